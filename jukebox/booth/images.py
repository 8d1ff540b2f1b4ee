"""Sandbox images: what of the host a booth shows its agent, its network, limits and verifier.

An image is a TOML file; `--image NAME` picks `jukebox/booth/sandbox_images/NAME.toml` (package
data),
`--image PATH` any file. The keys (see jukebox/booth/sandbox_images/host.toml):

    name, description, net ("host" | "none"), verify (a default verifier command)
    [fs]      readonly_host, private_tmp, only (top-level dirs kept; the rest hidden), hide
    [env]     allow (glob patterns of names passed to the agent), secret (patterns of names whose
              values are secret: passed only if allowed, marked on the tape), set (fixed values)
    [limits]  cpu_seconds, memory (bytes, or "512M", "8G"), open_files, processes,
              file_size (the largest file the agent may write: bytes or "2G"; RLIMIT_FSIZE),
              scratch (the most the booth's layer may stage, all files together; --fs fuse),
              tmp, shm (the sizes of the private /tmp and /dev/shm, which live in memory:
              bytes or "1G"; default a quarter of RAM for /tmp, the smaller of that and 1 GiB
              for /dev/shm; a scratch limit, from the image or --max-scratch, bounds both)
    [seccomp] enabled (default true), allow (groups of refused system calls to let through:
              see jukebox.booth.syscall_filter.GROUPS)
    [cgroup]  enabled (default true: `processes` and `memory` are also enforced by a cgroup,
              which binds root too)

Validation is strict: an unknown key or a wrong type is an error naming the file, the key and
the valid values, since a typo in a sandbox spec silently weakens the sandbox.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path

from jukebox.booth.syscall_filter import GROUPS, check_groups
from jukebox.errors import UsageError
from jukebox.redact import SECRET_ENV_PATTERNS
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

# Package data, so that a wheel install has them too.
IMAGES_DIR = Path(__file__).resolve().parent / "sandbox_images"
# The built-in images parsed, each beside the exact text it was parsed from (`write_parsed`):
# package data too, as trusted as the TOML files and this code. tomllib costs a booth's start
# about 3.4 ms to import, and the image is read at every start; a copy is used only for a file
# whose text is, character for character, the text it holds, so an edited image is parsed.
PARSED_NAME = "parsed.json"
DEFAULT_IMAGE = "host"
NET_MODES = ("host", "none")
SECRET_PATTERNS = SECRET_ENV_PATTERNS
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# The private /tmp and /dev/shm are tmpfs, held in memory (or swap): unsized, each could take
# half of RAM. By default /tmp gets a quarter of RAM, /dev/shm the smaller of that and 1 GiB
# (shared memory segments and semaphores; Docker's 64 MiB is known to break browsers).
TMP_RAM_FRACTION = 4
SHM_DEFAULT_MAX = 1 << 30


class ImageError(UsageError):
    pass


class Image(Value):
    # Every field; `source` is not part of the value (compared and shown without it).
    __slots__ = INIT = (
        "name", "path", "description", "net", "verify", "readonly_host", "private_tmp", "only",
        "hide", "env_allow", "env_secret", "env_set", "limits", "scratch_limit", "source",
        "seccomp", "seccomp_allow", "cgroup", "tmp_size", "shm_size",
    )  # fmt: skip
    FIELDS = tuple(n for n in INIT if n != "source")
    name: str
    path: Path
    description: str
    net: str
    verify: str | None
    readonly_host: bool
    private_tmp: bool
    only: tuple[str, ...]
    hide: tuple[str, ...]
    env_allow: tuple[str, ...]
    env_secret: tuple[str, ...]
    env_set: Mapping[str, str]
    limits: Mapping[str, int]  # resource limits (rlimits)
    scratch_limit: int | None  # bytes the booth's layer may stage in all
    # The parsed TOML as written: what a tape records of the image (jukebox.booth.recorded_image).
    source: Mapping[str, Any]
    seccomp: bool
    seccomp_allow: tuple[str, ...]  # groups of jukebox.booth.syscall_filter let through
    cgroup: bool
    tmp_size: int | None  # the private /tmp's size in bytes (None: the default)
    shm_size: int | None  # the private /dev/shm's size in bytes (None: the default)

    def __init__(
        self,
        name: str,
        path: Path,
        description: str = "",
        net: str = "host",
        verify: str | None = None,
        readonly_host: bool = True,
        private_tmp: bool = True,
        only: tuple[str, ...] = (),
        hide: tuple[str, ...] = (),
        env_allow: tuple[str, ...] = ("*",),
        env_secret: tuple[str, ...] = SECRET_PATTERNS,
        env_set: Mapping[str, str] | None = None,
        limits: Mapping[str, int] | None = None,
        scratch_limit: int | None = None,
        source: Mapping[str, Any] | None = None,
        seccomp: bool = True,
        seccomp_allow: tuple[str, ...] = (),
        cgroup: bool = True,
        tmp_size: int | None = None,
        shm_size: int | None = None,
    ) -> None:
        setfield(self, "name", name)
        setfield(self, "path", path)
        setfield(self, "description", description)
        setfield(self, "net", net)
        setfield(self, "verify", verify)
        setfield(self, "readonly_host", readonly_host)
        setfield(self, "private_tmp", private_tmp)
        setfield(self, "only", only)
        setfield(self, "hide", hide)
        setfield(self, "env_allow", env_allow)
        setfield(self, "env_secret", env_secret)
        setfield(self, "env_set", {} if env_set is None else env_set)
        setfield(self, "limits", {} if limits is None else limits)
        setfield(self, "scratch_limit", scratch_limit)
        setfield(self, "source", {} if source is None else source)
        setfield(self, "seccomp", seccomp)
        setfield(self, "seccomp_allow", seccomp_allow)
        setfield(self, "cgroup", cgroup)
        setfield(self, "tmp_size", tmp_size)
        setfield(self, "shm_size", shm_size)

    def is_secret(self, name: str) -> bool:
        return _matches(name, self.env_secret)

    def filter_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The agent's environment: allowed names from `environ`, then the image's fixed values."""
        env = {k: v for k, v in environ.items() if _matches(k, self.env_allow)}
        env.update(self.env_set)
        return env

    def describe_env(self, env: Mapping[str, str]) -> dict[str, list[str]]:
        """What a tape may say about an environment: names only, secret-looking ones apart."""
        names = sorted(env)
        return {
            "names": [n for n in names if not self.is_secret(n)],
            "secret_names": [n for n in names if self.is_secret(n)],
        }

    def hidden_paths(self, root: str = "/") -> list[str]:
        """Paths to cover: the explicit list plus every top-level directory `only` leaves out."""
        hidden = list(self.hide)
        if self.only:
            keep = {os.path.normpath(p) for p in self.only}
            with os.scandir(root) as entries:
                for entry in entries:
                    path = os.path.join(root, entry.name)
                    # A top-level symlink (merged /usr: /bin -> usr/bin) resolves inside what is
                    # kept or hidden anyway; covering it would cover its target.
                    if path not in keep and entry.is_dir(follow_symlinks=False):
                        hidden.append(path)
        return hidden

    def tmpfs_sizes(self, bound: int | None = None) -> dict[str, int]:
        """The sizes of the private /tmp and /dev/shm: the image's, else the defaults, each at
        most `bound` (the booth's scratch limit: what the agent may stage in memory counts)."""
        quarter = physical_memory() // TMP_RAM_FRACTION
        sizes = {
            "tmp": self.tmp_size or quarter,
            "shm": self.shm_size or min(quarter, SHM_DEFAULT_MAX),
        }
        if bound is not None:
            sizes = {key: min(size, bound) for key, size in sizes.items()}
        return sizes

    def policy(self) -> dict[str, Any]:
        """The image as recorded on the tape's run_start frame."""
        return {
            "image": self.name,
            "image_path": str(self.path),
            "net": self.net,
            "readonly_host": self.readonly_host,
            "private_tmp": self.private_tmp,
            "only": list(self.only),
            "hide": list(self.hide),
            "env_allow": list(self.env_allow),
            "limits": dict(self.limits),
            "scratch_limit": self.scratch_limit,
            "tmp_size": self.tmp_size,
            "shm_size": self.shm_size,
            "verify": self.verify,
            "seccomp": {"enabled": self.seccomp, "allow": list(self.seccomp_allow)},
            "cgroup": {"enabled": self.cgroup},
        }


def physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return _matched(name, tuple(patterns))


# A booth's start asks about each variable of the environment about eight times (the agent's
# environment, the secrets the tape, the proxies and the MCP gate scrub, the names it records):
# some 1,400 fnmatch calls, about 1.5 ms, for answers that do not change.
@functools.lru_cache(maxsize=4096)
def _matched(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def image_path(name_or_path: str) -> Path:
    if name_or_path.endswith(".toml") or os.sep in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise ImageError(f"no sandbox image file at {name_or_path}: check the path")
        return path
    path = IMAGES_DIR / f"{name_or_path}.toml"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name_or_path) or not path.is_file():
        raise ImageError(
            f"unknown sandbox image {name_or_path!r}: use one of {', '.join(available())} "
            "or a path to a .toml file"
        )
    return path


def available() -> list[str]:
    return sorted(p.stem for p in IMAGES_DIR.glob("*.toml"))


def load_image(name_or_path: str | None = None) -> Image:
    path = image_path(name_or_path or DEFAULT_IMAGE)
    text = path.read_text()
    data = parsed_copy(IMAGES_DIR / PARSED_NAME, path.name, text) if _built_in(path) else None
    if data is None:
        data = parse_toml(path, text)
    return parse_image(data, path)


def _built_in(path: Path) -> bool:
    return path.parent == IMAGES_DIR and path.suffix == ".toml"


