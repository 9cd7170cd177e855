#!/usr/bin/env bash
# `make wheel-check`: the one abi3 wheel (cp310-abi3, setup.py) built, then used as a user gets it, never the source:
#   1. `pip wheel .` into dist/; its tag must be cp310-abi3 and both C extensions in it `*.abi3.so`;
#   2. for each CPython 3.10-3.13 in $PYENV_ROOT/versions (those present): a fresh venv, the wheel installed with its
#      dependencies (prometheus-client, from the package index), then from an empty folder with no PYTHONPATH: both
#      extensions import from that venv's site-packages, `python -m kv_exporter.plugin --check` exits 0, and the
#      tracker holds and releases a storage of plain objects (no torch);
#   3. on the engine's Python (.venv-vllm: vLLM 0.32's CPU engine, torch): the wheel installed --no-deps into a
#      folder of its own, and the real-engine observation tests run with that folder as the only kv_exporter on the
#      path: they run from a copy of tests/ that has no kv_exporter beside it, every process of the engine records
#      where kv_exporter and its extensions came from (kvx_testplugin.check_origin) and refuses any other, and the
#      records are shown and checked at the end. Minutes: the engine starts for each test module.
#
#   scripts/wheel-check.sh                  all three
#   scripts/wheel-check.sh --no-engine      1 and 2 only (seconds)
#
# Environment: PYTHON (builds the wheel; default .venv/bin/python), PYENV_ROOT (default /root/.pyenv),
# WHEEL_CHECK_VERSIONS (default "3.10 3.11 3.12 3.13"), ABI3AUDIT (default abi3audit on PATH; empty or absent: skipped),
# WHEEL_CHECK_ENGINE_TESTS (the engine tests, default tests/engine/test_observed_engine.py and
# tests/engine/test_running_steps.py), KEEP=1 keeps the scratch folder.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

PYTHON=${PYTHON:-.venv/bin/python}
PYENV_ROOT=${PYENV_ROOT:-/root/.pyenv}
ENGINE_TESTS=${WHEEL_CHECK_ENGINE_TESTS:-tests/engine/test_observed_engine.py tests/engine/test_running_steps.py}
engine=1
[[ ${1:-} == --no-engine ]] && engine=0

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvx-wheel-check.XXXXXX")
[[ ${KEEP:-0} == 1 ]] || trap 'rm -rf "$tmp"' EXIT
say() { printf 'wheel-check: %s\n' "$*"; }
fail() {
    printf 'wheel-check: FAILED: %s\n' "$*" >&2
    exit 1
}

