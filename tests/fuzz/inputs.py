"""Inputs shared by the hypothesis properties and the atheris targets: seeds from the real writers and recorded
pages, structure-aware mutations driven by a `random.Random` (so both tools can steer them), and the invariants
every rejection must keep."""

from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path
from typing import Any

from kv_exporter.manifest import ManifestError, parse_manifest
from kv_exporter.reference import REFERENCE_MODELS
from kv_exporter.sidecar.engine_page import EnginePageError, scan_page
from tests.support.manifests import reference_manifest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ENGINE_PAGE_FIXTURES = tuple(sorted(FIXTURES.glob("*-metrics.txt")))

# A rejection reason is a metric label value (`model_local_kv_manifest_errors_total{reason}`): it must stay a
# short code from a fixed vocabulary, never free text (unbounded label cardinality).
REASON = re.compile(r"[a-z][a-z0-9_]{0,39}")

# Values that sit on the validators' edges: limits, signs, types, enum spellings, JSON's odd corners.
EDGE_VALUES: tuple[Any, ...] = (
    0,
    1,
    -1,
    2**53 - 1,
    2**53,
    2**64,
    -(2**63),
    0.5,
    -0.0,
    1e308,
    "",
    " ",
    "\u0000",
    "x" * 300,
    "float32",
    "bfloat16",
    "torch.float16",
    "fixed",
    "max_num_seqs",
    "request",
    "session",
    "load",
    "warmup",
    "kv_exporter",
    "vllm_omni",
    None,
    True,
    False,
    [],
    {},
    [None],
    {"": None},
)


def manifest_seeds() -> list[bytes]:
    """Valid manifests as the writer produces them, one per reference model (the corpus the fuzzers start from)."""
    return [reference_manifest(model).to_json().encode() for model in REFERENCE_MODELS]


def engine_page_seeds() -> list[bytes]:
    """The recorded vLLM 0.32 and vllm-omni 0.30 pages, plus just their running-count lines."""
    pages = [path.read_bytes() for path in ENGINE_PAGE_FIXTURES]
    running = [b"\n".join(line for line in page.splitlines() if b"num_requests_running" in line) for page in pages]
    return pages + running


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position in a JSON document, the root included."""
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for step in path[:-1]:
        doc = doc[step]
    return doc


def _new_value(rng: random.Random, old: Any) -> Any:
    choice = rng.random()
    if choice < 0.5:
        return copy.deepcopy(rng.choice(EDGE_VALUES))
    if isinstance(old, bool) or not isinstance(old, (int, float, str)):
        return rng.choice((str(old), [old], {"value": old}))
    if isinstance(old, str):
        return rng.choice((old + rng.choice(("x", " ", "\n", "é")), old.upper(), len(old), old[: len(old) // 2]))
    return rng.choice((old + 1, old - 1, -old, str(old), float(old), old * 2**20))


def mutate_document(doc: Any, rng: random.Random) -> Any:
    """One structural change to a copy of `doc`: replace, delete, add, duplicate or retype a random node."""
    doc = copy.deepcopy(doc)
    path = rng.choice(_paths(doc))
    if not path:
        return _new_value(rng, doc)
    parent, key = _parent(doc, path), path[-1]
    action = rng.random()
    if action < 0.55:
        parent[key] = _new_value(rng, parent[key])
    elif action < 0.7:
        del parent[key]
    elif action < 0.85:
        if isinstance(parent, dict):
            parent[rng.choice(("extra", "Schema_version", key + "_"))] = copy.deepcopy(parent[key])
        else:
            parent.append(copy.deepcopy(parent[key]))
    else:
        parent[key] = [parent[key]] if rng.random() < 0.5 else {"nested": parent[key]}
    return doc


def mutate_manifest_bytes(data: bytes, rng: random.Random) -> bytes:
    """A structural mutation when `data` is JSON (reach the validator's deep branches), else a byte edit."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return mutate_bytes(data, rng)
    for _ in range(rng.randint(1, 3)):
        doc = mutate_document(doc, rng)
    text = json.dumps(doc, indent=rng.choice((None, 2)), sort_keys=rng.random() < 0.5, ensure_ascii=rng.random() < 0.5)
    return text.encode("utf-8", "surrogatepass")


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """Truncate, splice, flip or duplicate a byte range."""
    if not data:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 16)))
    i = rng.randrange(len(data))
    j = min(len(data), i + rng.randint(1, 32))
    action = rng.randrange(4)
    if action == 0:
        return data[:i]
    if action == 1:
        return data[:i] + bytes(rng.getrandbits(8) for _ in range(j - i)) + data[j:]
    if action == 2:
        return data[:i] + data[i:j] * rng.randint(2, 8) + data[j:]
    return data[:i] + data[j:]


