"""Keeping secrets off the tape: header redaction and scrubbing of known key values.

API keys must reach the upstream (the proxy forwards headers as they came) but never a frame, a
store object or a log line. Two layers: headers whose name looks secret are replaced by a marker
before anything records them, and every byte string that is recorded (request and response
bodies, stream events) has each known secret value replaced, so a key an agent pastes into a
prompt is caught too. Known values are the ones seen in secret headers plus the supervisor's
secret-looking environment values, which the booth hands over.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

REDACTED = "[REDACTED]"

# Exact names, lowercase. Anything matching SECRET_MARKERS is treated the same way.
SECRET_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "openai-api-key",
        "anthropic-api-key",
        "cookie",
        "set-cookie",
        "x-goog-api-key",
    }
)
SECRET_MARKERS = ("key", "token", "secret", "auth", "password", "credential", "session")

# Values shorter than this are not scrubbed from bodies: replacing every "abc" in a prompt would
# wreck the record while protecting nothing a real key would need.
MIN_SECRET_LEN = 8


def is_secret_header(name: str) -> bool:
    lowered = name.lower()
    if lowered in SECRET_HEADERS:
        return True
    # Rate-limit headers name tokens ("x-ratelimit-remaining-tokens") without holding any.
    return "ratelimit" not in lowered and any(m in lowered for m in SECRET_MARKERS)


def secret_values(name: str, value: str) -> list[str]:
    """The secret parts of one secret header: the whole value and, for `Bearer X`, X alone."""
    out = [value.strip()]
    scheme, _, rest = value.strip().partition(" ")
    if rest and scheme.lower() in ("bearer", "basic", "token"):
        out.append(rest.strip())
    return [v for v in out if len(v) >= MIN_SECRET_LEN]


class Scrubber:
    """Replaces known secret values in bytes and strings; learns new values as they are seen.

    Thread-safe: the proxy's loop adds values while a recorder thread scrubs.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: tuple[bytes, ...] = ()
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        fresh = {s.encode() for s in secrets if s and len(s) >= MIN_SECRET_LEN}
        with self._lock:
            if fresh - set(self._values):
                # Longest first: a key that contains another key is replaced whole.
                merged = set(self._values) | fresh
                self._values = tuple(sorted(merged, key=len, reverse=True))

    def learn_headers(self, headers: Iterable[tuple[str, str]]) -> None:
        found: list[str] = []
        for name, value in headers:
            if is_secret_header(name):
                found.extend(secret_values(name, value))
        if found:
            self.add(found)

    def bytes(self, data: bytes) -> bytes:
        for value in self._values:
            if value in data:
                data = data.replace(value, REDACTED.encode())
        return data

    def text(self, data: str) -> str:
        for value in self._values:
            plain = value.decode()
            if plain in data:
                data = data.replace(plain, REDACTED)
        return data

    @property
    def count(self) -> int:
        return len(self._values)


def redact_headers(headers: Iterable[tuple[str, str]] | Mapping[str, str]) -> dict[str, str]:
    """Headers as a recordable dict: secret-looking ones replaced by the marker."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: dict[str, str] = {}
    for name, value in items:
        lowered = name.lower()
        out[lowered] = REDACTED if is_secret_header(lowered) else value
    return out
