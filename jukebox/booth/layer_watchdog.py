"""The supervisor's watchdog over its own FUSE layer.

The supervisor still waits on its layer in a few places of its own making: the syncfs and
STATFS before a snapshot, the kernel invalidations after a restore. Those wait for the layer's
workers; should the workers stop answering (a bug, a base tree on a dead network file system),
the waiting thread is stuck in the kernel, where no signal reaches it — and the main thread
waits for signals only between such calls, so Ctrl-C would go unanswered.

`LayerWatchdog` runs one thread. While a thread of the supervisor is inside `blocking(what)`,
the watchdog aborts the layer's FUSE connection (its fusectl `abort` file) when requests to the
layer are outstanding and either the call has lasted `limit` seconds, or an interrupt
(SIGINT, SIGTERM, SIGHUP) is pending and the call has lasted `interrupt_grace` seconds. The
blocked call then fails, and `blocking` raises one `LayerStuck` naming what hung. Outside such
calls it does nothing: the agent's own requests may take as long as they take.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from types import TracebackType

from jukebox.booth import fusectl
from jukebox.booth.control import _quickline
from jukebox.errors import JukeboxError

STUCK_SECONDS = 120.0
INTERRUPT_GRACE = 2.0
INTERRUPTS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
POLL = 0.25


class LayerStuck(JukeboxError):
    exit_code = 1


class LayerWatchdog:
    def __init__(
        self,
        connection: int,
        *,
        limit: float = STUCK_SECONDS,
        interrupt_grace: float = INTERRUPT_GRACE,
    ) -> None:
        self.connection = connection
        # Taken now, while the layer is mounted: the unmount runs inside `blocking`, and once
        # the mount is gone its number may be the next FUSE mount's (another booth's), which
        # the watchdog must then neither count nor abort.
        self._identity = fusectl.fusectl_identity(connection)
        self.limit = limit
        self.interrupt_grace = interrupt_grace
        self.fired: str | None = None
        self._calls: dict[int, tuple[str, float]] = {}  # thread id -> (what, since)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="layer-watchdog", daemon=True)

    def start(self) -> LayerWatchdog:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def blocking(self, what: str) -> _Blocking:
        """Marks the calling thread as waiting on the layer for `what` (nestable)."""
        return _Blocking(self, what)

    def _watch(self) -> None:
        while not self._stop.wait(POLL):
            with self._lock:
                calls = list(self._calls.values())
            if _quickline is not None:
                # A checkpoint's syncfs in the control socket's compiled path (its `serve`).
                since = _quickline.syncing(self.connection)
                if since is not None:
                    calls.append(("a checkpoint's syncfs", since))
            if not calls or self.fired is not None:
                continue
            what, since = min(calls, key=lambda call: call[1])
            lasted = time.monotonic() - since
            interrupted = bool(INTERRUPTS & signal.sigpending())
            due = lasted >= self.limit or (interrupted and lasted >= self.interrupt_grace)
            identity = self._identity
            if not due or identity is None or fusectl.waiting(self.connection, identity) == 0:
                continue
            cause = "an interrupt" if interrupted and lasted < self.limit else f"{lasted:.0f} s"
            self.fired = (
                f"the booth's FUSE layer stopped answering ({what} waited, {cause}): its "
                f"connection {self.connection} was aborted and the "
                "agent stopped; the real tree was not touched"
            )
            with contextlib.suppress(OSError):
                if not fusectl.abort_connection(self.connection, identity):
                    self.fired = None  # that connection ended meanwhile: nothing to free


class _Blocking:
    """`LayerWatchdog.blocking`'s section. A class, not a generator: every checkpoint enters one,
    and on a request that runs cold (after the agent's pause) each frame of contextlib's
    machinery costs tens of µs."""

    __slots__ = ("_ident", "_outer", "_watchdog", "_what")

    def __init__(self, watchdog: LayerWatchdog, what: str) -> None:
        self._watchdog = watchdog
        self._what = what

    def __enter__(self) -> None:
        watchdog = self._watchdog
        self._ident = ident = threading.get_ident()
        with watchdog._lock:
            self._outer = watchdog._calls.get(ident)
            if self._outer is None:
                watchdog._calls[ident] = (self._what, time.monotonic())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        watchdog = self._watchdog
        if self._outer is None:
            with watchdog._lock:
                watchdog._calls.pop(self._ident, None)
        fired = watchdog.fired
        if fired is None:
            return
        if error is None:
            raise LayerStuck(fired)
        if isinstance(error, Exception):
            raise LayerStuck(fired) from error
