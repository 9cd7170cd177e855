"""Inputs shared by the hypothesis properties and the atheris targets: seeds from the real writers and recorded
pages, structure-aware mutations driven by a `random.Random` (so both tools can steer them), and the invariants
every rejection must keep."""

from __future__ import annotations

import copy
import json
import random
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

from kv_exporter.manifest import READER_ERROR_REASONS, ManifestError, parse_manifest
from kv_exporter.reference import REFERENCE_MODELS
from kv_exporter.sidecar.engine_page import SCAN_ERROR_REASONS, EnginePageError, scan_page
from kv_exporter.transport.fetch import FETCH_ERROR_REASONS, FetchError, get
from tests.support.manifests import reference_manifest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ENGINE_PAGE_FIXTURES = tuple(sorted(FIXTURES.glob("*-metrics.txt")))

# A rejection reason is a metric label value (`model_local_kv_manifest_errors_total{reason}`): it must stay a
# short code from the fixed vocabulary the counters are exported at 0 for, never free text (unbounded cardinality).
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
        if not REASON.fullmatch(exc.reason) or exc.reason not in READER_ERROR_REASONS or exc.path != "fuzz-input":
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
        if not REASON.fullmatch(exc.reason) or exc.reason not in SCAN_ERROR_REASONS:
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


# -- HTTP answers (the fetch) ------------------------------------------------------------------------------------

FETCH_TIMEOUT_S = 2.0  # every answer arrives whole at once and the connection closes: far more than enough
FETCH_MAX_BODY = 1 << 16
_PAGE = b'vllm:num_requests_running{engine="0",model_name="m"} 3\n'


def answer_seeds() -> list[bytes]:
    """Answers Go's client and `fetch.get` read: with Content-Length, chunked (extension, trailer), after interim
    1xx answers, close-delimited HTTP/1.0; and a few it refuses."""
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"%x;e=1\r\n%s\r\n0\r\nX-T: 1\r\n\r\n" % (
        len(_PAGE),
        _PAGE,
    )
    sized = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(_PAGE), _PAGE)
    return [
        sized,
        chunked,
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + sized,
        b"HTTP/1.0 200 OK\r\n\r\n" + _PAGE,
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n",
        sized.replace(b"Content-Length", b"Content-Length: 1\r\nContent-Length"),
    ]


_ANSWER_TOKENS = (
    b"\r\n",
    b"\n",
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip, chunked\r\n",
    b"Content-Length: 5\r\n",
    b"Content-Length: -1\r\n",
    b"Content-Length: 99999999999999999999\r\n",
    b" continued\r\n",
    b"0\r\n\r\n",
    b"ffffffffffffffffff\r\n",
    b";ext",
    b"HTTP/9.9 200 OK\r\n",
    b"HTTP/1.1 2000 OK\r\n",
)


def mutate_answer(data: bytes, rng: random.Random) -> bytes:
    """Line-aware edits of an HTTP answer: drop, duplicate or rewrite head and framing lines, splice tokens."""
    if rng.random() < 0.3:
        return mutate_bytes(data, rng)
    lines = data.split(b"\r\n")
    i = rng.randrange(len(lines))
    action = rng.randrange(3)
    if action == 0:
        lines.insert(i, lines[rng.randrange(len(lines))])
    elif action == 1:
        del lines[i]
    else:
        cut = rng.randint(0, len(lines[i]))
        lines[i] = lines[i][:cut] + rng.choice(_ANSWER_TOKENS) + lines[i][cut + rng.randint(0, 4) :]
    return b"\r\n".join(lines)


class _AnswerServer:
    """A loopback listener that answers every connection with `answer`, then closes it."""

    def __init__(self) -> None:
        self.answer = b""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/metrics"
        threading.Thread(target=self._serve, name="answer-server", daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self._listener.accept()
            with conn:
                try:
                    conn.recv(65536)  # the request (small: one read holds it)
                    conn.sendall(self.answer)
                except OSError:
                    pass  # the client gave up first (a cap reached): as a server may see it


_server: _AnswerServer | None = None


def check_fetch(data: bytes) -> bytes | None:
    """Fetch `data` as an engine's whole answer: a refusal must be a FetchError with one of its listed reasons; an
    acceptance a body within the cap; either within the timeout. Returns the body, or None if refused."""
    global _server
    if _server is None:
        _server = _AnswerServer()
    _server.answer = data
    started = time.monotonic()
    try:
        body = get(_server.url, {}, FETCH_TIMEOUT_S, FETCH_MAX_BODY)
    except FetchError as exc:
        if exc.reason not in FETCH_ERROR_REASONS or exc.reason == "timeout":
            raise AssertionError(f"bad refusal {exc.reason!r} of a whole answer: {exc}") from exc
        return None
    finally:
        if time.monotonic() - started > FETCH_TIMEOUT_S + 1:
            raise AssertionError("the fetch overran its deadline")
    if len(body) > FETCH_MAX_BODY:
        raise AssertionError(f"a body of {len(body)} bytes passed the cap {FETCH_MAX_BODY}")
    return body
