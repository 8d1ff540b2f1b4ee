"""The agent's private network under `--net none`: a namespace with only loopback, in which the
proxy listens, so the agent reaches the proxy and nothing else.

The namespace is made by an anchor thread of the supervisor (network namespaces are per thread:
the proxy's own upstream connections stay on the host's network). The listening socket is
created in that thread, so it belongs to the agent's namespace while the proxy serves it from
its own thread. The agent is spawned from the anchor thread too, so it starts inside; the
anchor lives until `close()` because PR_SET_PDEATHSIG fires when the *thread* that forked a
child exits, and the exec shim arms it.
"""

from __future__ import annotations

import ctypes
import os
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from jukebox.booth import isolation
from shadowfs.libc import libc as _libc

T = TypeVar("T")

def setns(fd: int, nstype: int) -> None:
    if _libc.setns(fd, nstype) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class _Job:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class PrivateNetwork:
    """A fresh network namespace (loopback up, nothing else) owned by an anchor thread."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._ready = _Job(lambda: None)
        self._thread = threading.Thread(target=self._loop, name="jukebox-agent-net", daemon=True)
        self._thread.start()
        self._ready.done.wait()
        if self._ready.error is not None:
            self._thread.join()
            error = self._ready.error
            raise isolation.IsolationError(
                f"cannot create the agent's private network ({error}); run as root or where "
                "user namespaces are allowed, or use --net host"
            ) from error

    def _loop(self) -> None:
        try:
            isolation.unshare(isolation.CLONE_NEWNET)
            isolation._lo_up()
        except OSError as error:
            self._ready.error = error
            self._ready.done.set()
            return
        self._ready.done.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.result = job.fn()
            except BaseException as error:  # handed to the caller, re-raised there
                job.error = error
            job.done.set()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs `fn` in the anchor thread, inside the namespace; children it forks start there."""
        if not self._thread.is_alive():
            raise RuntimeError("the agent's private network is closed")
        job = _Job(lambda: fn(*args, **kwargs))
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def listen(self, host: str = "127.0.0.1", port: int = 0) -> socket.socket:
        def make() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            return sock

        return self.call(make)

    def close(self) -> None:
        """Ends the anchor thread; call it only once the children it spawned have exited."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
