"""A wheel of the project, installed into a fresh venv, runs a booth without the source checkout.

`make` installs the project editable, so a file missing from the wheel (the sandbox images, once)
goes unnoticed there. This builds the wheel as `pip install jukebox-os` would get it, installs it
into a new venv whose only other packages are the test venv's dependencies, and runs real booths
from a directory outside the checkout with `-I`, so nothing of the checkout can be imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.booth.conftest import REPO

pytestmark = [pytest.mark.usefixtures("root_only", "dev_fuse"), pytest.mark.slow]

COPY_IGNORE = shutil.ignore_patterns(
    ".venv", ".git", "__pycache__", "build", "*.egg-info", ".pytest_cache", ".hypothesis", "tapes"
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a fresh venv holding only the wheel (dependencies come from ours)."""
    base = tmp_path_factory.mktemp("wheel")
    # Built from a copy: an in-tree build would write build/ and *.egg-info into the checkout.
    source, wheels = base / "source", base / "wheels"
    shutil.copytree(REPO, source, ignore=COPY_IGNORE)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("jukebox_os-*.whl")
    fresh = base / "venv"
    venv.EnvBuilder(with_pip=False).create(fresh)
    # A plain path line, not site.addsitedir: our venv's .pth files would pull in the checkout
    # through the editable install.
    ours = next((Path(sys.prefix) / "lib").glob("python3*/site-packages"))
    site = next((fresh / "lib").glob("python3*/site-packages"))
    (site / "test-dependencies.pth").write_text(f"{ours}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(fresh / "bin" / "python"), "install",
         "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    return fresh / "bin"


def run_isolated(
    bin_dir: Path, *args: str, cwd: Path
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JUKEBOX_"))}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run(
        [str(bin_dir / "python"), "-I", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=60,
    )


def test_the_wheel_holds_the_images_and_not_the_checkout(installed: Path, tmp_path: Path) -> None:
    probe = run_isolated(
        installed,
        "-c",
        "import jukebox, jukebox.booth.images as i; print(jukebox.__file__); print(*i.available())",
        cwd=tmp_path,
    )
    assert probe.returncode == 0, probe.stderr
    where, images = probe.stdout.splitlines()
    assert Path(where).is_relative_to(installed.parent), where
    assert not Path(where).is_relative_to(REPO)
    assert images.split() == ["host", "minimal"]
    # The help topics are package data too: `jukebox help TOPIC` reads them from the wheel.
    shown = run_isolated(installed, str(installed / "jukebox"), "help", "config", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("The config file:")
    # So are the viewer's page, style and script (`jukebox view`).
    assets = run_isolated(
        installed,
        "-c",
        "from jukebox.viewer.page import asset; "
        "print(*(len(asset(n)) > 100 for n in ('viewer.html', 'viewer.css', 'viewer.js')))",
        cwd=tmp_path,
    )
    assert assets.stdout.split() == ["True"] * 3, assets.stderr


@pytest.mark.parametrize("image", [None, "minimal"])
def test_a_booth_runs_from_the_wheel(installed: Path, tmp_path: Path, image: str | None) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "a.txt").write_text("one\n")
    opts = ["--image", image] if image else []
    done = run_isolated(
        installed,
        str(installed / "jukebox"),
        "booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), *opts, "--", "true",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"no changes to commit: {tree} is as it was" in done.stderr
    assert list(tapes.glob("*.jbx")), "the booth wrote no tape"
    bad = run_isolated(installed, str(installed / "jukebox"), "booth", "run", "--tree",
                       str(tree), "--tape-dir", str(tapes), "--image", "nope", "--", "true",
                       cwd=tmp_path)
    assert bad.returncode == 2
    assert "use one of host, minimal or a path" in bad.stderr
