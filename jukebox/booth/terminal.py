"""The agent's own pseudo-terminal, relayed to the operator's terminal by the supervisor.

An agent that held the operator's terminal could push input into it (TIOCSTI: a command the
operator's shell runs once `jukebox` returns, or the `y` of `--commit ask`), hang it up
(vhangup) or read what the operator types. So the agent never gets it: CMD runs in a session
of its own (isolation's exec shim calls setsid), and when any of the caller's stdin, stdout or
stderr is a terminal, the supervisor opens a new pty whose follower side replaces each of
those fds and becomes CMD's controlling terminal. Everything the agent can do to "its"
terminal then lands on that pty; the supervisor alone touches the operator's.

The relay, a thread of the supervisor:

* copies the pty's output to the operator's terminal, and the operator's keystrokes to the pty;
* puts the operator's terminal in raw mode while an interactive agent runs (stdin is a terminal
  and the booth is its foreground job), so Ctrl-C, Ctrl-Z and Ctrl-\\ travel as bytes and the
  pty's line discipline turns them into the agent's own terminal signals, sent to the agent's
  foreground process group; the operator's settings come back on every way out of `relayed`.
  (CMD leads its session, so its own process group is orphaned: the kernel drops a Ctrl-Z
  aimed at it unless it handles SIGTSTP, as for any login shell; a job-control shell running
  as the agent suspends its jobs as usual. The booth itself is not suspended.)
* counts the interrupt characters (VINTR, Ctrl-C) typed while the agent's terminal generates
  signals, so the supervisor can treat them as it treats a Ctrl-C it receives itself;
* takes window sizes over (`resize`, which the supervisor calls on SIGWINCH), and sends the
  signals the supervisor is asked to pass on through the pty (`send_signal`: TIOCSIG), so they
  too reach the agent's foreground job as terminal signals;
* when the agent is gone, drains what it wrote, then closes the pty: nothing inside the booth
  can write to a terminal while the booth asks its question;
* asks the operator a question while the agent runs (`ask`: an MCP tool call the policy says to
  ask about): the keys typed from then until Enter are the answer, echoed by the relay and never
  passed to the agent.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import struct
import sys
import termios
import threading
import tty
from collections.abc import Callable, Iterator

from jukebox.errors import JukeboxError

STDIO = (0, 1, 2)
# TIOCSIG on a pty's leader sends a signal to the follower's foreground process group, as a
# typed Ctrl-C would (_IOW('T', 0x36, int); Python's termios module does not name it).
TIOCSIG = 0x40045436
# Once the agent is gone, how long the relay waits for more output from a pty somebody still
# holds open (a descriptor passed out of the booth) before it closes the pty under them.
DRAIN_IDLE_S = 1.0
# While the follower is closed (the agent closed or hung up its terminal), how often the relay
# looks whether it was opened again.
REOPEN_POLL_S = 0.2
WINSIZE = struct.Struct("HHHH")
DISABLED = b"\0"  # _POSIX_VDISABLE: a control character switched off


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _in_foreground(fd: int) -> bool:
    """Whether this process's group owns the terminal on `fd` (a background job that set it
    raw would be stopped with SIGTTOU, one that read it with SIGTTIN)."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


def _copy_winsize(source: int, target: int) -> None:
    with contextlib.suppress(OSError):
        size = fcntl.ioctl(source, termios.TIOCGWINSZ, bytes(WINSIZE.size))
        fcntl.ioctl(target, termios.TIOCSWINSZ, size)


class TerminalError(JukeboxError):
    """The agent's pty could not be made; the booth does not start."""


