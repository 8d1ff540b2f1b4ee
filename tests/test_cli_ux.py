"""What a person at a shell sees: the config file, --quiet/--verbose, colour and NO_COLOR,
progress on a terminal only, `jukebox help`, shell completion. The real console script, on a
real pseudo-terminal where the terminal matters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.on_terminal import plain, run_on_terminal
from tests.test_cli_read import record_run

JUKEBOX = str(Path(sys.executable).parent / "jukebox")
ESC = "\x1b["


def user_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A user with a config dir of their own and no jukebox variables set."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JUKEBOX_TAPE_DIR", "JUKEBOX_CONFIG", "NO_COLOR", "JUKEBOX_LOCK_TIMEOUT")
    }
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"))
    env["TERM"] = "xterm-256color"  # whatever the terminal running the tests is (CI: none)
    env.update(extra)
    return env


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config" / "jukebox" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def jb(*args: str, env: dict[str, str], cwd: Path | str = "/") -> subprocess.CompletedProcess:
    return subprocess.run(
        [JUKEBOX, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=60
    )


# ------------------------------------------------------------------------------ config file


def test_tape_dir_comes_from_the_flag_then_the_env_then_the_file(tmp_path: Path) -> None:
    dirs = {name: tmp_path / name for name in ("from-file", "from-env", "from-flag")}
    for path in dirs.values():
        path.mkdir()
    write_config(tmp_path, f'tape-dir = "{dirs["from-file"]}"\n')
    env = user_env(tmp_path)
    assert jb("ls", env=env).stdout == f"no tapes in {dirs['from-file']}\n"
    env["JUKEBOX_TAPE_DIR"] = str(dirs["from-env"])
    assert jb("ls", env=env).stdout == f"no tapes in {dirs['from-env']}\n"
    flagged = jb("ls", "--tape-dir", str(dirs["from-flag"]), env=env)
    assert flagged.stdout == f"no tapes in {dirs['from-flag']}\n"


def test_jukebox_config_names_another_file_and_the_python_api_reads_it(tmp_path: Path) -> None:
    tapes = tmp_path / "my tapes"
    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text('tape-dir = "~/my tapes"\n')
    env = user_env(tmp_path, JUKEBOX_CONFIG=str(elsewhere), HOME=str(tmp_path))
    code = "from jukebox import Jukebox; print(Jukebox().tape_dir)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tapes)
    assert jb("ls", env=env).stdout == f"no tapes in {tapes}\n"


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        ("tapes = '/x'\n", "unknown key 'tapes'", "the keys are tape-dir, image"),
        ("fs = 'zfs'\n", "fs", "'zfs' is not one of fuse, overlay"),
        ("max-turns = 0\n", "max-turns", "whole number >= 1"),
        ("max-cost-usd = 'lots'\n", "max-cost-usd", "positive number of US dollars"),
        ("max-scratch = 'huge'\n", "max-scratch", "is not a size"),
        ("image = 'nope'\n", "image", "unknown sandbox image 'nope'"),
        ("tape-dir = 'relative/dir'\n", "tape-dir", "is relative"),
        ("lock-timeout = 'soon'\n", "lock-timeout", "is not a duration"),
        ("no-color = 'yes'\n", "no-color", "is not true or false"),
        ("allow-hooks = true\n", "unknown key 'allow-hooks'", "the keys are"),
        ("max-turns = \n", "not valid TOML", "line 1"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_file_and_the_key(
    tmp_path: Path, text: str, key: str, why: str
) -> None:
    path = write_config(tmp_path, text)
    done = jb("ls", env=user_env(tmp_path))
    assert done.returncode == 2, done
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"jukebox: {path}: {key}")
    assert why in line


def test_a_missing_file_named_by_jukebox_config_is_an_error(tmp_path: Path) -> None:
    done = jb("ls", env=user_env(tmp_path, JUKEBOX_CONFIG=str(tmp_path / "nope.toml")))
    assert done.returncode == 2
    assert done.stderr == (
        f"jukebox: $JUKEBOX_CONFIG names {tmp_path / 'nope.toml'}, which does not exist: "
        "fix the path or unset it\n"
    )
    # `jukebox help` still works: it is where one reads how to fix the file.
    shown = jb("help", "config", env=user_env(tmp_path, JUKEBOX_CONFIG=str(tmp_path / "nope")))
    assert shown.returncode == 0 and shown.stdout.startswith("The config file:")


def test_config_values_are_the_defaults_of_the_flags_they_name(tmp_path: Path) -> None:
    write_config(tmp_path, 'fs = "overlay"\nmax-turns = 7\nlock-timeout = "5s"\n')
    env = user_env(tmp_path)
    run_help = jb("booth", "run", "--help", env=env).stdout
    assert "[default: overlay]" in run_help
    told = jb("-v", "ls", env=env)
    assert told.returncode == 0, told.stderr
    assert f"jukebox: config {tmp_path}/config/jukebox/config.toml: fs, max-turns, lock-timeout" \
        in told.stderr  # fmt: skip


# ------------------------------------------------------------------------------ output options


def test_output_options_go_before_or_after_the_command(tmp_path: Path) -> None:
    env = user_env(tmp_path, JUKEBOX_TAPE_DIR=str(tmp_path))
    for args in (["-q", "ls"], ["ls", "-q"], ["--verbose", "ls"], ["ls", "--no-color"]):
        assert jb(*args, env=env).returncode == 0, args
    for args in (["booth", "-q", "ls"], ["booth", "ls", "--quiet"]):
        assert jb(*args, env=env).stdout == "no pending booths\n", args
    both = jb("-q", "ls", "-v", env=env)
    assert both.returncode == 2
    assert "--quiet and --verbose contradict each other" in both.stderr


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    return record_run(tmp_path / "tapes", tmp_path / "work")


def test_colour_on_a_terminal_only_and_never_with_no_color(tmp_path: Path, recorded: Path) -> None:
    env = user_env(tmp_path, JUKEBOX_TAPE_DIR=str(recorded.parent))
    code, screen = run_on_terminal([JUKEBOX, "ls"], env)
    assert code == 0
    assert f"{ESC}1mTRACK ID" in screen  # the header, bold
    assert f"{ESC}32mCOMMITTED" in screen  # the status, green
    code, screen = run_on_terminal([JUKEBOX, "diff", "-p", "tr_demo@2"], env)
    assert code == 0
    assert f"{ESC}31m-line two" in screen and f"{ESC}32m+line 2" in screen
    assert f"  {ESC}32m{ESC}1mA{ESC}0m  " in screen  # an added file's letter
    piped = jb("diff", "-p", "tr_demo@2", env=env)
    assert ESC not in piped.stdout and "+line 2" in piped.stdout
    for quiet_env, args in (
        (dict(env, NO_COLOR="1"), ["ls"]),
        (dict(env, NO_COLOR="1"), ["diff", "-p", "tr_demo@2"]),
        (env, ["--no-color", "diff", "-p", "tr_demo@2"]),
        (env, ["ls", "--no-color"]),
        (dict(env, TERM="dumb"), ["ls"]),
    ):
        code, screen = run_on_terminal([JUKEBOX, *args], quiet_env)
        assert code == 0 and ESC not in screen, (args, screen)
        assert "COMMITTED" in screen or "+line 2" in screen
    write_config(tmp_path, "no-color = true\n")
    code, screen = run_on_terminal([JUKEBOX, "ls"], env)
    assert code == 0 and ESC not in screen and "COMMITTED" in screen


def test_progress_on_a_terminal_only_and_not_when_quiet(tmp_path: Path, recorded: Path) -> None:
    env = user_env(tmp_path, JUKEBOX_TAPE_DIR=str(recorded.parent), JUKEBOX_PROGRESS_DELAY="0")
    code, screen = run_on_terminal([JUKEBOX, "gc", "--grace", "0"], env)
    assert code == 0, screen
    assert "gc: scanning tapes" in plain(screen)
    code, screen = run_on_terminal([JUKEBOX, "replay", "tr_demo"], env)
    assert code == 0, screen
    assert "rebuilding file states" in plain(screen)
    code, screen = run_on_terminal([JUKEBOX, "gc", "-q"], env)
    assert code == 0 and "gc:" not in screen and "removed 0 object(s)" in screen
    piped = jb("gc", env=env)
    assert piped.returncode == 0 and piped.stderr == ""
    verbose = jb("replay", "tr_demo", "-v", env=env)
    assert verbose.returncode == 0
    lines = verbose.stderr.splitlines()
    assert [line.split(":")[1] for line in lines] == [
        " verified the tape", " rebuilt the file states"
    ]
    assert "rebuilding" not in verbose.stderr  # no bar drawn into a pipe


# ------------------------------------------------------------------------------ help, completion


def test_help_topics_come_from_the_package(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    listing = jb("help", env=env)
    assert listing.returncode == 0
    topics = [line.split()[0] for line in listing.stdout.splitlines()[2:10]]
    assert topics == [
        "booth", "tapes", "images", "breaker", "replay", "config", "output", "completion"
    ]
    from jukebox.cli.help import topic_text

    for topic in topics:
        text = topic_text(topic)
        assert text is not None and len(text.splitlines()) > 5, topic
    assert jb("help", "completion", env=env).stdout == topic_text("completion")
    assert "_JUKEBOX_COMPLETE=bash_source" in (topic_text("completion") or "")
    assert jb("help", "booth", "run", env=env).stdout == jb(
        "booth", "run", "--help", env=env
    ).stdout.replace("Usage: jukebox booth run", "Usage: jukebox booth run", 1)
    unknown = jb("help", "tapez", env=env)
    assert unknown.returncode == 2 and "no help topic or command 'tapez'" in unknown.stderr


def test_shell_completion_script_and_answers(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    script = jb(env=dict(env, _JUKEBOX_COMPLETE="bash_source"))
    assert script.returncode == 0 and "_jukebox_completion" in script.stdout
    # The script is valid bash that registers the completion.
    registered = subprocess.run(
        ["bash", "-c", f"{script.stdout}\ncomplete -p jukebox"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert "-F _jukebox_completion" in registered.stdout, registered.stderr

    def complete(words: str) -> list[str]:
        answer = jb(
            env=dict(
                env,
                _JUKEBOX_COMPLETE="bash_complete",
                COMP_WORDS=words,
                COMP_CWORD=str(len(words.split()) - (0 if words.endswith(" ") else 1)),
            )
        )
        assert answer.returncode == 0, answer.stderr
        return [line.split(",", 1)[1] for line in answer.stdout.splitlines() if line]

    assert complete("jukebox boo") == ["booth"]
    record_run(tmp_path / "tapes", tmp_path / "work")
    assert complete(f"jukebox log --tape-dir {tmp_path / 'tapes'} tr_") == ["tr_demo"]
    assert complete(f"jukebox diff --tape-dir {tmp_path / 'tapes'} ") == ["tr_demo"]
    assert complete("jukebox verify tr_") == []  # the default tape dir has none
    assert complete("jukebox help con") == ["config"]
    assert "--quiet" in complete("jukebox booth run --q")
    for shell in ("zsh", "fish"):
        other = jb(env=dict(env, _JUKEBOX_COMPLETE=f"{shell}_source"))
        assert other.returncode == 0 and "jukebox" in other.stdout


STEPS = """
import sys, time
from jukebox.display import progress
progress.configure(level=progress.NORMAL, draw=True, color=True)
with progress.step("spinning", counted=False):
    time.sleep(0.3)
