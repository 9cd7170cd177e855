"""Property tests (hypothesis) for the three readers of untrusted input: the manifest reader, the engine-page scanner
and the HTTP answer reader (the fetch).

Whatever the input, only the typed rejection (ManifestError / EnginePageError / FetchError, with a listed reason)
may escape; what is accepted must be right (a valid manifest round-trips; a well-formed page gives back exactly the
counts it was built from; a well-formed answer exactly its body). Bounded to a few seconds for `make test`;
`make fuzz` raises KVX_FUZZ_EXAMPLES and runs the coverage-guided atheris targets (fuzz_*.py) beside these.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kv_exporter.document import MAX_SAFE_INT
from kv_exporter.dtypes import ITEMSIZE
from kv_exporter.manifest import (
    COLLECTORS,
    Baseline,
    Declaration,
    DeviceInfo,
    EngineIdentity,
    Manifest,
    ManifestError,
    ManifestLimits,
    Phase,
    ProcessInfo,
    parse_manifest,
)
from kv_exporter.protocol import ModelLocalKVScope, RowDriver
from kv_exporter.sidecar.engine_page import EngineKey, EnginePageError, scan_page
from tests.fuzz.inputs import (
    answer_seeds,
    check_engine_page,
    check_fetch,
    check_manifest,
    engine_page_seeds,
    manifest_seeds,
    mutate_answer,
    mutate_bytes,
    mutate_manifest_bytes,
    mutate_page,
)

EXAMPLES = int(os.environ.get("KVX_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def mutated(seed: bytes, mutate: Callable[[bytes, random.Random], bytes], rng: random.Random, rounds: int) -> bytes:
    """`seed` after `rounds` applications of `mutate`."""
    for _ in range(rounds):
        seed = mutate(seed, rng)
    return seed


MANIFEST_SEEDS = manifest_seeds()
PAGE_SEEDS = engine_page_seeds()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=30,
)

# -- the manifest reader -------------------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=4096))
@example(b"")
@example(b"\xff\xfe")
@example(b"[" * 100_000)  # deeper than Python's recursion limit
@example(b'{"a": NaN}')
@example(b'{"a": 1, "a": 2}')
def test_arbitrary_bytes_are_rejected_cleanly(data: bytes) -> None:
    check_manifest(data)


@FUZZ
@given(json_values)
def test_arbitrary_json_is_rejected_cleanly(document: object) -> None:
    assert not check_manifest(json.dumps(document).encode())


@FUZZ
@given(st.sampled_from(MANIFEST_SEEDS), st.randoms(use_true_random=False), st.integers(1, 4))
def test_mutated_manifests_are_rejected_cleanly_or_round_trip(seed: bytes, rng: random.Random, rounds: int) -> None:
    data = mutated(seed, mutate_manifest_bytes, rng, rounds)
    check_manifest(data)


@FUZZ
@given(st.sampled_from(MANIFEST_SEEDS), st.randoms(use_true_random=False))
def test_byte_edits_of_manifests_are_rejected_cleanly(seed: bytes, rng: random.Random) -> None:
    check_manifest(mutate_bytes(seed, rng))


@FUZZ
@given(st.sampled_from(MANIFEST_SEEDS), st.integers(0, 1 << 16))
def test_the_size_limit_is_enforced_before_parsing(seed: bytes, max_bytes: int) -> None:
    limits = ManifestLimits(max_bytes=max_bytes)
    try:
        parse_manifest(seed, "sized", limits)
    except ManifestError as exc:
        assert len(seed) > max_bytes and exc.reason == "too_large"
    else:
        assert len(seed) <= max_bytes


# A valid manifest, field by field, within the reader's documented ranges.
# Any character a document may hold: everything but control characters and lone surrogates (refused, see below).
_allowed = st.characters(blacklist_categories=("Cc", "Cs"))
_texts = st.text(_allowed, max_size=40)
_names = st.text(_allowed, min_size=1, max_size=40).filter(str.strip)
_counts = st.integers(0, MAX_SAFE_INT)


@st.composite
def declarations(draw: st.DrawFn, owner: str, name: str) -> Declaration:
    dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
    geometry = [draw(st.integers(1, 4096)) for _ in range(4)]  # layers, kv_heads, head_dim, positions
    rows = draw(st.sampled_from(RowDriver))
    reason = draw(_names if rows is RowDriver.FIXED else _texts)
    layers, kv_heads, head_dim, positions = geometry
    return Declaration(
        owner=owner,
        name=name,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        physical_capacity_positions=positions,
        capacity_source=draw(_texts),
        scope=draw(st.sampled_from(ModelLocalKVScope)).value,
        rows=rows.value,
        rows_fixed=draw(st.integers(1, 1 << 20)),
        rows_reason=reason,
        allocation_note=draw(st.none() | _texts),
    )


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    keys = draw(st.lists(st.tuples(_texts, _names), max_size=6, unique=True))
    return Manifest(
        engine=EngineIdentity(draw(_names), *[draw(st.integers(0, 1 << 16)) for _ in range(5)]),
        process=ProcessInfo(
            pid=draw(st.integers(1, 1 << 22)),
            start_time_ticks=draw(st.none() | _counts),
            pid_namespace=draw(st.none() | _texts),
            hostname=draw(_texts),
        ),
        device=DeviceInfo(
            kind=draw(_names), index=draw(st.none() | st.integers(0, 1024)), uuid=draw(st.none() | _names)
        ),
        max_num_seqs=draw(st.integers(1, 1 << 20)),
        phase=draw(st.sampled_from(Phase)),
        collector=draw(st.sampled_from(COLLECTORS)),
        declarations=tuple(draw(declarations(owner, name)) for owner, name in keys),
        baseline=Baseline(draw(st.none() | _counts), draw(st.none() | _counts)),
        written_at=draw(st.floats(0, 4e9)),
        writer_version=draw(_names),
    )


@FUZZ
@given(manifests())
def test_every_valid_manifest_round_trips(manifest: Manifest) -> None:
    assert parse_manifest(manifest.to_json().encode(), "generated") == manifest


_forbidden = st.characters(whitelist_categories=("Cc", "Cs"))


@FUZZ
@given(
    manifests(), st.sampled_from(["engine.model_name", "process.hostname", "device.kind", "writer_version"]), _forbidden
)
def test_a_forbidden_character_in_any_string_is_refused_by_name(manifest: Manifest, field: str, bad: str) -> None:
    document = json.loads(manifest.to_json())
    *parents, last = field.split(".")
    target = document
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    target[last] = f"a{bad}b"
    with pytest.raises(ManifestError) as caught:  # json.dumps escapes a lone surrogate as \udXXX, as an attacker would
        parse_manifest(json.dumps(document).encode(), "generated")
    assert caught.value.reason == "invalid_string" and last in caught.value.detail


# -- the engine-page scanner ---------------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=4096))
@example(b"vllm:num_requests_running")
@example(b'vllm:num_requests_running{model_name="m"')
@example(b'vllm:num_requests_running{model_name="m\\"} 1')
def test_arbitrary_bytes_never_crash_the_scanner(data: bytes) -> None:
    check_engine_page(data)


@FUZZ
@given(st.lists(st.sampled_from(PAGE_SEEDS[-2:]) | st.binary(max_size=64), max_size=6).map(b"\n".join))
def test_spliced_pages_never_crash_the_scanner(data: bytes) -> None:
    check_engine_page(data)


@FUZZ
@given(st.sampled_from(PAGE_SEEDS), st.randoms(use_true_random=False), st.integers(1, 6))
def test_mutated_real_pages_never_crash_the_scanner(seed: bytes, rng: random.Random, rounds: int) -> None:
    data = mutated(seed, mutate_page, rng, rounds)
    check_engine_page(data)


def _escape(value: str) -> str:
    """The exposition format's label-value escaping."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


