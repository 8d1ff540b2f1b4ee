"""Attacks on the early-forked shim (isolation.PreforkedShim, join_later), performed for real.

`jukebox booth run` forks the agent's shim before the supervisor enters its namespaces; when
its spec comes, the shim joins them with setns(2). Whatever happens to the supervisor, and
whoever else holds its number, the agent must run in the supervisor's view (the layer over the
tree) or not at all: never in another process's namespaces, never on the real tree.

One driver process per user runs every attack in turn, with real processes, namespaces and
mounts (a tmpfs over the tree stands in for the layer, as in test_isolation.py), and prints
what it saw. CMD says `RAN` on a pipe of the driver's, lists its descriptors, and writes a
marker at the tree's path: in the supervisor's view that lands in the tmpfs; anywhere else it
lands on the real tree.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.booth.conftest import NOBODY, REPO
from tests.conftest import slow

pytestmark = pytest.mark.usefixtures("root_only")

DRIVER = r"""
import json, os, select, signal, sys, time
from jukebox.booth import isolation as iso
from jukebox.booth import private_dev, syscall_filter  # what the shim imports, read as root

cfg = json.loads(sys.argv[1])
TREE = cfg["tree"]
MARK = os.path.join(TREE, "marker")
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
SCRIPT = 'echo RAN; ls -l /proc/self/fd; echo pwned > "$1/marker"'
iso.prctl(iso.PR_SET_CHILD_SUBREAPER, 1)  # a shim whose supervisor died comes to us


def fork(fn, *args):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException as error:
            os.write(2, f"{fn.__name__}: {error!r}\n".encode())
            code = 1
        os._exit(code)
    return pid


def send(fd, obj):
    os.write(fd, (json.dumps(obj) + "\n").encode())


def receive(f):
    line = f.readline()
    if not line:
        raise EOFError("the other side ended early")
    return json.loads(line)


def drain(fd):
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def wait_stopped(pid):
    # The driver is not the shim's parent: it cannot waitpid(WUNTRACED) for it.
    while open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "T":
        time.sleep(0.001)


def become_root_of_a_user_namespace():
    # What an unprivileged user needs for a PID namespace of its own (`unshare -Ur --pid`).
    if os.geteuid() == 0:
        return
    uid, gid = os.geteuid(), os.getegid()
    iso.unshare(iso.CLONE_NEWUSER)
    open("/proc/self/setgroups", "w").write("deny")
    open("/proc/self/uid_map", "w").write(f"0 {uid} 1")
    open("/proc/self/gid_map", "w").write(f"0 {gid} 1")


def take_number(pid):
    # The next process forked in this PID namespace gets `pid`.
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(pid - 1))


def hostile(ready_w, hold_r, hold_w):
    # A process of its own mount namespace: a copy of the host's mounts, the real tree in it.
    os.close(hold_w)  # it lives until the driver closes its end
    iso.unshare(iso.CLONE_NEWNS)
    send(ready_w, {"hostile": os.getpid()})
    os.read(hold_r, 1)


def supervisor(report_w, go_r, out_w, script):
    # As `jukebox booth run`: the shim first, then the namespace and the layer over the tree.
    shim = iso.PreforkedShim.fork(join_later=True)
    iso.enter_private_namespace()
    iso.mount("tmpfs", TREE, "tmpfs", 0, "mode=0777")
    shim.prepare([], preload_seccomp=False)
    send(report_w, {"sup": os.getpid(), "shim": shim.pid})
    if os.read(go_r, 1) != b"g":
        return
    spec = iso.ChildSpec(argv=["sh", "-c", script, "cmd", TREE], cwd="/", env=ENV,
                         keep=[TREE], hide=[])
    child = shim.spawn(spec, stdout=out_w, stderr=out_w)
    send(report_w, {"sent": True})
    started = child.wait_started()
    _, status = os.waitpid(shim.pid, 0)
    send(report_w, {"started": started, "error": child.setup_error, "status": status,
                    "in_view": os.path.exists(MARK)})


