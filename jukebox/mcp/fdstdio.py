"""The agent's side of `jukebox mcp wrap`: the same streams as the SDK's `stdio_server`, without
its worker threads.

The SDK reads stdin and writes stdout through `anyio.wrap_file`: every line read, every write and
every flush is a hop to a worker thread and back, three per tool call, which was the largest
share of what the gateway added to a call (docs/mcp.md, "Speed"). When stdin and stdout are
pipes or sockets (as an MCP client starts a stdio server), they are read and written here
non-blocking on the event loop instead; anything else (a terminal, a file) goes through the SDK's
own transport. The messages are parsed and serialized by the SDK's own models, as there.

As the SDK does, fd 0 reads the null device and fd 1 goes to stderr while serving, so a stray
print cannot corrupt the wire; both are restored at the end.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel

CHUNK = 1 << 16


def _streamable(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@contextlib.asynccontextmanager
async def agent_stdio() -> AsyncIterator[tuple[Any, Any]]:
    """(read stream, write stream) of SessionMessages over this process's stdin and stdout."""
    from mcp.server.stdio import stdio_server

    if not (_streamable(0) and _streamable(1)):
        async with stdio_server() as streams:
            yield streams
        return
    read_fd, write_fd = os.dup(0), os.dup(1)
    saved_in, saved_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    try:
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        async with _serve(read_fd, write_fd) as streams:
            yield streams
    finally:
        # The pipes' open file descriptions may be shared with other processes: leave them
        # blocking, as they came.
        for fd in (read_fd, write_fd):
            with contextlib.suppress(OSError):
                os.set_blocking(fd, True)
        os.dup2(saved_in, 0)
        os.dup2(saved_out, 1)
        for fd in (saved_in, saved_out, read_fd, write_fd):
            os.close(fd)


@contextlib.asynccontextmanager
async def _serve(read_fd: int, write_fd: int) -> AsyncIterator[tuple[Any, Any]]:
    import mcp_types as types
    from mcp.shared._context_streams import create_context_streams
    from mcp.shared.message import SessionMessage

    read_writer, read_stream = create_context_streams[SessionMessage | Exception](0)
    write_stream, write_reader = create_context_streams[SessionMessage](0)

    async def reader() -> None:
        pending = bytearray()
        async with read_writer:
            while True:
                try:
                    chunk = os.read(read_fd, CHUNK)
                except BlockingIOError:
                    await anyio.wait_readable(read_fd)
                    continue
                if not chunk:
                    return  # the agent closed its end
                start = len(pending)
                pending += chunk
                at = pending.find(b"\n", start)
                while at >= 0:
                    line = bytes(pending[:at])
                    del pending[: at + 1]
                    if line.strip():
                        message: Any
                        try:
                            message = SessionMessage(
                                types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                            )
                        except Exception as error:  # the SDK's session answers a bad line
                            message = error
                        try:
                            await read_writer.send(message)
                        except anyio.ClosedResourceError:
                            return
                    at = pending.find(b"\n")

    async def writer() -> None:
        async with write_reader:
            async for message in write_reader:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                view = memoryview((data + "\n").encode())
                while view:
                    try:
                        view = view[os.write(write_fd, view) :]
                    except BlockingIOError:
                        await anyio.wait_writable(write_fd)
                    except BrokenPipeError:
                        return  # the agent is gone: nothing more can reach it

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(reader)
        tasks.start_soon(writer)
        yield read_stream, write_stream
