#!/usr/bin/env bash
# `make fuzz`: coverage-guided fuzzing (atheris / libFuzzer) of the two readers of untrusted input, the manifest
# reader and the engine-page scanner, for at least FUZZ_RUNS (default 100,000) inputs per target; then the
# hypothesis properties with a larger budget (KVX_FUZZ_EXAMPLES, default 5,000 per property).
#
#   scripts/fuzz.sh                 build .venv-fuzz if needed, run every target, then the properties
#   scripts/fuzz.sh manifest        one target (manifest | engine_page)
#   scripts/fuzz.sh --env-only      only build .venv-fuzz (used by `make test` for its short atheris run)
#
# Environment: FUZZ_RUNS, FUZZ_SEED (libFuzzer -seed; 0 = random), KVX_FUZZ_EXAMPLES, PYTHON (for the venv).
# Crashes land in .artifacts/fuzz/crashes/ (replay: .venv-fuzz/bin/python tests/fuzz/fuzz_<target>.py FILE);
# the growing corpora in .artifacts/fuzz/corpus/<target>/ are reused by the next run.
#
# atheris lives in its own venv: it is a native extension built against clang's libFuzzer, has wheels only for
# some Python versions, and the project venv must not depend on it. Where pip finds no wheel, Debian's clang and
# libFuzzer are installed and atheris is built from source.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv-fuzz
PY="$VENV/bin/python"
STAMP="$VENV/.stamp"
ATHERIS="atheris==3.0.0"
RUNS="${FUZZ_RUNS:-100000}"
SEED="${FUZZ_SEED:-0}"
OUT=.artifacts/fuzz
KEY="$( (cat "$0" pyproject.toml; "$PYTHON" -V) | sha256sum | cut -d' ' -f1)"

install_atheris() {
    if "$PY" -m pip install -q --only-binary=:all: "$ATHERIS"; then
        return
    fi
    echo "fuzz.sh: no atheris wheel for $("$PY" -V); building it with Debian's clang and libFuzzer" >&2
    if ! command -v clang >/dev/null 2>&1; then
        if [[ $EUID -ne 0 ]]; then
            echo "fuzz.sh: clang is missing; run as root or install clang and libclang-rt-dev" >&2
            exit 1
        fi
        apt-get -q -o DPkg::Lock::Timeout=600 update -qq
        local major
        major="$(clang_major)"  # Debian's `clang` is clang-N; compiler-rt and libFuzzer come per N
        DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=600 install -y -qq \
            --no-install-recommends clang "libclang-rt-${major}-dev" "libfuzzer-${major}-dev" >/dev/null
    fi
    CLANG_BIN="$(command -v clang)" "$PY" -m pip install -q --no-binary atheris "$ATHERIS"
}

clang_major() {
    apt-cache depends clang 2>/dev/null | sed -n 's/.*Depends: clang-\([0-9]*\)$/\1/p' | head -n1
}

ensure_env() {
    if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
        return
    fi
    # One builder at a time: `make -j` or several helpers sharing the checkout must not interleave pip runs.
    exec 9>"${TMPDIR:-/tmp}/kv-exporter-fuzz-env-$(pwd | sha256sum | cut -c1-12).lock"
    flock 9
    if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
        return
    fi
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    install_atheris
    "$PY" -m pip install -q -e .
    "$PY" -c 'import atheris, kv_exporter.manifest, kv_exporter.sidecar.engine_page'
    echo "$KEY" > "$STAMP"
    echo "fuzz.sh: built $VENV ($("$PY" -m pip show atheris | sed -n 's/^Version: /atheris /p'))"
}

run_target() {
    local target="$1" log="$OUT/logs/$1.log"
    mkdir -p "$OUT/crashes" "$OUT/logs"
    echo "fuzz.sh: $target: $RUNS inputs (seed corpus + $OUT/corpus/$target)"
    local started=$SECONDS
    # -rss_limit_mb / -timeout: a reader that balloons or hangs on one input is a finding too.
    if ! PYTHONPATH=. "$PY" "tests/fuzz/fuzz_${target}.py" \
        -runs="$RUNS" -seed="$SEED" -rss_limit_mb=2048 -timeout=20 -max_len=131072 -print_final_stats=1 \
        -artifact_prefix="$OUT/crashes/${target}-" "$OUT/corpus/$target" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "fuzz.sh: $target FAILED; reproducer in $OUT/crashes/, full log $log" >&2
        return 1
    fi
    local executed
    executed="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)"
    if [[ -z "$executed" || "$executed" -lt "$RUNS" ]]; then
        echo "fuzz.sh: $target ran only ${executed:-?} inputs (< $RUNS); log $log" >&2
        return 1
    fi
    echo "fuzz.sh: $target: $executed inputs, no crash, $((SECONDS - started)) s" \
        "($(grep -c . <(ls "$OUT/corpus/$target")) corpus files; $(grep -m1 -o 'cov: [0-9]*' <(tac "$log") || true))"
}

main() {
    local env_only=0 targets=()
    for arg in "$@"; do
        case "$arg" in
            --env-only) env_only=1 ;;
            manifest | engine_page | fetch) targets+=("$arg") ;;
            *) echo "usage: $0 [--env-only] [manifest|engine_page|fetch ...]" >&2; exit 2 ;;
        esac
    done
    ensure_env
    [[ $env_only -eq 1 ]] && return
    [[ ${#targets[@]} -eq 0 ]] && targets=(manifest engine_page fetch)
    PYTHONPATH=. "$PY" -m tests.fuzz.seed_corpus "$OUT/corpus" >/dev/null
    local failed=0
    for target in "${targets[@]}"; do
        run_target "$target" || failed=1
    done
    # The properties run in the project venv (hypothesis is there), with a budget far above make test's.
    if [[ -x .venv/bin/python ]]; then
        echo "fuzz.sh: hypothesis properties, ${KVX_FUZZ_EXAMPLES:-5000} examples each"
        KVX_FUZZ_EXAMPLES="${KVX_FUZZ_EXAMPLES:-5000}" .venv/bin/python -m pytest -q -p no:cacheprovider \
            tests/fuzz/test_properties.py || failed=1
    fi
    return $failed
}

main "$@"
