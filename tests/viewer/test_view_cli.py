"""`jukebox view` as a command and a server: bad input refused in one line, the server reachable
only on 127.0.0.1 and only by its own name (a DNS-rebinding page is refused), nothing but the
page and the frames served, and Ctrl-C or SIGTERM stopping it cleanly."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import socket
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.viewer.conftest import Tapes, jukebox


def get(port: int, path: str, host: str | None = None, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def test_bad_input_is_one_line_and_exit_2(tapes: Tapes, tmp_path: Path) -> None:
    cases = [
        (("view", str(tmp_path / "nope.jbx")), "no tape at"),
        (("view", f"{tapes.rec}@3"), "drop the @3"),
        (("view", str(tapes.rec), "--compare", str(tmp_path / "gone.jbx")), "no tape at"),
        (("view", str(tapes.rec), "--port", "70000"), "70000"),
        (("view", str(tapes.rec), "--port", "8000", "--html", str(tmp_path / "x.html")), "one of"),
        (("view", str(tapes.rec), "--html", str(tmp_path / "no" / "x.html")), "No such file"),
    ]
    for args, says in cases:
        done = jukebox(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert says in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert "Traceback" not in done.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = jukebox("view", str(tapes.rec), "--port", str(port))
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert jukebox("view", "--help").returncode == 0


def test_the_server_answers_its_own_page_only(tapes: Tapes, serve: Any) -> None:
    server = serve(str(tapes.rec), "--compare", str(tapes.fork))
    port = server.port
    status, page = get(port, "/")
    assert status == 200 and b'id="jb-data"' in page
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/")
    answer = conn.getresponse()
    policy = answer.getheader("Content-Security-Policy") or ""
    conn.close()
    assert "default-src 'none'" in policy and "script-src 'nonce-" in policy
    assert "frame-ancestors 'none'" in policy and "connect-src 'self'" in policy
    assert answer.getheader("X-Content-Type-Options") == "nosniff"
    status, body = get(port, "/api/frame/a/2")
    assert status == 200 and json.loads(body)["kind"] == "llm_turn"
    assert "headers" not in json.loads(body)["payload"]
    status, body = get(port, "/api/frame/b/5")
    assert status == 200 and json.loads(body)["payload"]["model"] == "gpt-4.1"
    assert get(port, "/", host=f"localhost:{port}")[0] == 200
    # A page of another site, its name rebound to 127.0.0.1, reads nothing.
    for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1:{port + 1}", ""):
        status, body = get(port, "/api/frame/a/2", host=host)
        assert status == 403 and b"llm_turn" not in body, host
    for path in ("/api/frame/a/13", "/api/frame/c/1", "/api/frame/a/-1", "/../../etc/passwd",
                 "/api/frame/a/2/../../../etc/passwd", "/viewer.js", "/api"):  # fmt: skip
        assert get(port, path)[0] == 404, path
    assert get(port, "/", method="POST")[0] == 405
    # Bound to 127.0.0.1 alone: another loopback address, and the host's own, find nothing.
    addresses = {"127.0.0.2"}
    with contextlib.suppress(OSError):
        addresses.add(socket.gethostbyname(socket.gethostname()))
    for address in addresses - {"127.0.0.1"}:
        with pytest.raises(OSError), socket.create_connection((address, port), timeout=5):
            pass
    # A client gone mid-request (a tab closed) resets its connection: no error of ours.
    with socket.create_connection(("127.0.0.1", port)) as rude:
        rude.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        rude.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % port)
    assert get(port, "/api/frame/a/0")[0] == 200
    stopped = server.stop()  # SIGINT, as Ctrl-C sends
    assert stopped.returncode == 0 and stopped.stderr == "", stopped.stderr


def test_sigterm_stops_it_and_the_text_says_where(tapes: Tapes) -> None:
    import subprocess
    import sys

    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "jukebox"), "view", str(tapes.rec)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith(f"serving {tapes.rec} at http://127.0.0.1:"), line
        assert line.rstrip().endswith("(Ctrl-C stops)")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and out == "stopped\n" and err == "", (out, err)


def test_html_with_json_names_the_file_it_wrote(tapes: Tapes, tmp_path: Path) -> None:
    out = tmp_path / "share.html"
    done = jukebox("view", str(tapes.rec), "--html", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"html": str(out), "bytes": out.stat().st_size}
    assert out.read_text().startswith("<!doctype html>")