# -- 1. the wheel ------------------------------------------------------------------------------------------------
# build/ first: setuptools packs whatever an earlier build left in build/lib (an in-place build's
# *.cpython-311-*.so, say) into the wheel.
rm -rf build
mkdir -p dist
rm -f dist/kv_exporter-*.whl
"$PYTHON" -m pip wheel -q --no-deps -w dist/ .
wheels=(dist/kv_exporter-*.whl)
((${#wheels[@]} == 1)) || fail "expected one wheel in dist/, found: ${wheels[*]}"
wheel=$repo/${wheels[0]}
case $(basename "$wheel") in
    kv_exporter-*-cp310-abi3-linux_*.whl | kv_exporter-*-cp310-abi3-manylinux*.whl) ;;
    *) fail "$(basename "$wheel") is not tagged cp310-abi3" ;;
esac
"$PYTHON" - "$wheel" <<'EOF' || fail "the wheel's extensions"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
built = sorted(name for name in names if name.endswith(".so"))
want = ["kv_exporter/plugin/_steps.abi3.so", "kv_exporter/plugin/observe/_tracker.abi3.so"]
if built != want:
    sys.exit(f"the wheel's extensions are {built}, not {want}")
EOF
say "built $(basename "$wheel") (both extensions *.abi3.so)"
# abi3audit (in .venv: requirements-dev.txt; not a dependency of the package) reads every symbol the extensions
# import against the stable ABI's list for the tag's version; tests/native/test_wheel.py makes a cheaper check.
abi3audit=${ABI3AUDIT-$(command -v abi3audit || command -v "$repo/.venv/bin/abi3audit" || true)}
if [[ -n $abi3audit ]]; then
    "$abi3audit" --strict --report "$wheel" >"$tmp/abi3audit.json" || {
        "$abi3audit" --strict --verbose "$wheel" || true
        fail "abi3audit: the extensions use symbols outside the stable ABI of 3.10"
    }
    say "abi3audit: both extensions keep to the stable ABI of 3.10"
else
    say "abi3audit not installed: the symbols are not audited here (tests/native/test_wheel.py makes a cheaper check)"
fi

# -- 2. every local CPython from 3.10 ------------------------------------------------------------------------------
# Run in an empty folder, with no PYTHONPATH: only the venv's site-packages can give kv_exporter.
INSTALLED_CHECK='
import importlib, sys, sysconfig
from pathlib import Path
site = Path(sysconfig.get_paths()["purelib"]).resolve()
loaded, failed = {}, []
for name in ("kv_exporter.plugin._steps", "kv_exporter.plugin.observe._tracker"):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        failed.append(f"{name}: {exc}")
        continue
    file = Path(module.__file__).resolve()
    if not file.is_relative_to(site) or not file.name.endswith(".abi3.so"):
        failed.append(f"{name} from {file}, not an abi3 extension under {site}")
        continue
    loaded[name] = module
    print(f"  {name}: {file}")

# The step writer: steps through a StepWrapper land in the record (positional, keyword, a dummy run that does not).
if "kv_exporter.plugin._steps" in loaded:
    import mmap
    from kv_exporter.steprecord import RECORD_BYTES, decode, new_record
    steps = loaded["kv_exporter.plugin._steps"]
    class Output:
        num_scheduled_tokens = {"a": 1, "b": 1, "c": 1}
    mapped = mmap.mmap(-1, RECORD_BYTES)
    mapped[:] = new_record(1, 1)
    record = steps.Record(mapped)
    wrapper = steps.StepWrapper(lambda scheduler_output, dummy_run=False: 7, record)
    results = (wrapper(Output()), wrapper(scheduler_output=Output()), wrapper(Output(), dummy_run=True))
    written = decode(bytes(mapped))
    record.close()
    mapped.close()
    if results != (7, 7, 7) or (written.steps, written.finished, written.latest) != (2, 2, 3):
        failed.append(f"the step writer wrote {written} for {results}")
    else:
        print("  step writer: 2 steps of 3 sequences written, the dummy run passed through")
for failure in failed:
    print(f"  FAILED {failure}")
if "kv_exporter.plugin.observe._tracker" not in loaded:
    sys.exit(1)
tracker = loaded["kv_exporter.plugin.observe._tracker"]

# The tracker without torch: any class with untyped_storage().nbytes() and .data_ptr() is a tensor to it.
class Storage:
    def __init__(self, nbytes, pointer):
        self._nbytes, self._pointer = nbytes, pointer
    def nbytes(self):
        return self._nbytes
    def data_ptr(self):
        return self._pointer
class Tensor:
    def __init__(self, nbytes, pointer):
        self.storage = Storage(nbytes, pointer)
    def untyped_storage(self):
        return self.storage
class Delegate:
    pass
held = tracker.Tracker(Delegate(), "unattributed", set(), set(), Tensor)
state = Tensor(4096, 0x10000)
held.hold(state, "smoke.owner", False)  # as the state of a declaring owner: read at the catch-up
held.catch_up()
now = held.take()[0]["smoke.owner"][0]
assert now == 4096, f"the tracker holds {now} bytes, not the 4096 it was given"
held.let_go(state)
held.catch_up()
now = held.take()[0]["smoke.owner"][0]
assert now == 0, f"the tracker still holds {now} bytes it let go"
print("  tracker: held, counted and let go 4096 bytes of a plain-object tensor")
sys.exit(1 if failed else 0)
'
found=0
failures=()
for version in ${WHEEL_CHECK_VERSIONS:-3.10 3.11 3.12 3.13}; do
    mapfile -t interpreters < <(find "$PYENV_ROOT/versions" -maxdepth 3 -path "*/$version.*/bin/python$version" 2>/dev/null | sort -V)
    ((${#interpreters[@]})) || {
        say "no CPython $version under $PYENV_ROOT/versions: skipped"
        continue
    }
    python=${interpreters[-1]}
    found=$((found + 1))
    venv=$tmp/venv-$version
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
    say "$("$venv/bin/python" -VV | head -1): installed"
    (cd "$tmp" && env -u PYTHONPATH "$venv/bin/python" -I -c "$INSTALLED_CHECK") || failures+=("CPython $version: extensions")
    (cd "$tmp" && env -u PYTHONPATH "$venv/bin/python" -m kv_exporter.plugin --check) || failures+=("CPython $version: --check")
done
((found)) || fail "no CPython 3.10-3.13 under $PYENV_ROOT/versions"
((${#failures[@]} == 0)) || fail "$(printf '%s; ' "${failures[@]}")"

((engine)) || {
    say "ok (engine tests not run: --no-engine)"
    exit 0
}

# -- 3. the real engine, on the wheel ---------------------------------------------------------------------------
vllm_python=$repo/.venv-vllm/bin/python
[[ -x $vllm_python ]] || fail "no .venv-vllm (make engine-env)"
site=$tmp/site
"$vllm_python" -m pip install -q --disable-pip-version-check --no-deps --target "$site" "$wheel"
# The tests' own modules from a copy of tests/ with no kv_exporter beside it: pytest puts the copy's root first on
# sys.path, and the engine's processes get it first on theirs (tests/engine/server.py), so a source tree there would
# shadow the wheel. The environments are this checkout's (links); .venv-vllm's editable kv_exporter comes after
# PYTHONPATH on every sys.path.
runner=$tmp/repo
mkdir -p "$runner"
cp -r tests pyproject.toml "$runner/"
find "$runner/tests" -name __pycache__ -prune -exec rm -rf {} +
ln -s "$(readlink -f .venv-vllm)" "$runner/.venv-vllm"
[[ ! -e $runner/kv_exporter ]] || fail "kv_exporter in the test copy"
origins=$tmp/origins.jsonl
: >"$origins"
say "engine tests on the wheel under $site: $ENGINE_TESTS"
# shellcheck disable=SC2086  # ENGINE_TESTS: a list of paths
(cd "$runner" && PYTHONPATH=$site KVX_TEST_EXPECT_KV_EXPORTER_UNDER=$site KVX_TEST_ORIGIN_LOG=$origins \
    "$repo/.venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$runner" $ENGINE_TESTS) ||
    fail "engine tests on the wheel"
"$PYTHON" - "$origins" "$site" <<'EOF' || fail "where the engine's processes took kv_exporter from"
import json, sys
from collections import Counter
from pathlib import Path
lines = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines()]
site = Path(sys.argv[2]).resolve()
processes = {(line["pid"], line["process"]) for line in lines}
if not any(name != "MainProcess" for _, name in processes):  # the engine core and its workers are named
    sys.exit(f"no engine core or worker recorded where kv_exporter came from, only {sorted(processes)}")
for line in lines:
    for name, file in line["files"].items():
        if not Path(file).resolve().is_relative_to(site):
            sys.exit(f"pid {line['pid']}: {name} from {file}")
tracker = {line["files"]["kv_exporter.plugin.observe._tracker"] for line in lines}
names = ", ".join(f"{count} {name}" for name, count in sorted(Counter(name for _, name in processes).items()))
print(f"wheel-check: {len(processes)} engine processes ({names}), each with kv_exporter.plugin.observe._tracker "
      f"from {', '.join(sorted(tracker))}")
EOF
say ok
