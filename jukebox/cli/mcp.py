"""`jukebox mcp`: MCP servers through the stage gate (docs/mcp.md)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import click

from jukebox.cli import cli
from jukebox.cli.options import tape_dir_option


@cli.group("mcp")
def mcp_group() -> None:
    """Record, gate and replay an agent's MCP tool calls (docs/mcp.md)."""


def _policy_options(fn):
    fn = click.option("--ask", "ask", multiple=True, metavar="TOOL",
                      help="Ask the operator before this tool runs (repeatable; a pattern, "
                      "SERVER/TOOL or TOOL, with * and ?).")(fn)  # fmt: skip
    fn = click.option("--deny", "deny", multiple=True, metavar="TOOL",
                      help="Refuse this tool (repeatable).")(fn)  # fmt: skip
    fn = click.option("--stage", "stage", multiple=True, metavar="TOOL",
                      help="Hold its calls until the verdict (repeatable).")(fn)  # fmt: skip
    fn = click.option("--allow", "allow", multiple=True, metavar="TOOL",
                      help="Forward this tool's calls at once (repeatable).")(fn)  # fmt: skip
    fn = click.option("--policy", "policy_file", type=click.Path(dir_okay=False), default=None,
                      help="A policy file (TOML: mode, and a [tools] table of "
                      "\"PATTERN\" = \"allow|stage|deny|ask\").")(fn)  # fmt: skip
    fn = click.option("--mode", type=click.Choice(["staged_acid", "deny", "record"]),
                      default=None,
                      help="staged_acid: stage what is not read-only (the default in a booth); "
                      "deny: refuse what is not read-only; record: forward everything (the "
                      "default outside a booth, where no verdict comes).")(fn)  # fmt: skip
    return fn


@mcp_group.command(
    "wrap", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option("--name", default=None, help="The server's name on the tape (default: CMD's name).")
@tape_dir_option
@click.option("--tape-id", default=None, help="Outside a booth: the new tape's id.")
@click.option("--replay", "replay_tape", default=None, metavar="TAPE",
              help="Serve the answers recorded on TAPE instead of starting a server (offline); "
              "a call that differs from the recorded one is a divergence (exit 1).")  # fmt: skip
@_policy_options
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="Seconds to wait for the real server's answer to a request.")  # fmt: skip
@click.option("--start-timeout", type=float, default=30.0, show_default=True,
              help="Seconds to wait for the real server to start (initialize).")  # fmt: skip
@click.option("--max-tool-calls", type=int, default=None, metavar="N",
              help="Circuit breaker: refuse every call past the Nth.")  # fmt: skip
@click.option("--max-tool-repeat", type=int, default=None, metavar="N",
              help="Circuit breaker: refuse the Nth identical call in a row.")  # fmt: skip
@click.option("--ask-timeout", type=float, default=300.0, show_default=True,
              help="In a booth: seconds to wait for the operator's answer to an ask; then "
              "the call is refused.")  # fmt: skip
@click.argument("command", nargs=-1, required=False, type=click.UNPROCESSED)
def wrap_command(
    name: str | None,
    tape_dir: Path | None,
    tape_id: str | None,
    replay_tape: str | None,
    policy_file: str | None,
    mode: str | None,
    allow: tuple[str, ...],
    stage: tuple[str, ...],
    deny: tuple[str, ...],
    ask: tuple[str, ...],
    timeout: float,
    start_timeout: float,
    max_tool_calls: int | None,
    max_tool_repeat: int | None,
    ask_timeout: float,
    command: tuple[str, ...],
) -> None:
    """Serve the stdio MCP server CMD to an agent through the stage gate: point the agent's MCP
    config at `jukebox mcp wrap --name N -- CMD ARGS...` instead of `CMD ARGS...`. Every call is
    recorded; inside a booth calls that are not read-only are staged until the verdict,
    outside one they are forwarded and the gateway writes its own tape."""
    from jukebox.errors import UsageError
    from jukebox.mcp.policy import build_policy, flag_rules

    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv and replay_tape is None:
        raise UsageError("no server to wrap: write `jukebox mcp wrap [OPTIONS] -- CMD ARGS...`")
    if timeout <= 0 or start_timeout <= 0:
        raise UsageError("--timeout and --start-timeout must be positive numbers of seconds")
    from jukebox.booth.control import SOCKET_ENV
    from jukebox.mcp.limits import ToolCallLimits

    limits = ToolCallLimits(max_tool_calls, max_tool_repeat)

    in_booth = bool(os.environ.get(SOCKET_ENV))
    if replay_tape is not None:
        _replay(replay_tape, tape_dir, tape_id, name, timeout)
        return
    server = name or os.path.basename(argv[0])
    policy = build_policy(mode, policy_file, flag_rules(allow, stage, deny, ask),
                          default_mode="staged_acid" if in_booth else "record")  # fmt: skip
    if policy.mode == "staged_acid" and not in_booth:
        raise UsageError(
            "staging needs a booth's verdict: run the agent in `jukebox booth run`, or use "
            "--mode record (forward and record) or --mode deny outside a booth"
        )
    # The SDK takes most of a second to import: only once the arguments are known good.
    import anyio

    _one_line_sdk_logs()
    from jukebox.mcp.booth_upstream import REPLAY_ENV, BoothReplayUpstream
    from jukebox.mcp.gateway import GatewayError, serve_stdio
    from jukebox.mcp.record import BoothSink, DeferredSink, TapeSink, env_scrubber

    scrubber = env_scrubber(os.environ)
    sink: Any
    stager: Any
    asker: Any
    if in_booth:  # the tape dir is hidden in a booth: the supervisor records, and stages
        # Each frame is in the supervisor's socket before the agent has its answer: an agent
        # that exits at once ends the booth, which kills this process with whatever it held.
        booth_sink = BoothSink(argv, scrubber)
        sink, stager = booth_sink, booth_sink.stage
        asker = functools.partial(booth_sink.ask, wait=ask_timeout)
    else:
        # Outside a booth frames are written after the agent has its answer, on a thread of
        # their own, and all of them when the agent closes the connection.
        sink = DeferredSink(TapeSink(tape_dir, server, argv, policy.describe(), scrubber,
                                     tape_id))  # fmt: skip
        stager = asker = None
    async def serve() -> None:
        booth_replay = None
        if in_booth and os.environ.get(REPLAY_ENV):
            # A replay or fork of a booth: the supervisor answers from the tape.
            booth_replay = BoothReplayUpstream(server, argv, scrubber, start_timeout)
        await serve_stdio(server, argv, sink, policy, timeout=timeout,
                          start_timeout=start_timeout, stager=stager,
                          limits=limits if limits.active else None, asker=asker,
                          booth_replay=booth_replay)  # fmt: skip

    try:
        anyio.run(serve)
    except BaseExceptionGroup as group:  # the SDK's task groups wrap what failed
        raise _first(group) from None
    except GatewayError:
        raise
    finally:
        sink.close()


