"""Under `--net none` the booth sees the host names the agent resolves around the proxy: the
agent's real resolver (glibc, through /etc/resolv.conf) gets a refusal, the booth names the host
and, for a known sender, the switch that turns it off."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jukebox.llm.lookups import (
    MAX_HOSTS,
    LookupWatch,
    nameservers,
    question,
    refusal,
    sender,
    warning,
)
from jukebox.tape.tape import Tape
from shadowfs.store import Store

JUKEBOX = str(Path(sys.executable).parent / "jukebox")

# The agent resolves what litellm fetches at import and another host, each twice; a lookup
# that succeeded would print its address.
AGENT = """
import socket
for host in ("raw.githubusercontent.com", "example.org") * 2:
    try:
        print("resolved", host, socket.getaddrinfo(host, 443)[0][4])
    except socket.gaierror as error:
        print("refused", host, error.errno)
# An agent inventing names: listed up to a bound, then once as "more".
for i in range(120):
    try:
        socket.getaddrinfo(f"h{i}.example.org", 443)
    except socket.gaierror:
        pass
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="booths here run as root")
@pytest.mark.skipif(not nameservers(), reason="no IPv4 nameserver in /etc/resolv.conf")
def test_lookups_around_the_proxy_are_refused_and_named(tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    proc = subprocess.run(
        [JUKEBOX, "booth", "run", "--net", "none", "--tree", str(tree), "--tape-dir", str(tapes),
         "--tape-id", "dns", "--", sys.executable, "-c", AGENT],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "resolved" not in proc.stdout and proc.stdout.count("refused") == 4
    warned = [line for line in proc.stderr.splitlines() if "looked up" in line]
    assert len(warned) == MAX_HOSTS + 1  # once per host, up to the bound, then once for the rest
    assert "raw.githubusercontent.com" in warned[0] and "LITELLM_LOCAL_MODEL_COST_MAP" in warned[0]
    assert "more than 100 names looked up" in warned[-1]
    with Store.open(tapes / ".jukebox" / "store") as store:
        tape = Tape.load(tapes / "dns.jbx", store)
        notes = [f.payload for f in tape.frames if f.kind == "note"]
    refused = [n for n in notes if n.get("event") == "lookup_refused"]
    assert len(refused) == MAX_HOSTS + 1 and refused[-1] == {
        "event": "lookup_refused",
        "more": True,
    }
    assert [(n["host"], "sender" in n) for n in refused[:2]] == [
        ("raw.githubusercontent.com", True),
        ("example.org", False),
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="booths here run as root")
@pytest.mark.skipif(not nameservers(), reason="no IPv4 nameserver in /etc/resolv.conf")
def test_litellm_fetching_its_price_map_at_import_is_named(tmp_path: Path) -> None:
    """The real litellm, imported under --net none: its fetch of the price map is refused at
    once and named with its switch (its retries run in a thread the agent does not wait for)."""
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LITELLM_")}
    proc = subprocess.run(
        [JUKEBOX, "booth", "run", "--net", "none", "--tree", str(tree), "--tape-dir", str(tapes),
         "--tape-id", "litellm", "--", sys.executable, "-c", "import os, litellm; os._exit(0)"],
        capture_output=True, text=True, timeout=120, cwd="/", env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "looked up" in line]
    assert warned and "raw.githubusercontent.com" in warned[0]
    assert "litellm's model price map" in warned[0]
    assert "LITELLM_LOCAL_MODEL_COST_MAP=True" in warned[0]
    with Store.open(tapes / ".jukebox" / "store") as store:
        notes = [f.payload for f in Tape.load(tapes / "litellm.jbx", store).frames
                 if f.kind == "note" and f.payload.get("event") == "lookup_refused"]  # fmt: skip
    assert notes[0]["host"] == "raw.githubusercontent.com" and "sender" in notes[0]


def test_a_query_gets_a_refusal_with_its_id_and_question() -> None:
    # A query for example.org, type A, with recursion desired (as glibc sends it).
    query = bytes.fromhex("abcd01000001000000000000") + b"\x07example\x03org\x00\x00\x01\x00\x01"
    assert question(query) == "example.org"
    answer = refusal(query)
    assert answer[:2] == b"\xab\xcd" and answer[12:] == query[12:]
    assert answer[2:4] == bytes.fromhex("8185")  # a response, RD kept, RA, REFUSED
    assert question(answer) is None  # a response is no question
    assert question(b"\x00" * 12 + b"\x40") is None  # a label longer than DNS allows
    assert sender("api.smith.langchain.com") is not None and sender("smith.langchain.co") is None
    # A name is the agent's: a terminal escape in a label is shown, never sent to the terminal.
    hostile = bytes.fromhex("abcd01000001000000000000") + b"\x05\x1b[31m\x03org\x00\x00\x01\x00\x01"
    assert "\x1b" in question(hostile) and "\x1b" not in warning(question(hostile))


def _query(name: bytes) -> bytes:
    labels = b"".join(bytes([len(part)]) + part for part in name.split(b"."))
    return bytes.fromhex("abcd01000001000000000000") + labels + b"\x00\x00\x01\x00\x01"


def test_a_query_still_unread_when_the_watch_closes_is_noted() -> None:
    """An agent whose resolver gave up (a loaded machine) and exited leaves its query unread in
    the socket when the booth closes the watch: the name is still noted, not dropped with it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    entered, release = threading.Event(), threading.Event()
    notes: list[str] = []

    def record(kind: str, payload: dict) -> None:
        if not entered.is_set():
            entered.set()
            assert release.wait(30)  # the watch's thread held in its first note
        notes.append(payload["host"])

    watch = LookupWatch([sock], record)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as agent:
        agent.sendto(_query(b"first.example.org"), sock.getsockname())
        assert entered.wait(30)
        agent.sendto(_query(b"second.example.org"), sock.getsockname())
        closer = threading.Thread(target=watch.close)
        closer.start()
        while not watch._stop.is_set():  # close has begun: the thread ends after its note
            time.sleep(0.001)
        release.set()
        closer.join(30)
    assert not closer.is_alive()
    assert notes == ["first.example.org", "second.example.org"]
    assert sock.fileno() == -1  # closed with the watch
