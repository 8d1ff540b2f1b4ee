"""`jukebox warm`: commands run by a kept-alive server's child, with real processes.

A warm booth run gives what a cold one gives (exit code, output, tape); a client killed mid-run
ends its booth as a hang-up does, leaving no process or mount; SIGINT or SIGTERM sent to the
client ends the booth with the cold run's exit code and record; a server whose code changed is
not used; and the attacks are refused: an agent in a booth that reaches the server's socket (as
root and as nobody), another uid that connects, a socket directory that is a symlink or that
others may enter (as root and as nobody).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jukebox.cli import WARM_DIR_ENV, warm
from tests.booth.conftest import NOBODY
from tests.conftest import slow

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

# The command line as the console script runs it, through `python -c` so that the system Python
# nobody uses runs it too.
LAUNCH = "import sys; sys.argv[0] = 'jukebox'; from jukebox.cli import main; main()"

# What an agent in a booth does with a server's socket it can see: connect, hand over its own
# streams, ask for a command. It reports the server's first byte ("R" would be a command run).
AGENT = r"""
import json, os, socket, sys
out = {}
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sys.argv[1])
    body = b"\0".join([b"jukebox-warm/1", b"run", b"?", b"18", b"2", b"jukebox", b"ls"])
    try:
        s.sendmsg([len(body).to_bytes(4, "big") + body],
                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(memoryview(
                      __import__("array").array("i", [0, 1, 2, 0]))))])
    except BrokenPipeError:
        pass  # refused before it read: the reply is still there
    out["reply"] = s.recv(1).decode()
except OSError as error:
    out["error"] = type(error).__name__
print("AGENT " + json.dumps(out))
"""


def jukebox(
    args: list[str],
    env: dict[str, str],
    python: str = sys.executable,
    user: int | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    cmd = [python, "-c", LAUNCH, *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, cwd="/", timeout=slow(timeout))  # fmt: skip


def status(env: dict[str, str], python: str = sys.executable, user: int | None = None) -> dict:
    """`jukebox warm status --json`; root's asked from here (a start less per question)."""
    if user is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(os.path.join(env["JUKEBOX_WARM_DIR"], warm.SOCKET_NAME))
        except (FileNotFoundError, ConnectionRefusedError):
            return {"running": False}
        with sock:
            warm.request(sock, [warm.PROTOCOL, b"status"])  # type: ignore[arg-type]
            reply = b"".join(iter(lambda: sock.recv(65536), b""))
        return json.loads(reply)
    proc = jukebox(["warm", "status", "--json"], env, python, user)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _gone(pid: int, seconds: float = 10) -> bool:
    """Whether `pid` has ended (gone, or a zombie) within `seconds`; looks at least once."""
    deadline = time.monotonic() + slow(seconds)
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1][:1] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


@contextlib.contextmanager
def served(
    directory: Path, python: str = sys.executable, user: int | None = None
) -> Iterator[tuple[dict[str, str], int]]:
    """A warm server with its socket in `directory`: (the env that reaches it, its pid)."""
    env = {k: v for k, v in os.environ.items() if k != "JUKEBOX_WARM"}
    env["JUKEBOX_WARM_DIR"] = str(directory)
    proc = jukebox(["warm", "start", "--idle-timeout", "300"], env, python, user)
    assert proc.returncode == 0, proc.stderr
    pid = status(env, python, user)["pid"]
    try:
        yield env, pid
    finally:
        if not _gone(pid, 0):  # a stale server ended by itself
            jukebox(["warm", "stop"], env, python, user)
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def root_server() -> Iterator[tuple[dict[str, str], int, Path]]:
    """Root's server, its directory under /var/tmp: a booth's /tmp is its own, /var/tmp is
    the host's, so an agent sees the socket there."""
    base = Path(f"/var/tmp/jukebox-test-warm-{os.getpid()}")
    base.mkdir(mode=0o700)
    try:
        with served(base / "warm") as (env, pid):
            yield env, pid, base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _normal(text: str) -> str:
    return re.sub(r"(tree|tapes)-(warm|cold)", r"\1", text)


