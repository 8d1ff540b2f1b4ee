"""Booting one test VM with virtme-ng: the accelerator, the command line, one retry.

KVM is used when /dev/kvm boots a stock kernel; paravirtualised and nested hosts often refuse
(QEMU aborts on an MSR, or the guest hangs after boot), so a short probe boot decides and its
verdict is cached per host kernel and QEMU. Without KVM the guest runs under TCG, QEMU's software
emulation, about ten times slower. QEMU runs at `nice 19`: the tests in the VM must not starve
whatever else the machine is doing.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vm import disks
from vm.kernels import Kernel

MEMORY = "3G"  # the 2 GiB commit test and pytest's own memory, with room to spare
CPUS = "2"
TCG_OPTS = "-accel tcg,tb-size=512"  # a bigger translation cache: fewer retranslations
PROBE_SECONDS = 120


def nice() -> list[str]:
    return ["nice", "-n", os.environ.get("JUKEBOX_VM_NICE", "19")]


VNG_REQUIREMENT = "virtme-ng>=1.42,<2"


class VngError(Exception):
    """virtme-ng could not be installed; the message says which step failed and how."""


def install_vng(cache: Path, log=print) -> None:
    """virtme-ng from PyPI into CACHE/vng, a venv of its own, unless it is there. The caller
    holds the run's lock (vm.__main__.hold_lock): two runs installing at once would build one
    venv over the other, and one of them would boot with a half-installed vng."""
    venv = cache / "vng"
    if os.access(venv / "bin" / "vng", os.X_OK):
        return
    log(f"vm: installing {VNG_REQUIREMENT} into {venv}")
    # --clear: what an interrupted install left is rebuilt, not trusted.
    for cmd in ([sys.executable, "-m", "venv", "--clear", str(venv)],
                [str(venv / "bin" / "pip"), "install", "-q", VNG_REQUIREMENT]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
            raise VngError(f"installing virtme-ng: `{shlex.join(cmd)}` failed"
                           + (f": {tail[0]}" if tail else ""))


def vng(cache: Path) -> str:
    exe = cache / "vng" / "bin" / "vng"
    return str(exe) if exe.exists() else (shutil.which("vng") or "vng")


def _command(cache: Path, kernel: Kernel, accel: str, repo: Path, script: str,
             disk_paths: list[Path]) -> list[str]:
    cmd = [*nice(), vng(cache), "--run", str(kernel.image), "--memory", MEMORY, "--cpus", CPUS,
           "--rwdir", str(repo), "--cwd", str(repo)]
    for d in disk_paths:
        cmd += ["--disk", str(d)]
    if accel == "tcg":
        cmd += ["--disable-kvm", f"--qemu-opts={TCG_OPTS}"]
    return [*cmd, "--exec", script]


def _env(cache: Path) -> dict[str, str]:
    # virtme-ng runs its helpers (virtme-run) from PATH.
    bindir = str(Path(vng(cache)).parent)
    path = os.environ.get("PATH", "")
    return dict(os.environ, PATH=f"{bindir}:{path}:/usr/sbin:/sbin")


def accelerator(cache: Path, kernel: Kernel, repo: Path, log=print) -> str:
    """"kvm" or "tcg": JUKEBOX_VM_ACCEL if set, else a cached verdict, else a probe boot."""
    forced = os.environ.get("JUKEBOX_VM_ACCEL")
    if forced:
        return forced
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        log("vm: /dev/kvm is missing or not usable: software emulation (TCG), slower")
        return "tcg"
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True)
    key = f"{os.uname().release} {qemu.stdout.splitlines()[0] if qemu.stdout else '?'}"
    verdict_file = cache / "accel"
    if verdict_file.exists():
        verdict, _, seen = verdict_file.read_text().strip().partition(" ")
        if seen == key:
            if verdict == "tcg":
                log(f"vm: /dev/kvm could not run a stock kernel here ({verdict_file} says so): "
                    "software emulation (TCG), slower")
            return verdict
    run_dir = cache / "runs" / "kvm-probe"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    marker = run_dir / "booted"
    cmd = _command(cache, kernel, "kvm", repo, f"echo ok > {shlex.quote(str(marker))}", [])
    log(f"vm: probing KVM with {kernel.name} (at most {PROBE_SECONDS} s)")
    _run_vm(cmd, cache, repo, PROBE_SECONDS, subprocess.DEVNULL)
    verdict = "kvm" if marker.exists() else "tcg"
    if verdict == "tcg":
        log("vm: /dev/kvm cannot run a stock kernel here (paravirtualised or nested host): "
            "software emulation (TCG), slower")
    verdict_file.write_text(f"{verdict} {key}\n")
    return verdict


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _group_nice(pid: int) -> None:
    """Gives the VM's session the niceness its processes have. A new session is a scheduling
    group of its own where the kernel groups by session (sched_autogroup, the default on Debian):
    `nice` then only ranks processes inside that group, and QEMU at nice 19 still took as much CPU
    as any other session. A failure (no autogroup, a negative value without CAP_SYS_NICE) leaves
    the VM as it was."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(os.environ.get("JUKEBOX_VM_NICE", "19"))


