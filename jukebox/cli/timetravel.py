"""Time travel on the command line: `jukebox fork`, and what `replay --exec` and
`diff TAPE_A TAPE_B` run (their commands live with the other read-side commands in tapes.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from jukebox.cli import cli
from jukebox.cli.booth_view import view_path_options
from jukebox.cli.options import tape_dir_option
from jukebox.cli.reading import emit_json, whole_tape
from jukebox.cli.tapes import image_option, mcp_config_option, tape_argument, trust_option
from jukebox.display.names import printable, printable_lines

if TYPE_CHECKING:
    from jukebox.booth.paths import BoothPaths


def report_image(choice, err: bool = True) -> None:
    """The image lines of a replay or fork: what a recorded image loosens, how the image used
    differs from the recorded one."""
    if choice is None:
        return
    # The recorded name, paths and variable names are the tape's: shown escaped.
    if choice.loosened:
        click.echo(
            printable(
                f"jukebox: warning: running under the recorded image {choice.image.name!r}, "
                "which loosens the built-in one: " + "; ".join(choice.loosened)
            ),
            err=err,
        )
    if choice.difference:
        click.echo(f"jukebox: {printable(choice.difference)}", err=err)


def run_replay_exec(
    tape: str,
    tape_dir: Path | None,
    mode: str,
    until: int | None,
    record: bool,
    fs: str | None,
    as_json: bool,
    image: str | None = None,
    trust_recorded_image: bool = False,
    honor_timing: bool = False,
    paths: BoothPaths | None = None,
    mcp_config: Path | None = None,
) -> None:
    """`jukebox replay TAPE --exec`: exits 0 when the run matched its tape, 1 at a divergence."""
    from jukebox.tape.tapedir import TapeRef
    from jukebox.timetravel.timetravel import replay_exec

    ref = TapeRef.parse(tape, tape_dir)
    whole_tape(ref, "replay", "drop the @{n} (--until {n} serves frames 0..{n}, then goes live)")
    result = replay_exec(
        ref.path, ref.tape_dir.path, mode, until, record=record, fs=fs, image=image,
        trust_recorded_image=trust_recorded_image, honor_timing=honor_timing, paths=paths,
        mcp_config=mcp_config,
    )  # fmt: skip
    # The agent owns stdout (its own output, as it printed it when recorded); ours is stderr,
    # except the --json result, which comes last on stdout.
    if as_json:
        click.echo(json.dumps(result.to_json(), sort_keys=True))
    report_image(result.image)
    for problem in result.problems:  # the agent's own failure first: it explains the rest
        click.echo(f"jukebox: {printable(problem)}", err=True)
    if result.difference:
        click.echo(f"jukebox: {printable_lines(result.difference)}", err=True)
    click.echo(f"jukebox: {result.summary()}", err=True)
    sys.exit(result.code)


@cli.command("fork")
@tape_argument()
@click.option("--at", "at", type=int, required=True, help="Share frames 0..N-1; fork at frame N.")
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="[PROVIDER=]MODEL",
    help="Model for a provider's requests from frame N on (openai=M, anthropic=M; repeat for "
    "both); a bare MODEL is for the provider of frame N.",
)
@click.option(
    "--system-prompt", default=None, help="System prompt for every request from frame N on."
)
@click.option(
    "--tool-result",
    default=None,
    metavar="JSON|TEXT|@FILE",
    help="The result the MCP tool call at frame N gets instead of the recorded one: an MCP "
    "result ({\"content\": [...]}), or text; with --exec the agent receives it.",
)
@click.option(
    "--exec",
    "exec_",
    is_flag=True,
    help="Re-run the command: calls before frame N from the tape, live with the overrides after.",
)
@click.option(
    "--strict/--loose",
    "strict",
    default=True,
    help="How --exec matches the re-run's calls before frame N (default strict).",
)
@click.option(
    "--honor-timing",
    is_flag=True,
    help="--exec: answer the calls before frame N after their recorded latency, in the "
    "recorded order.",
)
@click.option("--tape-id", default=None, help="The new tape's id (default: <id>-fork-<n>).")
@mcp_config_option
@click.option("--fs", type=click.Choice(["fuse", "overlay"]), default=None, help="Booth layer.")
@image_option
@trust_option
@view_path_options
@tape_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def fork_command(
    tape: str,
    at: int,
    models: tuple[str, ...],
    system_prompt: str | None,
    tool_result: str | None,
    exec_: bool,
    strict: bool,
    honor_timing: bool,
    tape_id: str | None,
    fs: str | None,
    image: str | None,
    trust_recorded_image: bool,
    tape_dir: Path | None,
    as_json: bool,
    paths: BoothPaths | None,
    mcp_config: Path | None,
) -> None:
    """Make a new tape sharing TAPE's frames 0..N-1, with overrides for what follows.

    With --exec the recorded command runs again in a fresh offline booth over the recorded base
    tree (a process cannot resume mid-run): model calls recorded before frame N are served from
    the tape, later ones go live (to $OPENAI_BASE_URL / $ANTHROPIC_BASE_URL, else the public
    APIs) with the overrides, and the fork tape gets the frames produced from frame N on.
    MCP tool calls recorded before frame N are served from the tape too (the one at frame N
    with --tool-result's result), later ones go to the real servers (docs/mcp.md), with the
    headers and secret env values from --mcp-config or the environment.
    """
    from jukebox.llm.model_override import describe
    from jukebox.tape.tapedir import TapeRef
    from jukebox.timetravel.timetravel import fork

    ref = TapeRef.parse(tape, tape_dir)
    whole_tape(ref, "fork", "name the frame with --at {n}")
    result = fork(
        ref.path,
        at,
        tape_dir=ref.tape_dir.path,
        model=models or None,
        system_prompt=system_prompt,
        exec_=exec_,
        mode="strict" if strict else "loose",
        tape_id=tape_id,
        fs=fs,
        image=image,
        trust_recorded_image=trust_recorded_image,
        paths=paths,
        honor_timing=honor_timing,
        tool_result=tool_result,
        mcp_config=mcp_config,
    )
    if as_json:
        emit_json(result.to_json())
        sys.exit(result.code)
    overrides = ", ".join(
        f"tool_result@{v['frame']}" if k == "tool_result" else f"{k}={describe(v)!r}"
        for k, v in result.overrides.items()
    ) or "none"
    out = click.echo if not exec_ else lambda text: click.echo(text, err=True)
    out(
        f"forked {ref.path} at frame {at} into {result.tape_id} ({result.tape_path}): "
        f"frames 0..{at - 1} shared, overrides: {overrides}"
    )
    report_image(result.image)
    if result.executed:
        for problem in result.problems:
            click.echo(f"jukebox: {printable(problem)}", err=True)
        if result.difference:
            click.echo(f"jukebox: {printable_lines(result.difference)}", err=True)
        out(
            f"re-executed: {result.llm_served} LLM call(s) served from the tape before frame "
            f"{at}, {result.llm_live} live after it, {result.tools_served} MCP tool call(s) "
            f"served from the tape, {result.appended} frame(s) appended, "
            f"${result.spent_usd:.4f} spent; agent exit status {result.agent_status}"
        )
    sys.exit(result.code)


def print_comparison(
    tape_a, tape_b, store, markdown: Path | None, as_json: bool, labels: tuple[str, str]
) -> None:
    """`jukebox diff TAPE_A TAPE_B`: the full report, as markdown text (or JSON)."""
    from jukebox.tape.compare import compare_tapes

    comparison = compare_tapes(tape_a, tape_b, store, label_a=labels[0], label_b=labels[1])
    if as_json:
        emit_json(comparison.to_json())
        return
    text = comparison.to_markdown()
    if markdown is not None:
        markdown.write_text(text)
        click.echo(f"wrote {markdown}")
        return
    click.echo(text, nl=False)
