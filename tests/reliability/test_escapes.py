"""Attempts to get out of a booth: none may reach the real tree, the tape dir or the host.

One agent (plain Python on the system interpreter, raw syscalls through ctypes) tries about
forty ways out in a single `jukebox booth run --commit never`, once as root and once as
`nobody` through the user namespace, and prints what each call returned. The tests then read
those outcomes and compare hashed walks of the real tree, the pre-existing tape dir contents
and canary files under /srv and /root, taken before and after the run; finally the pending booth
is committed, which must write the agent's symlinks as symlinks and never through them.

Separate runs cover what cannot share one: killing the supervisor, stragglers that outlive the
agent, and file-system limits. Hostile tree objects planted straight in the store (what a
tampered store or tape would carry) are handed to every consumer: decode, materialize, commit,
`jukebox diff` and `jukebox booth commit`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import pytest

from jukebox.booth.scratchdir import socket_dir_prefix
from shadowfs import tree as treemod
from shadowfs.commit import apply
from shadowfs.errors import ShadowfsError, TreeError
from shadowfs.store import Store
from tests.conftest import slow
from tests.reliability.conftest import (
    AGENT_PRELUDE,
    AGENT_PYTHON,
    JUKEBOX,
    NOBODY,
    Canaries,
    booth_argv,
    jb,
    tree_state,
)

# Everything the agent tries. Each outcome is "ok" or the errno name the kernel (or the layer)
# answered with; a few attempts report what they saw instead.
AGENT = AGENT_PRELUDE + r"""
import shutil, socket, stat, struct, subprocess

T, TAPES, SUP, CAN = cfg["tree"], cfg["tapes"], os.getppid(), cfg["canary"]
libc.ptrace.restype = ctypes.c_long
NR = {"x86_64": {"pivot_root": 155, "init_module": 175, "finit_module": 313},
      "aarch64": {"pivot_root": 41, "init_module": 105, "finit_module": 273}}[platform.machine()]
B = os.fsencode
out["supervisor"] = SUP
MS_BIND, MS_REC, MS_REMOUNT, MS_MOVE, MNT_DETACH = 0x1000, 0x4000, 0x20, 0x2000, 2

def mnt(src, tgt, fs, flags):
    return c(libc.mount(src and B(src), B(tgt), fs and B(fs), ctypes.c_ulong(flags), None))

def setattr_rw(path):
    attr = ctypes.create_string_buffer(struct.pack("=QQQQ", 0, 1, 0, 0), 32)  # clear RDONLY
    return c(libc.syscall(ctypes.c_long(442), ctypes.c_int(-100), ctypes.c_char_p(B(path)),
                          ctypes.c_uint(0x8000), attr, ctypes.c_size_t(32)))

def write(path, data="pwned\n", mode="a"):
    with open(path, mode) as f:
        f.write(data)

def by_handle():
    hb = bytes.fromhex(cfg["handle"])
    raw = struct.pack("Ii", len(hb), cfg["handle_type"]) + hb
    buf = ctypes.create_string_buffer(raw, len(raw))
    mfd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    fd = libc.open_by_handle_at(mfd, buf, os.O_RDONLY)
    err = ctypes.get_errno()
    os.close(mfd)
    if fd >= 0:
        os.close(fd)
        return "ok"
    return en(err)

def sup_open(rel, flags=os.O_RDONLY):
    fd = os.open(f"/proc/{SUP}/{rel}", flags | os.O_NONBLOCK)
    os.close(fd)

# --- the mount table: the layer over the tree must stay where it is
attempt("umount", lambda: c(libc.umount2(B(T), 0)))
attempt("umount_lazy", lambda: c(libc.umount2(B(T), MNT_DETACH)))
attempt("umount_lazy_root", lambda: c(libc.umount2(b"/", MNT_DETACH)))
attempt("bind_root_over_tree", lambda: mnt("/", T, None, MS_BIND | MS_REC))
attempt("tmpfs_over_tree", lambda: mnt("tmpfs", T, "tmpfs", 0))
attempt("bind_over_subdir", lambda: mnt("/etc", T + "/sub", None, MS_BIND))
attempt("move_tree_mount", lambda: mnt(T, "/mnt", None, MS_MOVE))
attempt("remount_root_rw", lambda: mnt(None, "/", None, MS_REMOUNT | MS_BIND))
attempt("mount_setattr_rw", lambda: setattr_rw("/"))
attempt("fsopen", lambda: c(libc.syscall(ctypes.c_long(430), ctypes.c_char_p(b"tmpfs"),
                                          ctypes.c_uint(0))))
attempt("open_tree_clone", lambda: c(libc.syscall(ctypes.c_long(428), ctypes.c_int(-100),
                                                  ctypes.c_char_p(B(T)), ctypes.c_uint(0x8001))))
attempt("chroot", lambda: os.chroot(T))
attempt("pivot_root", lambda: c(libc.syscall(ctypes.c_long(NR["pivot_root"]),
                                             ctypes.c_char_p(B(T)),
                                             ctypes.c_char_p(B(T + "/sub")))))

# --- the host: read-only, and its kernel interfaces closed
attempt("write_etc", lambda: write("/etc/jukebox-escape-" + cfg["tag"]))
attempt("write_srv_canary", lambda: write(CAN["file"]))
attempt("proc_sys_open_w", lambda: os.close(os.open("/proc/sys/kernel/hostname", os.O_WRONLY)))
attempt("sysrq_open_w", lambda: os.close(os.open("/proc/sysrq-trigger", os.O_WRONLY)))
attempt("sys_open_w", lambda: os.close(os.open(cfg["sysfs_file"], os.O_WRONLY)))
attempt("finit_module", lambda: c(libc.syscall(ctypes.c_long(NR["finit_module"]),
                                               ctypes.c_int(-1), ctypes.c_char_p(b""),
                                               ctypes.c_int(0))))
