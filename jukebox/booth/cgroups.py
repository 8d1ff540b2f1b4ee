"""A booth's own cgroup: process and memory limits that bind root too.

RLIMIT_NPROC does not bind uid 0 and RLIMIT_AS counts address space, not memory; a cgroup's
pids.max and memory limit bind every process in it, root included, and the memory one counts
what really is used (page cache and tmpfs pages such as the private /tmp included).

Where the cgroup goes: under the supervisor's own cgroup in each hierarchy, as
`<own>/jukebox/<pid>-<booth>`, so a booth never escapes limits its caller is under (a systemd
slice, a container, a CI job). cgroup v2 forbids controllers below a cgroup that holds
processes (the supervisor's own, unless it is the root): there the booth's cgroup goes to
`<v2 root>/jukebox/` instead, as container managers do. cgroup v1 (or a hybrid host) has one
hierarchy per controller: `/sys/fs/cgroup/pids/<own>/jukebox/...` and `.../memory/...`.

The relay (the first process of the sandbox shim) writes itself into the cgroup before it
forks anything, so the init and CMD and all they start are born inside. The supervisor removes
the cgroup once they are gone; one left by a killed supervisor (its pid in the name no longer
alive) is removed by the next booth.

Unprivileged users cannot create cgroups unless one was delegated to them; a booth then runs
without, and says so (see jukebox.booth.protections).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

from jukebox.booth.isolation import _is_under
from jukebox.errors import JukeboxError
from shadowfs.values import Record, Value, setfield

CONTROLLERS = ("pids", "memory")
PROTECTION_NAMES = {"pids": "pids_cgroup", "memory": "memory_cgroup"}
GROUP_DIR = "jukebox"
RMDIR_WAIT_S = 2.0  # the last processes of a booth may still be exiting when it ends


class CgroupUnavailable(JukeboxError):
    """This controller cannot be used here; the message says why."""


class Hierarchy(Value):
    __slots__ = FIELDS = ("mount", "own", "v2")
    mount: str  # where it is mounted
    own: str  # this process's cgroup in it, relative to the mount ("/" is its root)
    v2: bool

    def __init__(self, mount: str, own: str, v2: bool) -> None:
        setfield(self, "mount", mount)
        setfield(self, "own", own)
        setfield(self, "v2", v2)


class BoothCgroup(Record):
    """The cgroup directories one booth made (one per hierarchy) and what each enforces."""

    __slots__ = FIELDS = ("name", "dirs", "mounts", "states")

    def __init__(
        self, name: str, dirs: list[str] | None = None, mounts: list[str] | None = None,
        states: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.dirs: list[str] = [] if dirs is None else dirs
        # The file systems the dirs are on.
        self.mounts: list[str] = [] if mounts is None else mounts
        # protection name -> "on" | why not
        self.states: dict[str, str] = {} if states is None else states

    @property
    def procs_files(self) -> list[str]:
        """What a process writes its pid into to join the booth's cgroup in every hierarchy."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def remove(self) -> None:
        """Removes the booth's cgroups; call it once every process in them is gone."""
        for path in self.dirs:
            _remove_leaf(path)
        self.dirs = []


def mounted_hierarchies(mountinfo: str = "/proc/self/mountinfo") -> dict[str, Hierarchy]:
    """Controller name -> the hierarchy that offers it to this process."""
    own_v1: dict[str, str] = {}
    own_v2 = "/"
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            own_v2 = path
        for name in controllers.split(","):
            own_v1[name] = path
    found: dict[str, Hierarchy] = {}
    v2_mount = None
    for line in Path(mountinfo).read_text().splitlines():
        before, _, after = line.partition(" - ")
        fstype, _source, options = [*after.split(" "), "", ""][:3]
        mount_point = before.split(" ")[4].replace("\\040", " ")
        if fstype == "cgroup":
            for name in options.split(","):
                if name in CONTROLLERS and name in own_v1:
                    found.setdefault(name, Hierarchy(mount_point, own_v1[name], v2=False))
        elif fstype == "cgroup2" and v2_mount is None:
            v2_mount = mount_point
    if v2_mount is not None:
        offered = _read(os.path.join(v2_mount, "cgroup.controllers")).split()
        for name in CONTROLLERS:
            if name in offered and name not in found:
                found[name] = Hierarchy(v2_mount, own_v2, v2=True)
    return found


