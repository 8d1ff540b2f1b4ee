"""A layer's changes built into trees once its writes stop, before the snapshot that names them.

An agent in a booth writes in steps and asks for a checkpoint between them, often after a wait
(its model answering). Most of a snapshot's own work, reading, hashing and staging each changed
file and then each changed directory's tree, can be done in that wait: once `quiet` seconds
pass with nothing recorded in the layer's journal, `Layer.fold` builds the trees, and the
snapshot that follows finds only its journal left to store. After a pause the snapshot's code
runs from cold caches, and the less of it there is, the less that costs.

What this costs: a file changed again after the fold and before the snapshot is hashed and
staged twice (the first version's objects stay in the store, unnamed, until a gc removes them);
a layer written without a pause of `quiet` seconds is never folded early. The fold takes the
layer's lock like any request (`Layer.fold` goes through the mount), so it never races a write.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

# How long the layer must go without a recorded change before its changes are folded: longer
# than the gaps between one step's writes, shorter than a model's answer.
QUIET = 0.05


class QuietFold:
    """Folds `layer`'s changes (`fold`, by default `layer.fold`) once its journal has been
    still for `quiet` seconds, each time the layer has changes again. start() after the mount
    serves the layer, close() before it stops."""

    def __init__(
        self, layer: Any, quiet: float = QUIET, fold: Callable[[], None] | None = None
    ) -> None:
        self._layer = layer
        self._quiet = quiet
        self._fold = fold or layer.fold
        self._cond = threading.Condition()
        self._armed = True  # the layer may hold changes already
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="shadowfs-quiet-fold", daemon=True)

    def start(self) -> QuietFold:
        self._layer.on_dirty = self.arm
        self._thread.start()
        return self

    def arm(self) -> None:
        """The layer has changes again (`Layer.on_dirty`: on a mount's worker, under the layer
        lock, so this only notifies)."""
        with self._cond:
            if not self._armed:
                self._armed = True
                self._cond.notify()

    def close(self) -> None:
        """Stop folding; returns once no fold runs."""
        if self._layer.on_dirty == self.arm:
            self._layer.on_dirty = None
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        journal = self._layer.journal
        cond = self._cond
        while True:
            with cond:
                while not self._armed and not self._closing:
                    cond.wait()
                self._armed = False
                # Until `quiet` seconds pass with nothing recorded.
                seen = -1
                while not self._closing and journal.changes != seen:
                    seen = journal.changes
                    cond.wait(self._quiet)
                if self._closing:
                    return
            if self._layer.root.dirty_names:
                # The snapshot folds what this could not, and its caller hears why.
                with contextlib.suppress(Exception):
                    self._fold()
