"""Keeping secrets off tapes and logs: the one place that decides what a secret looks like.

Every place that records something a secret can travel in goes through this module:

- headers (`redact_headers`): a header whose name looks secret (`authorization`, `x-api-key`,
  `cookie`, anything with `key`, `token`, `secret`, `auth`, ...) is replaced by the marker;
- known values (`Scrubber`): the values of those headers, the supervisor's secret-looking
  environment values and the proxy's own secret are replaced wherever they appear in a recorded
  body, stream event, header value or error text, so a key an agent pastes into a prompt is
  caught too;
- URLs and paths (`redact_url`, `redact_query`): the `user:password@` of a URL and the values of
  secret-looking query parameters (`?key=`, `?api-key=`, `?access_token=`, `?sig=`, ...);
- free text and command lines (`redact_text`, `redact_argv`): the above plus values that look
  like provider keys (`sk-...`, `AKIA...`, `ghp_...`, `xox...-`, ...), `Bearer X`, the value of a
  secret-looking option (`--api-key X`, `--token=X`) and of a secret-looking assignment
  (`OPENAI_API_KEY=X`).

What is not scrubbed: file content (a tree's own `.env` is content and is recorded as such), and
bodies are scrubbed of known values only, not of the key-shaped patterns (a prompt quoting a file
stays as the agent sent it).
"""

from __future__ import annotations

import fnmatch
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from urllib.parse import unquote, urlsplit

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
# Parts of a name (an argument's, a header's, an option's) that say its value is secret.
SECRET_MARKERS = ("key", "token", "secret", "password", "passwd", "credential", "auth")
# Headers also carry session ids (`x-session-token`, `session-id`) that let whoever holds them in.
_HEADER_MARKERS = (*SECRET_MARKERS, "session")

# Environment variable names whose values are secrets (the images' default `env.secret`).
SECRET_ENV_PATTERNS = ("*_KEY", "*_TOKEN", "*SECRET*", "*PASSWORD*")

# Query parameters that carry credentials without a marker in their name.
_SECRET_QUERY = frozenset({"sig", "signature", "code", "pass", "pwd", "jwt"})

# Command-line options whose value is a secret: these names, or ending in one of the suffixes.
_SECRET_OPTIONS = frozenset(
    {"key", "token", "password", "passwd", "pass", "secret", "auth", "apikey", "bearer", "cookie"}
)
_SECRET_OPTION_SUFFIXES = ("-key", "-token", "-secret", "-password", "-passwd", "-credentials")

class _Pattern:
    """A regular expression compiled at its first use. Compiling this module's seven cost
    about 15 M instructions, a booth's start paid them to redact a command line like `true`
    that none can match, and `redact_text` now tries a pattern only on text holding what it
    cannot match without (`_may_hold_secrets`)."""

    __slots__ = ("_compiled", "_flags", "pattern")

    def __init__(self, pattern: str, flags: int = 0) -> None:
        self.pattern = pattern
        self._flags = flags
        self._compiled: re.Pattern[str] | None = None

    def compiled(self) -> re.Pattern[str]:
        compiled = self._compiled
        if compiled is None:  # two threads may both compile: the same pattern either way
            compiled = self._compiled = re.compile(self.pattern, self._flags)
        return compiled

    def sub(self, repl: str | Callable[[re.Match[str]], str], text: str) -> str:
        return self.compiled().sub(repl, text)

    def search(self, text: str) -> re.Match[str] | None:
        return self.compiled().search(text)


