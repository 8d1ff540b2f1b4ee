"""`python -m vm [KERNEL ...]`: the test subset in a VM per kernel (what `make vm-test` runs).

See docs/vm-tests.md. Kernels are Debian suites (bookworm, trixie, sid) or a vmlinuz path.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from vm import boot, disks, kernels, report

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".vm-cache"
SUBSET = REPO / "vm" / "subset.txt"

# Seconds of tests per kernel under emulation, so that three kernels with their boots fit in the
# issue's hour on a 2-core machine; vm/subset.txt puts the most kernel-dependent tests first.
TCG_BUDGET = 1080

# Under emulation everything takes about this many times longer than on the host: the tests'
# own waits (JUKEBOX_TEST_SLOWDOWN, read by tests/conftest.py) and pytest's timeout scale by it.
SLOWDOWN = {"tcg": 10, "kvm": 2}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fail(msg: str) -> None:
    print(f"vm-test: {msg}", file=sys.stderr)
    sys.exit(2)


def subset(path: Path, only: str | None) -> tuple[list[str], list[str]]:
    """(test arguments, extra pytest arguments) from the subset file, or from --tests."""
    if only:
        return only.split(), []
    tests, extra = [], []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            extra += ["--deselect", line[1:].strip()]
        else:
            tests.append(line)
    return tests, extra


# A `--parallel` run's children (one `python -m vm KERNEL` each) run under their parent's lock:
# this names the descriptor they inherit it on.
LOCK_FD_ENV = "JUKEBOX_VM_LOCK_FD"


def hold_lock(cache: Path) -> int:
    """Takes CACHE/lock (flock) for this run and returns its descriptor, held until exit; exits
    2 when another run holds it. Two runs at once would boot VMs over the same scratch disks,
    run directories, reports and kernel downloads."""
    path = cache / "lock"
    inherited = os.environ.get(LOCK_FD_ENV)
    if inherited:
        # The parent's descriptor: flock again on the open file that holds the lock keeps it.
        try:
            fd = int(inherited)
            same = os.fstat(fd)
            here = os.stat(path)
            if (same.st_dev, same.st_ino) == (here.st_dev, here.st_ino):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
        except (ValueError, OSError):
            pass
        _fail(f"{LOCK_FD_ENV}={inherited} is not this run's lock {path}: unset it")
    cache.mkdir(exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        who = f" (pid {holder})" if holder.isdigit() else ""
        _fail(f"another run holds {path}{who}: wait for it to end, or stop it; two runs would "
              "share its scratch files")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vm", description=__doc__.splitlines()[0])
    p.add_argument("kernels", nargs="*", help="bookworm, trixie, sid, or a vmlinuz path "
                   f"(default: $KERNEL, else {' '.join(kernels.DEFAULT)})")
    p.add_argument("--tests", help="pytest arguments to run instead of vm/subset.txt "
                   "(space-separated test files or ids)")
    p.add_argument("--timeout", type=float, default=float(os.environ.get("JUKEBOX_VM_TIMEOUT",
                   0)) or None, help="seconds one VM may run before it is stopped "
                   "(default 2700, or the budget and 15 minutes)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of tests per kernel before pytest is interrupted and what ran "
                   "is reported (default $JUKEBOX_VM_BUDGET, else "
                   f"{TCG_BUDGET} under emulation, none under KVM; 0: no budget)")
    p.add_argument("--parallel", action="store_true",
                   help="boot the kernels side by side (3 GiB of memory each) instead of in turn")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)

    names = args.kernels or os.environ.get("KERNEL", "").split() or list(kernels.DEFAULT)
    try:
        kernels.check(names)
    except kernels.KernelError as exc:
        _fail(str(exc))
    if os.environ.get("JUKEBOX_VM_ACCEL", "kvm") not in ("kvm", "tcg"):
        _fail(f"JUKEBOX_VM_ACCEL={os.environ['JUKEBOX_VM_ACCEL']}: use kvm or tcg, or unset it")
    try:
        forced_scale = float(os.environ.get("JUKEBOX_TEST_SLOWDOWN", "0"))
    except ValueError:
        _fail(f"JUKEBOX_TEST_SLOWDOWN={os.environ['JUKEBOX_TEST_SLOWDOWN']}: give a factor like 10")
    budget = args.budget
    if budget is None:
        env_budget = os.environ.get("JUKEBOX_VM_BUDGET")
        try:
            budget = float(env_budget) if env_budget else None
        except ValueError:
            _fail(f"JUKEBOX_VM_BUDGET={env_budget}: give seconds of tests per kernel, or 0")
    if budget is not None and budget < 0:
        _fail(f"--budget {budget:g}: give seconds of tests per kernel, or 0 for none")
    if args.timeout is not None and args.timeout <= 0:
        _fail(f"--timeout {args.timeout:g}: give the seconds one VM may run, e.g. 2700")
    # Before anything reads or writes the cache (kernels, images, runs): a second run stops
    # here, in a second, and a VM of the first is never booted over files the second rewrote.
    lock = hold_lock(CACHE)
    for tool in ("qemu-system-x86_64", "qemu-img", "mkfs.ext4", "dpkg-deb", "apt-get", "depmod",
                 "busybox"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            _fail(f"{tool} is not installed: run `make vm-test`, which installs it")
    if not (REPO / ".venv" / "bin" / "python").exists():
        _fail("no .venv in the checkout: run `make setup` first")
    CACHE.mkdir(exist_ok=True)
    try:
        boot.install_vng(CACHE, _log)  # under the lock, as everything else in the cache
    except boot.VngError as exc:
        _fail(str(exc))
    try:
        chosen = kernels.resolve(CACHE, names, _log)
    except kernels.KernelError as exc:
        _fail(str(exc))
    tests, extra = subset(SUBSET, args.tests)

    accel = boot.accelerator(CACHE, chosen[0], REPO, _log)
    scale = forced_scale or SLOWDOWN.get(accel, 10)
    if budget is None:
        budget = TCG_BUDGET if accel == "tcg" else 0
    timeout = args.timeout or max(2700.0, budget + 900)
    if budget:
        _log(f"vm: at most {budget / 60:g} min of tests per kernel (--budget 0 runs them all)")
    venv, prefix = disks.venv_paths(REPO)
    image = disks.python_image(REPO, CACHE, _log)
    settings = {
        "JBX_REPO": str(REPO),
        "JBX_VENV": str(venv),
        "JBX_PREFIX": str(prefix or ""),
        "JBX_TESTS": " ".join(tests),
        "JBX_PYTEST_ARGS": " ".join(extra),
        "JBX_PYTEST_TIMEOUT": str(int(120 * scale)),
        "JUKEBOX_TEST_SLOWDOWN": str(scale),
        "JBX_BUDGET": str(int(budget)),
    }
    started = time.monotonic()
    if args.parallel and len(chosen) > 1:
        results = _side_by_side(names, args.tests, budget, timeout, lock)
    else:
        results = [_one(k, accel, settings, image, timeout, len(tests)) for k in chosen]
    total = time.monotonic() - started
    (CACHE / "report.json").write_text(json.dumps(
        {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": total,
         "kernels": [r.as_json() for r in results]}, indent=2))
    if args.json:
        print(json.dumps([r.as_json() for r in results], indent=2))
    else:
        print(f"\n== vm-test: {len(results)} kernel(s) in {total / 60:.1f} min")
        print(report.render(results))
    return 0 if all(r.ok for r in results) else 1


def _one(k: kernels.Kernel, accel: str, settings: dict[str, str], image: Path | None,
         timeout: float, n_tests: int) -> report.KernelResult:
    _log(f"vm: {k.name}: booting {k.version} under {accel}, {n_tests} test arguments "
         f"(log: {CACHE / 'runs' / k.name / 'guest.log'})")
    b = boot.run_tests(CACHE, k, accel, REPO, settings, image, timeout, _log)
    r = report.read(report.KernelResult(k.name, k.version, accel, round(b.seconds, 1),
                                        round(b.cpu_seconds, 1), b.attempts, b.exit_code),
                    b.run_dir)
    _log(report.render([r]))
    return r


def _side_by_side(names: list[str], only: str | None, budget: float,
                  timeout: float, lock: int) -> list[report.KernelResult]:
    """One `python -m vm KERNEL --json` per kernel, all at once: each measures its own VM's CPU
    time, which one process running several VMs could not tell apart."""
    extra = ["--budget", str(budget), "--timeout", str(timeout), "--json"]
    if only:
        extra += ["--tests", only]
    env = dict(os.environ, **{LOCK_FD_ENV: str(lock)})
    procs = [subprocess.Popen([sys.executable, "-m", "vm", n, *extra], cwd=REPO, env=env,
                              pass_fds=(lock,), stdout=subprocess.PIPE, text=True)
             for n in names]
    results = []
    for n, proc in zip(names, procs, strict=True):
        out, _ = proc.communicate()
        try:
            (data,) = json.loads(out)
            data.pop("skipped_total", None)
            data.pop("ok", None)
            results.append(report.KernelResult(**data))
        except (ValueError, TypeError):
            results.append(report.KernelResult(n, "?", "?", 0.0, 0.0, 0, None,
                                               problem=f"its run ended with {proc.returncode} "
                                               "and no report"))
    return results


if __name__ == "__main__":
    sys.exit(main())
