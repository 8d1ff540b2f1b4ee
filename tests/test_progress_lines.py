"""The lines jukebox.display.progress writes: a terminal never receives a control character from
a name or a message, whichever way the line is written."""

from __future__ import annotations

import pytest

from jukebox.display import progress


@pytest.mark.parametrize(
    ("message", "line"),
    [
        ("no changes to commit: /tmp/t is as it was", "no changes to commit: /tmp/t is as it was"),
        ("a back\\slash stays", "a back\\slash stays"),
        ("an escape \x1b[31m in a name", "an escape \\x1b[31m in a name"),
        ("a tab\tand a\nnewline", "a tab\\tand a\\nnewline"),
        ("caf\u00e9 \u2014 printable text", "caf\u00e9 \u2014 printable text"),
        ("a bidi \u202e override", "a bidi \\u202e override"),
    ],
)
def test_a_note_is_written_escaped_as_printable_says(
    message: str, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from jukebox.display.names import printable

    assert printable(message) == line
    progress._write(message)
    assert capsys.readouterr().err == f"jukebox: {line}\n"
