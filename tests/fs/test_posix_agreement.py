"""POSIX answers of shadowfs, side by side with native ext4 and the kernel's overlayfs.

Each test runs the same operations on four roots over the same base tree: a plain directory
(``native``, the temp file system: ext4 here), a plain kernel overlay mount (``overlay``, the
reference), and both shadowfs backends (``shadowfs-overlay``: `shadowfs.overlay.OverlayLayer`;
``shadowfs-fuse``: the FUSE layer, served from a child process), and requires the shadowfs roots
to answer as the kernel overlay does.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import socket
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shadowfs.layer import Layer
from shadowfs.mountctl import Mount
from shadowfs.overlay import OverlayLayer
from shadowfs.store import Store
from tests.fs.conftest import needs_fuse, populate

pytestmark = [
    pytest.mark.fuse,
    needs_fuse,
    pytest.mark.skipif(os.geteuid() != 0, reason="kernel overlay mounts need root"),
]

SHADOWFS = ("shadowfs-overlay", "shadowfs-fuse")
LONG = b"x" * 256  # NAME_MAX + 1
LONGEST = b"y" * 255


@pytest.fixture
def roots(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """name -> a directory showing the `populate` tree, one per file system under test."""
    native = tmp_path / "native"
    populate_linked(native)
    base = tmp_path / "base"
    populate_linked(base)
    out = {"native": native}
    for name in ("overlay", "shadowfs-overlay", "shadowfs-fuse"):
        out[name] = tmp_path / name
        out[name].mkdir()
    kernel = tmp_path / "kernel"
    (kernel / "upper").mkdir(parents=True)
    (kernel / "work").mkdir()
    opts = f"lowerdir={base},upperdir={kernel}/upper,workdir={kernel}/work"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, out["overlay"]], check=True)
    store = Store.open(tmp_path / "store")
    try:
        with (
            OverlayLayer(base, store, tmp_path / "booth").mounted(out["shadowfs-overlay"]),
            Layer(base, store, tmp_path / "scratch") as layer,
            Mount(layer, out["shadowfs-fuse"], process=True),
        ):
            yield out
    finally:
        subprocess.run(["umount", "-l", out["overlay"]], check=True)
        store.close()


def populate_linked(root: Path) -> None:
    """`populate`, a base file with a second name in another directory, and a fifo of
    another owner."""
    populate(root)
    os.link(root / "src" / "util.py", root / "docs" / "util-link.py")
    os.mkfifo(root / "base-pipe")
    os.chmod(root / "base-pipe", 0o620)
    os.chown(root / "base-pipe", 65534, 65534)


def outcome(fn: Callable[[], Any]) -> Any:
    """What ``fn`` returned, or the name of the errno it failed with."""
    try:
        return fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def answers(roots: dict[str, Path], probe: Callable[[bytes], Any]) -> dict[str, Any]:
    return {name: probe(os.fsencode(root)) for name, root in roots.items()}


def assert_agree(got: dict[str, Any], reference: str = "overlay") -> None:
    want = got[reference]
    wrong = {name: got[name] for name in SHADOWFS if got[name] != want}
    assert not wrong, f"{reference} answered {want!r}; differing: {wrong!r}"


# ---------------------------------------------------------------------- names over NAME_MAX


def _name_probes(r: bytes) -> list[Any]:
    j = os.path.join
    probes: list[Callable[[], Any]] = [
        lambda: os.stat(j(r, LONG)).st_size,
        lambda: os.lstat(j(r, b"src", LONG)).st_size,
        lambda: os.stat(j(r, LONG)).st_size,  # again: no missing name cached for it
        lambda: os.close(os.open(j(r, LONG), os.O_RDONLY)),
        lambda: os.close(os.open(j(r, LONG), os.O_WRONLY | os.O_CREAT, 0o644)),
        lambda: os.mkdir(j(r, LONG)),
        lambda: os.mkfifo(j(r, LONG)),
        lambda: os.symlink(b"README", j(r, LONG)),
        lambda: os.link(j(r, b"README"), j(r, LONG)),
        lambda: os.rename(j(r, b"README"), j(r, LONG)),
        lambda: os.rename(j(r, LONG), j(r, b"elsewhere")),
        lambda: os.unlink(j(r, LONG)),
        lambda: os.rmdir(j(r, LONG)),
        lambda: os.listdir(j(r, LONG, b"below")),
        lambda: os.access(j(r, LONG), os.F_OK),
        # 255 bytes is a name like any other.
        lambda: os.close(os.open(j(r, LONGEST), os.O_WRONLY | os.O_CREAT, 0o644)),
        lambda: os.stat(j(r, LONGEST)).st_size,
        lambda: os.rename(j(r, LONGEST), j(r, b"src", LONGEST)),
        lambda: os.mkdir(j(r, LONGEST)),
        lambda: sorted(n for n in os.listdir(r) if len(n) > 200),
    ]
    return [outcome(p) for p in probes]


def test_a_name_over_255_bytes_is_too_long_for_every_request(roots: dict[str, Path]) -> None:
    got = answers(roots, _name_probes)
    assert_agree(got)
    assert got["overlay"] == got["native"]
    assert got["overlay"][0] == "ENAMETOOLONG"


# ---------------------------------------------------------------------- directory link counts


def _nlinks(r: bytes) -> dict[str, Any]:
    j = os.path.join

    def nlink(*parts: bytes) -> Any:
        return outcome(lambda: os.lstat(j(r, *parts)).st_nlink)

    out: dict[str, Any] = {}
    # Untouched base directories: none, one and two levels below.
    out["src"] = nlink(b"src")
    out["docs"] = nlink(b"docs")
    out["docs/deep"] = nlink(b"docs", b"deep")
    out["empty"] = nlink(b"empty")
    # Directories made in the layer, as sub-directories come and go.
    os.makedirs(j(r, b"new", b"a", b"x"))
    os.mkdir(j(r, b"new", b"b"))
    os.mkdir(j(r, b"new", b"c"))
    (Path(os.fsdecode(j(r, b"new", b"file")))).write_text("not a directory\n")
    out["new, 3 dirs"] = nlink(b"new")
    out["new/a"] = nlink(b"new", b"a")
    os.rmdir(j(r, b"new", b"c"))
    out["new, rmdir"] = nlink(b"new")
    os.rename(j(r, b"new", b"a"), j(r, b"moved"))
    out["new, renamed out"] = nlink(b"new")
    os.mkdir(j(r, b"other"))
    os.rename(j(r, b"moved"), j(r, b"other", b"moved"))
    out["other, renamed in"] = nlink(b"other")
    os.mkdir(j(r, b"other", b"empty"))
    os.rename(j(r, b"new", b"b"), j(r, b"other", b"empty"))  # over an empty directory
    out["other, renamed over"] = nlink(b"other")
    out["new, renamed over"] = nlink(b"new")
    os.rename(j(r, b"new", b"file"), j(r, b"other", b"file"))
    out["other, file moved in"] = nlink(b"other")
    return out


def _merged_nlinks(r: bytes) -> dict[str, Any]:
    j = os.path.join
    os.mkdir(j(r, b"docs", b"added"))
    os.rename(j(r, b"src"), j(r, b"docs", b"src"))
    os.rename(j(r, b"docs", b"deep", b"er"), j(r, b"er"))
    return {p: os.lstat(j(r, p)).st_nlink for p in (b"", b"docs", b"docs/deep", b"er")}


def test_a_directory_links_two_plus_its_sub_directories(roots: dict[str, Path]) -> None:
    got = answers(roots, _nlinks)
    assert_agree(got)
    assert got["overlay"] == got["native"]
    assert got["overlay"]["docs"] == 3 and got["overlay"]["new, 3 dirs"] == 5
    # A base directory changed in the layer: the kernel overlay gives up and says 1 for such a
    # "merged" directory (ovl_getattr); shadowfs knows the count and answers as ext4 does.
    merged = answers({n: roots[n] for n in ("native", "shadowfs-fuse")}, _merged_nlinks)
    assert merged["shadowfs-fuse"] == merged["native"]
    assert merged["native"] == {b"": 7, b"docs": 5, b"docs/deep": 2, b"er": 2}


# ---------------------------------------------------------------------- . and .. in listings


class _Dirent(ctypes.Structure):
    _fields_ = [
        ("d_ino", ctypes.c_uint64),
        ("d_off", ctypes.c_int64),
        ("d_reclen", ctypes.c_uint16),
        ("d_type", ctypes.c_uint8),
        ("d_name", ctypes.c_char * 256),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.opendir.restype = ctypes.c_void_p
_libc.opendir.argtypes = [ctypes.c_char_p]
_libc.readdir.restype = ctypes.POINTER(_Dirent)
_libc.readdir.argtypes = [ctypes.c_void_p]
_libc.closedir.argtypes = [ctypes.c_void_p]


def raw_listing(path: bytes) -> dict[bytes, tuple[int, int]]:
    """name -> (d_ino, d_type) of every entry readdir(3) returns, `.` and `..` included."""
    d = _libc.opendir(path)
    assert d, os.strerror(ctypes.get_errno())
    out = {}
    try:
        while ent := _libc.readdir(d):
            out[ent.contents.d_name] = (ent.contents.d_ino, ent.contents.d_type)
    finally:
        _libc.closedir(d)
    return out


def _dots(r: bytes) -> dict[str, Any]:
    j = os.path.join
    os.makedirs(j(r, b"made", b"inner"))
    out: dict[str, Any] = {}
    for rel in (b"", b"src", b"docs/deep", b"made", b"made/inner", b"empty"):
        p = j(r, rel) if rel else r
        listing = raw_listing(p)
        me, parent = os.stat(p).st_ino, os.stat(j(p, b"..")).st_ino
        out[f"{rel!r} names"] = sorted(listing)
        dot, dotdot = listing.get(b".", (0, 0)), listing.get(b"..", (0, 0))
        out[f"{rel!r} types"] = (dot[1], dotdot[1])
        out[f"{rel!r} . ino"] = dot[0] == me
        if rel:
            # Not the root's: its parent lies outside the file system (the kernel overlay
            # gives its upper directory's parent, shadowfs the root itself, as ext4's root).
            out[f"{rel!r} .. ino"] = dotdot[0] == parent
        out[f"{rel!r} listdir"] = sorted(os.listdir(p))
        out[f"{rel!r} scandir"] = sorted(e.name for e in os.scandir(p))
        ls = subprocess.run(["ls", "-a1", p], capture_output=True, check=True).stdout
        out[f"{rel!r} ls -a"] = sorted(ls.splitlines())
    found = subprocess.run(["find", ".", "-print0"], cwd=r, capture_output=True, check=True)
    out["find"] = sorted(found.stdout.split(b"\0"))
    return out


def test_listings_hold_dot_and_dot_dot(roots: dict[str, Path]) -> None:
    got = answers(roots, _dots)
    assert_agree(got)
    want = got["overlay"]
    assert want["b'src' names"][:2] == [b".", b".."] and b"." not in want["b'src' listdir"]
    assert want["b'made' . ino"] and want["b'made/inner' .. ino"]


# ---------------------------------------------------------------------- FIFOs and unix sockets


def _specials(r: bytes) -> dict[str, Any]:
    j = os.path.join
    out: dict[str, Any] = {}
    fifo, sock = j(r, b"src", b"pipe"), j(r, b"sock")
    st = os.lstat(j(r, b"base-pipe"))
    out["base fifo"] = (stat.S_ISFIFO(st.st_mode), st.st_mode & 0o7777, st.st_uid, st.st_mtime_ns)
    out["mkfifo"] = outcome(lambda: os.mkfifo(fifo, 0o640))
    out["mkfifo again"] = outcome(lambda: os.mkfifo(fifo))
    out["mkfifo over a file"] = outcome(lambda: os.mkfifo(j(r, b"README")))
    st = os.lstat(fifo)
    out["fifo stat"] = (stat.S_ISFIFO(st.st_mode), stat.S_IMODE(st.st_mode), st.st_size)
    fd = os.open(fifo, os.O_RDWR)  # Linux: a FIFO opened read-write needs no other end
    os.write(fd, b"through the pipe")
    out["fifo data"] = os.read(fd, 100)
    os.close(fd)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with server, client:
        out["bind"] = outcome(lambda: server.bind(sock))
        server.listen(1)
        out["bind again"] = outcome(
            lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).bind(sock)
        )
        client.connect(sock)
        peer, _ = server.accept()
        with peer:
            client.sendall(b"over the socket")
            out["socket data"] = peer.recv(100)
    out["socket stat"] = stat.S_ISSOCK(os.lstat(sock).st_mode)
    # Root has CAP_MKNOD: a device node is made (the shadowfs mounts are nodev: it opens
    # nothing there, which is not probed here).
    dev = j(r, b"src", b"null")
    out["mknod"] = outcome(lambda: os.mknod(dev, stat.S_IFCHR | 0o640, os.makedev(1, 3)))
    st = os.lstat(dev)
    out["device"] = (stat.S_ISCHR(st.st_mode), st.st_rdev, stat.S_IMODE(st.st_mode))
    out["mknod again"] = outcome(lambda: os.mknod(dev, stat.S_IFBLK | 0o600, os.makedev(7, 0)))
    out["mknod regular"] = outcome(lambda: os.mknod(j(r, b"plain"), stat.S_IFREG | 0o600))
    out["plain"] = stat.S_ISREG(os.lstat(j(r, b"plain")).st_mode)
    # The errors mkfifo(3) and mknod(2) name.
    out["mkfifo ENOENT"] = outcome(lambda: os.mkfifo(j(r, b"absent", b"p")))
    out["mkfifo ENOTDIR"] = outcome(lambda: os.mkfifo(j(r, b"README", b"p")))
    out["mkfifo over a symlink"] = outcome(lambda: os.mkfifo(j(r, b"link")))
    out["mkfifo over a dangling symlink"] = outcome(
        lambda: (os.symlink(b"nowhere", j(r, b"dangling")), os.mkfifo(j(r, b"dangling")))
    )
    out["mknod over a dir"] = outcome(lambda: os.mknod(j(r, b"src"), stat.S_IFIFO | 0o600))
    out["mknod ELOOP"] = outcome(
        lambda: (os.symlink(b"loop", j(r, b"loop")), os.mknod(j(r, b"loop", b"p")))
    )
    out["fifo in a fifo"] = outcome(lambda: os.mkfifo(j(fifo, b"p")))
    os.chmod(fifo, 0o4755)  # setuid and all bits: kept as given, as on ext4
    out["fifo mode"] = stat.S_IMODE(os.lstat(fifo).st_mode)
    os.chmod(fifo, 0o640)
    out["link"] = outcome(lambda: os.link(fifo, j(r, b"pipe2")))
    out["links"] = os.lstat(fifo).st_nlink
    out["rename"] = outcome(lambda: os.rename(j(r, b"pipe2"), j(r, b"docs", b"pipe3")))
    out["rmdir"] = outcome(lambda: os.rmdir(j(r, b"src")))
    out["listdir"] = sorted(os.listdir(r)), sorted(os.listdir(j(r, b"src")))
    out["find -type p,s"] = sorted(
        subprocess.run(["find", ".", "-type", "p", "-o", "-type", "s"], cwd=r,
                       capture_output=True, check=True).stdout.split()
    )
    removed = (fifo, sock, j(r, b"docs", b"pipe3"), dev)
    out["unlink"] = [outcome(lambda p=p: os.unlink(p)) for p in removed]
    out["gone"] = [os.path.lexists(p) for p in (fifo, sock)]
    return out


def test_fifos_and_unix_sockets_work_in_the_tree(roots: dict[str, Path]) -> None:
    got = answers({n: r for n, r in roots.items() if n != "native"}, _specials)
    assert_agree(got)
    want = got["overlay"]
    assert want["fifo data"] == b"through the pipe" and want["socket data"] == b"over the socket"
    assert want["mkfifo again"] == "EEXIST" and want["links"] == 2
    assert want["mknod"] is None and want["device"] == (True, os.makedev(1, 3), 0o640)
    assert want["base fifo"][:3] == (True, 0o620, 65534)
    assert (want["mkfifo ENOTDIR"], want["mknod ELOOP"]) == ("ENOTDIR", "ELOOP")
    assert want["mkfifo over a dangling symlink"] == "EEXIST" and want["fifo mode"] == 0o4755


# ---------------------------------------------------------------------- hard links


def _links(r: bytes) -> dict[str, Any]:
    j = os.path.join
    out: dict[str, Any] = {}
    readme, hard = j(r, b"README"), j(r, b"hard")

    def same(*paths: bytes) -> Any:
        """Whether all paths are one inode, and its link count as each name reports it."""
        sts = [os.lstat(p) for p in paths]
        return len({st.st_ino for st in sts}) == 1, [st.st_nlink for st in sts]

    out["link"] = outcome(lambda: os.link(readme, hard))
    out["same"] = same(readme, hard)
    with open(hard, "ab") as f:
        f.write(b"through hard\n")
    out["shared content"] = Path(os.fsdecode(readme)).read_bytes()
    os.chmod(readme, 0o600)
    out["shared mode"] = stat.S_IMODE(os.lstat(hard).st_mode)
    out["third"] = outcome(lambda: os.link(hard, j(r, b"src", b"hard2")))
    out["same 3"] = same(readme, hard, j(r, b"src", b"hard2"))
    # rename(2) between two names of one inode does nothing (POSIX).
    out["rename onto itself"] = outcome(lambda: os.rename(hard, readme))
    out["both stay"] = os.path.lexists(hard), os.path.lexists(readme)
    out["rename"] = outcome(lambda: os.rename(j(r, b"src", b"hard2"), j(r, b"docs", b"hard3")))
    out["same after rename"] = same(readme, hard, j(r, b"docs", b"hard3"))
    out["unlink"] = outcome(lambda: os.unlink(readme))
    out["same after unlink"] = same(hard, j(r, b"docs", b"hard3"))
    out["survivor"] = Path(os.fsdecode(hard)).read_bytes()
    # A file made in the layer, linked before and after it is written.
    new = j(r, b"new.txt")
    with open(new, "wb") as f:
        f.write(b"one")
        out["link open file"] = outcome(lambda: os.link(new, j(r, b"docs", b"new-link")))
        f.write(b" two")
    out["new same"] = same(new, j(r, b"docs", b"new-link"))
    out["new content"] = Path(os.fsdecode(j(r, b"docs", b"new-link"))).read_bytes()
    # A symlink's own inode (linkat without AT_SYMLINK_FOLLOW).
    out["link symlink"] = outcome(
        lambda: os.link(j(r, b"link"), j(r, b"link2"), follow_symlinks=False)
    )
    out["symlink same"] = same(j(r, b"link"), j(r, b"link2"))
    # Truncate and times through one name show through the other.
    os.truncate(j(r, b"docs", b"hard3"), 3)
    os.utime(hard, ns=(1_000_000_000, 2_000_000_000))
    st = os.lstat(j(r, b"docs", b"hard3"))
    out["truncate and times"] = st.st_size, st.st_mtime_ns, Path(os.fsdecode(hard)).read_bytes()
    # A directory holding a name moves with it; another file renamed over a name drops it.
    os.mkdir(j(r, b"holder"))
    os.link(hard, j(r, b"holder", b"inner"))
    os.rename(j(r, b"holder"), j(r, b"moved"))
    out["moved dir"] = same(hard, j(r, b"moved", b"inner"))
    with open(j(r, b"other"), "wb") as f:
        f.write(b"other")
    os.rename(j(r, b"other"), j(r, b"moved", b"inner"))
    out["renamed over"] = same(hard, j(r, b"docs", b"hard3")), os.lstat(
        j(r, b"moved", b"inner")
    ).st_nlink
    # Every name gone while a descriptor is open: the file lives on through it, with no link.
    fd = os.open(j(r, b"new.txt"), os.O_RDWR)
    for p in (j(r, b"new.txt"), j(r, b"docs", b"new-link")):
        os.unlink(p)
    os.pwrite(fd, b"ONE", 0)
    out["unlinked open file"] = os.fstat(fd).st_nlink, os.pread(fd, 10, 0)
    os.close(fd)
    # The errors link(2) names.
    out["EEXIST"] = outcome(lambda: os.link(hard, j(r, b"run.sh")))
    out["EPERM dir"] = outcome(lambda: os.link(j(r, b"src"), j(r, b"src2")))
    out["ENOENT source"] = outcome(lambda: os.link(j(r, b"absent"), j(r, b"x")))
    out["ENOENT dir"] = outcome(lambda: os.link(hard, j(r, b"absent", b"x")))
    out["ENOTDIR"] = outcome(lambda: os.link(hard, j(r, b"run.sh", b"x")))
    out["ENOTDIR source"] = outcome(lambda: os.link(j(r, b"run.sh", b"x"), j(r, b"x")))
    out["unlink last names"] = [
        outcome(lambda p=p: os.unlink(p)) for p in (hard, j(r, b"docs", b"hard3"))
    ]
    out["gone"] = os.path.lexists(hard)
    return out


def test_hard_links_are_one_inode_under_every_name(roots: dict[str, Path]) -> None:
    got = answers(roots, _links)
    assert_agree(got)
    assert got["overlay"] == got["native"]
    want = got["overlay"]
    assert want["same 3"] == (True, [3, 3, 3]) and want["same after unlink"] == (True, [2, 2])
    assert want["shared content"] == b"readme\nthrough hard\n" and want["shared mode"] == 0o600
    assert want["rename onto itself"] is None and want["both stay"] == (True, True)
    assert want["EPERM dir"] == "EPERM" and want["ENOTDIR"] == "ENOTDIR"
    assert want["truncate and times"] == (3, 2_000_000_000, b"rea")
    assert want["moved dir"] == (True, [3, 3]) and want["renamed over"] == ((True, [2, 2]), 1)
    assert want["unlinked open file"] == (0, b"ONE two")


def _base_links(r: bytes) -> dict[str, Any]:
    j = os.path.join
    util, other = j(r, b"src", b"util.py"), j(r, b"docs", b"util-link.py")
    out: dict[str, Any] = {}
    st1, st2 = os.lstat(util), os.lstat(other)
    out["before"] = st1.st_ino == st2.st_ino, st1.st_nlink, st2.st_nlink
    with open(other, "ab") as f:
        f.write(b"# appended through the other name\n")
    out["content"] = Path(os.fsdecode(util)).read_bytes()
    st1, st2 = os.lstat(util), os.lstat(other)
    out["after"] = st1.st_ino == st2.st_ino, st1.st_nlink, st2.st_nlink
    return out


def test_hard_links_of_the_base_stay_one_file_on_the_fuse_layer(roots: dict[str, Path]) -> None:
    got = answers(roots, _base_links)
    # The kernel overlay (index=off, as the overlay backend mounts it) copies one name up
    # alone: the base's link is split in the live view, in both overlays alike. The FUSE layer
    # keeps the inode whole, as the base's own file system does.
    assert got["shadowfs-overlay"] == got["overlay"]
    assert got["overlay"]["content"] == b"def f():\n    return 1\n"
    assert got["shadowfs-fuse"] == got["native"]
    assert got["native"]["before"] == got["native"]["after"] == (True, 2, 2)
    assert got["native"]["content"].endswith(b"the other name\n")


# ---------------------------------------------------------------------- what a commit makes


def _commit_ops(r: bytes) -> None:
    j = os.path.join
    os.mkfifo(j(r, b"src", b"pipe"), 0o640)
    os.mknod(j(r, b"null"), stat.S_IFCHR | 0o640, os.makedev(1, 3))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(j(r, b"sock"))  # the socket's inode outlives its server
    os.unlink(j(r, b"run.sh"))
    os.mkfifo(j(r, b"run.sh"), 0o600)  # a file becomes a fifo
    os.link(j(r, b"README"), j(r, b"docs", b"readme-link"))  # a base file gets a name
    with open(j(r, b"new"), "wb") as f:
        f.write(b"new file\n")
    os.link(j(r, b"new"), j(r, b"src", b"new-link"))
    os.link(j(r, b"new"), j(r, b"third"))
    os.unlink(j(r, b"third"))
    os.unlink(j(r, b"docs", b"util-link.py"))  # a base group loses a name
    os.link(j(r, b"src", b"pipe"), j(r, b"docs", b"pipe-link"))  # a fifo with two names


def describe(root: Path) -> dict[bytes, Any]:
    """Everything a commit must get right, by path: kind and mode, a file's bytes, a symlink's
    target, a device's number, and the other names of its inode (hard links)."""
    out: dict[bytes, Any] = {}
    by_ino: dict[int, list[bytes]] = {}
    r = os.fsencode(root)
    for dirpath, dirnames, filenames in os.walk(r):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, r)
            st = os.lstat(path)
            fmt = stat.S_IFMT(st.st_mode)
            what: Any = None
            if fmt != stat.S_IFDIR and fmt != stat.S_IFLNK:
                by_ino.setdefault(st.st_ino, []).append(rel)
            if fmt == stat.S_IFREG:
                what = hashlib.sha256(Path(os.fsdecode(path)).read_bytes()).hexdigest()[:16]
            elif fmt == stat.S_IFLNK:
                what = os.readlink(path)
            elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
                what = st.st_rdev
            out[rel] = [fmt, stat.S_IMODE(st.st_mode), what]
    for names in by_ino.values():
        for name in names:
            out[name].append(sorted(names))
    return out


