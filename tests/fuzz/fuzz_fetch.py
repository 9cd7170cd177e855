"""Coverage-guided fuzz target (atheris / libFuzzer) for the HTTP answer reader (`kv_exporter.transport.fetch`).

Run through `make fuzz` (scripts/fuzz.sh), or directly in .venv-fuzz:
    .venv-fuzz/bin/python tests/fuzz/fuzz_fetch.py -runs=100000 CORPUS_DIR
Each input is an engine's whole answer, sent by a loopback server to the real fetch: only FetchError (with a listed
reason, never `timeout`: the answer is all there) may escape, a body never passes the cap, no fetch overruns its
deadline. Half the mutations are line-aware (head and framing lines duplicated, dropped, spliced), the rest
libFuzzer's own.
"""

from __future__ import annotations

import random
import sys

import atheris

with atheris.instrument_imports(include=["kv_exporter", "tests.fuzz"]):
    from tests.fuzz.inputs import check_fetch, mutate_answer


def test_one_input(data: bytes) -> None:
    check_fetch(data)


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 0.5:
        mutated: bytes = atheris.Mutate(data, max_size)
        return mutated
    return mutate_answer(data, rng)[:max_size]


def main() -> None:
    atheris.Setup(sys.argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
