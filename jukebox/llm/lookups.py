"""Under `--net none`: the host names the agent tries to resolve, seen and refused.

The agent's private network has only loopback, so anything outside the proxy fails; what it
tried to reach was invisible. Most of it starts with a DNS lookup, sent to the nameservers of
`/etc/resolv.conf`. Inside the agent's namespace the booth answers at those addresses (a
loopback alias for each IPv4 nameserver that is not on loopback already): every query gets
`REFUSED` (the resolver then fails as it would with no network, at once), and each name once
gives a stderr line and a `note` frame (`event: lookup_refused`, `host`, and the sender when it
is a known one: litellm's price map, LangSmith, tiktoken's encodings, ...) with the switch that
turns it off (jukebox.llm.telemetry). A name is the agent's choice, and may carry a secret it
holds (its base URLs' path secret, the operator's keys in its environment): both the line and
the note show it through the booth's scrubber (`Scrubber.host`). Addresses used without a
lookup, and resolvers that do not read resolv.conf, are not seen. Where the namespace cannot
take the alias or the port (a booth without the privilege), nothing is watched and nothing
changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import select
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jukebox.display import progress
from jukebox.display.names import printable
from jukebox.llm.netns import PrivateNetwork

if TYPE_CHECKING:
    from jukebox.redact import Scrubber

RESOLV_CONF = "/etc/resolv.conf"
NOTE_EVENT = "lookup_refused"
_SIOCSIFADDR, _SIOCSIFNETMASK = 0x8916, 0x891C
_REFUSED = 5
_POLL_S = 0.2
MAX_HOSTS = 100  # names listed (stderr and notes) at most

# Hosts of known senders: (suffix, who, what turns it off).
KNOWN_HOSTS = (
    ("raw.githubusercontent.com", "litellm's model price map, fetched at import",
     "LITELLM_LOCAL_MODEL_COST_MAP=True"),
    ("smith.langchain.com", "LangSmith tracing", "LANGSMITH_TRACING=false"),
    ("langfuse.com", "Langfuse tracing", "unsetting LANGFUSE_PUBLIC_KEY"),
    ("posthog.com", "PostHog usage telemetry (Chroma, CrewAI and others use it)",
     "ANONYMIZED_TELEMETRY=False, or the library's own switch"),
    ("openaipublic.blob.core.windows.net", "tiktoken's encodings, downloaded at first use",
     "TIKTOKEN_CACHE_DIR pointing at encodings fetched beforehand"),
    ("huggingface.co", "the Hugging Face Hub", "HF_HUB_OFFLINE=1"),
    ("api.openai.com", "an OpenAI client that ignores OPENAI_BASE_URL, such as the Agents "
     "SDK's trace exporter", "OPENAI_AGENTS_DISABLE_TRACING=1, or a base_url from OPENAI_BASE_URL"),
    ("api.anthropic.com", "an Anthropic client that ignores ANTHROPIC_BASE_URL",
     "its base_url set from ANTHROPIC_BASE_URL"),
)  # fmt: skip


def nameservers(path: str = RESOLV_CONF) -> list[str]:
    """The IPv4 nameservers a resolver of the agent would ask."""
    out = []
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            words = line.split()
            if len(words) >= 2 and words[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    if ipaddress.ip_address(words[1]).version == 4 and words[1] not in out:
                        out.append(words[1])
    return out


def question(packet: bytes) -> str | None:
    """The name a DNS query asks for (its first question), or None for a malformed packet."""
    if len(packet) < 12 or packet[2] & 0x80:  # too short, or a response
        return None
    labels: list[str] = []
    at = 12
    while at < len(packet):
        size = packet[at]
        if size == 0:
            return ".".join(labels).lower() or "."
        if size > 63 or at + 1 + size > len(packet):
            return None
        labels.append(packet[at + 1 : at + 1 + size].decode("ascii", errors="replace"))
        at += 1 + size
    return None


def refusal(packet: bytes) -> bytes:
    """The REFUSED answer to a query: its id and question, no records."""
    end = 12
    while end < len(packet) and packet[end] != 0:
        end += 1 + packet[end]
    question_bytes = packet[12 : end + 5]  # the name, its terminator, type and class
    flags = 0x8000 | (packet[2] << 8 & 0x0100) | 0x0080 | _REFUSED
    return packet[:2] + struct.pack("!HHHHH", flags, 1, 0, 0, 0) + question_bytes


def sender(host: str) -> tuple[str, str] | None:
    for suffix, who, off in KNOWN_HOSTS:
        if host == suffix or host.endswith("." + suffix):
            return who, off
    return None


def warning(host: str) -> str:
    """The stderr line for a lookup; the name is the agent's, so it is escaped for a terminal."""
    known = sender(host)
    shown = printable(host)
    line = f"warning: the agent looked up {shown}, outside the proxy: under --net none, refused"
    if known is not None:
        line += f" ({known[0]}; {known[1]} turns it off)"
    return line


