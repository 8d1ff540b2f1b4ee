"""The viewer's page: the assets in `assets/` (HTML, CSS, JS, shipped as package data) with the
tape's data put inside, so a page needs nothing from the network.

The data goes in a `<script type="application/json">` element, a block the browser never runs,
with every `<`, `>` and `&` written as a JSON escape, so no text a tape holds can close the
element or open another. The page's own script and style carry a fresh nonce that the
Content-Security-Policy names: were anything of the tape ever read as markup, a script in it
would still not run (no inline handler, no `javascript:` URL, no other source).

Two forms: `served` (the frames' full views come from the server, one JSON request per frame)
and `file` (everything inside one HTML file; each block of frames' full views is deflated and
unpacked in the browser only when a frame of it is opened).
"""

from __future__ import annotations

import base64
import re
import secrets
import zlib
from importlib import resources
from typing import Any

from jukebox.viewer.model import TapeView, comparison, dumps

# Frames per deflated block in a file: opening a frame unpacks its block only.
FILE_CHUNK = 200

_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026"}


def asset(name: str) -> str:
    return resources.files("jukebox.viewer").joinpath("assets", name).read_text("utf-8")


def csp(nonce: str, served: bool) -> str:
    """The page's policy: its own nonce'd script and style, images only as data: URLs, requests
    only back to the server that served it (none from a file)."""
    connect = "'self'" if served else "'none'"
    return (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
        f"img-src data:; connect-src {connect}; base-uri 'none'; form-action 'none'"
    )


def embed(value: Any) -> str:
    """JSON safe inside a script element: no `</script>`, no `<!--`, whatever the strings hold."""
    return dumps(value).translate(_ESCAPES)


def page_data(a: TapeView, b: TapeView | None, mode: str) -> dict[str, Any]:
    data: dict[str, Any] = {"mode": mode, "a": {"facts": a.facts(), "index": a.index()}}
    if b is not None:
        data["b"] = {"facts": b.facts(), "index": b.index()}
        data["comparison"] = comparison(a, b)
    return data


def render(data: dict[str, Any], served: bool) -> tuple[str, str]:
    """The page's HTML and the Content-Security-Policy it was made for."""
    nonce = secrets.token_urlsafe(18)
    policy = csp(nonce, served)
    html = asset("viewer.html")
    title = data["a"]["facts"]["label"]
    # One pass over the template: a value put in is never searched again, so a tape's text
    # can never become a placeholder.
    parts = {
        "{{CSP}}": policy,
        "{{TITLE}}": _text(f"jukebox view: {title}"),
        "{{NONCE}}": nonce,
        "{{CSS}}": asset("viewer.css"),
        "{{DATA}}": embed(data),
        "{{JS}}": asset("viewer.js"),
    }
    filled = re.sub(r"\{\{[A-Z]+\}\}", lambda m: parts[m.group(0)], html)
    return filled, policy


def _text(value: str) -> str:
    import html

    return html.escape(value, quote=True)


def file_details(view: TapeView) -> dict[str, Any]:
    """Every frame's full view for a file, in deflated blocks of FILE_CHUNK frames. A model
    call's request and response are dropped from its payload (its messages and reply are the
    same content, read), and each message is stored once however many later calls repeat it:
    a conversation grows by a message or two a call."""
    table: list[str] = []
    seen: dict[str, int] = {}
    chunks: list[str] = []
    block: list[dict[str, Any]] = []
    count = len(view.frames)
    for n in range(count):
        detail = view.detail(n)
        if "messages" in detail:
            refs = []
            for message in detail["messages"]:
                key = dumps(message)
                if key not in seen:
                    seen[key] = len(table)
                    table.append(key)
                refs.append(seen[key])
            detail["messages"] = refs
            payload = detail.get("payload") or {}
            for key in ("request", "response"):
                if key in payload:
                    payload[key] = "(in the messages and reply above)"
        block.append(detail)
        if len(block) == FILE_CHUNK or n == count - 1:
            chunks.append(_pack(dumps(block)))
            block = []
    return {"chunk": FILE_CHUNK, "chunks": chunks, "messages": _pack("[" + ",".join(table) + "]")}


def _pack(text: str) -> str:
    # zlib's format is what the browser's DecompressionStream("deflate") reads.
    return base64.b64encode(zlib.compress(text.encode("utf-8"), 9)).decode("ascii")


def write_file(a: TapeView, b: TapeView | None) -> str:
    """One self-contained HTML file: the page, the index, and every frame's full view."""
    data = page_data(a, b, "file")
    data["a"]["details"] = file_details(a)
    if b is not None:
        data["b"]["details"] = file_details(b)
    html, _ = render(data, served=False)
    return html
