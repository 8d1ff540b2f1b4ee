"""The systems under test for the fs workload suite, each a fresh mount over a read-only lower dir.

A backend is a context manager factory: `with backend.prepare(lower) as mnt:` yields a directory
whose contents start equal to `lower`; everything written goes to scratch space that is removed on
exit, and `lower` itself is never modified (so fixtures can be cached and shared). Backends that
cannot run here say why through `unavailable()` instead of raising, so a report still has a row.

The two shadowfs backends are looked up lazily through the hook functions at the bottom
(`shadowfs_fuse_mount`, `shadowfs_overlay_mount`): they are written alongside this suite and may
not exist yet.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

NATIVE = "native"
KERNEL_OVERLAY = "kernel-overlay"
FUSE_OVERLAYFS = "fuse-overlayfs"
SHADOWFS_FUSE = "shadowfs-fuse"
SHADOWFS_OVERLAY = "shadowfs-overlay"
ALL = (NATIVE, KERNEL_OVERLAY, FUSE_OVERLAYFS, SHADOWFS_FUSE, SHADOWFS_OVERLAY)


class BackendError(RuntimeError):
    """A mount or unmount failed; the message names the command and its stderr."""


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().replace("\n", " ")
        raise BackendError(f"{what} failed ({' '.join(cmd)}): {detail or proc.returncode}")


def unmount(mountpoint: Path) -> None:
    """Unmounts, waiting out a briefly busy mount (a child still closing files), then lazily."""
    for _ in range(20):
        if not os.path.ismount(mountpoint):
            return
        proc = subprocess.run(["umount", str(mountpoint)], capture_output=True, text=True)
        if proc.returncode == 0:
            return
        time.sleep(0.05)
    # A wedged daemon must not leave the benchmark hanging on a stale mount.
    subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class Backend:
    """One system under test. Subclasses implement `_mount` and optionally `_probe`."""

    name: str = "?"
    description: str = ""

    def __init__(self, scratch_root: Path) -> None:
        self.scratch_root = scratch_root
        self._reason: str | bool | None = False  # False: not probed yet

    def unavailable(self) -> str | None:
        """None when the backend can run here, else one sentence saying why not (cached)."""
        if self._reason is False:
            try:
                self._reason = self._probe()
            except Exception as exc:  # a probe that blows up means "cannot run", not a crash
                self._reason = f"{type(exc).__name__}: {exc}"
        return self._reason  # type: ignore[return-value]

    def _probe(self) -> str | None:
        return None

    @contextlib.contextmanager
    def prepare(self, lower: Path) -> Iterator[Path]:
        """A fresh mount whose contents start equal to `lower`; all scratch goes away on exit."""
        scratch = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=self.scratch_root))
        try:
            with self._mount(Path(lower), scratch) as mnt:
                yield mnt
        finally:
            _rmtree(scratch)

    def _mount(self, lower: Path, scratch: Path) -> AbstractContextManager[Path]:
        raise NotImplementedError


class Native(Backend):
    name = NATIVE
    description = "a plain directory on the scratch file system (a copy of the lower dir)"

    @contextlib.contextmanager
    def _mount(self, lower: Path, scratch: Path) -> Iterator[Path]:
        tree = scratch / "tree"
        # cp -a keeps modes and mtimes, so tools that compare stat data (git) see the same tree.
        _run(["cp", "-a", "--", str(lower), str(tree)], "copying the lower dir")
        yield tree


def _overlay_dirs(scratch: Path) -> tuple[Path, Path, Path]:
    upper, work, mnt = scratch / "upper", scratch / "work", scratch / "mnt"
    for d in (upper, work, mnt):
        d.mkdir()
    return upper, work, mnt


class KernelOverlay(Backend):
    name = KERNEL_OVERLAY
    description = "mount -t overlay, upper and work dirs on the scratch file system"

    def _probe(self) -> str | None:
        if os.geteuid() != 0:
            return "needs root to mount -t overlay."
        probe = Path(tempfile.mkdtemp(prefix="probe-", dir=self.scratch_root))
        try:
            (probe / "lower").mkdir()
            with self._mount(probe / "lower", probe):
                pass
        except BackendError as exc:
            return str(exc)
        finally:
            _rmtree(probe)
        return None

    @contextlib.contextmanager
    def _mount(self, lower: Path, scratch: Path) -> Iterator[Path]:
        upper, work, mnt = _overlay_dirs(scratch)
        opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
        _run(["mount", "-t", "overlay", "overlay", "-o", opts, str(mnt)], "mount -t overlay")
        try:
            yield mnt
        finally:
            unmount(mnt)


class FuseOverlayfs(Backend):
    name = FUSE_OVERLAYFS
    description = "the fuse-overlayfs C daemon (default options)"

    def _probe(self) -> str | None:
        if shutil.which("fuse-overlayfs") is None:
            return (
                "the fuse-overlayfs binary is missing; install it: apt-get install fuse-overlayfs."
            )
        if not os.path.exists("/dev/fuse"):
            return "/dev/fuse is missing; load the fuse module or run with --device /dev/fuse."
        return None

    @contextlib.contextmanager
    def _mount(self, lower: Path, scratch: Path) -> Iterator[Path]:
        upper, work, mnt = _overlay_dirs(scratch)
        opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
        # The binary daemonizes once the mount is live, so returning means ready.
        _run(["fuse-overlayfs", "-o", opts, str(mnt)], "fuse-overlayfs")
        try:
            yield mnt
        finally:
            unmount(mnt)


class _Hooked(Backend):
    """A shadowfs backend reached through a hook function that may not be importable yet."""

    load_helper: Callable[[], Callable[..., AbstractContextManager[Any]]]

    def _probe(self) -> str | None:
        try:
            type(self).load_helper()
        except Exception as exc:  # ImportError, or a module that fails half-way through import
            return f"not available yet: {type(exc).__name__}: {exc}".replace("\n", " ")
        return None

    @contextlib.contextmanager
    def _mount(self, lower: Path, scratch: Path) -> Iterator[Path]:
        mnt, state = scratch / "mnt", scratch / "state"
        mnt.mkdir()
        state.mkdir()
        with _call_helper(type(self).load_helper(), lower, mnt, state) as yielded:
            # A helper that picks its own mount point says so by yielding it.
            yield Path(yielded) if isinstance(yielded, (str, os.PathLike)) else mnt


# ----------------------------------------------------------------------------------------------
# HOOKS(lead): the shadowfs backends. Each hook returns the mount helper: a callable returning a
# context manager that serves `lower` at `mountpoint` (scratch state under `state`) and unmounts
# on exit. `_call_helper` maps the helper's parameter names onto (lower, mountpoint, state). When
# shadowfs.fuse / shadowfs.overlay land with another name or signature, adapt these hooks only.
# The timed workloads run in child processes, so an in-process (threaded) daemon is not slowed
# down by the harness holding the GIL.
# ----------------------------------------------------------------------------------------------


def shadowfs_fuse_helper() -> Callable[..., AbstractContextManager[Any]]:
    from shadowfs.fuse import mounted

    return mounted


def shadowfs_overlay_helper() -> Callable[..., AbstractContextManager[Any]]:
    try:
        from shadowfs.overlay import mounted  # a ready-made helper wins once it exists
    except ImportError:
        return _overlay_layer_mounted()
    return mounted


def _overlay_layer_mounted() -> Callable[[Path, Path, Path], AbstractContextManager[Path]]:
    """The booth's set-up on shadowfs.overlay.OverlayLayer: a store, the base tree, the mount."""
    from shadowfs.overlay import OverlayLayer
    from shadowfs.store import Store

    @contextlib.contextmanager
    def mounted(lower: Path, mountpoint: Path, state: Path) -> Iterator[Path]:
        with Store.open(state / "store", create=True) as store:
            layer = OverlayLayer(lower, store, state / "booth")  # builds the base tree: untimed
            layer.mount(mountpoint)
            try:
                yield mountpoint
            finally:
                layer.discard()

    return mounted


