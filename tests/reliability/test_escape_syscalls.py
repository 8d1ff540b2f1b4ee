"""The booth's seccomp filter and cgroups, attacked from inside.

One agent (the system interpreter, raw syscalls through ctypes) makes every refused call and a
few allowed ones, then forks until it cannot; it prints what each call returned. The same agent
runs in three booths: as root with `--strict-sandbox` (everything applies), as nobody (no
cgroups: said on stderr and on the tape), and as root under an image that loosens the filter
and turns the cgroup off: there the loosened calls go through and the fork bomb gets past the
limit, which shows it was the filter and the cgroup that stopped them in the first run.
Separate short runs cover memory past the limit and `--strict-sandbox` refusing as nobody.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.reliability.conftest import AGENT_PYTHON, NOBODY, booth_argv, jb

# The agent's raw system call numbers and its 32-bit stub are x86_64's.
pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64 system calls")

PROCESSES = 50
TAPE = f"sys{os.getpid()}"  # also names the booth's cgroup: other booths may run meanwhile
FORKS = 300

AGENT = r"""
import ctypes, errno, fcntl, json, mmap, os, socket, struct, sys, time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}

def en(e):
    return errno.errorcode.get(e, str(e))

def sc(nr, *args, fd=False):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if r < 0:
        return en(ctypes.get_errno())
    if fd:
        os.close(r)
    return "ok"

KEEP = []  # buffers the kernel may write into must outlive the call

def buf(data):
    KEEP.append(ctypes.create_string_buffer(data, max(len(data), 1)))
    return ctypes.addressof(KEEP[-1])

def attempt(key, fn):
    try:
        r = fn()
        out[key] = r if isinstance(r, (str, int, dict)) else "ok"
    except OSError as e:
        out[key] = en(e.errno)

def in_child(fn):
    # For what may kill the caller (a 32-bit call where the kernel has no such ABI).
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, json.dumps(fn()).encode())
        os._exit(0)
    os.close(w)
    data = os.read(r, 4096)
    _, status = os.waitpid(pid, 0)
    return json.loads(data) if data else f"killed by signal {os.WTERMSIG(status)}"

out["seccomp_mode"] = [l.split()[1] for l in open("/proc/self/status")
                       if l.startswith("Seccomp:")][0]

# --- the terminal: typing into its own controlling tty (what reaches a shell), the console
master, slave = os.openpty()
def on_own_tty(request):
    def call():
        os.setsid()
        fcntl.ioctl(slave, 0x540E, 0)  # TIOCSCTTY: without it TIOCSTI needs CAP_SYS_ADMIN
        return sc(16, slave, request, buf(b"x"))
    return lambda: in_child(call)
attempt("tiocsti", on_own_tty(0x5412))
attempt("tiocsti_high_bits", on_own_tty(0x100005412))  # the kernel reads 32 bits of it
attempt("tioclinux", lambda: sc(16, slave, 0x541C, buf(b"\x0b")))
attempt("winsize_still_works", lambda: fcntl.ioctl(slave, 0x5413, b"\0" * 8) and "ok")

# --- the kernel keyring, io_uring, bpf, perf, userfaultfd, kexec, handles
attempt("keyctl", lambda: sc(250, 0, -3, 0))  # KEYCTL_GET_KEYRING_ID, the session keyring
# (into the process keyring, which dies with the process, should the call go through)
attempt("add_key", lambda: sc(248, buf(b"user"), buf(b"jbx"), buf(b"v"), 1, -2))
attempt("io_uring_setup", lambda: sc(425, 4, buf(bytes(120)), fd=True))
attempt("bpf", lambda: sc(321, 0, buf(bytes(72)), 72, fd=True))
# a software cpu-clock counter of the caller only, what perf_event_paranoid=2 still allows
attempt("perf_event_open", lambda: sc(298, buf(struct.pack("IIQQQQQ", 1, 128, 0, 0, 0, 0, 1 << 5)
                                                + bytes(80)), 0, -1, -1, 0, fd=True))
