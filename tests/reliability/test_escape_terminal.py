"""The operator's terminal and process group, attacked from inside a booth.

An operator, `bash -i` on a real pseudo-terminal that this test drives as a person at a keyboard
would, runs two booths one after the other, once as root (`--fs fuse`) and once as `nobody`
(`--fs overlay`, through the user namespace):

* an interactive agent, which reports what its terminal is, waits for a window size change and
  for a Ctrl-C typed by the operator (its SIGINT handler prints and exits), and on the way tries
  TIOCSTI with `touch /tmp/pwned-…`;
* a hostile agent under `--commit ask`: it reports its session and terminal, pushes
  `y\\n` and `touch /tmp/pwned-…\\n` with TIOCSTI into every terminal it holds or can open, stops
  its whole process group (`kill(0, SIGSTOP)`, a helper of its own continues it), hangs its
  terminal up (`vhangup()`) and ends with `kill(0, SIGKILL)`. The operator answers `k` (keep).

The operator's shell must survive all of it, run nothing the agents pushed, and see the booth
finish with the agent's own outcome; the booth must stay pending (no injected `y` answered it).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.reliability.conftest import AGENT_PYTHON, JUKEBOX, NOBODY, booth_argv, jb

# Shared by both agents: an attempt's outcome is "ok" or the errno's name.
COMMON = r"""
import ctypes, errno, fcntl, json, os, signal, struct, sys, termios, time

cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)

def outcome(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))

def tty_nr():
    stat = open("/proc/self/stat").read()
    return int(stat[stat.rfind(")") + 2:].split()[4])

def push(fd, text):
    # TIOCSTI: as if typed on that terminal; the first refusal ends it
    for byte in text.encode():
        fcntl.ioctl(fd, termios.TIOCSTI, bytes([byte]))

def push_everywhere(text):
    found = {}
    targets = [("fd0", 0), ("fd1", 1), ("fd2", 2)]
    for name, path in (("dev_tty", "/dev/tty"), ("operator_tty", cfg["operator_tty"])):
        try:
            targets.append((name, os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)))
        except OSError as e:
            found[name] = {"open": errno.errorcode.get(e.errno, str(e.errno))}
    for name, fd in targets:
        try:  # TIOCGDEV: the terminal behind the fd (/dev/tty's own node says nothing)
            dev = struct.unpack("I", fcntl.ioctl(fd, 0x80045432, bytes(4)))[0]
        except OSError:
            dev = None
        found[name] = {"dev": dev, "push": outcome(lambda: push(fd, text))}
    return found

