"""One frame of a tape in full, as a person reads it: `jukebox show TAPE@N`.

`frame_view` gathers what a frame holds into plain data (the `--json` of `show`): the frame's
fields, its payload with large values put back from the store, and what can be read off it:

* an `llm_turn`'s conversation as messages (`role`, then blocks: `text`, `tool_call`,
  `tool_result`, `image`, `other`), read from any of the request shapes the proxy records
  (OpenAI chat, OpenAI Responses, Anthropic Messages, legacy completions), and its reply, a
  stream's events put back together through the same reader the recorder uses
  (jukebox.llm.providers.summarize);
* the files a frame with a tree changed, against the tree before it: names, sizes, and a short
  diff of each text file.

Headers are never shown, whatever the frame holds: secrets are scrubbed when recorded, but a
header is where a credential would sit if a scrubber missed one. `render_frame` turns the view
into text; every string from the tape goes through jukebox.display.names before a terminal sees it.
"""

from __future__ import annotations

import json
from typing import Any

# A short diff: a person wants to see what changed, `jukebox diff -p` shows it whole.
DIFF_LINES = 40
FILES_SHOWN = 200
PATCHED_FILES = 20
OUTPUT_LINES = 40


def _no_headers(payload: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in payload.items() if k != "headers" and not k.endswith("_headers")}


# --------------------------------------------------------------------------- messages


def _text_block(text: Any) -> dict[str, Any]:
    return {"type": "text", "text": text if isinstance(text, str) else json.dumps(text)}


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _blocks(content: Any) -> list[dict[str, Any]]:
    """Content in any provider's shape: a string, or a list of typed parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [_text_block(content)]
    if not isinstance(content, list):
        return [_text_block(content)]
    out: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, str):
            out.append(_text_block(part))
            continue
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            out.append(_text_block(part.get("text", "")))
        elif kind == "thinking":
            out.append({"type": "thinking", "text": str(part.get("thinking", ""))})
        elif kind in ("tool_use", "server_tool_use"):
            out.append(
                {"type": "tool_call", "id": part.get("id"), "name": part.get("name"),
                 "arguments": part.get("input")}
            )  # fmt: skip
        elif kind == "tool_result":
            out.append(
                {"type": "tool_result", "id": part.get("tool_use_id"),
                 "content": _blocks(part.get("content")), "error": bool(part.get("is_error"))}
            )  # fmt: skip
        elif kind in ("image", "image_url", "input_image", "document", "input_file"):
            out.append({"type": "image" if "image" in kind else "file"})
        elif "text" in part:
            out.append(_text_block(part["text"]))
        else:
            out.append({"type": "other", "what": str(kind)})
    return out


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    blocks = _blocks(message.get("content"))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        blocks.append(
            {"type": "tool_call", "id": call.get("id"), "name": fn.get("name"),
             "arguments": _arguments(fn.get("arguments"))}
        )  # fmt: skip
    role = str(message.get("role", "?"))
    if role == "tool":
        blocks = [{"type": "tool_result", "id": message.get("tool_call_id"), "content": blocks}]
    return {"role": role, "blocks": blocks}


def _responses_item(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        return {"role": "user", "blocks": _blocks(item)}
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        args = _arguments(item.get("arguments", item.get("input")))
        block = {"type": "tool_call", "id": item.get("call_id"), "name": item.get("name"),
                 "arguments": args}  # fmt: skip
        return {"role": "assistant", "blocks": [block]}
    if kind in ("function_call_output", "custom_tool_call_output"):
        content = _blocks(item.get("output"))
        block = {"type": "tool_result", "id": item.get("call_id"), "content": content}
        return {"role": "tool", "blocks": [block]}
    return {"role": str(item.get("role", "user")), "blocks": _blocks(item.get("content"))}


def request_messages(request: Any) -> list[dict[str, Any]]:
    """The conversation a model request carried, oldest first, in one shape for every API."""
    if not isinstance(request, dict):
        return []
    out: list[dict[str, Any]] = []
    system = request.get("system", request.get("instructions"))
    if system:
        out.append({"role": "system", "blocks": _blocks(system)})
    if isinstance(request.get("messages"), list):
        out += [_chat_message(m) for m in request["messages"] if isinstance(m, dict)]
    elif "input" in request and "model" in request and "messages" not in request:
        items = request["input"]
        items = items if isinstance(items, list) else [items]
        out += [_responses_item(item) for item in items]
    elif "prompt" in request:
        out.append({"role": "user", "blocks": _blocks(request["prompt"])})
    return out


def _stream_events(response: Any) -> list[Any] | None:
    if not isinstance(response, list):
        return None
    return [e.get("data") for e in response if isinstance(e, dict) and "data" in e]


def _response_blocks(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A JSON reply's content in any provider's shape, tool calls with their ids."""
    choices = response.get("choices")
    if isinstance(choices, list):
        first = choices[0] if choices and isinstance(choices[0], dict) else {}
        if isinstance(first.get("message"), dict):
            return _chat_message(first["message"])["blocks"]
        return _blocks(first.get("text"))  # legacy completions
    if isinstance(response.get("content"), list):  # Anthropic Messages
        return _blocks(response["content"])
    if isinstance(response.get("output"), list):  # OpenAI Responses
        return [b for item in response["output"] for b in _responses_item(item)["blocks"]]
    return []