class Run:
    # One supervisor, its pipes, and what its CMD wrote.
    def __init__(self, script=SCRIPT):
        self.rep_r, rep_w = os.pipe()
        go_r, self.go_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.pid = fork(supervisor, rep_w, go_r, out_w, script)
        for fd in (rep_w, go_r, out_w):
            os.close(fd)
        self.reports = os.fdopen(self.rep_r)
        first = receive(self.reports)
        self.shim = first["shim"]

    def go(self):
        os.write(self.go_w, b"g")
        return receive(self.reports)

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)

    def reap_shim(self):
        os.kill(self.shim, signal.SIGCONT)
        return os.waitpid(self.shim, 0)[1]


def control():
    run = Run()
    run.go()
    final = receive(run.reports)
    os.waitpid(run.pid, 0)
    return {**final, "out": drain(run.out_r)}


def other_user():
    # Another local user goes for the waiting shim: the test runs HOSTILE as that user once
    # the driver says where the shim is, then lets the supervisor go on.
    run = Run()
    print(json.dumps({"probe": run.shim}), flush=True)
    sys.stdin.readline()
    run.go()
    final = receive(run.reports)
    os.waitpid(run.pid, 0)
    return {**final, "out": drain(run.out_r)}


def killed_waiting():
    # The supervisor dies while the shim waits for its spec (it has its cgroups, its imports).
    run = Run()
    run.kill()
    return {"shim_status": run.reap_shim(), "out": drain(run.out_r)}


def killed_after_spec():
    # The spec is in the shim's socket, the shim has not joined yet (held stopped right
    # there), and the supervisor dies: the moment a reparented shim could join the wrong place.
    run = Run()
    os.kill(run.shim, signal.SIGSTOP)
    wait_stopped(run.shim)
    run.go()
    run.kill()
    return {"shim_status": run.reap_shim(), "out": drain(run.out_r)}


def killed_after_join():
    # The supervisor dies once CMD runs, in the namespaces the shim joined (a user namespace
    # too, when not root: were pdeathsig lost on the way, the agent would outlive its booth).
    run = Run("echo RAN; exec sleep 600")
    run.go()
    started = os.read(run.out_r, 64).decode()
    run.kill()
    # Bounded waits, so that a failing run reports rather than hangs; not measures of time.
    deadline = time.monotonic() + cfg["bound"]
    status = None
    while status is None and time.monotonic() < deadline:
        done, raw = os.waitpid(run.shim, os.WNOHANG)
        status = raw if done else time.sleep(0.01)
    if status is None:  # the relay outlived its supervisor: end it, its init follows
        os.kill(run.shim, signal.SIGKILL)
        os.waitpid(run.shim, 0)
    # EOF once nobody holds CMD's stdout: CMD and all it started are gone.
    gone, _, _ = select.select([run.out_r], [], [], max(deadline - time.monotonic(), 1))
    ended = bool(gone) and os.read(run.out_r, 64) == b""
    while True:  # the init, reparented here when the relay died
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    return {"started": started, "shim_status": status, "cmd_ended": ended}


def pid_reused(result_w):
    # As killed_after_spec, then a hostile process takes the dead supervisor's number (in a
    # PID namespace of the driver's own, with its own /proc, where the next number can be
    # chosen) before the shim goes on.
    iso.mount(None, "/", None, iso.MS_REC | iso.MS_PRIVATE)
    iso.mount("proc", "/proc", "proc", iso.MS_NOSUID | iso.MS_NODEV | iso.MS_NOEXEC)
    run = Run()
    os.kill(run.shim, signal.SIGSTOP)
    wait_stopped(run.shim)
    run.go()
    run.kill()
    take_number(run.pid)
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    taker = fork(hostile, ready_w, hold_r, hold_w)
    receive(os.fdopen(ready_r))
    status = run.reap_shim()
    os.close(hold_w)
    os.waitpid(taker, 0)
    send(result_w, {"sup": run.pid, "hostile": taker, "shim_status": status,
                    "out": drain(run.out_r)})


