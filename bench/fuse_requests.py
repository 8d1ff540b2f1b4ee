"""The FUSE requests a workload sends to shadowfs-fuse, by kind, and the CPU the serving threads
took: `python -m bench.fuse_requests create,untar` (ids of bench.fs_workloads; root).

A measuring tool, not a group of the suite: each workload runs once on a fresh shadowfs-fuse
mount, as the fs suite runs it (same fixtures, set-up and timing), with `shadowfs.fuse.Server`'s
request dispatch wrapped to count opcodes. The kernel sends the same requests to fuse-overlayfs
for a workload, except OPEN, FLUSH and RELEASE, which the booth's mount answers ENOSYS once
("zero-message opens", docs/architecture.md). CPU is per thread of this process while the
workload ran (the FUSE workers, the scratch worker that pre-creates staged files), from
/proc/self/task, in clock ticks turned into milliseconds.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from bench import backends as bk
from bench import fs_workloads as fw
from bench import scratch_fs
from shadowfs import fuse
from shadowfs import fuse_wire as w

_OPCODES = [
    "LOOKUP", "FORGET", "GETATTR", "SETATTR", "READLINK", "SYMLINK", "MKNOD", "MKDIR", "UNLINK",
    "RMDIR", "RENAME", "LINK", "OPEN", "READ", "WRITE", "STATFS", "RELEASE", "FSYNC", "SETXATTR",
    "GETXATTR", "LISTXATTR", "REMOVEXATTR", "FLUSH", "INIT", "OPENDIR", "READDIR", "RELEASEDIR",
    "FSYNCDIR", "ACCESS", "CREATE", "INTERRUPT", "DESTROY", "BATCH_FORGET", "READDIRPLUS", "SYNCFS",
    "RENAME2",
]  # fmt: skip
# The kinds shadowfs.fuse_wire does not name (the server answers them ENOSYS).
NAMES = {getattr(w, n): n for n in _OPCODES} | {39: "IOCTL", 43: "FALLOCATE"}
_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def _threads_cpu() -> dict[int, tuple[str, float, float]]:
    """Native thread id -> (name, user ms, system ms) for this process's live threads."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[int, tuple[str, float, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "?")
        out[int(tid)] = (name, int(fields[11]) * _TICK_MS, int(fields[12]) * _TICK_MS)
    return out


def count(workload_ids: Sequence[str], quick: bool = False) -> list[dict[str, Any]]:
    """One row per workload: seconds, requests by kind, and CPU per serving thread; ``quick``:
    the fs suite's smaller fixtures."""
    counts: collections.Counter[int] = collections.Counter()
    serve = fuse.Server._serve

    def counting(self: fuse.Server, req: Any) -> bool:
        counts[w.IN_HEADER.unpack_from(req)[1]] += 1
        return serve(self, req)

    sizes = fw.Sizes.for_mode(quick)
    fx = fw.Fixtures(sizes)
    every = {x.id: x for x in fw.make_workloads(sizes)}
    rows = []
    fuse.Server._serve = counting  # type: ignore[method-assign]
    try:
        with scratch_fs.place(scratch_fs.TMP) as where:
            backend = bk.ShadowfsFuse(where.root)
            for wid in workload_ids:
                work = every[wid]
                with backend.prepare(where.lower(fx.lower(work.lower))) as mnt:
                    if work.setup is not None:
                        work.setup(mnt, fx)
                    os.sync()
                    counts.clear()
                    before = _threads_cpu()
                    seconds = work.run(mnt, fx)
                    after = _threads_cpu()
                    got = dict(counts)
                cpu = {}
                for tid, (name, user, system) in after.items():
                    _, user0, system0 = before.get(tid, (name, 0.0, 0.0))
                    if user - user0 + system - system0 > 0:
                        cpu[f"{name} ({tid})"] = (user - user0, system - system0)
                rows.append({"workload": wid, "seconds": seconds, "requests": got, "cpu_ms": cpu})
    finally:
        fuse.Server._serve = serve  # type: ignore[method-assign]
    return rows


def main(argv: Sequence[str]) -> int:
    known = [x.id for x in fw.make_workloads(fw.Sizes.for_mode(True))]
    wanted = [a.strip() for a in (argv[0] if argv else "").split(",") if a.strip()]
    unknown = [x for x in wanted if x not in known]
    if not wanted or unknown:
        print(f"usage: python -m bench.fuse_requests IDS (comma-separated: {', '.join(known)})",
              file=sys.stderr)  # fmt: skip
        return 2
    for row in count(wanted):
        reqs = row["requests"]
        kinds = ", ".join(f"{NAMES.get(op, op)} {n:,}" for op, n in
                          sorted(reqs.items(), key=lambda kv: -kv[1]))  # fmt: skip
        total = sum(reqs.values())
        print(f"{row['workload']}: {row['seconds']:.3f} s, {total:,} requests: {kinds}")
        for thread, (user, system) in sorted(row["cpu_ms"].items()):
            print(f"  {thread}: {user:.0f} ms user, {system:.0f} ms system")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
