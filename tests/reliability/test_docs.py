"""docs/reliability.md names tests that exist: every `path::name` (or `::name`, after a path on the same line)
resolves to a test function or class in that file, and every `[id]` to a parameter id the file spells out.

A renamed or removed test turns its row into a claim nothing proves; this keeps the matrix honest."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.constants import REPO

DOC = REPO / "docs" / "reliability.md"
REF = re.compile(r"`(?P<path>[\w/.-]+\.py)?(?P<names>(?:::\w+)+)(?:\[(?P<id>[^\]]+)\])?`")


def resolve(path: str) -> Path:
    """A path from the repository root, or a file name unique under tests/."""
    if (REPO / path).is_file():
        return REPO / path
    matches = list((REPO / "tests").rglob(Path(path).name))
    assert len(matches) == 1, (path, matches)
    return matches[0]


def references() -> list[tuple[int, Path, list[str], str | None]]:
    found = []
    for number, line in enumerate(DOC.read_text().splitlines(), 1):
        current: Path | None = None
        for match in REF.finditer(line):
            if match.group("path"):
                current = resolve(match.group("path"))
            assert current is not None, f"line {number}: {match.group(0)} names no file"
            found.append((number, current, match.group("names").split("::")[1:], match.group("id")))
    return found


def test_every_test_named_in_the_reliability_doc_exists() -> None:
    refs = references()
    assert len(refs) > 80  # the matrix, not an empty page
    for number, path, names, param in refs:
        source = path.read_text()
        for name in names:
            assert re.search(rf"^\s*(?:def|class) {name}\b", source, re.MULTILINE), f"line {number}: {path}::{name}"
        if param is not None:
            assert f'"{param}"' in source, f"line {number}: no parameter id {param!r} in {path}"


def test_every_reliability_test_is_in_the_doc() -> None:
    named = {(path, names[-1]) for _, path, names, _ in references()}
    here = Path(__file__).resolve().parent
    for path in sorted(here.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        tests = re.findall(r"^def (test_\w+)", path.read_text(), re.MULTILINE)
        missing = [t for t in tests if (path, t) not in named]
        assert not missing, f"{path.name}: {missing} not in docs/reliability.md"