def _run_vm(cmd: list[str], cache: Path, repo: Path, timeout: float, out) -> bool:
    """Runs one VM to its end; False when it had to be stopped. QEMU is a grandchild of vng:
    the whole process group goes, so no emulator outlives its run."""
    proc = subprocess.Popen(cmd, env=_env(cache), stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, cwd=repo, start_new_session=True)
    _group_nice(proc.pid)
    try:
        proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


@dataclass
class Boot:
    exit_code: int | None  # pytest's, as the guest wrote it; None when none came back
    seconds: float
    cpu_seconds: float  # QEMU's and virtme-ng's CPU time: the wall time on an idle machine is
    # about this divided by the vCPUs kept busy, whatever else the machine was doing
    attempts: int
    run_dir: Path


def run_tests(cache: Path, kernel: Kernel, accel: str, repo: Path, settings: dict[str, str],
              python_image: Path | None, timeout: float, log=print) -> Boot:
    """Boots kernel and runs the tests named in settings; once more if no exit code comes back
    (under emulation about one boot in five stops silently)."""
    run_dir = cache / "runs" / kernel.name
    start = time.monotonic()
    cpu0 = _children_cpu()
    for attempt in (1, 2):
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        (run_dir / "run.env").write_text(
            "".join(f"{k}={shlex.quote(v)}\n" for k, v in settings.items())
        )
        scratch = disks.scratch(run_dir / "scratch.img")  # per kernel: runs may overlap
        disk_paths = [scratch]
        if python_image:
            disk_paths.append(disks.private_view(python_image, run_dir / "python.qcow2"))
        # The guest runs a copy: sh reads a script as it goes, and the checkout may change.
        shutil.copy(repo / "vm" / "guest.sh", run_dir / "guest.sh")
        script = f"sh {shlex.quote(str(run_dir / 'guest.sh'))} {shlex.quote(str(run_dir))}"
        cmd = _command(cache, kernel, accel, repo, script, disk_paths)
        with open(run_dir / "console.log", "wb") as console:
            finished = _run_vm(cmd, cache, repo, timeout, console)
        if not finished:
            log(f"vm: {kernel.name}: no end after {timeout:.0f} s, stopped")
        scratch.unlink(missing_ok=True)
        (run_dir / "python.qcow2").unlink(missing_ok=True)
        code_file = run_dir / "exit-code"
        if code_file.exists():
            return Boot(int(code_file.read_text().strip()), time.monotonic() - start,
                        _children_cpu() - cpu0, attempt, run_dir)
        # A run that started its tests and then ran out of time would only do so again.
        hung = not finished and "pytest starts" in _read(run_dir / "guest.log")
        if attempt == 2 or hung:
            return Boot(None, time.monotonic() - start, _children_cpu() - cpu0, attempt, run_dir)
        log(f"vm: {kernel.name}: no exit code came back from the guest; booting once more")
    raise AssertionError("unreachable")
