"""The exec shim and the supervisor's namespace, with a tmpfs standing in for the layer.

A helper process enters the booth namespace the way the supervisor does, mounts a tmpfs over the
tree's own path (a real mount, as the layer is), and starts a shell through the shim; the shell
reports what it can and cannot do.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.booth.conftest import NOBODY, REPO
from tests.conftest import slow

pytestmark = pytest.mark.usefixtures("root_only")

HELPER = r"""
import json, os, subprocess, sys
from jukebox.booth import isolation as iso
cfg = json.loads(sys.argv[1])
tree = cfg["tree"]
userns = iso.enter_private_namespace()
iso.mount("tmpfs", tree, "tmpfs", 0, "mode=0777")
env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SUPERVISOR_PID": str(os.getpid())}
spec = iso.ChildSpec(argv=cfg["argv"], cwd=tree, env=env, keep=[tree, *cfg.get("keep", [])],
                     hide=cfg["hide"], limits=cfg.get("limits", {}),
                     net=cfg.get("net", "host"), private_tmp=cfg.get("private_tmp", True))
child = iso.spawn(spec, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
started = child.wait_started()
print("READY", flush=True)
sys.stdin.readline()
early = b""
if cfg.get("signal"):  # sent, as the supervisor sends it, once the command says it is ARMED
    while b"ARMED" not in early:
        chunk = os.read(child.proc.stdout.fileno(), 4096)
        if not chunk:
            break
        early += chunk
    child.proc.send_signal(cfg["signal"])
out = (early + child.proc.communicate()[0]).decode()
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
    cfg: dict, python: str = sys.executable, user: int | None = None, under: Sequence[str] = ()
) -> tuple[dict, str]:
    """Runs HELPER (``under`` a tracer, when given); returns its report and the test process's
    own mountinfo while it ran."""
    cmd = [*under, python, "-c", HELPER, json.dumps(cfg)]
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
        out, err = proc.communicate("go\n", timeout=slow(30))
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


# ----------------------------------------------------------------- the PID namespace and its init

PID_PROBE = r"""
echo INIT=$(tr '\0' ' ' < /proc/1/cmdline)
echo SELF=$$
[ -e "/proc/$SUPERVISOR_PID" ] && echo SUP_VISIBLE || echo SUP_HIDDEN
for i in 1 2 3; do (sleep 0.05 &); done
sleep 0.5
echo ZOMBIES=$(grep -l '^State:.Z' /proc/[0-9]*/status 2>/dev/null | wc -l)
"""


@pytest.mark.parametrize("who", ["root", "nobody"])
def test_cmd_runs_under_an_init_of_its_own_pid_namespace(
    request: pytest.FixtureRequest, tmp_path: Path, who: str
) -> None:
    python, user, tree = sys.executable, None, tmp_path / "tree"
    if who == "nobody":
        python, user = request.getfixturevalue("nobody_python"), NOBODY
        tree = request.getfixturevalue("nobody_dir") / "tree"
    tree.mkdir()
    if user is not None:
        os.chown(tree, NOBODY, NOBODY)
    cfg = {"tree": str(tree), "argv": ["sh", "-c", PID_PROBE], "hide": []}
    report, _ = booth_helper(cfg, python=python, user=user)
    out = report["out"]
    assert report["rc"] == 0, report
    # pid 1 is the init, CMD is pid 2, and a fresh /proc shows this namespace only.
    assert "INIT=jukebox-init" in out and "SELF=2" in out, out
    assert "SUP_HIDDEN" in out, out
    # Three orphans exited while CMD ran: the init reaped them.
    assert "ZOMBIES=0" in out, out


