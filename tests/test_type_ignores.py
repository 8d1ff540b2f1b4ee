"""Every `# type: ignore` in the package says which error it silences and why.

mypy checks the first half (`enable_error_code = ignore-without-code`, and `warn_unused_ignores`
for an ignore that silences nothing any more); this test the second: a comment right after the
ignore on its line, or a comment line right above it. An ignore is a claim the type checker
cannot verify; the comment is where a reader finds what makes it true."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")


def unjustified(source: str) -> list[tuple[int, str]]:
    """The (line number, line) of each ignore without an error code or without a why."""
    found = []
    lines = source.splitlines()
    for number, line in enumerate(lines, 1):
        match = IGNORE.search(line)
        if match is None:
            continue
        after = match["rest"].strip()
        above = lines[number - 2].strip() if number > 1 else ""
        why = (after.startswith("#") and len(after) > 2) or above.startswith("#")
        if match["codes"] is None or not why:
            found.append((number, line.strip()))
    return found


def test_every_type_ignore_names_its_error_and_says_why() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{number}: {line}"
        for package in ("shadowfs", "jukebox")
        for path in sorted((REPO / package).rglob("*.py"))
        for number, line in unjustified(path.read_text())
    ]
    assert not bad, "a type: ignore without its error code or its why:\n" + "\n".join(bad)


def test_the_check_tells_a_justified_ignore_from_a_bare_one() -> None:
    assert unjustified("x = f()  # type: ignore[arg-type]  # f is typed too narrowly\n") == []
    assert unjustified("# f is typed too narrowly\nx = f()  # type: ignore[arg-type]\n") == []
    assert unjustified("y = 1\nx = f()  # type: ignore[arg-type]\n") == [
        (2, "x = f()  # type: ignore[arg-type]")
    ]
    assert unjustified("x = f()  # type: ignore  # no code\n") == [
        (1, "x = f()  # type: ignore  # no code")
    ]