def foreign_proc(result_w):
    # A PID namespace whose /proc is still the host's (`unshare --pid --fork` without
    # --mount-proc, `nsenter --pid`): the supervisor's number there is, in /proc, a hostile
    # process in a mount namespace of its own, with the real tree in it.
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    taker = fork(hostile, ready_w, hold_r, hold_w)
    number = receive(os.fdopen(ready_r))["hostile"]
    iso.unshare(iso.CLONE_NEWPID)

    def pid1():
        take_number(number)
        run = Run()
        run.go()
        final = receive(run.reports)
        os.waitpid(run.pid, 0)
        send(result_w, {"sup": run.pid, "hostile": number, **final, "out": drain(run.out_r)})

    init = fork(pid1)
    os.waitpid(init, 0)
    os.close(hold_w)
    os.waitpid(taker, 0)


def in_pid_namespace(scenario):
    result_r, result_w = os.pipe()

    def outer():
        become_root_of_a_user_namespace()
        if scenario is pid_reused:
            iso.unshare(iso.CLONE_NEWPID | iso.CLONE_NEWNS)
            os.waitpid(fork(pid_reused, result_w), 0)
        else:
            foreign_proc(result_w)

    pid = fork(outer)
    os.close(result_w)
    result = receive(os.fdopen(result_r))
    os.waitpid(pid, 0)
    return result


report = {}
for name in cfg["scenarios"]:
    scenario = globals()[name]
    if name in ("pid_reused", "foreign_proc"):
        report[name] = in_pid_namespace(scenario)
    else:
        report[name] = scenario()
    report[name]["on_real_tree"] = os.path.exists(MARK)
print(json.dumps(report), flush=True)
"""

# Another user's ways at a shim waiting for its spec: its socket (a spec of its own sent on it
# would run as the shim's user, in the supervisor's namespaces), its descriptors, ptrace (to
# run code in it), a signal (to hold it, as the attacks above do), its namespaces.
HOSTILE = r"""
import ctypes, errno, json, os, signal, sys
pid = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
tried = {}

def call(result):
    if result < 0:
        raise OSError(ctypes.get_errno(), "")

def attempt(name, fn):
    try:
        fn()
        tried[name] = "DONE"
    except OSError as error:
        tried[name] = errno.errorcode.get(error.errno, str(error.errno))

attempt("list_fds", lambda: os.listdir(f"/proc/{pid}/fd"))
pidfd = os.pidfd_open(pid)
for n in range(10):
    attempt(f"pidfd_getfd {n}", lambda n=n: call(libc.syscall(438, pidfd, n, 0)))
attempt("ptrace_attach", lambda: call(libc.ptrace(16, pid, None, None)))
attempt("sigstop", lambda: os.kill(pid, signal.SIGSTOP))
attempt("its_mount_ns", lambda: os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY))
print(json.dumps(tried))
"""

SCENARIOS = [
    "control", "other_user", "killed_waiting", "killed_after_spec", "killed_after_join",
    "pid_reused", "foreign_proc",
]
OTHER_UID = 65533  # the other user when the booth's is nobody


def _as(user: int | None, cmd: list[str]) -> list[str]:
    if user is None:
        return cmd
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]


def _drive(tree: Path, python: str, user: int | None) -> dict:
    config = {"tree": str(tree), "scenarios": SCENARIOS, "bound": slow(20)}
    cmd = _as(user, [python, "-c", DRIVER, json.dumps(config)])
    # This checkout's code, wherever the venv's editable install points.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/", env=env)
    try:
        assert proc.stdin and proc.stdout
        line = proc.stdout.readline()
        assert line.startswith('{"probe"'), line + proc.stderr.read()
        other = NOBODY if user is None else OTHER_UID
        system = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        shim = str(json.loads(line)["probe"])
        hostile = subprocess.run(_as(other, [system, "-c", HOSTILE, shim]), capture_output=True,
                                 text=True, cwd="/", timeout=slow(30))
        assert hostile.returncode == 0, hostile.stderr
        out, err = proc.communicate("go\n", timeout=slow(90))
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, out + err
    return {**json.loads(lines[-1]), "hostile": json.loads(hostile.stdout)}


def _never_ran(result: dict) -> None:
    """The shim ended (its supervisor's death SIGKILLs it, unless the EOF on its socket ended
    it first; one that outlived it would fail its join) and CMD never started, anywhere."""
    status = result["shim_status"]
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    refused = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 125
    assert killed or refused, result
    assert "RAN" not in result["out"], result
    assert not result["on_real_tree"], result


@pytest.fixture(scope="module", params=["root", "nobody"])
def driven(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every attack, in one driver run per user (about a second each)."""
    python, user = sys.executable, None
    base = tmp_path_factory.mktemp("shim")
    if request.param == "nobody":
        python, user = request.getfixturevalue("nobody_python"), NOBODY
        base = Path("/tmp") / f"jukebox-nobody-{os.getpid()}-shim-attacks"  # pytest's is 0700
        base.mkdir()
        request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    tree = base / "tree"
    tree.mkdir()
    if user is not None:
        for path in (base, tree):
            os.chown(path, NOBODY, NOBODY)
    return {**_drive(tree, python, user), "tree": tree}


