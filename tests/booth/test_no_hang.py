"""No tree may hang the booth: the supervisor never reads through its own layer, and a stuck FUSE
connection is freed by `jukebox booth abort`.

The supervisor's own opens at the tree's path (pwd lookups in /etc, certificates, shared
libraries and /etc/ld.so.cache mapped by dlopen, lazy imports under /usr) used to go through its
own FUSE server; a page fault on such a mapping under the GIL waited for a worker that needed the
GIL. Now the supervisor's namespace shows the real tree at the tree's path, and only the agent's
view has the layer there."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jukebox.booth.scratchdir import socket_dir_prefix
from tests.booth.conftest import NOBODY

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

JUKEBOX = str(Path(sys.executable).parent / "jukebox")
LAYER_FSTYPE = "fuse.shadowfs"


def _command(python: str | None, user: int | None, *args: str) -> list[str]:
    cmd = (
        [JUKEBOX, *args]
        if python is None
        else [python, "-c", "from jukebox.cli import main; main()", *args]
    )
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return cmd


def jb(*args: str, python: str | None = None, user: int | None = None, timeout: float = 120):
    return subprocess.run(
        _command(python, user, *args), capture_output=True, text=True, cwd="/", timeout=timeout
    )


def mounts(pid: int | str) -> list[tuple[str, str, str]]:
    """(device, mount point, fstype) of process `pid`'s namespace."""
    out = []
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            head, _, tail = line.partition(" - ")
            fields = head.split(" ")
            out.append((fields[2], fields[4], tail.split(" ")[0]))
    return out


def layer_mounts(pid: int, tapes: Path, booth_id: str) -> list[tuple[str, str, str]]:
    """The booth's layer in its supervisor's namespace: at <tape dir>/.jukebox/mnt/<id>."""
    where = str(tapes / ".jukebox" / "mnt" / booth_id)
    return [m for m in mounts(pid) if m[1] == where and m[2] == LAYER_FSTYPE]


