"""Debian kernels for the VM tests: fetched with a private apt configuration, never installed.

Each Debian release gets its own apt state under CACHE/apt/<suite>/ (sources.list, lists,
archives), so the host's /etc/apt and its package database stay untouched: `apt-get download`
fetches the .debs and `dpkg-deb -x` unpacks them under CACHE/kernels/<suite>/. A release's
kernel is whatever its `linux-image-amd64` points at today; newer Debian splits the image into
linux-binary-*, linux-modules-* and linux-base-* packages, which are fetched with it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

MIRROR = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"

# Name on the command line -> Debian suite. The kernel each one carries moves with Debian;
# `make vm-test` prints the version it booted.
SUITES = {"bookworm": "bookworm", "trixie": "trixie", "sid": "sid"}
DEFAULT = ("bookworm", "trixie", "sid")


class KernelError(Exception):
    """A kernel could not be fetched or found; the message says what to do."""


@dataclass(frozen=True)
class Kernel:
    name: str  # what the report calls it: the suite, or the file a user named
    version: str  # `uname -r` inside the guest
    image: Path  # the vmlinuz to boot; its modules sit in the tree it was unpacked into


def _apt_options(state: Path) -> list[str]:
    """apt options that point every directory apt reads or writes into `state`."""
    return [
        "-o", f"Dir::Etc={state / 'etc'}",
        "-o", f"Dir::Etc::SourceList={state / 'etc' / 'sources.list'}",
        "-o", f"Dir::Etc::SourceParts={state / 'etc' / 'sources.list.d'}",
        "-o", f"Dir::Etc::Preferences={state / 'etc' / 'preferences'}",
        "-o", f"Dir::Etc::PreferencesParts={state / 'etc' / 'preferences.d'}",
        "-o", f"Dir::State={state / 'state'}",
        "-o", f"Dir::State::status={state / 'state' / 'status'}",
        "-o", f"Dir::Cache={state / 'cache'}",
        "-o", "Debug::NoLocking=1",
        "-o", "APT::Sandbox::User=root",
    ]


def _private_apt(cache: Path, suite: str) -> list[str]:
    state = cache / "apt" / suite
    for sub in ("etc/sources.list.d", "etc/preferences.d", "state/lists/partial",
                "cache/archives/partial"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "etc" / "sources.list").write_text(
        f"deb [signed-by={KEYRING}] {MIRROR} {suite} main\n"
    )
    (state / "state" / "status").touch()  # an empty package database: nothing is installed
    return _apt_options(state)


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise KernelError(f"{' '.join(cmd[:2])} failed: {' / '.join(tail)}")
    return proc.stdout


def _find_image(tree: Path) -> tuple[str, Path]:
    """The (version, vmlinuz) unpacked under tree: /boot/vmlinuz-V or /usr/lib/modules/V/vmlinuz."""
    for img in sorted(tree.glob("boot/vmlinuz-*")):
        return img.name.removeprefix("vmlinuz-"), img
    for img in sorted(tree.glob("usr/lib/modules/*/vmlinuz")):
        return img.parent.name, img
    raise KernelError(f"no vmlinuz under {tree}: delete it and run again")


def fetch(cache: Path, name: str, log=print) -> Kernel:
    """The kernel of Debian suite `name`, downloaded and unpacked once into cache."""
    suite = SUITES[name]
    tree = cache / "kernels" / suite
    done = tree / ".unpacked"
    if done.exists():
        version, image = _find_image(tree)
        return Kernel(name, version, image)
    apt = _private_apt(cache, suite)
    log(f"vm: fetching the {suite} kernel with a private apt configuration ({cache / 'apt'})")
    _run(["apt-get", *apt, "-qq", "update"])
    deps = _run(["apt-cache", *apt, "depends", "linux-image-amd64"])
    image_pkgs = re.findall(r"Depends: (linux-image-\d\S*)", deps)
    if not image_pkgs:
        raise KernelError(f"{suite}: linux-image-amd64 names no versioned image package")
    image_pkg = image_pkgs[0]
    abi = image_pkg.removeprefix("linux-image-")  # e.g. 6.12.117+deb13-amd64
    pkgs = [image_pkg]
    # Newer releases split the image: fetch every package of the same ABI it depends on.
    for dep in re.findall(r"Depends: (\S+)", _run(["apt-cache", *apt, "depends", image_pkg])):
        if dep.endswith(abi) and dep != image_pkg and dep not in pkgs:
            pkgs.append(dep)
    debs = cache / "debs" / suite
    shutil.rmtree(debs, ignore_errors=True)
    debs.mkdir(parents=True)
    _run(["apt-get", *apt, "-qq", "download", *pkgs], cwd=debs)
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(tree)])
    shutil.rmtree(debs, ignore_errors=True)  # the unpacked tree is all a boot needs
    version, image = _find_image(tree)
    done.write_text(" ".join(pkgs) + "\n")
    return Kernel(name, version, image)


def from_file(path: str) -> Kernel:
    """A kernel a user unpacked themselves: a vmlinuz whose modules sit in the same tree."""
    image = Path(path).resolve()
    if not image.is_file():
        raise KernelError(f"KERNEL={path}: no such file; name a suite ({', '.join(SUITES)}) "
                          "or a vmlinuz unpacked with its modules")
    m = re.search(r"vmlinuz-(.+)$", image.name)
    version = m.group(1) if m else image.parent.name
    return Kernel(image.name if m else version, version, image)


def check(names: list[str]) -> None:
    """Refuses a name that is neither a known suite nor an existing file, before any download."""
    for name in names:
        if name in SUITES:
            continue
        if os.sep not in name and not name.startswith("vmlinuz"):
            raise KernelError(f"KERNEL={name}: unknown; use one of {', '.join(SUITES)}, "
                              "or a path to a vmlinuz")
        from_file(name)


def resolve(cache: Path, names: list[str], log=print) -> list[Kernel]:
    check(names)
    return [fetch(cache, n, log) if n in SUITES else from_file(n) for n in names]
