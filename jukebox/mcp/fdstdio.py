"""Newline-delimited JSON-RPC over pipes, read and written non-blocking on the event loop: the
agent's side of `jukebox mcp wrap` (this process's stdin and stdout) and the real server's (its
stdin and stdout, jukebox.mcp.relay).

The SDK reads stdin and writes stdout through `anyio.wrap_file`: every line read, every write and
every flush is a hop to a worker thread and back, three per tool call, which was the largest
share of what the gateway added to a call (docs/mcp.md, "Speed"). When stdin and stdout are
pipes or sockets (as an MCP client starts a stdio server), they are read and written here
instead; anything else (a terminal, a file) goes through the SDK's own transport. The messages
the SDK's sessions see are parsed and serialized by the SDK's own models, as there; a line an
`intercept` takes (jukebox.mcp.relay: a tool call relayed as it came) never becomes one.

As the SDK does, fd 0 reads the null device and fd 1 goes to stderr while serving, so a stray
print cannot corrupt the wire; both are restored at the end.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

CHUNK = 1 << 16

# intercept(line) -> whether it took the line (then no SDK session sees it).
Intercept = Callable[[bytes], Awaitable[bool]]


class LinePipe:
    """Lines read from `read_fd` and written to `write_fd`, both non-blocking. Writers take
    turns: a line is written whole before the next one starts."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._writing: anyio.Event | None = None
        self.broken = False  # the reader of write_fd is gone

    async def lines(self) -> AsyncIterator[bytes]:
        """Each line, without its newline, until the other end closes."""
        pending = bytearray()
        while True:
            try:
                chunk = os.read(self.read_fd, CHUNK)
            except BlockingIOError:
                await anyio.wait_readable(self.read_fd)
                continue
            if not chunk:
                return
            start = len(pending)
            pending += chunk
            at = pending.find(b"\n", start)
            while at >= 0:
                line = bytes(pending[:at])
                del pending[: at + 1]
                if line.strip():
                    yield line
                at = pending.find(b"\n")

    async def write(self, data: bytes) -> bool:
        """Writes `data` whole; False when nobody reads the other end any more."""
        while self._writing is not None:
            await self._writing.wait()
        if self.broken:
            return False
        try:
            done = os.write(self.write_fd, data)
        except BlockingIOError:
            done = 0
        except OSError:  # EPIPE: the reader is gone; EBADF: this side was closed
            self.broken = True
            return False
        if done == len(data):
            return True
        # The pipe is full: the rest waits for room, and the other writers for this one.
        self._writing = turn = anyio.Event()
        try:
            view = memoryview(data)[done:]
            while view:
                try:
                    view = view[os.write(self.write_fd, view) :]
                except BlockingIOError:
                    await anyio.wait_writable(self.write_fd)
                except OSError:
                    self.broken = True
                    return False
            return True
        finally:
            self._writing = None
            turn.set()

    def restore_blocking(self) -> None:
        # The pipes' open file descriptions may be shared with other processes: leave them
        # blocking, as they came.
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.set_blocking(fd, True)


@contextlib.asynccontextmanager
async def session_streams(
    pipe: LinePipe, intercept: Intercept | None = None,
    at_end: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[tuple[Any, Any]]:  # fmt: skip
    """(read stream, write stream) of the SDK's SessionMessages over `pipe`; `at_end()` runs
    when the other end has closed its side."""
    import mcp_types as types
    from mcp.shared._context_streams import create_context_streams
    from mcp.shared.message import SessionMessage

    read_writer, read_stream = create_context_streams[SessionMessage | Exception](0)
    write_stream, write_reader = create_context_streams[SessionMessage](0)

    async def reader() -> None:
        async with read_writer:
            try:
                async for line in pipe.lines():
                    if intercept is not None and await intercept(line):
                        continue
                    message: Any
                    try:
                        message = SessionMessage(
                            types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                        )
                    except Exception as error:  # the SDK's session answers a bad line
                        message = error
                    try:
                        await read_writer.send(message)
                    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                        return  # the session is gone
            finally:
                if at_end is not None:
                    with anyio.CancelScope(shield=True):
                        await at_end()

    async def writer() -> None:
        async with write_reader:
            async for message in write_reader:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                if not await pipe.write((data + "\n").encode()):
                    return  # nothing more can reach the other end

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(reader)
        tasks.start_soon(writer)
        try:
            yield read_stream, write_stream
        finally:
            tasks.cancel_scope.cancel()


def _streamable(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@contextlib.asynccontextmanager
async def agent_stdio(
    intercept: Intercept | None = None,
) -> AsyncIterator[tuple[Any, Any, LinePipe | None]]:
    """(read stream, write stream, pipe) over this process's stdin and stdout; the pipe, which
    `intercept` may answer on, is None when they are not pipes (the SDK's transport serves)."""
    from mcp.server.stdio import stdio_server

    if not (_streamable(0) and _streamable(1)):
        async with stdio_server() as (read, write):
            yield read, write, None
        return
    read_fd, write_fd = os.dup(0), os.dup(1)
    saved_in, saved_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    pipe: LinePipe | None = None
    try:
        pipe = LinePipe(read_fd, write_fd)
        async with session_streams(pipe, intercept) as (read, write):
            yield read, write, pipe
    finally:
        if pipe is not None:
            pipe.restore_blocking()
        os.dup2(saved_in, 0)
        os.dup2(saved_out, 1)
        for fd in (saved_in, saved_out, read_fd, write_fd):
            os.close(fd)
