"""`booth run --rw/--ro/--hide/--no-private-tmp`, the hints after a run that tripped over the
booth's view, and a tree the booth used to cover with a read-only copy of itself.

One booth per configuration (root or nobody, FUSE or overlay) runs a battery of steps; the
host is checked afterwards."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.booth.paths import BoothPaths
from jukebox.booth.supervisor import run_booth
from jukebox.errors import UsageError
from jukebox.tape.tape import Tape
from jukebox.trees.realtree import commit_key_dir
from tests.booth.conftest import NOBODY
from tests.booth.test_no_hang import jb

pytestmark = pytest.mark.usefixtures("root_only", "dev_fuse")

# $B is the base directory (under /tmp, outside the tree); the agent's cwd is the tree.
BATTERY = """
"$B/tool.sh"
echo installed > "$B/venv/installed" && echo RW-WRITTEN
cp /bin/true "$B/venv/suid" && chmod 6755 "$B/venv/suid" && echo SUID-MADE
python3 -c "import os, shutil
os.chdir('$B/venv')
for _ in range(120):
    os.mkdir('d' * 48); os.chdir('d' * 48)
shutil.copy('/bin/true', 'suid'); os.chmod('suid', 0o4755); print('DEEP-SUID-MADE')"
echo bad > "$B/tool.sh" 2>/dev/null || echo TOOL-READ-ONLY
ls "$B/venv/to-tapes/" | wc -l | sed 's/^/TAPES-SEEN-/'
cat private/key 2>/dev/null || echo KEY-HIDDEN
cat "$B/elsewhere/data"
touch "$B/ro-dir/new"
echo changed > a.txt
"""


# Each user and each layer once: what is tested does not depend on the pair.
@pytest.fixture(params=["root-fuse", "nobody-overlay"])
def config(request: pytest.FixtureRequest, tmp_path: Path):
    who, fs = request.param.split("-")
    if who == "root":
        return None, None, tmp_path, fs
    python = request.getfixturevalue("nobody_python")
    request.getfixturevalue("open_dev_fuse")
    return python, NOBODY, request.getfixturevalue("nobody_dir"), fs


def _host(base: Path, user: int | None) -> tuple[Path, Path]:
    tree, tapes = base / "tree", base / "tapes"
    (tree / "private").mkdir(parents=True)
    (tree / "private" / "key").write_text("s3cret\n")
    (tree / "a.txt").write_text("one\n")
    (base / "tool.sh").write_text("#!/bin/sh\necho TOOL-RAN\n")
    (base / "tool.sh").chmod(0o755)
    (base / "venv").mkdir()
    (base / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (base / "venv" / "to-tapes").symlink_to(tapes)  # a way out through the hole: it must fail
    (base / "elsewhere").mkdir()
    (base / "elsewhere" / "data").write_text("data\n")
    (base / "ro-dir").mkdir()
    tapes.mkdir()
    (tapes / "placeholder.txt").write_text("x")
    if user is not None:
        for path in [base, *base.rglob("*")]:
            os.chown(path, user, user, follow_symlinks=False)
    return tree, tapes


def test_kept_and_hidden_paths_and_the_hints_after_the_run(config) -> None:
    python, user, base, fs = config
    tree, tapes = _host(base, user)
    # Root's configurations use the private /tmp (the tool shown with --ro, the rest of /tmp
    # hidden); nobody's show the host's /tmp and hide a directory of it instead.
    view = (
        ["--ro", f"{base}/tool.sh"]
        if user is None
        else ["--no-private-tmp", "--hide", f"{base}/elsewhere"]
    )
    argv = [
        *("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "v1"),
        *("--fs", fs, "--rw", f"{base}/venv", "--ro", f"{base}/ro-dir"),
        *("--hide", f"{tree}/private", *view),
        *("--", "sh", "-c", f"B={shlex.quote(str(base))}\n{BATTERY}"),
    ]
    proc = jb(*argv, python=python, user=user)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, (out, err)
    markers = ("TOOL-RAN", "RW-WRITTEN", "SUID-MADE", "DEEP-SUID-MADE", "TOOL-READ-ONLY",
               "TAPES-SEEN-0")  # fmt: skip
    for marker in (*markers, "KEY-HIDDEN"):
        assert marker in out, (marker, out, err)
    # The hole: written on the host directly. The rest: untouched.
    assert (base / "venv" / "installed").read_text() == "installed\n"
    # ...but never a set-id program: a root agent's would be one for anyone on the host.
    assert stat.S_IMODE((base / "venv" / "suid").stat().st_mode) == 0o755
    # Nor one past PATH_MAX (120 levels of 48 bytes), which no path reaches: only an fd walk.
    level = os.open(base / "venv", os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(120):
        deeper = os.open("d" * 48, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=level)
        os.close(level)
        level = deeper
    try:
        assert stat.S_IMODE(os.stat("suid", dir_fd=level, follow_symlinks=False).st_mode) == 0o755
    finally:
        os.close(level)
    assert "took the set-user/group-ID bits off 2 file(s)" in err, err
    assert (base / "tool.sh").read_text() == "#!/bin/sh\necho TOOL-RAN\n"
    assert not (base / "ro-dir" / "new").exists()
    assert (tree / "a.txt").read_text() == "changed\n"  # committed through the layer
    assert (tree / "private" / "key").read_text() == "s3cret\n"  # a cover is no deletion
    # The hints, one line each, naming the flag that would have let the agent at the path.
    why = "the booth's /tmp is private" if user is None else f"the booth hides {base}/elsewhere"
    assert f"could not find {base}/elsewhere/data: {why}" in err, err
    assert f"pass --ro {base}/elsewhere/data" in err, err
    assert f"could not write in {base}/ro-dir: it is read-only" in err, err
    assert f"pass --rw {base}/ro-dir" in err, err
    hints = [line for line in err.splitlines() if line.startswith("jukebox: the agent")]
    assert not [h for h in hints if "tapes" in h], hints  # never a hint at the tapes
    frames = Tape.load(tapes / "v1.jbx").frames
    policy = frames[0].payload["policy"]
    assert policy["paths"] == {
        "rw": [f"{base}/venv"],
        "ro": [f"{base}/ro-dir", *([f"{base}/tool.sh"] if user is None else [])],
        "hide": [f"{tree}/private", *([f"{base}/elsewhere"] if user is not None else [])],
        "no_private_tmp": user is not None,
    }
    assert policy["private_tmp"] is (user is None)
    notes = [f.payload for f in frames if f.kind == "note"]
    denials = next(n["denials"] for n in notes if n.get("event") == "view_denials")
    assert {(d["error"], d["flag"]) for d in denials} == {
        ("ENOENT", f"--ro {base}/elsewhere/data"),
        ("EROFS", f"--rw {base}/ro-dir"),
        ("EROFS", f"--rw {base}/tool.sh"),  # the host is read-only: --ro or not
    }


def test_refused_paths(tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    (tree / "sub").mkdir(parents=True)
    key_dir = commit_key_dir()
    key_dir.mkdir(parents=True, exist_ok=True)
    refused = {
        "rw the tree": (BoothPaths(rw=(str(tree),)), "overlaps the tree"),
        "rw inside the tree": (BoothPaths(rw=(str(tree / "sub"),)), "overlaps the tree"),
        "rw around the tree": (BoothPaths(rw=(str(tmp_path),)), "overlaps the tree"),
        "ro inside the tree": (BoothPaths(ro=(str(tree / "sub"),)), "overlaps the tree"),
        "rw the key's dir": (BoothPaths(rw=(str(key_dir),)), "holds your commit key"),
        "rw around the key": (BoothPaths(rw=(str(key_dir.parent),)), "holds your commit key"),
        "ro the key's dir": (BoothPaths(ro=(str(key_dir),)), "holds your commit key"),
        "rw /proc": (BoothPaths(rw=("/proc/sys",)), "the kernel's or the booth's own"),
        "hide the tree": (BoothPaths(hide=(str(tree),)), "is the tree itself"),
    }
    for case, (paths, message) in refused.items():
        with pytest.raises(UsageError, match=message):
            run_booth(["true"], tree=tree, tape_dir=tapes, paths=paths)
        assert not tapes.exists(), case
    tapes.mkdir()
    with pytest.raises(UsageError, match="overlaps the tape dir"):
        run_booth(["true"], tree=tree, tape_dir=tapes, paths=BoothPaths(ro=(str(tapes),)))
    with pytest.raises(UsageError, match="both name"):
        BoothPaths.from_options(rw=[str(tmp_path)], ro=[str(tmp_path)])
    # The command line: one line, exit 2, nothing made.
    cli = jb("booth", "run", "--tree", str(tree), "--tape-dir", str(tmp_path / "t2"),
             "--rw", str(tmp_path / "missing"), "--", "true")  # fmt: skip
    assert cli.returncode == 2 and cli.stderr.count("\n") == 1, cli.stderr
    assert "--rw" in cli.stderr and "no such file" in cli.stderr
    assert not (tmp_path / "t2").exists()


def test_a_tree_holding_the_running_jukebox_is_writable(tmp_path: Path) -> None:
    """A tree under the private /tmp that holds the interpreter jukebox runs from (its own
    editable checkout with its venv, say) used to get a read-only copy of itself over the
    layer: every write failed with EROFS, and the booth said "no changes"."""
    tree = Path("/tmp") / f"jukebox-test-venv-tree-{os.getpid()}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tree)], check=True)
    try:
        site = next((tree / "lib").glob("python3*/site-packages"))
        ours = next((Path(sys.prefix) / "lib").glob("python3*/site-packages"))
        (site / "jukebox-dev.pth").write_text(f"import site; site.addsitedir({str(ours)!r})\n")
        cli = [str(tree / "bin" / "python"), "-c", "from jukebox.cli import main; main()"]
        run = ["booth", "run", "--tree", str(tree), "--tape-dir", str(tmp_path / "tapes")]
        proc = subprocess.run(
            [*cli, *run, "--", "sh", "-c", "echo written > src.txt"],
            capture_output=True,
            text=True,
            cwd="/",
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert (tree / "src.txt").read_text() == "written\n", proc.stderr
    finally:
        subprocess.run(["rm", "-rf", str(tree)], check=True)


def test_a_tree_on_a_read_only_file_system_is_refused_or_kept_pending(tmp_path: Path) -> None:
    """Its commit used to fail half-way (exit 70) and leave an interrupted commit that no later
    command could recover, nor the booth be discarded."""
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tree)], check=True)
    try:
        (tree / "a.txt").write_text("one\n")
        subprocess.run(["mount", "-o", "remount,ro", str(tree)], check=True)
        run = ["booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "ro1"]
        refused = jb(*run, "--", "sh", "-c", "echo two > a.txt")
        assert refused.returncode == 2 and "read-only file system" in refused.stderr
        assert refused.stderr.count("\n") == 1 and not tapes.exists()
        kept = jb(*run, "--commit", "never", "--", "sh", "-c", "echo two > a.txt")
        assert kept.returncode == 0 and "stay pending" in kept.stderr, kept.stderr
        commit = jb("booth", "commit", "ro1", "--tape-dir", str(tapes))
        assert commit.returncode == 1 and "not started" in commit.stderr, commit.stderr
        assert (tree / "a.txt").read_text() == "one\n"
        assert jb("booth", "discard", "ro1", "--tape-dir", str(tapes)).returncode == 0
    finally:
        subprocess.run(["umount", str(tree)], check=True)


def test_replay_and_fork_exec_take_the_same_flags(tmp_path: Path) -> None:
    """A run that needed --ro for its agent needs it again to be re-executed; the flags are
    the caller's, never read from the tape (nor accepted without --exec)."""
    tree, tapes, tool = tmp_path / "tree", tmp_path / "tapes", tmp_path / "agent.sh"
    tree.mkdir()
    tool.write_text("#!/bin/sh\necho done > out.txt\n")
    tool.chmod(0o755)
    run = ["booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--tape-id", "r1"]
    recorded = jb(*run, "--ro", str(tool), "--commit", "never", "--", str(tool))
    assert recorded.returncode == 0, recorded.stderr
    tape = str(tapes / "r1.jbx")
    replayed = jb("replay", tape, "--exec", "--no-record", "--ro", str(tool))
    assert replayed.returncode == 0, replayed.stderr
    for command in (["replay", tape], ["fork", tape, "--at", "1"]):
        refused = jb(*command, "--ro", str(tool))
        assert refused.returncode == 2 and "add --exec" in refused.stderr, refused.stderr
    assert jb("booth", "discard", "r1", "--tape-dir", str(tapes)).returncode == 0