@pytest.fixture
def committed(tmp_path: Path) -> dict[str, dict[bytes, Any]]:
    """name -> `describe` of: the kernel overlay's view after `_commit_ops`, and each shadowfs
    backend's real tree after the same operations were committed to it."""
    from shadowfs.commit import apply

    out: dict[str, dict[bytes, Any]] = {}
    bases = {}
    populate_linked(tmp_path / "original")
    for name in ("overlay", "shadowfs-overlay", "shadowfs-fuse"):
        bases[name] = tmp_path / name / "base"
        (tmp_path / name / "mnt").mkdir(parents=True)
        # cp -a keeps the hard link (and big.bin's random bytes) in every copy.
        subprocess.run(["cp", "-a", tmp_path / "original", bases[name]], check=True)
    kernel = tmp_path / "overlay"
    (kernel / "upper").mkdir()
    (kernel / "work").mkdir()
    mnt = kernel / "mnt"
    opts = f"lowerdir={bases['overlay']},upperdir={kernel}/upper,workdir={kernel}/work"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, mnt], check=True)
    try:
        _commit_ops(os.fsencode(mnt))
        out["overlay"] = describe(mnt)
    finally:
        subprocess.run(["umount", mnt], check=True)
    with Store.open(tmp_path / "store") as store:
        sov = OverlayLayer(bases["shadowfs-overlay"], store, tmp_path / "booth")
        try:
            sov.mount(tmp_path / "shadowfs-overlay" / "mnt")
            _commit_ops(os.fsencode(tmp_path / "shadowfs-overlay" / "mnt"))
            sov.commit(tmp_path / "journal-o")
        finally:
            sov.discard()
        with Layer(bases["shadowfs-fuse"], store, tmp_path / "scratch") as layer:
            with Mount(layer, tmp_path / "shadowfs-fuse" / "mnt", process=True):
                _commit_ops(os.fsencode(tmp_path / "shadowfs-fuse" / "mnt"))
                tree, _ = layer.snapshot()
            apply(store, bases["shadowfs-fuse"], layer.base_tree, tree,
                  journal_dir=tmp_path / "journal-f")
    out["shadowfs-overlay"] = describe(bases["shadowfs-overlay"])
    out["shadowfs-fuse"] = describe(bases["shadowfs-fuse"])
    return out