def wait_for(predicate, what: str, proc: subprocess.Popen) -> None:
    # Waiting for a state, not timing it: the bound only turns a broken run into a failure.
    deadline = time.monotonic() + 60
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the booth ended before {what} (rc {proc.returncode}):\n{out}\n{err}")
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.05)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:  # a failed test must not leave a booth (or its mount) behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_booth(
    started: list, tree: Path, tapes: Path, booth_id: str, script: str, python=None, user=None
) -> subprocess.Popen:
    args = ["booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", booth_id]
    proc = subprocess.Popen(
        _command(python, user, *args, "--commit", "never", "--", "sh", "-c", script),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    started.append(proc)
    return proc


def nothing_left(booth_id: str, tree: Path, tapes: Path) -> None:
    layer = tapes / ".jukebox" / "mnt" / booth_id
    assert not [m for m in mounts("self") if m[1] in (str(tree), str(layer))]
    assert not layer.exists()
    prefix = socket_dir_prefix(tapes, booth_id)
    assert not [n for n in os.listdir("/tmp") if n.startswith(prefix)]


@pytest.fixture(params=["root", "nobody"])
def who(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str | None, int | None, Path]:
    """(python, user, a directory both may use) for a booth run as root or as nobody."""
    if request.param == "root":
        return None, None, tmp_path
    python = request.getfixturevalue("nobody_python")
    request.getfixturevalue("open_dev_fuse")
    return python, NOBODY, request.getfixturevalue("nobody_dir")


def test_the_supervisor_sees_the_real_tree_and_the_agent_the_layer(started, who) -> None:
    python, user, base = who
    tree, tapes = base / "tree", base / "tapes"
    tree.mkdir()
    (tree / "f").write_text("base\n")
    if user is not None:
        os.chown(tree, user, user)
        os.chown(tree / "f", user, user)
    proc = start_booth(
        started,
        tree,
        tapes,
        "nohang1",
        "grep ' - fuse.shadowfs ' /proc/self/mountinfo | cut -d' ' -f5;"
        " read go; echo agent > f; cat f",
        python=python,
        user=user,
    )
    wait_for(
        lambda: layer_mounts(proc.pid, tapes, "nohang1"),
        "the layer mounted",
        proc,
    )
    supervisor_view = mounts(proc.pid)
    assert not [m for m in supervisor_view if m[1] == str(tree)], supervisor_view
    assert (tree / "f").read_text() == "base\n"
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, err
    # The agent saw exactly one layer (at the tree's path, not also at the staging dir) and
    # wrote through it; the real tree is untouched (--commit never).
    shadowfs_mounts = out.split()[:-1]
    assert shadowfs_mounts.count(str(tree)) == 1, (out, err)
    assert not [m for m in shadowfs_mounts if "/.jukebox/mnt/" in m], (out, err)
    assert out.split()[-1] == "agent", (out, err)
    assert (tree / "f").read_text() == "base\n"
    nothing_left("nohang1", tree, tapes)


def test_a_booth_over_the_real_etc_finishes_and_leaves_etc_alone(tmp_path: Path) -> None:
    # The reproduction. Safe: --commit never keeps the change in the booth only, and the
    # booth is discarded afterwards.
    hosts = Path("/etc/hosts").read_bytes()
    tapes = tmp_path / "tapes"
    proc = jb(
        "booth",
        "run",
        "--tree",
        "/etc",
        "--tape-dir",
        str(tapes),
        "--tape-id",
        "etc1",
        "--commit",
        "never",
        "--",
        "bash",
        "-c",
        "echo '# jukebox-test' >> hosts && tail -n 1 hosts && getent passwd root",
    )
    assert proc.returncode == 0, proc.stderr
    assert "# jukebox-test" in proc.stdout and "root:" in proc.stdout
    assert Path("/etc/hosts").read_bytes() == hosts
    nothing_left("etc1", Path("/etc"), tapes)
    assert jb("booth", "discard", "etc1", "--tape-dir", str(tapes)).returncode == 0


# Each create and unlink is a request the layer's server must answer (a write to a file the
# kernel has open and cached may never reach it).
AGENT_LOOP = "while :; do echo y > new; rm new; done"


def running(command: str) -> bool:
    """Whether `sh -c command` runs, in whatever PID namespace: seen in /proc (the whole
    command line, not the `jukebox booth run ... -- sh -c command` that starts it)."""
    wanted = f"sh\0-c\0{command}\0".encode()
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if pid.isdigit() and Path(f"/proc/{pid}/cmdline").read_bytes() == wanted:
                return True
    return False


@pytest.mark.serial  # failed under load before; finds its agent by command line
def test_abort_frees_an_agent_stuck_on_the_layer(started, who) -> None:
    python, user, base = who
    tree, tapes = base / "tree", base / "tapes"
    tree.mkdir()
    if user is not None:
        os.chown(tree, user, user)
    proc = start_booth(
        started,
        tree,
        tapes,
        "stuck1",
        # Until one of its requests finds the server stopped and stays in the kernel.
        AGENT_LOOP,
        python=python,
        user=user,
    )
    wait_for(
        lambda: layer_mounts(proc.pid, tapes, "stuck1"),
        "the layer mounted",
        proc,
    )
    device = layer_mounts(proc.pid, tapes, "stuck1")[0][0]
    connection = Path("/sys/fs/fuse/connections") / device.partition(":")[2]
    assert connection.is_dir()
    # A supervisor that no longer answers (stopped here) leaves the agent's request waiting in
    # the kernel for good; SIGKILL alone would not free it. The layer is mounted before the
    # agent starts: stopped before that, the supervisor would leave nothing waiting on it.
    wait_for(lambda: running(AGENT_LOOP), "the agent running", proc)
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for(
        lambda: int((connection / "waiting").read_text()) > 0,
        "the agent's request waiting on the layer",
        proc,
    )
    aborted = jb("booth", "abort", "stuck1", "--tape-dir", str(tapes), python=python, user=user)
    assert aborted.returncode == 0, aborted.stderr
    assert f"FUSE connection {connection.name}" in aborted.stdout
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert not connection.exists()
    listed = jb("booth", "ls", "--tape-dir", str(tapes), python=python, user=user)
    assert "stuck1" in listed.stdout and "crashed" in listed.stdout, listed.stdout
    nothing_left("stuck1", tree, tapes)
    discarded = jb("booth", "discard", "stuck1", "--tape-dir", str(tapes), python=python, user=user)
    assert discarded.returncode == 0, discarded.stderr


def test_abort_refuses_a_booth_that_is_not_running(tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    done = jb(
        "booth",
        "run",
        "--tree",
        str(tree),
        "--tape-dir",
        str(tapes),
        "--tape-id",
        "idle1",
        "--commit",
        "never",
        "--",
        "true",
    )
    assert done.returncode == 0, done.stderr
    refused = jb("booth", "abort", "idle1", "--tape-dir", str(tapes))
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "not running" in refused.stderr
    assert jb("booth", "discard", "idle1", "--tape-dir", str(tapes)).returncode == 0


def test_an_interrupt_while_the_tree_is_read_stops_the_booth(started, tmp_path: Path) -> None:
    # Reading a big tree (/usr: minutes) happens with the interrupts already blocked for the
    # booth's signal loop; Ctrl-C must still stop it there, before anything is recorded.
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    for d in range(20):
        sub = tree / f"d{d}"
        sub.mkdir(parents=True)
        for f in range(1000):
            (sub / f"f{f}").touch()
    proc = start_booth(started, tree, tapes, "big1", "true")

    def reading() -> bool:  # the tree's fd is opened just before the read starts
        for fd in Path(f"/proc/{proc.pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) == str(tree):
                    return True
        return False

    wait_for(reading, "the tree read", proc)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip() == "jukebox: interrupted", err
    assert not (tapes / "big1.jbx").exists()
    assert not (tapes / ".jukebox" / "booths" / "big1.json").exists()


def test_abort_refuses_a_connection_number_another_mount_took(tmp_path: Path) -> None:
    # A connection's number is its mount's device minor, which the kernel gives to the next
    # FUSE mount once the super block is gone: a booth ending between `booth abort`'s look at
    # its mounts and the abort would leave its number to someone else's mount.
    from jukebox.booth.abort import abort_connections
    from jukebox.errors import UsageError
    from shadowfs import fuse_wire
    from shadowfs.layer import Layer
    from shadowfs.mountctl import Mount
    from shadowfs.store import Store

    if not fuse_wire.ensure_fusectl():
        pytest.skip("fusectl is not mounted at /sys/fs/fuse/connections")
    base, mnt = tmp_path / "base", tmp_path / "mnt"
    base.mkdir()
    mnt.mkdir()
    (base / "f").write_text("base\n")
    with Store.open(tmp_path / "store", create=True) as store:
        layer = Layer(base, store, tmp_path / "scratch")
        try:
            for _ in range(10):
                with Mount(layer, mnt) as booths:  # the booth's layer, as abort found it
                    assert booths._channel is not None
                    number, identity = booths._channel.minor, booths._channel.fusectl_id
                    assert number >= 0 and identity is not None
                gone = Path(fuse_wire.FUSECTL) / str(number)
                deadline = time.monotonic() + 10
                while gone.exists():  # the number is freed with the super block
                    assert time.monotonic() < deadline, "the booth's connection never ended"
                    time.sleep(0.01)
                with Mount(layer, mnt) as other:
                    assert other._channel is not None
                    if other._channel.minor != number:
                        continue  # another process on the machine took the number first
                    with pytest.raises(UsageError) as refused:
                        abort_connections("b1", [(number, identity)])
                    message = str(refused.value)
                    assert "\n" not in message and f"connection {number}" in message
                    assert "another mount" in message
                    assert (mnt / "f").read_text() == "base\n"  # the other mount still serves
                    # Its own identity is what an abort of it takes.
                    assert other._channel.fusectl_id is not None
                    mine = [(number, other._channel.fusectl_id)]
                    assert abort_connections("b2", mine) == [number]
                    with pytest.raises(OSError) as ended:
                        os.statvfs(mnt)
                    assert ended.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
                return
        finally:
            layer.close()
    pytest.skip("the connection's number went to other mounts ten times in a row")
