"""The proxy a booth starts: its socket listening from the start, the proxy itself started by
the first connection.

The recording proxy (jukebox.llm.server) stands on trio, httpx and h11, and its price catalogue
on pydantic: about 600 modules, most of a booth's start-up when imported there, and wasted on
every booth whose agent never calls a model (`jukebox booth run -- make test`). So the booth
gives its agent the proxy's base URLs at once, from a socket bound here with the standard
library, and a thread waits for that socket to become readable. The first connection (an
agent's first model call) starts the real proxy on the same socket and with the same secret:
the connection waits in the listen backlog meanwhile, so the agent sees one slower first call
(the imports, once per booth) and nothing else changes: the same URLs, the same secret, the
same frames.

`Standby.stop()` stops the proxy when it started, else only closes the socket; nothing of the
proxy is imported in that case.
"""

from __future__ import annotations

import binascii
import contextlib
import os
import select
import socket
import sys
import threading
from collections.abc import Callable, Mapping

from jukebox.llm.upstreams import proxy_env

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any

_URLSAFE = bytes.maketrans(b"+/", b"-_")  # base64's URL-safe alphabet


class Standby:
    """Stands in for a ProxyServer until its first connection.

    `make(sock, secret, secrets)` builds the proxy (not started) on the listening socket, with
    `secrets` (values learned since, `add_secrets`) to scrub besides its own; it runs on the
    standby's thread. `protocols` are the named upstreams' (jukebox.llm.upstreams.resolve), so
    `base_urls()` is the proxy's own without building it."""

    def __init__(
        self,
        make: Callable[[socket.socket, str, list[str]], Any],
        protocols: Mapping[str, str],
        sock: socket.socket | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self._make = make
        self.protocols = dict(protocols)
        self.named = sorted(self.protocols)
        # secrets.token_urlsafe(32) without importing secrets (hmac, hashlib, random: ~20 M
        # instructions of a booth's start): the same 32 bytes of os.urandom, the same encoding.
        # base64.urlsafe_b64encode's output, without importing base64 at a booth's start.
        encoded = binascii.b2a_base64(os.urandom(32), newline=False).translate(_URLSAFE)
        self.secret = encoded.rstrip(b"=").decode("ascii")
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
        sock.listen(128)
        self._sock = sock
        self.host, self.port = sock.getsockname()[:2]
        # The agent's environment, handed to the proxy when it starts (see ProxyServer).
        self.agent_environ: Mapping[str, str] = os.environ
        self.proxy: Any = None  # the ProxyServer, once the first connection started it
        self._secrets: list[str] = []  # `add_secrets`' values, for a proxy not started yet
        self._made: Any = None  # the proxy, from its making on (`proxy` once it has started)
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The root every request goes under, secret included: hand it to the agent only."""
        return f"http://{self.host}:{self.port}/{self.secret}"

    def base_urls(self) -> dict[str, str]:
        return proxy_env(self.url, self.protocols)

    def add_secrets(self, values: list[str]) -> None:
        """Values the proxy scrubs from what it records, besides those it was made with: to
        the running proxy's scrubber, or kept for its start."""
        with self._lock:
            self._secrets += values
            made = self._made
        if made is not None:
            made.scrubber.add(values)

    def start(self) -> Standby:
        self._thread = threading.Thread(target=self._wait, name="jukebox-llm-standby", daemon=True)
        self._thread.start()
        return self

    def _wait(self) -> None:
        waiting: list[Any] = [self._sock, self._wake_r]  # a socket and a pipe's fd
        readable, _, _ = select.select(waiting, [], [])
        if self._stopping or self._sock not in readable:
            return
        try:
            with self._lock:  # a value added from now on goes to the proxy's own scrubber
                proxy = self._made = self._make(self._sock, self.secret, list(self._secrets))
            proxy.agent_environ = self.agent_environ
            self.proxy = proxy.start()
        except Exception as error:  # the agent's calls then fail to connect; the booth goes on
            print(f"jukebox: the LLM proxy could not start: {error}", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                self._sock.close()

    def stop(self) -> None:
        """Stops the proxy (after a start in progress has finished) or closes the socket."""
        self._stopping = True
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join()
            self._thread = None
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        with contextlib.suppress(OSError):
            self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