# Values shaped like the providers' keys, wherever they appear in free text.
KEY_SHAPES = _Pattern(
    r"""
      \bsk-[A-Za-z0-9][A-Za-z0-9_-]{10,}          # OpenAI (sk-, sk-proj-), Anthropic (sk-ant-)
    | \b(?:AKIA|ASIA)[0-9A-Z]{16}\b                # AWS access key ids
    | \bgh[pousr]_[A-Za-z0-9]{20,}                 # GitHub tokens
    | \bgithub_pat_[A-Za-z0-9_]{20,}
    | \bxox[abposr]-[A-Za-z0-9-]{8,}               # Slack
    | \bAIza[0-9A-Za-z_-]{30,}                     # Google API keys
    | \bglpat-[A-Za-z0-9_-]{16,}                   # GitLab
    | \bhf_[A-Za-z0-9]{20,}                        # Hugging Face
    """,
    re.VERBOSE,
)
# scheme://user:password@ (a user name alone, as in ssh://git@host, is kept).
_URL_USERINFO = _Pattern(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@:]*:[^/\s@]*@")
_AUTH_SCHEME = _Pattern(r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]{8,}")
_SECRET_HEADER_LINE = _Pattern(
    r"(?i)\b(authorization|proxy-authorization|x-api-key|api-key|x-goog-api-key|cookie)"
    r"(\s*:\s*)([^\r\n\"']+)"
)
_VALUE = r"""("[^"]*"|'[^']*'|[^\s"']+)"""
_OPTION_VALUE = _Pattern(r"(?<![\w-])(--?[A-Za-z][\w-]*)(=|\s+)" + _VALUE)
_ASSIGNMENT = _Pattern(r"""(?<![\w-])([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|'[^']*'|[^\s"'&]+)""")
_QUERY_IN_TEXT = _Pattern(r"[?&][^\s=&#\"']+=[^\s&#\"']*")

# Values shorter than this are not scrubbed from bodies: replacing every "abc" in a prompt would
# wreck the record while protecting nothing a real key would need.
MIN_SECRET_LEN = 8


def is_secret_name(name: str) -> bool:
    """A name (of an argument, a field, an environment variable) that says its value is secret."""
    lowered = name.lower()
    return any(m in lowered for m in SECRET_MARKERS)


@lru_cache(maxsize=1024)  # asked for every header of every proxied call; names repeat
def is_secret_header(name: str) -> bool:
    lowered = name.lower()
    if lowered in SECRET_HEADERS:
        return True
    # Rate-limit headers name tokens ("x-ratelimit-remaining-tokens") without holding any.
    return "ratelimit" not in lowered and any(m in lowered for m in _HEADER_MARKERS)


def is_secret_env_name(name: str, patterns: Iterable[str] = SECRET_ENV_PATTERNS) -> bool:
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, p.upper()) for p in patterns)


def is_secret_query_name(name: str) -> bool:
    lowered = unquote(name).lower()
    return (
        lowered in _SECRET_QUERY
        or lowered.endswith(("signature", "-sig", "_sig"))
        or is_secret_header(lowered)
    )


def is_secret_option(option: str) -> bool:
    """`--api-key`, `--token`, `-password`, `--client_secret` (not `--max-tokens`)."""
    name = option.lstrip("-").lower().replace("_", "-")
    return name in _SECRET_OPTIONS or name.endswith(_SECRET_OPTION_SUFFIXES)


def secret_values(name: str, value: str) -> list[str]:
    """The secret parts of one secret header: the whole value and, for `Bearer X`, X alone."""
    out = [value.strip()]
    scheme, _, rest = value.strip().partition(" ")
    if rest and scheme.lower() in ("bearer", "basic", "token"):
        out.append(rest.strip())
    return [v for v in out if len(v) >= MIN_SECRET_LEN]


def url_secrets(url: str) -> list[str]:
    """The credentials a URL carries in its `user:password@`, as values to scrub."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = [parts.password or "", unquote(parts.password or "")]
    if parts.password is not None and parts.username:
        found.append(f"{parts.username}:{parts.password}")
    return [v for v in found if len(v) >= MIN_SECRET_LEN]


class Scrubber:
    """Replaces known secret values in bytes and strings; learns new values as they are seen.

    Thread-safe: the proxy's loop adds values while a recorder thread scrubs.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: tuple[bytes, ...] = ()
        # The same values as text, kept beside: `text` runs on every event of every stream, and
        # decoding each value there cost more than the search.
        self._texts: tuple[str, ...] = ()
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        fresh = {s.encode() for s in secrets if s and len(s) >= MIN_SECRET_LEN}
        with self._lock:
            if fresh - set(self._values):
                # Longest first: a key that contains another key is replaced whole.
                merged = set(self._values) | fresh
                values = tuple(sorted(merged, key=len, reverse=True))
                # One tuple each, swapped whole: a reader on another thread sees the old set
                # or the new one, never a mix (text values first: the count names both).
                self._texts = tuple(value.decode() for value in values)
                self._values = values

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
        for plain in self._texts:
            if plain in data:
                data = data.replace(plain, REDACTED)
        return data

    def host(self, name: str) -> str:
        """A host name as a frame or a log may show it (the agent's DNS lookups): the known
        values replaced in any case, since DNS names are case-insensitive and a resolver may
        change the case, and across the dots between labels, since a label holds 63 bytes at
        most and a longer value is split over several."""
        kept = [i for i, c in enumerate(name) if c != "."]
        flat = "".join(name[i] for i in kept).lower()
        spans: list[tuple[int, int]] = []
        for plain in self._texts:
            needle = plain.replace(".", "").lower()
            at = flat.find(needle) if needle else -1
            while at != -1:
                spans.append((kept[at], kept[at + len(needle) - 1] + 1))
                at = flat.find(needle, at + 1)
        if not spans:
            return name
        out, end = [], 0
        for start, stop in sorted(spans):
            if start < end:  # overlapping values: one marker for both
                end = max(end, stop)
                continue
            out += [name[end:start], REDACTED]
            end = stop
        return "".join(out) + name[end:]

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


