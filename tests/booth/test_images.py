"""Sandbox images: the shipped ones load, bad specs are refused by name, env filtering."""

from __future__ import annotations

from pathlib import Path

import pytest

from jukebox.booth.images import (
    IMAGES_DIR,
    PARSED_NAME,
    Image,
    ImageError,
    available,
    load_image,
    parse_image,
    parse_toml,
    parsed_copy,
    physical_memory,
    write_parsed,
)


def test_shipped_images_load() -> None:
    assert {"host", "minimal"} <= set(available())
    host = load_image(None)
    assert host.name == "host" and host.readonly_host and host.private_tmp and host.net == "host"
    minimal = load_image("minimal")
    assert "/home" in minimal.hide and "/etc/shadow" in minimal.hide and "/root" in minimal.hide
    assert minimal.limits["memory_bytes"] == 16 << 30
    assert set(minimal.limits) == {
        "cpu_seconds",
        "memory_bytes",
        "open_files",
        "processes",
        "file_size_bytes",
    }


def test_the_shipped_parsed_copy_is_current_and_loads_as_the_toml_does() -> None:
    """`python -m jukebox.booth.images` after editing an image; a stale copy is never used
    (below), but each start would pay for tomllib again."""
    assert (IMAGES_DIR / PARSED_NAME).read_text(encoding="utf-8") == write_parsed()
    for name in available():
        path = IMAGES_DIR / f"{name}.toml"
        parsed = parse_image(parse_toml(path, path.read_text()), path)
        loaded = load_image(name)
        assert loaded == parsed
        # What a tape records of the image (recorded_image) is its source, in its order.
        assert list(loaded.source.items()) == list(parsed.source.items())


