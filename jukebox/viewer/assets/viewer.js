// jukebox view: the page's only script. Every string that comes from a tape is put in the
// document with textContent or a text node, never as markup: a tape is someone else's text.
(() => {
  "use strict";

  const DATA = JSON.parse(document.getElementById("jb-data").textContent);
  const ROW = 22; // px, as --row in the stylesheet
  const SIDES = DATA.b ? ["a", "b"] : ["a"];
  const CMP = DATA.comparison || null;
  const LETTERS = { added: "A", deleted: "D", modified: "M", mode: "m", type: "T", link: "L" };
  const MAX_MARKS = 3000; // markers drawn per strip; more add nothing a person can see
  const state = { side: "a", seq: null, token: 0 };
  const details = { a: new Map(), b: new Map() };
  const timelines = {};

  // ------------------------------------------------------------------ small helpers

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function add(parent, ...kids) {
    for (const kid of kids) {
      if (kid === null || kid === undefined || kid === false) continue;
      parent.appendChild(typeof kid === "string" ? document.createTextNode(kid) : kid);
    }
    return parent;
  }

  function offset(ms) {
    if (ms < 1000) return "+" + ms.toFixed(1) + "ms";
    const s = ms / 1000;
    if (s < 120) return "+" + s.toFixed(2) + "s";
    const m = Math.floor(s / 60);
    return "+" + m + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s";
  }

  function money(value) {
    const v = Number(value || 0);
    // `jukebox log` rounds to 4 places; a cheap model's call would read as $0.0000 there.
    return "$" + (v > 0 && v < 0.0001 ? v.toPrecision(2) : v.toFixed(4));
  }

  function clock(ns) {
    const d = new Date(Number(ns) / 1e6);
    return isNaN(d) ? "?" : d.toISOString().replace("T", " ").replace("Z", " UTC");
  }

  function json(value) {
    if (typeof value === "string") return value;
    try {
      return JSON.stringify(value, null, 2);
    } catch (e) {
      return String(value);
    }
  }

  function pre(text, cls) {
    return el("pre", cls || "block", text);
  }

  function badge(text, tone, title) {
    const b = el("span", "badge " + tone, text);
    if (title) b.title = title;
    return b;
  }

  // ------------------------------------------------------------------ markdown, safely
  // A small renderer for what models write: fenced code, headings, lists, quotes, paragraphs,
  // `code`, **bold**, *emphasis* (not _this_: names like __init__ are everywhere), [links](url). It builds elements and text nodes; a link is
  // shown as its text and its address, never followed.

  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*\n][\s\S]*?)\*\*|\[([^\]\n]+)\]\(([^)\s]+)\)|\*([^*\s][^*\n]*?)\*/g;

  function inline(text, parent) {
    let last = 0;
    INLINE.lastIndex = 0;
    const source = String(text);
    let m;
    const found = [];
    while ((m = INLINE.exec(source)) !== null) found.push(m);
    for (const match of found) {
      if (match.index > last) add(parent, source.slice(last, match.index));
      if (match[1] !== undefined) add(parent, el("code", null, match[2]));
      else if (match[3] !== undefined) inline(match[3], add(parent, el("strong")).lastChild);
      else if (match[4] !== undefined) {
        const span = el("span", "link");
        add(span, match[4], el("span", "link-url", " <" + match[5] + ">"));
        add(parent, span);
      } else inline(match[6], add(parent, el("em")).lastChild);
      last = match.index + match[0].length;
    }
    if (last < source.length) add(parent, source.slice(last));
    return parent;
  }

  function markdown(text) {
    const root = el("div", "md");
    const lines = String(text).split("\n");
    let para = [];
    const flush = () => {
      if (para.length) root.appendChild(inline(para.join("\n"), el("p")));
      para = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = /^\s*(```+|~~~+)\s*([^`\s]*)/.exec(line);
      if (fence) {
        flush();
        const body = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
        const block = el("pre");
        const code = el("code", null, body.join("\n"));
        if (fence[2]) block.title = fence[2];
        root.appendChild(add(block, code));
        continue;
      }
      const heading = /^(#{1,6})\s+(.*)$/.exec(line);
      if (heading) {
        flush();
        root.appendChild(inline(heading[2], el("h" + heading[1].length)));
        continue;
      }
      const item = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line);
      if (item) {
        flush();
        const ordered = /\d/.test(item[1]);
        const list = el(ordered ? "ol" : "ul");
        let j = i;
        for (; j < lines.length; j++) {
          const next = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(lines[j]);
          if (!next || /\d/.test(next[1]) !== ordered) break;
          list.appendChild(inline(next[2], el("li")));
        }
        i = j - 1;
        root.appendChild(list);
        continue;
      }
      if (/^>\s?/.test(line)) {
        flush();
        const quoted = [];
        for (; i < lines.length && /^>\s?/.test(lines[i]); i++) quoted.push(lines[i].replace(/^>\s?/, ""));
        i--;
        const block = el("blockquote");
        block.appendChild(markdown(quoted.join("\n")));
        root.appendChild(block);
        continue;
      }
      if (!line.trim()) {
        flush();
        continue;
      }
      para.push(line);
    }
    flush();
    return root;
  }

  // ------------------------------------------------------------------ header and comparison

  function verdictBadge(facts) {
    const v = facts.verdict;
    if (!v) return badge(facts.status.toLowerCase(), facts.status === "DAMAGED" ? "bad" : "info");
    if (v.kind === "commit") return badge("committed @" + v.seq, "ok", v.what);
    if (v.kind === "discard") return badge("discarded @" + v.seq, "warn", v.what);
    return badge("rolled back @" + v.seq, "warn", v.what);
  }

  function verifiedBadge(facts) {
    const v = facts.verified;
    if (v.ok) {
      const what = "Merkle root " + v.merkle_root + " over " + v.frames + " frames" +
        (v.objects_checked ? ", every object checked" : ", objects not checked (no store)");
      return badge("verified ✓", "ok", what);
    }
    const problems = v.problems.join("\n") + (v.more_problems ? "\n… " + v.more_problems + " more" : "");
    return badge("NOT VERIFIED ✗", "bad", problems);
  }

  function jump(side, seq) {
    select(side, seq, true);
  }

  function header() {
    const top = document.getElementById("top");
    const f = DATA.a.facts;
    const run = f.run || {};
    add(top, el("h1", null, f.label));
    const what = run.name || (run.argv ? run.argv.join(" ") : run.function) || "";
    if (what) add(top, el("span", "fact mono", what));
    add(top, verdictBadge(f), verifiedBadge(f));
    for (const trip of f.breaker) {
      const b = badge("breaker @" + trip.seq + ": " + trip.what, "bad");
      b.classList.add("jb-breaker");
      b.addEventListener("click", () => jump("a", trip.seq));
      add(top, b);
    }
    const fact = (label, value) => add(el("span", "fact"), label + " ", el("b", null, value));
    add(
      top,
      fact("frames", String(DATA.a.index.count)),
      fact("cost", money(f.summary.cost_usd)),
      fact("model calls", String(f.llm_calls)),
      fact("tokens", f.tokens.input + " → " + f.tokens.output),
      fact("started", clock(f.summary.started_ns)),
    );
    if (!f.verified.ok || f.damage) {
      // The first problems, then the rest folded: one altered byte breaks every root after it.
      const list = el("div", "err jb-problems");
      list.style.flexBasis = "100%";
      const problems = f.verified.problems.length ? f.verified.problems : [f.damage];
      for (const p of problems.slice(0, 3)) list.appendChild(el("div", null, p));
      const rest = problems.length - 3 + (f.verified.more_problems || 0);
      if (rest > 0) {
        const more = el("details");
        add(more, el("summary", null, rest + " more problem(s)"));
        for (const p of problems.slice(3)) more.appendChild(el("div", null, p));
        list.appendChild(more);
      }
      add(top, list);
    }
  }

  function comparePanel() {
    if (!CMP) return;
    const box = document.getElementById("compare");
    box.hidden = false;
    const a = CMP.a, b = CMP.b;
    const table = el("table");
    const row = (name, x, y) => {
      const tr = el("tr");
      add(tr, el("th", null, name), el("td", null, x), el("td", null, y));
      if (String(x) !== String(y)) tr.className = "why";
      table.appendChild(tr);
    };
    row("", "A: " + a.label, "B: " + b.label);
    table.firstChild.className = "";
    row("frames", a.frames, b.frames);
    row("status", a.status, b.status);
    row("models", a.models.join(", ") || "-", b.models.join(", ") || "-");
    row("model calls", a.llm_calls, b.llm_calls);
    row("tool calls", a.tool_calls.length, b.tool_calls.length);
    row("checkpoints", a.checkpoints, b.checkpoints);
    row("tokens in / out", a.tokens.input + " / " + a.tokens.output, b.tokens.input + " / " + b.tokens.output);
    row("cost", money(a.cost_usd), money(b.cost_usd));
    row("verified", DATA.a.facts.verified.ok ? "yes" : "NO", DATA.b.facts.verified.ok ? "yes" : "NO");
    box.appendChild(table);
    const line = el("p", "jb-divergence");
    const n = CMP.shared_prefix;
    if (CMP.identical) add(line, "Same model behaviour and the same files on both tapes. ");
    add(line, n ? "Frames 0–" + (n - 1) + " are the same bytes on both tapes; " : "No frame in common; ");
    const go = el("button", "jb-go-diverge", "the tapes part at frame " + n);
    go.addEventListener("click", () => {
      jump("a", Math.min(n, DATA.a.index.count - 1));
      timelines.b.reveal(Math.min(n, DATA.b.index.count - 1));
    });
    add(line, go);
    const first = CMP.messages.first_difference;
    if (first) {
      const seqs = [first.a && first.a.seq, first.b && first.b.seq];
      add(line, ". First differing model turn: #" + first.turn + " (");
      if (seqs[0] !== null && seqs[0] !== undefined) {
        const btn = el("button", null, "A@" + seqs[0]);
        btn.addEventListener("click", () => jump("a", seqs[0]));
        add(line, btn);
      }
      if (seqs[1] !== null && seqs[1] !== undefined) {
        const btn = el("button", null, "B@" + seqs[1]);
        btn.addEventListener("click", () => jump("b", seqs[1]));
        add(line, " ", btn);
      }
      add(line, ")");
    }
    if (CMP.files) {
      add(line, ". Final files: " + (CMP.files.length ? CMP.files.length + " path(s) differ: " : "the same."));
      add(line, CMP.files.slice(0, 20).map((c) => (LETTERS[c.status] || "?") + " " + c.path).join(", "));
    }
    box.appendChild(line);
  }

  // The checkpoint frame a rollback went back to: the latest checkpoint with its id before it
  // (checkpoint 0 is the start of the run, frame 0).
  function rolledBackTo(facts, mark) {
    if (mark.to === null || mark.to === undefined) return null;
    if (mark.to === 0) return 0;
    let found = null;
    for (const m of facts.marks) {
      if (m.seq >= mark.seq) break;
      if (m.kind === "checkpoint" && m.id === mark.to) found = m.seq;
    }
    return found;
  }

  // ------------------------------------------------------------------ the strips

  function strips() {
    const box = document.getElementById("strips");
    for (const side of SIDES) {
      const facts = DATA[side].facts;
      const count = DATA[side].index.count;
      const at = (seq) => (count > 1 ? (100 * seq) / (count - 1) : 0) + "%";
      const strip = el("div", "strip jb-strip-" + side);
      // Hundreds of checkpoints would hide the rarer marks: they fade, the others stay on top.
      if (facts.marks.length > 200) strip.classList.add("crowded");
      strip.title = "checkpoints (green), rollbacks (amber), verifier, breaker (red), verdict";
      if (CMP && CMP.shared_prefix) {
        const shared = el("div", "shared");
        shared.style.left = "0";
        shared.style.width = at(Math.max(0, CMP.shared_prefix - 1));
        strip.appendChild(shared);
      }
      const marks = facts.marks.length > MAX_MARKS ? facts.marks.filter((m, i) => m.kind !== "checkpoint" || i % Math.ceil(facts.marks.length / MAX_MARKS) === 0) : facts.marks;
      for (const mark of marks) {
        let cls = "mk " + mark.kind;
        if (mark.kind === "verify") cls += mark.ok ? " ok" : " failed";
        const node = el("div", cls);
        node.style.left = at(mark.seq);
        node.title = "@" + mark.seq + " " + mark.kind + ": " + mark.what;
        strip.appendChild(node);
      }
      // Each rollback spans back to its checkpoint, above the line.
      for (const mark of facts.marks) {
        if (mark.kind !== "rollback") continue;
        const back = rolledBackTo(facts, mark);
        if (back === null) continue;
        const span = el("div", "back");
        span.style.left = at(back);
        span.style.width = "calc(" + at(mark.seq) + " - " + at(back) + ")";
        span.title = "@" + mark.seq + " rolled back to @" + back;
        strip.appendChild(span);
      }
      if (CMP && CMP.shared_prefix < count) {
        const node = el("div", "mk diverge");
        node.style.left = at(CMP.shared_prefix);
        node.title = "@" + CMP.shared_prefix + ": the tapes part here";
        strip.appendChild(node);
      }
      const here = el("div", "mk here");
      here.hidden = true;
      strip.appendChild(here);
      strip.appendChild(el("span", "name", SIDES.length > 1 ? side.toUpperCase() : ""));
      strip.addEventListener("click", (event) => {
        const box = strip.getBoundingClientRect();
        const seq = Math.round(((event.clientX - box.left) / box.width) * (count - 1));
        jump(side, Math.max(0, Math.min(count - 1, seq)));
      });
      timelines[side + "_here"] = (seq) => {
        here.hidden = seq === null;
        here.style.left = at(seq || 0);
      };
      box.appendChild(strip);
    }
  }

  // ------------------------------------------------------------------ the timelines

  function differing(side) {
    return new Set(CMP ? CMP.differing_frames[side] : []);
  }

  function Timeline(side) {
    const index = DATA[side].index;
    const count = index.count;
    const differs = differing(side);
    const root = el("div", "timeline jb-timeline-" + side);
    const head = el("div", "head", (SIDES.length > 1 ? side.toUpperCase() + ": " : "") + DATA[side].facts.label + " (" + count + " frames)");
    const rows = el("div", "rows");
    rows.tabIndex = 0;
    const spacer = el("div", "spacer");
    spacer.style.height = count * ROW + "px";
    rows.appendChild(spacer);
    add(root, head, rows);
    let drawn = [-1, -1];

    function makeRow(i) {
      const kind = index.kinds[index.kind[i]];
      const row = el("div", "row k-" + kind);
      row.dataset.seq = String(i);
      row.style.top = i * ROW + "px";
      if (CMP) {
        if (i < CMP.shared_prefix) row.classList.add("shared");
        else if (i === CMP.shared_prefix) row.classList.add("diverge");
        if (differs.has(i)) row.classList.add("differs");
      }
      if (state.side === side && state.seq === i) row.classList.add("sel");
      const what = el("span", "what", index.what[i]);
      row.title = "@" + i + " " + kind + ": " + index.what[i];
      add(
        row,
        el("span", "seq", "@" + i),
        el("span", "t", offset(index.t[i])),
        el("span", "kind", kind),
        el("span", "cost", index.cost[i] ? money(index.cost[i]) : ""),
        what,
      );
      return row;
    }

    function render(force) {
      const top = rows.scrollTop;
      const height = rows.clientHeight || 600;
      const first = Math.max(0, Math.floor(top / ROW) - 10);
      const last = Math.min(count, Math.ceil((top + height) / ROW) + 10);
      if (!force && first === drawn[0] && last === drawn[1]) return;
      drawn = [first, last];
      const fragment = document.createDocumentFragment();
      for (let i = first; i < last; i++) fragment.appendChild(makeRow(i));
      spacer.replaceChildren(fragment);
    }

    let pending = false;
    rows.addEventListener("scroll", () => {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => {
        pending = false;
        render(false);
        if (CMP && !syncing) {
          syncing = true;
          for (const other of SIDES) if (other !== side) timelines[other].scrollTo(rows.scrollTop);
          syncing = false;
        }
      });
    });
    spacer.addEventListener("click", (event) => {
      const row = event.target.closest(".row");
      if (row) select(side, Number(row.dataset.seq), false);
    });
    rows.addEventListener("keydown", (event) => {
      const step = { ArrowDown: 1, j: 1, ArrowUp: -1, k: -1, PageDown: 20, PageUp: -20 }[event.key];
      if (!step) return;
      event.preventDefault();
      const from = state.side === side && state.seq !== null ? state.seq : -1;
      select(side, Math.max(0, Math.min(count - 1, from + step)), true);
    });

    return {
      root,
      count,
      render,
      focus: () => rows.focus({ preventScroll: true }),
      scrollTo: (y) => {
        if (Math.abs(rows.scrollTop - y) > 1) rows.scrollTop = y;
      },
      reveal: (i) => {
        const y = i * ROW;
        if (y < rows.scrollTop || y + ROW > rows.scrollTop + rows.clientHeight) {
          rows.scrollTop = Math.max(0, y - rows.clientHeight / 3);
        }
        render(true);
      },
    };
  }
  let syncing = false;

  // ------------------------------------------------------------------ frame details

  async function inflate(b64) {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return JSON.parse(await new Response(stream).text());
  }

  const unpacked = { a: new Map(), b: new Map() };
  const tables = { a: null, b: null };

  async function fromFile(side, seq) {
    const packed = DATA[side].details;
    const n = Math.floor(seq / packed.chunk);
    if (!unpacked[side].has(n)) unpacked[side].set(n, inflate(packed.chunks[n]));
    if (!tables[side]) tables[side] = inflate(packed.messages);
    const block = await unpacked[side].get(n);
    const detail = block[seq - n * packed.chunk];
    if (Array.isArray(detail.messages) && detail.messages.length && typeof detail.messages[0] === "number") {
      const table = await tables[side];
      detail.messages = detail.messages.map((i) => table[i]);
    }
    return detail;
  }

  async function fromServer(side, seq) {
    const answer = await fetch("api/frame/" + side + "/" + seq, { credentials: "same-origin" });
    if (!answer.ok) throw new Error("the server answered " + answer.status);
    return answer.json();
  }

  function load(side, seq) {
    if (!details[side].has(seq)) {
      const promise = (DATA.mode === "file" ? fromFile : fromServer)(side, seq);
      promise.catch(() => details[side].delete(seq));
      details[side].set(seq, promise);
    }
    return details[side].get(seq);
  }

  function select(side, seq, reveal) {
    const previous = timelines[state.side];
    state.side = side;
    state.seq = seq;
    for (const s of SIDES) {
      timelines[s].render(true);
      timelines[s + "_here"](s === side ? seq : null);
    }
    if (reveal) timelines[side].reveal(seq);
    if (previous !== timelines[side] || reveal) timelines[side].focus();
    // The frame in the address (#a@12), so a link or a reload opens it again.
    try {
      history.replaceState(null, "", "#" + side + "@" + seq);
    } catch (e) {
      // a sandboxed viewer of the file may refuse; the page works without it
    }
    const token = ++state.token;
    const pane = document.getElementById("detail");
    pane.dataset.state = "loading";
    load(side, seq).then(
      (detail) => {
        if (token !== state.token) return;
        pane.replaceChildren(frameView(side, detail));
        pane.dataset.side = side;
        pane.dataset.seq = String(seq);
        pane.dataset.state = "shown";
        pane.scrollTop = 0;
      },
      (error) => {
        if (token !== state.token) return;
        pane.replaceChildren(el("p", "err", "frame @" + seq + " could not be read: " + error.message));
        pane.dataset.state = "error";
      },
    );
  }

  // Past this a text is shown cut, with a button for the rest: a pasted file or a long
  // system prompt would bury the conversation.
  const LONG_TEXT = 4000;

  function longText(text) {
    const whole = String(text);
    if (whole.length <= LONG_TEXT) return markdown(whole);
    const box = el("div", "long");
    const cut = whole.slice(0, LONG_TEXT);
    box.appendChild(markdown(cut));
    const more = el("button", "jb-more", "show all " + whole.length.toLocaleString("en") + " characters");
    more.addEventListener("click", () => box.replaceChildren(markdown(whole)));
    box.appendChild(more);
    return box;
  }

  function blockView(block) {
    switch (block.type) {
      case "text":
        return longText(block.text);
      case "thinking": {
        const box = el("details", "thinking");
        add(box, el("summary", null, "thinking"), markdown(block.text));
        return box;
      }
      case "tool_call": {
        const box = el("div", "call");
        add(box, "→ tool call ", el("span", "name", block.name), block.id ? " [" + block.id + "]" : "");
        add(box, pre(json(block.arguments)));
        return box;
      }
      case "tool_result": {
        const box = el("div", "call result" + (block.error ? " error" : ""));
        add(box, "← tool result", block.id ? " [" + block.id + "]" : "", block.error ? " (error)" : "");
        for (const inner of block.content || []) box.appendChild(blockView(inner));
        return box;
      }
      case "image":
      case "file":
        return el("div", "fact", "(" + block.type + ")");
      default:
        return el("div", "fact", "(" + (block.what || block.type) + ")");
    }
  }

  function messageView(role, blocks) {
    const box = el("div", "msg " + role.replace(/[^a-z]/g, ""));
    const body = el("div", "body");
    for (const block of blocks || []) body.appendChild(blockView(block));
    add(box, el("div", "role", role), body);
    return box;
  }

  function kv(object, skip) {
    const list = el("dl", "kv");
    for (const key of Object.keys(object || {}).sort()) {
      if (skip && skip.includes(key)) continue;
      add(list, el("dt", null, key), el("dd", "mono", json(object[key])));
    }
    return list;
  }

  function llmView(detail, out) {
    const p = detail.payload;
    const usage = p.usage || {};
    const facts = [
      (p.upstream || p.provider || "?") + " " + (p.endpoint || "") + ", model " + (p.model || "?"),
      "status " + (p.status === undefined ? "?" : p.status),
      typeof p.latency_ms === "number" ? Math.round(p.latency_ms) + " ms" : "",
      p.stream ? "streamed" : "",
      usage.input !== undefined ? usage.input + " → " + usage.output + " tokens" : "",
      typeof p.cost_usd === "number" ? money(p.cost_usd) : "",
      p.replayed_from !== undefined && p.replayed_from !== null ? "replayed from frame " + p.replayed_from : "",
    ].filter(Boolean);
    add(out, el("div", "meta", facts.join(" · ")));
    add(out, el("h3", null, "Messages"));
    for (const message of detail.messages || []) out.appendChild(messageView(message.role, message.blocks));
    const reply = detail.reply || {};
    add(out, el("h3", null, "Reply" + (reply.stream_events !== undefined ? " (a stream of " + reply.stream_events + " events)" : "")));
    if (reply.error !== undefined) add(out, el("p", "err", "error: " + reply.error));
    if (reply.blocks && reply.blocks.length) out.appendChild(messageView("assistant", reply.blocks));
    else if (reply.error === undefined) add(out, el("p", "fact", "(nothing)"));
  }

  function kindView(side, detail, what, out) {
    const p = detail.payload || {};
    switch (detail.kind) {
      case "llm_turn":
        llmView(detail, out);
        return;
      case "tool_call":
        add(out, el("p", p.ok === false ? "verdict-bad" : null, "tool " + (p.tool || "?") + (p.ok === false ? " (failed)" : "")));
        add(out, el("h3", null, "Arguments"), pre(json(p.args)));
        if ("result" in p) add(out, el("h3", null, "Result"), pre(json(p.result)));
        return;
      case "verify": {
        const cmd = Array.isArray(p.cmd) ? p.cmd.join(" ") : String(p.cmd || "");
        const line = p.skipped
          ? el("p", "fact", "verifier skipped (" + p.skipped + "): " + cmd)
          : el("p", p.ok ? "verdict-ok" : "verdict-bad", "verifier " + (p.ok ? "passed" : "FAILED") + ": " + cmd + " (exit " + p.exit + ")");
        add(out, line);
        if (p.output) add(out, el("h3", null, "Output" + (p.truncated ? " (truncated)" : "")), pre(p.output));
        return;
      }
      case "breaker":
        add(out, el("p", "verdict-bad", "circuit breaker " + what));
        add(out, kv(p));
        return;
      case "commit":
        add(out, el("p", "verdict-ok", "verdict: " + what));
        add(out, kv(p));
        return;
      case "discard":
        add(out, el("p", "verdict-bad", "verdict: discarded — " + what));
        add(out, kv(p));
        return;
      case "rollback": {
        const facts = DATA[side].facts;
        const mark = facts.marks.find((m) => m.seq === detail.seq);
        const back = mark ? rolledBackTo(facts, mark) : null;
        const line = el("p", null, "rollback " + what);
        if (back !== null) {
          const go = el("button", "jb-back", "go to @" + back);
          go.addEventListener("click", () => jump(side, back));
          add(line, " ", go);
        }
        add(out, line, kv(p));
        return;
      }
      default:
        add(out, el("p", null, what));
        add(out, kv(p));
    }
  }

  function sideBySide(patch) {
    const table = el("table", "sbs");
    // A fixed layout takes its widths from the first row, a hunk line spanning all four.
    const cols = el("colgroup");
    for (const cls of ["ln", "code", "ln", "code"]) cols.appendChild(el("col", "c-" + cls));
    table.appendChild(cols);
    let left = 0, right = 0, started = false;
    let dels = [], adds = [];
    const cell = (n, text, cls) => [el("td", "ln", n === null ? "" : String(n)), el("td", "mono " + cls, text === null ? "" : text)];
    const flush = () => {
      const rows = Math.max(dels.length, adds.length);
      for (let i = 0; i < rows; i++) {
        const tr = el("tr");
        const d = dels[i], a = adds[i];
        add(tr, ...(d !== undefined ? cell(++left, d, "del") : cell(null, null, "empty")));
        add(tr, ...(a !== undefined ? cell(++right, a, "add") : cell(null, null, "empty")));
        table.appendChild(tr);
      }
      dels = [];
      adds = [];
    };
    for (const line of patch.replace(/\n$/, "").split("\n")) {
      const hunk = /^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@(.*)$/.exec(line);
      if (hunk) {
        flush();
        started = true;
        left = Number(hunk[1]) - 1;
        right = Number(hunk[2]) - 1;
        const tr = el("tr", "hunk");
        const td = el("td", "mono", line);
        td.colSpan = 4;
        table.appendChild(add(tr, td));
        continue;
      }
      if (!started) {
        if (line.startsWith("--- ") || line.startsWith("+++ ")) continue;
        const tr = el("tr");
        const td = el("td", "fact", line);
        td.colSpan = 4;
        table.appendChild(add(tr, td));
        continue;
      }
      if (line.startsWith("-")) dels.push(line.slice(1));
      else if (line.startsWith("+")) adds.push(line.slice(1));
      else if (line.startsWith("\\")) continue;
      else {
        flush();
        const tr = el("tr");
        add(tr, ...cell(++left, line.slice(1), "ctx"), ...cell(++right, line.slice(1), "ctx"));
        table.appendChild(tr);
      }
    }
    flush();
    return table;
  }

  function filesView(detail, out) {
    const files = detail.files;
    const title = (detail.kind === "commit" ? "Files committed" : "Files changed") + " (" + files.length + ")";
    add(out, el("h3", null, title));
    if (detail.hidden) add(out, el("p", "fact", JSON.stringify(detail.hidden) + " hidden, as `jukebox booth diff` hides them"));
    if (!files.length) add(out, el("p", "fact", "none"));
    files.forEach((row) => {
      const box = el("div", "file");
      const head = el("div", "fhead");
      const letter = LETTERS[row.status] || "?";
      let size = "";
      if (row.size !== undefined) size = row.old_size !== undefined ? row.old_size + " → " + row.size + " bytes" : row.size + " bytes";
      if (row.target !== undefined || row.old_target !== undefined) size = "-> " + [row.old_target, row.target].filter((t) => t !== undefined).join(" → ");
      add(head, el("span", "st " + letter, letter), el("span", "path mono", row.path), el("span", "fact", size));
      const patch = row.patch || "";
      if (patch) {
        const button = el("button", "jb-diff", "diff");
        add(head, button);
        let shown = null;
        head.addEventListener("click", () => {
          if (shown) {
            shown.remove();
            shown = null;
            button.textContent = "diff";
          } else {
            shown = sideBySide(patch);
            box.appendChild(shown);
            button.textContent = "hide";
          }
        });
      } else if (row.patch === undefined && row.kind === "file") {
        add(head, el("span", "fact", "(diff: `jukebox diff -p`)"));
      }
      box.appendChild(head);
      out.appendChild(box);
    });
  }

  function frameView(side, detail) {
    const out = el("article", "frame jb-frame");
    const index = DATA[side].index;
    const what = index.what[detail.seq] || "";
    const label = SIDES.length > 1 ? side.toUpperCase() + " " : "";
    add(out, el("h2", null, label + "@" + detail.seq + " " + detail.kind));
    const t = index.t[detail.seq];
    const meta = [clock(detail.time_ns), offset(t || 0), "id " + String(detail.id).slice(0, 16)];
    if (detail.tree) meta.push("tree " + String(detail.tree).slice(0, 16));
    if (index.cost[detail.seq]) meta.push(money(index.cost[detail.seq]));
    add(out, el("div", "meta mono", meta.join(" · ")));
    if (CMP) {
      if (detail.seq < CMP.shared_prefix) add(out, el("p", "fact", "The same frame on both tapes."));
      else if (detail.seq === CMP.shared_prefix) add(out, el("p", "why", "The tapes part here."));
    }
    if (detail.error) add(out, el("p", "err", "part of this frame could not be read: " + detail.error));
    kindView(side, detail, what, out);
    if (detail.files) filesView(detail, out);
    // Built when opened: a model call's payload can hold megabytes of request and response.
    const raw = el("details", "raw");
    add(raw, el("summary", null, "the frame's payload as recorded (headers left out)"));
    raw.addEventListener("toggle", () => {
      if (raw.open && raw.childNodes.length === 1) raw.appendChild(pre(json(detail.payload)));
    });
    out.appendChild(raw);
    return out;
  }

  // ------------------------------------------------------------------ start

  header();
  comparePanel();
  strips();
  const holder = document.getElementById("timelines");
  if (CMP) document.body.classList.add("cmp");
  for (const side of SIDES) {
    timelines[side] = Timeline(side);
    holder.appendChild(timelines[side].root);
  }
  for (const side of SIDES) timelines[side].render(true);
  performance.mark("jb-timeline");
  // The callback of the next frame runs just before it is painted; a task queued from there
  // runs after: the moment the timeline is on the screen (bench/bench_viewer.py reads it).
  requestAnimationFrame(() => {
    setTimeout(() => {
      performance.mark("jb-painted");
      document.body.dataset.ready = "1";
    }, 0);
  });
  timelines.a.focus();
  const wanted = /^#([ab])@(\d+)$/.exec(location.hash);
  if (wanted && timelines[wanted[1]] && Number(wanted[2]) < DATA[wanted[1]].index.count) {
    select(wanted[1], Number(wanted[2]), true);
  }
})();