def _tape_digest(replayed: str) -> list:
    frames = json.loads(replayed)["frames"]
    start = frames[0]["payload"]
    # Tree ids hold the files' times, which differ between the two trees; the rest may not.
    return [[f["kind"], f["payload"].get("code")] for f in frames] + [
        start["argv"], _normal(start["cwd"]), start["env"]["names"], start["policy"],
        start["image"], start["sandbox_image"],
    ]  # fmt: skip


def test_a_warm_booth_run_gives_what_a_cold_one_gives(
    root_server: tuple[dict[str, str], int, Path],
) -> None:
    """The same exit code, output and tape; and `replay` through the server prints what it
    prints cold."""
    env, _, base = root_server
    before = status(env)["commands_run"]
    agent = "echo out; echo err >&2; echo two > b.txt; pwd; exit 3"
    # Cold: a socket directory with no server (the same variables, so the same tape).
    cold_env = {**env, "JUKEBOX_WARM_DIR": str(base / "none")}
    results, replayed = {}, {}
    for mode, run_env in (("warm", env), ("cold", cold_env)):
        tree, tapes = base / f"tree-{mode}", base / f"tapes-{mode}"
        tree.mkdir()
        (tree / "a.txt").write_text("one\n")
        proc = jukebox(["booth", "run", "--tree", str(tree), "--tape-dir", str(tapes),
                        "--tape-id", "t", "--commit", "never", "--", "sh", "-c", agent],
                       run_env)  # fmt: skip
        replay = jukebox(["replay", str(base / "tapes-warm" / "t.jbx"), "--json"], run_env)
        assert replay.returncode == 0, replay.stderr
        replayed[mode] = replay.stdout
        results[mode] = (proc.returncode, _normal(proc.stdout), _normal(proc.stderr))
    assert results["warm"][0] == 3, results["warm"]
    assert results["warm"] == results["cold"]
    assert replayed["warm"] == replayed["cold"]
    cold_tape = jukebox(["replay", str(base / "tapes-cold" / "t.jbx"), "--json"], cold_env)
    assert _tape_digest(replayed["warm"]) == _tape_digest(cold_tape.stdout)
    # The warm booth and the warm replay ran in the server's children; the cold ones did not.
    assert status(env)["commands_run"] == before + 2


def test_a_client_killed_mid_run_ends_its_booth_and_leaves_nothing(
    root_server: tuple[dict[str, str], int, Path],
) -> None:
    env, server, base = root_server
    tree, tapes = base / "tree-killed", base / "tapes-killed"
    tree.mkdir()
    marker = f"3600.{os.getpid()}"  # sleep's argument: a command line no other test has
    cmd = [sys.executable, "-c", LAUNCH, "booth", "run", "--tree", str(tree), "--tape-dir",
           str(tapes), "--tape-id", "k", "--", "sh", "-c", f"echo {marker} > f; echo started; "
           f"exec sleep {marker}"]  # fmt: skip
    client = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd="/")  # fmt: skip
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "started"
        children = [p for p in os.listdir("/proc") if p.isdigit()
                    and _ppid(int(p)) == server]  # fmt: skip
        assert len(children) == 1, "the booth runs in the server's child"
        supervisor = int(children[0])
        client.kill()
        client.wait(timeout=slow(10))
    finally:
        if client.poll() is None:
            client.kill()
    # The hang-up ends the booth as an interrupted one: the supervisor exits, nothing stays.
    assert _gone(supervisor), "the booth's supervisor outlived its client"
    leftover = [p for p in os.listdir("/proc") if p.isdigit() and marker in _cmdline(int(p))]
    assert leftover == []
    with open("/proc/self/mountinfo") as f:
        assert str(tree) not in f.read()
    record = json.loads(jukebox(["booth", "ls", "--tape-dir", str(tapes), "--json"],
                                {**env, "JUKEBOX_WARM": "off"}).stdout)  # fmt: skip
    assert [b["status"] for b in record] == ["pending"], record
    deadline = time.monotonic() + slow(5)
    while status(env)["commands_running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert status(env)["commands_running"] == 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_client_ends_the_booth_as_it_ends_a_cold_one(
    signum: int, root_server: tuple[dict[str, str], int, Path]
) -> None:
    """The client passes the signal on: the warm booth ends with the cold one's exit code and
    record, and the server ran it (a signal the client swallowed would leave the agent
    sleeping for an hour)."""
    env, _, base = root_server
    cold_env = {**env, "JUKEBOX_WARM_DIR": str(base / "none")}
    outcomes = {}
    for mode, run_env in (("warm", env), ("cold", cold_env)):
        before = status(env)["commands_run"]
        tree, tapes = base / f"tree-{mode}-{signum}", base / f"tapes-{mode}-{signum}"
        tree.mkdir()
        cmd = [sys.executable, "-c", LAUNCH, "booth", "run", "--tree", str(tree), "--tape-dir",
               str(tapes), "--", "sh", "-c", "echo started; exec sleep 3600"]  # fmt: skip
        client = subprocess.Popen(cmd, env=run_env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd="/")  # fmt: skip
        try:
            assert client.stdout is not None
            assert client.stdout.readline().strip() == "started"
            client.send_signal(signum)
            code = client.wait(timeout=slow(20))
        finally:
            if client.poll() is None:
                client.kill()
        record = json.loads(jukebox(["booth", "ls", "--tape-dir", str(tapes), "--json"],
                                    {**env, "JUKEBOX_WARM": "off"}).stdout)  # fmt: skip
        ran_warm = status(env)["commands_run"] - before
        outcomes[mode] = (code, [b["status"] for b in record], ran_warm)
    assert outcomes["warm"][2] == 1 and outcomes["cold"][2] == 0, outcomes
    assert outcomes["warm"][:2] == outcomes["cold"][:2], outcomes
    assert outcomes["cold"][0] != 0, outcomes


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _agent_attack(run: subprocess.CompletedProcess[str]) -> dict:
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("AGENT ")), None)
    assert line is not None, (run.returncode, run.stdout, run.stderr)
    return json.loads(line.removeprefix("AGENT "))


