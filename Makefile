# Every target builds what it needs: virtual environments and Debian packages are created on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The demo's own environment: only what the exporter needs at run time (prometheus-client), so it serves within
# seconds of a fresh clone instead of after the test toolchain's torch and friends.
DEMO_VENV  := .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed
DEMO_ARGS  ?=
# The torch-free test tier's environment: the package (nvml and web extras) and requirements-unit.txt, no torch,
# transformers or vLLM, so `make unit` runs tests/unit and tests/golden about a minute after a fresh clone.
UNIT_VENV  := .venv-unit
UNIT_STAMP := $(UNIT_VENV)/.installed
UNIT_TESTS := tests/unit tests/golden
# The plugin's C extensions (the cache tracker, the step record's writer), built in place by the editable installs
# (shared by every 3.11 venv here): rebuilt when a source changes, and required to import, since pip treats their
# build as optional (an image without a compiler still installs the plugin, which then reports its observation
# "not-built" and keeps no step record).
# Both keep to the limited API of 3.10 and are named *.abi3.so; a build from before that (*.cpython-311-*.so) would be
# imported ahead of them, so it is removed first.
TRACKER_SOURCE := kv_exporter/plugin/observe/_tracker.c kv_exporter/plugin/observe/_tables.h kv_exporter/plugin/_steps.c
TRACKER_STAMP  := $(VENV)/.tracker-built
OLD_BUILDS     := kv_exporter/plugin/_steps.cpython-*.so kv_exporter/plugin/observe/_tracker.cpython-*.so

.PHONY: demo test lint unit native wheel-check engine-env vllm34-env omni-env omni32-env fuzz-env system-deps bench fuzz gpu-proof clean

$(STAMP): pyproject.toml requirements-dev.txt requirements-unit.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[nvml,web]' -r requirements-dev.txt
	touch $(STAMP)

$(TRACKER_STAMP): $(STAMP) $(TRACKER_SOURCE) setup.py
	rm -f $(OLD_BUILDS)
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c 'import kv_exporter.plugin.observe._tracker, kv_exporter.plugin._steps' || \
		{ echo "the plugin's C extensions did not build: a C compiler and Python's headers are needed" >&2; exit 1; }
	touch $(TRACKER_STAMP)

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install -q --disable-pip-version-check -e .
	touch $(DEMO_STAMP)

$(UNIT_STAMP): pyproject.toml requirements-unit.txt
	$(PYTHON) -m venv $(UNIT_VENV)
	$(UNIT_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[nvml,web]' -r requirements-unit.txt
	touch $(UNIT_STAMP)

# The torch-free tier (tests/unit, tests/golden); the tests needing torch and transformers are in tests/torch.
unit: $(UNIT_STAMP)
	$(UNIT_VENV)/bin/python -m pytest -q $(UNIT_TESTS)

# The cache tracker's C alone (`make test` runs it too): its tables' C tests, its Python tests against a build with
# AddressSanitizer and UndefinedBehaviorSanitizer, and the reference-leak run; about 2 minutes.
native: $(STAMP) $(TRACKER_STAMP)
	$(PY) -m pytest -q tests/native

# The one wheel (cp310-abi3: every CPython from 3.10), built with `pip wheel .` and checked installed, never the source:
# on each CPython 3.10-3.13 under /root/.pyenv (both extensions load from the venv, --check, a tracker smoke test),
# then the real-engine observation tests on the engine's Python with the wheel as their kv_exporter; minutes.
# `bash scripts/wheel-check.sh --no-engine` stops before the engine (seconds).
wheel-check: $(STAMP) engine-env
	bash scripts/wheel-check.sh

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/kv-exporter demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

system-deps:
	bash scripts/ensure-system-deps.sh

engine-env:
	bash scripts/ensure-vllm-env.sh

# vLLM 0.34.0's classes (no engine: no CPU build exists); ~5.4 GB, ~1.5 min on a warm pip cache.
vllm34-env:
	bash scripts/ensure-vllm34-env.sh

omni-env:
	bash scripts/ensure-omni-env.sh

omni32-env:
	bash scripts/ensure-omni32-env.sh

fuzz-env:
	bash scripts/fuzz.sh --env-only

# The wheel's check last: the issue's promise (one wheel, installed, observes on every local CPython and under the
# real engine) is held by every run, not only when someone remembers `make wheel-check`.
test: $(STAMP) $(TRACKER_STAMP) system-deps engine-env vllm34-env omni-env omni32-env fuzz-env lint
	$(PY) -m pytest tests
	bash scripts/wheel-check.sh

bench: $(STAMP) $(TRACKER_STAMP)
	$(PY) -m bench.run_all

fuzz: $(STAMP)
	bash scripts/fuzz.sh

# On a CUDA machine, under its own python3 (no environment is built: such machines have no package index).
# Under the machine's own python3 (its CUDA torch): the tracker is built in place for it first.
gpu-proof:
	rm -f $(OLD_BUILDS)
	$(PYTHON) setup.py -q build_ext --inplace
	$(PYTHON) -m scripts.gpu_proof

clean:
	rm -rf $(VENV) .venv-* .pytest_cache .mypy_cache .ruff_cache
