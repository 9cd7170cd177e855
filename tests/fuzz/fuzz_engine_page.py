"""Coverage-guided fuzz target (atheris / libFuzzer) for the engine-page scanner (`kv_exporter.sidecar.engine_page`).

Run through `make fuzz` (scripts/fuzz.sh), or directly in .venv-fuzz:
    .venv-fuzz/bin/python tests/fuzz/fuzz_engine_page.py -runs=100000 CORPUS_DIR
Only EnginePageError (with a label-safe reason) may escape `scan_page`; accepted counts must be whole and >= 0.
Half the mutations are line-aware (running-count lines duplicated, dropped, spliced), the rest libFuzzer's own.
"""

from __future__ import annotations

import random
import sys

import atheris

with atheris.instrument_imports(include=["kv_exporter", "tests.fuzz"]):
    from tests.fuzz.inputs import check_engine_page, mutate_page


def test_one_input(data: bytes) -> None:
    check_engine_page(data)


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 0.5:
        mutated: bytes = atheris.Mutate(data, max_size)
        return mutated
    return mutate_page(data, rng)[:max_size]


def main() -> None:
    atheris.Setup(sys.argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