def test_an_agent_in_a_booth_is_refused_by_roots_server(
    root_server: tuple[dict[str, str], int, Path],
) -> None:
    env, _, base = root_server
    before = status(env)
    tree = base / "tree-agent"
    tree.mkdir()
    sock = str(base / "warm" / "warm.sock")
    run = jukebox(["booth", "run", "--tree", str(tree), "--tape-dir", str(base / "tapes-agent"),
                   "--commit", "never", "--", "/usr/bin/python3", "-c", AGENT, sock],
                  {**env, "JUKEBOX_WARM": "off"})  # fmt: skip
    outcome = _agent_attack(run)
    after = status(env)
    # It reached the socket (root's booth sees /var/tmp), and was refused for its namespaces.
    assert outcome == {"reply": "N"}, outcome
    assert after["peers_refused"] == before["peers_refused"] + 1
    assert after["commands_run"] == before["commands_run"]


def test_another_uid_is_refused(root_server: tuple[dict[str, str], int, Path]) -> None:
    """nobody, given a way to the socket (its directory and the socket opened up, which the
    server never does), is still refused by its uid."""
    env, _, base = root_server
    before = status(env)
    directory = base / "warm"
    os.chmod(base, 0o711)
    os.chmod(directory, 0o711)
    os.chmod(directory / "warm.sock", 0o666)
    try:
        run = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             "/usr/bin/python3", "-c", AGENT, str(directory / "warm.sock")],
            capture_output=True, text=True, timeout=slow(30),
        )  # fmt: skip
    finally:
        os.chmod(directory / "warm.sock", 0o600)
        os.chmod(directory, 0o700)
        os.chmod(base, 0o700)
    assert _agent_attack(run) == {"reply": "N"}
    after = status(env)
    assert after["peers_refused"] == before["peers_refused"] + 1
    assert after["commands_run"] == before["commands_run"]


def test_a_peer_in_a_chroot_is_refused(root_server: tuple[dict[str, str], int, Path]) -> None:
    """Root in a chroot that holds the socket: the same uid and namespaces, another root
    directory (paths it would hand over resolve elsewhere), refused. Root only: an unprivileged
    user can chroot only in a user namespace of its own, refused by the namespace check (the
    nobody booth test)."""
    env, _, base = root_server
    before = status(env)
    # The agent's modules imported before the chroot, which holds no Python.
    chrooted = (
        "import array, json, os, socket, sys; agent = sys.argv[2]; os.chroot(sys.argv[1]); "
        "os.chdir('/'); sys.argv = ['agent', '/warm/warm.sock']; exec(agent)"
    )
    run = subprocess.run([sys.executable, "-c", chrooted, str(base), AGENT],
                         capture_output=True, text=True, timeout=slow(30))  # fmt: skip
    assert _agent_attack(run) == {"reply": "N"}
    after = status(env)
    assert after["peers_refused"] == before["peers_refused"] + 1
    assert after["commands_run"] == before["commands_run"]