attempt("init_module", lambda: c(libc.syscall(ctypes.c_long(NR["init_module"]), None,
                                              ctypes.c_ulong(0), ctypes.c_char_p(b""))))

# --- devices and odd file types
attempt("mknod_char", lambda: os.mknod(T + "/null", stat.S_IFCHR | 0o666, os.makedev(1, 3)))
attempt("mknod_block", lambda: os.mknod(T + "/blockdev", stat.S_IFBLK | 0o600, os.makedev(7, 0)))
attempt("mknod_char_tmp", lambda: os.mknod("/tmp/null", stat.S_IFCHR | 0o666, os.makedev(1, 3)))
attempt("mkfifo", lambda: os.mkfifo(T + "/fifo"))
attempt("unix_socket_in_tree", lambda: socket.socket(socket.AF_UNIX).bind(T + "/sock"))

# --- links pointing out of the tree (the symlinks stay, to be committed)
attempt("hardlink_host", lambda: os.link("/etc/passwd", T + "/hl_passwd"))
attempt("hardlink_canary", lambda: os.link(CAN["file"], T + "/hl_canary"))
def hardlink_inside():
    os.link(T + "/a.txt", T + "/hl_a")
    write(T + "/hl_a", "through the link\n")
    return open(T + "/a.txt").read()
attempt("hardlink_inside", hardlink_inside)
def symlink_write(name, target):
    os.symlink(target, T + "/" + name)
    write(T + "/" + name)
attempt("symlink_abs", lambda: symlink_write("sl_abs", CAN["file"]))
depth = len(T.strip("/").split("/"))
attempt("symlink_rel_srv", lambda: symlink_write("sl_rel", "../" * depth + CAN["file"][1:]))
attempt("symlink_rel_tmp", lambda: symlink_write("sl_tmp", "../outside.txt"))
attempt("symlink_tapes", lambda: symlink_write("sl_tapes", TAPES + "/planted.jbx"))
def dir_becomes_symlink():
    shutil.rmtree(T + "/d")
    os.symlink(CAN["dir"], T + "/d")
    write(T + "/d/inner.txt", "pwned", "w")
attempt("dir_to_symlink", dir_becomes_symlink)

# --- /proc: other processes' roots, cwds and fds (the supervisor holds one to the real tree)
attempt("proc_self_root", lambda: write(f"/proc/self/root{T}/via_self_root.txt"))
attempt("proc_1_root", lambda: os.listdir(f"/proc/1/root{T}"))
attempt("proc_1_ns", lambda: sup_open("../1/ns/mnt"))
attempt("decoy_root", lambda: write(f"/proc/{cfg['decoy']}/root{T}/via_decoy.txt"))
attempt("sup_root", lambda: write(f"/proc/{SUP}/root{T}/via_supervisor.txt"))
attempt("sup_cwd", lambda: os.listdir(f"/proc/{SUP}/cwd"))
attempt("sup_environ", lambda: sup_open("environ"))
attempt("sup_mem", lambda: sup_open("mem"))
attempt("sup_ns_mnt", lambda: sup_open("ns/mnt"))
def sup_fds():
    seen, errs = [], set()
    try:
        names = os.listdir(f"/proc/{SUP}/fd")
    except OSError as e:
        return en(e.errno)
    for n in names:
        try:
            sup_open("fd/" + n)
            seen.append(n)
        except OSError as e:
            errs.add(en(e.errno))
    return ("opened " + ",".join(seen)) if seen else "/".join(sorted(errs))
attempt("sup_fds", sup_fds)
def ptrace_sup():
    r = c(libc.ptrace(ctypes.c_long(16), ctypes.c_long(SUP), None, None))  # PTRACE_ATTACH
    if r == "ok":
        libc.ptrace(ctypes.c_long(17), ctypes.c_long(SUP), None, None)  # never leave it stopped
    return r
attempt("ptrace_attach", ptrace_sup)
attempt("ptrace_seize", lambda: c(libc.ptrace(ctypes.c_long(0x4206), ctypes.c_long(SUP), None,
                                              None)))
def pidfd_getfd():
    pidfd = libc.syscall(ctypes.c_long(434), ctypes.c_int(SUP), ctypes.c_uint(0))
    if pidfd < 0:
        return en(ctypes.get_errno())
    got, errs = [], set()
    for fd in range(64):
        r = libc.syscall(ctypes.c_long(438), ctypes.c_int(pidfd), ctypes.c_int(fd),
                         ctypes.c_uint(0))
        if r >= 0:
            got.append(fd)
            os.close(r)
        else:
            errs.add(en(ctypes.get_errno()))
    os.close(pidfd)
    return ("got " + ",".join(map(str, got))) if got else "/".join(sorted(errs))
attempt("pidfd_getfd", pidfd_getfd)
attempt("open_by_handle_at", by_handle)

# --- the tape dir and the store behind it
attempt("tapes_listing", lambda: os.listdir(TAPES))
attempt("tapes_write", lambda: write(TAPES + "/planted.jbx"))
attempt("tapes_mkdir", lambda: os.mkdir(TAPES + "/.jukebox"))
attempt("store_write", lambda: write(TAPES + "/.jukebox/store/packs/pack-evil.pack"))

