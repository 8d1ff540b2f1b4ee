"""The booth's own /dev: the few device nodes a program needs, and nothing of the host's.

Built as bubblewrap's `--dev` builds it: a small fresh tmpfs over /dev (nosuid, nodev, noexec,
0755) holding bind mounts of the host's null, zero, full, random, urandom and tty nodes (a bind
mount of a device node works in a user namespace, where mknod does not), a new devpts instance
(its own pty numbers; /dev/ptmx points into it), a private sized tmpfs at /dev/shm, the
/dev/fd, stdin, stdout, stderr links, and the booth's pty as /dev/console when it has one. No
disk, loop, kvm, userfaultfd, vsock, kmsg, mem, fuse or other host pty is reachable by name; a
file descriptor the command already holds (the pty slave the supervisor opened for it) keeps
working, since nothing here closes it.
"""

from __future__ import annotations

import contextlib
import os

from jukebox.booth import isolation

DEV = "/dev"
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
SYMLINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
    "ptmx": "pts/ptmx",
}
# Each pty the command opens gets its own node on the new devpts instance; `mode` is the
# slaves' (owner rw, group w: what `write`/`wall` expect), `ptmxmode` lets any uid open one.
DEVPTS_OPTIONS = "newinstance,ptmxmode=0666,mode=0620"


def clone_device_nodes(terminal_fd: int | None = None) -> dict[str, int]:
    """Detached bind mounts of the host's device nodes, taken before /dev is covered (and
    before the host view is made nodev, which the clones must not inherit).

    With `terminal_fd` (the booth's pty, opened by the supervisor on the host's devpts), its
    node becomes /dev/console, as bubblewrap does: the command's own terminal, nothing more,
    and what lets ttyname(3) name it (glibc searches /dev for the node when the name it had on
    the host, /dev/pts/N, is not in this devpts instance).
    """
    clones: dict[str, int] = {}
    for name in DEVICES:
        path = os.path.join(DEV, name)
        if os.path.exists(path):
            clones[name] = isolation.open_tree_clone(path)
    if terminal_fd is not None:
        with contextlib.suppress(OSError):
            path = os.ttyname(terminal_fd)
            held, named = os.fstat(terminal_fd), os.stat(path)
            # The same node, reached by a path in this mount namespace (a bind of the fd's own
            # mount would be refused: it belongs to the supervisor's namespace).
            if (held.st_rdev, held.st_ino, held.st_dev) == (
                named.st_rdev,
                named.st_ino,
                named.st_dev,
            ):
                clones["console"] = isolation.open_tree_clone(path)
    return clones


def mount_private_dev(clones: dict[str, int], shm_size: int) -> None:
    """Covers /dev with the minimal tree; consumes `clones` (closes every fd)."""
    try:
        isolation.mount(
            "tmpfs",
            DEV,
            "tmpfs",
            isolation.MS_NOSUID | isolation.MS_NODEV | isolation.MS_NOEXEC,
            "mode=0755,size=64k,nr_inodes=64",
        )
        for name, fd in clones.items():
            node = os.path.join(DEV, name)
            os.close(os.open(node, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666))
            isolation.move_mount(fd, node)
            isolation.mount_setattr(node, isolation.MOUNT_ATTR_NOSUID | isolation.MOUNT_ATTR_NOEXEC)
        pts = os.path.join(DEV, "pts")
        os.mkdir(pts, 0o755)
        isolation.mount(
            "devpts", pts, "devpts", isolation.MS_NOSUID | isolation.MS_NOEXEC, DEVPTS_OPTIONS
        )
        shm = os.path.join(DEV, "shm")
        os.mkdir(shm, 0o1777)
        isolation.mount(
            "tmpfs",
            shm,
            "tmpfs",
            isolation.MS_NOSUID | isolation.MS_NODEV,
            f"mode=1777,size={shm_size}",
        )
        for name, target in SYMLINKS.items():
            os.symlink(target, os.path.join(DEV, name))
    finally:
        for fd in clones.values():
            with contextlib.suppress(OSError):
                os.close(fd)


def seal_private_dev() -> None:
    """Makes the /dev tmpfs itself read-only once everything that lives in it is in place:
    the nodes, pts and shm are mounts of their own and stay as they are."""
    isolation.mount_setattr(DEV, isolation.MOUNT_ATTR_RDONLY)
