"""Rollback while processes keep running in the mount: they see the restored state on their next
open or stat, without a remount or a restart."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shadowfs import tree
from shadowfs.layer import Layer
from shadowfs.mountctl import Mount
from shadowfs.store import Store
from tests.conftest import slow
from tests.fs.conftest import needs_fuse

pytestmark = [pytest.mark.fuse, needs_fuse]

READER = r"""
import os, sys, time
path = sys.argv[1]
held = open("held.txt")  # opened before any rollback, kept open throughout
while True:
    try:
        with open(path) as f:
            content = f.read()
        size = os.stat(path).st_size
    except FileNotFoundError:
        content, size = "<missing>", -1
    held.seek(0)
    extra = "extra" if os.path.exists("extra.txt") else "no-extra"
    print(f"{content}|{size}|{extra}|{held.read()}|{os.getcwd()}", flush=True)
    time.sleep(0.005)
"""

APPENDER = r"""
import os, sys, time
i = 0
while True:
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, b"line %d\n" % i)
    os.close(fd)
    i += 1
    time.sleep(0.002)
"""


class Lines:
    """Collects a child's stdout lines on a thread; waits for one matching a predicate."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pred: Callable[[str], bool], timeout: float = 10.0) -> str:
        deadline = time.monotonic() + slow(timeout)
        with self._cond:
            start = len(self.lines)
            while True:
                for line in self.lines[start:]:
                    if pred(line):
                        return line
                start = len(self.lines)
                left = deadline - time.monotonic()
                assert left > 0, f"no matching line; last: {self.lines[-3:]}"
                assert self.proc.poll() is None, f"the process died: {self.lines[-3:]}"
                self._cond.wait(left)


@pytest.fixture(params=["thread", "process"])
def live(request: pytest.FixtureRequest, layer: Layer, tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "live"
    mnt.mkdir()
    with Mount(layer, mnt, process=request.param == "process"):
        yield mnt


def spawn(code: str, *args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=cwd, stdout=subprocess.PIPE, text=True
    )


def test_a_running_reader_sees_each_restore(live: Path, layer: Layer) -> None:
    work = live / "work"
    work.mkdir()
    (work / "held.txt").write_text("held v1")
    (work / "state.txt").write_text("version one")
    t1, _ = layer.snapshot()
    (work / "state.txt").write_text("v2")
    (work / "extra.txt").write_text("only in t2")
    (work / "held.txt").write_text("held v2")
    t2, _ = layer.snapshot()
    reader = spawn(READER, "state.txt", cwd=work)
    try:
        out = Lines(reader)
        out.wait_for(lambda s: s.startswith("v2|2|extra|held v2|"))
        layer.restore(t1)
        line = out.wait_for(lambda s: s.startswith("version one|"))
        _, size, extra, held, cwd = line.split("|")
        assert (size, extra) == ("11", "no-extra"), "stat and lookups see the rollback too"
        # The file it held open keeps the content it opened (like a file replaced by rename).
        assert held == "held v2" and cwd == str(work)
        layer.restore(t2)
        out.wait_for(lambda s: s.startswith("v2|2|extra|held v2|"))
        os.unlink(work / "state.txt")
        out.wait_for(lambda s: s.startswith("<missing>|-1|"))
        layer.restore(t1)
        out.wait_for(lambda s: s.startswith("version one|11|no-extra|"))
        assert reader.poll() is None, "the reader kept running across every rollback"
    finally:
        reader.kill()
        reader.wait()


def test_a_running_writer_continues_from_the_restored_file(
    live: Path, layer: Layer, store: Store
) -> None:
    log = live / "log.txt"
    writer = spawn(APPENDER, str(log), cwd=live)
    try:
        deadline = time.monotonic() + slow(10)
        while not log.exists() or log.stat().st_size < 200:
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.01)
        t1, _ = layer.snapshot()
        at_t1 = store.read_bytes(tree.lookup(store, t1, b"log.txt").oid)
        while log.stat().st_size < len(at_t1) + 500:
            time.sleep(0.01)
        layer.restore(t1)
        # The writer's first whole line after the restored end: waited for, not slept for.
        deadline = time.monotonic() + slow(10)
        while (now := log.read_bytes()).count(b"\n") <= at_t1.count(b"\n"):
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.01)
        assert now.startswith(at_t1), "the rollback discarded what came after the checkpoint"
        lines = now.decode().splitlines()
        assert len(lines) > len(at_t1.decode().splitlines()), "the writer kept appending"
        # Lines after the checkpoint's end continue the writer's counter, not a restart.
        first_new = int(lines[len(at_t1.decode().splitlines())].split()[1])
        last_old = int(at_t1.decode().splitlines()[-1].split()[1])
        assert first_new > last_old + 1
        assert writer.poll() is None
    finally:
        writer.kill()
        writer.wait()


def test_rollback_restores_deleted_trees_and_removes_new_ones(live: Path, layer: Layer) -> None:
    t0, _ = layer.snapshot()
    subprocess.run(["rm", "-rf", str(live / "docs"), str(live / "src")], check=True)
    (live / "new" / "dir").mkdir(parents=True)
    (live / "new" / "dir" / "f").write_text("x")
    lister = spawn(
        "import os,time\n"
        "while True:\n"
        "    print(sorted(os.listdir('.')), os.path.exists('docs/deep/er/note.md'), flush=True)\n"
        "    time.sleep(0.005)\n",
        cwd=live,
    )
    try:
        out = Lines(lister)
        out.wait_for(lambda s: "'new'" in s and s.endswith("False"))
        layer.restore(t0)
        line = out.wait_for(lambda s: "'new'" not in s and s.endswith("True"))
        assert "'docs'" in line and "'src'" in line
    finally:
        lister.kill()
        lister.wait()
    assert (live / "src" / "main.py").read_text() == "print('hello')\n"
    assert not (live / "new").exists()