def _replay(tape: str, tape_dir: Path | None, tape_id: str | None, name: str | None,
            timeout: float) -> None:  # fmt: skip
    import anyio

    from jukebox.errors import CheckFailed
    from jukebox.mcp.gateway import serve_stdio
    from jukebox.mcp.policy import Policy
    from jukebox.mcp.record import TapeSink, env_scrubber, scrub
    from jukebox.mcp.replay import RecordedServer

    _one_line_sdk_logs()
    scrubber = env_scrubber(os.environ)
    diverged: list[str] = []
    sink: TapeSink | None = None

    def on_divergence(divergence) -> None:
        diverged.append(divergence.message())
        assert sink is not None
        sink.record("note", divergence.to_payload())

    # A tape named by its path is read with the store beside it; by its id, from --tape-dir.
    named_by_path = os.sep in tape or tape.endswith(".jbx")
    recorded = RecordedServer.load(tape, None if named_by_path else tape_dir, name, on_divergence,
                              lambda args: scrub({"a": args}, scrubber)["a"])  # fmt: skip
    # Everything the tape answers is forwarded as recorded: the decisions were taken then.
    policy = Policy("record")
    sink = TapeSink(tape_dir, recorded.server, ["--replay", str(recorded.path)],
                    policy.describe(), scrubber, tape_id)  # fmt: skip
    try:
        anyio.run(lambda: serve_stdio(recorded.server, [], sink, policy, timeout=timeout,
                                      replay=recorded))  # fmt: skip
    except BaseExceptionGroup as group:
        raise _first(group) from None
    finally:
        sink.close()
    if diverged:
        raise CheckFailed(diverged[0].splitlines()[0])


def _one_line_sdk_logs() -> None:
    """The SDK logs what a server got wrong (a line that is not JSON-RPC) with a traceback: the
    operator gets one line per event instead."""
    import logging

    class OneLine(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"jukebox: the MCP SDK reports: {record.getMessage()}"

    handler = logging.StreamHandler()
    handler.setFormatter(OneLine())
    log = logging.getLogger("mcp")
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = False


def _first(group: BaseExceptionGroup) -> BaseException:
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return _first(error)
        return error
    return group


@mcp_group.command("config")
@click.argument("config_file", metavar="FILE", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write the rewritten config here instead of printing it.")  # fmt: skip
@click.option("--tape-dir", "wrap_tape_dir", default=None,
              help="Outside a booth, where the wrappers write their tapes.")  # fmt: skip
def config_command(config_file: str, output: str | None, wrap_tape_dir: str | None) -> None:
    """Rewrite a Claude Code / Cursor MCP config (.mcp.json) so that every stdio server goes
    through `jukebox mcp wrap`; HTTP servers (url) are kept as they are. Point the agent at the
    result (`claude --mcp-config OUT`); in a booth, `jukebox booth run --mcp-config FILE` does
    this itself."""
    import json
    import shutil
    import sys

    from jukebox.mcp.servers import read_config, wrapped_config

    jukebox = shutil.which("jukebox") or os.path.join(os.path.dirname(sys.executable), "jukebox")
    extra = ["--tape-dir", os.path.abspath(wrap_tape_dir)] if wrap_tape_dir else []
    text = json.dumps(wrapped_config(read_config(config_file), jukebox, extra), indent=2) + "\n"
    if output is None:
        click.echo(text, nl=False)
    else:
        Path(output).write_text(text)


def _register_approve() -> None:
    # `jukebox booth approve` lives with the MCP commands it serves.
    from jukebox.cli.booth import _tape_dir, booth

    @booth.command("approve")
    @click.argument("booth_id")
    @click.argument("call")
    @click.option("--deny", is_flag=True, help="Refuse the call instead.")
    @click.option("--tape-dir", default=None)
    def approve(booth_id: str, call: str, deny: bool, tape_dir: str | None) -> None:
        """Answer a running booth's question about an MCP tool call (its policy said `ask`):
        CALL is the ask-N id the booth printed. The call runs (or is refused) when the
        agent's gateway reads the answer (docs/mcp.md)."""
        from jukebox.mcp.approvals import write_answer

        answer = "deny" if deny else "approve"
        write_answer(_tape_dir(tape_dir), booth_id, call, answer)
        click.echo(f"{'refused' if deny else 'approved'} {call} of booth {booth_id}")


_register_approve()
