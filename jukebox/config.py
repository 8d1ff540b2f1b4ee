"""The user's config file: defaults for jukebox's flags, under the flags' own names.

``$JUKEBOX_CONFIG`` names the file; else ``$XDG_CONFIG_HOME/jukebox/config.toml``, else
``~/.config/jukebox/config.toml``. A missing default file is no config; a file named by
``$JUKEBOX_CONFIG`` must exist. For example::

    tape-dir = "~/tapes"
    image = "minimal"
    max-cost-usd = 2.5
    max-turns = 40

A flag beats an environment variable (``$JUKEBOX_TAPE_DIR``, ``$JUKEBOX_LOCK_TIMEOUT``,
``$NO_COLOR``), which beats the file. Only settings that pick a default are taken: nothing
that loosens a protection (``allow-hooks``, ``no-seccomp``, ``trust-recorded-image``) can be
turned on from a file. A bad key or value is one line naming the file and the key, exit 2.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from jukebox.errors import UsageError
from shadowfs.values import Value, setfield

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

CONFIG_ENV = "JUKEBOX_CONFIG"


class ConfigError(UsageError):
    """The config file cannot be read, or holds an unknown key or a bad value."""


def _choice(*allowed: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value not in allowed:
            raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        return value

    return check


def _tape_dir(value: Any) -> Any:
    if not isinstance(value, str) or not value:
        raise ValueError("write a directory, like \"~/jukebox-tapes\"")
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        raise ValueError(f"{value!r} is relative: write an absolute path or one under ~/")
    return os.path.normpath(path)


def _image(value: Any) -> Any:
    from jukebox.booth.images import image_path

    if not isinstance(value, str) or not value:
        raise ValueError("write an image name (like \"host\") or a path to a .toml file")
    image = os.path.expanduser(value)
    image_path(image)  # an unknown name or a missing file says so (ImageError)
    return image


def _positive_seconds(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:  # fmt: skip
        raise ValueError(f"{value!r} is not a positive number of seconds")
    return float(value)


def _breaker_limit(flag: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        from jukebox.guard.breaker import CircuitBreaker

        CircuitBreaker.from_options(**{flag.replace("-", "_"): value})  # UsageError if bad
        return value

    return check


def _size(value: Any) -> Any:
    from jukebox.booth.images import parse_size

    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    try:
        parse_size(value)
    except (ValueError, TypeError):
        raise ValueError(f"{value!r} is not a size: write bytes or like \"512M\"") from None
    return str(value)


def _duration(value: Any) -> Any:
    from jukebox.trees.realtree import parse_duration

    try:
        parse_duration(str(value))
    except ValueError:
        raise ValueError(f"{value!r} is not a duration: write like \"30s\", \"500ms\", \"2m\"") \
            from None  # fmt: skip
    return str(value)


def _flag(value: Any) -> Any:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


# key (a flag's name) -> its check, which returns the value as the flag's default.
KEYS: dict[str, Callable[[Any], Any]] = {
    "tape-dir": _tape_dir,
    "image": _image,
    "fs": _choice("fuse", "overlay"),
    "net": _choice("host", "none"),
    "commit": _choice("auto", "ask", "never"),
    "checkpoint-every": _positive_seconds,
    "max-cost-usd": _breaker_limit("max-cost-usd"),
    "unknown-cost": _breaker_limit("unknown-cost"),
    "max-tokens": _breaker_limit("max-tokens"),
    "max-turns": _breaker_limit("max-turns"),
    "max-repeat": _breaker_limit("max-repeat"),
    "max-scratch": _size,
    "lock-timeout": _duration,
    "no-color": _flag,
}

# The commands whose flags take their defaults from the file (command path -> keys). tape-dir
# is not here: every command, and the Python API, reads it through jukebox.tape.tapedir.
COMMANDS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("booth", "run"): (
        "image", "fs", "net", "commit", "checkpoint-every", "max-cost-usd", "unknown-cost",
        "max-tokens", "max-turns", "max-repeat", "max-scratch",
    ),
    ("booth", "commit"): ("lock-timeout",),
}  # fmt: skip

# A key whose environment variable, when set, wins over the file.
ENVIRONMENT = {
    "tape-dir": "JUKEBOX_TAPE_DIR",
    "lock-timeout": "JUKEBOX_LOCK_TIMEOUT",
}


class Config(Value):
    __slots__ = FIELDS = ("path", "values")
    path: Path | None  # None: no file
    values: dict[str, Any]

    def __init__(self, path: Path | None = None, values: dict[str, Any] | None = None) -> None:
        setfield(self, "path", path)
        setfield(self, "values", {} if values is None else values)

    def get(self, key: str) -> Any:
        """The file's value for ``key``, or None when unset or overridden by its env var."""
        env = ENVIRONMENT.get(key)
        if env and os.environ.get(env):
            return None
        return self.values.get(key)


def config_path() -> tuple[Path, bool]:
    """The config file's path, and whether the user named it ($JUKEBOX_CONFIG)."""
    named = os.environ.get(CONFIG_ENV)
    if named:
        return Path(os.path.expanduser(named)), True
    base = os.environ.get("XDG_CONFIG_HOME", "")
    # The XDG spec: a relative path is invalid and must be ignored.
    root = Path(base) if os.path.isabs(base) else Path.home() / ".config"
    return root / "jukebox" / "config.toml", False


def _visible(path: Path) -> bool:
    """Whether this user can see that `path` exists (it may still be unreadable)."""
    try:
        path.stat()
    except PermissionError:
        return False
    except OSError:
        return True
    return True


def load() -> Config:
    """The config file, checked whole: ConfigError on the first bad key or value."""
    path, named = config_path()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if named:
            raise ConfigError(
                f"${CONFIG_ENV} names {path}, which does not exist: fix the path or unset it"
            ) from None
        return Config()
    except PermissionError as error:
        if not named and not _visible(path):
            # `sudo -u nobody jukebox …` keeps HOME=/root: a default path this user cannot
            # even look at is no config of theirs (ignoring it loosens nothing: no key may).
            return Config()
        raise ConfigError(f"{path}: cannot be read ({error.strerror}): check it") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read ({error.strerror}): check it") from None
    import tomllib

    try:
        document = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    values: dict[str, Any] = {}
    for key, value in document.items():
        check = KEYS.get(key)
        if check is None:
            raise ConfigError(
                f"{path}: unknown key {key!r}: the keys are {', '.join(KEYS)} (see `jukebox help "
                "config`)"
            )
        try:
            values[key] = check(value)
        except (ValueError, UsageError) as error:
            raise ConfigError(f"{path}: {key}: {error}") from None
    return Config(path, values)


def default_map(config: Config, commands: Any) -> dict[str, Any]:
    """click's default_map for the root command ``commands``: each command of COMMANDS gets
    the file's values of its keys, under the names of the parameters of the flags they name."""
    result: dict[str, Any] = {}
    for command_path, keys in COMMANDS.items():
        command = commands
        for name in command_path:
            command = getattr(command, "commands", {}).get(name)
            if command is None:
                break
        if command is None:
            continue
        defaults = {}
        for param in command.params:
            for opt in getattr(param, "opts", ()):
                key = opt.removeprefix("--")
                if key in keys and config.get(key) is not None:
                    defaults[param.name] = config.get(key)
        if defaults:
            level = result
            for name in command_path[:-1]:
                level = level.setdefault(name, {})
            level[command_path[-1]] = defaults
    return result