class AgentTerminal:
    """A pty for the agent, standing in for each of the caller's stdio fds that is a terminal."""

    def __init__(self, tty_fds: list[int]) -> None:
        self.tty_fds = tty_fds
        self._operator = tty_fds[0]
        self._out = next((fd for fd in (1, 2) if fd in tty_fds), None)
        self.interactive = 0 in tty_fds and _in_foreground(0)
        try:
            self.master, self._follower = os.openpty()
        except OSError as error:
            # Never a fallback to the caller's terminal: that is what the pty is there to avoid.
            raise TerminalError(
                f"cannot open a pseudo-terminal for the agent ({error.strerror}): free some "
                "ptys (see /proc/sys/kernel/pty/nr and max), or run the booth with its stdin, "
                "stdout and stderr redirected away from the terminal"
            ) from None
        self._saved: list | None = None  # the operator's settings while raw
        with contextlib.suppress(termios.error):
            # The agent's terminal starts as the operator's is (the shell's cooked settings).
            termios.tcsetattr(self._follower, termios.TCSANOW, termios.tcgetattr(self._operator))
        _copy_winsize(self._operator, self.master)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._draining = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._on_interrupt: Callable[[], None] = lambda: None
        # Sees everything the agent prints on its terminal (jukebox.booth.view_denials keeps a
        # tail).
        self.on_output: Callable[[bytes], None] | None = None
        # A question being asked (`ask`): [text, shown yet, the line typed so far, done event].
        self._question: list | None = None
        self._answer: str | None = None
        self._ask_lock = threading.Lock()

    @classmethod
    def for_caller(cls) -> AgentTerminal | None:
        """A pty when any of this process's stdin, stdout or stderr is a terminal, else None."""
        tty_fds = [fd for fd in STDIO if _isatty(fd)]
        return cls(tty_fds) if tty_fds else None

    def stdio(self) -> dict[str, int | None]:
        """The agent's stdin/stdout/stderr for `isolation.spawn`: the pty's follower in place
        of each terminal, None (inherited as they are) for the rest."""
        names = ("stdin", "stdout", "stderr")
        return {
            name: self._follower if fd in self.tty_fds else None
            for name, fd in zip(names, STDIO, strict=True)
        }

    def start(self, on_interrupt: Callable[[], None]) -> None:
        """After the agent was spawned: drop our copy of the follower, go raw, start relaying."""
        os.close(self._follower)
        self._follower = -1
        self._on_interrupt = on_interrupt
        os.set_blocking(self.master, False)
        if self.interactive:
            with contextlib.suppress(termios.error):
                self._saved = termios.tcgetattr(0)
                tty.setraw(0, termios.TCSADRAIN)
        self._thread = threading.Thread(target=self._relay, name="jukebox-tty", daemon=True)
        self._thread.start()

    def resize(self) -> None:
        """The operator's window changed (SIGWINCH): the agent's follows, and its foreground
        job gets SIGWINCH from the kernel."""
        _copy_winsize(self._operator, self.master)

    def send_signal(self, sig: int) -> bool:
        """Sends `sig` to the agent's foreground process group through its terminal; False when
        the pty cannot (the agent hung it up)."""
        try:
            fcntl.ioctl(self.master, TIOCSIG, sig)
        except OSError:
            return False
        return True

    def notice(self, message: str) -> None:
        """A supervisor's line on stderr, readable while the operator's terminal is raw."""
        end = "\r\n" if self._saved is not None else "\n"
        sys.stderr.write(f"jukebox: {message}{end}")
        sys.stderr.flush()

    def ask(self, question: str, wait: float) -> str | None:
        """Asks the operator `question` on their terminal while the agent runs; the line they
        type (Ctrl-C: an empty one), or None when there is no one to ask here (stdin is no
        terminal, or not the booth's to read) or nobody answered within `wait` seconds. One
        question at a time; the keys typed meanwhile go to the answer, not to the agent."""
        if not self.interactive or self._thread is None or self._stopping:
            return None
        with self._ask_lock:
            done = threading.Event()
            self._answer = None
            self._question = [question, False, b"", done]
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
            answered = done.wait(wait)
            self._question = None
            if not answered:
                self._say(b"\r\n(no answer in time)\r\n")
            return self._answer if answered else None

    def _say(self, data: bytes) -> None:
        fd = self._out if self._out is not None else 2
        with contextlib.suppress(OSError):
            os.write(fd, data)

    def _answering(self, typed: bytes) -> None:
        """Keys typed while a question is asked: echoed, edited, ended by Enter."""
        question = self._question
        if question is None:
            return
        for byte in typed:
            key = bytes([byte])
            if key in (b"\r", b"\n", b"\x03"):
                line = b"" if key == b"\x03" else question[2]
                self._answer = line.decode(errors="replace").strip()
                self._say(b"\r\n")
                question[3].set()
                return
            if key in (b"\x7f", b"\x08"):
                if question[2]:
                    question[2] = question[2][:-1]
                    self._say(b"\x08 \x08")
            elif byte >= 0x20:
                question[2] += key
                self._say(key)

    def close(self, *, drain: bool) -> None:
        """Ends the relay (after draining the agent's last output when `drain`), closes the pty
        and gives the operator's terminal its settings back."""
        question = self._question
        if question is not None:  # the agent is gone: nobody waits for the answer any more
            question[3].set()
        try:
            if self._thread is not None:
                self._draining = drain
                self._stopping = not drain
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")
                self._thread.join()
        finally:
            for fd in (self._follower, self.master, self._wake_r, self._wake_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._follower = self.master = self._wake_r = self._wake_w = -1
            self._restore()

    def _restore(self) -> None:
        if self._saved is not None:
            saved, self._saved = self._saved, None
            with contextlib.suppress(termios.error):
                termios.tcsetattr(0, termios.TCSADRAIN, saved)

    # ------------------------------------------------------------------ the relay thread

    def _relay(self) -> None:
        reading = self.interactive
        follower_open = True
        pending = b""  # typed, not yet taken by the pty (the agent does not read its input)
        while not self._stopping:
            readers = [self._wake_r]
            if follower_open or self._draining:
                readers.append(self.master)
            if reading and not self._draining:
                readers.append(0)
            writers = [self.master] if pending and not self._draining else []
            timeout = DRAIN_IDLE_S if self._draining else None if follower_open else REOPEN_POLL_S
            readable, writable, _ = select.select(readers, writers, [], timeout)
            if self._wake_r in readable:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 64)
                question = self._question
                if question is not None and not question[1]:
                    question[1] = True
                    self._say(b"\r\njukebox: " + question[0].encode(errors="replace") + b" ")
                continue  # look at the flags again
            if not readable and not writable:
                if self._draining:
                    return  # somebody outside still holds the pty: stop waiting for them
                follower_open = True  # see whether the agent opened its terminal again
                continue
            if self.master in readable:
                try:
                    data = os.read(self.master, 65536)
                except BlockingIOError:
                    data = None
                except OSError as error:
                    if error.errno != errno.EIO:
                        raise
                    data = b""
                if data == b"":
                    # EIO: nobody holds the follower. At the end that is the end of the
                    # output; during the run the agent closed or hung up its terminal.
                    if self._draining:
                        return
                    follower_open = False
                elif data:
                    self._show(data)
            if 0 in readable:
                try:
                    typed = os.read(0, 4096)
                except OSError:
                    typed = b""
                if not typed:  # the operator's terminal went away
                    reading = False
                elif self._question is not None:
                    self._answering(typed)
                else:
                    self._count_interrupts(typed)
                    pending += typed
            if self.master in writable:
                try:
                    pending = pending[os.write(self.master, pending) :]
                except BlockingIOError:
                    pass
                except OSError:  # hung up: what was typed has nowhere to go
                    pending = b""

    def _show(self, data: bytes) -> None:
        if self.on_output is not None:
            self.on_output(data)
        if self._out is None:
            return  # only stdin is a terminal: the pty's output is its echo, shown nowhere
        with contextlib.suppress(OSError):
            view = memoryview(data)
            while view:
                view = view[os.write(self._out, view) :]

    def _count_interrupts(self, typed: bytes) -> None:
        try:
            attrs = termios.tcgetattr(self.master)  # on Linux: the follower's settings
        except termios.error:
            return
        if not attrs[3] & termios.ISIG:
            return  # the agent reads Ctrl-C as a key (its terminal is raw)
        interrupt = attrs[6][termios.VINTR]
        if interrupt != DISABLED:
            for _ in range(typed.count(interrupt)):
                self._on_interrupt()


@contextlib.contextmanager
def relayed(term: AgentTerminal | None) -> Iterator[AgentTerminal | None]:
    """Closes `term` on the way out: drained when the block ended normally (the agent is
    gone), at once on an exception; the operator's terminal settings are restored either way."""
    if term is None:
        yield None
        return
    try:
        yield term
    except BaseException:
        term.close(drain=False)
        raise
    term.close(drain=True)


def send_to_agent(term: AgentTerminal | None, pid: int, sig: int) -> None:
    """Passes a signal the supervisor received on to the agent: a terminal signal through the
    agent's own terminal (its foreground job gets it, as from a typed key), anything else, or
    when there is no terminal, to the exec shim, which relays it to CMD."""
    terminal_signals = (signal.SIGINT, signal.SIGQUIT)
    if term is not None and sig in terminal_signals and term.send_signal(sig):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
