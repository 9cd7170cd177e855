"""Running counts from a vLLM / vllm-omni metrics page: a fetch with hard limits (`fetch`), and a narrow scanner.

Only two metric names matter, so the scanner looks only at lines starting with them and never parses the other
~600 lines of a real page (prometheus_client's generic parser costs ~50-70 us a line on these cores):

- vLLM:      ``vllm:num_requests_running{engine="0",model_name="M"}``            (no stage: stage 0)
- vllm-omni: ``vllm:num_requests_running{model_name="M",replica="0",stage="1"}`` (per stage, may lag high)
             ``vllm_omni:num_requests_running{model_name="M"}``                 (whole pipeline)

Those lines are read as Prometheus' own text parser reads them (model/textparse, promlex.l and promparse.go):
blanks are spaces and tabs, a line ends at LF only (a CR is part of the value), label values take the escapes
`\\`, `\"` and `\n` (any other is kept as written) and must be UTF-8; a value is what Go's strconv.ParseFloat
takes without `p`, `P` or `_` (so `1_000`, `0x10`, `1e400` and `+nan` are not numbers); a timestamp is decimal
digits that fit an int64. An empty label value is no label, as in Prometheus. What Prometheus would refuse is
`malformed`; what it takes but cannot be a running count (NaN, infinities, negatives) is `bad_value`; a model name no
manifest could hold (a control character, over 256 characters) is `bad_label`.

Anything wrong with the page becomes an `EnginePageError` with a short reason (a metric label), never another
exception.
"""

from __future__ import annotations

import base64
import math
import re
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from kv_exporter.document import MAX_SAFE_INT, DocumentError, check_text
from kv_exporter.printable import DETAIL_MAX_CHARS, printable
from kv_exporter.transport.fetch import FETCH_ERROR_REASONS, TIMEOUT, Client, FetchError


@dataclass(frozen=True)
class PageSeries:
    """A series the scanner reads from an engine's page: its name, and what it gives."""

    name: bytes
    gives: str


# The engine page's series, in one table: the scanner's search and its line grammar are made from it. (The
# simulated engine spells vLLM's name on its own: it stands for vLLM, and a typo here must not pass against it.)
STAGE_SERIES = PageSeries(b"vllm:num_requests_running", "the running count per engine (vLLM) or stage replica")
PIPELINE_SERIES = PageSeries(b"vllm_omni:num_requests_running", "vllm-omni's pipeline-wide count: the idle signal")
PAGE_SERIES = (STAGE_SERIES, PIPELINE_SERIES)

DEFAULT_TIMEOUT_S = 3.0  # well below Prometheus' default 10 s scrape timeout
DEFAULT_MAX_PAGE_BYTES = 4 << 20  # a real vLLM 0.32 page is ~57 KB; vllm-omni's ~80 KB

# Why a page could not be used: metric label values, exported at 0 per target before the first one.
SCAN_ERROR_REASONS = ("no_running_series", "malformed", "bad_value", "missing_label", "bad_label", "duplicate_series")
INTERNAL_ERROR = "internal_error"  # a bug in the reader, reported like a bad page
# A running count above the engine's own max_num_seqs (its manifests'): impossible, so not used for that engine.
ABOVE_MAX_NUM_SEQS = "running_above_max_num_seqs"
PAGE_ERROR_REASONS = (*FETCH_ERROR_REASONS, *SCAN_ERROR_REASONS, INTERNAL_ERROR, ABOVE_MAX_NUM_SEQS)


