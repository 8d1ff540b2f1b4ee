"""The file-system workload suite: the same workloads on every backend, side by side in one run.

Each workload runs on a fresh mount (see `bench.backends`) over a cached, read-only lower dir,
`runs` times per backend with the backends interleaved so drift hits them all alike; a cell is the
median. Ratios are backend seconds over native (or fuse-overlayfs) seconds: lower is better.

What is timed is only the workload itself: mounting, untimed set-up and unmounting are not. Tools
(tar, find, grep, rm, git, pip) are timed from here as whole processes; the workloads written in
Python run in a child interpreter that times its own loop (`python -m bench.fs_workloads child`),
so the child's start-up is excluded and an in-process FUSE daemon never competes with the
harness for the GIL.

Fixtures are deterministic and cached under $JUKEBOX_BENCH_CACHE (default
/tmp/jukebox-bench-cache); the source tree, repos and wheel are generated, never downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from bench import backends as bk
from bench import scratch_fs
from bench.harness import fmt, geomean, median

GROUP = "fs"
REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("JUKEBOX_BENCH_CACHE", "/tmp/jukebox-bench-cache"))
# Bump when a generator changes so stale fixtures are not reused.
FIXTURE_VERSION = 1
FIXED_MTIME = 1_700_000_000  # old enough that git never treats a file as racily clean
TOOL_TIMEOUT = 600


class WorkloadError(RuntimeError):
    """A timed command failed; the message carries the command and the tail of its stderr."""


# ============================================================================ deterministic data

# A word list reads better as prose than as a 54-item literal.
_WORDS = tuple(
    " ".join(
        (
            "alpha beta gamma delta value items index count total result buffer cache entry",
            "record parse render build check apply merge split join load store fetch update",
            "remove create config options state context handle stream reader writer node tree",
            "path name size offset token frame batch chunk layer block queue event error status",
            "report window",
        )
    ).split(" ")
)


def _ident(rng: random.Random) -> str:
    return "_".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))


def python_module(rng: random.Random, target_bytes: int) -> str:
    """Plausible Python source of about `target_bytes`: imports, classes, functions, docstrings."""
    parts = [f'"""{" ".join(rng.choice(_WORDS) for _ in range(8)).capitalize()}."""\n\n']
    parts.append("from __future__ import annotations\n\nimport os\nimport sys\n\n")
    size = sum(map(len, parts))
    while size < target_bytes:
        if rng.random() < 0.3:
            cls = "".join(w.capitalize() for w in _ident(rng).split("_"))
            block = [f"\n\nclass {cls}:\n", f'    """{_ident(rng).replace("_", " ")}."""\n\n']
            for _ in range(rng.randint(1, 4)):
                block.append(f"    def {_ident(rng)}(self, {_ident(rng)}: int) -> int:\n")
                block.append(f"        {_ident(rng)} = {rng.randint(0, 999)} + len(str(self))\n")
                block.append(f"        return {rng.randint(1, 64)}\n\n")
        else:
            args = ", ".join(_ident(rng) for _ in range(rng.randint(0, 3)))
            var = _ident(rng)
            block = [
                f"\n\ndef {_ident(rng)}({args}):\n",
                f'    """{" ".join(rng.choice(_WORDS) for _ in range(10))}."""\n',
                f"    {var} = [{', '.join(str(rng.randint(0, 99)) for _ in range(6))}]\n",
                f"    for {_ident(rng)} in range(len({var})):\n",
                f"        {var}.append(os.sep.join(map(str, {var}[-2:])))\n",
                f"    return {var}\n",
            ]
        text = "".join(block)
        parts.append(text)
        size += len(text)
    return "".join(parts)


def write_source_tree(dest: Path, n_files: int, seed: int = 1) -> int:
    """A synthetic Python project: `n_files` files in nested packages, about 5 KB each."""
    rng = random.Random(seed)
    total = 0
    for i in range(n_files):
        depth = rng.choice((1, 2, 2, 3))
        parts = [f"pkg{i % 8}", f"sub{(i // 8) % 5}", "impl", "detail"][:depth]
        name = "README.md" if i % 97 == 0 else f"mod_{i:04d}.py"
        path = dest.joinpath(*parts, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = python_module(rng, rng.randint(1_000, 9_000))
        path.write_text(text)
        total += len(text)
    return total


def write_small_tree(dest: Path, n_files: int, seed: int = 2) -> None:
    """`n_files` small source files (~0.5 KB) in dirs of 100, fast enough for 100,000 files."""
    rng = random.Random(seed)
    templates = [python_module(rng, 400) for _ in range(16)]
    made: set[Path] = set()
    for i in range(n_files):
        d = dest / f"d{i // 1000:03d}" / f"s{(i // 100) % 10}"
        if d not in made:
            d.mkdir(parents=True, exist_ok=True)
            made.add(d)
        path = d / f"m{i:06d}.py"
        path.write_text(f"# module {i}\n{templates[i % len(templates)]}")
        os.utime(path, (FIXED_MTIME, FIXED_MTIME))


def git_env() -> dict[str, str]:
    """git isolated from the machine's config, with a fixed identity."""
    return dict(
        os.environ,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL="/dev/null",
        GIT_AUTHOR_NAME="bench",
        GIT_AUTHOR_EMAIL="bench@example.invalid",
        GIT_COMMITTER_NAME="bench",
        GIT_COMMITTER_EMAIL="bench@example.invalid",
    )