_LOWER_NAMES = ("base", "lower", "lower_dir", "base_dir", "tree", "root", "source")
_MNT_NAMES = ("mountpoint", "mount_point", "mnt", "target", "where")
_STATE_NAMES = ("state", "booth", "booth_dir", "state_dir", "layer_dir", "scratch", "upper", "work")


def _call_helper(
    helper: Callable[..., AbstractContextManager[Any]], lower: Path, mnt: Path, state: Path
) -> AbstractContextManager[Any]:
    """Calls a mount helper by its parameter names when they are recognisable, else positionally."""
    try:
        params = list(inspect.signature(helper).parameters.values())
    except (TypeError, ValueError):
        return helper(lower, mnt, state)
    kwargs: dict[str, Path] = {}
    for p in params:
        name = p.name.lower()
        if name in _LOWER_NAMES:
            kwargs[p.name] = lower
        elif name in _MNT_NAMES:
            kwargs[p.name] = mnt
        elif name in _STATE_NAMES:
            kwargs[p.name] = state
        elif name in ("store", "store_dir", "store_path"):
            kwargs[p.name] = state / "store"
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if all(p.name in kwargs for p in required) and kwargs:
        return helper(**kwargs)
    positional = [lower, mnt, state][: max(len(required), 2)]
    return helper(*positional)


class ShadowfsFuse(_Hooked):
    name = SHADOWFS_FUSE
    description = "shadowfs pyfuse3 layer (shadowfs.fuse.mounted)"
    load_helper = staticmethod(shadowfs_fuse_helper)


class ShadowfsOverlay(_Hooked):
    name = SHADOWFS_OVERLAY
    description = "shadowfs.overlay.OverlayLayer on kernel OverlayFS (its own mount options)"
    load_helper = staticmethod(shadowfs_overlay_helper)


_CLASSES: dict[str, type[Backend]] = {
    NATIVE: Native,
    KERNEL_OVERLAY: KernelOverlay,
    FUSE_OVERLAYFS: FuseOverlayfs,
    SHADOWFS_FUSE: ShadowfsFuse,
    SHADOWFS_OVERLAY: ShadowfsOverlay,
}


def backends(scratch_root: Path, names: list[str] | None = None) -> list[Backend]:
    """The backends to run, in report order; unknown names are a usage error."""
    chosen = names or list(ALL)
    unknown = [n for n in chosen if n not in _CLASSES]
    if unknown:
        raise ValueError(
            f"unknown fs backend(s) {', '.join(unknown)}; choose from {', '.join(ALL)}."
        )
    return [_CLASSES[n](scratch_root) for n in ALL if n in chosen]