def test_a_commit_makes_what_the_kernel_overlay_shows(
    committed: dict[str, dict[bytes, Any]],
) -> None:
    want = committed["overlay"]
    for name in SHADOWFS:
        got = committed[name]
        wrong = {p: (want.get(p), got.get(p)) for p in want.keys() | got.keys()
                 if want.get(p) != got.get(p)}
        assert not wrong, f"{name} differs from the kernel overlay (path: (overlay, it)): {wrong}"
    assert want[b"src/pipe"][:2] == [stat.S_IFIFO, 0o640]
    assert want[b"src/pipe"][3] == [b"docs/pipe-link", b"src/pipe"]
    assert want[b"run.sh"][:2] == [stat.S_IFIFO, 0o600]
    assert want[b"sock"][0] == stat.S_IFSOCK
    assert want[b"null"][:3] == [stat.S_IFCHR, 0o640, os.makedev(1, 3)]
    assert want[b"new"][3] == [b"new", b"src/new-link"]
    assert want[b"new"][2] == hashlib.sha256(b"new file\n").hexdigest()[:16]
    assert want[b"README"][3] == [b"README", b"docs/readme-link"]
    assert want[b"src/util.py"][3] == [b"src/util.py"]


def _base_link_ops(r: bytes) -> None:
    j = os.path.join
    with open(j(r, b"docs", b"util-link.py"), "ab") as f:
        f.write(b"# through the other name\n")
    os.chmod(j(r, b"src", b"util.py"), 0o600)
    os.link(j(r, b"src", b"util.py"), j(r, b"third"))


def test_a_commit_through_the_fuse_layer_keeps_base_links_whole(tmp_path: Path) -> None:
    # The kernel overlay parts a base file's names at copy-up (index=off); the FUSE layer keeps
    # them one file, and its commit must leave the tree as ext4 itself would.
    from shadowfs.commit import apply

    populate_linked(tmp_path / "original")
    native, base = tmp_path / "native", tmp_path / "base"
    for copy in (native, base):
        subprocess.run(["cp", "-a", tmp_path / "original", copy], check=True)
    _base_link_ops(os.fsencode(native))
    (tmp_path / "mnt").mkdir()
    with Store.open(tmp_path / "store") as store, Layer(base, store, tmp_path / "scratch") as layer:
        with Mount(layer, tmp_path / "mnt", process=True):
            _base_link_ops(os.fsencode(tmp_path / "mnt"))
            tree, _ = layer.snapshot()
        apply(store, base, layer.base_tree, tree, journal_dir=tmp_path / "journal")
    got, want = describe(base), describe(native)
    assert got == want
    assert want[b"third"][1:2] == [0o600]
    assert want[b"third"][3] == [b"docs/util-link.py", b"src/util.py", b"third"]
