"""jukebox.redact on its own: each shape of secret it must catch, and what it must leave alone
(a record full of markers is as useless as one full of keys)."""

from __future__ import annotations

import pytest

from jukebox.llm.paths import PathRefused
from jukebox.llm.providers import CHAT, route
from jukebox.redact import (
    REDACTED,
    Scrubber,
    redact_argv,
    redact_query,
    redact_text,
    redact_url,
    url_origin,
    url_secrets,
)

R = REDACTED


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["agent", "--api-key", "abc123"], ["agent", "--api-key", R]),
        (["agent", "--api_key=abc123"], ["agent", f"--api_key={R}"]),
        (["agent", "--token=t0k3n"], ["agent", f"--token={R}"]),
        (["agent", "--auth-token", "x", "--client-secret", "y"],
         ["agent", "--auth-token", R, "--client-secret", R]),
        (["agent", "--password", "hunter2"], ["agent", "--password", R]),
        (["env", "OPENAI_API_KEY=sk-abc", "GH_TOKEN=xyz", "agent"],
         ["env", f"OPENAI_API_KEY={R}", f"GH_TOKEN={R}", "agent"]),
        (["agent", "sk-proj-abcdefghijklmnop"], ["agent", R]),
        (["agent", "--model-key=sk-ant-api03-abcdefghijkl"], ["agent", f"--model-key={R}"]),
        (["aws", "AKIAABCDEFGHIJKLMNOP"], ["aws", R]),
        (["gh", "ghp_" + "a" * 36], ["gh", R]),
        (["slack", "xoxb-1234-5678-abcdefgh"], ["slack", R]),
        (["git", "clone", "https://me:pw-123@example.com/r"],
         ["git", "clone", f"https://{R}@example.com/r"]),
        (["curl", "-H", "Authorization: Bearer abcdefgh12345"],
         ["curl", "-H", f"Authorization: {R}"]),
        (["curl", "https://x.test/api?key=abcdef&limit=3"],
         ["curl", f"https://x.test/api?key={R}&limit=3"]),
        (["sh", "-c", "agent --api-key 'a b c' --verbose && OPENAI_API_KEY=zz run"],
         ["sh", "-c", f"agent --api-key {R} --verbose && OPENAI_API_KEY={R} run"]),
        # A secret option given as a flag is followed by another option, not by its value.
        (["agent", "--token", "--verbose"], ["agent", "--token", "--verbose"]),
        # Left alone: limits named after tokens, plain values, a user name without a password.
        (["agent", "--max-tokens", "4096", "--model", "gpt-4o", "ssh://git@github.com/x"],
         ["agent", "--max-tokens", "4096", "--model", "gpt-4o", "ssh://git@github.com/x"]),
        (["python", "task-runner.py", "MAX_TOKENS=10", "--keyboard", "us"],
         ["python", "task-runner.py", "MAX_TOKENS=10", "--keyboard", "us"]),
    ],
)  # fmt: skip
def test_command_lines_lose_their_keys_and_keep_their_shape(
    argv: list[str], expected: list[str]
) -> None:
    assert redact_argv(argv) == expected


def test_known_values_are_scrubbed_from_command_lines_whatever_their_shape() -> None:
    known = Scrubber(["plain-looking-value"])
    argv = ["run", "--x", "plain-looking-value/dir"]
    assert redact_argv(argv, known) == ["run", "--x", f"{R}/dir"]


def test_query_strings_lose_secret_values_only() -> None:
    path = "/v1/x?key=1&api-key=2&api_key=3&access_token=4&token=5&sig=6&limit=7&order=desc"
    assert redact_query(path) == (
        f"/v1/x?key={R}&api-key={R}&api_key={R}&access_token={R}&token={R}&sig={R}"
        "&limit=7&order=desc"
    )
    assert redact_query("/v1/x?X-Amz-Signature=a&X-Amz-Credential=b&flag") == (
        f"/v1/x?X-Amz-Signature={R}&X-Amz-Credential={R}&flag"
    )
    assert redact_query("/v1/chat/completions") == "/v1/chat/completions"


def test_urls_lose_passwords_and_name_their_origin_only() -> None:
    url = "https://alice:s3cret-pass@api.example.com:8443/v1?api_key=k"
    assert redact_url(url) == f"https://{R}@api.example.com:8443/v1?api_key={R}"
    assert url_origin(url) == "https://api.example.com:8443"
    assert url_origin("http://[::1]:9/p/secret-segment") == "http://[::1]:9"
    assert "s3cret-pass" in url_secrets(url) and "alice:s3cret-pass" in url_secrets(url)
    assert url_secrets("https://api.example.com/v1") == []