attempt("userfaultfd", lambda: sc(323, 1, fd=True))  # UFFD_USER_MODE_ONLY: no privilege needed
attempt("kexec_load", lambda: sc(246, 0, 0, 0, 0))
attempt("open_by_handle_at", lambda: sc(304, -100, buf(struct.pack("Ii", 8, 1) + bytes(8)), 0,
                                        fd=True))
attempt("unshare_userns", lambda: sc(272, 0x10000000))
attempt("clone3", lambda: sc(435, 0, 0))
attempt("personality_read_implies_exec", lambda: sc(135, 0x0400000))
attempt("personality_query", lambda: sc(135, 0xFFFFFFFF))

# --- sockets: families an agent has no use for, and the ones it has
def sock(family, kind, proto=0):
    socket.socket(family, kind, proto).close()
attempt("af_packet", lambda: sock(17, socket.SOCK_RAW, 0x300))
attempt("af_vsock", lambda: sock(40, socket.SOCK_STREAM))
attempt("af_alg", lambda: sock(38, socket.SOCK_SEQPACKET))
attempt("af_key", lambda: sock(15, socket.SOCK_RAW, 2))
attempt("af_netlink_audit", lambda: sock(16, socket.SOCK_RAW, 9))
attempt("af_netlink_route", lambda: sock(16, socket.SOCK_RAW, 0))
attempt("af_inet", lambda: sock(socket.AF_INET, socket.SOCK_STREAM))
attempt("af_unix", lambda: sock(socket.AF_UNIX, socket.SOCK_STREAM))

# --- ptrace: a sibling cannot be attached to; a tracer of its own child still works
def ptrace_sibling():
    sleeper = os.fork()
    if sleeper == 0:
        time.sleep(30)
        os._exit(0)
    def attach():
        r = libc.ptrace(ctypes.c_long(16), ctypes.c_long(sleeper), None, None)
        return "ok" if r == 0 else en(ctypes.get_errno())
    try:
        return in_child(attach)
    finally:
        os.kill(sleeper, 9)
        os.waitpid(sleeper, 0)
attempt("ptrace_attach_sibling", ptrace_sibling)
attempt("ptrace_traceme", lambda: in_child(lambda: "ok" if libc.ptrace(
    ctypes.c_long(0), 0, None, None) == 0 else en(ctypes.get_errno())))
attempt("process_vm_readv", lambda: sc(310, os.getpid(), 0, 0, 0, 0, 0))

# --- other ABIs: a 32-bit int 0x80 and an x32 call, both getpid
def int80_getpid():
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax,20; int 0x80; ret
    fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    r = fn()
    return "ok" if r == os.getpid() else en(-r)
attempt("int80_getpid", lambda: in_child(int80_getpid))
attempt("x32_getpid", lambda: sc(0x40000000 | 39))

# --- a fork bomb: how many children until the kernel says no, and what the cgroup saw
def fork_bomb():
    cg = [l.strip().split(":", 2)[2] for l in open("/proc/self/cgroup")
          if ":pids:" in l or l.startswith("0::")]
    base = next((b for b in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup") if os.path.exists(
        b + cg[0] + "/pids.max")), None) if cg else None
    gate_r, gate_w = os.pipe()
    kids, error, peak = [], None, None
    for _ in range(int(sys.argv[1])):
        try:
            pid = os.fork()
        except OSError as e:
            error = en(e.errno)
            break
        if pid == 0:
            os.close(gate_w)
            os.read(gate_r, 1)
            os._exit(0)
        kids.append(pid)
    if base:
        peak = int(open(base + cg[0] + "/pids.current").read())
    os.close(gate_w)
    for pid in kids:
        os.waitpid(pid, 0)
    return {"forked": len(kids), "error": error, "cgroup_pids": peak,
            "pids_max": open(base + cg[0] + "/pids.max").read().strip() if base else None}
attempt("fork_bomb", fork_bomb)

