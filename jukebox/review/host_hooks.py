"""Changes that make the host run code later, without anyone asking: flagged before a commit.

An agent that writes ``.git/hooks/pre-commit`` or sets ``core.fsmonitor`` in ``.git/config`` has
its code run by the user's next ``git status``, outside any booth. Ordinary project files
(a Makefile, package.json scripts, tests) are content: they run when someone asks for them, and
the review shows them like any change. Flagged are only files whose purpose is to run on the host
implicitly (the list is documented in docs/reliability.md, "Hook-like files"):

- a ``.git`` file or symlink (it points git at other config and hooks); in any ``.git``
  directory (a nested repo's, a submodule's, a worktree's too): ``hooks/*`` but ``*.sample``
  (git never runs those), and a ``config``/``config.worktree`` that newly sets a key
  naming a program (``core.fsmonitor``, ``core.hooksPath``, ``alias.*``, ``filter.*`` ...: see
  ``_RISKY``); a config this module cannot read line by line is flagged whole;
- at any depth: ``.envrc`` (direnv), ``.vscode/tasks.json`` and ``.vscode/settings.json``,
  ``*.code-workspace``, ``.idea/workspace.xml`` and ``.idea/runConfigurations/``,
  ``.devcontainer/`` and ``.devcontainer.json``, ``.husky/``, ``.pre-commit-config.yaml``;
- at the tree's root, for a tree that is a home directory: shell start-up files, ``.gitconfig``,
  ``.ssh/``, ``.config/git/``, ``.config/autostart/``, ``.config/systemd/``.

Deleting such a file is not flagged (it runs nothing). A booth whose changes are flagged is not
committed by ``--commit auto`` nor by ``jukebox booth commit`` without ``--allow-hooks``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from jukebox.display.names import visible
from shadowfs.oid import ObjectId
from shadowfs.tree import DIR, FILE, diff_trees
from shadowfs.values import Value, setfield

if TYPE_CHECKING:
    from shadowfs.objects import ObjectReader

_ANYWHERE_FILES = frozenset({b".envrc", b".devcontainer.json", b".pre-commit-config.yaml"})
_ANYWHERE_DIRS = frozenset({b".devcontainer", b".husky"})
_EDITOR_FILES = {
    b".vscode": frozenset({b"tasks.json", b"settings.json"}),
    b".idea": frozenset({b"workspace.xml", b"runConfigurations"}),
}
_HOME_FILES = frozenset(
    {
        b".bashrc", b".bash_profile", b".bash_login", b".bash_logout", b".profile",
        b".zshrc", b".zshenv", b".zprofile", b".zlogin", b".gitconfig",
    }
)  # fmt: skip
_HOME_DIRS = (
    (b".ssh",), (b".config", b"git"), (b".config", b"autostart"), (b".config", b"systemd")
)

# (section, key) of git config variables whose value is a program git runs, or that pull in more
# config; the subsection (a remote's or a driver's name) does not matter. None: any key.
_RISKY: frozenset[tuple[str, str | None]] = frozenset(
    {
        ("core", "fsmonitor"), ("core", "hookspath"), ("core", "sshcommand"),
        ("core", "pager"), ("core", "editor"), ("core", "askpass"), ("core", "gitproxy"),
        ("sequence", "editor"), ("diff", "external"), ("diff", "textconv"), ("diff", "command"),
        ("merge", "driver"), ("credential", "helper"), ("gpg", "program"),
        ("uploadpack", "packobjectshook"), ("remote", "uploadpack"), ("remote", "receivepack"),
        ("include", "path"), ("includeif", "path"), ("difftool", "cmd"), ("mergetool", "cmd"),
        ("browser", "cmd"), ("man", "cmd"), ("alias", None), ("filter", None), ("pager", None),
    }
)  # fmt: skip
_CONFIG_READ_MAX = 1 << 20

_SECTION = re.compile(r'\[\s*([A-Za-z0-9.-]+)(?:\s+"(?:[^"\\]|\\.)*")?\s*\]\s*(.*)')
_KEY = re.compile(r"([A-Za-z][A-Za-z0-9-]*)\s*(?:=\s*(.*))?")


class HookChange(Value):
    __slots__ = FIELDS = ("path", "why")
    path: bytes
    why: str

    def __init__(self, path: bytes, why: str) -> None:
        setfield(self, "path", path)
        setfield(self, "why", why)

    def line(self) -> str:
        return f"{visible(self.path)} ({self.why})"


def _config_settings(data: bytes) -> set[tuple[str, str]] | None:
    """The risky ``(name, value)`` pairs a git config sets; None when a line is not understood."""
    found: set[tuple[str, str]] = set()
    section = ""
    lines = iter(data.decode("utf-8", "surrogateescape").splitlines())
    for raw in lines:
        line = raw.strip()
        while line.endswith("\\"):  # a value continued on the next line
            line = line[:-1] + next(lines, "").strip()
        if not line or line[0] in "#;":
            continue
        header = _SECTION.fullmatch(line)
        if header is not None:
            section = header.group(1).lower().split(".", 1)[0]
            line = header.group(2).strip()
            if not line or line[0] in "#;":
                continue
        setting = _KEY.fullmatch(line)
        if setting is None or not section:
            return None
        key = setting.group(1).lower()
        if (section, key) in _RISKY or (section, None) in _RISKY:
            found.add((f"{section}.{key}", (setting.group(2) or "").strip()))
    return found


def _config_change(store: ObjectReader, old: ObjectId | None, new: ObjectId) -> str | None:
    """Why a changed git config is flagged, or None when it sets no new program."""

    def settings(oid: ObjectId) -> set[tuple[str, str]] | None:
        data = store.read_bytes(oid)
        return _config_settings(data) if len(data) <= _CONFIG_READ_MAX else None

    after = settings(new)
    if after is None:
        return "a git config not read line by line"
    before = (settings(old) or set()) if old is not None else set()
    added = sorted({name for name, value in after - before})
    return f"sets {', '.join(added)}" if added else None


def _may_run(path: bytes) -> bool:
    """Whether `_kind_of` could flag ``path`` at all: every rule names a component starting
    with a dot (``.git``, ``.envrc``, ``.vscode``, ``.ssh``...) but ``*.code-workspace``. One
    bytes search a path instead of a split and a dozen tests: the check of a 50,000-file
    change took 0.08 s of CPU besides its diff, 0.02 s with it."""
    return path.startswith(b".") or b"/." in path or path.endswith(b".code-workspace")


def _kind_of(parts: list[bytes]) -> str | None:
    """Why a path (split at '/') runs on the host, by its place alone; "config" for a git
    config, whose content decides."""
    if b".git" in parts:
        rest = parts[len(parts) - parts[::-1].index(b".git") :]
        if not rest:  # a `.git` file or symlink: it says where git finds config and hooks
            return "points git at another repository"
        if b"hooks" in rest and not rest[-1].endswith(b".sample"):
            return "a git hook"  # a hook, or `hooks` itself made a file or symlink
        if rest and rest[-1] in (b"config", b"config.worktree"):
            return "config"
    name = parts[-1]
    if name in _ANYWHERE_FILES or name.endswith(b".code-workspace"):
        return "run by a tool on entering or opening the tree"
    if any(p in _ANYWHERE_DIRS for p in parts[:-1]):
        return "run by a tool on entering or opening the tree"
    for i, part in enumerate(parts[:-1]):
        if part in _EDITOR_FILES and parts[i + 1] in _EDITOR_FILES[part]:
            return "an editor's task or setting that runs commands"
    if len(parts) == 1 and name in _HOME_FILES:
        return "run by a shell or git in a home directory"
    if any(tuple(parts[: len(d)]) == d and len(parts) > len(d) for d in _HOME_DIRS):
        return "run by a login or desktop session in a home directory"
    return None


def host_hook_changes(store: ObjectReader, base: ObjectId, final: ObjectId) -> list[HookChange]:
    """The changes from ``base`` to ``final`` that would run code on the host later."""
    flagged = []
    for change in diff_trees(store, base, final):
        new = change.new
        if new is None or new.kind == DIR or not _may_run(change.path):
            continue
        why = _kind_of(change.path.split(b"/"))
        if why == "config":
            if new.kind != FILE:
                why = f"a git config replaced by a {new.kind}"  # a symlink, a fifo, ...
            else:
                old = change.old
                old_oid = old.oid if old and old.kind == FILE else None
                why = _config_change(store, old_oid, new.oid)  # type: ignore[arg-type]  # a FILE has an oid
        if why is not None:
            flagged.append(HookChange(change.path, why))
    return flagged


def refusal(changes: list[HookChange], limit: int = 5) -> str:
    """Names the flagged files in one phrase: "it changes files that run code on the host: ..."."""
    shown = ", ".join(c.line() for c in changes[:limit])
    more = f" and {len(changes) - limit} more" if len(changes) > limit else ""
    return f"it changes files that run code on the host: {shown}{more}"


def warning_block(changes: list[HookChange], highlight: bool) -> str:
    """The lines `--commit ask` shows before the change list."""
    on, off = ("\x1b[1;31m", "\x1b[0m") if highlight else ("", "")
    head = f"{on}!! {len(changes)} change(s) run code on the host later (hook-like files):{off}\n"
    return head + "".join(f"{on}!!   {c.line()}{off}\n" for c in changes)
