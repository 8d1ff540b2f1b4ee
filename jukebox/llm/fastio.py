"""Socket reads and writes for the proxy's hot path, without trio's scheduling rounds when the
socket is ready.

`trio.SocketStream.send_all` and `receive_some` each yield to trio's scheduler (a checkpoint:
one pass of its run loop and an `epoll_wait`) even when the kernel takes or gives the bytes at
once, which is nearly always the case for a proxy on loopback: about 9 µs of CPU per call on
the dev VM, a dozen times per streamed model call. These try the system call first and go
through trio only when the socket would block, so a call waits (and yields) exactly when there
is something to wait for. They take the stream's file descriptor (`fileno`), which is a plain
TCP socket's: a TLS stream goes through trio as before.

`spin_read` and `read_spun` poll a socket for a bounded time (`Spin`, jukebox.spin) before the
caller sleeps on it: a sleep in `epoll_wait` costs a wake-up, which on these VMs costs more than
most of the proxy's code.

Errors read as trio's: a reset or closed peer is `trio.BrokenResourceError`.
"""

from __future__ import annotations

import os
import time

import trio

from jukebox.spin import Spin


def fileno(stream: trio.abc.Stream) -> int | None:
    """The descriptor of a plain `trio.SocketStream`, or None (TLS, or anything else)."""
    if type(stream) is trio.SocketStream:
        return stream.socket.fileno()
    return None


def try_write(fd: int | None, data: bytes) -> int:
    """How much of `data` the socket took at once, without waiting (0 for no descriptor).
    A caller that would put a deadline around a write needs one only when this falls short:
    a trio cancel scope costs more than the write on loopback."""
    if fd is None:
        return 0
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as error:  # EPIPE, ECONNRESET, EBADF (closed): as trio says them
        raise trio.BrokenResourceError(str(error)) from error


def try_read(fd: int | None, size: int) -> bytes | None:
    """Up to `size` bytes already there (b"" at the end), or None when a read would wait."""
    if fd is None:
        return None
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None
    except OSError as error:
        raise trio.BrokenResourceError(str(error)) from error


async def write_all(stream: trio.abc.Stream, fd: int | None, data: bytes) -> None:
    """`stream.send_all(data)`: at once when the socket takes all of it."""
    sent = try_write(fd, data)
    if sent < len(data):
        await stream.send_all(memoryview(data)[sent:] if sent else data)


async def read_some(
    stream: trio.abc.Stream, fd: int | None, size: int, *, wait_first: bool = False
) -> bytes:
    """`stream.receive_some(size)`: at once when bytes (or the end) are there already.
    `wait_first`: the caller has just found nothing there (`try_read`), so the read that
    would fail is not tried again before waiting."""
    if fd is None:
        return bytes(await stream.receive_some(size))
    if wait_first:
        await trio.lowlevel.wait_readable(fd)
    while True:
        data = try_read(fd, size)
        if data is not None:
            return data
        await trio.lowlevel.wait_readable(fd)


def spin_read(fd: int, size: int, budget_ns: int) -> bytes | None:
    """`try_read` again and again for up to `budget_ns`, yielding the CPU between tries (to a
    process on the same CPU that has the answer to write): the bytes, or None when the budget
    ran out. Blocks the event loop meanwhile: callers spin only while no other call is served."""
    end = time.monotonic_ns() + budget_ns
    read, pause, now = os.read, os.sched_yield, time.monotonic_ns
    while True:
        try:
            return read(fd, size)
        except BlockingIOError:
            pass
        except OSError as error:
            raise trio.BrokenResourceError(str(error)) from error
        if now() >= end:
            return None
        pause()


async def read_spun(
    stream: trio.abc.Stream, fd: int | None, size: int, spin: Spin, may_spin: bool = True
) -> bytes:
    """`read_some`, with a poll of up to `spin`'s budget before sleeping when nothing is
    there yet; the wait, if any, teaches `spin`."""
    data = try_read(fd, size)
    if data is not None or fd is None:
        return data if data is not None else await read_some(stream, fd, size)
    started = time.monotonic_ns()
    if may_spin and spin.budget_ns:
        data = spin_read(fd, size, spin.budget_ns)
    if data is None:
        data = await read_some(stream, fd, size, wait_first=True)
    spin.observed(time.monotonic_ns() - started)
    return data