# What a manifest's model_name may hold (kv_exporter.document.check_text): only such names can match one.
_model_names = st.text(st.characters(codec="utf-8", blacklist_categories=("Cc", "Cs")), min_size=1, max_size=30).filter(
    str.strip
)


@st.composite
def pages(draw: st.DrawFn) -> tuple[bytes, dict[EngineKey, int], dict[str, int]]:
    """A page built from known counts, in vLLM's or vllm-omni's spelling, with noise lines the scanner must skip."""
    omni = draw(st.booleans())
    keys = draw(
        st.lists(
            st.builds(EngineKey, _model_names, st.integers(0, 9) if omni else st.just(0), st.integers(0, 99)),
            max_size=5,
            unique=True,
        )
    )
    running = {key: draw(st.integers(0, 100_000)) for key in keys}
    pipeline = {name: draw(st.integers(0, 100_000)) for name in {k.model_name for k in keys}} if omni else {}
    lines = [_running_line(draw, key, count, omni) for key, count in running.items()]
    lines += [f'vllm_omni:num_requests_running{{model_name="{_escape(m)}"}} {c}.0' for m, c in pipeline.items()]
    lines += draw(st.lists(st.sampled_from(_NOISE), max_size=4))
    order = draw(st.permutations(lines))
    return "\n".join(order).encode(), running, pipeline