print("RESULT " + json.dumps(out), flush=True)
"""

# Refused by the filter with EPERM; the loosened run shows the filter is what refuses them.
REFUSED = (
    "tiocsti",
    "tiocsti_high_bits",
    "tioclinux",
    "keyctl",
    "add_key",
    "io_uring_setup",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "kexec_load",
    "open_by_handle_at",
    "unshare_userns",
    "personality_read_implies_exec",
    "af_packet",
    "af_vsock",
    "af_alg",
    "af_key",
    "af_netlink_audit",
    "ptrace_attach_sibling",
    "process_vm_readv",
    "int80_getpid",
    "x32_getpid",
)
ALLOWED = (
    "winsize_still_works",
    "personality_query",
    "af_netlink_route",
    "af_inet",
    "af_unix",
    "ptrace_traceme",
)
LOOSENED = ("ptrace", "io_uring", "keyring", "terminal")

TIGHT_IMAGE = f"""
name = "tight"
[limits]
processes = {PROCESSES}
memory = "1G"
"""
LOOSE_IMAGE = (
    TIGHT_IMAGE.replace('"tight"', '"loose"')
    + f"[seccomp]\nallow = {json.dumps(list(LOOSENED))}\n[cgroup]\nenabled = false\n"
)
# The host left writable on purpose: the cgroup file systems must stay read-only all the same.
MEMORY_IMAGE = '[fs]\nreadonly_host = false\n[limits]\nmemory = "64M"\n'
# Tries to leave its memory cgroup (for the parent) and to raise its limit, then allocates.
HOG = r"""
import errno, json, os, sys
lines = [ln.split(":", 2) for ln in open("/proc/self/cgroup").read().splitlines()]
mem = next((p for _, c, p in lines if c == "memory"), None)
if mem:
    root, path, limit, unlimited = "/sys/fs/cgroup/memory", mem, "memory.limit_in_bytes", "-1"
else:
    root, path = "/sys/fs/cgroup", next(p for _, c, p in lines if c == "")
    limit, unlimited = "memory.max", "max"
out = {}
for key, name, data in (("move_out", os.path.dirname(path) + "/cgroup.procs", str(os.getpid())),
                        ("raise_limit", path + "/" + limit, unlimited)):
    try:
        with open(os.path.normpath(root + "/" + name), "w") as f:
            f.write(data)
        out[key] = "ok"
    except OSError as e:
        out[key] = errno.errorcode.get(e.errno, str(e.errno))
print("ESCAPE " + json.dumps(out), flush=True)
try:
    hog = b"x" * (512 << 20)
    out["allocated"] = True
except MemoryError:
    out["allocated"] = False
print("RESULT " + json.dumps(out), flush=True)
sys.exit(0 if out["allocated"] else 3)
"""


@dataclass
class Run:
    code: int
    stderr: str
    results: dict[str, object]
    policy: dict[str, object]
    stdout: str = ""

    def line(self, tag: str) -> dict[str, object]:
        found = [ln for ln in self.stdout.splitlines() if ln.startswith(tag + " ")]
        return json.loads(found[0][len(tag) + 1 :]) if found else {}


def _work(user: int | None, tmp: pytest.TempPathFactory, name: str) -> Path:
    if user is None:
        return tmp.mktemp(name)
    work = Path("/tmp") / f"jukebox-{name}-{os.getpid()}"
    work.mkdir()
    os.chown(work, user, user)
    return work


def _booth(
    work: Path,
    image: str,
    script: str,
    *args: str,
    opts: tuple[str, ...] = (),
    python: str | None = None,
    user: int | None = None,
) -> Run:
    tree, tapes = work / "tree", work / "tapes"
    tree.mkdir()
    (work / "image.toml").write_text(image)
    if user is not None:
        for p in (tree, work / "image.toml"):
            os.chown(p, user, user)
    proc = jb(
        *booth_argv(tree, tapes, TAPE, "--image", str(work / "image.toml"), *opts),
        AGENT_PYTHON,
        "-I",
        "-c",
        script,
        *args,
        cwd=work,
        python=python,
        user=user,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    results = json.loads(line[len("RESULT ") :]) if line else {}
    log = jb("log", str(tapes / f"{TAPE}.jbx"), "--json", python=python, user=user)
    data = json.loads(log.stdout) if log.returncode == 0 else {}
    frames = data.get("frames", []) if isinstance(data, dict) else data
    policy = frames[0]["payload"]["policy"] if frames else {}
    return Run(proc.returncode, proc.stderr, results, policy, proc.stdout)


# root-overlay: the same filter and cgroup with the kernel overlay as the layer.
@pytest.fixture(scope="module", params=["root", "root-overlay", "nobody", "loosened"])
def battery(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    request.getfixturevalue("booth_ready")
    user = python = None
    image, opts = TIGHT_IMAGE, ("--strict-sandbox",)
    if request.param == "nobody":
        python = request.getfixturevalue("nobody_python")
        request.getfixturevalue("open_dev_fuse")
        user, opts = NOBODY, ()
    elif request.param == "loosened":
        image, opts = LOOSE_IMAGE, ()
    elif request.param == "root-overlay":
        opts = (*opts, "--fs", "overlay")
    work = _work(user, tmp_path_factory, f"syscalls-{request.param}")
    try:
        yield _booth(work, image, AGENT, str(FORKS), opts=opts, python=python, user=user)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _booth_cgroups() -> list[str]:
    """This module's booth cgroups still on the host (`<supervisor pid>-<tape id>`)."""
    return [str(p) for p in Path("/sys/fs/cgroup").glob(f"**/jukebox/*-{TAPE}") if p.is_dir()]


