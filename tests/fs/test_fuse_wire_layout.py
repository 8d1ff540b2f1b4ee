"""shadowfs.fuse_wire's message layouts and numbers against the kernel's own <linux/fuse.h>.

fuse_wire writes the protocol's structs as `struct` formats by hand; a field in the wrong place
would corrupt every reply of its kind. A small C program compiled here prints the header's
offsetof/sizeof for each field fuse_wire packs or reads, and its opcode and flag values.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from shadowfs import fuse_wire as w

HEADER = Path("/usr/include/linux/fuse.h")

# C struct -> (fuse_wire's layout, its fields in order (None: not compared, e.g. padding whose
# name changed between kernel versions), whether the layout is the whole struct or a prefix).
ATTR_FIELDS: list[str | None] = [
    "ino", "size", "blocks", "atime", "mtime", "ctime", "atimensec", "mtimensec", "ctimensec",
    "mode", "nlink", "uid", "gid", "rdev", "blksize", "flags",
]  # fmt: skip
LAYOUTS: dict[str, tuple[struct.Struct, list[str | None], bool]] = {
    "fuse_in_header": (
        w.IN_HEADER,
        ["len", "opcode", "unique", "nodeid", "uid", "gid", "pid", None, None],
        True,
    ),
    "fuse_out_header": (w.OUT_HEADER, ["len", "error", "unique"], True),
    "fuse_attr": (w.ATTR, ATTR_FIELDS, True),
    "fuse_entry_out": (
        w.ENTRY_ATTR,
        ["nodeid", "generation", "entry_valid", "attr_valid", "entry_valid_nsec",
         "attr_valid_nsec", "attr", *[None] * 15],
        True,
    ),
    "fuse_attr_out": (
        w.ATTR_OUT_ATTR, ["attr_valid", "attr_valid_nsec", "dummy", "attr", *[None] * 15], True
    ),
    "fuse_dirent": (w.DIRENT_HEAD, ["ino", "off", "namelen", "type"], False),
    "fuse_init_in": (w.INIT_IN, ["major", "minor", "max_readahead", "flags", "flags2"], False),
    "fuse_init_out": (
        w.INIT_OUT,
        ["major", "minor", "max_readahead", "flags", "max_background", "congestion_threshold",
         "max_write", "time_gran", "max_pages", "map_alignment", "flags2"],
        True,
    ),
    "fuse_setattr_in": (
        w.SETATTR_IN,
        ["valid", "padding", "fh", "size", "lock_owner", "atime", "mtime", "ctime", "atimensec",
         "mtimensec", "ctimensec", "mode", "unused4", "uid", "gid", "unused5"],
        True,
    ),
    "fuse_read_in": (w.READ_IN, ["fh", "offset", "size", "read_flags"], False),
    "fuse_mknod_in": (w.MKNOD_IN, ["mode", "rdev", "umask", "padding"], True),
    "fuse_mkdir_in": (w.MKDIR_IN, ["mode", "umask"], True),
    "fuse_rename2_in": (w.RENAME2_IN, ["newdir", "flags", "padding"], True),
    "fuse_getxattr_in": (w.XATTR_IN, ["size", "padding"], True),
    "fuse_setxattr_in": (w.XATTR_IN, ["size", "flags"], False),
    "fuse_getxattr_out": (w.XATTR_OUT, ["size", "padding"], True),
    "fuse_write_out": (w.WRITE_OUT, ["size", "padding"], True),
    "fuse_batch_forget_in": (w.BATCH_FORGET_IN, ["count", "dummy"], True),
    "fuse_forget_one": (w.FORGET_ONE, ["nodeid", "nlookup"], True),
    "fuse_kstatfs": (
        w.STATFS_OUT,
        ["blocks", "bfree", "bavail", "files", "ffree", "bsize", "namelen", "frsize", "padding"],
        True,
    ),
    "fuse_notify_inval_inode_out": (w.INVAL_INODE, ["ino", "off", "len"], True),
    "fuse_notify_inval_entry_out": (w.INVAL_ENTRY, ["parent", "namelen", None], True),
}
OPCODES = [
    "LOOKUP", "FORGET", "GETATTR", "SETATTR", "READLINK", "SYMLINK", "MKNOD", "MKDIR", "UNLINK",
    "RMDIR", "RENAME", "LINK", "OPEN", "READ", "WRITE", "STATFS", "RELEASE", "FSYNC", "SETXATTR",
    "GETXATTR", "LISTXATTR", "REMOVEXATTR", "FLUSH", "INIT", "OPENDIR", "READDIR", "RELEASEDIR",
    "FSYNCDIR", "ACCESS", "CREATE", "INTERRUPT", "DESTROY", "BATCH_FORGET", "READDIRPLUS",
    "RENAME2", "SYNCFS", "NOTIFY_INVAL_INODE", "NOTIFY_INVAL_ENTRY",
    # INIT flags
    "ASYNC_READ", "BIG_WRITES", "DO_READDIRPLUS", "READDIRPLUS_AUTO", "ASYNC_DIO",
    "WRITEBACK_CACHE", "PARALLEL_DIROPS", "ABORT_ERROR", "MAX_PAGES", "CACHE_SYMLINKS",
    "EXPLICIT_INVAL_DATA", "HANDLE_KILLPRIV_V2", "WRITE_KILL_SUIDGID",
]  # fmt: skip
# setattr's valid bits keep their FATTR_ names in the header.
FATTRS = [name for name in dir(w) if name.startswith("FATTR_")]

_TOKEN = re.compile(r"(\d*)([xcbB?hHiIlLqQnNefdspP])")


def _offsets(layout: struct.Struct) -> list[int]:
    """The offset of each field of a little-endian `struct` format, padding (`x`) skipped."""
    fmt = layout.format.lstrip("<")
    offsets: list[int] = []
    done = ""
    for count, code in _TOKEN.findall(fmt):
        n = int(count or 1)
        if code == "x":
            done += f"{n}x"
            continue
        for _ in range(1 if code == "s" else n):
            offsets.append(struct.calcsize("<" + done))
            done += f"{n}s" if code == "s" else code
    return offsets


def _c_program() -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <linux/fuse.h>", "",
             "int main(void) {"]  # fmt: skip
    for name, (_, fields, _whole) in LAYOUTS.items():
        lines.append(f'  printf("sizeof {name} %zu\\n", sizeof(struct {name}));')
        for field in fields:
            if field is not None:
                lines.append(
                    f'  printf("offsetof {name}.{field} %zu\\n",'
                    f" offsetof(struct {name}, {field}));"
                )
    lines.append('  printf("sizeof fuse_write_in %zu\\n", sizeof(struct fuse_write_in));')
    for name in OPCODES:
        lines.append(f'  printf("value {name} %llu\\n", (unsigned long long)FUSE_{name});')
    for name in FATTRS:
        lines.append(f'  printf("value {name} %llu\\n", (unsigned long long){name});')
    lines += ["#ifdef FUSE_EXPIRE_ONLY",
              '  printf("value EXPIRE_ONLY %llu\\n", (unsigned long long)FUSE_EXPIRE_ONLY);',
              "#endif", "  return 0;", "}", ""]  # fmt: skip
    return "\n".join(lines)


@pytest.fixture(scope="module")
def header_facts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    if not HEADER.exists() or shutil.which("gcc") is None:
        pytest.fail(f"{HEADER} and gcc are needed: `make test` installs them (APT_PACKAGES)")
    work = tmp_path_factory.mktemp("fuse-h")
    (work / "layout.c").write_text(_c_program())
    subprocess.run(
        ["gcc", "-o", str(work / "layout"), str(work / "layout.c")], check=True, timeout=60
    )
    out = subprocess.run([str(work / "layout")], check=True, capture_output=True, text=True)
    facts: dict[str, int] = {}
    for line in out.stdout.splitlines():
        what, key, value = line.split()
        facts[f"{what} {key}"] = int(value)
    return facts


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_struct_layout_matches_the_header(name: str, header_facts: dict[str, int]) -> None:
    layout, fields, whole = LAYOUTS[name]
    offsets = _offsets(layout)
    assert len(offsets) == len(fields), f"{name}: the field list does not match the format"
    for field, offset in zip(fields, offsets, strict=True):
        if field is not None:
            assert header_facts[f"offsetof {name}.{field}"] == offset, f"{name}.{field}"
    if whole:
        assert header_facts[f"sizeof {name}"] == layout.size, f"sizeof {name}"
    else:
        assert header_facts[f"sizeof {name}"] >= layout.size, f"sizeof {name}"


def test_sizes_fuse_wire_names_match_the_header(header_facts: dict[str, int]) -> None:
    assert header_facts["sizeof fuse_in_header"] == w.IN_HEADER_SIZE
    assert header_facts["sizeof fuse_out_header"] == w.OUT_HEADER_SIZE
    # A WRITE's data follows its fuse_write_in, which fuse_wire skips by size alone.
    assert header_facts["sizeof fuse_write_in"] == w.WRITE_IN_SIZE


def test_opcodes_and_flags_match_the_header(header_facts: dict[str, int]) -> None:
    for name in OPCODES + FATTRS:
        assert header_facts[f"value {name}"] == getattr(w, name), name
    if "value EXPIRE_ONLY" in header_facts:  # protocol 7.38 (Linux 6.2) and later
        assert header_facts["value EXPIRE_ONLY"] == w.EXPIRE_ONLY