# A listener of `uid` at argv[1], moved by the test to the client's socket path once ready; it
# reports what the client sent it: a client that hands its streams over would send fds.
PLANTED = r"""
import array, json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o666)
s.listen(8)
s.settimeout(10)
print("ready", flush=True)
got = {"connections": 0, "bytes": 0, "fds": 0}
try:
    while got["connections"] < 2:
        conn, _ = s.accept()
        got["connections"] += 1
        conn.settimeout(10)
        data, anc, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(64))
        got["bytes"] += len(data)
        got["fds"] += sum(len(raw) // 4 for _, _, raw in anc)
except OSError:
    pass
print(json.dumps(got), flush=True)
"""


@pytest.mark.parametrize("client_is_nobody", [False, True], ids=["root", "nobody"])
def test_another_uids_server_at_the_users_own_socket_gets_nothing(
    client_is_nobody: bool, request: pytest.FixtureRequest
) -> None:
    """A listener of another uid at the socket path in the client's own (valid) directory: the
    client checks the server's uid (SO_PEERCRED) and hangs up, never handing over its streams,
    and runs cold."""
    python = request.getfixturevalue("nobody_python")
    client, server = (NOBODY, 0) if client_is_nobody else (0, NOBODY)
    root = Path(f"/var/tmp/jukebox-test-warm-planted-{os.getpid()}-{int(client_is_nobody)}")
    root.mkdir(mode=0o711)
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    staging, directory = root / "staging", root / "warm"
    staging.mkdir(mode=0o700)
    os.chown(staging, server, server)
    directory.mkdir(mode=0o700)
    os.chown(directory, client, client)
    listener = subprocess.Popen(
        [*(["setpriv", f"--reuid={server}", f"--regid={server}", "--clear-groups"]
           if server else []), "/usr/bin/python3", "-c", PLANTED, str(staging / "l.sock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert listener.stdout is not None
        assert listener.stdout.readline().strip() == "ready"
        os.rename(staging / "l.sock", directory / warm.SOCKET_NAME)  # root moves it in
        check = ("from jukebox.cli import warm; "
                 "print(warm.connect() is None, warm.run(['ls']) is None)")  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "JUKEBOX_WARM"}
        env[WARM_DIR_ENV] = str(directory)
        cmd = [python if client else sys.executable, "-c", check]
        if client:
            cmd = ["setpriv", f"--reuid={client}", f"--regid={client}", "--clear-groups", *cmd]
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              cwd="/", env=env, timeout=slow(30))  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["True", "True"]
        got = json.loads(listener.communicate(timeout=slow(30))[0].splitlines()[-1])
    finally:
        if listener.poll() is None:
            listener.kill()
    # It reached the listener (so the uid check, not the path, stopped it) and sent nothing.
    assert got == {"connections": 2, "bytes": 0, "fds": 0}, got


# Run as the user under test: for each bad directory, the client must not connect and the
# server must not start.
DIR_CHECK = r"""
import json, os, sys
from jukebox.cli import WARM_DIR_ENV, warm, warm_server
out = {}
for name, path in json.loads(sys.argv[1]).items():
    os.environ[WARM_DIR_ENV] = path
    try:
        warm_server.start_server(60.0)
        started = "started"
    except Exception as error:
        started = str(error)
    out[name] = [warm.connect() is None, warm.run(["ls"]) is None, started]
print(json.dumps(out))
"""


@pytest.mark.parametrize("as_nobody", [False, True], ids=["root", "nobody"])
def test_a_socket_dir_that_is_not_the_users_alone_is_never_used(
    as_nobody: bool, request: pytest.FixtureRequest
) -> None:
    """A listener sits in each bad directory (a server someone else could have put there): the
    client never connects to it, and `warm start` refuses the directory."""
    root = Path(f"/var/tmp/jukebox-test-warm-dirs-{os.getpid()}-{int(as_nobody)}")
    root.mkdir()
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    python = request.getfixturevalue("nobody_python") if as_nobody else sys.executable
    user = NOBODY if as_nobody else 0
    (root / "real").mkdir(mode=0o700)
    (root / "loose").mkdir()
    os.chmod(root / "loose", 0o755)
    (root / "others").mkdir(mode=0o700)
    (root / "link").symlink_to(root / "real")
    for path in (root, root / "real", root / "loose"):
        os.chown(path, user, user)
    os.chown(root / "others", 65533 if as_nobody else NOBODY, 0)
    dirs = {"a symlink": root / "link", "a loose mode": root / "loose",
            "another owner": root / "others"}  # fmt: skip
    listeners = []
    for path in (root / "real", root / "loose", root / "others"):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path / warm.SOCKET_NAME))
        os.chmod(path / warm.SOCKET_NAME, 0o666)
        listener.listen(8)
        listener.setblocking(False)
        listeners.append(listener)
    cmd = [python, "-c", DIR_CHECK, json.dumps({k: str(v) for k, v in dirs.items()})]
    if as_nobody:
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
    env = {k: v for k, v in os.environ.items() if k != "JUKEBOX_WARM"}  # tests/conftest's off
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          cwd="/", env=env, timeout=slow(30))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for what, (no_connection, cold, started) in json.loads(proc.stdout).items():
        assert no_connection and cold, what
        assert started.startswith("the warm server did not start"), (what, started)
    for listener in listeners:
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
        listener.close()
    assert not (root / "real" / warm_server_log()).exists()