def test_the_agent_made_every_call(battery: Run) -> None:
    assert battery.code == 0, battery.stderr
    assert set(REFUSED) | set(ALLOWED) <= set(battery.results), battery.results


def _kernel_refuses_tiocsti() -> bool:
    try:
        with open("/proc/sys/dev/tty/legacy_tiocsti") as f:
            return f.read().strip() == "0"
    except FileNotFoundError:  # before 6.2 every kernel allowed it
        return False


def test_refused_calls_fail_with_eperm(request: pytest.FixtureRequest, battery: Run) -> None:
    r = battery.results
    loosened = request.node.callspec.params["battery"] == "loosened"
    assert r["seccomp_mode"] == "2"  # a filter is installed
    let_through = {"ptrace_attach_sibling", "process_vm_readv", "io_uring_setup"}
    let_through |= {"keyctl", "add_key", "tiocsti", "tiocsti_high_bits", "tioclinux"}
    for call in REFUSED:
        if loosened and call in let_through:
            continue
        expected = "ENOSYS" if call == "clone3" else "EPERM"
        assert r[call] == expected, (call, r[call])
    assert r["clone3"] == "ENOSYS"  # glibc falls back to clone, whose flags the filter reads
    for call in ALLOWED:
        assert r[call] == "ok", (call, r[call])
    if loosened:
        # What the image let through really goes through: the filter was what refused it.
        for call in sorted(let_through):
            assert r[call] != "EPERM", (call, r[call])
        for call in ("ptrace_attach_sibling", "keyctl", "io_uring_setup"):
            assert r[call] == "ok", (call, r[call])
        # Kernels built without LEGACY_TIOCSTI (Debian's from 6.12 on) refuse TIOCSTI themselves
        # to anyone without CAP_SYS_ADMIN, with EIO: there the filter has nothing to add.
        expected = "EIO" if _kernel_refuses_tiocsti() else "ok"
        assert r["tiocsti"] == expected, ("tiocsti", r["tiocsti"])


def test_fork_bomb_stops_at_the_process_limit(request: pytest.FixtureRequest, battery: Run) -> None:
    bomb = battery.results["fork_bomb"]
    assert isinstance(bomb, dict), bomb
    kind = request.node.callspec.params["battery"].removesuffix("-overlay")
    if kind == "loosened":
        # No cgroup: as root RLIMIT_NPROC binds nothing, and every fork succeeds.
        assert bomb["forked"] == FORKS and bomb["cgroup_pids"] is None, bomb
        return
    assert bomb["error"] == "EAGAIN" and bomb["forked"] < PROCESSES, bomb
    if kind == "root":
        # The cgroup bound root, and the host's count of it never passed the limit.
        assert bomb["pids_max"] == str(PROCESSES), bomb
        assert bomb["cgroup_pids"] is not None and bomb["cgroup_pids"] <= PROCESSES, bomb


