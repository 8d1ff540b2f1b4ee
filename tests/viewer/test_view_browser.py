"""`jukebox view` in a real browser (Debian's Chromium, headless, driven by Playwright): tapes a
booth really recorded, clicked through frame by frame, a diff opened, a fork compared, a
breaker trip and a tampered tape shown, and a tape's hostile text shown as text and never run.
Each test saves screenshots (see conftest.py for where)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from tests.viewer.agent import HOSTILE, HOSTILE_NAME
from tests.viewer.conftest import Tapes, jukebox


class Listener:
    """A server on 127.0.0.1 that answers nothing useful and remembers every request."""

    def __enter__(self) -> Listener:
        import threading
        from http.server import BaseHTTPRequestHandler, HTTPServer

        hits = self.hits = []  # type: list[str]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def ready(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']")


def open_frame(page: Any, side: str, seq: int) -> Any:
    page.click(f".jb-timeline-{side} .row[data-seq='{seq}']")
    shown = f"#detail[data-side='{side}'][data-seq='{seq}'][data-state='shown']"
    return page.wait_for_selector(shown)


def detail_text(page: Any) -> str:
    """The frame as shown (headings in capitals, as the style sets them)."""
    return page.inner_text("#detail")


def nothing_ran(page: Any) -> None:
    """The hostile text did nothing: no flag set, only the page's own two scripts, no image or
    link made from the tape's text, and no error in the page's script."""
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("document.scripts.length") == 2
    assert page.evaluate("document.querySelectorAll('img, a, iframe, object, embed').length") == 0
    assert page.errors == []


def test_served_page_clicks_through_frames_and_opens_a_diff(
    tapes: Tapes, serve: Any, page: Any, artefacts: Path
) -> None:
    server = serve(str(tapes.rec))
    assert server.url == f"http://127.0.0.1:{server.port}/"
    ready(page, server.url)
    top = page.inner_text("#top")
    assert "committed @12" in top and "verified ✓" in top and "model calls 3" in top
    title = page.get_attribute("#top .badge.ok >> nth=1", "title")
    assert title and "Merkle root" in title and "every object checked" in title
    # The timeline draws the checkpoints, the rollback, the verifier and the verdict.
    strip = ".jb-strip-a"
    assert page.locator(f"{strip} .mk.checkpoint").count() == 3
    assert page.locator(f"{strip} .mk.rollback").count() == 1
    assert page.locator(f"{strip} .mk.verify.ok").count() == 1
    assert page.locator(f"{strip} .mk.commit").count() == 1
    assert page.inner_text(".jb-timeline-a .row[data-seq='6'] .kind") == "rollback"
    assert page.get_attribute(f"{strip} .back", "title") == "@6 rolled back to @3"

    open_frame(page, "a", 2)  # the first model call: messages in markdown, the tool call
    text = detail_text(page)
    assert "MESSAGES" in text.upper() and "You are a file agent." in text
    assert "→ tool call write_file" in text
    assert page.inner_text("#detail .md h1") == "Plan"
    assert page.inner_text("#detail .md strong") == "hello"
    assert page.inner_text("#detail .md pre code") == "print('hi')"
    assert page.locator("#detail .md li").all_inner_texts() == ["one", "two"]
    assert HOSTILE in text  # shown as text, whole
    page.screenshot(path=str(artefacts / "served-model-call.png"))

    page.keyboard.press("j")  # the next frame: checkpoint turn-1, the file it added
    page.wait_for_selector("#detail[data-seq='3'][data-state='shown']")
    assert "FILES CHANGED (1)" in detail_text(page) and "notes.txt" in detail_text(page)

    open_frame(page, "a", 6)  # the rollback: back to checkpoint turn-1, frame 3
    page.click("#detail button.jb-back")
    page.wait_for_selector("#detail[data-seq='3'][data-state='shown']")

    open_frame(page, "a", 5)  # checkpoint turn-2: a modified file, a hostile file and name
    text = detail_text(page)
    assert "FILES CHANGED (3)" in text and HOSTILE_NAME in text, text
    notes = page.locator("#detail .file", has_text="notes.txt")
    notes.locator("button.jb-diff").click()
    rows = notes.locator("table.sbs tr")
    changed = [r for r in rows.all() if r.locator("td.del").count() and r.locator("td.add").count()]
    assert len(changed) == 1
    assert changed[0].locator("td.del").inner_text() == "line 4"
    assert changed[0].locator("td.add").inner_text() == "line four"
    evil = page.locator("#detail .file", has_text="evil.html")
    evil.locator("button.jb-diff").click()
    assert HOSTILE in evil.locator("td.add").inner_text()
    page.screenshot(path=str(artefacts / "served-diff.png"))
    nothing_ran(page)

    # Every frame opens, one request each.
    for seq in range(13):
        open_frame(page, "a", seq)
    open_frame(page, "a", 11)
    assert "verifier passed: test -f notes.txt" in detail_text(page)
    open_frame(page, "a", 12)
    assert "verdict: 2 change(s) applied" in detail_text(page)
    nothing_ran(page)
    stopped = server.stop()
    assert stopped.returncode == 0, stopped.stderr


def test_one_file_compares_a_fork_offline(
    tapes: Tapes, page: Any, tmp_path: Path, artefacts: Path
) -> None:
    out = tmp_path / "share.html"
    made = jukebox("view", str(tapes.rec), "--compare", str(tapes.fork), "--html", str(out))
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"wrote {out}")
    html = out.read_text()
    # Self-contained: nothing fetched from anywhere, and the tape's text cannot close a tag.
    assert not re.search(r"""(src|href)\s*=|@import|url\(""", html, re.I)
    block = html.split('id="jb-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in block and ">" not in block and "window.__pwned" in block
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    ready(page, out.as_uri())
    assert [u for u in requests if not u.startswith("file:")] == []

    box = page.inner_text("#compare")
    assert "the tapes part at frame 4" in box and "gpt-4o-mini, gpt-4.1" in box
    assert "First differing model turn: #2" in box
    for side, differing in (("a", {4, 7}), ("b", {5, 8})):
        timeline = f".jb-timeline-{side}"
        assert page.locator(f"{timeline} .row.shared").count() == 4
        assert page.locator(f"{timeline} .row.diverge").get_attribute("data-seq") == "4"
        seqs = page.locator(f"{timeline} .row.differs").evaluate_all(
            "rows => rows.map(r => Number(r.dataset.seq))"
        )
        assert set(seqs) == differing
    assert page.locator(".jb-strip-a .mk.diverge").count() == 1

    page.click("button:text('B@5')")
    page.wait_for_selector("#detail[data-side='b'][data-seq='5'][data-state='shown']")
    assert "model gpt-4.1" in detail_text(page)
    page.screenshot(path=str(artefacts / "file-compare.png"))
    assert page.url.endswith("#b@5")  # a link to this frame: it opens it again
    page.goto("about:blank")
    page.goto(out.as_uri() + "#a@4")
    page.wait_for_selector("#detail[data-side='a'][data-seq='4'][data-state='shown']")
    assert "model gpt-4o-mini" in detail_text(page) and "The tapes part here." in detail_text(page)
    open_frame(page, "a", 2)  # unpacked from the file: the same conversation, as text
    assert HOSTILE in detail_text(page)
    open_frame(page, "b", 6)
    evil = page.locator("#detail .file", has_text="evil.html")
    evil.locator("button.jb-diff").click()
    assert HOSTILE in evil.locator("td.add").inner_text()
    nothing_ran(page)
    # The page's policy is the second wall: markup that got into the page would still not run
    # (an inline handler, a script without the nonce) nor fetch anything (a listener here
    # counts what reaches it).
    with Listener() as listener:
        page.evaluate(
            """url => {
            document.body.insertAdjacentHTML('beforeend',
                '<img src="' + url + 'x.png" onerror="window.__pwned=9">' +
                '<svg onload="window.__pwned=10"></svg>');
            const s = document.createElement('script');
            s.textContent = 'window.__pwned = 11';
            document.body.appendChild(s);
            fetch(url + 'f').catch(() => {});
            }""",
            listener.url,
        )
        page.wait_for_timeout(300)
        assert listener.hits == []
    assert page.evaluate("window.__pwned") is None


def test_the_breaker_trip_and_a_tampered_tape(
    tapes: Tapes, page: Any, tmp_path: Path, artefacts: Path
) -> None:
    out = tmp_path / "tripped.html"
    assert jukebox("view", str(tapes.tripped), "--html", str(out)).returncode == 0
    ready(page, out.as_uri())
    top = page.inner_text("#top")
    assert "rolled back @7" in top and "verified ✓" in top
    page.click(".jb-breaker")
    page.wait_for_selector("#detail[data-seq='4'][data-state='shown']")
    assert "circuit breaker tripped max_turns" in detail_text(page)
    assert page.locator(".jb-strip-a .mk.breaker").count() == 1
    page.screenshot(path=str(artefacts / "breaker.png"))

    # A byte changed inside a frame: the page says the tape is not what was recorded.
    altered = tapes.dir / "altered.jbx"
    shutil.copy(tapes.rec, altered)
    data = bytearray(altered.read_bytes())
    at = data.index(b"write_file")
    data[at] ^= 0x20
    altered.write_bytes(bytes(data))
    out = tmp_path / "altered.html"
    made = jukebox("view", str(altered), "--html", str(out))
    assert made.returncode == 0, made.stderr
    ready(page, out.as_uri())
    assert "NOT VERIFIED ✗" in page.inner_text("#top")
    assert page.locator(".jb-problems div").count() >= 1
    shown = page.locator(".jb-timeline-a .row").count()
    assert 0 < shown < 13  # the frames from the damage on are not vouched for: not shown
    page.screenshot(path=str(artefacts / "tampered.png"))
    nothing_ran(page)


def build_long_tape(path: Path, store: Any, frames: int) -> None:
    """A run of ``frames`` frames (model calls, tool calls, checkpoints, agent turns), written
    straight to a tape: only the page is under test here. One call near the end carries a long
    system prompt (the rest stay small: a large value goes to the store, one fsync each)."""
    from jukebox.tape.tape import TapeWriter

    t = 1_767_225_600_000_000_000
    with TapeWriter.create(path, store, "big", fsync=False) as w:
        w.append("run_start", {"name": "long-agent", "argv": ["agent"]}, time_ns=t)
        for i in range(1, frames - 3):
            t += 1_000_000
            step = i % 4
            if step == 1:
                system = "Keep changes small. " * (280 if i + 8 > frames else 1)
                messages = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"step {i}"},
                ]
                w.append("llm_turn", {
                    "provider": "openai", "endpoint": "chat.completions", "model": "gpt-4o-mini",
                    "status": 200, "usage": {"input": 20, "output": 5}, "cost_usd": 0.00001,
                    "request": {"model": "gpt-4o-mini", "messages": messages},
                    "response": {"choices": [{"message": {"role": "assistant",
                                                          "content": f"done {i}"}}]},
                }, time_ns=t)  # fmt: skip
            elif step == 2:
                w.append("tool_call", {"tool": "edit", "args": {"n": i}, "result": "ok"}, time_ns=t)
            elif step == 3:
                w.append("checkpoint", {"id": i, "label": f"step-{i}"}, time_ns=t)
            else:
                w.append("agent_turn", {"text": f"turn {i}"}, time_ns=t)
        w.append("verify", {"cmd": ["pytest"], "exit": 0, "ok": True}, time_ns=t + 1)
        w.append("commit", {"changes": 3}, time_ns=t + 2)
        w.append("exit", {"code": 0}, time_ns=t + 3)


def test_a_10000_frame_tape_draws_only_the_rows_in_view(
    page: Any, tmp_path: Path, artefacts: Path
) -> None:
    """10,000 frames in one file: the timeline holds only the rows in view, the last frame
    opens from the last block, a long prompt is cut until asked for whole."""
    from jukebox.tape.tape import Tape
    from jukebox.viewer import page as viewer_page
    from jukebox.viewer.model import TapeView
    from shadowfs.store import Store

    with Store.open(tmp_path / "store", create=True) as store:
        build_long_tape(tmp_path / "big.jbx", store, 10_000)
        store.flush()
        view = TapeView(Tape.load(tmp_path / "big.jbx", store), "big")
        out = tmp_path / "big.html"
        out.write_text(viewer_page.write_file(view, None), encoding="utf-8")
    ready(page, out.as_uri())
    assert "frames 10000" in page.inner_text("#top")
    assert page.locator(".jb-timeline-a .row").count() < 100
    page.evaluate("document.querySelector('.jb-timeline-a .rows').scrollTop = 1e9")
    page.wait_for_selector(".jb-timeline-a .row[data-seq='9999']")
    assert page.locator(".jb-timeline-a .row").count() < 100
    open_frame(page, "a", 9999)
    assert "exit 0" in detail_text(page)
    open_frame(page, "a", 9993)  # the model call with a long system prompt: cut
    more = page.locator("#detail button.jb-more")
    assert more.inner_text() == "show all 5,600 characters"
    more.click()
    assert page.locator("#detail button.jb-more").count() == 0
    assert detail_text(page).count("Keep changes small.") == 280
    page.screenshot(path=str(artefacts / "ten-thousand-frames.png"))
    assert page.errors == []
