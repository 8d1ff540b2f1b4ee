"""The systems under test for the fs workload suite, each a fresh mount over a read-only lower dir.

A backend is a context manager factory: `with backend.prepare(lower) as mnt:` yields a directory
whose contents start equal to `lower`; everything written goes to scratch space that is removed on
exit, and `lower` itself is never modified (so fixtures can be cached and shared). Backends that
cannot run here say why through `unavailable()` instead of raising, so a report still has a row.

The two shadowfs backends are looked up lazily through the hook functions near the bottom
(`shadowfs_fuse_helper`, `shadowfs_overlay_helper`): they are written alongside this suite, and a
missing or broken module makes them "not available yet" rather than crashing the run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

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


# (lower, mountpoint, state) -> a context manager serving the booth at mountpoint
MountHelper = Callable[[Path, Path, Path], AbstractContextManager[Path]]


class _Hooked(Backend):
    """A shadowfs backend reached through a hook function that may not be importable yet."""

    load_helper: Callable[[], MountHelper]

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
        with type(self).load_helper()(lower, mnt, state) as served:
            yield served


# ----------------------------------------------------------------------------------------------
# HOOKS(lead): the shadowfs backends, wired to the APIs as they landed. Each hook imports what it
# needs (an ImportError here makes the backend "not available yet", a row with a note) and
# returns `mounted(lower, mountpoint, state)`: a context manager that sets up a booth over
# `lower` with its store and scratch under `state`, serves it at `mountpoint`, and tears it all
# down on exit. Set-up (opening the store, building the base tree) is not timed. If the shadowfs
# APIs change, adapt these two functions only. The timed workloads run in child processes, so
# the FUSE thread living in the harness process is not slowed by the harness holding the GIL.
# ----------------------------------------------------------------------------------------------


def shadowfs_fuse_helper() -> MountHelper:
    """shadowfs.layer.Layer served by shadowfs.mountctl (own FUSE server, in-process threads)."""
    from shadowfs.layer import Layer
    from shadowfs.mountctl import mounted as serve
    from shadowfs.store import Store

    @contextlib.contextmanager
    def mounted(lower: Path, mountpoint: Path, state: Path) -> Iterator[Path]:
        with Store.open(state / "store", create=True) as store:
            layer = Layer(lower, store, state / "scratch")
            try:
                with serve(layer, mountpoint):
                    yield mountpoint
            finally:
                layer.close()

    return mounted


def shadowfs_overlay_helper() -> MountHelper:
    """shadowfs.overlay.OverlayLayer: kernel overlayfs with the booth's own mount options."""
    from shadowfs.overlay import OverlayLayer
    from shadowfs.store import Store

    @contextlib.contextmanager
    def mounted(lower: Path, mountpoint: Path, state: Path) -> Iterator[Path]:
        with Store.open(state / "store", create=True) as store:
            layer = OverlayLayer(lower, store, state / "booth")
            layer.mount(mountpoint)
            try:
                yield mountpoint
            finally:
                layer.discard()

    return mounted


class ShadowfsFuse(_Hooked):
    name = SHADOWFS_FUSE
    description = (
        "shadowfs.layer.Layer served by shadowfs.fuse (own FUSE protocol server, in-process "
        "threads, zero-message opens)"
    )
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