class EnginePageError(Exception):
    """The page could not be used. `reason` is a short stable code; `detail` (printable, short) says why."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = printable(detail, DETAIL_MAX_CHARS)
        super().__init__(f"{reason}: {self.detail}")


@dataclass(frozen=True, order=True, slots=True)
class EngineKey:
    """One engine as metric labels name it: vLLM's `engine` label is vllm-omni's `replica`."""

    model_name: str
    stage: int
    engine: int


@dataclass(frozen=True)
class EnginePage:
    """What one page says: running per engine, and the pipeline-wide running per model (vllm-omni only)."""

    running: dict[EngineKey, int]
    pipeline_running: dict[str, int]

    def running_for(self, key: EngineKey) -> int | None:
        """The engine's running count; a vllm-omni stage reads 0 while its pipeline is idle.

        vllm-omni 0.30 refreshes the per-stage gauge at most once a second and only while there is work, so after
        load it keeps its last value indefinitely; a stale-high count would understate the projected peak. Its
        pipeline gauge reads low under load but returns to 0 as soon as the last request ends, so it is used as
        the idle signal, not as a count. It is labelled with the model path even under --served-model-name: a
        page with exactly one pipeline series (one vllm-omni server serves one pipeline) gates every stage on it.
        """
        value = self.running.get(key)
        if value is None:
            return None
        pipeline = self.pipeline_running.get(key.model_name)
        if pipeline is None and len(self.pipeline_running) == 1:
            (pipeline,) = self.pipeline_running.values()
        return 0 if pipeline == 0 else value

    def above(self, limits: dict[EngineKey, int]) -> tuple[EngineKey, ...]:
        """The engines whose running count passes their limit (their max_num_seqs): no engine runs more."""
        return tuple(key for key in self.running if key in limits and (self.running_for(key) or 0) > limits[key])

    def without(self, keys: tuple[EngineKey, ...]) -> EnginePage:
        return EnginePage({k: v for k, v in self.running.items() if k not in keys}, self.pipeline_running)


# Series read between looks at the clock: ~20 ms of scanning (~80 us a series here).
_SERIES_PER_CLOCK_CHECK = 256


def scan_page(data: bytes, deadline: float | None = None) -> EnginePage:
    """Read the running-count series out of a Prometheus text-format page; `timeout` past `deadline` (monotonic):
    a page under --engine-max-bytes can hold ~50,000 series, seconds of scanning that the engine deadline bounds."""
    running: dict[EngineKey, int] = {}
    pipeline: dict[str, int] = {}
    for count, start in enumerate(_series_starts(data), 1):
        if deadline is not None and count % _SERIES_PER_CLOCK_CHECK == 0 and time.monotonic() > deadline:
            raise EnginePageError(TIMEOUT, f"reading the page's series passed the deadline after {count} series")
        match = _SERIES.match(data, start)
        if match is None:
            raise EnginePageError("malformed", _show(data, start))
        name, label_text, value_text, stamp = match.groups()
        line = match.group()
        labels = _labels(label_text or b"", line)
        value = _count(value_text, stamp, line)
        if name == PIPELINE_SERIES.name:
            _put(pipeline, _model_name(labels), value, line)
        else:
            _put(running, _engine_key(labels), value, line)
    if not running and not pipeline:
        raise EnginePageError("no_running_series", f"no {STAGE_SERIES.name.decode()} series on the page")
    return EnginePage(running, pipeline)


# One series line of either metric, from the start of its line (a blank before the name makes it part of the name
# for Prometheus: an invalid one). A quoted label value may hold a raw newline, as Prometheus lets it. The labels
# repeat without ambiguity (whitespace after a value belongs to that value's pair): a failing match is linear.
_SERIES = re.compile(
    rb"("
    + b"|".join(re.escape(series.name) for series in PAGE_SERIES)
    + rb""")[ \t]*
    (?:\{[ \t]*((?:[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"(?:\\[^\n]|[^\\"])*"[ \t]*(?:,[ \t]*)?)*)\})?
    [ \t]*([^{ \t\n]+)(?:[ \t]+([0-9]+))?[ \t]*(?:\n|\Z)""",
    re.VERBOSE,
)
_LABEL = re.compile(rb'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:\\[^\n]|[^\\"])*)"')
_ESCAPE = re.compile(rb'\\(["\\n])')
_UNESCAPED = {b'"': b'"', b"\\": b"\\", b"n": b"\n"}
# What Go's strconv.ParseFloat reads, less the hexadecimal forms (which need `p`) and the `_` Prometheus refuses.
_GO_FLOAT = re.compile(rb"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf(?:inity)?))|(?i:nan)")
_NAME_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_:")
MAX_TIMESTAMP = (1 << 63) - 1


def _series_starts(data: bytes) -> Iterator[int]:
    """Where the lines of the two metrics start, in page order. Found with `bytes.find` (C speed) rather than by
    splitting the page: a real page has ~600 lines and 1-4 of interest (docs/benchmarks.md, target 2). A longer name
    (`..._total`) is another metric; a hit after anything but blanks at the start of a line (a comment, a label
    value) is not a series line; one after blanks is, and malformed."""
    starts = []
    for prefix in (series.name for series in PAGE_SERIES):
        at = data.find(prefix)
        while at != -1:
            end = at + len(prefix)
            if end == len(data) or data[end] not in _NAME_CHARS:
                start = at
                while start and data[start - 1] in b" \t":
                    start -= 1
                if start == 0 or data[start - 1] == ord("\n"):
                    starts.append(start)
            at = data.find(prefix, end)
    return iter(sorted(starts))


def _put(target: dict[EngineKey, int] | dict[str, int], key: object, value: int, line: bytes) -> None:
    if key in target:
        raise EnginePageError("duplicate_series", _show(line))
    target[key] = value  # type: ignore[index]


def _show(data: bytes, start: int = 0) -> str:
    end = data.find(b"\n", start, start + 200)
    return data[start : start + 200 if end == -1 else end].decode("utf-8", "backslashreplace")


def _labels(text: bytes, line: bytes) -> dict[str, str]:
    labels: dict[str, str] = {}
    for match in _LABEL.finditer(text):
        name, raw = match.group(1).decode(), match.group(2)
        try:
            value = _ESCAPE.sub(lambda m: _UNESCAPED[m.group(1)], raw).decode("utf-8")
        except UnicodeDecodeError:
            raise EnginePageError("malformed", f"label value not UTF-8: {_show(line)}") from None
        if name in labels:
            raise EnginePageError("malformed", f"label {name} twice: {_show(line)}")
        labels[name] = value
    return labels


def _count(value_text: bytes, stamp: bytes | None, line: bytes) -> int:
    if not _GO_FLOAT.fullmatch(value_text) or (stamp is not None and (len(stamp) > 19 or int(stamp) > MAX_TIMESTAMP)):
        raise EnginePageError("malformed", _show(line))
    value = float(value_text)
    if math.isinf(value) and value_text.lstrip(b"+-")[:1] not in (b"i", b"I"):  # 1e400: Go's range error
        raise EnginePageError("malformed", f"out of float64 range: {_show(line)}")
    if not math.isfinite(value) or value < 0:
        raise EnginePageError("bad_value", _show(line))
    return int(value)  # gauges of whole requests; a fraction would be a bug upstream, truncated


def _model_name(labels: dict[str, str]) -> str:
    value = labels.get("model_name", "")
    if not value:
        raise EnginePageError("missing_label", "series without model_name")
    try:
        return check_text(value, "model_name", not_blank=True)
    except DocumentError as exc:  # it could name no manifest's engine
        raise EnginePageError("bad_label", f"{exc.reason}: {exc.detail}") from None


def _index(labels: dict[str, str], *names: str) -> int:
    """The first of `names` with a value (none: 0), a decimal index a manifest could hold."""
    value = next((labels[name] for name in names if labels.get(name)), "0")
    if not (value.isascii() and value.isdigit() and len(value) <= 16 and int(value) <= MAX_SAFE_INT):
        raise EnginePageError("bad_label", f"{names[0]}={value[:40]!r} is not an index")
    return int(value)


def _engine_key(labels: dict[str, str]) -> EngineKey:
    """vLLM names the data-parallel engine `engine`; vllm-omni names it `replica` and adds `stage`."""
    return EngineKey(_model_name(labels), _index(labels, "stage"), _index(labels, "engine", "replica"))


# -- fetching ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineTarget:
    """A configured engine metrics URL: `url` is what is fetched (a query string an engine needs stays in it),
    `target` the label and what logs show: scheme, host, port and path only, so neither credentials in the userinfo
    nor a `?token=` end up in Prometheus."""

    url: str
    target: str
    authorization: str | None

    @classmethod
    def parse(cls, url: str) -> EngineTarget:
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL must be http(s)://host[:port][/path], got {url!r}")
        netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        if parts.port is not None:
            netloc = f"{netloc}:{parts.port}"
        path = parts.path or "/metrics"  # a bare engine address means its /metrics page
        fetched = urllib.parse.urlunsplit((parts.scheme, netloc, path, parts.query, ""))  # no fragment: never sent
        shown = urllib.parse.urlunsplit((parts.scheme, netloc, path, "", ""))
        auth = None
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        return cls(url=fetched, target=shown, authorization=auth)


async def fetch_page(client: Client, target: EngineTarget, max_bytes: int = DEFAULT_MAX_PAGE_BYTES) -> bytes:
    """GET the page on `client` (the caller's deadline bounds every step of the exchange)."""
    headers = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"}
    if target.authorization:
        headers["Authorization"] = target.authorization
    try:
        return await client.get(target.url, headers, max_bytes)
    except FetchError as exc:
        failure = exc.reason, exc.detail
    # Raised outside the handler: the FetchError (its frames hold what was read) is freed here, not kept as context.
    raise EnginePageError(*failure)