def test_with_no_attack_cmd_runs_in_the_supervisors_view(driven: dict) -> None:
    """The control: CMD writes into the layer (the tmpfs), not the real tree, and holds no
    handle on the supervisor."""
    control = driven["control"]
    assert control["started"] and control["status"] == 0, control
    assert control["in_view"] and not control["on_real_tree"], control
    assert "RAN" in control["out"] and "pidfd" not in control["out"], control


def test_another_user_cannot_reach_the_waiting_shim(driven: dict) -> None:
    """Neither its socket nor any of its descriptors, nor ptrace, a signal or its namespaces;
    the supervisor's own spec then runs as it should."""
    assert driven["hostile"] and all(
        outcome in ("EPERM", "EACCES") for outcome in driven["hostile"].values()
    ), driven["hostile"]
    other = driven["other_user"]
    assert other["started"] and other["status"] == 0 and other["in_view"], other


def test_a_supervisor_killed_while_the_shim_waits_leaves_nothing_running(driven: dict) -> None:
    _never_ran(driven["killed_waiting"])


def test_a_supervisor_killed_once_the_spec_is_sent_leaves_nothing_running(
    driven: dict,
) -> None:
    """The shim held stopped between its spec and its join, the one moment a reparented shim
    could join the wrong namespaces."""
    _never_ran(driven["killed_after_spec"])


def test_a_supervisor_killed_once_cmd_runs_takes_cmd_with_it(driven: dict) -> None:
    """After the join (into a user namespace too, as nobody), the relay still dies with the
    supervisor, and with it the init and CMD: the agent never outlives its booth."""
    joined = driven["killed_after_join"]
    assert joined["started"].startswith("RAN"), joined
    status = joined["shim_status"]
    assert status is not None, joined  # the relay did not outlive the supervisor
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, joined
    assert joined["cmd_ended"], joined


def test_the_dead_supervisors_number_taken_by_a_hostile_process_is_never_joined(
    driven: dict,
) -> None:
    reused = driven["pid_reused"]
    assert reused["hostile"] == reused["sup"], reused  # the attack really took the number
    _never_ran(reused)


def test_a_proc_of_another_pid_namespace_cannot_point_the_shim_elsewhere(driven: dict) -> None:
    """Where /proc is not of the booth's PID namespace, the supervisor's number is, in /proc,
    a hostile process (with the real tree in its mount namespace). The shim joins the
    supervisor by a pidfd, and CMD runs in its view; through /proc/PID it wrote on the real
    tree."""
    foreign = driven["foreign_proc"]
    assert foreign["hostile"] == foreign["sup"], foreign  # the attack really took the number
    assert foreign["started"] and foreign["status"] == 0, foreign
    assert foreign["in_view"] and not foreign["on_real_tree"], foreign
    assert "RAN" in foreign["out"], foreign
    assert not (driven["tree"] / "marker").exists()
