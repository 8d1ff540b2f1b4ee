"""Keeping a request inside its provider's prefix: the path after `/openai/v1` or `/anthropic`
is appended to the upstream's base URL, so `..` there would reach the rest of the upstream host
(`/openai/v1/../../admin` is `https://api.openai.com/admin`).

Each segment is percent-decoded (repeatedly, as a chain of servers might) before it is judged:
`.` and empty segments are dropped, `..` removes the segment before it and is refused when there
is none left, and a segment that decodes to a separator (`%2f`, `%5c`) or NUL is refused, since
servers disagree on whether it splits the path. Endpoints are matched on the decoded path, so
`chat/%63ompletions` is recorded as the model call the upstream will see.
"""

from __future__ import annotations

from urllib.parse import unquote

from jukebox.errors import JukeboxError

_DECODE_ROUNDS = 4
_FORBIDDEN = ("/", "\\", "\x00")


class PathRefused(JukeboxError, ValueError):
    """The request's path leaves its prefix or cannot be judged; the message says which."""


def _decoded(segment: str) -> str:
    for _ in range(_DECODE_ROUNDS):
        decoded = unquote(segment, errors="strict") if "%" in segment else segment
        if decoded == segment:
            return decoded
        segment = decoded
    raise PathRefused("a path segment is percent-encoded more times than any client does")


def confine(rest: str) -> tuple[str, str]:
    """(the path and query to forward, the decoded path to match endpoints on) for what follows
    a provider's prefix; raises PathRefused for a path that would leave the prefix."""
    path, mark, query = rest.partition("?")
    raw_kept: list[str] = []
    decoded_kept: list[str] = []
    for raw in path.split("/"):
        try:
            decoded = _decoded(raw)
        except UnicodeDecodeError:
            raise PathRefused("a path segment is not valid UTF-8 once percent-decoded") from None
        if any(c in decoded for c in _FORBIDDEN):
            raise PathRefused("a path segment hides a separator (%2f, %5c) or a NUL")
        if decoded in ("", "."):
            continue
        if decoded == "..":
            if not raw_kept:
                raise PathRefused("the path climbs out of the provider's prefix with '..'")
            raw_kept.pop()
            decoded_kept.pop()
            continue
        raw_kept.append(raw)
        decoded_kept.append(decoded)
    trailing = "/" if raw_kept and path.endswith("/") else ""
    forward = "/" + "/".join(raw_kept) + trailing if raw_kept or path else ""
    return forward + mark + query, "/" + "/".join(decoded_kept)
