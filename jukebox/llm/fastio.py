"""Socket reads and writes for the proxy's hot path, without trio's scheduling rounds when the
socket is ready.

`trio.SocketStream.send_all` and `receive_some` each yield to trio's scheduler (a checkpoint:
one pass of its run loop and an `epoll_wait`) even when the kernel takes or gives the bytes at
once, which is nearly always the case for a proxy on loopback: about 9 µs of CPU per call on
the dev VM, a dozen times per streamed model call. These try the system call first and go
through trio only when the socket would block, so a call waits (and yields) exactly when there
is something to wait for. They take the stream's file descriptor (`fileno`), which is a plain
TCP socket's: a TLS stream goes through trio as before.

Errors read as trio's: a reset or closed peer is `trio.BrokenResourceError`.
"""

from __future__ import annotations

import os

import trio


def fileno(stream: trio.abc.Stream) -> int | None:
    """The descriptor of a plain `trio.SocketStream`, or None (TLS, or anything else)."""
    if type(stream) is trio.SocketStream:
        return stream.socket.fileno()
    return None


async def write_all(stream: trio.abc.Stream, fd: int | None, data: bytes) -> None:
    """`stream.send_all(data)`: at once when the socket takes all of it."""
    if fd is None:
        await stream.send_all(data)
        return
    try:
        sent = os.write(fd, data)
    except BlockingIOError:
        sent = 0
    except OSError as error:  # EPIPE, ECONNRESET, EBADF (closed): as trio says them
        raise trio.BrokenResourceError(str(error)) from error
    if sent < len(data):
        await stream.send_all(memoryview(data)[sent:])


async def read_some(stream: trio.abc.Stream, fd: int | None, size: int) -> bytes:
    """`stream.receive_some(size)`: at once when bytes (or the end) are there already."""
    if fd is None:
        return bytes(await stream.receive_some(size))
    while True:
        try:
            return os.read(fd, size)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(fd)
        except OSError as error:
            raise trio.BrokenResourceError(str(error)) from error
