"""The supervisor's layer watchdog: a thread blocked on a FUSE layer that stopped answering is
freed (the connection aborted, one LayerStuck naming what hung), after its limit or at once on a
pending interrupt; a call that is answered is left alone.

A real shadowfs mount served from a child process, stopped with SIGSTOP: the test's own thread
then waits in the kernel on a real request, exactly as the supervisor's would."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jukebox.booth import fusectl
from jukebox.booth.layer_watchdog import LayerStuck, LayerWatchdog

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")


@pytest.fixture
def interrupts_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread and every thread started from now on, as in the supervisor:
    an interrupt then stays pending until taken with sigtimedwait."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.sigtimedwait({signal.SIGINT}, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, int, int]]:
    """(mount point, connection number, server pid) of a layer served from a child process."""
    from shadowfs.layer import Layer
    from shadowfs.mountctl import Mount, is_mounted
    from shadowfs.store import Store

    base, mnt = tmp_path / "base", tmp_path / "mnt"
    base.mkdir()
    mnt.mkdir()
    (base / "f").write_text("base\n")
    store = Store.open(tmp_path / "store")
    layer = Layer(base, store, tmp_path / "scratch")
    mount = Mount(layer, mnt, process=True).start()
    connection = fusectl.connection_at(str(mnt))
    assert connection is not None
    # Should the watchdog fail, this frees the test instead of leaving it in the kernel (and the
    # test fails: the call then raises a plain OSError, not LayerStuck).
    identity = fusectl.fusectl_identity(connection)
    assert identity is not None
    backstop = threading.Timer(60, lambda: fusectl.abort_connection(connection, identity))
    backstop.start()
    try:
        yield mnt, connection, mount._pid
    finally:
        backstop.cancel()
        os.kill(mount._pid, signal.SIGCONT)
        mount.stop()
        layer.close()
        store.close()
    assert not is_mounted(mnt)
    # The kernel drops the connection's control dir when the super block's last reference goes,
    # which a lazy unmount defers past mount.stop() on a busy machine: it must go, soon.
    control_dir = os.path.join(fusectl.FUSECTL, str(connection))
    deadline = time.monotonic() + 30
    while os.path.exists(control_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(control_dir)


def stop_server(pid: int) -> None:
    """SIGSTOP the layer's server and wait until every one of its threads is stopped: kill()
    returns before a busy machine has stopped them all, and a thread still running would answer
    the test's call (ENOENT) instead of leaving it stuck."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
            states.append(stat.rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"the layer's server {pid} did not stop")


def interrupt_once_stuck(connection: int) -> threading.Thread:
    """Sends this process a SIGINT once the kernel holds a request of `connection` unanswered
    (the test's own call, its server stopped): seen through fusectl, not guessed from a sleep."""

    def send() -> None:
        # The bound only turns a broken test into a failure: the call then never gets stuck.
        deadline = time.monotonic() + 30
        while fusectl.waiting(connection) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.serial  # its 60 s backstop fired beside another worker under load
def test_a_call_stuck_past_the_limit_is_aborted(served) -> None:
    mnt, connection, server = served
    watchdog = LayerWatchdog(connection, limit=1.0).start()
    try:
        with watchdog.blocking("a snapshot"):
            assert (mnt / "f").read_text() == "base\n"  # answered: nothing fires
        stop_server(server)
        with pytest.raises(LayerStuck) as stuck, watchdog.blocking("a snapshot"):
            os.stat(mnt / "new-name")
    finally:
        watchdog.close()
    message = str(stuck.value)
    assert "\n" not in message
    assert "a snapshot" in message and f"connection {connection}" in message


@pytest.mark.serial  # its 60 s backstop fired beside another worker under load
def test_an_interrupt_frees_a_stuck_call_before_the_limit(interrupts_blocked, served) -> None:
    mnt, connection, server = served
    watchdog = LayerWatchdog(connection, limit=3600).start()
    stop_server(server)
    sender = interrupt_once_stuck(connection)
    try:
        with pytest.raises(LayerStuck) as stuck, watchdog.blocking("a rollback"):
            os.stat(mnt / "new-name")
    finally:
        watchdog.close()
        sender.join()
    assert "a rollback" in str(stuck.value) and "an interrupt" in str(stuck.value)
    # The interrupt itself is left for the supervisor's own signal loop to answer.
    assert signal.sigtimedwait({signal.SIGINT}, 0) is not None