with progress.step("counting", "things") as tick:
    for n in range(3):
        tick(n, 3)
print("done")
"""


def test_a_step_that_cannot_count_spins_and_no_rich_means_no_bar(tmp_path: Path) -> None:
    env = user_env(tmp_path, JUKEBOX_PROGRESS_DELAY="0")
    code, screen = run_on_terminal([sys.executable, "-c", STEPS], env)
    assert code == 0, screen
    assert "spinning" in plain(screen) and "counting" in plain(screen)
    # Without rich (a minimal install), the steps run and nothing is drawn.
    without_rich = "import sys; sys.modules['rich'] = None\n" + STEPS
    code, screen = run_on_terminal([sys.executable, "-c", without_rich], env)
    assert code == 0, screen
    assert plain(screen).strip() == "done"


def test_a_command_keeps_a_short_flag_of_its_own() -> None:
    import click

    from jukebox.cli.options import add_output_options

    @click.command()
    @click.option("-v", "--invert", is_flag=True)
    def command(invert: bool) -> None:
        click.echo(f"invert={invert}")

    add_output_options(command)
    assert [p.opts for p in command.params] == [
        ["-v", "--invert"], ["-q", "--quiet"], ["--verbose"], ["--no-color"]
    ]
    from click.testing import CliRunner

    from jukebox.display import progress, style

    before = (progress.level(), progress.drawing(), style.enabled())
    try:
        assert CliRunner().invoke(command, ["-v", "--verbose"]).output == "invert=True\n"
        assert progress.level() == progress.VERBOSE
    finally:
        progress.configure(level=before[0], draw=before[1], color=True)
        style.configure(before[2])


def test_the_cli_in_a_longer_lived_process_leaves_the_api_plain(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from jukebox.cli import cli
    from jukebox.cli import tapes as _  # noqa: F401  (registers ls)
    from jukebox.display import progress, style

    result = CliRunner().invoke(cli, ["-v", "ls", "--tape-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (progress.level(), progress.drawing(), style.enabled()) == (
        progress.NORMAL, False, False
    )