def test_a_parsed_copy_of_other_text_is_not_used(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    text = (IMAGES_DIR / "host.toml").read_text()
    (images / "host.toml").write_text(text)
    copies = tmp_path / PARSED_NAME
    copies.write_text(write_parsed(images))
    assert parsed_copy(copies, "host.toml", text) == parse_toml(images / "host.toml", text)
    edited = text.replace('private_tmp = true', 'private_tmp = false')
    assert edited != text
    assert parsed_copy(copies, "host.toml", edited) is None  # parsed again, from the file
    assert parsed_copy(copies, "other.toml", text) is None
    assert parsed_copy(tmp_path / "missing.json", "host.toml", text) is None
    for broken in ("{", "[]", '{"host.toml": 1}', '{"host.toml": {"text": "x"}}'):
        copies.write_text(broken)
        assert parsed_copy(copies, "host.toml", text) is None


def test_env_filtering_and_secret_names() -> None:
    environ = {
        "PATH": "/bin",
        "OPENAI_API_KEY": "sk-1",
        "GITHUB_TOKEN": "ghp",
        "DB_PASSWORD": "pw",
        "HOME": "/root",
        "LC_ALL": "C",
        "AWS_SECRET_ACCESS_KEY": "x",
    }
    host = load_image("host")
    env = host.filter_env(environ)
    assert env == environ
    described = host.describe_env(env)
    assert described["secret_names"] == [
        "AWS_SECRET_ACCESS_KEY",
        "DB_PASSWORD",
        "GITHUB_TOKEN",
        "OPENAI_API_KEY",
    ]
    assert described["names"] == ["HOME", "LC_ALL", "PATH"]
    assert "sk-1" not in repr(described)
    minimal = load_image("minimal")
    env = minimal.filter_env(environ)
    assert env["HOME"] == "/tmp"  # fixed by the image
    assert {"PATH", "LC_ALL", "OPENAI_API_KEY"} <= set(env)
    assert not {"GITHUB_TOKEN", "DB_PASSWORD", "AWS_SECRET_ACCESS_KEY"} & set(env)


def test_only_hides_every_other_top_level_directory(tmp_path: Path) -> None:
    for d in ("usr", "home", "srv", "etc"):
        (tmp_path / d).mkdir()
    (tmp_path / "bin").symlink_to("usr/bin")
    spec = tmp_path / "img.toml"
    spec.write_text(f'[fs]\nonly = ["{tmp_path}/usr", "{tmp_path}/etc"]\nhide = ["/x"]\n')
    hidden = load_image(str(spec)).hidden_paths(str(tmp_path))
    assert sorted(hidden) == sorted(["/x", f"{tmp_path}/home", f"{tmp_path}/srv"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('net = "wifi"', "key 'net' is 'wifi': valid values are 'host', 'none'"),
        ("colour = 1", "key 'colour' is unknown: valid keys here are name, description"),
        (
            "[fs]\nreadonly = true",
            "key 'fs.readonly' is unknown: valid keys here are readonly_host",
        ),
        ('[fs]\nhide = ["relative"]', "key 'fs.hide' holds 'relative': paths must be absolute"),
        ("[fs]\nprivate_tmp = 1", "key 'fs.private_tmp' is 1: must be true or false"),
        ('[env]\nallow = "*"', "key 'env.allow' is '*': must be a list of strings"),
        ("[env]\nset = { A = 1 }", "key 'env.set' must map names to string values"),
        ("[limits]\nopen_files = 0", "key 'limits.open_files' is 0: must be a positive integer"),
        ("[limits]\nprocesses = true", "key 'limits.processes' is True"),
        ('[limits]\nmemory = "lots"', "key 'limits.memory' is 'lots'"),
        ("name = [", "is not valid TOML"),
        ('[seccomp]\nallow = ["ptrace", "io-uring"]', "key 'seccomp.allow' holds 'io-uring'"),
        ("[seccomp]\nenabled = 0", "key 'seccomp.enabled' is 0: must be true or false"),
        ("[seccomp]\ndeny = []", "key 'seccomp.deny' is unknown: valid keys here are enabled"),
        ('[cgroup]\nenabled = "no"', "key 'cgroup.enabled' is 'no': must be true or false"),
    ],
)
def test_validation_names_file_key_and_valid_values(
    tmp_path: Path, text: str, message: str
) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(text + "\n")
    with pytest.raises(ImageError) as info:
        load_image(str(spec))
    assert str(spec) in str(info.value) and message in str(info.value)


def test_unknown_image_lists_the_known_ones() -> None:
    with pytest.raises(ImageError, match="unknown sandbox image 'nope': use one of host, minimal"):
        load_image("nope")
    with pytest.raises(ImageError, match="no sandbox image file"):
        load_image("/nonexistent/x.toml")


def test_memory_sizes(tmp_path: Path) -> None:
    spec = tmp_path / "m.toml"
    spec.write_text('[limits]\nmemory = "512M"\ncpu_seconds = 10\n')
    assert dict(load_image(str(spec)).limits) == {"memory_bytes": 512 << 20, "cpu_seconds": 10}


def test_a_scratch_limit_is_the_layers_not_a_resource_limit(tmp_path: Path) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text('[limits]\nscratch = "20G"\nfile_size = "1G"\n')
    image = load_image(str(spec))
    assert image.scratch_limit == 20 << 30
    assert dict(image.limits) == {"file_size_bytes": 1 << 30}  # what setrlimit gets
    assert image.policy()["scratch_limit"] == 20 << 30
    assert load_image("host").scratch_limit is None
    spec.write_text('[limits]\nscratch = "0"\n')
    with pytest.raises(ImageError, match=r"key 'limits\.scratch' is '0': must be a positive size"):
        load_image(str(spec))


def test_seccomp_and_cgroup_default_on_and_loosen_by_group(tmp_path: Path) -> None:
    host = load_image("host")
    assert host.seccomp and host.cgroup and host.seccomp_allow == ()
    spec = tmp_path / "loose.toml"
    spec.write_text('[seccomp]\nallow = ["ptrace", "io_uring"]\n[cgroup]\nenabled = false\n')
    loose = load_image(str(spec))
    assert loose.seccomp_allow == ("ptrace", "io_uring") and not loose.cgroup
    assert loose.policy()["seccomp"] == {"enabled": True, "allow": ["ptrace", "io_uring"]}


def test_a_recorded_image_with_a_looser_filter_or_no_cgroup_is_a_loosening(tmp_path: Path) -> None:
    from jukebox.booth.recorded_image import loosenings

    def image(text: str) -> Image:
        spec = tmp_path / "i.toml"
        spec.write_text(text)
        return load_image(str(spec))

    default = image("")
    loose = image('[seccomp]\nallow = ["ptrace", "bpf"]\n[cgroup]\nenabled = false\n')
    assert loosenings(loose, default) == [
        "seccomp.allow lets through bpf, ptrace",
        "cgroup.enabled = false (rlimits only)",
    ]
    assert loosenings(image("[seccomp]\nenabled = false\n"), default) == [
        "seccomp.enabled = false (no system call filter)"
    ]
    assert loosenings(default, loose) == []  # stricter than the image used: nothing loosened


def test_private_tmp_and_shm_sizes(tmp_path: Path) -> None:
    ram = physical_memory()
    host = load_image("host")
    assert host.tmpfs_sizes() == {"tmp": ram // 4, "shm": min(ram // 4, 1 << 30)}
    assert host.tmpfs_sizes(10 << 20) == {"tmp": 10 << 20, "shm": 10 << 20}  # a scratch limit
    spec = tmp_path / "t.toml"
    spec.write_text('[limits]\ntmp = "64M"\nshm = 1048576\n')
    image = load_image(str(spec))
    assert image.tmpfs_sizes() == {"tmp": 64 << 20, "shm": 1 << 20}
    assert image.tmpfs_sizes(32 << 20) == {"tmp": 32 << 20, "shm": 1 << 20}
    assert dict(image.limits) == {}  # not rlimits
    assert image.policy()["tmp_size"] == 64 << 20
    from jukebox.booth.recorded_image import loosenings

    spec.with_name("default.toml").write_text("")
    default = load_image(str(spec.with_name("default.toml")))
    assert loosenings(image, default) == []  # smaller than the default: nothing loosened
    assert loosenings(default, image) == [
        f"limits.tmp {64 << 20} -> default",
        f"limits.shm {1 << 20} -> default",
    ]
    for bad, message in (('tmp = "0"', "must be a positive size"), ('shm = "big"', "'big'")):
        spec.write_text(f"[limits]\n{bad}\n")
        with pytest.raises(ImageError, match=message):
            load_image(str(spec))