def reply(payload: dict[str, Any]) -> dict[str, Any]:
    """What the model answered, as message blocks (a stream's events put together by the
    recorder's own reader), or the error an upstream gave."""
    from jukebox.llm.providers import summarize

    response = payload.get("response")
    events = _stream_events(response)
    status = payload.get("status")
    if isinstance(status, int) and status >= 400 and events is None:
        error = response.get("error") if isinstance(response, dict) else response
        if isinstance(error, dict):
            error = error.get("message", error)
        return {"error": error if isinstance(error, str) else json.dumps(error)}
    if events is None:
        return {"blocks": _response_blocks(response) if isinstance(response, dict) else []}
    summary = summarize(
        str(payload.get("provider", "")), str(payload.get("endpoint", "")),
        payload.get("request"), None, events,
    )  # fmt: skip
    blocks = [_text_block(summary.text)] if summary.text else []
    blocks += [
        {"type": "tool_call", "id": None, "name": call.get("name"),
         "arguments": call.get("arguments")}
        for call in summary.tool_calls
    ]  # fmt: skip
    # events is not None: response is the list of stream events they came from
    return {"blocks": blocks, "stream_events": len(response)}  # type: ignore[arg-type]


# --------------------------------------------------------------------------- files


def file_changes(tape: Any, n: int, shown: Any) -> list[dict[str, Any]] | None:
    """What frame ``n``'s tree changed against the tree before it, less what ``shown`` (a
    jukebox.review.filter.ReviewFilter) hides; None for a frame with no tree, for the first
    frame (its tree is the base, not a change) and when the store is not at hand."""
    from jukebox.display.names import name_json
    from jukebox.review.patch import text_patch
    from shadowfs import tree

    frame = tape.frames[n]
    if frame.tree is None or tape.store is None or n == 0:
        return None
    # A commit frame's tree is the state it wrote into the real tree, which held the base.
    before = tape.frames[0].tree if frame.kind == "commit" else tape.tree_at(n - 1)
    out: list[dict[str, Any]] = []
    for change in shown.keep(tree.diff_trees(tape.store, before, frame.tree)):
        row: dict[str, Any] = {**name_json(change.path), "status": change.status}
        entry = change.new or change.old
        row["kind"] = entry.kind if entry is not None else None
        if entry is not None and entry.kind == "file":
            row["size"] = entry.size
            if change.old is not None and change.old.kind == "file" and change.new is not None:
                row["old_size"] = change.old.size
        for side, entry_ in (("old_target", change.old), ("target", change.new)):
            if entry_ is not None and entry_.kind == "symlink":
                row[side] = (entry_.target or b"").decode("utf-8", "surrogateescape")
        if len(out) < PATCHED_FILES:
            row["patch"] = text_patch(tape.store, change, indent="")
        out.append(row)
    return out


# --------------------------------------------------------------------------- the view


