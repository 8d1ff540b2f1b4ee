"""OpenTelemetry export: a 1,000-frame tape to spans and over OTLP/HTTP, and what a live export
adds to each frame a booth writes.

The tape mimics a long agent run: OpenAI chat calls with real-shaped request and response
bodies (prompts large enough to be spilled to the store), streamed Anthropic calls, tool calls,
checkpoints with real trees (a few files changed each), a verify, a commit, an exit. The OTLP
endpoint is a local HTTP server that reads each request and answers 200, so the rows time
Jukebox and the SDK's exporter, not a collector's storage.
"""

from __future__ import annotations

import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.harness import sample_us, summarize_us
from jukebox.tape.tape import Tape, TapeWriter
from shadowfs import tree
from shadowfs.store import Store

FRAMES = 1000


def build_tape(root: Path, store: Store, frames: int = FRAMES) -> Path:
    path = root / "otel.jbx"
    work = root / "work"
    work.mkdir()
    for i in range(20):
        (work / f"module_{i}.py").write_text(f"def f(x):\n    return x + {i}\n")
    base = tree.build_tree(store, work)
    previous = base
    t = 1_767_225_600_000_000_000
    system = "You are a coding agent working in /work/repo. Keep changes small. " * 80
    with TapeWriter.create(path, store, "bench-otel", fsync=False) as w:
        w.append("run_start", {"name": "bench-agent", "argv": ["python", "agent.py"]},
                 tree=base, time_ns=t)  # fmt: skip
        i = 0
        while w.count < frames - 3:
            i += 1
            t += 50_000_000
            step = i % 4
            if step == 1:
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": f"step {i}: fix the failing test"}]
                w.append("llm_turn", {
                    "provider": "openai", "endpoint": "chat.completions", "model": "gpt-4o-mini",
                    "status": 200, "latency_ms": 812.5, "stream": False,
                    "usage": {"input": 2000 + i, "output": 40, "cached": 0},
                    "tool_calls": [{"name": "edit_file", "arguments": {"path": "module_1.py"}}],
                    "cost_usd": 0.0003,
                    "request": {"model": "gpt-4o-mini", "messages": messages, "temperature": 0},
                    "response": {"id": f"chatcmpl-{i}", "model": "gpt-4o-mini-2024-07-18",
                                 "choices": [{"index": 0, "finish_reason": "tool_calls",
                                              "message": {"role": "assistant", "content": None,
                                                          "tool_calls": [{"id": f"call_{i}",
                                                          "type": "function", "function": {
                                                          "name": "edit_file", "arguments":
                                                          '{"path": "module_1.py"}'}}]}}],
                                 "usage": {"prompt_tokens": 2000 + i, "completion_tokens": 40}},
                }, time_ns=t)  # fmt: skip
            elif step == 2:
                events = [{"chunk": 0, "t_ms": 1, "event": "message_start", "data": {
                    "type": "message_start", "message": {"id": f"msg_{i}",
                    "model": "claude-haiku-4-5", "usage": {"input_tokens": 900}}}}]
                events += [{"chunk": k, "t_ms": 2 + k, "event": "content_block_delta", "data": {
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": f"word{k} "}}} for k in range(20)]
                events.append({"chunk": 21, "t_ms": 30, "event": "message_delta", "data": {
                    "type": "message_delta", "delta": {"stop_reason": "end_turn"},
                    "usage": {"output_tokens": 20}}})
                w.append("llm_turn", {
                    "provider": "anthropic", "endpoint": "messages", "model": "claude-haiku-4-5",
                    "status": 200, "latency_ms": 430.0, "stream": True,
                    "usage": {"input": 900, "output": 20, "cached": 0}, "tool_calls": [],
                    "cost_usd": 0.0001,
                    "request": {"model": "claude-haiku-4-5", "max_tokens": 256, "stream": True,
                                "messages": [{"role": "user", "content": f"explain step {i}"}]},
                    "response": events,
                }, time_ns=t)  # fmt: skip
            elif step == 3:
                w.append("tool_call", {"tool": "edit_file", "id": f"call_{i}",
                                       "args": {"path": "module_1.py"}, "result": "ok",
                                       "ok": True, "seconds": 0.01}, time_ns=t)  # fmt: skip
            else:
                (work / f"module_{i % 20}.py").write_text(f"def f(x):\n    return x * {i}\n")
                now = tree.build_tree(store, work, previous=previous)
                previous = now
                w.append("checkpoint", {"id": i, "label": f"step-{i}", "reason": "auto"},
                         tree=now, time_ns=t)  # fmt: skip
        w.append("verify", {"cmd": ["pytest", "-q"], "exit": 0, "ok": True, "seconds": 2.0},
                 time_ns=t + 1)  # fmt: skip
        w.append("commit", {"changes": 20, "ok": True}, tree=previous, time_ns=t + 2)
        w.append("exit", {"code": 0, "signal": None, "seconds": 60.0}, time_ns=t + 3)
    store.flush()
    return path


class _Sink(BaseHTTPRequestHandler):
    """Reads an OTLP request whole and says it was taken (an empty protobuf response)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _row(case: str, samples: list[float], note: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"group": "otel", "case": case, "system": "jukebox",
                           **summarize_us(samples)}  # fmt: skip
    if note:
        row["note"] = note
    return row


def run(quick: bool = False) -> list[dict[str, Any]]:
    from jukebox.export.otel_live import LiveExport
    from jukebox.export.otel_send import export_tape, plan_tape

    runs = 3 if quick else 10
    rows: list[dict[str, Any]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with tempfile.TemporaryDirectory(prefix="bench-otel-") as tmp:
            root = Path(tmp)
            with Store.open(root / "store", create=True) as store:
                path = build_tape(root, store)

                def load() -> Tape:
                    tape = Tape.load(path, store)
                    tape.check_chain()
                    return tape

                rows.append(_row(
                    f"map a {FRAMES}-frame tape to spans",
                    sample_us(lambda: plan_tape(load()), runs),
                    "load, chain check, payloads from the store, file changes from the trees",
                ))  # fmt: skip
                rows.append(_row(
                    f"map a {FRAMES}-frame tape to spans, --capture-content",
                    sample_us(lambda: plan_tape(load(), capture=True), runs),
                    "plus every message as the conventions' JSON, scrubbed",
                ))  # fmt: skip

                def export() -> None:
                    report = export_tape(load(), url)
                    assert report["spans_sent"] and report["metrics_sent"]

                rows.append(_row(
                    f"export a {FRAMES}-frame tape over OTLP/HTTP", sample_us(export, runs),
                    "`jukebox export otel` without the interpreter start: spans and metrics "
                    "to a local endpoint that takes them",
                ))  # fmt: skip

                # What a live export adds to each frame the booth writes: `observe` (the
                # writer's listener) puts the frame on a queue and returns.
                frames = load().frames
                payloads = [f.resolve_payload(store) for f in frames]
                for name, endpoint in (("a collector", url), ("no collector", "http://127.0.0.1:9")):
                    live = LiveExport("bench-live", endpoint, lambda _message: None)
                    live.start()
                    samples = []
                    for frame, payload in zip(frames, payloads, strict=True):
                        t0 = time.perf_counter_ns()
                        live.observe(frame, payload)
                        samples.append((time.perf_counter_ns() - t0) / 1000.0)
                    t0 = time.perf_counter_ns()
                    live.close()
                    closing = (time.perf_counter_ns() - t0) / 1000.0
                    rows.append(_row(
                        f"live export: per frame written, {name}", samples,
                        f"the tape writer's listener; closing the export took "
                        f"{closing / 1000:.0f} ms",
                    ))  # fmt: skip
    finally:
        server.shutdown()
    return rows


if __name__ == "__main__":
    for r in run(quick=True):
        print(r)
