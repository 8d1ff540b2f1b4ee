"""Telling an SDK's retry from an agent that asks the same thing again.

The SDKs (openai, anthropic, and litellm on top of them) resend the very same request after a
retryable answer: 408, 409, 429, a 5xx, or no answer at all (a connection error). To the
breaker that is one logical call, not a semantic loop. The same bytes sent after a success, or
after an error the SDKs never retry (a 400), are a new call and count as one.

A request is a retry when its provider, endpoint and body bytes equal those of a request whose
latest answer was retryable, at most `MAX_RETRIES` times in a row: an agent that resends a
rate-limited request forever is looping, and from then on every attempt counts again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

RETRYABLE_STATUS = frozenset({408, 409, 429})
MAX_RETRIES = 10  # litellm's Router retries up to a handful of times; the SDKs twice by default
_REMEMBERED = 256  # failed requests remembered at once (parallel calls each have their own)


def retryable(status: int, error: str | None) -> bool:
    """Whether an SDK would retry this answer (no answer at all counts as retryable)."""
    return error is not None or status in RETRYABLE_STATUS or status >= 500


def fingerprint(provider: str, endpoint: str, body: bytes) -> bytes:
    return hashlib.sha256(b"\0".join((provider.encode(), endpoint.encode(), body))).digest()


class RetryTracker:
    """Remembers requests whose latest answer was retryable. Used from one trio loop only."""

    def __init__(self) -> None:
        self._failed: OrderedDict[bytes, int] = OrderedDict()  # fingerprint -> retries so far

    def is_retry(self, key: bytes) -> bool:
        return self._failed.get(key, MAX_RETRIES) < MAX_RETRIES

    def settled(self, key: bytes, status: int, error: str | None, was_retry: bool) -> None:
        """The answer to a request: remembered when retryable, forgotten otherwise."""
        if not retryable(status, error):
            self._failed.pop(key, None)
            return
        self._failed[key] = self._failed.get(key, -1) + 1 if was_retry else 0
        self._failed.move_to_end(key)
        while len(self._failed) > _REMEMBERED:
            self._failed.popitem(last=False)