# --- a user namespace of its own: full capabilities, but over nothing that matters
def userns():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        res = {}
        try:
            uid, gid = os.getuid(), os.getgid()
            res["unshare"] = c(libc.unshare(0x10000000 | 0x00020000))
            if res["unshare"] == "ok":
                try:  # /proc is read-only in the booth: the maps are expected to fail
                    write("/proc/self/setgroups", "deny", "w")
                    write("/proc/self/uid_map", f"0 {uid} 1", "w")
                    write("/proc/self/gid_map", f"0 {gid} 1", "w")
                    res["uid_map"] = "ok"
                except OSError as e:
                    res["uid_map"] = en(e.errno)
                res["umount_tree"] = c(libc.umount2(B(T), MNT_DETACH))
                res["remount_root_rw"] = mnt(None, "/", None, MS_REMOUNT | MS_BIND)
                res["mount_setattr_rw"] = setattr_rw("/")
                res["tmpfs_over_tree"] = mnt("tmpfs", T, "tmpfs", 0)
                for key, fn in (
                    ("write_tree", lambda: write(T + "/via_userns.txt")),
                    ("write_srv_canary", lambda: write(CAN["file"])),
                    ("sup_root", lambda: write(f"/proc/{SUP}/root{T}/via_userns.txt")),
                    ("chroot_then_srv", lambda: (os.chroot("/"), write(CAN["file"]))),
                ):
                    try:
                        fn()
                        res[key] = "ok"
                    except OSError as e:
                        res[key] = en(e.errno)
                res["open_by_handle_at"] = by_handle()
        except Exception as e:
            res["error"] = repr(e)
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    return json.loads(data)
attempt("userns", userns)

# --- the control socket, spoken to by a hostile client
def control():
    def ask(line):
        s = socket.socket(socket.AF_UNIX)
        s.connect(os.environ["JUKEBOX_SOCKET"])
        try:
            s.sendall(line + b"\n")
        except OSError:
            pass  # the server may hang up mid-way through a flood; its reply still counts
        reply = s.makefile("rb").readline()
        s.close()
        return json.loads(reply).get("ok") if reply else "closed"
    replies = {}
    for key, line in (
        ("to_huge", b'{"op": "rollback", "to": 1000000000000000000000000000000}'),
        ("to_negative", b'{"op": "rollback", "to": -1}'),
        ("to_bool", b'{"op": "rollback", "to": true}'),
        ("to_float", b'{"op": "rollback", "to": 1e308}'),
        ("to_path", b'{"op": "rollback", "to": "../../../etc"}'),
        ("extra_key", b'{"op": "status", "path": "/"}'),
        ("not_json", b'\xff\xfe{{{'),
        ("nested", b"[" * 100000),
        ("huge_line", b'{"op": "checkpoint", "label": "' + b"x" * (1 << 20) + b'"}'),
    ):
        replies[key] = ask(line)
    flood = []
    for _ in range(200):
        try:
            k = socket.socket(socket.AF_UNIX)
            k.connect(os.environ["JUKEBOX_SOCKET"])
            flood.append(k)
        except OSError:
            break
    for k in flood:
        k.close()
    replies["status_after"] = ask(b'{"op": "status"}')
    return replies
attempt("control", control)
# ... and the directory it sits in: reachable, but nothing can be put beside the socket
SOCK_DIR = os.path.dirname(os.environ["JUKEBOX_SOCKET"])
attempt("socket_dir_listing", lambda: sorted(os.listdir(SOCK_DIR)))
attempt("socket_dir_write", lambda: write(SOCK_DIR + "/planted"))
attempt("socket_dir_mkdir", lambda: os.mkdir(SOCK_DIR + "/planted.d"))
attempt("socket_dir_bind", lambda: socket.socket(socket.AF_UNIX).bind(SOCK_DIR + "/evil.sock"))

# --- the PID namespace: pid 1 is the booth's init, and no host process is there at all
attempt("pid1_cmdline", lambda: open("/proc/1/cmdline").read().strip("\0"))
attempt("proc_pids", lambda: [int(n) for n in os.listdir("/proc") if n.isdigit()])

# --- the file system's own rules: no directory inside itself, no renaming the mount away
def rename_loop():
    os.makedirs(T + "/loop/inner")
    os.rename(T + "/loop", T + "/loop/inner/loop")
attempt("rename_loop", rename_loop)
attempt("rename_mountpoint", lambda: os.rename(T, T + "-moved"))

# --- setuid: the bit can be set, but buys nothing inside (NoNewPrivs, capabilities cut)
def setuid():
    shutil.copy("/bin/cat", T + "/suidcat")
    os.chmod(T + "/suidcat", 0o4755)
    status = subprocess.run([T + "/suidcat", "/proc/self/status"], capture_output=True,
                            text=True).stdout
    fields = dict(ln.split(":\t", 1) for ln in status.splitlines() if ":\t" in ln)
    return {"mode": oct(os.stat(T + "/suidcat").st_mode & 0o7777),
            "nnp": fields.get("NoNewPrivs"), "cap_eff": fields.get("CapEff")}
attempt("setuid", setuid)
attempt("caps", lambda: {ln.split(":")[0]: ln.split()[1] for ln in open("/proc/self/status")
                         if ln.startswith(("CapBnd", "CapEff", "CapPrm", "NoNewPrivs"))})

