"""Each rule of jukebox.review.host_hooks, on trees built from real directories: a change to
every kind of hook-like file is flagged, wherever the rule says it may be, and look-alikes
(the same names elsewhere, near misses) are not. The check skips paths that no rule can flag
before trying the rules (`_may_run`): this is what says it skips none that one would."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from jukebox.review.host_hooks import host_hook_changes
from shadowfs import tree
from shadowfs.store import Store
from shadowfs.tree import build_tree

FLAGGED = [
    ".git/hooks/pre-commit",
    "sub/repo/.git/hooks/post-checkout",
    ".git/config",  # sets core.fsmonitor (below)
    ".envrc",
    "deep/er/.envrc",
    "a/.devcontainer.json",
    "a/b/.pre-commit-config.yaml",
    "a/b/c/project.code-workspace",  # the one rule with no component starting with a dot
    "top.code-workspace",
    "x/.devcontainer/run.sh",
    "x/.husky/pre-push",
    "y/.vscode/tasks.json",
    ".vscode/settings.json",
    "z/.idea/workspace.xml",
    "z/.idea/runConfigurations/run.xml",
    ".bashrc",
    ".gitconfig",
    ".ssh/authorized_keys",
    ".config/git/config",
    ".config/autostart/x.desktop",
    ".config/systemd/user/x.service",
]
NOT_FLAGGED = [
    "src/main.py",
    "git/hooks/pre-commit",  # no dot: not a repository
    ".git/hooks/pre-commit.sample",
    ".git/description",
    "a.envrc",
    "envrc",
    "a/.vscode/launch.json",
    "vscode/tasks.json",
    "code-workspace",
    "a/.bashrc",  # start-up files count at the root only
    "a/.ssh/authorized_keys",
    ".config/other/x",
    "a/.hidden/file",
    "Makefile",
]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    tree.clear_cache()
    s = Store.open(tmp_path / "store", create=True)
    try:
        yield s
    finally:
        s.close()


def test_every_rule_flags_its_files_and_no_look_alike(tmp_path: Path, store: Store) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    base = build_tree(store, root)
    for rel in FLAGGED + NOT_FLAGGED:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("[core]\n\tfsmonitor = ./run\n" if rel.endswith("config") else "x\n")
    os.utime(root, ns=(1, 1))  # the root directory's own change is no file's
    final = build_tree(store, root)
    flagged = {c.path.decode() for c in host_hook_changes(store, base, final)}
    assert flagged == set(FLAGGED)
