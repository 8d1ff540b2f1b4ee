"""What each statement the agent sends is, as PostgreSQL's own parser sees it (pglast wraps
libpg_query): ordinary work, the agent's transaction control (which the proxy turns into
savepoints), or something the booth's one transaction cannot hold (refused).

A statement the parser cannot read is refused too: forwarding text the proxy did not understand
could hide a COMMIT from it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pglast
from pglast import ast
from pglast.enums.parsenodes import TransactionStmtKind as K

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


def _has_option(params: tuple | None, name: str) -> bool:
    return any(getattr(p, "defname", None) == name for p in params or ())


_WRITES = (ast.InsertStmt, ast.UpdateStmt, ast.DeleteStmt, ast.MergeStmt)


def _reads_only(node: object) -> bool:
    if isinstance(node, ast.VariableShowStmt):
        return True
    if not isinstance(node, ast.SelectStmt) or node.lockingClause or node.intoClause:
        return False
    with_ = node.withClause
    return not (with_ is not None and any(
        isinstance(getattr(cte, "ctequery", None), _WRITES) for cte in with_.ctes or ()
    ))


def classify_node(text: str, node: object) -> Statement:
    if isinstance(node, ast.TransactionStmt):
        kind = node.kind
        if kind in (K.TRANS_STMT_BEGIN, K.TRANS_STMT_START):
            return Statement(text, BEGIN, reads=True)
        if kind == K.TRANS_STMT_COMMIT:
            if node.chain:
                return _refuse(text, "COMMIT AND CHAIN", "use COMMIT, then BEGIN")
            return Statement(text, COMMIT, reads=True)
        if kind == K.TRANS_STMT_ROLLBACK:
            if node.chain:
                return _refuse(text, "ROLLBACK AND CHAIN", "use ROLLBACK, then BEGIN")
            return Statement(text, ROLLBACK, reads=True)
        if kind in (K.TRANS_STMT_SAVEPOINT, K.TRANS_STMT_RELEASE, K.TRANS_STMT_ROLLBACK_TO):
            name = node.savepoint_name or ""
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
    if isinstance(node, ast.CreatedbStmt):
        return _refuse(text, "CREATE DATABASE")
    if isinstance(node, ast.DropdbStmt):
        return _refuse(text, "DROP DATABASE")
    if isinstance(node, ast.AlterDatabaseStmt) and _has_option(node.options, "tablespace"):
        return _refuse(text, "ALTER DATABASE SET TABLESPACE")
    if isinstance(node, ast.VacuumStmt) and node.is_vacuumcmd:
        return _refuse(text, "VACUUM")
    if isinstance(node, ast.IndexStmt) and node.concurrent:
        return _refuse(text, "CREATE INDEX CONCURRENTLY", "drop CONCURRENTLY: in the booth "
                       "nobody else sees the table being indexed")
    if isinstance(node, ast.DropStmt) and node.concurrent:
        return _refuse(text, "DROP INDEX CONCURRENTLY", "drop CONCURRENTLY")
    if isinstance(node, ast.ReindexStmt) and (
        _has_option(node.params, "concurrently") or node.relation is None
    ):
        return _refuse(text, "REINDEX CONCURRENTLY or of a whole schema or database")
    if isinstance(node, ast.ClusterStmt) and node.relation is None:
        return _refuse(text, "CLUSTER without a table")
    if isinstance(node, ast.AlterSystemStmt):
        return _refuse(text, "ALTER SYSTEM", "it writes the server's configuration file")
    if isinstance(node, (ast.CreateTableSpaceStmt, ast.DropTableSpaceStmt)):
        return _refuse(text, "CREATE or DROP TABLESPACE")
    if isinstance(node, (ast.CreateSubscriptionStmt, ast.AlterSubscriptionStmt,
                         ast.DropSubscriptionStmt)):
        return _refuse(text, "a subscription command")
    if isinstance(node, ast.DiscardStmt):
        return _refuse(text, "DISCARD", "the booth's session is shared by all its connections")
    return Statement(text, PLAIN, reads=_reads_only(node))


@functools.lru_cache(maxsize=2048)
def split(query: str) -> tuple[Statement, ...]:
    """The statements of one query string, each classified; an unreadable string is one
    refused statement. An empty string is no statement. Cached: an agent repeats its
    statements, and parsing is most of what the proxy adds to one."""
    return tuple(_split(query))


def _split(query: str) -> list[Statement]:
    try:
        raws = pglast.parse_sql(query)
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
        start = stmt.stmt_location or 0
        end = start + stmt.stmt_len if stmt.stmt_len else len(raw)
        text = raw[start:end].decode("utf-8", "replace").strip()
        out.append(classify_node(text, stmt.stmt))
    return out


def reads_only(stmts: tuple[Statement, ...] | list[Statement]) -> bool:
    """Whether running `stmts` writes nothing (a refused statement runs nothing)."""
    return all(s.reads or s.kind == REFUSED for s in stmts)