def git(repo: Path, *args: str) -> None:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args], env=git_env(), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise WorkloadError(f"git {' '.join(args)} failed in {repo}: {proc.stderr.strip()[-300:]}")


def make_git_repo(dest: Path, n_files: int) -> None:
    """A committed, packed repo of `n_files` small files; gc.auto=0 so no timing hits a gc."""
    dest.mkdir(parents=True)
    write_small_tree(dest, n_files)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "config", "gc.auto", "0")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "base")
    git(dest, "gc", "-q")


def cached(name: str, build: Callable[[Path], None]) -> Path:
    """CACHE/name, built once by `build(tmp)` into a temporary sibling and renamed into place."""
    final = CACHE / f"{name}-v{FIXTURE_VERSION}"
    if final.exists():
        return final
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = CACHE / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.exists():  # another run finishing first is fine; anything else is not
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    return final


_WHEEL_BACKEND = '''"""A tiny PEP 517 backend: `pip wheel` builds this offline, no deps."""
import base64, hashlib, os, zipfile

NAME, VERSION = "jbxbenchpkg", "1.0"


def _line(arc, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arc},sha256={digest},{len(data)}"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    dist = f"{NAME}-{VERSION}.dist-info"
    files = []
    for root, dirs, names in os.walk(NAME):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                files.append((p.replace(os.sep, "/"), f.read()))
    meta = f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n"
    files.append((f"{dist}/METADATA", meta.encode()))
    wheel_meta = "Wheel-Version: 1.0\\nGenerator: jukebox-bench\\nRoot-Is-Purelib: true\\n"
    files.append((f"{dist}/WHEEL", (wheel_meta + "Tag: py3-none-any\\n").encode()))
    record = "\\n".join(_line(a, d) for a, d in files) + f"\\n{dist}/RECORD,,\\n"
    files.append((f"{dist}/RECORD", record.encode()))
    wheel = f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files:
            info = zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0))
            z.writestr(info, data, zipfile.ZIP_DEFLATED)
    return wheel
'''