def _every_pattern(text: str) -> str:
    """redact_text as it was before it checked what each pattern needs: all seven, in order."""
    from jukebox import redact as r

    text = r._URL_USERINFO.compiled().sub(lambda m: m.group(1) + R + "@", text)
    text = r._SECRET_HEADER_LINE.compiled().sub(lambda m: m.group(1) + m.group(2) + R, text)
    text = r._AUTH_SCHEME.compiled().sub(lambda m: m.group(1) + m.group(2) + R, text)
    text = r._OPTION_VALUE.compiled().sub(r._secret_option_value, text)
    text = r._ASSIGNMENT.compiled().sub(r._secret_assignment, text)
    text = r._QUERY_IN_TEXT.compiled().sub(r._secret_query_pair, text)
    return r.KEY_SHAPES.compiled().sub(R, text)


def test_skipping_a_pattern_that_cannot_match_changes_nothing() -> None:
    """redact_text tries a pattern only on text holding what the pattern needs: over secrets of
    every shape, joined by every kind of separator (Unicode spaces \\s matches included), the
    result is the same as trying all seven."""
    pieces = [
        "https://me:pw-123@example.com/r", "Authorization: Bearer abcdefgh12345", "Bearer",
        "abcdefgh12345", "--api-key", "--token=t0k3n", "OPENAI_API_KEY=sk-abc", "?key=abcdef",
        "&sig=zzzzzzzz", "sk-proj-abcdefghijklmnop", "AKIAABCDEFGHIJKLMNOP", "ghp_" + "a" * 36,
        "github_pat_" + "b" * 22, "xoxb-1234-5678-abcdefgh", "AIza" + "c" * 32, "glpat-" + "d" * 20,
        "hf_" + "e" * 24, "cookie:x", "x-api-key:abc", "ssh://git@github.com/x", "true", "",
    ]  # fmt: skip
    joins = ["", " ", "\t", "\n", "\u00a0", "\u2003", "\x1c", "=", "-", ":", "?", "&", "@"]
    seen = 0
    for a in pieces:
        for b in pieces:
            for join in joins:
                text = a + join + b
                assert redact_text(text) == _every_pattern(text), repr(text)
                seen += text != redact_text(text)
    assert seen  # secrets were found, not only passed through


def test_free_text_loses_every_shape_at_once() -> None:
    text = (
        "upstream https://u:pw-secret-1@h/x failed: ConnectError('x-api-key: abc123456') "
        "Bearer abcdefghijk sk-abcdefghijklmnop token=abcdefgh"
    )
    out = redact_text(text)
    for secret in ("pw-secret-1", "abc123456", "abcdefghijk", "sk-abcdefghijklmnop", "=abcdefgh"):
        assert secret not in out, secret
    assert out.startswith("upstream https://[REDACTED]@h/x failed")


def test_host_names_lose_known_values_in_any_case_and_across_labels() -> None:
    scrub = Scrubber(["Tok3nValue-AbCdEf", "short", "abcdefgh.ijkl"])
    assert scrub.host("tok3nvalue-abcdef.example.org") == f"{R}.example.org"
    assert scrub.host("x.TOK3N.value-AbCdEf.y") == f"x.{R}.y"  # split over two labels
    assert scrub.host("abcdefghijkl.org") == f"{R}.org"  # a value with a dot, joined
    # Values that overlap in the name give one marker; a value shorter than 8 is no secret.
    scrub.add(["efabcdefgh"])
    assert scrub.host("tok3nvalue-abcdefabcdefgh.short.org") == f"{R}.short.org"
    assert scrub.host("example.org") == "example.org"


@pytest.mark.parametrize(
    "target",
    [
        "/openai/v1/../../admin",
        "/openai/v1/%2e%2e/admin",
        "/openai/v1/.%2E/admin",
        "/openai/v1/..%2fadmin",
        "/openai/v1/a%2Fb",
        "/openai/v1/..%5Cadmin",
        "/openai/v1/%252e%252e/admin",
        "/openai/v1/%25252525252e%2e/admin",
        "/openai/v1/a%00b",
        "/openai/v1/%ff%fe",
        "/anthropic/v1/../../admin",
    ],
)
def test_paths_that_leave_or_blur_the_prefix_are_refused(target: str) -> None:
    with pytest.raises(PathRefused):
        route("POST", target)


def test_paths_inside_the_prefix_are_resolved_and_matched_decoded() -> None:
    r = route("POST", "/openai/v1/models/../chat/./completions/?x=1")
    assert r is not None and (r.endpoint, r.rest) == (CHAT, "/chat/completions/?x=1")
    r = route("POST", "/openai/v1/chat/%63ompletions")
    assert r is not None and (r.endpoint, r.rest) == (CHAT, "/chat/%63ompletions")
    r = route("GET", "/openai/v1?after=x/../y")  # the query is not a path
    assert r is not None and r.rest == "?after=x/../y"
