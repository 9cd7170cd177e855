"""Coverage-guided fuzz target (atheris / libFuzzer) for the manifest reader.

Run through `make fuzz` (scripts/fuzz.sh), or directly in .venv-fuzz:
    .venv-fuzz/bin/python tests/fuzz/fuzz_manifest.py -runs=100000 CORPUS_DIR
Only ManifestError (with a label-safe reason) may escape `parse_manifest`; an accepted manifest must round-trip.
Half the mutations are structure-aware (JSON fields changed, dropped, added, retyped), the rest libFuzzer's own.
"""

from __future__ import annotations

import random
import sys

import atheris

with atheris.instrument_imports(include=["kv_exporter", "tests.fuzz"]):
    from tests.fuzz.inputs import check_manifest, mutate_manifest_bytes


def test_one_input(data: bytes) -> None:
    check_manifest(data)


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 0.5:
        mutated: bytes = atheris.Mutate(data, max_size)
        return mutated
    return mutate_manifest_bytes(data, rng)[:max_size]


def main() -> None:
    atheris.Setup(sys.argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
