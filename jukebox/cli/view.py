"""`jukebox view TAPE [--compare FORK] [--port N | --html FILE]`: a tape in the browser
(jukebox.viewer, docs/viewer.md)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from jukebox.cli import cli
from jukebox.cli.options import json_option, tape_dir_option
from jukebox.cli.reading import load, whole_tape
from jukebox.cli.tapes import tape_argument


def _view(text: str, tape_dir: Path | None, role: str):
    from jukebox.tape.tapedir import TapeRef
    from jukebox.viewer.model import TapeView

    ref = TapeRef.parse(text, tape_dir)
    whole_tape(ref, f"view ({role})", "drop the @{n}: the page shows every frame")
    tape = load(ref)
    if not tape.frames:
        from jukebox.errors import UsageError

        raise UsageError(f"{ref.path} holds no frame: there is nothing to show")
    return TapeView(tape, ref.path.stem)


@cli.command("view")
@tape_argument()
@click.option(
    "--compare",
    "fork",
    default=None,
    metavar="FORK",
    help="A second tape (a fork, a replay) shown beside the first, the divergence marked.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="The port on 127.0.0.1 to serve on (0: any free one).",
)
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=None,
    metavar="FILE",
    help="Write one self-contained HTML file to share instead of serving.",
)
@tape_dir_option
@json_option
def view_command(
    tape: str,
    fork: str | None,
    port: int,
    html_path: Path | None,
    tape_dir: Path | None,
    as_json: bool,
) -> None:
    """Look at a tape in the browser: the frames on a timeline with time and cost, each model
    call's messages and tool calls, each frame's file changes side by side, checkpoints,
    rollbacks, the verdict, the breaker, and the tape's verification. Serves the page on
    127.0.0.1 until Ctrl-C, or writes it to one file with --html (no network needed)."""
    from jukebox.display.progress import step
    from jukebox.viewer import page

    if html_path is not None and port:
        from jukebox.errors import UsageError

        raise UsageError("--port serves the page, --html writes it to a file: give one of them")

    with step("reading and verifying the tape", "tapes", done="read the tape") as tick:
        a = _view(tape, tape_dir, "TAPE")
        a.verified()
        tick(1)
        b = None
        if fork is not None:
            b = _view(fork, tape_dir, "--compare")
            b.verified()
            tick(2)
    if html_path is not None:
        html = page.write_file(a, b)
        html_path.write_text(html, encoding="utf-8")
        if as_json:
            click.echo(json.dumps({"html": str(html_path), "bytes": len(html.encode())}))
        else:
            click.echo(f"wrote {html_path} ({len(a.frames)} frames; open it in a browser)")
        return
    _serve(a, b, port, as_json)


def _serve(a, b, port: int, as_json: bool) -> None:
    from jukebox.errors import UsageError
    from jukebox.viewer import page
    from jukebox.viewer.server import ViewerServer

    html, policy = page.render(page.page_data(a, b, "served"), served=True)
    views = {"a": a} if b is None else {"a": a, "b": b}
    try:
        server = ViewerServer(html, policy, views, port)
    except OSError as error:
        raise UsageError(
            f"cannot listen on 127.0.0.1:{port}: {error.strerror}: pick another --port"
        ) from None
    import signal

    # SIGTERM (a service manager, `kill`) stops it as Ctrl-C does: the socket closed, exit 0.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        # Inside the try: a reader that stops it as soon as it sees the URL stops it cleanly.
        if as_json:
            click.echo(json.dumps({"url": server.url, "port": server.port}))
        else:
            click.echo(f"serving {a.tape.path} at {server.url}  (Ctrl-C stops)")
        server.serve_forever()
    except KeyboardInterrupt:
        if not as_json:
            click.echo("stopped")
    finally:
        server.server_close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
