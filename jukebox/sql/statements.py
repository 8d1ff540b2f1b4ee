"""What each statement the agent sends is, as PostgreSQL's own parser sees it (pglast wraps
libpg_query): ordinary work, the agent's transaction control (which the proxy turns into
savepoints), or something the booth's one transaction cannot hold (refused).

A statement the parser cannot read is refused too: forwarding text the proxy did not understand
could hide a COMMIT from it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import pglast

# Savepoints of the proxy's own (the agent's transaction, the booth's checkpoints): an agent
# that names one could release or roll back past the booth's own state.
RESERVED_PREFIX = "jukebox_"

PLAIN = "plain"
BEGIN = "begin"
COMMIT = "commit"
ROLLBACK = "rollback"
SAVEPOINT = "savepoint"  # SAVEPOINT, RELEASE, ROLLBACK TO: passed on inside a transaction block
REFUSED = "refused"

# SQLSTATE for a statement that cannot run in the booth's transaction:
# active_sql_transaction ("cannot run inside a transaction block") and syntax_error.
NOT_IN_TRANSACTION = "25001"
SYNTAX_ERROR = "42601"


@dataclass(frozen=True)
class Statement:
    text: str
    kind: str
    refusal: str = ""  # why, for REFUSED
    code: str = ""  # its SQLSTATE
    savepoint: str | None = None  # the agent's savepoint name, for SAVEPOINT
    # Reads only (a SELECT without FOR UPDATE, INTO or a writing WITH; SHOW; the transaction
    # control the proxy answers itself): it may run while another connection's transaction
    # block is open (jukebox.sql.session). A function that writes, called by a SELECT, is not
    # seen: it counts as a read.
    reads: bool = False


def _refuse(text: str, what: str, why: str = "") -> Statement:
    return Statement(
        text,
        REFUSED,
        f"jukebox: {what} cannot run inside the booth's transaction"
        + (f" ({why})" if why else "")
        + "; it was refused, nothing ran. Run it outside the booth after its verdict",
        NOT_IN_TRANSACTION,
    )


# The parser's tree comes as JSON (libpg_query's own output) and is read as plain dicts: building
# pglast's Python AST instead cost ~60 µs a statement, most of what the proxy spent on one
# (texts with literals in them, as `pgbench -M simple` sends, are never twice the same, so
# the cache below does not spare it). In that JSON a node is {"TypeName": {fields}}, and a
# field at its default (false, 0, empty) is left out.
Node = dict[str, Any]


def _node(wrapped: Any) -> tuple[str, Node]:
    """("SelectStmt", its fields) of {"SelectStmt": {...}}."""
    if isinstance(wrapped, dict) and len(wrapped) == 1:
        name, fields = next(iter(wrapped.items()))
        if isinstance(fields, dict):
            return name, fields
    return "", {}


def _has_option(options: Any, name: str) -> bool:
    return any(_node(option)[1].get("defname") == name for option in options or ())


_WRITES = ("InsertStmt", "UpdateStmt", "DeleteStmt", "MergeStmt")


def _reads_only(kind: str, node: Node) -> bool:
    if kind == "VariableShowStmt":
        return True
    if kind != "SelectStmt" or node.get("lockingClause") or node.get("intoClause"):
        return False
    ctes = (node.get("withClause") or {}).get("ctes") or ()
    return not any(_node(_node(cte)[1].get("ctequery"))[0] in _WRITES for cte in ctes)


def classify_node(text: str, kind: str, node: Node) -> Statement:
    if kind == "TransactionStmt":
        what = node.get("kind", "")
        if what in ("TRANS_STMT_BEGIN", "TRANS_STMT_START"):
            return Statement(text, BEGIN, reads=True)
        if what == "TRANS_STMT_COMMIT":
            if node.get("chain"):
                return _refuse(text, "COMMIT AND CHAIN", "use COMMIT, then BEGIN")
            return Statement(text, COMMIT, reads=True)
        if what == "TRANS_STMT_ROLLBACK":
            if node.get("chain"):
                return _refuse(text, "ROLLBACK AND CHAIN", "use ROLLBACK, then BEGIN")
            return Statement(text, ROLLBACK, reads=True)
        if what in ("TRANS_STMT_SAVEPOINT", "TRANS_STMT_RELEASE", "TRANS_STMT_ROLLBACK_TO"):
            name = node.get("savepoint_name") or ""
            if name.lower().startswith(RESERVED_PREFIX):
                return Statement(
                    text,
                    REFUSED,
                    f"jukebox: savepoint names starting with {RESERVED_PREFIX} are the booth's "
                    "own; pick another name",
                    "42939",  # reserved_name
                )
            return Statement(text, SAVEPOINT, savepoint=name)
        # PREPARE TRANSACTION, COMMIT PREPARED, ROLLBACK PREPARED: the booth's verdict does these.
        return _refuse(text, "two-phase commit", "the booth's verdict prepares and commits")
    if kind == "CreatedbStmt":
        return _refuse(text, "CREATE DATABASE")
    if kind == "DropdbStmt":
        return _refuse(text, "DROP DATABASE")
    if kind == "AlterDatabaseStmt" and _has_option(node.get("options"), "tablespace"):
        return _refuse(text, "ALTER DATABASE SET TABLESPACE")
    if kind == "VacuumStmt" and node.get("is_vacuumcmd"):
        return _refuse(text, "VACUUM")
    if kind == "IndexStmt" and node.get("concurrent"):
        return _refuse(text, "CREATE INDEX CONCURRENTLY", "drop CONCURRENTLY: in the booth "
                       "nobody else sees the table being indexed")
    if kind == "DropStmt" and node.get("concurrent"):
        return _refuse(text, "DROP INDEX CONCURRENTLY", "drop CONCURRENTLY")
    if kind == "ReindexStmt" and (
        _has_option(node.get("params"), "concurrently") or not node.get("relation")
    ):
        return _refuse(text, "REINDEX CONCURRENTLY or of a whole schema or database")
    if kind == "ClusterStmt" and not node.get("relation"):
        return _refuse(text, "CLUSTER without a table")
    if kind == "AlterSystemStmt":
        return _refuse(text, "ALTER SYSTEM", "it writes the server's configuration file")
    if kind in ("CreateTableSpaceStmt", "DropTableSpaceStmt"):
        return _refuse(text, "CREATE or DROP TABLESPACE")
    if kind in ("CreateSubscriptionStmt", "AlterSubscriptionStmt", "DropSubscriptionStmt"):
        return _refuse(text, "a subscription command")
    if kind == "DiscardStmt":
        return _refuse(text, "DISCARD", "the booth's session is shared by all its connections")
    return Statement(text, PLAIN, reads=_reads_only(kind, node))


@functools.lru_cache(maxsize=2048)
def split(query: str) -> tuple[Statement, ...]:
    """The statements of one query string, each classified; an unreadable string is one
    refused statement. An empty string is no statement. Cached: an agent repeats its
    statements, and parsing is most of what the proxy adds to one."""
    return tuple(_split(query))


def _split(query: str) -> list[Statement]:
    try:
        raws = json.loads(pglast.parser.parse_sql_json(query)).get("stmts") or ()
    except pglast.parser.ParseError as error:
        return [Statement(
            query, REFUSED,
            f"jukebox: the booth's SQL proxy cannot parse this statement ({error}); it was "
            "refused, nothing ran", SYNTAX_ERROR,
        )]
    except Exception as error:  # pglast is C underneath: whatever it raises is a refusal
        return [Statement(query, REFUSED, f"jukebox: unreadable statement ({error})",
                          SYNTAX_ERROR)]
    raw = query.encode()
    out = []
    for stmt in raws:
        start = stmt.get("stmt_location") or 0
        length = stmt.get("stmt_len") or 0
        end = start + length if length else len(raw)
        text = raw[start:end].decode("utf-8", "replace").strip()
        out.append(classify_node(text, *_node(stmt.get("stmt"))))
    return out


@functools.lru_cache(maxsize=2048)
def may_write(query: str) -> bool:
    """`not reads_only(split(query))`, cached: asked for every Bind and Execute of an agent's
    prepared statements, which repeat."""
    return not reads_only(split(query))


def reads_only(stmts: tuple[Statement, ...] | list[Statement]) -> bool:
    """Whether running `stmts` writes nothing (a refused statement runs nothing)."""
    return all(s.reads or s.kind == REFUSED for s in stmts)
