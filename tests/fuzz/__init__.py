"""Fuzz harnesses for every decoder that reads bytes an attacker could write.

One module per target (`fuzz_tape`, `fuzz_tree`, `fuzz_store`, `fuzz_control`); each exposes a
`TARGETS` list of `common.Target`. The property everywhere: a hostile input ends in one of the
project's own clean errors, never a raw struct/index/key/unicode/zstd/recursion/memory error and
never a hang. `python -m tests.fuzz` runs atheris on every target (`make fuzz`);
`test_fuzz_short.py` runs the same functions over seeded mutations in `make test`.

This package imports nothing at import time so atheris can instrument the project modules as the
harness modules import them.
"""