def test_a_signal_to_the_shim_reaches_cmd_and_cmd_status_comes_back(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    script = "trap 'echo GOT_TERM; exit 42' TERM; echo ARMED; while :; do sleep 0.05; done"
    cfg = {"tree": str(tree), "argv": ["sh", "-c", script], "hide": [], "signal": 15}
    report, _ = booth_helper(cfg)
    assert report["rc"] == 42 and "GOT_TERM" in report["out"], report


def test_cmd_killed_by_a_signal_ends_the_shim_by_the_same_signal(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    cfg = {"tree": str(tree), "argv": ["sh", "-c", "echo ARMED; exec sleep 30"], "hide": []}
    report, _ = booth_helper({**cfg, "signal": 15})
    assert report["rc"] == -15, report  # what the supervisor records as signal 15


# ----------------------------------------------------------------- the file size limit

FSIZE_PROBE = r"""
head -c 3000000 /dev/zero > big; echo HEAD=$?
echo SIZE=$(stat -c %s big)
truncate -s 1G sparse 2>/dev/null; echo TRUNCATE=$?
/usr/bin/python3 -c '
import errno
try:
    open("py", "wb").write(b"x" * (2 << 20))
    print("PY ok")
except OSError as e:
    print("PY", errno.errorcode[e.errno])
'
"""


def test_file_size_limit_stops_a_writer_with_sigxfsz_or_efbig(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    cfg = {
        "tree": str(tree),
        "argv": ["sh", "-c", FSIZE_PROBE],
        "hide": [],
        "limits": {"file_size_bytes": 1 << 20},
    }
    out = booth_helper(cfg)[0]["out"]
    # head dies of SIGXFSZ (128 + 25) with the file cut at the limit; a sparse truncate past it
    # fails; Python, which ignores SIGXFSZ, gets EFBIG.
    assert "HEAD=153" in out and f"SIZE={1 << 20}" in out, out
    assert "TRUNCATE=0" not in out, out
    assert "PY EFBIG" in out, out


def test_images_carry_a_file_size_limit(tmp_path: Path) -> None:
    from jukebox.booth.images import ImageError, load_image

    assert load_image("host").limits["file_size_bytes"] == 8 << 30
    assert load_image("minimal").limits["file_size_bytes"] == 2 << 30
    spec = tmp_path / "small.toml"
    spec.write_text('[limits]\nfile_size = "64M"\n')
    assert dict(load_image(str(spec)).limits) == {"file_size_bytes": 64 << 20}
    spec.write_text('[limits]\nfile_size = "huge"\n')
    with pytest.raises(ImageError, match=r"key 'limits\.file_size' is 'huge'"):
        load_image(str(spec))
    spec.write_text("[limits]\nfile_size = 0\n")
    with pytest.raises(ImageError, match="must be a positive size"):
        load_image(str(spec))


def test_cmd_waits_for_the_whole_view_and_never_runs_when_it_fails(tmp_path: Path) -> None:
    # CMD is forked before the init builds the view (isolation._init_main) and must not go on
    # to its exec without it: a kept path that is not there fails the view, and the command,
    # which would write the marker on the host's file system, never runs.
    tree, marker = tmp_path / "tree", tmp_path / "ran"
    tree.mkdir()
    cfg = {
        "tree": str(tree), "argv": ["sh", "-c", f"echo ran > {marker}"], "hide": [],
        "keep": [str(tmp_path / "missing")],
    }  # fmt: skip
    report, _ = booth_helper(cfg)
    assert report["started"] is False and report["rc"] == 125, report
    assert "building the booth's view of the file system" in report["error"], report
    assert not marker.exists()


WAITING_INIT = r"""
import json, os, sys, time
from jukebox.booth import isolation as iso
shim = iso.PreforkedShim.fork(join_later=True)
shim.prepare([], preload_seccomp=False)
children = f"/proc/{shim.pid}/task/{shim.pid}/children"
deadline = time.monotonic() + float(sys.argv[1])
while not open(children).read().split() and time.monotonic() < deadline:
    time.sleep(0.01)
kids = open(children).read().split()
nspid = [ln.split() for ln in open(f"/proc/{kids[0]}/status") if ln.startswith("NSpid:")]
shim.close()
print(json.dumps({"kids": kids, "nspid": nspid[0][1:], "left": os.path.exists(f"/proc/{kids[0]}")}))
"""


def test_a_prepared_shim_has_its_init_waiting_before_the_spec(tmp_path: Path) -> None:
    # As root, the pre-forked relay makes the PID namespace and forks the init as soon as it
    # is prepared (isolation._relay_with_waiting_init), off the agent's way to its start; a
    # shim closed unused ends both.
    proc = subprocess.run(
        [sys.executable, "-c", WAITING_INIT, str(slow(10))], capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)), cwd="/", timeout=slow(30),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["kids"]) == 1, report
    assert report["nspid"][-1] == "1", report  # pid 1 of a namespace of its own
    assert report["left"] is False, report


def _view_race(tree: Path, python: str = sys.executable, user: int | None = None) -> None:
    # CMD is forked before the init builds the view (isolation._init_main). strace holds each
    # mount_setattr the init makes for 0.15 s, the first of them the one that makes the host
    # read-only: a CMD that went on to its exec without waiting for the whole view would run
    # meanwhile and write on the host.
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("no strace (make installs it)")
    escaped = Path("/var/tmp") / f"jukebox-view-race-{os.getpid()}"
    script = f"{{ echo x > {escaped}; }} 2>/dev/null && echo WROTE; echo DONE"
    delay = ["-f", "-qq", "-o", "/dev/null", "-e", "trace=mount_setattr",
             "-e", "inject=mount_setattr:delay_enter=150000"]  # fmt: skip
    try:
        report, _ = booth_helper(
            {"tree": str(tree), "argv": ["sh", "-c", script], "hide": []},
            python=python,
            user=user,
            under=[strace, *delay],
        )
        assert report["started"] and report["rc"] == 0, report
        assert report["out"].splitlines() == ["DONE"], report["out"]
        assert not escaped.exists()
    finally:
        escaped.unlink(missing_ok=True)


def test_cmd_never_runs_before_the_view_is_whole(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    _view_race(tree)


def test_cmd_never_runs_before_the_view_is_whole_as_nobody(
    nobody_python: str, nobody_dir: Path
) -> None:
    # /var/tmp is writable by nobody on the host: only the view keeps the agent from it.
    tree = nobody_dir / "tree"
    tree.mkdir()
    _view_race(tree, nobody_python, NOBODY)
