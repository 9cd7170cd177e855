"""Write the fuzzers' seed corpora: `python -m tests.fuzz.seed_corpus DIR` -> DIR/manifest, DIR/engine_page,
DIR/fetch."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from tests.fuzz.inputs import answer_seeds, engine_page_seeds, manifest_seeds

TARGETS = {"manifest": manifest_seeds, "engine_page": engine_page_seeds, "fetch": answer_seeds}


def write_seeds(root: Path) -> dict[str, Path]:
    folders = {}
    for target, seeds in TARGETS.items():
        folder = root / target
        folder.mkdir(parents=True, exist_ok=True)
        for seed in seeds():
            # Named by content, like libFuzzer's own corpus files: rewriting is idempotent.
            (folder / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
        folders[target] = folder
    return folders


if __name__ == "__main__":
    for name, folder in write_seeds(Path(sys.argv[1])).items():
        print(f"{name}: {folder}")
