"""The sandbox image a tape records, and how it compares with the image a replay runs under.

A booth's run_start carries its image whole (`image_record`): the TOML as parsed, canonical
JSON, with its BLAKE3 hash. Replays and forks never take policy from a tape (a tape dir can come
from anyone): they run under the caller's image, and `jukebox replay --exec --image recorded`
rebuilds the recorded one only after checking its hash and, when it is looser than the image
it replaces, only with the caller's explicit confirmation (`loosenings` names what it loosens).

Values the image sets for secret-looking environment names (`[env] set`) never reach a tape:
they are left out of the recorded content, which names them under `redacted_env`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from blake3 import blake3

from jukebox.booth.images import Image, parse_image
from jukebox.errors import CheckFailed, UsageError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

RECORDED = "recorded"  # the --image value that asks for the tape's own image
# Fields that are the image's identity, not its policy.
_IDENTITY = frozenset({"name", "path", "description", "source"})


def _content(img: Image) -> tuple[dict[str, Any], list[str]]:
    content = {k: v for k, v in img.source.items()}
    env = content.get("env")
    redacted: list[str] = []
    if isinstance(env, Mapping) and isinstance(env.get("set"), Mapping):
        kept = {k: v for k, v in env["set"].items() if not img.is_secret(k)}
        redacted = sorted(set(env["set"]) - set(kept))
        content["env"] = {**env, "set": kept}
    return content, redacted


def content_hash(content: Mapping[str, Any]) -> str:
    from jukebox.tape.frame import canonical_json

    return blake3(canonical_json(content)).hexdigest()


def image_record(img: Image) -> dict[str, Any]:
    """What run_start records of an image: its name, canonical content and that content's hash."""
    content, redacted = _content(img)
    record: dict[str, Any] = {"name": img.name, "blake3": content_hash(content), "content": content}
    if redacted:
        record["redacted_env"] = redacted
    return record


def image_from_record(record: Any, where: str) -> Image:
    """The image a tape recorded, rebuilt from its content after checking the content's hash.

    Never reads a file: the name is a label, not a path. `where` names the tape in messages."""
    if not isinstance(record, Mapping) or not isinstance(record.get("content"), Mapping):
        raise UsageError(
            f"{where} records no image content (it predates recorded images): "
            "replay it under --image NAME|PATH instead of --image recorded"
        )
    content, digest = record["content"], record.get("blake3")
    if content_hash(content) != digest:
        raise CheckFailed(
            f"{where}: the recorded image's content does not hash to its recorded blake3 "
            f"{str(digest)[:16]!r}: the tape was altered; run `jukebox verify` on it"
        )
    name = record["name"] if isinstance(record.get("name"), str) else "recorded"
    label = Path(f"<image recorded in {where}>")
    img = parse_image(dict(content), label)
    return img.replace(name=name, path=label)


def differences(a: Image, b: Image) -> list[str]:
    """The names of the policy fields two images set differently (every field of the image's
    class but its identity, so a field added later is compared too)."""
    names = [name for name in a.INIT if name not in _IDENTITY]
    return [name for name in names if getattr(a, name) != getattr(b, name, None)]


def _limit_text(value: int | None) -> str:
    return "none" if value is None else str(value)


def loosenings(recorded: Image, used: Image, ignore: tuple[str, ...] = ()) -> list[str]:
    """What running under `recorded` instead of `used` would loosen, one phrase each.

    A policy field this function does not know counts as loosening whenever it differs: a new
    protection must not be dropped silently because this list was not updated."""
    out: list[str] = []
    for name in differences(recorded, used):
        if name in ignore or name == "verify":  # replays never run the verifier
            continue
        r, u = getattr(recorded, name), getattr(used, name)
        if name == "net":
            if r == "host":
                out.append("net = host (the agent reaches the network)")
        elif name in ("readonly_host", "private_tmp"):
            if u and not r:
                what = "the host is writable" if name == "readonly_host" else "/tmp is the host's"
                out.append(f"fs.{name} = false ({what})")
        elif name == "hide":
            shown = sorted(set(u) - set(r))
            if shown:
                out.append(f"fs.hide no longer hides {', '.join(shown)}")
        elif name == "only":
            if u and (not r or set(r) - set(u)):
                out.append(f"fs.only shows {', '.join(sorted(set(r) - set(u))) or 'every dir'}")
        elif name == "env_allow":
            if "*" not in u and set(r) - set(u):
                out.append(f"env.allow passes {', '.join(sorted(set(r) - set(u)))}")
        elif name == "env_secret":
            if set(u) - set(r):
                out.append(f"env.secret no longer marks {', '.join(sorted(set(u) - set(r)))}")
        elif name == "env_set":
            changed = sorted(k for k in r if u.get(k) != r[k])
            if changed:
                out.append(f"env.set sets {', '.join(changed)}")
        elif name == "limits":
            for key in sorted(u):
                if key not in r or r[key] > u[key]:
                    out.append(f"limits.{key} {u[key]} -> {_limit_text(r.get(key))}")
        elif name == "scratch_limit":
            if u is not None and (r is None or r > u):
                out.append(f"limits.scratch {u} -> {_limit_text(r)}")
        elif name in ("tmp_size", "shm_size"):  # unset: the default share of RAM
            if u is not None and (r is None or r > u):
                out.append(f"limits.{name.removesuffix('_size')} {u} -> {r or 'default'}")
        elif name in ("seccomp", "cgroup"):
            if u and not r:
                what = "no system call filter" if name == "seccomp" else "rlimits only"
                out.append(f"{name}.enabled = false ({what})")
        elif name == "seccomp_allow":
            if set(r) - set(u):
                out.append(f"seccomp.allow lets through {', '.join(sorted(set(r) - set(u)))}")
        else:
            out.append(f"{name} differs")
    return out


def difference_line(record: Any, used: Image, where: str) -> str | None:
    """One line saying how the image a tape recorded differs from the one a replay used, or
    None when they are the same policy."""
    used_hash = image_record(used)["blake3"]
    if not isinstance(record, Mapping) or not isinstance(record.get("content"), Mapping):
        return (
            f"image: {where} records no image content to compare; this run used "
            f"{used.name!r} (blake3 {used_hash[:12]})"
        )
    try:
        recorded = image_from_record(record, where)
    except (UsageError, CheckFailed) as error:
        return f"image: {error}; this run used {used.name!r} (blake3 {used_hash[:12]})"
    fields = differences(recorded, used)
    if not fields:
        return None
    return (
        f"image: the tape was recorded under {recorded.name!r} (blake3 "
        f"{str(record.get('blake3'))[:12]}), this run used {used.name!r} (blake3 "
        f"{used_hash[:12]}): they differ in {', '.join(fields)}"
    )