def parse_toml(path: Path, text: str) -> dict[str, Any]:
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ImageError(f"sandbox image {path} is not valid TOML: {error}") from None


def parsed_copy(copies: Path, name: str, text: str) -> dict[str, Any] | None:
    """The parsed image `name` from the file `copies`, when it was parsed from exactly `text`;
    None when there is no copy of it, or one of other text (the image was edited since: it is
    parsed again), or the file cannot be read as one."""
    import json

    try:
        with open(copies, encoding="utf-8") as f:
            entry = json.load(f).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(entry, dict) or entry.get("text") != text:
        return None
    data = entry.get("data")
    return data if isinstance(data, dict) else None


def write_parsed(images_dir: Path = IMAGES_DIR) -> str:
    """The content of `PARSED_NAME` for the TOML images in `images_dir`: each image's text and
    what tomllib makes of it. Its values are what TOML and JSON share (strings, integers,
    booleans, lists and tables; an image holds nothing else), so they come back the same.
    `python -m jukebox.booth.images` rewrites the shipped one; a test checks it is current."""
    import json

    copies = {}
    for path in sorted(images_dir.glob("*.toml")):
        text = path.read_text()
        copies[path.name] = {"text": text, "data": parse_toml(path, text)}
    return json.dumps(copies, indent=1, ensure_ascii=False) + "\n"


