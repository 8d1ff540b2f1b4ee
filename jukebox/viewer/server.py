"""The viewer's HTTP server: the standard library's, on loopback only.

`GET /` is the page (built once, the index inside); `GET /api/frame/a/N` (and `/b/N` for the
fork beside it) is frame N in full, built when asked and kept for the next time. Nothing else
is served; only GET and HEAD are answered.

A page on some web site the user visits can make the browser send requests to 127.0.0.1, and
with DNS rebinding read the answers: every request must name this server by its loopback
address in its Host header (the browser's own, which a rebinding page cannot forge), or it
gets 403.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jukebox.viewer.model import TapeView, dumps

# Frames' full views kept: a person clicks back and forth among a few.
CACHED_FRAMES = 256

_FRAME_PATH = re.compile(r"/api/frame/([ab])/([0-9]{1,9})")


class ViewerServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, page: str, policy: str, views: dict[str, TapeView], port: int = 0) -> None:
        self.page = page.encode("utf-8")
        self.policy = policy
        self.views = views
        # Tapes and the store are read by one request at a time.
        self.lock = threading.Lock()
        self.cache: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        super().__init__(("127.0.0.1", port), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """socketserver prints a traceback for any error in a request; a browser that closed a
        tab or cancelled a fetch resets its connection, which is no error of ours."""
        import sys

        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | TimeoutError):
            return
        print(f"jukebox view: a request failed: {type(error).__name__}: {error}", file=sys.stderr)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def frame_json(self, side: str, n: int) -> bytes | None:
        view = self.views.get(side)
        if view is None or not 0 <= n < len(view.frames):
            return None
        with self.lock:
            body = self.cache.get((side, n))
            if body is None:
                body = dumps(view.detail(n)).encode("utf-8")
                self.cache[(side, n)] = body
                while len(self.cache) > CACHED_FRAMES:
                    self.cache.popitem(last=False)
            else:
                self.cache.move_to_end((side, n))
        return body


class _Handler(BaseHTTPRequestHandler):
    server: ViewerServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the terminal shows the URL and nothing per request."""

    def _host_ok(self) -> bool:
        port = self.server.port
        return self.headers.get("Host", "") in (f"127.0.0.1:{port}", f"localhost:{port}")

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        if not self._host_ok():
            self._send(403, b"forbidden: open the viewer at its 127.0.0.1 URL\n", "text/plain")
            return
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(200, self.server.page, "text/html; charset=utf-8", head)
            return
        match = _FRAME_PATH.fullmatch(path)
        body = self.server.frame_json(match[1], int(match[2])) if match else None
        if body is None:
            self._send(404, b"not found\n", "text/plain", head)
            return
        self._send(200, body, "application/json; charset=utf-8", head)

    def _send(self, status: int, body: bytes, kind: str, head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        # frame-ancestors works only as a header (a meta policy ignores it): no framing.
        self.send_header("Content-Security-Policy", self.server.policy + "; frame-ancestors 'none'")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _refuse(self) -> None:
        self._send(405, b"only GET\n", "text/plain")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse
