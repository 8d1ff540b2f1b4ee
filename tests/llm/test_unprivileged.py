"""The proxy in a booth run by an unprivileged user (nobody, through a user namespace), under
`--net none`: the real openai SDK's call reaches the upstream through the proxy, which listens
in the agent's own network namespace, and is recorded without its key."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from jukebox.tape.tape import Tape
from shadowfs.store import Store
from tests.booth.conftest import NOBODY, nobody_dir, nobody_python  # noqa: F401 (fixtures)
from tests.llm.conftest import OPENAI_KEY
from tests.llm.upstream import FakeUpstream

AGENT = """
import openai
o = openai.OpenAI(max_retries=0)
r = o.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
print(r.choices[0].message.content)
"""


def test_an_unprivileged_booth_records_through_its_proxy_under_net_none(
    nobody_python: str,  # noqa: F811
    nobody_dir: Path,  # noqa: F811
    upstream: FakeUpstream,
) -> None:
    tree, tapes = nobody_dir / "tree", nobody_dir / "tapes"
    tree.mkdir()
    (tree / "agent.py").write_text(AGENT)
    for path in (tree, tree / "agent.py"):
        os.chown(path, NOBODY, NOBODY)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(nobody_dir),
        "OPENAI_API_KEY": OPENAI_KEY,
        "OPENAI_BASE_URL": upstream.openai_url,  # the proxy's upstream, not the agent's
    }
    cli = "import sys; from jukebox.cli import main; sys.argv[0] = 'jukebox'; sys.exit(main())"
    proc = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         nobody_python, "-c", cli, "booth", "run", "--net", "none", "--tree", str(tree),
         "--tape-dir", str(tapes), "--tape-id", "nobody", "--", nobody_python, "agent.py"],
        capture_output=True, text=True, env=env, timeout=120, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "echo: hi\n"
    assert [path for _, path, _, _ in upstream.seen] == ["/v1/chat/completions"]
    with Store.open(tapes / ".jukebox" / "store") as store:
        tape = Tape.load(tapes / "nobody.jbx", store)
        turns = [f.payload for f in tape.frames if f.kind == "llm_turn"]
        assert tape.frames[0].payload["policy"]["net"] == "none"
    assert len(turns) == 1 and turns[0]["status"] == 200
    assert turns[0]["usage"]["input"] > 0
    assert OPENAI_KEY.encode() not in (tapes / "nobody.jbx").read_bytes()
    assert all(os.stat(p).st_uid == NOBODY for p in (tapes, tapes / "nobody.jbx"))