def create(
    booth_id: str,
    processes: int | None,
    memory: int | None,
    *,
    enabled: bool = True,
    mountinfo: str = "/proc/self/mountinfo",
) -> BoothCgroup:
    """Makes the booth's cgroup(s) with the limits asked for; what could not be made is in
    `states` with the reason (nothing raises: a booth can run without)."""
    cgroup = BoothCgroup(f"{os.getpid()}-{booth_id}")
    wanted = {name: limit for name, limit in (("pids", processes), ("memory", memory)) if limit}
    if not enabled:
        for name in wanted:
            cgroup.states[PROTECTION_NAMES[name]] = "off: the image sets cgroup.enabled = false"
        return cgroup
    try:
        hierarchies = mounted_hierarchies(mountinfo)
    except OSError as error:
        hierarchies = {}
        missing = f"cannot read this process's cgroups ({error.strerror})"
    else:
        missing = "no cgroup hierarchy here offers the {} controller"
    made: set[str] = set()
    for name, limit in wanted.items():
        protection = PROTECTION_NAMES[name]
        hierarchy = hierarchies.get(name)
        if hierarchy is None:
            cgroup.states[protection] = "unavailable: " + missing.format(name)
            continue
        # cgroup v2 is one tree: a process is in one cgroup of it, so every controller there
        # must go to the same leaf.
        same_tree = [d for d in cgroup.dirs if hierarchy.v2 and _is_under(d, hierarchy.mount)]
        try:
            leaf = _make_leaf(hierarchy, name, cgroup.name, same_tree[0] if same_tree else None)
        except CgroupUnavailable as error:
            cgroup.states[protection] = f"unavailable: {error}"
            continue
        made.add(leaf)
        try:
            _set_limit(leaf, name, limit, hierarchy.v2)
        except OSError as error:
            cgroup.states[protection] = f"unavailable: {_why(error, leaf)}"
            continue
        if leaf not in cgroup.dirs:
            cgroup.dirs.append(leaf)
        if hierarchy.mount not in cgroup.mounts:
            cgroup.mounts.append(hierarchy.mount)
        cgroup.states[protection] = "on"
    # A leaf whose limit could not be set enforces nothing: drop it again.
    for leaf in made - set(cgroup.dirs):
        _remove_leaf(leaf)
    return cgroup


def _make_leaf(hierarchy: Hierarchy, controller: str, name: str, leaf: str | None) -> str:
    candidates = [os.path.normpath(os.path.join(hierarchy.mount, hierarchy.own.lstrip("/")))]
    if hierarchy.v2 and hierarchy.own != "/":
        candidates.append(hierarchy.mount)  # the own cgroup may hold processes: see above
    if leaf is not None:
        candidates = [os.path.dirname(os.path.dirname(leaf))]
    reasons = []
    for parent in candidates:
        try:
            return _make_leaf_under(parent, controller, name, hierarchy.v2)
        except CgroupUnavailable as error:
            reasons.append(str(error))
        except OSError as error:
            reasons.append(_why(error, parent))
    raise CgroupUnavailable("; ".join(reasons))


def _make_leaf_under(parent: str, controller: str, name: str, v2: bool) -> str:
    remove_stale(parent)
    group = os.path.join(parent, GROUP_DIR)
    leaf = os.path.join(group, name)
    for _attempt in range(3):  # another booth may remove an empty `jukebox` dir meanwhile
        if v2:
            _enable(parent, controller)
        with contextlib.suppress(FileExistsError):
            os.mkdir(group, 0o755)
        try:
            if v2:
                _enable(group, controller)
            with contextlib.suppress(FileExistsError):
                os.mkdir(leaf, 0o755)
            return leaf
        except FileNotFoundError:
            continue
    raise CgroupUnavailable(f"{group} keeps disappearing")


def _enable(path: str, controller: str) -> None:
    if controller in _read(os.path.join(path, "cgroup.subtree_control")).split():
        return
    try:
        Path(path, "cgroup.subtree_control").write_text(f"+{controller}")
    except OSError as error:
        if error.errno == errno.EBUSY:
            raise CgroupUnavailable(
                f"cgroup v2 cannot enable {controller} below {path}: it holds processes"
            ) from None
        raise


def _set_limit(leaf: str, controller: str, limit: int, v2: bool) -> None:
    if controller == "pids":
        Path(leaf, "pids.max").write_text(str(limit))
    elif v2:
        Path(leaf, "memory.max").write_text(str(limit))
        # Without this the limit only moves the excess to swap.
        with contextlib.suppress(FileNotFoundError):
            Path(leaf, "memory.swap.max").write_text("0")
    else:
        Path(leaf, "memory.limit_in_bytes").write_text(str(limit))
        with contextlib.suppress(FileNotFoundError):  # absent without swap accounting
            Path(leaf, "memory.memsw.limit_in_bytes").write_text(str(limit))


def remove_stale(parent: str) -> None:
    """Removes booth cgroups under `parent` whose supervisor (the pid in the name) is dead."""
    group = os.path.join(parent, GROUP_DIR)
    try:
        names = os.listdir(group)
    except OSError:
        return
    for name in names:
        pid, _, booth = name.partition("-")
        if booth and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _remove_leaf(os.path.join(group, name), wait=0.0)


def _remove_leaf(path: str, wait: float = RMDIR_WAIT_S) -> None:
    deadline = time.monotonic() + wait
    while True:
        try:
            os.rmdir(path)
            break
        except FileNotFoundError:
            break
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() >= deadline:
                return
            time.sleep(0.01)
    # The `jukebox` directory goes too once no booth uses it: an empty child cgroup left
    # behind would keep the caller's own cgroup from being removed.
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _why(error: OSError, path: str) -> str:
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"cannot write cgroups under {path} as uid {os.getuid()} ({error.strerror}); "
            "run as root or under a delegated cgroup"
        )
    return f"{path}: {error.strerror}"