def stop_own_group():
    # kill(0, SIGSTOP) stops our whole process group; a helper in a group of its own continues
    # it. A group led outside the booth (the caller's) has no number in here: then the helper
    # continues us alone, and whatever else the signal stopped stays stopped.
    me, group = os.getpid(), os.getpgid(0)
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.setpgid(0, 0)
        os.read(go_r, 1)
        while open(f"/proc/{me}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)
        os.kill(-group if group > 0 else me, signal.SIGCONT)
        os._exit(0)
    os.setpgid(helper, helper)
    os.write(go_w, b"x")
    result = outcome(lambda: os.kill(0, signal.SIGSTOP))
    os.waitpid(helper, 0)
    return result
"""

INTERACTIVE = COMMON + r"""
def size():
    rows, cols = struct.unpack("HHHH", fcntl.ioctl(1, termios.TIOCGWINSZ, bytes(8)))[:2]
    return f"{rows}x{cols}"

def say(line):  # a handler may run inside another's print: no buffered stream here
    os.write(1, (line + "\n").encode())

signal.signal(signal.SIGWINCH, lambda *_: say("WINCH " + size()))
for name in ("SIGTSTP", "SIGQUIT"):
    signal.signal(getattr(signal, name), lambda *_, n=name: say(f"{n}-REACHED"))

def interrupted(*_):
    say("SIGINT-REACHED-THE-AGENT")
    os._exit(0)

signal.signal(signal.SIGINT, signal.SIG_IGN if cfg.get("ignore_sigint") else interrupted)
report = {
    "tty_nr": tty_nr(),
    "isatty": [os.isatty(fd) for fd in (0, 1, 2)],
    "size": size(),
    "tiocsti": push_everywhere(f"touch {cfg['pwned']}-interactive\n"),
}
print("REPORT " + json.dumps(report), flush=True)
# Not signal.pause(): a signal landing after the interpreter's last check and before pause(2)
# runs its handler only at the next signal (the CI lost a typed Ctrl-\ so, under load); a
# sleep returns, and the handler runs, within its period.
while True:
    time.sleep(0.05)
"""

HOSTILE = COMMON + r"""
open("changed.txt", "w").write("only a `y` typed by the operator commits this\n")
report = {"pid": os.getpid(), "sid": os.getsid(0), "tty_nr": tty_nr()}
report["tiocsti"] = push_everywhere(f"y\ntouch {cfg['pwned']}-hostile\n")
report["kill0_sigstop"] = stop_own_group()

try:  # where the agent's /dev has a devpts of its own, the pty has no name in it
    own_tty = os.ttyname(0)
except OSError:
    own_tty = None
print("REPORT " + json.dumps(report), flush=True)
# A hangup discards what the relay has not read yet: wait until the operator saw the report.
for line in sys.stdin:  # (after the lines pushed above)
    if line.strip() == "go":
        break
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # vhangup sends it to our session
hung = libc.vhangup()
hangup = "ok" if hung == 0 else errno.errorcode.get(ctypes.get_errno(), "?")
try:  # the hung-up fds are dead; the terminal itself is not
    fd = os.open(own_tty, os.O_WRONLY | os.O_NOCTTY)
    os.write(fd, f"VHANGUP {hangup}\r\n".encode())
except (OSError, TypeError):
    pass
os.kill(0, signal.SIGKILL)
"""

# Run with no terminal on stdin, stdout or stderr, as the agent and as the verifier: no tty at
# all, still a session of its own; exits 0 only when all of that holds.
PIPED = COMMON + r"""
report = {
    "isatty": [os.isatty(fd) for fd in (0, 1, 2)],
    "dev_tty": outcome(lambda: os.open("/dev/tty", os.O_RDWR)),
    # Led by a process in the booth (CMD: the verifier's python runs under `sh -c`); a session
    # led outside the booth's PID namespace shows as 0.
    "session_in_booth": os.getsid(0) > 0,
    "kill0_sigstop": stop_own_group(),
}
print("REPORT " + json.dumps(report), flush=True)
expected = {"isatty": [False] * 3, "dev_tty": "ENXIO", "session_in_booth": True}
sys.exit(0 if report == {**expected, "kill0_sigstop": "ok"} else 1)
"""


def encode_dev(rdev: int) -> int:
    """A device number as /proc/PID/stat's tty_nr field writes it (the kernel's new_encode_dev)."""
    major, minor = os.major(rdev), os.minor(rdev)
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


class Operator:
    """`bash -i` on a pty of its own, typed at and read like a screen."""

    def __init__(self, user: int | None, env: dict[str, str]) -> None:
        self.leader, follower = os.openpty()
        self.resize(24, 200)  # a fresh pty is 0x0, which line editing takes badly
        self.tty_path = os.ttyname(follower)
        self.tty_rdev = os.fstat(follower).st_rdev
        cmd = ["bash", "--norc", "--noprofile", "-i"]
        if user is not None:
            cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]

        def take_terminal() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.shell = subprocess.Popen(
            cmd,
            stdin=follower,
            stdout=follower,
            stderr=follower,
            env={**env, "PS1": "operator$ ", "HISTFILE": "/dev/null", "TERM": "dumb"},
            preexec_fn=take_terminal,
            cwd="/",
        )
        os.close(follower)
        self.screen = b""
        self.seen = 0  # what `expect` already matched stays behind it

    def type(self, keys: str) -> None:
        os.write(self.leader, keys.encode())

    def expect(self, pattern: str, timeout: float = 90) -> re.Match[bytes]:
        regex = re.compile(pattern.encode())
        deadline = time.monotonic() + timeout
        while True:
            found = regex.search(self.screen, self.seen)
            if found:
                self.seen = found.end()
                return found
            left = deadline - time.monotonic()
            if left <= 0 or (self.shell.poll() is not None and not self._read(0)):
                raise AssertionError(
                    f"never saw {pattern!r} (shell {self.shell.poll()}); the screen:\n"
                    + self.screen.decode(errors="replace")[-3000:]
                )
            self._read(min(left, 0.5))

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.leader], [], [], timeout)
        if not ready:
            return False
        try:
            chunk = os.read(self.leader, 65536)
        except OSError:  # the shell is gone and the pty with it
            return False
        self.screen += chunk
        return bool(chunk)

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.leader, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def run(self, command: str) -> int:
        """Types `command`, waits for it to end, returns its exit status as the shell saw it."""
        self.type(f"{command}; echo RC-$((1000 + $?))\r")
        return int(self.expect(r"RC-1(\d\d\d)").group(1))

    def alive(self) -> bool:
        """The shell still runs commands: it computes what only a live shell prints."""
        self.type("echo ALIVE-$((6 * 7))\r")
        self.expect(r"ALIVE-42")
        return self.shell.poll() is None

    def close(self) -> None:
        if self.shell.poll() is None:
            self.shell.kill()
        self.shell.wait()
        os.close(self.leader)


@dataclass
class Session:
    user: str
    operator: Operator
    pwned: str
    interactive: dict
    interactive_events: list[str]
    interactive_code: int
    hostile: dict
    hostile_code: int
    piped: dict
    piped_code: int
    verified_code: int
    cooked: dict
    cooked_events: list[str]
    cooked_code: int
    terminated_code: int
    stubborn_code: int
    stty: str  # the operator's terminal settings after all of it
    tree: Path
    tapes: Path
    booths: list[dict]


def report(operator: Operator) -> dict:
    return json.loads(operator.expect(r"REPORT (\{[^\r\n]*\})").group(1))


@pytest.fixture(scope="module", params=["root-fuse", "nobody-overlay"])
def session(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Session]:
    request.getfixturevalue("booth_ready")
    user, fs = request.param.split("-")
    uid: int | None = None
    python: str | None = None
    if user == "nobody":
        python = request.getfixturevalue("nobody_python")
        uid = NOBODY
        work = Path("/tmp") / f"jukebox-tty-{os.getpid()}"
        work.mkdir()
        os.chown(work, NOBODY, NOBODY)
    else:
        work = tmp_path_factory.mktemp("tty")
    tree, tapes = work / "tree", work / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    for p in (tree, tree / "a.txt"):
        if uid is not None:
            os.chown(p, uid, uid)
    (tree / "interactive.py").write_text(INTERACTIVE)
    (tree / "hostile.py").write_text(HOSTILE)
    (tree / "piped.py").write_text(PIPED)
    pwned = f"/tmp/pwned-{os.getpid()}-{user}"
    env = dict(os.environ, PATH=f"{Path(JUKEBOX).parent}:{os.environ.get('PATH', '')}")
    jukebox = [JUKEBOX]
    if python is not None:
        jukebox = [python, "-c", "from jukebox.cli import main; main()"]
    operator = Operator(uid, env)
    try:
        operator.expect(r"operator\$ ")
        cfg = json.dumps({"pwned": pwned, "operator_tty": operator.tty_path})

        def booth(tape_id: str, agent: str, *opts: str, config: str = cfg) -> str:
            argv = [*jukebox, *booth_argv(tree, tapes, tape_id, "--fs", fs, *opts)]
            return shlex.join([*argv, AGENT_PYTHON, "-I", agent, config])

        # No terminal on any stdio fd (the booth is still the operator's foreground job).
        piped_log = work / "piped.log"
        verifier = shlex.join([AGENT_PYTHON, "-I", "piped.py", cfg])
        command = booth("piped", "piped.py", "--commit", "never", "--verify", verifier)
        piped_code = operator.run(f"{command} </dev/null >{piped_log} 2>&1")
        piped = json.loads(piped_log.read_text().split("REPORT ", 1)[1].splitlines()[0])
        # The same verifier after an agent that had the booth's pty: it gets none of it.
        argv = booth_argv(tree, tapes, "verified", "--fs", fs, "--commit", "never")
        verified_code = operator.run(
            shlex.join([*jukebox, *argv[:-1], "--verify", verifier, "--", "true"])
        )

        operator.type(booth("interactive", "interactive.py", "--commit", "never") + "\r")
        interactive = report(operator)
        operator.resize(33, 101)  # the kernel sends SIGWINCH to the booth, the operator's job
        events = [operator.expect(r"WINCH \d+x\d+").group(0).decode()]
        for key in ("\x1a", "\x1c"):  # Ctrl-Z, Ctrl-\\: the agent's own terminal signals
            operator.type(key)
            events.append(operator.expect(r"SIG[A-Z]+-REACHED").group(0).decode())
        operator.type("\x03")  # Ctrl-C
        operator.expect(r"SIGINT-REACHED-THE-AGENT")
        # Typed only once the booth is done with the terminal (the keys would be the agent's).
        operator.expect(r"kept pending")
        operator.type("echo RC-$((1000 + $?))\r")
        interactive_code = int(operator.expect(r"RC-1(\d\d\d)").group(1))

        # stdin a pipe: the operator's terminal stays cooked, its Ctrl-C signals the booth (the
        # operator's foreground job), which sends it on through the agent's pty.
        operator.type("true | " + booth("cooked", "interactive.py", "--commit", "never") + "\r")
        cooked = report(operator)
        operator.resize(30, 90)
        cooked_events = [operator.expect(r"WINCH \d+x\d+").group(0).decode()]
        operator.type("\x03")
        cooked_events.append(operator.expect(r"SIGINT-REACHED-THE-AGENT").group(0).decode())
        operator.expect(r"kept pending")
        operator.type("echo RC-$((1000 + $?))\r")
        cooked_code = int(operator.expect(r"RC-1(\d\d\d)").group(1))

        # An agent that ignores SIGINT: the second typed Ctrl-C kills it.
        stubborn_cfg = json.dumps({**json.loads(cfg), "ignore_sigint": True})
        command = booth("stubborn", "interactive.py", "--commit", "never", config=stubborn_cfg)
        operator.type(command + "\r")
        report(operator)
        operator.type("\x03")
        operator.expect(r"interrupt again to kill it")
        operator.type("\x03")
        operator.expect(r"kept pending")
        operator.type("echo RC-$((1000 + $?))\r")
        stubborn_code = int(operator.expect(r"RC-1(\d\d\d)").group(1))

        # SIGTERM to the booth while its agent holds the operator's terminal raw.
        operator.type(booth("terminated", "interactive.py", "--commit", "never") + "\r")
        report(operator)
        os.killpg(os.tcgetpgrp(operator.leader), signal.SIGTERM)  # the foreground job
        operator.expect(r"kept pending")
        operator.type("echo RC-$((1000 + $?))\r")
        terminated_code = int(operator.expect(r"RC-1(\d\d\d)").group(1))
        operator.type("stty -a; echo STTY-DONE\r")
        stty = operator.expect(r"(?s)\r\n(speed .*?)STTY-DONE").group(1).decode()

        operator.type(booth("hostile", "hostile.py", "--commit", "ask") + "\r")
        hostile = report(operator)
        operator.type("go\r")
        operator.expect(r"commit these changes to the real tree\?[^\r\n]*: ")
        operator.type("k\r")
        operator.type("echo RC-$((1000 + $?))\r")
        hostile_code = int(operator.expect(r"RC-1(\d\d\d)").group(1))
        listing = jb("booth", "ls", "--json", "--tape-dir", str(tapes), python=python, user=uid)
        booths = json.loads(listing.stdout) if listing.returncode == 0 else []
        yield Session(
            user=user,
            operator=operator,
            pwned=pwned,
            interactive=interactive,
            interactive_events=events,
            interactive_code=interactive_code,
            hostile=hostile,
            hostile_code=hostile_code,
            piped=piped,
            piped_code=piped_code,
            verified_code=verified_code,
            cooked=cooked,
            cooked_events=cooked_events,
            cooked_code=cooked_code,
            terminated_code=terminated_code,
            stubborn_code=stubborn_code,
            stty=stty,
            tree=tree,
            tapes=tapes,
            booths=booths,
        )
    finally:
        operator.close()
        for suffix in ("interactive", "hostile"):
            Path(f"{pwned}-{suffix}").unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def test_the_operators_shell_survives_and_runs_nothing_the_agents_pushed(
    session: Session,
) -> None:
    # (1) TIOCSTI, (3) kill(0, SIGSTOP/SIGKILL), (4) vhangup: the shell still runs commands...
    assert session.operator.alive()
    # ... and ran none of the agents' (it ran everything typed before this, in order).
    assert session.operator.run(f"test -e {session.pwned}-interactive") == 1
    assert session.operator.run(f"test -e {session.pwned}-hostile") == 1
    operators = encode_dev(session.operator.tty_rdev)
    for report_ in (session.interactive, session.hostile):
        own = report_["tty_nr"]  # the agent's controlling terminal
        assert own not in (0, operators), report_
        for target, result in report_["tiocsti"].items():
            # A push either failed or landed on the agent's own pty, never the operator's.
            assert result.get("push") in (None, "ok", "EPERM", "EIO"), (target, result)
            if result.get("push") == "ok":
                assert result["dev"] == own, (target, result)


def test_the_agent_has_a_session_and_a_pty_of_its_own(session: Session) -> None:
    # (5) the agent leads its own session, on a terminal that is not the operator's.
    hostile = session.hostile
    assert hostile["sid"] == hostile["pid"], hostile
    assert hostile["tty_nr"] not in (0, encode_dev(session.operator.tty_rdev)), hostile
    assert hostile["tty_nr"] == hostile["tiocsti"]["fd0"]["dev"], hostile


def test_kill_of_its_process_group_reaches_only_the_agent(session: Session) -> None:
    # (3) SIGSTOP stopped the agent's own group (its helper continued it), not the supervisor:
    # the booth went on to ask; SIGKILL ended the agent, and the booth reported it as such.
    assert session.hostile["kill0_sigstop"] == "ok"
    assert session.hostile_code == 128 + 9


def test_pushed_input_cannot_answer_the_commit_question(session: Session) -> None:
    # (2) the injected `y` never answered: the operator's `k` kept the booth pending.
    assert not (session.tree / "changed.txt").exists()
    assert [b["status"] for b in session.booths if b["id"] == "hostile"] == ["pending"]


def test_without_a_terminal_the_agent_and_the_verifier_have_none_and_own_sessions(
    session: Session,
) -> None:
    assert session.piped == {
        "isatty": [False, False, False],
        "dev_tty": "ENXIO",  # the operator's terminal is the supervisor's alone
        "session_in_booth": True,
        "kill0_sigstop": "ok",  # and the booth, the operator's job, was not stopped with it
    }
    assert session.piped_code == 0
    for run in ("piped", "verified"):  # the same checks, as the verifier (no terminal, and
        # after an agent on the booth's pty)
        assert [b["verify"]["ok"] for b in session.booths if b["id"] == run] == [True], run
    assert session.verified_code == 0


def test_an_interactive_agent_gets_a_terminal_its_size_and_the_operators_ctrl_c(
    session: Session,
) -> None:
    # (6) a tty on every stdio fd, the window size kept up to date, the typed Ctrl-Z, Ctrl-\
    # and Ctrl-C delivered to it as SIGTSTP, SIGQUIT and SIGINT (and the booth still running).
    assert session.interactive["isatty"] == [True, True, True]
    assert session.interactive["size"] == "24x200"
    assert session.interactive_events == ["WINCH 33x101", "SIGTSTP-REACHED", "SIGQUIT-REACHED"]
    # Its handler exited 0; the booth counts the typed Ctrl-C as an interruption and keeps it.
    assert session.interactive_code == 130
    assert [b["status"] for b in session.booths if b["id"] == "interactive"] == ["pending"]


def test_without_raw_mode_the_operators_ctrl_c_is_sent_on_through_the_pty(
    session: Session,
) -> None:
    assert session.cooked["isatty"] == [False, True, True]  # stdin stayed the pipe it was
    assert session.cooked_events == ["WINCH 30x90", "SIGINT-REACHED-THE-AGENT"]
    assert session.cooked_code == 130


def test_a_second_typed_ctrl_c_kills_an_agent_that_ignores_the_first(session: Session) -> None:
    assert session.stubborn_code == 128 + signal.SIGKILL


def test_the_operators_terminal_settings_come_back_after_a_signal(session: Session) -> None:
    assert session.terminated_code == 128 + signal.SIGTERM  # passed on to the agent
    flags = set(session.stty.split())
    assert {"icanon", "isig", "echo", "icrnl", "opost"} <= flags, session.stty