def build_wheel(dest: Path, n_modules: int = 150) -> None:
    """Generates a pure-Python package and builds its wheel into `dest` with `pip wheel`."""
    src = dest / "src"
    pkg = src / "jbxbenchpkg"
    pkg.mkdir(parents=True)
    rng = random.Random(3)
    (pkg / "__init__.py").write_text('"""Generated for the Jukebox benchmarks."""\n')
    for i in range(n_modules):
        sub = pkg / f"part{i % 6}"
        sub.mkdir(exist_ok=True)
        (sub / "__init__.py").touch()
        (sub / f"m{i:03d}.py").write_text(python_module(rng, rng.randint(1_000, 4_000)))
    (src / "_jbx_backend.py").write_text(_WHEEL_BACKEND)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "_jbx_backend"\nbackend-path = ["."]\n'
    )
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-index", "--no-deps"]
    cmd += ["--no-build-isolation", "--disable-pip-version-check", "-q", "-w", str(dest), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise WorkloadError(f"pip wheel of the generated package failed: {proc.stderr[-400:]}")
    shutil.rmtree(src)


# ============================================================================ fixtures


@dataclass(frozen=True)
class Sizes:
    src_files: int
    repo_files: int
    big_mb: int
    seq_mb: int
    create_files: int
    edit_files: int

    @classmethod
    def for_mode(cls, quick: bool) -> Sizes:
        if quick:
            return cls(
                src_files=1_000,
                repo_files=2_000,
                big_mb=16,
                seq_mb=16,
                create_files=2_000,
                edit_files=200,
            )
        return cls(
            src_files=1_000,
            repo_files=10_000,
            big_mb=64,
            seq_mb=100,
            create_files=2_000,
            edit_files=200,
        )


class Fixtures:
    """Cached lower dirs and inputs; each is built the first time a workload asks for it."""

    def __init__(self, sizes: Sizes) -> None:
        self.sizes = sizes

    @cached_property
    def tarball(self) -> Path:
        def build(tmp: Path) -> None:
            tmp.mkdir(parents=True)
            tree = tmp / "tree"
            write_source_tree(tree / "src", self.sizes.src_files)
            tar = tmp / "src.tar"

            def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
                info.mtime, info.uid, info.gid, info.uname, info.gname = FIXED_MTIME, 0, 0, "", ""
                return info

            with tarfile.open(tar, "w") as tf:
                for root, dirs, files in os.walk(tree):
                    dirs.sort()
                    for name in sorted(files):
                        p = Path(root) / name
                        tf.add(p, arcname=str(p.relative_to(tree)), filter=normalize)
            shutil.rmtree(tree)

        return cached(f"src-tar-{self.sizes.src_files}", build) / "src.tar"

    @cached_property
    def empty(self) -> Path:
        return cached("lower-empty", lambda tmp: tmp.mkdir(parents=True))

    @cached_property
    def src(self) -> Path:
        """A lower dir holding `src/`, the untarred source tree."""

        def build(tmp: Path) -> None:
            tmp.mkdir(parents=True)
            with tarfile.open(self.tarball) as tf:
                tf.extractall(tmp, filter="tar")

        return cached(f"lower-src-{self.sizes.src_files}", build)

    @cached_property
    def repo(self) -> Path:
        """A lower dir holding `repo/`, a committed git repo of small files."""
        return cached(
            f"lower-repo-{self.sizes.repo_files}",
            lambda tmp: make_git_repo(tmp / "repo", self.sizes.repo_files),
        )

    @cached_property
    def big(self) -> Path:
        """A lower dir holding `big.bin`; appending to it forces a copy-up of the whole file."""

        def build(tmp: Path) -> None:
            tmp.mkdir(parents=True)
            block = random.Random(4).randbytes(1 << 20)
            with open(tmp / "big.bin", "wb") as f:
                for i in range(self.sizes.big_mb):
                    f.write(block[i:] + block[:i])  # distinct blocks: no dedup shortcuts

        return cached(f"lower-big-{self.sizes.big_mb}mb", build)

    @cached_property
    def wheel(self) -> Path:
        found = sorted(cached("wheel", build_wheel).glob("*.whl"))
        if not found:
            raise WorkloadError("the cached wheel dir holds no wheel; delete it and rerun.")
        return found[0]

    @cached_property
    def edit_list(self) -> list[str]:
        """The files the edit workload rewrites: every k-th .py file of src/, by sorted path."""
        files = sorted(
            str(p.relative_to(self.src)) for p in (self.src / "src").rglob("*.py") if p.is_file()
        )
        step = max(1, len(files) // self.sizes.edit_files)
        return files[::step][: self.sizes.edit_files]

    def lower(self, kind: str) -> Path:
        return getattr(self, kind)


# ============================================================================ timed operations


def timed_tool(
    cmd: Sequence[str],
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    ok: tuple[int, ...] = (0,),
) -> float:
    """Seconds a whole process takes; output is discarded, a failure raises WorkloadError."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        list(cmd),
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=TOOL_TIMEOUT,
    )
    elapsed = time.perf_counter() - t0
    if proc.returncode not in ok:
        tail = proc.stderr.decode(errors="replace").strip()[-300:]
        raise WorkloadError(f"{' '.join(cmd)} exited {proc.returncode}: {tail}")
    return elapsed


def timed_child(op: str, mnt: Path, arg: Any = None) -> float:
    """Runs one Python workload in a fresh interpreter that reports its own timed seconds."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fs_workloads", "child", op, str(mnt)],
        input=json.dumps(arg),
        capture_output=True,
        text=True,
        env=env,
        timeout=TOOL_TIMEOUT,
    )
    if proc.returncode != 0:
        raise WorkloadError(f"child {op} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def _child_create(mnt: Path, n: int) -> float:
    blob = random.Random(5).randbytes(4096)
    sizes = [512 + (i * 37) % 3585 for i in range(n)]
    t0 = time.perf_counter()
    dirs = max(1, n // 100)
    for d in range(dirs):
        os.makedirs(mnt / "new" / f"dir{d:02d}")
    for i in range(n):
        with open(mnt / "new" / f"dir{i % dirs:02d}" / f"f{i:05d}", "wb") as f:
            f.write(blob[: sizes[i]])
    return time.perf_counter() - t0


def _child_edit(mnt: Path, files: list[str]) -> float:
    # An agent's edit tool: read the whole file, change one spot, write the whole file back.
    t0 = time.perf_counter()
    for rel in files:
        path = mnt / rel
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data.replace(b"return", b"return  ", 1))
    return time.perf_counter() - t0


def _child_append(mnt: Path, writes: int) -> float:
    line = b"x" * 1023 + b"\n"
    t0 = time.perf_counter()
    with open(mnt / "big.bin", "ab") as f:
        for _ in range(writes):
            f.write(line)
    return time.perf_counter() - t0


def _child_seqwrite(mnt: Path, mb: int) -> float:
    block = random.Random(6).randbytes(1 << 20)
    fd = os.open(mnt / "seq.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    try:
        for _ in range(mb):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


_CHILD_OPS: dict[str, Callable[[Path, Any], float]] = {
    "create": _child_create,
    "edit": _child_edit,
    "append": _child_append,
    "seqwrite": _child_seqwrite,
}


def _child_main(argv: Sequence[str]) -> int:
    if len(argv) != 3 or argv[0] != "child" or argv[1] not in _CHILD_OPS:
        print(
            f"usage: python -m bench.fs_workloads child {{{','.join(_CHILD_OPS)}}} MNT",
            file=sys.stderr,
        )
        return 2
    arg = json.loads(sys.stdin.read() or "null")
    print(f"{_CHILD_OPS[argv[1]](Path(argv[2]), arg):.9f}")
    return 0


def drop_caches() -> bool:
    """Writes back dirty data and drops page, dentry and inode caches; False when not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


# ============================================================================ the workloads


@dataclass(frozen=True)
class Workload:
    id: str
    title: str
    lower: str  # a Fixtures attribute naming the lower dir
    run: Callable[[Path, Fixtures], float]  # the timed part; returns seconds
    setup: Callable[[Path, Fixtures], None] | None = None  # untimed, inside the fresh mount
    cold: bool = False  # drop caches between set-up and the timed part


def _walk(mnt: Path, fx: Fixtures) -> float:
    # find -printf %s stats every entry, as a walk that lists sizes must.
    return timed_tool(["find", str(mnt / "repo"), "-printf", "%s\n"])


def _untar_into(mnt: Path, fx: Fixtures) -> float:
    return timed_tool(["tar", "-xf", str(fx.tarball), "-C", str(mnt)])


def _git_status(mnt: Path, fx: Fixtures) -> float:
    return timed_tool(["git", "-C", str(mnt / "repo"), "status", "--porcelain"], env=git_env())


def _git_commit(mnt: Path, fx: Fixtures) -> float:
    script = "git init -q -b main && git add -A && git commit -q -m bench"
    return timed_tool(["sh", "-c", script], cwd=mnt / "src", env=git_env())


def _pip_install(mnt: Path, fx: Fixtures) -> float:
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-input", "-q"]
    cmd += ["--disable-pip-version-check", "--target", str(mnt / "site"), str(fx.wheel)]
    return timed_tool(cmd, env=dict(os.environ, PIP_NO_CACHE_DIR="1"))


def make_workloads(sizes: Sizes) -> list[Workload]:
    s = sizes
    return [
        Workload("untar", f"untar a {s.src_files:,}-file source tree", "empty", _untar_into),
        Workload(
            "walk_cold", f"walk {s.repo_files:,}-file tree, cold cache", "repo", _walk, cold=True
        ),
        Workload(
            "walk_warm",
            f"walk {s.repo_files:,}-file tree, warm",
            "repo",
            _walk,
            setup=lambda m, fx: void(_walk(m, fx)),
        ),
        Workload(
            "grep",
            f"grep -r over {s.src_files:,} files (first read through the mount)",
            "src",
            lambda m, fx: timed_tool(["grep", "-r", "-c", "return", str(m / "src")]),
        ),
        Workload(
            "create",
            f"create {s.create_files:,} small files",
            "empty",
            lambda m, fx: timed_child("create", m, s.create_files),
        ),
        Workload(
            "edit",
            f"edit {s.edit_files} files (read, rewrite whole)",
            "src",
            lambda m, fx: timed_child("edit", m, fx.edit_list),
        ),
        Workload(
            "append",
            f"append 100 KiB to a {s.big_mb} MiB base file (copy-up)",
            "big",
            lambda m, fx: timed_child("append", m, 100),
        ),
        Workload(
            "seqwrite",
            f"{s.seq_mb} MiB sequential write + fsync",
            "empty",
            lambda m, fx: timed_child("seqwrite", m, s.seq_mb),
        ),
        Workload(
            "rm_untarred",
            "rm -rf the untarred tree",
            "empty",
            lambda m, fx: timed_tool(["rm", "-rf", str(m / "src")]),
            setup=lambda m, fx: void(_untar_into(m, fx)),
        ),
        Workload(
            "rm_base",
            "rm -rf the source tree in the base (whiteouts)",
            "src",
            lambda m, fx: timed_tool(["rm", "-rf", str(m / "src")]),
        ),
        Workload(
            "git_commit", f"git init + add + commit, {s.src_files:,} files", "src", _git_commit
        ),
        Workload(
            "git_status",
            f"git status, {s.repo_files:,}-file repo (index fresh)",
            "repo",
            _git_status,
            setup=lambda m, fx: void(_git_status(m, fx)),
        ),
        Workload(
            "pip_install", "pip install --target of a local 150-module wheel", "empty", _pip_install
        ),
    ]


def void(_: object) -> None:
    """Discards a set-up step's timing."""


# ============================================================================ the suite


def _run_once(w: Workload, backend: bk.Backend, fx: Fixtures, lower: Path) -> tuple[float, bool]:
    with backend.prepare(lower) as mnt:
        if w.setup is not None:
            w.setup(mnt, fx)
        # Flush what set-up (or an earlier run) left dirty so its write-back is not timed here.
        if w.cold:
            dropped = drop_caches()
        else:
            os.sync()
            dropped = True
        return w.run(mnt, fx), dropped


def check_options(
    backends: Sequence[str] | None = None,
    workloads: Sequence[str] | None = None,
    places: str | None = None,
) -> None:
    """Raise ValueError naming what is unknown, before anything runs."""
    known = [w.id for w in make_workloads(Sizes.for_mode(True))]
    unknown = [w for w in workloads or () if w not in known]
    if unknown:
        raise ValueError(
            f"unknown fs workload(s) {', '.join(unknown)}; choose from {', '.join(known)}."
        )
    unknown = [b for b in backends or () if b not in bk.ALL]
    if unknown:
        raise ValueError(
            f"unknown fs backend(s) {', '.join(unknown)}; choose from {', '.join(bk.ALL)}."
        )
    scratch_fs.parse(places)


def run(
    quick: bool = False,
    backends: Sequence[str] | None = None,
    workloads: Sequence[str] | None = None,
    runs: int | None = None,
    places: str | None = None,
) -> list[dict[str, Any]]:
    """Every workload on every backend, on each scratch file system; rows of seconds, ratios and
    a geometric mean each."""
    check_options(backends, workloads, places)
    sizes = Sizes.for_mode(quick)
    fx = Fixtures(sizes)
    wanted = list(workloads or [])
    all_w = {w.id: w for w in make_workloads(sizes)}
    chosen_w = [all_w[w] for w in wanted] if wanted else list(all_w.values())
    # Five runs: this is often a small shared VM, and a median of three still wobbles.
    n = runs or (1 if quick else 5)
    rows: list[dict[str, Any]] = []
    for name in scratch_fs.parse(places):
        try:
            with scratch_fs.place(name) as where:
                rows += _run_on(where, chosen_w, backends, fx, n)
        except scratch_fs.ScratchUnavailable as exc:
            rows.append({"group": GROUP, "case": "(all workloads)", "system": "-", "fs": name,
                         "fs_label": name, "note": str(exc)})
    return rows


def _run_on(
    where: scratch_fs.Place,
    chosen_w: list[Workload],
    backends: Sequence[str] | None,
    fx: Fixtures,
    n: int,
) -> list[dict[str, Any]]:
    systems = bk.backends(where.root, list(backends) if backends else None)
    live = [b for b in systems if b.unavailable() is None]
    samples: dict[tuple[str, str], list[float]] = {}
    failures: dict[tuple[str, str], str] = {}
    not_cold: set[str] = set()
    for w in chosen_w:
        t0 = time.perf_counter()
        lower = where.lower(fx.lower(w.lower))
        for _ in range(n):
            for b in live:  # interleaved, so slow drift spreads over every backend
                key = (w.id, b.name)
                if key in failures:
                    continue
                try:
                    secs, dropped = _run_once(w, b, fx, lower)
                except Exception as exc:  # one broken backend must not sink the others
                    failures[key] = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
                    continue
                samples.setdefault(key, []).append(secs)
                if not dropped:
                    not_cold.add(w.id)
        took = time.perf_counter() - t0
        print(f"bench: fs [{where.name}] {w.id} {took:.1f} s", file=sys.stderr, flush=True)
    rows = _rows(chosen_w, systems, samples, failures, not_cold)
    for row in rows:
        row["fs"], row["fs_label"] = where.name, where.label
    return rows


def _rows(
    chosen: list[Workload],
    systems: list[bk.Backend],
    samples: dict[tuple[str, str], list[float]],
    failures: dict[tuple[str, str], str],
    not_cold: set[str],
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    med = {key: median(vals) for key, vals in samples.items()}
    ratios: dict[str, dict[str, list[float]]] = {b.name: {"native": [], "fo": []} for b in systems}
    for w in chosen:
        for b in systems:
            if b.unavailable() is not None:
                continue
            key = (w.id, b.name)
            row: dict[str, Any] = {
                "group": GROUP,
                "case": w.title,
                "system": b.name,
                "workload": w.id,
            }
            if key in failures:
                row["note"] = f"failed: {failures[key]}"
            elif key in med:
                row["seconds"] = med[key]
                row["runs"] = len(samples[key])
                for ref, label in ((bk.NATIVE, "native"), (bk.FUSE_OVERLAYFS, "fo")):
                    base = med.get((w.id, ref))
                    if base:
                        r = med[key] / base
                        row["ratio_native" if label == "native" else "ratio_fuse_overlayfs"] = r
                        ratios[b.name][label].append(r)
                if w.id in not_cold:
                    row["note"] = "caches could not be dropped (not root): warm, not cold"
            rows.append(row)
    for b in systems:
        reason = b.unavailable()
        if reason is not None:
            rows.append(
                {"group": GROUP, "case": "(all workloads)", "system": b.name, "note": reason}
            )
            continue
        row = {"group": GROUP, "case": "geometric mean", "system": b.name, "workload": "geomean"}
        if ratios[b.name]["native"]:
            row["ratio_native"] = geomean(ratios[b.name]["native"])
            row["workloads"] = len(ratios[b.name]["native"])
        if ratios[b.name]["fo"]:
            row["ratio_fuse_overlayfs"] = geomean(ratios[b.name]["fo"])
        rows.append(row)
    return rows


# ============================================================================ the report section

def render(rows: list[dict[str, Any]]) -> str:
    """One section per scratch file system, in the order they ran."""
    labels: dict[str, str] = {}
    for r in rows:
        labels.setdefault(r.get("fs", scratch_fs.TMP), r.get("fs_label", ""))
    out = []
    for name, label in labels.items():
        mine = [r for r in rows if r.get("fs", scratch_fs.TMP) == name]
        skipped = [r["note"] for r in mine if r["system"] == "-"]
        body = f"Not run: {skipped[0]}" if skipped else _render_place(mine)
        out.append(f"### On {label}\n\n{body}")
    return "\n\n".join(out)


def _render_place(rows: list[dict[str, Any]]) -> str:
    """Workloads down, backends across: seconds, then ratios to native and to fuse-overlayfs."""
    systems = [s for s in bk.ALL if any(r["system"] == s for r in rows)]
    workloads_seen: list[str] = []
    by_key: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        if r.get("workload") and r["workload"] != "geomean":
            if r["case"] not in workloads_seen:
                workloads_seen.append(r["case"])
            by_key[(r["case"], r["system"])] = r
    geo = {r["system"]: r for r in rows if r.get("workload") == "geomean"}
    missing = {r["system"]: r["note"] for r in rows if r["case"] == "(all workloads)"}
    runs = sorted({r["runs"] for r in rows if "runs" in r})

    def cell(case: str, system: str, key: str) -> str:
        if system in missing:
            return "n/a"
        r = by_key.get((case, system), {})
        if key in r:
            return fmt(float(r[key]), key)
        return "failed" if "failed" in str(r.get("note", "")) else ""

    def table(key: str, title: str, with_geo: bool) -> list[str]:
        out = [title, "", "| workload | " + " | ".join(systems) + " |"]
        out.append("|---|" + "---:|" * len(systems))
        for case in workloads_seen:
            out.append(f"| {fmt(case)} | " + " | ".join(cell(case, s, key) for s in systems) + " |")
        if with_geo:
            vals = [
                fmt(float(geo[s][key]), key) if key in geo.get(s, {}) else "n/a" for s in systems
            ]
            out.append("| **geometric mean** | " + " | ".join(f"**{v}**" for v in vals) + " |")
        return [*out, ""]

    n_text = "/".join(str(x) for x in runs) or "?"
    out = [f"Median of {n_text} run(s), each on a fresh mount; lower is better.", ""]
    out += table("seconds", "Seconds:", with_geo=False)
    if bk.NATIVE in systems:
        out += table("ratio_native", "Ratio to native:", with_geo=True)
    if bk.FUSE_OVERLAYFS in systems:
        out += table("ratio_fuse_overlayfs", "Ratio to fuse-overlayfs:", with_geo=True)
    notes = [
        f"- {r['system']}, {r['case']}: {r['note']}"
        for r in rows
        if r.get("note") and r["case"] != "(all workloads)"
    ]
    backends_text = [
        f"- {cls.name}: {cls.description}"
        for cls in (
            bk.Native,
            bk.KernelOverlay,
            bk.FuseOverlayfs,
            bk.ShadowfsFuse,
            bk.ShadowfsOverlay,
        )
        if cls.name in systems
    ]
    out += ["Backends:", "", *backends_text, ""]
    if notes:
        out += ["Notes:", "", *notes, ""]
    return "\n".join(out).rstrip()


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(_child_main(sys.argv[1:]))
