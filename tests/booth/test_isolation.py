"""The exec shim and the supervisor's namespace, with a tmpfs standing in for the layer.

A helper process enters the booth namespace the way the supervisor does, mounts a tmpfs over the
tree's own path (a real mount, as the layer is), and starts a shell through the shim; the shell
reports what it can and cannot do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.booth.conftest import NOBODY, REPO

pytestmark = pytest.mark.usefixtures("root_only")

HELPER = r"""
import json, os, subprocess, sys
from jukebox import isolation as iso
cfg = json.loads(sys.argv[1])
tree = cfg["tree"]
userns = iso.enter_private_namespace()
iso.mount("tmpfs", tree, "tmpfs", 0, "mode=0777")
spec = iso.ChildSpec(argv=cfg["argv"], cwd=tree, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                     keep=[tree], hide=cfg["hide"], limits=cfg.get("limits", {}),
                     net=cfg.get("net", "host"), private_tmp=cfg.get("private_tmp", True))
child = iso.spawn(spec, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
started = child.wait_started()
print("READY", flush=True)
sys.stdin.readline()
out = child.proc.communicate()[0].decode()
print(json.dumps({"userns": userns, "started": started, "error": child.setup_error,
                  "rc": child.proc.returncode, "out": out}), flush=True)
"""

PROBE = r"""
grep -E '^(NoNewPrivs|CapBnd|CapEff):' /proc/self/status
umount "$1" 2>/dev/null && echo UMOUNT_OK || echo UMOUNT_FAILED
mount --bind / "$1" 2>/dev/null && echo BIND_OK || echo BIND_FAILED
echo x 2>/dev/null > "$2/planted" && echo TAPE_WRITE_OK || echo TAPE_WRITE_FAILED
echo y > "$1/new" && echo TREE_WRITE_OK || echo TREE_WRITE_FAILED
echo z 2>/dev/null > /etc/jukebox-escape && echo HOST_WRITE_OK || echo HOST_WRITE_FAILED
echo TMP=$(ls -A /tmp | grep -v '^jukebox-nobody' | tr '\n' ' ')
echo NOFILE=$(ulimit -n)
"""


def booth_helper(
    cfg: dict, python: str = sys.executable, user: int | None = None
) -> tuple[dict, str]:
    """Runs HELPER; returns its report and the test process's own mountinfo while it ran."""
    cmd = [python, "-c", HELPER, json.dumps(cfg)]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        env=env,
    )
    try:
        first = proc.stdout.readline()
        assert first.strip() == "READY", first + proc.stderr.read()
        outside = Path("/proc/self/mountinfo").read_text()
        out, err = proc.communicate("go\n", timeout=30)
    finally:
        proc.kill()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, err
    return json.loads(lines[-1]), outside


def probe_cfg(tree: Path, tapes: Path, **extra) -> dict:
    return {
        "tree": str(tree),
        "argv": ["sh", "-c", PROBE, "probe", str(tree), str(tapes)],
        "hide": [str(tapes)],
        **extra,
    }


def cap_bnd(out: str) -> int:
    return int(next(ln for ln in out.splitlines() if ln.startswith("CapBnd:")).split()[1], 16)


CAP_SYS_ADMIN = 21


def check_probe(report: dict, outside: str, tree: Path) -> None:
    out = report["out"]
    assert report["started"] and report["rc"] == 0, report
    assert "NoNewPrivs:\t1" in out
    assert not cap_bnd(out) & (1 << CAP_SYS_ADMIN)
    assert "UMOUNT_FAILED" in out and "BIND_FAILED" in out
    assert "TAPE_WRITE_FAILED" in out
    assert "TREE_WRITE_OK" in out  # the stand-in layer over the tree stays writable
    assert "HOST_WRITE_FAILED" in out
    assert f" {tree} " not in outside  # nobody outside sees the booth's mount
    assert not (tree / "new").exists()  # the write went to the layer, not the real tree
    assert not os.path.exists("/etc/jukebox-escape")


def test_root_booth_is_sealed(tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    tapes.mkdir()
    report, outside = booth_helper(probe_cfg(tree, tapes, limits={"open_files": 321}))
    check_probe(report, outside, tree)
    assert report["userns"] is False
    assert "NOFILE=321" in report["out"]
    # A private /tmp: nothing in it but the path back to the tree.
    assert f"TMP={tree.relative_to('/tmp').parts[0]}\n" in report["out"]
    assert not (tapes / "planted").exists()


def test_hidden_dir_outside_tmp_is_empty_and_read_only(tmp_path: Path) -> None:
    # Without a private /tmp the explicit hide is all that keeps the tape dir away.
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    tapes.mkdir()
    (tapes / "old.jbx").write_text("secret tape")
    cfg = probe_cfg(tree, tapes, private_tmp=False)
    cfg["argv"][2] += 'ls -A "$2" | wc -l | sed "s/^/TAPE_ENTRIES=/"\n'
    report, outside = booth_helper(cfg)
    check_probe(report, outside, tree)
    assert "TAPE_ENTRIES=0" in report["out"]
    assert sorted(os.listdir(tapes)) == ["old.jbx"]


def test_tree_under_a_hidden_directory_stays_reachable(tmp_path: Path) -> None:
    home = tmp_path / "home"
    tree = home / "user" / "repo"
    tree.mkdir(parents=True)
    (home / "user" / ".netrc").write_text("password")
    script = 'cat "$1/../.netrc" 2>/dev/null && echo LEAK; echo ok > "$1/f" && echo TREE_OK'
    cfg = {
        "tree": str(tree),
        "argv": ["sh", "-c", script, "x", str(tree)],
        "hide": [str(home)],
        "private_tmp": False,
    }
    report, _ = booth_helper(cfg)
    assert "TREE_OK" in report["out"] and "LEAK" not in report["out"], report


def test_no_network(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    script = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"
    report, _ = booth_helper(
        {"tree": str(tree), "argv": ["sh", "-c", script], "hide": [], "net": "none"}
    )
    assert report["out"].split() == ["lo"], report


def test_command_not_found_is_reported(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    report, _ = booth_helper({"tree": str(tree), "argv": ["no-such-command-xyz"], "hide": []})
    assert report["started"] is False
    assert report["rc"] == 127
    assert "no-such-command-xyz" in report["error"]


def test_unprivileged_booth_via_user_namespace(nobody_python: str, nobody_dir: Path) -> None:
    tree, tapes = nobody_dir / "tree", nobody_dir / "tapes"
    for d in (tree, tapes):
        d.mkdir()
        os.chown(d, NOBODY, NOBODY)
    report, outside = booth_helper(probe_cfg(tree, tapes), python=nobody_python, user=NOBODY)
    check_probe(report, outside, tree)
    assert report["userns"] is True
