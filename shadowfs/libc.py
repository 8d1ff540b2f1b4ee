"""The C library's calls that Python's os module lacks, declared once for every caller.

mount(2), umount2(2), unshare(2), setns(2), syncfs(2), sync_file_range(2), prctl(2),
capget(2)/capset(2), fstatfs(2) (for its f_type, which os.statvfs lacks) and syscall(2) for the
ones libc does not wrap (mount_setattr, open_tree, move_mount, keyctl). One handle with each
function's argument types set here, so that a call cannot pass what another module declared
differently; errno is kept per thread (`use_errno`): read it with `ctypes.get_errno()` right
after a call that failed, or let `check` raise it.
"""

from __future__ import annotations

import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)

_char_p, _int, _uint, _ulong = ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_ulong
libc.mount.argtypes = [_char_p, _char_p, _char_p, _ulong, _char_p]
libc.umount2.argtypes = [_char_p, _int]
libc.unshare.argtypes = [_int]
libc.setns.argtypes = [_int, _int]
libc.syncfs.argtypes = [_int]
libc.sync_file_range.argtypes = [_int, ctypes.c_int64, ctypes.c_int64, _uint]
# prctl is variadic: every argument as a full unsigned long, as the kernel reads them, so a
# pointer goes as its address (ctypes.addressof) and unused ones as 0.
libc.prctl.argtypes = [_int, _ulong, _ulong, _ulong, _ulong]
libc.syscall.restype = ctypes.c_long
libc.fstatfs.argtypes = [_int, ctypes.c_void_p]

# struct statfs is at most 120 bytes on every 64-bit Linux; f_type is its first field, a long.
_STATFS_SIZE = 256


def check(result: int, what: str) -> int:
    """`result` when the call succeeded, else OSError(errno, "WHAT: strerror")."""
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def fstatfs_type(fd: int) -> int:
    """The f_type of the file system holding ``fd`` (fstatfs(2)): its magic number."""
    buf = ctypes.create_string_buffer(_STATFS_SIZE)
    check(libc.fstatfs(fd, buf), "fstatfs")
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
