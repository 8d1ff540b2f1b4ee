"""Prints the FUSE protocol version the running kernel offers (run as root inside a test VM).

The booth's invalidation path depends on it (protocol 7.38 brought FUSE_EXPIRE_ONLY), so each
kernel's report says which path its run took. Mounts an empty FUSE file system, reads the
kernel's INIT request, and unmounts without answering it.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile

from shadowfs.fuse_wire import EXPIRE_ONLY_MINOR, Channel

FUSE_INIT = 26
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad


def main() -> int:
    point = tempfile.mkdtemp(prefix="fuse-probe-")
    ch = Channel.open(point, fsname="probe", subtype="probe", allow_other=False)
    try:
        buf = os.read(ch.fd, 1 << 21)
    finally:
        os.system(f"umount -l {point}")
        os.close(ch.fd)
        os.rmdir(point)
    opcode = IN_HEADER.unpack_from(buf)[1]
    if opcode != FUSE_INIT:
        print(f"fuse protocol unknown (first request was opcode {opcode})")
        return 1
    major, minor = struct.unpack_from("<II", buf, IN_HEADER.size)
    path = "expires entries" if minor >= EXPIRE_ONLY_MINOR else "drops entries (pre-7.38 path)"
    print(f"fuse protocol {major}.{minor}: invalidation {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