def frame_view(tape: Any, n: int, shown: Any) -> dict[str, Any]:
    """Frame ``n`` of ``tape`` (a jukebox.tape.tape.Tape whose chain was checked) as plain data;
    ``shown`` filters the files it changed (jukebox.review.filter.ReviewFilter)."""
    frame = tape.frames[n]
    payload = frame.resolve_payload(tape.store) if tape.store is not None else frame.payload
    start = tape.frames[0].time_ns
    view: dict[str, Any] = {
        "tape": str(tape.path),
        "seq": frame.seq,
        "frames": len(tape.frames),
        "kind": frame.kind,
        "time_ns": frame.time_ns,
        "offset_ns": frame.time_ns - start,
        "id": frame.id.hex(),
        "tree": frame.tree.hex() if frame.tree else None,
        "payload": _no_headers(payload),
    }
    if frame.kind == "llm_turn":
        view["messages"] = request_messages(payload.get("request"))
        view["reply"] = reply(payload)
    files = file_changes(tape, n, shown)
    if files is not None:
        view["files"] = files
        view["hidden"] = shown.hidden
    return view


# --------------------------------------------------------------------------- text


def _indent(text: str, prefix: str = "    ") -> list[str]:
    from jukebox.display.names import printable

    return [prefix + printable(line) for line in str(text).split("\n")]


def _json_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


def _block_lines(block: dict[str, Any]) -> list[str]:
    kind = block.get("type")
    if kind == "text":
        return _indent(block.get("text", ""))
    if kind == "thinking":
        return _indent("(thinking) " + block.get("text", ""))
    if kind == "tool_call":
        call_id = f" [{block['id']}]" if block.get("id") else ""
        head = f"    → tool call {block.get('name')}{call_id}"
        return _indent(head, "") + _indent(_json_text(block.get("arguments")), "      ")
    if kind == "tool_result":
        call_id = f" [{block['id']}]" if block.get("id") else ""
        error = " (error)" if block.get("error") else ""
        lines = _indent(f"    ← tool result{call_id}{error}", "")
        for inner in block.get("content") or []:
            lines += ["  " + line for line in _block_lines(inner)]
        return lines
    if kind in ("image", "file"):
        return [f"    ({kind})"]
    return _indent(f"({block.get('what', kind)})")


def _llm_lines(view: dict[str, Any]) -> list[str]:
    from jukebox.display.render import money

    p = view["payload"]
    usage = p.get("usage") or {}
    facts = [
        f"{p.get('provider', '?')} {p.get('endpoint', '')} model {p.get('model', '?')}"
        + (f" (upstream {p['upstream']})" if p.get("upstream") else ""),
        f"status {p.get('status', '?')}",
        f"{p['latency_ms']:.0f} ms" if isinstance(p.get("latency_ms"), int | float) else "",
        "streamed" if p.get("stream") else "",
        f"{usage.get('input', '?')} → {usage.get('output', '?')} tokens" if usage else "",
        money(p["cost_usd"]) if isinstance(p.get("cost_usd"), int | float) else "",
        f"replayed from frame {p['replayed_from']}" if p.get("replayed_from") is not None else "",
    ]
    lines = ["  " + ", ".join(f for f in facts if f)]
    lines.append("")
    lines.append("messages:")
    for message in view["messages"]:
        lines += _indent(f"  [{message['role']}]", "")
        for block in message["blocks"]:
            lines += _block_lines(block)
    answer = view["reply"]
    events = answer.get("stream_events")
    streamed = f" (a stream of {events} events)" if events is not None else ""
    lines += ["", f"reply{streamed}:"]
    if "error" in answer:
        lines += _indent(f"error: {answer['error']}")
    for block in answer.get("blocks") or []:
        lines += _block_lines(block)
    if not answer.get("blocks") and "error" not in answer:
        lines.append("    (nothing)")
    return lines


