"""What a tape records of a sandbox image, and how a replay compares it with the image it uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from jukebox.booth.images import load_image
from jukebox.booth.recorded_image import (
    content_hash,
    difference_line,
    image_from_record,
    image_record,
    loosenings,
)
from jukebox.errors import CheckFailed, UsageError


def image(text: str, tmp_path: Path, name: str = "mine"):  # type: ignore[no-untyped-def]
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return load_image(str(path))


def test_every_shipped_image_round_trips_through_its_record() -> None:
    for name in ("host", "minimal"):
        img = load_image(name)
        record = image_record(img)
        assert record["blake3"] == content_hash(record["content"])
        back = image_from_record(record, "t.jbx")
        assert back.name == name and "t.jbx" in str(back.path)
        assert loosenings(back, img) == [] and difference_line(record, img, "t") is None
        for field in ("readonly_host", "hide", "only", "env_allow", "env_secret", "limits"):
            assert getattr(back, field) == getattr(img, field)


def test_secret_env_values_never_reach_the_record(tmp_path: Path) -> None:
    img = image('[env]\nset = { API_TOKEN = "tok-123", MODE = "ci" }\n', tmp_path)
    record = image_record(img)
    assert "tok-123" not in repr(record)
    assert record["content"]["env"]["set"] == {"MODE": "ci"}
    assert record["redacted_env"] == ["API_TOKEN"]
    assert img.env_set["API_TOKEN"] == "tok-123"  # the live image keeps it


def test_an_altered_content_fails_its_hash_and_a_missing_one_is_named() -> None:
    record = image_record(load_image("minimal"))
    record["content"] = {**record["content"], "fs": {"readonly_host": False}}
    with pytest.raises(CheckFailed, match="does not hash to its recorded blake3"):
        image_from_record(record, "t.jbx")
    with pytest.raises(UsageError, match="records no image content"):
        image_from_record(None, "t.jbx")
    line = difference_line(None, load_image("host"), "t.jbx")
    assert line is not None and "records no image content to compare" in line


def test_loosenings_name_each_field_that_gives_the_agent_more(tmp_path: Path) -> None:
    host = load_image("host")
    loose = image(
        'net = "host"\n[fs]\nreadonly_host = false\nprivate_tmp = false\n'
        '[env]\nsecret = ["*_KEY"]\nset = { LD_PRELOAD = "/tree/x.so" }\n'
        "[limits]\nprocesses = 99999\n",
        tmp_path,
    )
    found = loosenings(loose, host, ignore=("net",))
    assert "fs.readonly_host = false (the host is writable)" in found
    assert "fs.private_tmp = false (/tmp is the host's)" in found
    assert "env.set sets LD_PRELOAD" in found
    assert "limits.processes 16384 -> 99999" in found
    assert "limits.file_size_bytes 8589934592 -> none" in found
    assert any(f.startswith("env.secret no longer marks") for f in found)
    assert not any(f.startswith("net") for f in found)
    minimal = load_image("minimal")
    shown = loosenings(host, minimal)
    assert any(f.startswith("fs.hide no longer hides") and "/root" in f for f in shown)
    assert any(f.startswith("fs.only shows") for f in shown)
    assert any(f.startswith("env.allow passes") for f in shown)
    assert "net = host (the agent reaches the network)" not in loosenings(host, host)


def test_a_tighter_image_loosens_nothing(tmp_path: Path) -> None:
    host = load_image("host")
    secret = ", ".join(f'"{p}"' for p in host.env_secret)
    tight = image(
        f'[env]\nsecret = [{secret}]\n[limits]\nprocesses = 10\nopen_files = 10\n'
        'file_size = "1M"\nscratch = "1M"\n',
        tmp_path,
    )
    assert loosenings(tight, host) == []
    line = difference_line(image_record(tight), host, "t")
    assert line is not None and line.endswith("they differ in limits, scratch_limit")


def test_a_field_this_module_does_not_know_counts_as_loosening() -> None:
    """A protection added to images later is never dropped silently by a replay that only
    compares the fields known here."""
    from typing import Any

    from jukebox.booth.images import Image
    from shadowfs.values import setfield

    class Later(Image):
        __slots__ = ("future_guard",)
        INIT = (*Image.INIT, "future_guard")
        FIELDS = (*Image.FIELDS, "future_guard")

        def __init__(self, future_guard: bool = True, **fields: Any) -> None:
            super().__init__(**fields)
            setfield(self, "future_guard", future_guard)

    host = load_image("host")
    fields = {name: getattr(host, name) for name in Image.INIT}
    without = Later(**{**fields, "future_guard": False})
    assert loosenings(without, Later(**fields)) == ["future_guard differs"]
    assert loosenings(Later(**fields), Later(**fields)) == []
