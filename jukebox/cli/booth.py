"""`jukebox booth ...`: run an agent in a shadow booth and manage pending booths."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from jukebox.cli import cli, skip_teardown
from jukebox.cli.booth_view import view_path_options
from jukebox.cli.options import listed_tape_dir, tape_dir_option
from jukebox.cli.review_options import exclude_options

if TYPE_CHECKING:
    from jukebox.booth.paths import BoothPaths


@cli.group()
def booth() -> None:
    """Run any agent over its working tree in a copy-on-write booth."""


_ALLOW_HOOKS_HELP = (
    "Commit even changes to files that run code on the host later (git hooks and config, "
    ".envrc, editor tasks: docs/reliability.md); without it such a booth stays pending."
)


@booth.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--tree", default=".", show_default=True, help="The agent's working tree.")
@click.option(
    "--tape-dir",
    default=None,
    help="Where tapes go ($JUKEBOX_TAPE_DIR, else ~/.local/share/jukebox/tapes).",
)
@click.option("--tape-id", default=None, help="The tape's id (also the booth's id).")
@click.option("--name", default=None, help="A name for the run, recorded on the tape.")
@click.option("--fs", type=click.Choice(["fuse", "overlay"]), default="fuse", show_default=True)
@click.option("--image", default=None, help="Sandbox image name or .toml path (default: host).")
@click.option(
    "--commit",
    "commit_mode",
    type=click.Choice(["auto", "ask", "never"]),
    default="auto",
    show_default=True,
    help="auto: commit on success, roll back on failure; ask; never: keep the booth pending.",
)
@click.option("--verify", "verify_cmd", default=None, help="Verifier command run in the booth.")
@click.option("--net", type=click.Choice(["host", "none"]), default=None, help="Network access.")
@click.option(
    "--checkpoint-every", type=float, default=None, help="Automatic checkpoint every N seconds."
)
@click.option(
    "--max-cost-usd", type=float, default=None, help="Circuit breaker: stop past this spend (USD)."
)
@click.option(
    "--unknown-cost",
    default=None,
    metavar="deny|warn|price=IN/OUT",
    help="With --max-cost-usd, a model without a price: refuse its calls (deny), count it $0 "
    "with a warning (warn, the default), or price it at IN/OUT dollars per million tokens.",
)
@click.option(
    "--max-tokens", type=int, default=None, help="Circuit breaker: stop past this many tokens."
)
@click.option(
    "--max-turns", type=int, default=None, help="Circuit breaker: at most this many model calls."
)
@click.option(
    "--max-repeat",
    type=int,
    default=None,
    help="Circuit breaker: stop at N near-duplicate outputs (or N same failures) in a row.",
)
@click.option(
    "--max-scratch",
    default=None,
    metavar="SIZE",
    help="Stop the agent when its changes would stage more than SIZE (like 512M, 20G) in all; "
    "--fs fuse. Also caps the model traffic the LLM proxy records (else 1 GiB). "
    "Default: the image's limits.scratch, else none.",
)
@click.option(
    "--upstream",
    "upstreams",
    multiple=True,
    metavar="NAME=URL",
    help="Another OpenAI-compatible model server (Ollama, vLLM, OpenRouter, ...), recorded "
    "through the proxy: the agent finds it at $JUKEBOX_UPSTREAM_NAME_BASE_URL. Repeatable; "
    "NAME=anthropic+URL for an Anthropic-compatible one; openai=URL or anthropic=URL replace "
    "the built-in upstreams (docs/llm-proxy.md).",
)
@click.option(
    "--pg",
    "pg",
    multiple=True,
    metavar="NAME=URL",
    help="A PostgreSQL database (postgresql://user@host:port/db) the agent reaches through a "
    "savepoint proxy at $DATABASE_URL / $PG* ($NAME_DATABASE_URL): its work commits or vanishes "
    "with the booth's files. Repeatable (docs/sql.md).",
)
@click.option(
    "--max-sql-rows-changed",
    type=int,
    default=None,
    help="Circuit breaker: stop the agent once its statements changed more database rows.",
)
@click.option(
    "--max-sql-lock-seconds",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Circuit breaker: stop the agent and roll its database work back once another client "
    "waited longer on a lock the booth holds; the agent's own lock waits end after it too.",
)
@click.option(
    "--record-sql-results",
    is_flag=True,
    help="Keep what each --pg statement answered (rows, scrubbed of secrets) on its sql frame, "
    "so `jukebox replay --exec` can run the agent again without the database.",
)
@click.option("--allow-hooks", is_flag=True, help=_ALLOW_HOOKS_HELP)
@click.option(
    "--strict-sandbox",
    is_flag=True,
    help="Refuse to start (exit 2) when a protection cannot be applied here, e.g. cgroups "
    "as a user who cannot create them.",
)
@click.option(
    "--no-seccomp",
    is_flag=True,
    help="Run without the system call filter (to measure its cost, or for an agent it "
    "breaks; an image can loosen it by group instead: [seccomp] allow).",
)
@click.option(
    "--mcp-config",
    type=click.Path(dir_okay=False),
    default=None,
    help="A .mcp.json (Claude Code, Cursor): its stdio servers are the ones staged MCP calls "
    "run against at the commit; the agent finds it rewritten through `jukebox mcp wrap` in "
    "$JUKEBOX_MCP_CONFIG (docs/mcp.md).",
)
@click.option(
    "--mcp-upstream",
    "mcp_upstreams",
    multiple=True,
    metavar="NAME=URL",
    help="A streamable-HTTP MCP server, served to the agent through the stage gate at "
    "$JUKEBOX_MCP_URL/NAME/ (repeatable; docs/mcp.md).",
)
@click.option("--mcp-policy", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="MCP tool policy (TOML: mode, and a [tools] table of \"PATTERN\" = "
              "\"allow|stage|deny|ask\"), for every server of --mcp-config and "
              "--mcp-upstream (docs/mcp.md).")  # fmt: skip
@click.option("--mcp-allow", multiple=True, metavar="TOOL",
              help="Forward this MCP tool's calls at once (repeatable; SERVER/TOOL or TOOL, "
              "with * and ?; after --mcp-policy's rules).")  # fmt: skip
@click.option("--mcp-stage", multiple=True, metavar="TOOL",
              help="Hold this MCP tool's calls until the verdict (repeatable).")  # fmt: skip
@click.option("--mcp-deny", multiple=True, metavar="TOOL",
              help="Refuse this MCP tool (repeatable).")  # fmt: skip
@click.option("--mcp-ask", multiple=True, metavar="TOOL",
              help="Ask the operator before this MCP tool runs (repeatable).")  # fmt: skip
@click.option("--mcp-compensate", multiple=True, metavar="TOOL=ENTRY",
              help="The call that compensates a staged call of TOOL if a later one fails at "
              "the commit: ENTRY as a policy file's [compensate] entry, {tool = \"T\", args = "
              "{...}} (or JSON); repeatable, after --mcp-policy's (docs/mcp.md).")  # fmt: skip
@click.option("--max-tool-calls", type=int, default=None, metavar="N",
              help="Circuit breaker: stop at the MCP tool call past the Nth.")  # fmt: skip
@click.option("--max-tool-repeat", type=int, default=None, metavar="N",
              help="Circuit breaker: stop at the Nth identical tool call in a row.")  # fmt: skip
@view_path_options
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    tree: str,
    tape_dir: str | None,
    tape_id: str | None,
    name: str | None,
    fs: str,
    image: str | None,
    commit_mode: str,
    verify_cmd: str | None,
    net: str | None,
    checkpoint_every: float | None,
    max_cost_usd: float | None,
    unknown_cost: str | None,
    max_tokens: int | None,
    max_turns: int | None,
    max_repeat: int | None,
    max_scratch: str | None,
    upstreams: tuple[str, ...],
    pg: tuple[str, ...],
    max_sql_rows_changed: int | None,
    record_sql_results: bool,
    max_sql_lock_seconds: float | None,
    allow_hooks: bool,
    strict_sandbox: bool,
    no_seccomp: bool,
    mcp_config: str | None,
    mcp_upstreams: tuple[str, ...],
    mcp_policy: str | None,
    mcp_allow: tuple[str, ...],
    mcp_stage: tuple[str, ...],
    mcp_deny: tuple[str, ...],
    mcp_ask: tuple[str, ...],
    mcp_compensate: tuple[str, ...],
    max_tool_calls: int | None,
    max_tool_repeat: int | None,
    cmd: tuple[str, ...],
    paths: BoothPaths | None,
) -> None:
    """Run CMD in a booth over the tree; CMD's exit status is the run's.

    A circuit breaker flag that trips stops the agent and rolls the booth back (kept pending
    under --commit never); see docs/breaker.md.
    """
    from jukebox.booth.supervisor import run_booth

    if cmd[0].startswith("-"):
        # Unknown options are let through so that CMD's own options need no `--`; one before
        # CMD is a mistyped option of ours, not a program to run (and to make a tape for).
        raise click.UsageError(f"no such option: {cmd[0]}; the agent's command goes after `--`")
    scratch_limit = None
    if max_scratch is not None:
        from jukebox.booth.images import parse_size

        try:
            scratch_limit = parse_size(max_scratch)
        except ValueError:
            raise click.BadParameter(
                f"{max_scratch!r} is not a size: write bytes or like 512M, 20G",
                param_hint="--max-scratch",
            ) from None
    llm = _llm_options(upstreams)
    databases = None
    if pg:
        from jukebox.sql.booth_link import parse_specs

        databases = parse_specs(pg)
    breaker = None
    if any(v is not None for v in (max_cost_usd, max_tokens, max_turns, max_repeat, unknown_cost)):
        # Only then: the breaker's module is imported by no booth that sets none of its flags.
        from jukebox.guard.breaker import CircuitBreaker

        breaker = CircuitBreaker.from_options(
            max_cost_usd=max_cost_usd,
            max_tokens=max_tokens,
            max_turns=max_turns,
            max_repeat=max_repeat,
            unknown_cost=unknown_cost,
        )

    # run_booth closes what it opens, whatever the outcome: no teardown needed after it.
    skip_teardown()
    code = run_booth(
        list(cmd),
        tree=tree,
        tape_dir=tape_dir,
        tape_id=tape_id,
        name=name,
        fs=fs,
        image=image,
        commit_mode=commit_mode,
        verify_cmd=verify_cmd,
        net=net,
        checkpoint_every=checkpoint_every,
        max_scratch=scratch_limit,
        breaker=breaker,
        llm=llm,
        allow_hooks=allow_hooks,
        seccomp=not no_seccomp,
        strict_sandbox=strict_sandbox,
        paths=paths,
        mcp_config=mcp_config,
        mcp_upstreams=_mcp_upstreams(mcp_upstreams),
        databases=databases,
        max_sql_rows_changed=max_sql_rows_changed,
        record_sql_results=record_sql_results,
        max_sql_lock_seconds=max_sql_lock_seconds,
        mcp_limits=_tool_limits(max_tool_calls, max_tool_repeat),
        mcp_policy=_mcp_policy(
            mcp_policy, mcp_allow, mcp_stage, mcp_deny, mcp_ask, mcp_compensate
        ),
    )
    sys.exit(code)


def _mcp_policy(path: str | None, allow: tuple[str, ...], stage: tuple[str, ...],
                deny: tuple[str, ...], ask: tuple[str, ...],
                compensate: tuple[str, ...] = ()):  # fmt: skip
    """The booth's MCP policy (jukebox.mcp.policy), or None: the tools' annotations decide."""
    if path is None and not (allow or stage or deny or ask or compensate):
        return None
    from jukebox.mcp.policy import build_policy, flag_rules

    return build_policy(None, path, flag_rules(allow, stage, deny, ask), compensate=compensate)


def _mcp_upstreams(specs: tuple[str, ...]) -> dict[str, str] | None:
    out: dict[str, str] = {}
    for spec in specs:
        name, eq, url = spec.partition("=")
        if not eq or not name or not url:
            raise click.BadParameter(f"{spec!r}: write NAME=URL", param_hint="--mcp-upstream")
        if name in out:
            raise click.BadParameter(f"{name!r} is named twice", param_hint="--mcp-upstream")
        out[name] = url
    return out or None


def _tool_limits(max_calls: int | None, max_repeat: int | None):
    if max_calls is None and max_repeat is None:
        return None
    from jukebox.mcp.limits import ToolCallLimits

    return ToolCallLimits(max_calls, max_repeat)


def _llm_options(specs: tuple[str, ...]):
    """The proxy's options for `--upstream NAME=URL` values (None: the defaults), checked with
    $JUKEBOX_UPSTREAMS before anything is made."""
    import os

    from jukebox.llm.session import LlmOptions
    from jukebox.llm.upstreams import LIST_ENV, BadUpstream, upstreams_from_env, with_named

    if not specs and not os.environ.get(LIST_ENV):
        return None

    try:
        return LlmOptions(upstreams=with_named(upstreams_from_env(os.environ), specs, os.environ))
    except BadUpstream as bad:
        raise click.BadParameter(str(bad), param_hint="--upstream") from None


def _tape_dir(tape_dir: str | None):
    return listed_tape_dir(Path(tape_dir) if tape_dir is not None else None)


@booth.command("ls")
@tape_dir_option
@click.option("--json", "as_json", is_flag=True, help="A JSON array: one object per booth.")
def ls(tape_dir: Path | None, as_json: bool) -> None:
    """List pending booths."""
    from jukebox.booth.supervisor import list_booths
    from jukebox.display.render import table, timestamp
    from jukebox.display.style import status

    records = list_booths(listed_tape_dir(tape_dir))
    if as_json:
        click.echo(json.dumps([r.to_json() for r in records], indent=1))
        return
    if not records:
        click.echo("no pending booths")
        return
    click.echo(
        table(
            ["BOOTH ID", "STATUS", "CREATED", "TREE", "NAME"],
            ([r.id, r.status, timestamp(r.created), r.tree, r.name or "-"] for r in records),
            paint={1: status},
        )
    )


def _duration(text: str | None) -> float | None:
    from jukebox.trees.realtree import parse_duration

    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a duration: write like 30s, 500ms or 2m", param_hint="--lock-timeout"
        ) from None


_AT_HELP = (
    "A checkpoint of the booth instead of its final state: its number (0 is the start) or its "
    "label (the latest with it)."
)


@booth.command("diff")
@click.argument("booth_id")
@click.option("--tape-dir", default=None)
@click.option("--at", "at", default=None, metavar="LABEL|N", help=_AT_HELP)
@click.option(
    "-p", "--patch", is_flag=True, help="Add line diffs of text files; binary files are named."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object: the trees, the changes.")
@exclude_options
def diff(
    booth_id: str,
    tape_dir: str | None,
    at: str | None,
    patch: bool,
    as_json: bool,
    excludes: tuple[str, ...],
    default_excludes: bool,
) -> None:
    """What a pending booth would change in its real tree (paths under .git/objects, .venv,
    __pycache__ and node_modules hidden unless --no-default-excludes; a commit applies them)."""
    from jukebox.booth.supervisor import change_summary_line, pending_changes
    from jukebox.display.names import name_json
    from jukebox.review.filter import ReviewFilter
    from jukebox.review.patch import text_patch

    shown = ReviewFilter.from_options(excludes, default_excludes)
    with pending_changes(_tape_dir(tape_dir), booth_id, at) as (store, base, target, every):
        changes = shown.keep(every)
        if as_json:
            rows = []
            for change in changes:
                row: dict[str, object] = {**name_json(change.path), "status": change.status}
                entry = change.new or change.old
                if entry is not None:
                    row["kind"] = entry.kind
                if entry is not None and entry.kind == "file":
                    row["size"] = entry.size
                    if entry.link:
                        row["hard_link"] = True
                if patch:
                    row["patch"] = text_patch(store, change, indent="")
                rows.append(row)
            doc: dict[str, Any] = {
                "booth": booth_id, "at": at, "from_tree": base.hex(), "to_tree": target.hex()
            }
            doc |= {"excluded": list(shown.patterns), "hidden": shown.hidden}
            click.echo(json.dumps({**doc, "changes": rows}, indent=1))
            return
        from jukebox.display import style

        for change in changes:
            click.echo(style.change_line(change_summary_line(change)))
            if patch:
                click.echo(style.patch(text_patch(store, change)), nl=False)
    if not changes:
        click.echo("no changes" + (" shown" if shown.hidden else ""))
    note = shown.hidden_note(f"jukebox booth diff {booth_id}")
    if note:
        click.echo(note)


@booth.command("commit")
@click.argument("booth_id")
@click.argument("paths", nargs=-1, metavar="[--only PATH...]")
@click.option(
    "--only",
    is_flag=True,
    help="Commit only the changes at and under the PATHs that follow (from the tree's root, or "
    "from here inside it); the rest stays pending in the booth.",
)
@click.option("--tape-dir", default=None)
@click.option("--at", "at", default=None, metavar="LABEL|N", help=_AT_HELP)
@click.option("--allow-hooks", is_flag=True, help=_ALLOW_HOOKS_HELP)
@click.option(
    "--lock-timeout",
    default=None,
    metavar="DURATION",
    callback=lambda _ctx, _param, value: _duration(value),
    help="How long to wait for another process's lock on the real tree, like 30s or 500ms "
    "(default: $JUKEBOX_LOCK_TIMEOUT, else 30s); then exit 1 naming the holder.",
)
def commit(
    booth_id: str,
    paths: tuple[str, ...],
    only: bool,
    tape_dir: str | None,
    at: str | None,
    allow_hooks: bool,
    lock_timeout: float | None,
) -> None:
    """Apply a pending booth to its real tree (exit 1 listing conflicts if it changed, or if
    the tree's path now leads to another directory; 130 if interrupted)."""
    from jukebox.booth.supervisor import commit_booth
    from jukebox.trees.realtree import recovered

    tapes = _tape_dir(tape_dir)
    if recovered(tapes, booth_id) == "finished":
        click.echo(f"committed booth {booth_id}: its interrupted commit was finished by recovery")
        return
    if paths and not only:
        from jukebox.errors import UsageError

        raise UsageError(
            f"got unexpected PATHs {' '.join(paths)!r}: to commit only them, put --only first"
        )
    if only:
        from jukebox.cli.booth_review import commit_only

        commit_only(tapes, booth_id, paths, at, allow_hooks, lock_timeout)
        return
    changes = commit_booth(tapes, booth_id, at, allow_hooks=allow_hooks, lock_timeout=lock_timeout)
    # Everything it opened is closed. The trees and diffs it keeps cached are millions of
    # objects after a 50,000-file commit, which the interpreter's teardown would walk and free
    # one by one: 0.6 s at load 7.
    skip_teardown()
    what = f"checkpoint {at} of booth" if at is not None else "booth"
    click.echo(f"committed {what} {booth_id}: {changes} change(s)")


@booth.command("discard")
@click.argument("booth_id")
@click.option("--tape-dir", default=None)
def discard(booth_id: str, tape_dir: str | None) -> None:
    """Drop a pending booth; its real tree is untouched."""
    from jukebox.booth.supervisor import discard_booth

    discard_booth(_tape_dir(tape_dir), booth_id)
    click.echo(f"discarded booth {booth_id}")


@booth.command("abort")
@click.argument("booth_id")
@click.option("--tape-dir", default=None)
def abort(booth_id: str, tape_dir: str | None) -> None:
    """Free a stuck running booth: abort its FUSE connection and kill its supervisor."""
    from jukebox.booth.abort import abort_booth

    aborted = abort_booth(_tape_dir(tape_dir), booth_id)
    what = f"FUSE connection {', '.join(map(str, aborted))}" if aborted else "no FUSE connection"
    click.echo(
        f"aborted booth {booth_id} ({what}); it is crashed now: `jukebox booth discard {booth_id}`"
    )


@booth.command("stop")
@click.argument("booth_id")
@click.option("--tape-dir", default=None)
@click.option(
    "--grace",
    default="10s",
    show_default=True,
    metavar="DURATION",
    help="How long the agent has to exit after SIGTERM before it is killed (like 30s, 500ms).",
)
def stop(booth_id: str, tape_dir: str | None, grace: str) -> None:
    """End a running booth's agent (SIGTERM, then SIGKILL after the grace period); the booth
    stays pending, to diff, commit or discard."""
    from jukebox.booth.stop import status_after_stop, stop_booth
    from jukebox.trees.realtree import parse_duration

    try:
        seconds = parse_duration(grace)
    except ValueError:
        raise click.BadParameter(
            f"{grace!r} is not a duration: write like 30s, 500ms or 2m", param_hint="--grace"
        ) from None
    tapes = _tape_dir(tape_dir)
    how = stop_booth(tapes, booth_id, seconds)
    ended = "its agent exited on SIGTERM" if how == "terminated" else (
        f"its agent was killed after {grace}"
    )
    state = status_after_stop(tapes, booth_id)
    if state == "finished":
        click.echo(f"stopped booth {booth_id} ({ended}); it is finished: `jukebox log {booth_id}`")
        return
    click.echo(
        f"stopped booth {booth_id} ({ended}); status {state}: `jukebox booth diff {booth_id}`, "
        f"then `jukebox booth commit {booth_id}` or `jukebox booth discard {booth_id}`"
    )


@booth.command("checkpoint")
@click.option("--label", default=None, help="A name to roll back to later.")
@click.option("--json", "as_json", is_flag=True)
def checkpoint(label: str | None, as_json: bool) -> None:
    """Checkpoint the booth this runs in (uses $JUKEBOX_SOCKET)."""
    from jukebox.booth.control import NUMERIC_LABEL, request

    if label is not None and label.isdigit():
        raise click.BadParameter(NUMERIC_LABEL.format(label=label), param_hint="--label")
    req: dict[str, object] = {"op": "checkpoint"}
    if label is not None:
        req["label"] = label
    response = request(req)
    if as_json:
        click.echo(json.dumps(response))
    else:
        click.echo(f"checkpoint {response['checkpoint']}" + (f" ({label})" if label else ""))


@booth.command("rollback")
@click.option("--to", "to", required=True, help="A checkpoint label or number (0 is the start).")
def rollback(to: str) -> None:
    """Roll the booth this runs in back to a checkpoint, while it keeps running."""
    from jukebox.booth.control import request

    target: str | int = int(to) if to.isdigit() else to
    response = request({"op": "rollback", "to": target})
    click.echo(f"rolled back to checkpoint {response['checkpoint']}")


@booth.command("status")
@click.option("--json", "as_json", is_flag=True)
def status(as_json: bool) -> None:
    """The booth this runs in: id, tape, checkpoints."""
    from jukebox.booth.control import request

    response = request({"op": "status"})
    if as_json:
        click.echo(json.dumps(response))
        return
    click.echo(f"booth {response['booth']}  tree {response['tree']}  tape {response['tape']}")
    staged, limit = response.get("staged_bytes"), response.get("scratch_limit")
    if staged is not None:
        from jukebox.display.render import size

        of = f" of {size(limit)} (--max-scratch)" if limit is not None else ""
        click.echo(f"  staged {size(staged)}{of}")
    for cp in response["checkpoints"]:
        click.echo(f"  {cp['n']}  {cp['label'] or ''}  {cp['tree'][:16]}")
