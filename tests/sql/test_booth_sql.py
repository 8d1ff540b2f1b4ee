"""`jukebox booth run --pg`: real booths whose agents use a real database through the proxy,
and the verdict, checkpoints, rollbacks and pending booths taking the database along."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jukebox.tape.tape import Tape
from shadowfs.store import Store
from tests.sql.cluster import SCRAM_PASSWORD, SCRAM_USER, Cluster, wait_for

JUKEBOX = str(Path(sys.executable).parent / "jukebox")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="booths here run as root")

# The agent: psycopg with the booth's DATABASE_URL, one file written beside its rows.
AGENT = """
import os, subprocess, sys, psycopg
url = os.environ["DATABASE_URL"]
with psycopg.connect(url) as conn:
    conn.execute("INSERT INTO t VALUES (3, 'from the agent')")
    conn.execute("CREATE TABLE made_by_agent (x int)")
open("done.txt", "w").write(os.environ["PGPORT"])
"""

# What the agents below start with: sql(q) runs q on a connection of its own (autocommit).
SQL_AGENT = """
import os, subprocess, psycopg
url = os.environ["DATABASE_URL"]
def sql(q):
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(q).fetchall() if q.startswith("SELECT") else conn.execute(q)
"""

# Checkpoints and rolls back while running: row 4 survives, row 5 is undone with its file.
CHECKPOINTS = SQL_AGENT + """
sql("INSERT INTO t VALUES (4, 'before')")
open("a.txt", "w").write("a")
subprocess.run(["jukebox", "booth", "checkpoint", "--label", "a"], check=True)
sql("INSERT INTO t VALUES (5, 'after')")
open("b.txt", "w").write("b")
subprocess.run(["jukebox", "booth", "rollback", "--to", "a"], check=True)
seen = sql("SELECT id FROM t ORDER BY id")
open("seen.txt", "w").write(",".join(str(r[0]) for r in seen))
"""


def booth(tmp_path: Path, url: str, code: str, *args: str,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    tree = tmp_path / "tree"
    tree.mkdir(exist_ok=True)
    return subprocess.run(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tmp_path / "tapes"),
         "--pg", f"main={url}", *args, "--", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=90, cwd="/", env={**os.environ, **(env or {})},
    )


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([JUKEBOX, *args, "--tape-dir", str(tmp_path / "tapes")],
                          capture_output=True, text=True, timeout=60, cwd="/")


def frames(tmp_path: Path, tape_id: str) -> list[tuple[str, dict]]:
    tapes = tmp_path / "tapes"
    with Store.open(tapes / ".jukebox" / "store") as store:
        tape = Tape.load(tapes / f"{tape_id}.jbx", store)
        return [(f.kind, f.resolve_payload(store)) for f in tape.frames]


def table(pg: Cluster, db: str) -> str:
    return pg.psql("SELECT string_agg(id::text, ',' ORDER BY id) FROM t", db=db)


# Under --net none the agent reaches the proxy and nothing else: not the server around it.
AROUND_THE_PROXY = """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
    raise SystemExit("the agent reached the server around the proxy")
except OSError:
    pass