# -- engine pages ------------------------------------------------------------------------------------------------

_PAGE_TOKENS = (
    b"vllm:num_requests_running",
    b"vllm_omni:num_requests_running",
    b"vllm:num_requests_running_total",
    b'{engine="0",model_name="m"}',
    b'{model_name="m",replica="1",stage="2"}',
    b'model_name="a\\"b\\\\c\\n"',
    b"engine=",
    b'stage="-1"',
    b' 3.0"',
    b" NaN",
    b" +Inf",
    b" -1",
    b" 1e308",
    b" 7 1700000000000",
    b"\r\n",
    b"\n",
    b"{",
    b"}",
    b",",
    b'"',
    b"\\",
    b"# TYPE vllm:num_requests_running gauge\n",
)


def mutate_page(data: bytes, rng: random.Random) -> bytes:
    """Line-aware edits of a metrics page: drop, duplicate or rewrite running-count lines, splice tokens."""
    lines = data.split(b"\n")
    # Most of a real page is other metrics the scanner skips: aim mostly at the running-count lines.
    relevant = [n for n, line in enumerate(lines) if b"num_requests_running" in line]
    i = rng.choice(relevant) if relevant and rng.random() < 0.8 else rng.randrange(len(lines))
    action = rng.randrange(4)
    if action == 0:
        lines.insert(i, lines[rng.randrange(len(lines))])  # a duplicate series
    elif action == 1:
        del lines[i]
    elif action == 2:
        line = lines[i]
        cut = rng.randint(0, len(line))
        lines[i] = line[:cut] + rng.choice(_PAGE_TOKENS) + line[cut + rng.randint(0, 8) :]
    else:
        return mutate_bytes(data, rng)
    return b"\n".join(lines)


# -- the invariants ----------------------------------------------------------------------------------------------


def check_manifest(data: bytes) -> bool:
    """Parse `data`: a rejection must be a ManifestError with a label-safe reason; an acceptance must round-trip.

    Returns whether it was accepted. Any other exception escapes (the fuzzers report it as a crash).
    """
    try:
        manifest = parse_manifest(data, "fuzz-input")
    except ManifestError as exc:
        if not REASON.fullmatch(exc.reason) or exc.path != "fuzz-input":
            raise AssertionError(f"bad rejection: reason={exc.reason!r} path={exc.path!r}") from exc
        return False
    again = parse_manifest(manifest.to_json().encode(), "round-trip")
    if again != manifest:
        raise AssertionError(f"accepted manifest does not round-trip: {manifest!r} != {again!r}")
    return True


def check_engine_page(data: bytes) -> bool:
    """Scan `data`: a rejection must be an EnginePageError with a label-safe reason; an acceptance must hold only
    whole non-negative counts for well-formed engine keys. Returns whether it was accepted."""
    try:
        page = scan_page(data)
    except EnginePageError as exc:
        if not REASON.fullmatch(exc.reason):
            raise AssertionError(f"bad rejection reason {exc.reason!r}") from exc
        return False
    for key, count in page.running.items():
        if not (isinstance(count, int) and count >= 0 and key.stage >= 0 and key.engine >= 0):
            raise AssertionError(f"accepted an impossible series {key!r} = {count!r}")
        capped = page.running_for(key)
        if capped is None or capped > count:
            raise AssertionError(f"running_for({key!r}) = {capped!r} is not capped by {count}")
    if any(not isinstance(count, int) or count < 0 for count in page.pipeline_running.values()):
        raise AssertionError(f"accepted an impossible pipeline count {page.pipeline_running!r}")
    return bool(page.running or page.pipeline_running)