def _verdict_lines(kind: str, p: dict[str, Any]) -> list[str]:
    if kind == "verify":
        cmd = p.get("cmd")
        cmd_text = " ".join(map(str, cmd)) if isinstance(cmd, list) else str(cmd or "")
        if p.get("skipped"):
            lines = _indent(f"verifier skipped ({p['skipped']}): {cmd_text}", "  ")
        else:
            result = "passed" if p.get("ok") else "FAILED"
            lines = _indent(f"verifier {result}: {cmd_text} (exit {p.get('exit')})", "  ")
        output = str(p.get("output") or "").rstrip("\n")
        if output:
            shown = output.split("\n")
            lines.append("  output:")
            lines += _indent("\n".join(shown[-OUTPUT_LINES:]))
            if len(shown) > OUTPUT_LINES or p.get("truncated"):
                lines.append(f"    (the last {min(len(shown), OUTPUT_LINES)} lines shown)")
        return lines
    if kind == "tool_call":
        failed = "" if p.get("ok", True) else " (failed)"
        lines = _indent(f"tool {p.get('tool', '?')}{failed}", "  ")
        lines += ["  arguments:", *_indent(_json_text(p.get("args")))]
        if "result" in p:
            lines += ["  result:", *_indent(_json_text(p.get("result")))]
        return lines
    return []


def _detail_lines(p: dict[str, Any]) -> list[str]:
    """The payload's fields, one a line; a long value cut short (`--json` has it whole)."""
    from jukebox.display.render import short

    lines = []
    for key in sorted(p):
        value = p[key] if isinstance(p[key], str) else json.dumps(p[key], ensure_ascii=False)
        if "\n" in value and isinstance(p[key], str) and len(value) <= 4000:
            lines += _indent(f"{key}:", "  ") + _indent(value, "      ")
        else:
            lines += _indent(f"{key}: {short(value, 200)}", "  ")
    return lines


def _file_lines(files: list[dict[str, Any]], what: str) -> list[str]:
    from jukebox.display.names import CHANGE_LETTERS, printable, visible

    lines = [f"files {what}: {len(files)}" if files else f"files {what}: none"]
    for row in files[:FILES_SHOWN]:
        size = ""
        if "size" in row:
            size = (
                f"  ({row['old_size']} → {row['size']} bytes)"
                if "old_size" in row
                else (f"  ({row['size']} bytes)")
            )
        if "target" in row or "old_target" in row:
            targets = [visible(row[k]) for k in ("old_target", "target") if k in row]
            size = "  (-> " + " → ".join(targets) + ")"
        lines.append(f"  {CHANGE_LETTERS.get(row['status'], '?')} {visible(row['path'])}{size}")
        patch = row.get("patch") or ""
        patch_lines = patch.rstrip("\n").split("\n") if patch else []
        for line in patch_lines[:DIFF_LINES]:
            lines.append("      " + printable(line))
        if len(patch_lines) > DIFF_LINES:
            lines.append(f"      … {len(patch_lines) - DIFF_LINES} more line(s): `jukebox diff -p`")
    if len(files) > FILES_SHOWN:
        lines.append(f"  … {len(files) - FILES_SHOWN} more: `jukebox diff TAPE@N`")
    return lines


def render_frame(view: dict[str, Any]) -> str:
    from jukebox.display.names import printable
    from jukebox.display.render import describe, seconds, timestamp

    kind, p = view["kind"], view["payload"]
    lines = [
        printable(
            f"frame @{view['seq']} of {view['tape']} ({view['frames']} frames): {kind}, "
            f"{timestamp(view['time_ns'] / 1e9)} (+{seconds(view['offset_ns'])})"
        ),
        f"  id {view['id']}" + (f"  tree {view['tree']}" if view["tree"] else ""),
    ]
    if kind == "llm_turn":
        lines += _llm_lines(view)
    else:
        summary = describe(kind, p)
        if summary and kind not in ("verify", "tool_call"):
            lines += _indent(summary, "  ")
        lines += _verdict_lines(kind, p)
        if kind not in ("verify", "tool_call"):
            lines += _detail_lines(p)
    if "files" in view:
        what = "committed" if kind == "commit" else "changed"
        lines += ["", *_file_lines(view["files"], what)]
    elif view["tree"] and view["seq"] > 0:
        lines.append("  (no store beside the tape: its files cannot be shown)")
    return "\n".join(lines)
