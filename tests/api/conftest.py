"""Fixtures for the Python API tests: a project directory with a tape dir inside it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from jukebox.api.api import Jukebox, SandboxPolicy


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project tree as the working directory: a file, a sub-directory, and room for tapes."""
    root = tmp_path / "work"
    (root / "src").mkdir(parents=True)
    (root / "README.md").write_text("hello\n")
    (root / "src" / "app.py").write_text("print('v1')\n")
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def jb(work: Path) -> Iterator[Jukebox]:
    box = Jukebox(tape_dir=work / "tapes", sandbox=SandboxPolicy())
    yield box
    box.close()
