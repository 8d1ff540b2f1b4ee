# Two commands do all set-up on a fresh Debian machine: `make demo` and `make test`.
# Everything else here is what they are made of.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := fuse3 libfuse3-dev libcap-dev pkg-config fuse-overlayfs sqlite3 git python3-venv python3-dev gcc xfsprogs libseccomp2 postgresql chromium openssl bubblewrap strace
STAMP := $(VENV)/.installed
# Real MCP servers from npm the tests run (tests/mcp/node/package-lock.json).
NODE_SERVERS := tests/mcp/node
NODE_STAMP := $(NODE_SERVERS)/node_modules/.installed

.PHONY: demo test bench torture fuzz lint setup system-packages receivers vm-test clean

demo: setup
	$(PY) -m jukebox.demo

# The suite on two workers (pytest-xdist; tests sharing a module- or package-scoped fixture on one
# of them, tests/conftest.py), then, alone, the tests marked `serial` (pyproject.toml's markers:
# CPU hogs, tests an idle CPU or the CPU affinity decides, machine-wide state). Serially pytest
# took 16 to 18 minutes on CI's 2-core VM.
test: setup receivers
	$(VENV)/bin/ruff check shadowfs jukebox tests bench vm
	$(VENV)/bin/mypy
	$(PY) -m pytest -q --durations=20 -n 2 --dist loadgroup -m "not serial" tests
	$(PY) -m pytest -q --durations=20 -m serial tests

bench: setup
	$(PY) -m bench

# Long fuzzing of every decoder that reads untrusted bytes (make test runs a short pass).
fuzz: setup
	JUKEBOX_FUZZ_SECONDS=$${JUKEBOX_FUZZ_SECONDS:-300} $(PY) -m tests.fuzz

# Crash consistency at scale: hundreds of SIGKILLed commits (at injected points, and real
# `jukebox booth commit` processes killed at random times), each recovered to exactly old or new.
torture: setup
	JUKEBOX_TORTURE_TRIALS=200 JUKEBOX_STORE_CRASH_TRIALS=50 JUKEBOX_TAPE_CRASH_TRIALS=50 \
	JUKEBOX_TAMPER_TRIALS=20000 JUKEBOX_MODEL_SEEDS=16 JUKEBOX_MODEL_OPS=2500 \
	JUKEBOX_CLI_KILL_TRIALS=40 \
	$(PY) -m pytest -q tests/fs/test_commit_crash.py tests/reliability/test_commit_kills.py \
	  tests/reliability/test_store_crash.py tests/reliability/test_tape_crash.py \
	  tests/reliability/test_tamper.py tests/fs/test_model_differential.py

# The kernel-dependent tests (vm/subset.txt) in a virtme-ng VM per Debian kernel: bookworm, trixie
# and sid by default, or KERNEL=bookworm (a suite or a vmlinuz path). Not part of `make test`.
# QEMU runs at nice 19; see docs/vm-tests.md for times and for adding a kernel. The runner
# installs virtme-ng into .vm-cache/vng itself, under the lock a run holds on the cache.
VM_APT_PACKAGES := qemu-system-x86 qemu-utils kmod busybox-static e2fsprogs file util-linux
KERNEL ?=
# Side by side with 45 min of tests each: the whole subset ran in 42 min this way on 2 cores under
# emulation, but with QEMU at nice 0, not 19 (docs/vm-tests.md, "Budget"); in turn it would take
# over two hours. 3 GiB of memory per VM.
VM_ARGS ?= --parallel --budget 2700  # see `.venv/bin/python -m vm --help`

vm-test: setup
	@$(MAKE) --no-print-directory system-packages APT_PACKAGES="$(VM_APT_PACKAGES)"
	nice -n 19 $(PY) -m vm $(VM_ARGS) $(KERNEL)

lint: setup
	$(VENV)/bin/ruff check shadowfs jukebox tests bench vm
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# Bytecode as a wheel install would leave it (PYTHONDONTWRITEBYTECODE may be set): without it the
# CLI recompiles every module on every start.
setup: system-packages $(STAMP) $(NODE_STAMP)
	@$(PY) -m compileall -q shadowfs jukebox >/dev/null

# Only calls apt-get when something is actually missing, so repeated runs stay fast and offline.
system-packages:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO="sudo"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

# The editable install also compiles the booth's C extension in place: rebuilt when it changes.
$(STAMP): pyproject.toml jukebox/booth/_quickline.c shadowfs/_batchio.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# setuptools warns about any flat layout on every editable build: noise for a user
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

# Node from Debian's packages only when no node and npm are on PATH at all (a machine may have
# them from elsewhere, whose nodejs Debian's npm would conflict with).
$(NODE_STAMP): $(NODE_SERVERS)/package-lock.json
	@if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
	  echo "installing system packages: nodejs npm"; \
	  SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO="sudo"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq nodejs npm; \
	fi
	cd $(NODE_SERVERS) && npm ci --no-audit --no-fund --loglevel=error
	@touch $(NODE_STAMP)

# Real OpenTelemetry receivers the export tests send to and read back (tests/export), each in a
# venv of its own: Arize Phoenix pins versions of anthropic and google-genai older than the test
# clients need.
PHOENIX_VENV := $(VENV)/receivers/phoenix
receivers: $(PHOENIX_VENV)/.installed

$(PHOENIX_VENV)/.installed: tests/export/phoenix-requirements.txt
	@test -x $(PHOENIX_VENV)/bin/python || $(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install -q -r tests/export/phoenix-requirements.txt
	@touch $@

clean:
	rm -rf $(VENV) build *.egg-info $(NODE_SERVERS)/node_modules