"""


def test_a_failed_verifier_leaves_the_database_exactly_as_before(
    pg: Cluster, db: str, tmp_path: Path
) -> None:
    before = pg.dump(db)
    failed = booth(tmp_path, pg.url(db), AGENT + AROUND_THE_PROXY.format(port=pg.port),
                   "--verify", "false", "--tape-id", "failed", "--net", "none")
    assert failed.returncode == 1, failed.stderr
    assert "verifier failed" in failed.stderr
    assert (tmp_path / "tapes" / "failed.jbx").exists()
    assert any(k == "sql" for k, _ in frames(tmp_path, "failed"))
    assert pg.dump(db) == before
    assert not (tmp_path / "tree" / "done.txt").exists()
    # Recorded without --record-sql-results: a replay cannot serve its database, and says so.
    replay = cli(tmp_path, "replay", str(tmp_path / "tapes" / "failed.jbx"), "--exec")
    assert replay.returncode == 2
    assert "--record-sql-results" in replay.stderr


def test_commit_and_a_rollback_to_a_checkpoint_while_the_agent_runs(
    pg: Cluster, db: str, tmp_path: Path
) -> None:
    # SCRAM to the server; its password never reaches the agent or the tape.
    url = pg.url(db, SCRAM_USER, SCRAM_PASSWORD)
    ok = booth(tmp_path, url, AGENT + "\nassert 'PGPASSWORD' not in os.environ\n" + CHECKPOINTS,
               "--verify", "true", "--tape-id", "ok", env={"PGPASSWORD": SCRAM_PASSWORD})
    assert ok.returncode == 0, ok.stderr
    tree = tmp_path / "tree"
    # Row 5 and b.txt came after checkpoint a and were rolled back together, the agent running.
    assert (tree / "seen.txt").read_text() == "1,2,3,4"
    assert (tree / "a.txt").exists() and not (tree / "b.txt").exists()
    assert table(pg, db) == "1,2,3,4"
    assert pg.psql("SELECT to_regclass('made_by_agent') IS NOT NULL", db=db) == "t"
    assert (tree / "done.txt").exists()
    recorded = frames(tmp_path, "ok")
    sql = [p for k, p in recorded if k == "sql"]
    assert [p["statement"] for p in sql if "INSERT" in p["statement"]] == [
        "INSERT INTO t VALUES (3, 'from the agent')",
        "INSERT INTO t VALUES (4, 'before')",
        "INSERT INTO t VALUES (5, 'after')",
    ]
    assert any(p.get("event") == "sql_commit" for k, p in recorded if k == "note")
    data = (tmp_path / "tapes" / "ok.jbx").read_bytes()
    assert SCRAM_PASSWORD.encode() not in data
    log = cli(tmp_path, "log", "ok").stdout
    assert "main#1 INSERT INTO t VALUES (3, 'from the agen… → INSERT 0 1" in log


def test_a_pending_booth_survives_a_server_restart_and_a_crash_of_its_commit(
    pg: Cluster, db: str, tmp_path: Path
) -> None:
    out = booth(tmp_path, pg.url(db), AGENT, "--commit", "never", "--tape-id", "later")
    assert out.returncode == 0, out.stderr
    assert table(pg, db) == "1,2"
    assert pg.psql("SELECT gid FROM pg_prepared_xacts") == "jukebox-later-main"
    pg.restart()
    assert table(pg, db) == "1,2"
    # `booth commit` killed past the file commit point, before COMMIT PREPARED.
    killed = subprocess.run(
        [JUKEBOX, "booth", "commit", "later", "--tape-dir", str(tmp_path / "tapes")],
        capture_output=True, text=True, timeout=60, cwd="/",
        env={**os.environ, "SHADOWFS_CRASH_AT": "applied"},
    )
    assert killed.returncode == -9
    assert table(pg, db) == "1,2"
    # The next command finishes both: the files' commit, then the database's.
    assert cli(tmp_path, "booth", "ls").returncode == 0
    assert table(pg, db) == "1,2,3"
    assert (tmp_path / "tree" / "done.txt").exists()
    assert pg.psql("SELECT count(*) FROM pg_prepared_xacts") == "0"


def test_booth_commit_and_discard_of_pending_booths(
    pg: Cluster, db: str, tmp_path: Path
) -> None:
    out = booth(tmp_path, pg.url(db), AGENT, "--commit", "never", "--tape-id", "kept")
    assert out.returncode == 0, out.stderr
    other = AGENT.replace("(3, ", "(4, ").replace("made_by_agent", "made_too")
    out = booth(tmp_path, pg.url(db), other, "--commit", "never", "--tape-id", "dropped")
    assert out.returncode == 0, out.stderr
    assert pg.psql("SELECT count(*) FROM pg_prepared_xacts") == "2"
    assert cli(tmp_path, "booth", "discard", "dropped").returncode == 0
    assert pg.psql("SELECT gid FROM pg_prepared_xacts") == "jukebox-kept-main"
    done = cli(tmp_path, "booth", "commit", "kept")
    assert done.returncode == 0, done.stderr
    assert pg.psql("SELECT count(*) FROM pg_prepared_xacts") == "0"
    assert table(pg, db) == "1,2,3"
    assert pg.psql("SELECT to_regclass('made_too') IS NULL", db=db) == "t"


def test_a_crash_after_the_file_commit_point_is_finished_by_the_next_command(
    pg: Cluster, db: str, tmp_path: Path
) -> None:
    """What a supervisor killed between the file commit point and COMMIT PREPARED leaves: the
    files committed (the booth's record gone), the transaction prepared, its ledger saying
    `committing`. Any command that opens the tape dir commits the database too; a ledger
    still `prepared` whose booth is gone was discarded: rolled back."""
    gids = {"kept": "committing", "gone": "prepared"}
    for n, (name, state) in enumerate(gids.items(), start=10):
        pg.psql(f"BEGIN; INSERT INTO t VALUES ({n}, '{name}'); "
                f"PREPARE TRANSACTION 'jukebox-{name}-main'", db=db)
        ledger = tmp_path / "tapes" / ".jukebox" / "sql" / f"{name}.json"
        ledger.parent.mkdir(parents=True, exist_ok=True)
        ledger.write_text(json.dumps({"booth": name, "state": state, "databases": [
            {"name": "main", "url": pg.url(db), "gid": f"jukebox-{name}-main"}]}))
    assert table(pg, db) == "1,2"
    assert cli(tmp_path, "booth", "ls").returncode == 0
    assert table(pg, db) == "1,2,10"
    assert pg.psql("SELECT count(*) FROM pg_prepared_xacts") == "0"
    assert not list((tmp_path / "tapes" / ".jukebox" / "sql").glob("*.json"))


def test_refusals_and_the_rows_breaker(pg: Cluster, db: str, tmp_path: Path) -> None:
    many = """
import os, psycopg
with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
    try:
        conn.execute("VACUUM t")
    except psycopg.Error as e:
        open("refused.txt", "w").write(str(e))
    for i in range(10, 20):
        conn.execute("INSERT INTO t VALUES (%s, 'x')", (i,))
"""
    out = booth(tmp_path, pg.url(db), many, "--max-sql-rows-changed", "4", "--tape-id", "b")
    assert out.returncode != 0
    assert "circuit breaker" in out.stderr
    assert table(pg, db) == "1,2"
    trips = [p for k, p in frames(tmp_path, "b") if k == "breaker"]
    assert trips and trips[0]["rule"] == "sql_rows_changed"
    errors = [p["error"]["message"] for k, p in frames(tmp_path, "b")
              if k == "sql" and p.get("error")]
    assert errors[0].startswith("jukebox: VACUUM cannot run")
    bad = cli(tmp_path, "booth", "run", "--pg", "main=mysql://x", "--", "true")
    assert bad.returncode == 2 and "postgresql://" in bad.stderr


def test_refused_before_anything_is_made(pg: Cluster, db: str, tmp_path: Path) -> None:
    """A server that cannot be reached refuses the run (exit 2) before its tape exists; so does
    one without prepared transactions, whatever the commit mode (`auto`, the default, too: its
    commit could not be atomic), before the agent has run: nothing to lose."""
    gone = booth(tmp_path, "postgresql://nobody@127.0.0.1:1/nowhere", AGENT)
    assert gone.returncode == 2
    assert "cannot connect to postgresql://nobody@127.0.0.1:1/nowhere" in gone.stderr
    assert pg.psql("SELECT count(*) FROM pg_prepared_xacts") == "0"
    pg.psql("ALTER SYSTEM SET max_prepared_transactions = 0")
    pg.restart()
    try:
        for mode in ("auto", "never"):
            refused = booth(tmp_path, pg.url(db), AGENT, "--commit", mode, "--verify", "true")
            assert refused.returncode == 2, refused.stderr
            line = refused.stderr.strip()
            assert "\n" not in line
            assert "max_prepared_transactions = 0" in line
            assert "ALTER SYSTEM SET max_prepared_transactions = 10) and restart it" in line
            assert not (tmp_path / "tapes").exists()
            assert not list((tmp_path / "tree").iterdir())  # the agent never ran
            assert table(pg, db) == "1,2"
    finally:
        pg.psql("ALTER SYSTEM RESET max_prepared_transactions")
        pg.restart()


# Reads rows into a file (extended query with psycopg, simple query with psql), so the files a
# replay ends with say whether it was served the recorded rows.
RECORDED_RESULTS = """
import os, subprocess, psycopg
n = int(os.environ.get("JB_SQL_ROUND", "1"))
with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
    conn.execute("INSERT INTO t VALUES (11, %s)", (f"round {n}",))
    rows = conn.execute("SELECT id, v FROM t WHERE id > %s ORDER BY id", (0,)).fetchall()
    with conn.cursor().copy("COPY (SELECT id FROM t ORDER BY id) TO STDOUT") as copy:
        copied = b"".join(bytes(block) for block in copy)
count = subprocess.run(["psql", "-X", "-At", "-c", "BEGIN; SELECT count(*) FROM t; COMMIT"],
                       capture_output=True, text=True, check=True).stdout
open("seen.txt", "w").write(repr(rows) + repr(copied) + count)
"""


def test_recorded_results_replay_offline_and_a_different_statement_diverges(
    pg: Cluster, db: str, tmp_path: Path
) -> None:
    out = booth(tmp_path, pg.url(db), RECORDED_RESULTS, "--record-sql-results", "--verify",
                "true", "--tape-id", "rec")
    assert out.returncode == 0, out.stderr
    seen = (tmp_path / "tree" / "seen.txt").read_text()
    assert "(11, 'round 1')" in seen and "BEGIN\n3\nCOMMIT" in seen
    kept = [p for k, p in frames(tmp_path, "rec") if k == "sql" and "SELECT id, v" in
            p["statement"]]
    assert kept and kept[0]["result"]  # the rows, base64 of the server's messages
    # The database changes under the tape: a replay never asks it (and runs under --net none).
    pg.psql("DELETE FROM t", db=db)
    replay = cli(tmp_path, "replay", str(tmp_path / "tapes" / "rec.jbx"), "--exec", "--json")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    report = json.loads(replay.stdout)
    assert report["ok"] and report["difference"] is None
    # Another statement than the recorded one is a divergence, named with both.
    diverged = subprocess.run(
        [JUKEBOX, "replay", str(tmp_path / "tapes" / "rec.jbx"), "--exec", "--json",
         "--tape-dir", str(tmp_path / "tapes")],
        capture_output=True, text=True, timeout=60, cwd="/",
        env={**os.environ, "JB_SQL_ROUND": "2"},
    )
    assert diverged.returncode == 1, diverged.stdout + diverged.stderr
    difference = json.loads(diverged.stdout)["difference"]
    assert "the statement differs from the recorded one" in difference
    assert "['round 1']" in difference and "['round 2']" in difference
    fork = cli(tmp_path, "fork", str(tmp_path / "tapes" / "rec.jbx"), "--at", "3", "--exec")
    assert fork.returncode == 2 and "used --pg databases" in fork.stderr



def test_a_lock_held_too_long_trips_the_breaker_and_lets_the_waiter_go(
    pg: Cluster, db: str, tmp_path: Path
) -> None:
    holder = """
import os, time, psycopg
with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
    conn.execute("UPDATE t SET v = 'agent' WHERE id = 1")
    time.sleep(60)
"""
    tree = tmp_path / "tree"
    tree.mkdir()
    agent = subprocess.Popen(
        [JUKEBOX, "booth", "run", "--tree", str(tree), "--tape-dir", str(tmp_path / "tapes"),
         "--pg", f"main={pg.url(db)}", "--max-sql-lock-seconds", "1", "--tape-id", "locks",
         "--", sys.executable, "-c", holder],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
    )
    try:
        # Once the booth's transaction holds row 1, another client updates it and waits.
        holds = ("SELECT count(*) > 0 FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                 "WHERE a.application_name = 'jukebox booth locks' "
                 "AND l.locktype = 'transactionid'")
        wait_for(lambda: pg.psql(holds, db=db) == "t", timeout=60)
        other = pg.psql("UPDATE t SET v = 'other' WHERE id = 1 RETURNING v", db=db)
        assert other.startswith("other")
        _, err = agent.communicate(timeout=60)
    finally:
        agent.kill()
    assert agent.returncode != 0
    assert "circuit breaker tripped (sql_lock_held)" in err
    trips = [p for k, p in frames(tmp_path, "locks") if k == "breaker"]
    assert trips and trips[0]["rule"] == "sql_lock_held"
    assert "more than --max-sql-lock-seconds 1" in trips[0]["detail"]
    assert pg.psql("SELECT v FROM t WHERE id = 1", db=db) == "other"


@pytest.mark.parametrize("point", ["prepare", "applied"])
def test_a_supervisor_killed_mid_commit_leaves_files_and_database_agreeing(
    pg: Cluster, db: str, tmp_path: Path, point: str
) -> None:
    """`--commit auto`, the supervisor SIGKILLed at the worst instants of its verdict: with the
    database transaction prepared and the files' commit not yet at its commit point
    (`prepare`), and past the files' commit point before COMMIT PREPARED (`applied`). After
    the next command's recovery the files and the database agree, and the prepared
    transaction is finished or still owned by the booth handed back pending."""
    tree, ledger = tmp_path / "tree", tmp_path / "tapes" / ".jukebox" / "sql" / "cut.json"
    killed = booth(tmp_path, pg.url(db), AGENT, "--verify", "true", "--tape-id", "cut",
                   env={"SHADOWFS_CRASH_AT": point})
    assert killed.returncode == -9, killed.stderr
    # Killed with the transaction prepared: nothing of it is visible yet.
    assert pg.psql("SELECT gid FROM pg_prepared_xacts") == "jukebox-cut-main"
    assert table(pg, db) == "1,2"
    recovered = cli(tmp_path, "booth", "ls", "--json")
    assert recovered.returncode == 0, recovered.stderr
    if point == "applied":  # past both commit points: both committed, nothing left prepared
        assert "recovered the interrupted commit of booth cut: finished" in recovered.stderr
        assert (tree / "done.txt").exists()
        assert table(pg, db) == "1,2,3"
        assert pg.psql("SELECT count(*) FROM pg_prepared_xacts") == "0"
        assert not ledger.exists()
        assert json.loads(recovered.stdout) == []
        return
    # Before the files' commit point: both undone, the booth pending with its transaction
    # prepared (its ledger back to `prepared`, so a discard rolls it back) ...
    assert "recovered the interrupted commit of booth cut: undone" in recovered.stderr
    assert not (tree / "done.txt").exists()
    assert table(pg, db) == "1,2"
    assert json.loads(ledger.read_text())["state"] == "prepared"
    assert [b["status"] for b in json.loads(recovered.stdout)] == ["pending"]
    assert pg.psql("SELECT gid FROM pg_prepared_xacts") == "jukebox-cut-main"
    # ... which `booth commit` finishes whole: the files, then the database.
    done = cli(tmp_path, "booth", "commit", "cut")
    assert done.returncode == 0, done.stderr
    assert (tree / "done.txt").exists()
    assert table(pg, db) == "1,2,3"
    assert pg.psql("SELECT count(*) FROM pg_prepared_xacts") == "0"
    assert not ledger.exists()


def test_a_supervisor_killed_during_prepare_transaction_commits_neither(
    pg: Cluster, db: str, tmp_path: Path
) -> None:
    """`--commit auto`, the supervisor SIGKILLed during its PREPARE TRANSACTION (the crash
    point `sql-prepared`: the server has prepared it, the supervisor has recorded nothing
    more): the files' commit never began. After the next command neither is committed, the
    ledger says `prepared` (never to be committed alone), a commit of a checkpoint is
    refused, and `booth discard` rolls both back, leaving nothing prepared."""
    tree, ledger = tmp_path / "tree", tmp_path / "tapes" / ".jukebox" / "sql" / "prep.json"
    killed = booth(tmp_path, pg.url(db), AGENT, "--verify", "true", "--tape-id", "prep",
                   env={"SHADOWFS_CRASH_AT": "sql-prepared"})
    assert killed.returncode == -9, killed.stderr
    assert pg.psql("SELECT gid FROM pg_prepared_xacts") == "jukebox-prep-main"
    listed = cli(tmp_path, "booth", "ls", "--json")
    assert [b["status"] for b in json.loads(listed.stdout)] == ["crashed"]
    assert json.loads(ledger.read_text())["state"] == "prepared"
    refused = cli(tmp_path, "booth", "commit", "prep", "--at", "0")
    assert refused.returncode == 1 and "one prepared transaction" in refused.stderr
    assert not (tree / "done.txt").exists() and table(pg, db) == "1,2"
    gone = cli(tmp_path, "booth", "discard", "prep")
    assert gone.returncode == 0, gone.stderr
    assert pg.psql("SELECT count(*) FROM pg_prepared_xacts") == "0"
    assert table(pg, db) == "1,2" and not (tree / "done.txt").exists() and not ledger.exists()


# Rolls back while other connections hold transactions open: one that wrote, one that only
# read, one failed (which keeps the booth's session until its ROLLBACK).
OPEN_BLOCKS = """
import os, subprocess, time, psycopg
def jb(*args):
    return subprocess.run(["jukebox", "booth", *args], capture_output=True, text=True)
url = os.environ["DATABASE_URL"]
jb("checkpoint", "--label", "early")  # before any connection: nothing ran yet
auto = psycopg.connect(url, autocommit=True)
def ids():
    return ",".join(str(r[0]) for r in auto.execute("SELECT id FROM t ORDER BY id"))
auto.execute("INSERT INTO t VALUES (5, 'kept')")
jb("checkpoint", "--label", "a")
held = psycopg.connect(url)  # psycopg opens a block before its first statement
held.execute("INSERT INTO t VALUES (6, 'in an open block')")
reader = psycopg.connect(url)
reader.execute("SELECT count(*) FROM t").fetchone()
failed = psycopg.connect(url)
try:
    failed.execute("SELECT 1/0")
except psycopg.errors.DivisionByZero:
    pass
start = time.monotonic()
mid = jb("checkpoint", "--label", "mid")  # the state before the open blocks, at once
out = [f"{mid.returncode} {time.monotonic() - start:.1f}"]
start = time.monotonic()
out += [str(jb("rollback", "--to", "a").returncode), f"{time.monotonic() - start:.1f}"]
for conn in (held, failed):
    try:
        conn.execute("SELECT 1")
        out.append("ran")
    except psycopg.errors.InFailedSqlTransaction as error:
        out.append(str(error).splitlines()[0])
    conn.rollback()
out.append(str(reader.execute("SELECT count(*) FROM t").fetchone()[0]))
reader.commit()
held.execute("INSERT INTO t VALUES (7, 'after')")
held.commit()
out.append(ids())
out.append(str(jb("rollback", "--to", "early").returncode))
out.append(ids())
gone = jb("rollback", "--to", "a")  # past it already: refused, the database still serves
out.append(f"{gone.returncode} {gone.stderr.strip()}")
auto.execute("INSERT INTO t VALUES (8, 'last')")
out.append(ids())
open("seen.txt", "w").write("\\n".join(out))
"""


def test_a_rollback_undoes_other_connections_open_transactions(
    pg: Cluster, db: str, tmp_path: Path
) -> None:
    """`booth checkpoint` and `booth rollback` while other connections of the agent hold
    transactions open go at once (they used to wait 10 s for a block that wrote and fail): a
    block that wrote or failed is
    undone with the rest and told so at its next statement, then runs again after its
    ROLLBACK; a block that only read carries on. A checkpoint taken before the agent's first
    connection is the database's start; one a rollback went past is refused, and the booth's
    transaction is not harmed by asking."""
    out = booth(tmp_path, pg.url(db), OPEN_BLOCKS, "--verify", "true", "--tape-id", "open")
    assert out.returncode == 0, out.stderr
    seen = (tmp_path / "tree" / "seen.txt").read_text().splitlines()
    mid, code, took, held, failed, counted, after, early, at_start, gone, last = seen
    assert mid.split()[0] == "0" and float(mid.split()[1]) < 5  # it waited 10 s and failed
    assert code == "0" and float(took) < 5
    undone = ("jukebox: the booth rolled back to checkpoint 2 while this transaction was open, "
              "which undid its work; commands are ignored until ROLLBACK")
    assert held == failed == undone
    assert counted == "3"  # 1, 2, 5: row 6 went with the rollback
    assert after == "1,2,5,7"
    assert early == "0" and at_start == "1,2"
    assert gone.startswith("2 ") and "cannot go to checkpoint 2" in gone
    assert last == "1,2,8"
    assert table(pg, db) == "1,2,8"


# The unlabelled checkpoint's line, which a booth answers without parsing it, takes the database
# along like any checkpoint (with --pg its plain handler serves it: a savepoint first).
UNLABELLED = SQL_AGENT + """
import time
from jukebox.booth.control import request
sql("INSERT INTO t VALUES (4, 'before')")
open("a.txt", "w").write("a")
time.sleep(0.2)  # the step folded: the compiled path would answer, but not with --pg
cp = request({"op": "checkpoint"})
sql("INSERT INTO t VALUES (5, 'after')")
open("b.txt", "w").write("b")
request({"op": "rollback", "to": cp["checkpoint"]})
seen = sql("SELECT id FROM t ORDER BY id")
open("seen.txt", "w").write(",".join(str(r[0]) for r in seen))
"""


def test_an_unlabelled_checkpoint_request_takes_the_database_along(
    pg: Cluster, db: str, tmp_path: Path
) -> None:
    out = booth(tmp_path, pg.url(db), UNLABELLED, "--verify", "true", "--tape-id", "quick")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "tree" / "seen.txt").read_text() == "1,2,4"
    assert not (tmp_path / "tree" / "b.txt").exists()
    assert table(pg, db) == "1,2,4"
