"""Instructions per in-process snapshot, counted by valgrind: a figure this VM's noise cannot move.

    .venv/bin/python -m bench.snapshot_instructions [N_FILES] [STEPS]

Runs the in-process checkpoint loop of `bench.bench_checkpoint_fuse` (a 10-file step, then a
snapshot) under `valgrind --tool=cachegrind` twice, once with the snapshots and once without,
and prints the difference per snapshot. The background flush is off and the process ends without
the final drain, so only the snapshots' own work is counted; PYTHONHASHSEED is fixed, so two runs
of the same code agree to about 0.02%. Wall time on this VM moves by up to 2x between minutes;
this is how changes to the snapshot path are compared. Not part of `python -m bench`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from bench.fs_workloads import REPO_ROOT


def _loop(n_files: int, steps: int, snapshot: bool) -> None:
    import shadowfs.store as store_mod

    store_mod.Store.flush_soon = lambda self, delay=0: None  # type: ignore[method-assign]
    from bench.bench_checkpoint_fuse import _edit_in_process, _unmounted_layer

    with _unmounted_layer(n_files, "jukebox-bench-instr-") as (layer, paths):
        layer.snapshot(durable=False)
        for step in range(steps):
            _edit_in_process(layer, paths, 10, step)
            if snapshot:
                layer.snapshot(durable=False)
        # The caller removes the scratch directory, outside the count.
        print(os.path.dirname(layer.scratch_dir), flush=True)
        os._exit(0)  # no final drain: it would dwarf the snapshots in the count


def _count(n_files: int, steps: int, snapshot: bool) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, "-m", "bench.snapshot_instructions", "loop", str(n_files), str(steps),
         "1" if snapshot else "0"],
        capture_output=True, text=True, env=env,
    )
    scratch = proc.stdout.strip().splitlines()[-1:]
    if scratch and os.path.basename(scratch[0]).startswith("jukebox-bench-instr-"):
        shutil.rmtree(scratch[0], ignore_errors=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"valgrind run failed: {proc.stderr.strip()[-400:]}")
    return int(found.group(1).replace(",", ""))


def main(argv: list[str]) -> int:
    if argv[:1] == ["loop"]:
        _loop(int(argv[1]), int(argv[2]), argv[3] == "1")
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is missing; install it: apt-get install valgrind", file=sys.stderr)
        return 2
    try:
        n_files = int(argv[0]) if argv else 1000
        steps = int(argv[1]) if len(argv) > 1 else 100
    except ValueError:
        print(f"expected N_FILES and STEPS as numbers, got {' '.join(argv)!r}", file=sys.stderr)
        return 2
    with_snapshots = _count(n_files, steps, True)
    edits_only = _count(n_files, steps, False)
    per = (with_snapshots - edits_only) / steps
    print(f"{per / 1e6:.3f}M instructions per 10-file snapshot ({n_files:,}-file tree, "
          f"{steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