def _alias(address: str, index: int) -> None:
    """`address`/32 on a loopback alias (`lo:jbN`), in the calling thread's namespace."""
    name = f"lo:jb{index}".encode()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for request, value in ((_SIOCSIFADDR, address), (_SIOCSIFNETMASK, "255.255.255.255")):
            # struct ifreq: the name, then a sockaddr_in (its family in host byte order).
            sockaddr = struct.pack("=H", socket.AF_INET)
            sockaddr += struct.pack("!H4s8x", 0, socket.inet_aton(value))
            fcntl.ioctl(s.fileno(), request, struct.pack("16s16s", name, sockaddr))


def _bind(servers: list[str]) -> list[socket.socket]:
    socks = []
    for i, address in enumerate(servers):
        try:
            if not ipaddress.ip_address(address).is_loopback:
                _alias(address, i)
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((address, 53))
            socks.append(sock)
        except OSError:
            continue  # not allowed here: that nameserver stays unwatched
    return socks


class LookupWatch:
    """Answers and reports the agent's DNS lookups inside its private network."""

    def __init__(
        self,
        socks: list[socket.socket],
        record: Callable[[str, dict[str, Any]], Any],
        scrubber: Scrubber | None = None,
    ):
        self._socks = socks
        self._record = record
        self._scrubber = scrubber
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="jukebox-lookups", daemon=True)
        if socks:
            self._thread.start()

    @classmethod
    def start(
        cls,
        network: PrivateNetwork,
        record: Callable[[str, dict[str, Any]], Any],
        scrubber: Scrubber | None = None,
    ) -> LookupWatch:
        """`scrubber`: the booth's, read at each new name (it learns values after the start)."""
        return cls(network.call(_bind, nameservers()), record, scrubber)

    @property
    def watching(self) -> bool:
        return bool(self._socks)

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select(self._socks, [], [], _POLL_S)
            for sock in ready:
                with contextlib.suppress(OSError):
                    packet, peer = sock.recvfrom(4096)
                    host = question(packet)
                    if host is None:
                        continue
                    # Noted before the agent hears the refusal: an agent that exits on it
                    # would otherwise race the tape's closing, and the note could be lost.
                    self._seen_once(host)
                    sock.sendto(refusal(packet), peer)

    def _seen_once(self, host: str) -> None:
        if host in self._seen or len(self._seen) > MAX_HOSTS:
            return
        self._seen.add(host)
        known = sender(host)
        if self._scrubber is not None:
            host = self._scrubber.host(host)
        note: dict[str, Any] = {"event": NOTE_EVENT, "host": host}
        if len(self._seen) > MAX_HOSTS:  # an agent inventing names fills no tape nor terminal
            line = f"note: more than {MAX_HOSTS} names looked up; the others are not listed"
            note = {"event": NOTE_EVENT, "more": True}
        elif known is not None:
            line = warning(host)
            note.update(sender=known[0], off=known[1])
        else:
            line = warning(host)
        if line.startswith("note:"):
            progress.note(line)  # --quiet drops notes, never warnings
        else:
            print(f"jukebox: {line}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # a closed tape at shutdown loses only the note
            self._record("note", note)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        # A query the thread had not read yet (an agent whose resolver gave up under load, and
        # exited) is still a name the agent tried: noted, never dropped with the socket.
        for sock in self._socks:
            with contextlib.suppress(OSError):
                while True:
                    packet, _ = sock.recvfrom(4096, socket.MSG_DONTWAIT)
                    host = question(packet)
                    if host is not None:
                        self._seen_once(host)
        for sock in self._socks:
            sock.close()