class _Reader:
    """Takes keys out of one table, checking types, and complains about what is left over."""

    def __init__(self, path: Path, table: Mapping[str, Any], prefix: str = "") -> None:
        self.path, self.table, self.prefix = path, dict(table), prefix

    def fail(self, key: str, wanted: str) -> ImageError:
        return ImageError(f"sandbox image {self.path}: key '{self.prefix}{key}' {wanted}")

    def take(self, key: str, kind: type | tuple[type, ...], default: Any, wanted: str) -> Any:
        if key not in self.table:
            return default
        value = self.table.pop(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(key, f"is {value!r}: {wanted}")
        return value

    def strings(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.take(key, list, None, "must be a list of strings")
        if value is None:
            return default
        if not all(isinstance(v, str) and v for v in value):
            raise self.fail(key, f"is {value!r}: must be a list of non-empty strings")
        return tuple(value)

    def table_(self, key: str) -> _Reader:
        value = self.take(key, dict, {}, "must be a table")
        return _Reader(self.path, value, f"{self.prefix}{key}.")

    def done(self, valid: tuple[str, ...]) -> None:
        if self.table:
            key = sorted(self.table)[0]
            raise self.fail(key, f"is unknown: valid keys here are {', '.join(valid)}")


def parse_size(value: int | str) -> int:
    if isinstance(value, int):
        return value
    match = _SIZE.match(value)
    if not match:
        raise ValueError(value)
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_image(data: Mapping[str, Any], path: Path) -> Image:
    top = _Reader(path, data)
    name = top.take("name", str, path.stem, "must be a string")
    description = top.take("description", str, "", "must be a string")
    net = top.take("net", str, "host", "must be a string")
    if net not in NET_MODES:
        raise top.fail("net", f"is {net!r}: valid values are {', '.join(map(repr, NET_MODES))}")
    verify = top.take("verify", str, None, "must be a command line (a string)") or None

    fs = top.table_("fs")
    readonly_host = fs.take("readonly_host", bool, True, "must be true or false")
    private_tmp = fs.take("private_tmp", bool, True, "must be true or false")
    only = fs.strings("only", ())
    hide = fs.strings("hide", ())
    for key, paths in (("only", only), ("hide", hide)):
        for p in paths:
            if not p.startswith("/"):
                raise fs.fail(key, f"holds {p!r}: paths must be absolute")
    fs.done(("readonly_host", "private_tmp", "only", "hide"))

    env = top.table_("env")
    allow = env.strings("allow", ("*",))
    secret = env.strings("secret", SECRET_PATTERNS)
    env_set = env.take("set", dict, {}, 'must be a table of NAME = "value"')
    if not all(isinstance(v, str) for v in env_set.values()):
        raise env.fail("set", "must map names to string values")
    env.done(("allow", "secret", "set"))

    lim = top.table_("limits")
    limits: dict[str, int] = {}
    for key in ("cpu_seconds", "open_files", "processes"):
        value = lim.take(key, int, None, "must be a positive integer")
        if value is not None:
            if value <= 0:
                raise lim.fail(key, f"is {value}: must be a positive integer")
            limits[key] = value
    sizes: dict[str, int] = {}
    for key in ("memory", "file_size", "scratch", "tmp", "shm"):
        size = lim.take(key, (int, str), None, 'must be a size in bytes or like "512M", "8G"')
        if size is None:
            continue
        try:
            sizes[key] = parse_size(size)
        except ValueError:
            raise lim.fail(key, f'is {size!r}: use bytes or a size like "512M", "8G"') from None
        if sizes[key] <= 0:
            raise lim.fail(key, f"is {size!r}: must be a positive size")
    for key, rlimit in (("memory", "memory_bytes"), ("file_size", "file_size_bytes")):
        if key in sizes:
            limits[rlimit] = sizes[key]
    lim.done(
        ("cpu_seconds", "memory", "open_files", "processes", "file_size", "scratch", "tmp", "shm")
    )

    sec = top.table_("seccomp")
    seccomp = sec.take("enabled", bool, True, "must be true or false")
    seccomp_allow = sec.strings("allow", ())
    unknown = check_groups(seccomp_allow)
    if unknown:
        raise sec.fail("allow", f"holds {unknown[0]!r}: valid groups are {', '.join(GROUPS)}")
    sec.done(("enabled", "allow"))
    cg = top.table_("cgroup")
    cgroup = cg.take("enabled", bool, True, "must be true or false")
    cg.done(("enabled",))
    top.done(
        ("name", "description", "net", "verify", "fs", "env", "limits", "seccomp", "cgroup")
    )

    return Image(
        name=name,
        path=path,
        description=description,
        net=net,
        verify=verify,
        readonly_host=readonly_host,
        private_tmp=private_tmp,
        only=only,
        hide=hide,
        env_allow=allow,
        env_secret=secret,
        env_set=dict(env_set),
        limits=limits,
        scratch_limit=sizes.get("scratch"),
        source=data,
        seccomp=seccomp,
        seccomp_allow=seccomp_allow,
        cgroup=cgroup,
        tmp_size=sizes.get("tmp"),
        shm_size=sizes.get("shm"),
    )


if __name__ == "__main__":
    (IMAGES_DIR / PARSED_NAME).write_text(write_parsed(), encoding="utf-8")
