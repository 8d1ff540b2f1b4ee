"""The FUSE kernel protocol: opcodes, message layouts, and a channel to /dev/fuse.

The layouts follow <linux/fuse.h> (protocol 7.x as the kernel offers it at INIT). This module
knows nothing of layers: it mounts, reads raw requests, writes replies and notifications, and
tears the connection down. `shadowfs.fuse` serves a layer on top of it.

Why not pyfuse3 for the booth mount: pyfuse3 (over libfuse) hands ``read``, ``write`` and
``readdir`` only a file handle, never the inode, and cannot set ``FOPEN_CACHE_DIR``. Without
those, the kernel must send OPEN and RELEASE around every file access and re-read every
directory listing from the daemon, which is most of the requests of ``grep -r``, a warm tree
walk or ``git status``. Speaking the protocol directly lets the booth answer OPEN and OPENDIR
with ENOSYS ("zero-message opens", kernel 4.x+ for files, 5.1+ for directories): the kernel then
keeps page cache and directory listings cached across opens and sends no OPEN, RELEASE or
FLUSH at all. The read-only view (`shadowfs.view`) still uses pyfuse3.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import socket
import struct
from collections.abc import Iterable

from shadowfs.libc import libc as _libc

# ------------------------------------------------------------------ opcodes

LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
ACCESS = 34
CREATE = 35
INTERRUPT = 36
DESTROY = 38
BATCH_FORGET = 42
READDIRPLUS = 44
RENAME2 = 45
SYNCFS = 50

NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3

# ------------------------------------------------------------------ INIT flags

ASYNC_READ = 1 << 0
BIG_WRITES = 1 << 5
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
PARALLEL_DIROPS = 1 << 18
ABORT_ERROR = 1 << 21
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
EXPLICIT_INVAL_DATA = 1 << 25
HANDLE_KILLPRIV_V2 = 1 << 28

# ------------------------------------------------------------------ setattr valid bits

FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8
FATTR_KILL_SUIDGID = 1 << 11

WRITE_KILL_SUIDGID = 1 << 2

# ------------------------------------------------------------------ layouts

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
IN_HEADER_UNIQUE = struct.Struct("<8xQ")  # just the unique
IN_HEADER_SIZE = IN_HEADER.size  # 40
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
OUT_HEADER_SIZE = OUT_HEADER.size  # 16
# ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink uid gid rdev
# blksize flags
_ATTR_FIELDS = "QQQQQQIIIIIIIIII"
ATTR = struct.Struct("<" + _ATTR_FIELDS)
# fuse_entry_out: nodeid generation entry_valid attr_valid entry_valid_nsec attr_valid_nsec attr
ENTRY_ATTR = struct.Struct("<QQQQII" + _ATTR_FIELDS)
# fuse_attr_out: attr_valid attr_valid_nsec dummy attr
ATTR_OUT_ATTR = struct.Struct("<QII" + _ATTR_FIELDS)
DIRENT_HEAD = struct.Struct("<QQII")  # ino off namelen type
INIT_IN = struct.Struct("<IIIII")  # major minor max_readahead flags flags2
# major minor max_readahead flags max_background congestion_threshold max_write time_gran
# max_pages map_alignment flags2, then 7 unused words
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")
# valid padding fh size lock_owner atime mtime ctime atimensec mtimensec ctimensec mode
# unused4 uid gid unused5
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
READ_IN = struct.Struct("<QQII")  # fh offset size flags (the rest is unused here)
WRITE_IN_SIZE = 40
MKNOD_IN = struct.Struct("<IIII")  # mode rdev umask padding
MKDIR_IN = struct.Struct("<II")  # mode umask
RENAME2_IN = struct.Struct("<QII")  # newdir flags padding
U64 = struct.Struct("<Q")
XATTR_IN = struct.Struct("<II")  # getxattr: size padding; setxattr: size flags
XATTR_OUT = struct.Struct("<II")
WRITE_OUT = struct.Struct("<II")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
# blocks bfree bavail files ffree bsize namelen frsize padding spare[6]
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
INVAL_INODE = struct.Struct("<Qqq")
INVAL_ENTRY = struct.Struct("<QII")
# fuse_notify_inval_entry_out.flags: expire the dentry instead of dropping it (protocol 7.38,
# kernel 6.2; earlier kernels read the field as padding and drop the dentry).
EXPIRE_ONLY = 1
EXPIRE_ONLY_MINOR = 38

MIN_MINOR = 31  # kernel 5.10: no_opendir, cache_readdir, max_pages, explicit data invalidation
MAX_PAGES_WANTED = 256
BUFFER_SIZE = MAX_PAGES_WANTED * 4096 + 4096


def name_arg(buf: bytes, start: int) -> tuple[bytes, int]:
    """The NUL-terminated name at ``start`` and the offset just after its NUL."""
    nul = buf.index(b"\0", start)
    return buf[start:nul], nul + 1


_PADS = tuple(b"\0" * i for i in range(8))


def dirent(ino: int, off: int, name: bytes, dtype: int) -> bytes:
    n = len(name)
    return DIRENT_HEAD.pack(ino, off, n, dtype) + name + _PADS[-(24 + n) % 8]


# ------------------------------------------------------------------ the channel

MS_NOSUID = 2
MS_NODEV = 4


class Channel:
    """One FUSE connection: the /dev/fuse fd of a mount at ``mountpoint``.

    `open` mounts: through mount(2) when this process may (root, or root of its user
    namespace), else through fusermount3, which passes the fd back over a socket. Replies and
    notifications are single writes; the kernel matches replies to requests by ``unique``, so
    any thread may reply to any request.
    """

    def __init__(self, fd: int, mountpoint: str) -> None:
        self.fd = fd
        self.mountpoint = mountpoint
        ensure_fusectl()
        # The connection's number in fusectl (the mount's device minor), read at mount time:
        # a stat of the mount point would wait for the answer to INIT.
        self.minor = _mount_minor(mountpoint)
        # Which connection that number names now: once the mount is gone its number passes to
        # the next FUSE mount on the machine (see `fusectl_identity`).
        self.fusectl_id = fusectl_identity(self.minor) if self.minor >= 0 else None
        # The protocol minor agreed at INIT (set by the server that answers it); 0 before.
        self.protocol_minor = 0

    @classmethod
    def open(cls, mountpoint: str, *, fsname: str, subtype: str, allow_other: bool) -> Channel:
        mountpoint = os.path.abspath(mountpoint)
        opts = ["default_permissions", *(["allow_other"] if allow_other else [])]
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        try:
            data = ",".join(
                [
                    f"fd={fd}",
                    f"rootmode={0o40000:o}",
                    f"user_id={os.getuid()}",
                    f"group_id={os.getgid()}",
                    *opts,
                ]
            )
            rc = _libc.mount(
                fsname.encode(),
                mountpoint.encode(),
                f"fuse.{subtype}".encode(),
                MS_NOSUID | MS_NODEV,
                data.encode(),
            )
            if rc != 0:
                err = ctypes.get_errno()
                if err != errno.EPERM:
                    raise OSError(err, f"mount: {os.strerror(err)}", mountpoint)
                os.close(fd)
                fd = -1
                fd = _fusermount(mountpoint, [*opts, f"fsname={fsname}", f"subtype={subtype}"])
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return cls(fd, mountpoint)

    def reply(self, unique: int, body: bytes = b"") -> None:
        os.write(self.fd, OUT_HEADER.pack(OUT_HEADER_SIZE + len(body), 0, unique) + body)

    def reply_parts(self, unique: int, parts: list[bytes]) -> None:
        size = OUT_HEADER_SIZE + sum(map(len, parts))
        os.writev(self.fd, [OUT_HEADER.pack(size, 0, unique), *parts])

    def reply_error(self, unique: int, err: int) -> None:
        os.write(self.fd, OUT_HEADER.pack(OUT_HEADER_SIZE, -err, unique))

    def _notify(self, code: int, body: bytes) -> None:
        os.write(self.fd, OUT_HEADER.pack(OUT_HEADER_SIZE + len(body), code, 0) + body)

    def invalidate_entry(self, parent: int, name: bytes) -> None:
        """Make the kernel ask LOOKUP again for ``name`` in ``parent`` at its next use, which
        drops the dentry if the name now leads elsewhere; ENOENT when it holds none. Blocks
        while the kernel holds the parent directory locked (a request in flight).

        Where the kernel can (`EXPIRE_ONLY_MINOR`), the dentry is only expired, not dropped
        at once: dropping it evicts its inode, and the FORGET for each woke a FUSE worker that
        then took turns with the invalidating thread for the interpreter (a 10-file rollback
        through the mount took 0.9-1.0 ms that way, 0.26-0.27 ms with the dentries expired)."""
        flags = EXPIRE_ONLY if self.protocol_minor >= EXPIRE_ONLY_MINOR else 0
        self._notify(NOTIFY_INVAL_ENTRY, INVAL_ENTRY.pack(parent, len(name), flags) + name + b"\0")

    def invalidate_inode(self, ino: int, *, attr_only: bool) -> None:
        """Drop the kernel's attributes of ``ino`` (and its cached pages unless ``attr_only``)."""
        self._notify(NOTIFY_INVAL_INODE, INVAL_INODE.pack(ino, -1 if attr_only else 0, 0))

    def abort(self) -> None:
        """End the connection: readers blocked on the fd wake with ENODEV, users of the mount
        get ENOTCONN. Through fusectl (`ensure_fusectl`); quiet when it is not available, and
        when the connection has ended already (its number may be another mount's by then)."""
        if self.minor < 0 or self.fusectl_id is None:
            return
        with contextlib.suppress(OSError):
            abort_connection(self.minor, self.fusectl_id)

    def requests_waiting(self) -> int | None:
        """How many requests the kernel has sent or queued that are not answered yet (fusectl's
        ``waiting``; writeback included); None when fusectl is not available. By number, without
        `abort`'s check: it is asked while the mount serves, when the number is this one's, and
        a wrong count could only cost or spare a barrier round trip."""
        if self.minor < 0:
            return None
        try:
            # fusectl files cannot seek: each reading opens the file anew.
            fd = os.open(self._fusectl("waiting"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return int(os.read(fd, 32))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def _fusectl(self, name: str) -> str:
        """This connection's file ``name`` in fusectl."""
        return f"{FUSECTL}/{self.minor}/{name}"

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


FUSECTL = "/sys/fs/fuse/connections"
_fusectl_tried = False


def ensure_fusectl() -> bool:
    """Whether fusectl is mounted, mounting it once per process when it is not and this process
    may (root). systemd mounts it at boot on most distributions, but a minimal machine or a
    container may not: without it a connection cannot be aborted (a stop would wait for every
    process still inside the mount) and a checkpoint cannot skip its barrier round trip."""
    global _fusectl_tried
    if os.path.ismount(FUSECTL):
        return True
    if _fusectl_tried or not os.path.isdir(FUSECTL):
        return False
    _fusectl_tried = True
    return bool(_libc.mount(b"fusectl", FUSECTL.encode(), b"fusectl", 0, None) == 0)


def fusectl_identity(minor: int) -> tuple[int, int] | None:
    """(device, inode) of FUSE connection ``minor``'s directory in fusectl, or None when there
    is none. The number is the mount's device minor, which the kernel hands to the next mount
    once this one's super block is gone: an abort by number alone, sent late (after a lazy
    unmount, from a thread that outlived its mount), ended whichever mount had it by then. Each
    connection's directory is a new inode, so the pair names one connection."""
    try:
        st = os.stat(f"{FUSECTL}/{minor}")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def abort_connection(minor: int, identity: tuple[int, int]) -> bool:
    """Abort FUSE connection ``minor`` if it is still the one ``identity`` (`fusectl_identity`)
    was taken of; False when that connection is gone. The directory stays open from the check
    to the write: if the connection ends in between, its ``abort`` file is gone with it
    (ENOENT), and a stale ``abort`` file does nothing. OSError when fusectl refuses."""
    try:
        dfd = os.open(f"{FUSECTL}/{minor}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        st = os.fstat(dfd)
        if (st.st_dev, st.st_ino) != identity:
            return False
        try:
            fd = os.open("abort", os.O_WRONLY | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            return False
        try:
            os.write(fd, b"1")
        finally:
            os.close(fd)
        return True
    finally:
        os.close(dfd)


def _mount_minor(mountpoint: str) -> int:
    """The device minor of the newest mount at ``mountpoint``, from /proc/self/mountinfo."""
    minor = -1
    want = os.fsencode(mountpoint)
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split(b" ", 5)
            # Spaces, tabs, newlines and backslashes in mount points are escaped as \ooo.
            point = _OCTAL.sub(lambda m: bytes([int(m[1], 8)]), fields[4])
            if point == want:
                minor = int(fields[2].split(b":")[1])
    return minor


_OCTAL = re.compile(rb"\\([0-7]{3})")


def _fusermount(mountpoint: str, opts: Iterable[str]) -> int:
    """Mount through the setuid fusermount3 helper and receive the /dev/fuse fd from it."""
    import shutil  # with bz2 and lzma: a mount as root (a booth's) never runs the helper

    tool = shutil.which("fusermount3")
    if tool is None:
        raise OSError(errno.EPERM, "mounting needs root or fusermount3 (apt-get install fuse3)")
    import subprocess  # not at the top: a mount as root (a booth's) never runs the helper

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        proc = subprocess.Popen(
            [tool, "-o", ",".join(opts), "--", mountpoint],
            env=env,
            pass_fds=[theirs.fileno()],
            stderr=subprocess.PIPE,
        )
        theirs.close()
        _, fds, _, _ = socket.recv_fds(mine, 1, 1)
        _, err = proc.communicate(timeout=30)
        if not fds:
            detail = err.decode(errors="replace").strip() or f"exit {proc.returncode}"
            raise OSError(errno.EPERM, f"fusermount3 failed: {detail}", mountpoint)
        return fds[0]
    finally:
        mine.close()
        with contextlib.suppress(OSError):
            theirs.close()
