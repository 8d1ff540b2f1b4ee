"""Benchmarks for Jukebox, run side by side in one process: `python -m bench`.

Every `bench/bench_*.py` module exposes `run(quick: bool = False) -> list[dict]`; the harness
(`bench.harness`) discovers them, adds the file-system workload suite (`bench.fs_workloads`), and
renders one markdown report. Speed is measured here only, never in timed tests.
"""
