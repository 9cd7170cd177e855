"""The docs keep their shape: reference pages state what holds now, history lives in decision records, links resolve.

A reference page is README.md or any docs/*.md. It may name a date as provenance (a table's "date, load" column, a
run's date inside a sentence), but no heading carries a date and no paragraph, list item or heading opens with one
or with a history marker ("Before:", "This round", "Second design", ...): that is a dated narrative, and it belongs
in a record under docs/decisions/. A record has the four parts `## Context`, `## Choice`, `## Measurement` (naming
a YYYY-MM-DD date and the load average) and `## Consequences`, in that order, and a row in docs/decisions/README.md.
Every relative link in README.md and docs/ resolves: the file exists and an `#anchor` is one of its headings' anchors
as GitHub makes them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DECISIONS = DOCS / "decisions"
REFERENCE_PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
ALL_PAGES = [*REFERENCE_PAGES, *sorted(DECISIONS.glob("*.md"))]
RECORDS = sorted(path for path in DECISIONS.glob("*.md") if re.fullmatch(r"\d{4}-[a-z0-9-]+\.md", path.name))
PARTS = ("Context", "Choice", "Measurement", "Consequences")

DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
# What a paragraph of dated history opens with, once its list marker and emphasis are stripped.
HISTORY_OPENING = re.compile(
    r"(\d{4}-\d{2}-\d{2}|(Before|After)( and (after|before))?\s*[:.,(]|(This|The first|The second|The last) round\b"
    r"|(First|Second|Third|Fourth|Fifth) design\b|How it got here\b)",
    re.IGNORECASE,
)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a fence's own lines blanked, so paragraphs still split there)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def without_code_spans(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower case, only letters, digits, `_`, `-` and spaces
    kept, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, a repeated one suffixed -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def paragraph_openings(text: str) -> list[str]:
    """The first line of every paragraph, list item and heading, its markers and emphasis stripped."""
    openings, previous = [], ""
    for line in prose_lines(text):
        stripped = line.strip()
        starts_block = not previous.strip() or re.match(r"([-*+]|\d+\.)\s", stripped) or stripped.startswith("#")
        if stripped and not stripped.startswith("|") and starts_block:
            openings.append(re.sub(r"^(#{1,6}|[-*+]|\d+\.)?\s*[*_]*", "", stripped))
        previous = line
    return openings


def test_the_anchor_rule_is_githubs() -> None:
    assert github_anchor("The step record's cost per step") == "the-step-records-cost-per-step"
    assert github_anchor("vLLM 0.34 (its real classes; no engine)") == "vllm-034-its-real-classes-no-engine"
    assert github_anchor("`measure_cache_bytes(cache)`") == "measure_cache_bytescache"
    assert github_anchor("Locked-down serving: `--web.config.file`") == "locked-down-serving---webconfigfile"
    assert github_anchor("1. Scrape latency") == "1-scrape-latency"


def test_a_dated_opening_is_found() -> None:
    text = "# Page\n\nCurrent text.\n\n**Second design, 2026-12-02.** Then...\n\n- 2026-12-03: a run\n"
    flagged = [line for line in paragraph_openings(text) if HISTORY_OPENING.match(line)]
    assert flagged == ["Second design, 2026-12-02.** Then...", "2026-12-03: a run"]


@pytest.mark.parametrize("page", REFERENCE_PAGES, ids=lambda path: path.name)
def test_reference_pages_hold_no_dated_narrative(page: Path) -> None:
    text = page.read_text()
    dated_headings = [line for line in prose_lines(text) if HEADING.match(line) and DATE.search(line)]
    history = [line for line in paragraph_openings(text) if HISTORY_OPENING.match(without_code_spans(line))]
    assert not dated_headings, f"{page.name}: headings with a date belong in docs/decisions/: {dated_headings}"
    assert not history, f"{page.name}: dated history belongs in docs/decisions/: {history}"


@pytest.mark.parametrize("record", RECORDS, ids=lambda path: path.name)
def test_each_decision_record_has_its_four_parts(record: Path) -> None:
    text = record.read_text()
    assert text.startswith(f"# {record.name[:4]}. "), f"{record.name}: the title is '# NNNN. ...' with its number"
    headings = [line[3:].strip() for line in prose_lines(text) if line.startswith("## ")]
    assert headings == list(PARTS), f"{record.name}: parts {headings}, wanted {list(PARTS)}"
    measurement = text.split("## Measurement", 1)[1].split("## Consequences", 1)[0]
    assert DATE.search(measurement), f"{record.name}: the measurement names no YYYY-MM-DD date"
    assert "load" in measurement, f"{record.name}: the measurement names no load average"


def test_the_index_lists_every_record_and_nothing_else() -> None:
    listed = set(re.findall(r"\]\((\d{4}-[a-z0-9-]+\.md)\)", (DECISIONS / "README.md").read_text()))
    assert listed == {record.name for record in RECORDS}
    numbers = [int(record.name[:4]) for record in RECORDS]
    assert numbers == list(range(1, len(numbers) + 1)), "records are numbered 0001, 0002, ... without gaps"


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for line in prose_lines(page.read_text()):
        for target in LINK.findall(without_code_spans(line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # http:, https:, mailto:
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            if not linked.exists() or (anchor and (linked.suffix != ".md" or anchor not in anchors(linked))):
                broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links that resolve to nothing: {broken}"
