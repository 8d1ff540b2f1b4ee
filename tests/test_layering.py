"""The layering docs/architecture.md draws, as import-linter contracts (pyproject's
[tool.importlinter]): shadowfs never imports jukebox, and jukebox's packages depend one way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def _lint(config: Path | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    argv = [LINT_IMPORTS, "--no-cache"] + ([f"--config={config}"] if config else [])
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_import_contracts_are_kept() -> None:
    result = _lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_a_shadowfs_module_importing_jukebox_breaks_the_contract(tmp_path: Path) -> None:
    # The same contract over a copy of the two packages, one of whose shadowfs modules now
    # imports jukebox: the check must fail and name the import.
    import shutil

    for package in ("shadowfs", "jukebox"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns(
            "__pycache__", "node_modules", "assets", "data", "sandbox_images"))
    (tmp_path / "shadowfs" / "oid.py").write_text(
        (ROOT / "shadowfs" / "oid.py").read_text() + "\nfrom jukebox.errors import UsageError\n"
    )
    config = tmp_path / "contracts.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["shadowfs", "jukebox"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "shadowfs knows nothing of jukebox"\n'
        'type = "forbidden"\nsource_modules = ["shadowfs"]\nforbidden_modules = ["jukebox"]\n'
    )
    result = subprocess.run(
        [LINT_IMPORTS, "--no-cache", f"--config={config}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "shadowfs.oid -> jukebox.errors" in result.stdout
