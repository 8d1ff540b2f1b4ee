"""A booth after its verdict, and the names a checkpoint may take."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from tests.booth.conftest import NOBODY
from tests.booth.test_booth_run import booth_run, jb, work  # noqa: F401 (fixture)
from tests.conftest import slow

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

FINISHED = re.compile(
    r"^jukebox: booth t1 was already committed \(1 change\(s\)\) at "
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} by (`jukebox booth commit`|the run itself), "
    r"user root \(uid 0\), pid \d+: "
    r"nothing to do \(`jukebox log .*t1\.jbx`\)\n$"
)


def test_committing_twice_says_when_and_by_what_it_was_committed(work) -> None:  # noqa: F811
    tree, tapes = work
    assert booth_run(tree, tapes, "echo two >> a.txt", "--commit", "never").returncode == 0
    header, row = jb("booth", "ls", "--tape-dir", str(tapes)).stdout.splitlines()
    assert header.split() == ["BOOTH", "ID", "STATUS", "CREATED", "TREE", "NAME"], header
    assert re.fullmatch(
        r"t1 +pending +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} +\S+ +-", row
    ), row
    assert jb("ls", "--tape-dir", str(tapes)).stdout.split()[-1] == "PENDING"
    assert jb("booth", "commit", "t1", "--tape-dir", str(tapes)).returncode == 0
    assert jb("ls", "--tape-dir", str(tapes)).stdout.split()[-1] == "COMMITTED"
    again = jb("booth", "commit", "t1", "--tape-dir", str(tapes))
    assert again.returncode == 1
    assert FINISHED.match(again.stderr), again.stderr
    assert "by `jukebox booth commit`" in again.stderr
    # An id that never was a booth here is still a usage error.
    missing = jb("booth", "commit", "nope", "--tape-dir", str(tapes))
    assert missing.returncode == 2 and "no pending booth 'nope'" in missing.stderr


def test_the_loser_of_a_commit_race_is_told_it_was_committed(work) -> None:  # noqa: F811
    tree, tapes = work
    assert booth_run(tree, tapes, "echo two >> a.txt", "--commit", "never").returncode == 0
    cmd = ["booth", "commit", "t1", "--tape-dir", str(tapes)]
    from tests.booth.test_booth_run import JUKEBOX

    racers = [
        subprocess.Popen([JUKEBOX, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = sorted((p.wait(slow(60)), p.stderr.read()) for p in racers)  # type: ignore[union-attr]
    assert [code for code, _ in results] == [0, 1], results
    assert FINISHED.match(results[1][1]), results
    assert (tree / "a.txt").read_text() == "one\ntwo\n"


def test_an_auto_committed_booth_names_the_run_as_its_committer(work) -> None:  # noqa: F811
    tree, tapes = work
    assert booth_run(tree, tapes, "echo two >> a.txt").returncode == 0
    again = jb("booth", "commit", "t1", "--tape-dir", str(tapes))
    assert again.returncode == 1 and "by the run itself" in again.stderr, again.stderr


def test_a_discarded_booth_says_who_discarded_it(work) -> None:  # noqa: F811
    tree, tapes = work
    assert booth_run(tree, tapes, "echo two >> a.txt", "--commit", "never").returncode == 0
    assert jb("booth", "discard", "t1", "--tape-dir", str(tapes)).returncode == 0
    late = jb("booth", "commit", "t1", "--tape-dir", str(tapes))
    assert late.returncode == 1, late.stderr
    assert re.fullmatch(
        r"jukebox: booth t1 was already discarded at \S+ \S+ \S+ by `jukebox booth discard`, "
        r"user root \(uid 0\), pid \d+: nothing to do \(`jukebox log .*`\)\n",
        late.stderr,
    ), late.stderr
    assert (tree / "a.txt").read_text() == "one\n"


def test_numeric_labels_are_refused_by_the_cli_and_the_socket(work) -> None:  # noqa: F811
    tree, tapes = work
    script = (
        "jukebox booth checkpoint --label 3 2>&1; echo rc=$?; "
        'printf \'{"op":"checkpoint","label":"42"}\\n\' | '
        'python3 -c "import socket,os,sys; s=socket.socket(socket.AF_UNIX); '
        "s.connect(os.environ['JUKEBOX_SOCKET']); s.sendall(sys.stdin.buffer.read()); "
        "print(s.recv(4096).decode())\"; "
        "jukebox booth checkpoint --label v3 --json"
    )
    proc = booth_run(tree, tapes, script, "--commit", "never")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("jukebox: Invalid value for --label: label '3' is a number"), lines
    assert lines[1] == "rc=2"
    refused = json.loads(lines[2])
    assert refused["ok"] is False and "label '42' is a number" in refused["error"], refused
    assert json.loads(lines[-1])["checkpoint"] == 1, lines  # the refusals took none


REVIEWED = (
    "echo two >> a.txt && rm keep.txt && printf 'x\\0y' > blob.bin && "
    "printf 'fresh\\n' > \"$(printf 'evil\\033[31m.txt')\""
)


def test_booth_diff_shows_patches_and_json(work) -> None:  # noqa: F811
    tree, tapes = work
    assert booth_run(tree, tapes, REVIEWED, "--commit", "never").returncode == 0
    proc = jb("booth", "diff", "t1", "-p", "--tape-dir", str(tapes))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "\033" not in out  # the hostile name is shown, never acted on
    assert "M a.txt  (8 bytes)\n     --- a/a.txt\n     +++ b/a.txt\n" in out, out
    assert "      one\n     +two\n" in out, out
    assert "A blob.bin  (3 bytes)\n     (binary file)\n" in out, out
    assert "--- a/keep.txt\n     +++ /dev/null\n" in out and "     -untouched\n" in out, out
    assert "A evil\\x1b[31m.txt  (6 bytes)\n     --- /dev/null\n" in out, out
    assert "     +++ b/evil\\x1b[31m.txt\n" in out and "     +fresh\n" in out, out
    plain = jb("booth", "diff", "t1", "--tape-dir", str(tapes)).stdout
    assert "---" not in plain and "M a.txt  (8 bytes)" in plain, plain

    data = json.loads(jb("booth", "diff", "t1", "--json", "--tape-dir", str(tapes)).stdout)
    assert data["booth"] == "t1" and data["at"] is None
    assert len(data["from_tree"]) == len(data["to_tree"]) == 64
    by_path = {c["path"]: c for c in data["changes"]}
    assert by_path["a.txt"] == {"path": "a.txt", "status": "modified", "kind": "file", "size": 8}
    assert by_path["keep.txt"]["status"] == "deleted"
    assert by_path["evil\033[31m.txt"]["status"] == "added"  # JSON carries the exact name
    patched = json.loads(
        jb("booth", "diff", "t1", "--json", "-p", "--tape-dir", str(tapes)).stdout
    )
    patches = {c["path"]: c["patch"] for c in patched["changes"]}
    assert patches["a.txt"].startswith("--- a/a.txt\n+++ b/a.txt\n@@"), patches
    assert "+two\n" in patches["a.txt"] and patches["blob.bin"] == "(binary file)\n"
    start = jb("booth", "diff", "t1", "--json", "--at", "0", "--tape-dir", str(tapes)).stdout
    assert json.loads(start)["changes"] == []  # checkpoint 0 is the start: nothing to commit


SPECIALS = (
    "mkfifo pipe && ln a.txt hard && "
    "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"sock\")'"
)


@pytest.mark.parametrize(("fs", "who"), [("fuse", "root"), ("overlay", "nobody")])
def test_fifos_sockets_and_hard_links_are_reviewed_and_committed(
    request: pytest.FixtureRequest, tmp_path: Path, fs: str, who: str
) -> None:
    # Both layers, both kinds of user: an unprivileged booth's overlay runs in a user namespace.
    python, user, home = None, None, tmp_path
    if who == "nobody":
        python, user = request.getfixturevalue("nobody_python"), NOBODY
        home = request.getfixturevalue("nobody_dir")
    tree, tapes = home / "tree", home / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    (tree / "keep.txt").write_text("untouched\n")
    if user is not None:
        for path in (tree, tree / "a.txt", tree / "keep.txt"):
            os.chown(path, user, user)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return jb(*args, python=python, user=user)

    proc = run("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "t1",
               "--fs", fs, "--commit", "never", "--", "sh", "-c", SPECIALS)
    assert proc.returncode == 0, proc.stderr
    review = run("booth", "diff", "t1", "--tape-dir", str(tapes)).stdout
    for line in ("A pipe  (fifo)", "A sock  (unix socket)", "A hard  (4 bytes, hard link)",
                 "L a.txt  (4 bytes, hard link)"):
        assert line in review.splitlines(), review
    data = json.loads(run("booth", "diff", "t1", "--json", "--tape-dir", str(tapes)).stdout)
    kinds = {c["path"]: c["kind"] for c in data["changes"]}
    assert kinds == {"a.txt": "file", "hard": "file", "pipe": "fifo", "sock": "socket"}
    tape = str(tapes / "t1.jbx")
    between = run("diff", f"{tape}@0", tape).stdout
    assert "  A  pipe  (fifo)" in between and "  A  keep.txt" not in between, between
    assert run("booth", "commit", "t1", "--tape-dir", str(tapes)).returncode == 0
    assert stat.S_ISFIFO(os.lstat(tree / "pipe").st_mode)
    assert stat.S_ISSOCK(os.lstat(tree / "sock").st_mode)
    assert os.lstat(tree / "a.txt").st_ino == os.lstat(tree / "hard").st_ino