def _running_line(draw: st.DrawFn, key: EngineKey, count: int, omni: bool) -> str:
    labels = {"model_name": key.model_name}
    if omni:
        labels |= {"replica": str(key.engine), "stage": str(key.stage)}
    else:
        labels["engine"] = str(key.engine)
    if draw(st.booleans()):
        labels["extra"] = draw(_model_names)
    items = draw(st.permutations(list(labels.items())))
    # Blanks and separators as Prometheus' parser allows them: spaces or tabs (never before the name), commas
    # optional, one trailing (tests/deploy/test_page_grammar.py asks a real Prometheus).
    sep, blank = (draw(st.sampled_from(choices)) for choices in ([",", ", ", "\t,", " "], [" ", "\t", " \t"]))
    text = sep.join(f'{name}{blank}="{_escape(value)}"' for name, value in items) + draw(st.sampled_from(["", ","]))
    value = draw(st.sampled_from([f"{count}.0", str(count), f"{count}e0", f"+{count}.", f"{count}E+0"]))
    stamp = draw(st.sampled_from(["", " 1700000000000", "\t0"]))
    return f"vllm:num_requests_running{blank}{{{text}}}{blank}{value}{stamp}{blank}"


_NOISE = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
    "# TYPE vllm:num_requests_running gauge",
    'vllm:num_requests_running_total{engine="0",model_name="noise"} 5.0',
    'vllm:num_requests_waiting{engine="0",model_name="noise"} 3.0',
    'vllm:kv_cache_usage_perc{engine="0",model_name="noise"} 0.5',
    "",
)


@FUZZ
@given(pages())
def test_a_well_formed_page_gives_back_exactly_its_counts(
    built: tuple[bytes, dict[EngineKey, int], dict[str, int]],
) -> None:
    data, running, pipeline = built
    try:
        page = scan_page(data)
    except EnginePageError as exc:
        assert not running and not pipeline and exc.reason == "no_running_series"
        return
    assert page.running == running
    assert page.pipeline_running == pipeline


# -- the HTTP answer reader ----------------------------------------------------------------------------------------

ANSWER_SEEDS = answer_seeds()


@FUZZ
@given(st.binary(max_size=2048))
@example(b"")
@example(b"HTTP/1.1 100 Continue\r\n\r\n" * 6)
@example(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * 3000)
def test_arbitrary_answers_never_crash_the_fetch(data: bytes) -> None:
    check_fetch(data)


@FUZZ
@given(st.sampled_from(ANSWER_SEEDS), st.randoms(use_true_random=False), st.integers(1, 4))
def test_mutated_answers_never_crash_the_fetch(seed: bytes, rng: random.Random, rounds: int) -> None:
    data = mutated(seed, mutate_answer, rng, rounds)
    check_fetch(data)


@st.composite
def answers(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """An answer Go's client reads, and its body: up to 5 interim answers, then the body with a Content-Length, in
    chunks (extensions, a trailer) or, on HTTP/1.0, ended by the close; header names in any case."""
    body = draw(st.binary(max_size=3000))
    interim = b"".join(
        b"HTTP/1.1 %d Info\r\n%s\r\n"
        % (draw(st.sampled_from([100, 102, 103])), draw(st.sampled_from([b"", b"L: x\r\n"])))
        for _ in range(draw(st.integers(0, 5)))
    )
    extra = draw(st.sampled_from([b"", b"Server: x\r\n", b"X-Folded: a\r\n b\r\n"]))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    name = draw(st.sampled_from(["Content-Length", "content-length", "CONTENT-LENGTH"]))
    if framing == "length":
        head = b"HTTP/1.1 200 OK\r\n%s%s: %d\r\n\r\n" % (extra, name.encode(), len(body))
        return interim + head + body, body
    if framing == "close":
        return interim + b"HTTP/1.0 200 OK\r\n" + extra + b"\r\n" + body, body
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
    ext = draw(st.sampled_from([b"", b";a=b", b" \t"]))
    chunks = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces)
    trailer = draw(st.sampled_from([b"", b"X-Trailer: 1\r\n"]))
    head = b"HTTP/1.1 200 OK\r\n%sTransfer-Encoding: chunked\r\n\r\n" % extra
    return interim + head + chunks + b"0\r\n" + trailer + b"\r\n", body


@FUZZ
@given(answers())
def test_a_well_formed_answer_gives_back_its_body(built: tuple[bytes, bytes]) -> None:
    data, body = built
    assert check_fetch(data) == body