def redact_query(target: str) -> str:
    """A path with the values of its secret-looking query parameters replaced by the marker."""
    path, mark, query = target.partition("?")
    if not mark:
        return target
    pairs = []
    for pair in query.split("&"):
        name, eq, _ = pair.partition("=")
        pairs.append(f"{name}={REDACTED}" if eq and is_secret_query_name(name) else pair)
    return f"{path}?{'&'.join(pairs)}"


def redact_url(url: str) -> str:
    """A URL without the password of its `user:password@` and with its query redacted."""
    return redact_query(_URL_USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", url))


def url_origin(url: str) -> str:
    """`scheme://host[:port]` of a URL: what may name an upstream in a message (its path can
    hold another proxy's secret, its userinfo a password)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "(unparsable URL)"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{port}"


def _secret_option_value(m: re.Match[str]) -> str:
    if not is_secret_option(m.group(1)) or m.group(3).startswith("-"):
        return m.group(0)
    return m.group(1) + m.group(2) + REDACTED


def _secret_assignment(m: re.Match[str]) -> str:
    name = m.group(1)
    secret = is_secret_env_name(name) or is_secret_option(name)
    return f"{name}={REDACTED}" if secret else m.group(0)


def _secret_query_pair(m: re.Match[str]) -> str:
    name = m.group(0)[1:].partition("=")[0]
    return m.group(0)[0] + f"{name}={REDACTED}" if is_secret_query_name(name) else m.group(0)


def redact_text(text: str, known: Scrubber | None = None) -> str:
    """Free text (an error message, a command line, one argument) with every secret it shows
    replaced: known values, URL passwords, key-shaped values, `Bearer X`, header lines,
    `--secret-option X`, `SECRET_NAME=X` and secret query parameters."""
    if known is not None:
        text = known.text(text)
    # Each pattern is tried only where it could match: what it needs is checked on the text
    # as it is at that step (a replacement is the marker, which holds none of it).
    if "://" in text and "@" in text:
        text = _URL_USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)
    if ":" in text:
        text = _SECRET_HEADER_LINE.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    if _has_space(text):
        text = _AUTH_SCHEME.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    if "-" in text and ("=" in text or _has_space(text)):
        text = _OPTION_VALUE.sub(_secret_option_value, text)
    if "=" in text:
        text = _ASSIGNMENT.sub(_secret_assignment, text)
        if "?" in text or "&" in text:
            text = _QUERY_IN_TEXT.sub(_secret_query_pair, text)
    # What every alternative of KEY_SHAPES starts with, as it is written (the pattern has no
    # IGNORECASE): text holding none of these holds no key shape.
    # Spelled out rather than any() over a tuple: its generator was a cost of every SQL
    # parameter recorded.
    if ("sk-" in text or "AKIA" in text or "ASIA" in text or "gh" in text
            or "github_pat_" in text or "xox" in text or "AIza" in text or "glpat-" in text
            or "hf_" in text):
        text = KEY_SHAPES.sub(REDACTED, text)
    return text


def _has_space(text: str) -> bool:
    """Whether `text` holds a character `\\s` matches: str.split() splits on exactly those
    (both are Py_UNICODE_ISSPACE), so text without one splits into itself alone."""
    return text.split() != [text]


def redact_argv(argv: Sequence[str], known: Scrubber | None = None) -> list[str]:
    """A command line fit for a tape: as many arguments, each secret replaced by the marker
    (`--api-key X` spans two arguments: X is replaced whole)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not (arg.startswith("-") and arg != "-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = arg.startswith("-") and "=" not in arg and is_secret_option(arg)
        out.append(redact_text(arg, known))
    return out
