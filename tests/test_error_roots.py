"""One error root per package: every exception class jukebox defines derives from
`jukebox.errors.JukeboxError`, every one shadowfs defines from `shadowfs.errors.ShadowfsError`.

The CLI (`jukebox.cli.guarded`) turns those two roots into one line and the documented exit code;
a class outside them reaches the user as an "internal error" with exit code 70. Classes that must
also be a builtin (an `OSError` the FUSE server answers with its errno, a `ValueError` callers
catch) take the root as a second base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import jukebox
import shadowfs
from jukebox.errors import CheckFailed, JukeboxError
from shadowfs.errors import ShadowfsError

ROOTS: dict[types.ModuleType, type[Exception]] = {jukebox: JukeboxError, shadowfs: ShadowfsError}
# Fewer classes than these means the walk missed modules (at the time of writing: 42 and 17).
AT_LEAST = {jukebox: 40, shadowfs: 15}


def _modules(package: types.ModuleType) -> list[types.ModuleType]:
    found = [package]
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.endswith("__main__"):
            continue  # runs a command when imported
        found.append(importlib.import_module(info.name))
    return found


def _exception_classes(module: types.ModuleType) -> list[type[BaseException]]:
    return [
        value
        for value in vars(module).values()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == module.__name__
    ]


def strays(modules: list[types.ModuleType], root: type[Exception]) -> list[str]:
    """The exception classes defined in `modules` that do not derive from `root`."""
    return [
        f"{cls.__module__}.{cls.__qualname__}"
        for module in modules
        for cls in _exception_classes(module)
        if not issubclass(cls, root)
    ]


def test_every_exception_class_derives_from_its_packages_root() -> None:
    for package, root in ROOTS.items():
        modules = _modules(package)
        classes = [cls for module in modules for cls in _exception_classes(module)]
        # The walk must reach the modules that define errors, or the check proves nothing.
        assert len(classes) >= AT_LEAST[package], (package.__name__, classes)
        assert strays(modules, root) == [], f"derive these from {root.__name__}"


def test_a_class_outside_the_root_is_named() -> None:
    stray = types.ModuleType("jukebox.fake_stray")
    exec(
        "class Fine(JukeboxError):\n    pass\n\nclass Outside(Exception):\n    pass\n",
        {"__name__": stray.__name__, "JukeboxError": JukeboxError},
        stray.__dict__,
    )
    assert strays([stray], JukeboxError) == ["jukebox.fake_stray.Outside"]


def test_divergences_exit_as_failed_checks() -> None:
    # DESIGN.md's exit codes: a replay that diverged is a check that failed (1), not bad input.
    from jukebox.api.bside import ReplayDiverged
    from jukebox.llm.replay import Divergence
    from jukebox.sql.replay import Diverged

    for cls in (ReplayDiverged, Divergence, Diverged):
        assert issubclass(cls, CheckFailed) and cls.exit_code == 1, cls


def test_a_scratch_limit_is_still_an_enospc_oserror() -> None:
    # The FUSE server answers an OSError with its errno: the root is a second base only.
    import errno

    from shadowfs.layer import ScratchLimitReached

    error = ScratchLimitReached(errno.ENOSPC, "the layer's scratch limit would be passed")
    assert isinstance(error, OSError) and isinstance(error, ShadowfsError)
    assert error.errno == errno.ENOSPC and error.strerror.startswith("the layer's")