def warm_server_log() -> str:
    from jukebox.cli.warm_server import LOG_NAME

    return LOG_NAME


def test_an_agent_in_nobodys_booth_is_refused_by_nobodys_server(
    nobody_python: str, nobody_tree: tuple[Path, Path], open_dev_fuse: None
) -> None:
    tree, tapes = nobody_tree
    base = Path(f"/var/tmp/jukebox-test-warm-nobody-{os.getpid()}")
    base.mkdir(mode=0o700)
    os.chown(base, NOBODY, NOBODY)
    try:
        with served(base / "warm", nobody_python, NOBODY) as (env, pid):
            with open(f"/proc/{pid}/status") as f:
                assert f"Uid:\t{NOBODY}\t" in f.read()
            run = jukebox(["booth", "run", "--tree", str(tree), "--tape-dir", str(tapes),
                           "--commit", "never", "--", "/usr/bin/python3", "-c", AGENT,
                           str(base / "warm" / "warm.sock")],
                          {**env, "JUKEBOX_WARM": "off"}, nobody_python, NOBODY)  # fmt: skip
            outcome = _agent_attack(run)
            after = status(env, nobody_python, NOBODY)
        assert outcome == {"reply": "N"}, outcome
        assert after["peers_refused"] == 1 and after["commands_run"] == 0, after
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_server_whose_code_changed_is_not_used(tmp_path: Path) -> None:
    """A package directory on sys.path that changes (here a module added to a PYTHONPATH
    entry) makes the server answer cold, and stop."""
    extra = tmp_path / "extra"
    extra.mkdir()
    base = Path(f"/var/tmp/jukebox-test-warm-stale-{os.getpid()}")
    base.mkdir(mode=0o700)
    try:
        path = os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), str(extra)) if x)
        os.environ["PYTHONPATH"], saved = path, os.environ.get("PYTHONPATH")
        try:
            with served(base / "warm") as (env, pid):
                listed = jukebox(["ls", "--tape-dir", str(tmp_path), "--json"], env)
                assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed
                assert status(env)["commands_run"] == 1
                # Another hash seed than the server's children would have: cold.
                seeded = jukebox(["ls", "--tape-dir", str(tmp_path), "--json"],
                                 {**env, "PYTHONHASHSEED": "1"})  # fmt: skip
                assert seeded.stdout == listed.stdout
                assert status(env)["commands_run"] == 1 and status(env)["answered_cold"] == 1
                (extra / "newmodule.py").write_text("")
                assert not status(env)["code_current"]
                assert jukebox(["ls", "--tape-dir", str(tmp_path)], env).returncode == 0
                assert _gone(pid), "a stale server stops once it was asked"
                assert not status(env)["running"]
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = saved
    finally:
        shutil.rmtree(base, ignore_errors=True)
