"""A module's logger that imports `logging` at its first message.

`logging` (with `traceback`, `linecache`, `tokenize` and `string` behind it) is about 30 M
instructions to import; the FUSE server logs only what goes wrong, and a booth whose mount has
no trouble never needs it (docs/benchmarks.md, "Where a user waits")."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any


class LazyLogger:
    """Stands for `logging.getLogger(name)`: any attribute asked for is the real logger's."""

    __slots__ = ("_logger", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger: Any = None

    def __getattr__(self, attr: str) -> Any:
        logger = self._logger
        if logger is None:
            import logging

            logger = self._logger = logging.getLogger(self._name)
        return getattr(logger, attr)