print("RESULT " + json.dumps(out), flush=True)
"""

MOUNT_CALLS = (
    "umount",
    "umount_lazy",
    "umount_lazy_root",
    "bind_root_over_tree",
    "tmpfs_over_tree",
    "bind_over_subdir",
    "move_tree_mount",
    "remount_root_rw",
    "mount_setattr_rw",
    "fsopen",
    "open_tree_clone",
    "chroot",
    "pivot_root",
)
HOST_CALLS = (
    "write_etc",
    "write_srv_canary",
    "proc_sys_open_w",
    "sysrq_open_w",
    "sys_open_w",
    "finit_module",
    "init_module",
)
SUPERVISOR_CALLS = (
    "proc_1_root",
    "proc_1_ns",
    "decoy_root",
    "sup_root",
    "sup_cwd",
    "sup_environ",
    "sup_mem",
    "sup_ns_mnt",
    "ptrace_attach",
    "ptrace_seize",
)
CAP_SYS_ADMIN = 21
# CAP_DAC_READ_SEARCH, CAP_LINUX_IMMUTABLE, CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_SYS_CHROOT,
# CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_SYS_BOOT, CAP_MKNOD
DROPPED = (2, 9, 16, 17, 18, 19, 21, 22, 27)


def refused(outcome: object) -> bool:
    """An errno answer (not success, not a crash of the agent's own code)."""
    return isinstance(outcome, str) and outcome.startswith("E")


def file_handle(path: Path) -> tuple[str, int]:
    """name_to_handle_at(2) of a real-tree file, taken outside: bait for open_by_handle_at."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(8 + 128)
    struct.pack_into("I", buf, 0, 128)
    mount_id = ctypes.c_int()
    r = libc.name_to_handle_at(-100, os.fsencode(path), buf, ctypes.byref(mount_id), 0)
    assert r == 0, os.strerror(ctypes.get_errno())
    size, kind = struct.unpack_from("Ii", buf)
    return buf.raw[8 : 8 + size].hex(), kind


def sysfs_file() -> str:
    for candidate in ("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/power/state"):
        if os.path.exists(candidate):
            return candidate
    return "/sys/kernel/uevent_helper"


@dataclass
class Battery:
    user: str
    work: Path
    tree: Path
    tapes: Path
    results: dict[str, object]
    run: subprocess.CompletedProcess[str]
    tree_before: dict[str, object]
    tree_after: dict[str, object]
    tapes_before: dict[str, object]
    tapes_after: dict[str, object]
    canaries_before: dict[str, object]
    canaries_after: dict[str, object]
    outside_before: str
    outside_after: str
    commit: subprocess.CompletedProcess[str]
    committed: dict[str, object]
    tmp_residue: list[str]  # what the run left in the host's /tmp


def _prepare(work: Path, owner: int | None, tapes: Path | None = None) -> tuple[Path, Path]:
    tree, tapes = work / "tree", tapes or work / "tapes"
    (tree / "sub").mkdir(parents=True)
    (tree / "d").mkdir()
    (tree / "a.txt").write_text("one\n")
    (tree / "keep.txt").write_text("untouched\n")
    (tree / "d" / "f").write_text("in a directory that becomes a symlink\n")
    tapes.mkdir()
    (tapes / "canary.txt").write_text("a file the agent must not see or change\n")
    (work / "outside.txt").write_text("beside the tree, on the host\n")
    if owner is not None:
        for p in [work, *work.rglob("*"), tapes, *tapes.rglob("*")]:
            os.chown(p, owner, owner, follow_symlinks=False)
    return tree, tapes


@contextlib.contextmanager
def _decoy(user: int | None) -> Iterator[int]:
    """A host process of the agent's own uid, outside any booth: its /proc root is the host's."""
    cmd = ["sleep", "120"]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    proc = subprocess.Popen(cmd)
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module", params=["root", "nobody"])
def battery(
    request: pytest.FixtureRequest,
    canaries: Canaries,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Battery]:
    request.getfixturevalue("booth_ready")
    user: int | None = None
    python: str | None = None
    if request.param == "nobody":
        python = request.getfixturevalue("nobody_python")
        request.getfixturevalue("open_dev_fuse")
        user = NOBODY
        work = Path("/tmp") / f"jukebox-escapes-{os.getpid()}"
        work.mkdir()
    else:
        work = tmp_path_factory.mktemp("escapes")
    # As root the tape dir sits outside /tmp, where only the booth's cover hides it (under the
    # private /tmp it would simply not exist); as nobody it stays beside the tree.
    far = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="jukebox-escapes-"))
    try:
        tree, tapes = _prepare(work, user, far / "tapes" if user is None else None)
        handle, handle_type = file_handle(tree / "a.txt")
        tree_before, tapes_before = tree_state(tree), tree_state(tapes)
        canaries_before = canaries.state()
        outside_before = (work / "outside.txt").read_text()
        with _decoy(user) as decoy:
            cfg = {
                "tree": str(tree),
                "tapes": str(tapes),
                "canary": {"file": str(canaries.file), "dir": str(canaries.dir)},
                "tag": f"{os.getpid()}-{request.param}",
                "handle": handle,
                "handle_type": handle_type,
                "decoy": decoy,
                "sysfs_file": sysfs_file(),
            }
            run = jb(
                *booth_argv(tree, tapes, "esc", "--commit", "never"),
                AGENT_PYTHON,
                "-I",
                "-c",
                AGENT,
                json.dumps(cfg),
                cwd=work,
                python=python,
                user=user,
            )
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert line, f"the agent printed no result (rc {run.returncode}):\n{run.stderr}"
        results = json.loads(line[len("RESULT ") :])
        if os.environ.get("JUKEBOX_ESCAPES_SHOW"):
            print(json.dumps(results, indent=1))
        tree_after, tapes_after = tree_state(tree), tree_state(tapes)
        prefix = socket_dir_prefix(tapes, "esc")
        tmp_residue = sorted(p.name for p in Path("/tmp").glob(prefix + "*"))
        canaries_after = canaries.state()
        outside_after = (work / "outside.txt").read_text()
        commit = jb("booth", "commit", "esc", "--tape-dir", str(tapes), python=python, user=user)
        yield Battery(
            request.param,
            work,
            tree,
            tapes,
            results,
            run,
            tree_before,
            tree_after,
            tapes_before,
            tapes_after,
            canaries_before,
            canaries_after,
            outside_before,
            outside_after,
            commit,
            tree_state(tree),
            tmp_residue,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(far, ignore_errors=True)


# ------------------------------------------------------------------- what the agent was told


def test_the_agent_ran_every_attempt(battery: Battery) -> None:
    assert battery.run.returncode == 0, battery.run.stderr
    errors = {k: v for k, v in battery.results.items() if str(v).startswith("error ")}
    assert not errors, errors  # every attempt ran to an answer; none crashed the agent


@pytest.mark.parametrize("call", MOUNT_CALLS)
def test_mount_table_is_sealed(battery: Battery, call: str) -> None:
    assert refused(battery.results[call]), (call, battery.results[call])


@pytest.mark.parametrize("call", HOST_CALLS)
def test_host_and_kernel_interfaces_are_closed(battery: Battery, call: str) -> None:
    assert refused(battery.results[call]), (call, battery.results[call])


def test_capabilities_that_open_a_way_out_are_gone_for_good(battery: Battery) -> None:
    # Checked on the sets, not only by the calls: a kernel without module support answers
    # init_module with ENOSYS whatever the caller holds.
    caps = battery.results["caps"]
    assert isinstance(caps, dict), caps
    assert caps["NoNewPrivs"] == "1"
    for name in ("CapBnd", "CapEff", "CapPrm"):
        held = int(caps[name], 16)
        for cap in DROPPED:
            assert not held & (1 << cap), (name, cap)


@pytest.mark.parametrize("call", SUPERVISOR_CALLS)
def test_supervisor_and_host_processes_are_out_of_reach(battery: Battery, call: str) -> None:
    # The supervisor holds an fd to the real tree and lives in the namespace where the tree is
    # bare; /proc/<pid>/{root,cwd,fd,mem,ns} and ptrace all need ptrace access to it, which a
    # process whose capabilities are a strict subset of the target's never has.
    assert refused(battery.results[call]), (call, battery.results[call])


def test_supervisor_fds_cannot_be_opened_or_stolen(battery: Battery) -> None:
    r = battery.results
    assert r["sup_fds"] in ("EACCES", "EPERM"), r["sup_fds"]
    assert r["pidfd_getfd"] == "EPERM", r["pidfd_getfd"]


def test_open_by_handle_is_refused(battery: Battery) -> None:
    # A handle to the real a.txt, taken outside: with CAP_DAC_READ_SEARCH it would open the
    # real file past every mount (the "shocker" escape).
    assert battery.results["open_by_handle_at"] == "EPERM"


def test_devices_cannot_be_made_and_fifos_stay_in_the_layer(battery: Battery) -> None:
    r = battery.results
    for call in ("mknod_char", "mknod_block", "mknod_char_tmp"):
        assert refused(r[call]), (call, r[call])
    # FIFOs and sockets are no devices: they work in the layer while the booth runs (tools make
    # them), and the commit test below shows they reach the real tree as what they are.
    assert r["mkfifo"] == "ok" and r["unix_socket_in_tree"] == "ok", r


def test_hard_links_stay_inside(battery: Battery) -> None:
    r = battery.results
    assert r["hardlink_host"] == "EXDEV" and r["hardlink_canary"] == "EXDEV"
    # A hard link inside the tree works like one, but the write lands in the layer.
    assert r["hardlink_inside"] == "one\nthrough the link\n"
    assert battery.tree_after == battery.tree_before


def test_symlinks_do_not_carry_writes_out(battery: Battery) -> None:
    r = battery.results
    for call in ("symlink_abs", "symlink_rel_srv", "symlink_tapes", "dir_to_symlink"):
        assert refused(r[call]), (call, r[call])
    # ../outside.txt resolves into the booth's private /tmp: the write succeeds there only.
    assert r["symlink_rel_tmp"] == "ok"
    assert battery.outside_after == battery.outside_before


def test_tape_dir_is_hidden_and_read_only(battery: Battery) -> None:
    r = battery.results
    # Covered by an empty tmpfs, or (under a private /tmp) not there at all.
    assert r["tapes_listing"] in ([], "ENOENT"), r["tapes_listing"]
    for call in ("tapes_write", "tapes_mkdir", "store_write"):
        assert refused(r[call]), (call, r[call])
    for path, entry in battery.tapes_before.items():
        if path != ".":
            assert battery.tapes_after.get(path) == entry, path
    assert not any("planted" in p or "evil" in p for p in battery.tapes_after)


def test_a_user_namespace_of_its_own_is_refused(battery: Battery) -> None:
    # The seccomp filter refuses CLONE_NEWUSER (an image may allow it: [seccomp] allow =
    # ["userns"]); in one the agent would hold every capability over new namespaces again.
    assert battery.results["userns"] == {"unshare": "EPERM"}
    assert "via_userns.txt" not in battery.tree_after


def test_control_socket_survives_hostile_requests(battery: Battery) -> None:
    replies = battery.results["control"]
    assert isinstance(replies, dict), replies
    status = replies.pop("status_after")
    assert status is True  # and the server still answers after all of that
    # Each refused with an error reply (a line over 64 KiB may instead end its connection).
    assert all(v is False for k, v in replies.items() if k != "huge_line"), replies
    assert replies["huge_line"] in (False, "closed"), replies


def test_control_socket_dir_is_read_only_and_leaves_nothing_in_tmp(battery: Battery) -> None:
    r = battery.results
    assert r["socket_dir_listing"] == ["control.sock"], r["socket_dir_listing"]
    for call in ("socket_dir_write", "socket_dir_mkdir", "socket_dir_bind"):
        assert r[call] == "EROFS", (call, r[call])
    # The agent connected all the same (the hostile requests above got their answers), and
    # the directory, a private tmpfs over an empty mount point, is gone with the run.
    assert r["control"]["to_negative"] is False  # an answer: the connection was made
    assert battery.tmp_residue == []


def test_pid_one_is_the_init_and_host_processes_do_not_exist_inside(battery: Battery) -> None:
    r = battery.results
    assert r["pid1_cmdline"] == "jukebox-init", r["pid1_cmdline"]
    assert r["supervisor"] == 1  # the agent's parent is the init, not the supervisor
    pids = r["proc_pids"]
    assert isinstance(pids, list) and 1 in pids, pids
    # The init, the agent and whatever the agent runs at that moment: a handful, all small.
    assert len(pids) < 10 and max(pids) < 100, pids
    assert r["decoy_root"] == "ENOENT"  # a host process of the same uid has no pid here


def test_directory_cannot_be_moved_into_itself(battery: Battery) -> None:
    assert battery.results["rename_loop"] == "EINVAL"
    assert refused(battery.results["rename_mountpoint"])


def test_setuid_buys_nothing_inside(battery: Battery) -> None:
    s = battery.results["setuid"]
    assert isinstance(s, dict), s
    assert s["mode"] == "0o4755"  # the layer records what the agent asked for
    assert s["nnp"] == "1"
    assert not int(s["cap_eff"], 16) & (1 << CAP_SYS_ADMIN)


def test_real_tree_tape_dir_and_host_untouched_by_the_run(battery: Battery) -> None:
    assert battery.tree_after == battery.tree_before
    assert battery.canaries_after == battery.canaries_before
    assert not list(Path("/etc").glob("jukebox-escape-*"))


# ------------------------------------------------------------------- the commit of it all


def test_commit_writes_links_as_links_and_never_through_them(battery: Battery) -> None:
    assert battery.commit.returncode == 0, battery.commit.stderr
    tree, c = battery.tree, battery.committed
    assert os.readlink(tree / "sl_abs").endswith("/file.txt")
    assert os.readlink(tree / "sl_rel").startswith("../")
    assert os.readlink(tree / "sl_tmp") == "../outside.txt"
    assert (tree / "d").is_symlink() and os.readlink(tree / "d").endswith("/dir")
    # Replacing d/ by a link to the canary dir deleted d/f, in the real d/, not in the canary.
    assert battery.canaries_after == battery.canaries_before
    assert (battery.work / "outside.txt").read_text() == battery.outside_before
    # A hard link made inside stays one: two names of one inode.
    assert (tree / "a.txt").read_text() == (tree / "hl_a").read_text() == "one\nthrough the link\n"
    assert os.lstat(tree / "a.txt").st_ino == os.lstat(tree / "hl_a").st_ino
    assert (tree / "via_self_root.txt").exists()  # /proc/self/root is the booth's own view
    never = ("null", "blockdev", "hl_passwd", "hl_canary", "via_supervisor.txt")
    for name in never:
        assert name not in c, name
    # The FIFO and the socket's inode come as they are; no device node ever does.
    assert stat.S_ISFIFO(os.lstat(tree / "fifo").st_mode)
    assert stat.S_ISSOCK(os.lstat(tree / "sock").st_mode)
    kinds = {stat.S_IFMT(e[0]) for e in c.values()}  # type: ignore[index, call-overload]
    assert kinds <= {stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK}


def test_commit_never_mints_setuid_files(battery: Battery) -> None:
    # A root supervisor writing an agent's setuid file would hand every local user a setuid-root
    # program the sandbox never let the agent use itself: commits drop setuid/setgid on files.
    assert battery.commit.returncode == 0, battery.commit.stderr
    mode = stat.S_IMODE(os.lstat(battery.tree / "suidcat").st_mode)
    assert mode == 0o755, oct(mode)


# ------------------------------------------------------------------- runs of their own


def _booth_popen(args: list[str], cwd: Path, python: str | None, user: int | None) -> Popen:
    """`jukebox ARGS` as `jb` runs it, but started, not waited for; its pid is the supervisor's."""
    cmd = [JUKEBOX, *args]
    if python is not None:
        cmd = [python, "-c", "from jukebox.cli import main; main()", *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    env = dict(os.environ, PATH=f"{Path(JUKEBOX).parent}:{os.environ.get('PATH', '')}")
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _lines_until(proc: Popen, last: str, timeout: float = 30) -> list[str]:
    """The agent's stdout lines up to `last`, read straight from the pipe (a buffered reader
    would hide lines from select)."""
    buf = b""
    deadline = time.monotonic() + slow(timeout)
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            lines = buf.decode(errors="replace").splitlines()
            if last in lines:
                return lines
    raise AssertionError(f"no {last!r} from the agent; it printed {buf!r}")


def _processes_with(marker: str) -> list[int]:
    """Host pids whose argv holds `marker` (a sleep's unique duration)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker.encode() in argv:
                found.append(int(entry))
    return found


@pytest.fixture(params=["root", "nobody"])
def runner(request: pytest.FixtureRequest, booth_ready: None, tmp_path: Path) -> Iterator[tuple]:
    """(work dir, python, user) for a booth run as root or as nobody through a user namespace."""
    if request.param == "root":
        yield tmp_path, None, None
        return
    python = request.getfixturevalue("nobody_python")
    request.getfixturevalue("open_dev_fuse")
    work = Path("/tmp") / f"jukebox-escapes-{os.getpid()}-{tmp_path.name}"
    work.mkdir()
    try:
        yield work, python, NOBODY
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_killing_the_supervisor_ends_every_process_of_the_booth(runner: tuple) -> None:
    work, python, user = runner
    tree, tapes = _prepare(work, user)
    before = tree_state(tree)
    booth = f"k{os.getpid()}"
    marker = f"1000.{os.getpid()}{time.monotonic_ns() % 100000}"
    # Every way a process leaves its parent behind: a new session, nohup, a double fork. The
    # supervisor's real pid comes on stdin: inside, it must not exist, nor be killable.
    script = (
        "read SUP; echo half > a.txt; "
        f"setsid sleep {marker} </dev/null >/dev/null 2>&1 & "
        f"nohup sleep {marker} </dev/null >/dev/null 2>&1 & "
        f"(sleep {marker} </dev/null >/dev/null 2>&1 &); "
        "echo INIT $(tr '\\0' ' ' < /proc/1/cmdline); "
        "[ -e /proc/$SUP ] && echo SUP_VISIBLE || echo SUP_HIDDEN; "
        "kill -9 $SUP 2>/dev/null && echo SUP_KILLED || echo SUP_UNREACHABLE; "
        f"echo READY; exec sleep {marker}"
    )
    args = [*booth_argv(tree, tapes, booth), "sh", "-c", script]
    proc = _booth_popen(args, work, python, user)
    try:
        proc.stdin.write(f"{proc.pid}\n")
        proc.stdin.flush()
        lines = _lines_until(proc, "READY")
        assert "INIT jukebox-init" in lines, lines
        assert "SUP_HIDDEN" in lines and "SUP_UNREACHABLE" in lines, lines
        deadline = time.monotonic() + slow(10)
        while len(_processes_with(marker)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_processes_with(marker)) == 4  # the agent and its three runaways
        # The control socket's mount point, which the discard below must take away.
        assert list(Path("/tmp").glob(socket_dir_prefix(tapes, booth) + "*")) != []
        proc.kill()
        assert proc.wait(timeout=slow(10)) == -9
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + slow(5)
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []
    assert tree_state(tree) == before
    listed = json.loads(jb("booth", "ls", "--json", "--tape-dir", str(tapes)).stdout)
    assert [(b["id"], b["status"]) for b in listed] == [(booth, "crashed")]
    assert jb("booth", "commit", booth, "--tape-dir", str(tapes)).returncode != 0
    discard = jb("booth", "discard", booth, "--tape-dir", str(tapes))
    assert discard.returncode == 0, discard.stderr
    assert json.loads(jb("booth", "ls", "--json", "--tape-dir", str(tapes)).stdout) == []
    assert not (tapes / ".jukebox" / "scratch" / booth).exists()
    # The control socket lived in a tmpfs that died with the supervisor's namespace; the empty
    # mount point it left in /tmp goes with the discard.
    assert list(Path("/tmp").glob(socket_dir_prefix(tapes, booth) + "*")) == []
    assert tree_state(tree) == before
    assert jb("verify", str(tapes / f"{booth}.jbx"), "--tape-dir", str(tapes)).returncode == 0


def test_stragglers_die_with_the_run(booth_ready: None, tmp_path: Path) -> None:
    tree, tapes = _prepare(tmp_path, None)
    marker = f"straggler.{os.getpid()}{time.monotonic_ns() % 100000}"
    # The straggler carries the marker in its own argv ($0) from its exec on, and the agent
    # leaves only once it has shown it runs (c.txt): the check below cannot miss it for being
    # slow to start. Left alone it would outlive the test by far, so it cannot be gone by
    # having ended by itself either (a one-second straggler was, before the run returned).
    script = (
        f"setsid sh -c 'echo started > c.txt; sleep 600' {marker} </dev/null >/dev/null 2>&1 & "
        "while [ ! -e c.txt ]; do sleep 0.01; done; echo done > b.txt"
    )
    try:
        run = jb(*booth_argv(tree, tapes, "s1"), "sh", "-c", script, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert (tree / "c.txt").read_text() == "started\n"  # it ran while the agent did
        # The init exited with the agent: the kernel had killed the straggler (and waited for
        # it to die) before the verdict, so it is gone the moment the run returns.
        assert _processes_with(marker) == []
        assert (tree / "b.txt").read_text() == "done\n"
    finally:
        for pid in _processes_with(marker):  # only when the booth let it live
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_big_file_and_many_files_round_trip(booth_ready: None, tmp_path: Path) -> None:
    """Limits the layer must carry: a file over the 4 MiB chunk size and 1,000 new files."""
    tree, tapes = _prepare(tmp_path, None)
    script = (
        "import os\n"
        "with open('big.bin', 'wb') as f:\n"
        "    for i in range(12):\n"
        "        f.write(bytes([i]) * (1 << 20))\n"
        "os.mkdir('many')\n"
        "for i in range(1000):\n"
        "    open(f'many/{i}', 'w').write(str(i))\n"
    )
    run = jb(*booth_argv(tree, tapes, "big"), AGENT_PYTHON, "-c", script, cwd=tree)
    assert run.returncode == 0, run.stderr
    big = (tree / "big.bin").read_bytes()
    assert len(big) == 12 << 20 and big[-1] == 11 and big[(5 << 20) + 7] == 5
    names = os.listdir(tree / "many")
    assert len(names) == 1000 and (tree / "many" / "999").read_text() == "999"


# ------------------------------------------------------------------- hostile tree objects


HOSTILE_NAMES = (b"..", b".", b"../../escaped", b"/etc/escaped", b"a/b", b"nul\0byte", b"")


def _hostile(store: Store, name: bytes, kind: str = treemod.FILE) -> bytes:
    blob = store.put("blob", b"pwned\n")
    entry = treemod.Entry(name, kind, 0o644, 6, 0, blob, None)
    # pack_entries skips validation: it is how a forged tree object is made.
    return treemod.pack_entries([entry])


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "store", create=True) as s:
        yield s


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_hostile_names_are_refused_by_decode_materialize_and_commit(
    store: Store, tmp_path: Path, name: bytes
) -> None:
    raw = _hostile(store, name)
    bad = store.put("tree", raw)
    treemod.clear_cache()
    with pytest.raises(TreeError, match="malformed tree object"):
        treemod.decode_tree(raw)
    with pytest.raises(TreeError):
        treemod.read_tree(store, bad)

    dest = tmp_path / "out" / "dest"
    dest.parent.mkdir()
    with pytest.raises(TreeError):
        treemod.materialize(store, bad, dest)
    assert os.listdir(dest.parent) == ["dest"] and os.listdir(dest) == []

    # Hidden one level down: a valid root whose sub-directory is the forged tree.
    root_entry = treemod.Entry(b"sub", treemod.DIR, 0o755, 0, 0, bad, None)
    nested = store.put("tree", treemod.encode_tree([root_entry]))
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("keep\n")
    base = treemod.build_tree(store, target)
    before = tree_state(tmp_path)
    for new in (bad, nested):
        with pytest.raises(ShadowfsError):
            apply(store, target, base, new, journal_dir=tmp_path / "journal")
    after = tree_state(tmp_path)
    assert after.pop("journal")[0] == stat.S_IFDIR and os.listdir(tmp_path / "journal") == []
    assert after == before
    assert not Path("/etc/escaped").exists() and not (tmp_path / "escaped").exists()


def test_device_kind_in_a_tree_is_refused(store: Store) -> None:
    raw = bytearray(_hostile(store, b"disk"))
    raw[1] = 4  # the kind code of the first entry: 1 file, 2 dir, 3 symlink, nothing else
    with pytest.raises(TreeError, match="unknown kind"):
        treemod.decode_tree(bytes(raw))


def test_setuid_and_absolute_symlinks_in_a_forged_tree_commit_as_plain_entries(
    store: Store, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("outside\n")
    base = treemod.build_tree(store, target)
    blob = store.put("blob", b"pwned\n")
    entries = [
        treemod.Entry(
            b"link", treemod.SYMLINK, 0o777, len(str(outside)), 0, None, os.fsencode(outside)
        ),
    ]
    new = store.put("tree", treemod.encode_tree(entries))
    apply(store, target, base, new, journal_dir=tmp_path / "journal")
    assert os.readlink(target / "link") == str(outside)
    assert outside.read_text() == "outside\n"
    # Now the same name as a file: the commit replaces the link, never writes through it.
    base2 = treemod.build_tree(store, target)
    entries = [treemod.Entry(b"link", treemod.FILE, 0o644, 6, 0, blob, None)]
    apply(
        store,
        target,
        base2,
        store.put("tree", treemod.encode_tree(entries)),
        journal_dir=tmp_path / "journal",
    )
    assert not (target / "link").is_symlink() and (target / "link").read_text() == "pwned\n"
    assert outside.read_text() == "outside\n"


def test_forged_pending_booth_and_tape_are_refused_cleanly(
    booth_ready: None, tmp_path: Path
) -> None:
    """A tampered store or record (never the agent: it cannot reach the tape dir) names a tree
    with `..` in it: `jukebox booth commit`, `diff` and `replay` refuse it in one line."""
    tree, tapes = _prepare(tmp_path, None)
    run = jb(*booth_argv(tree, tapes, "f1", "--commit", "never"), "sh", "-c", "echo x > n.txt")
    assert run.returncode == 0, run.stderr
    with Store.open(tapes / ".jukebox" / "store") as s:
        bad = s.put("tree", _hostile(s, b"../../escaped"))
        s.flush()
        from jukebox.tape.tape import TapeWriter

        with TapeWriter.open_append(str(tapes / "f1.jbx"), s) as w:
            forged = w.append("fs", {"reason": "forged"}, tree=bad).seq
    record_path = tapes / ".jukebox" / "booths" / "f1.json"
    record = json.loads(record_path.read_text())
    record["final_tree"] = bad.hex()
    record_path.write_text(json.dumps(record))
    before = tree_state(tmp_path)
    for args in (
        ("booth", "commit", "f1"),
        ("booth", "diff", "f1"),
        ("diff", "f1@0", f"f1@{forged}"),
        ("replay", "f1"),
    ):
        proc = jb(*args, "--tape-dir", str(tapes))
        assert proc.returncode in (1, 2), (args, proc.returncode, proc.stderr)
        assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr, args
        assert proc.stderr.count("\n") == 1, (args, proc.stderr)
    after = tree_state(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("tapes")} == {
        k: v for k, v in before.items() if not k.startswith("tapes")
    }
    assert not (tmp_path.parent / "escaped").exists() and not (tmp_path / "escaped").exists()


def test_drop_setid_clears_the_bits_only_on_files_the_commit_writes(
    store: Store, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "old-suid").write_text("base\n")
    (target / "old-suid").chmod(0o4755)
    base = treemod.build_tree(store, target)
    blob = store.put("blob", b"new\n")
    entries = [
        *treemod.read_tree(store, base),
        treemod.Entry(b"new-suid", treemod.FILE, 0o6755, 4, 0, blob, None),
        treemod.Entry(b"sgid-dir", treemod.DIR, 0o2775, 0, 0, store.put("tree", b"\x01"), None),
    ]
    new = store.put("tree", treemod.encode_tree(entries))
    apply(store, target, base, new, journal_dir=tmp_path / "j", drop_setid=True)
    assert stat.S_IMODE((target / "new-suid").stat().st_mode) == 0o755
    assert stat.S_IMODE((target / "old-suid").stat().st_mode) == 0o4755  # untouched: kept
    assert stat.S_IMODE((target / "sgid-dir").stat().st_mode) == 0o2775  # directories keep it