def test_run_start_lists_the_protections(request: pytest.FixtureRequest, battery: Run) -> None:
    protections = battery.policy.get("protections")
    kind = request.node.callspec.params["battery"].removesuffix("-overlay")
    assert isinstance(protections, dict), battery.policy
    if kind == "root":
        for name in ("seccomp", "pids_cgroup", "memory_cgroup"):
            assert protections[name] == "on", protections
        overlay = request.node.callspec.params["battery"] == "root-overlay"
        assert battery.policy["fs"] == ("overlay" if overlay else "fuse")
        assert "runs without" not in battery.stderr
    elif kind == "nobody":
        assert protections["seccomp"] == "on"
        for name in ("pids_cgroup", "memory_cgroup"):
            assert protections[name].startswith("unavailable: "), protections
        # Said once, on one line, naming what is missing and what it leaves open.
        said = [ln for ln in battery.stderr.splitlines() if "runs without" in ln]
        assert len(said) == 1 and "pids_cgroup" in said[0] and "fork bomb" in said[0], said
    else:
        assert protections["pids_cgroup"].startswith("off: "), protections
        assert battery.policy["seccomp"] == {"enabled": True, "allow": list(LOOSENED)}


def test_booth_cgroups_are_gone_after_the_runs(battery: Run) -> None:
    assert _booth_cgroups() == []


@pytest.mark.parametrize("user", ["root", "nobody"])
def test_memory_past_the_limit_ends_the_agent_not_the_host(
    request: pytest.FixtureRequest,
    booth_ready: None,
    tmp_path_factory: pytest.TempPathFactory,
    user: str,
) -> None:
    uid = python = None
    if user == "nobody":
        python = request.getfixturevalue("nobody_python")
        request.getfixturevalue("open_dev_fuse")
        uid = NOBODY
    work = _work(uid, tmp_path_factory, f"memory-{user}")
    try:
        run = _booth(work, MEMORY_IMAGE, HOG, opts=("--no-seccomp",), python=python, user=uid)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert run.policy["protections"]["seccomp"] == "off: --no-seccomp"
    escape = run.line("ESCAPE")
    assert set(escape) == {"move_out", "raise_limit"}, run.stdout
    assert all(v in ("EROFS", "EACCES") for v in escape.values()), escape
    assert run.results.get("allocated") is not True
    if user == "root":
        assert escape == {"move_out": "EROFS", "raise_limit": "EROFS"}  # read-only, writable host
        # The cgroup's OOM killer ended the agent (RLIMIT_AS is left off while the cgroup binds).
        assert run.policy["protections"]["memory_cgroup"] == "on"
        assert run.code == 128 + 9, (run.code, run.stderr)
    else:
        # No cgroup for nobody: RLIMIT_AS, the fallback, refuses the allocation.
        assert run.policy["protections"]["memory_cgroup"].startswith("unavailable: ")
        assert run.results.get("allocated") is False and run.code == 3, (run.code, run.stderr)
    assert _booth_cgroups() == []


def test_strict_sandbox_refuses_as_nobody(
    booth_ready: None, nobody_python: str, open_dev_fuse: None, tmp_path_factory
) -> None:
    work = _work(NOBODY, tmp_path_factory, "strict")
    try:
        run = _booth(
            work,
            TIGHT_IMAGE,
            "print('RESULT {}')",
            opts=("--strict-sandbox",),
            python=nobody_python,
            user=NOBODY,
        )
        assert run.code == 2 and run.results == {}, run
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and "--strict-sandbox" in lines[0] and "pids_cgroup" in lines[0]
        assert not (work / "tapes").exists()  # the tape dir it made (and its store) is gone
    finally:
        shutil.rmtree(work, ignore_errors=True)
