"""Running counts from a vLLM / vllm-omni metrics page: a fetch with hard limits, and a narrow line scanner.

Only two metric names matter, so the scanner looks only at lines starting with them and never parses the other
~600 lines of a real page (prometheus_client's generic parser costs ~50-70 us a line on these cores):

- vLLM:      ``vllm:num_requests_running{engine="0",model_name="M"}``            (no stage: stage 0)
- vllm-omni: ``vllm:num_requests_running{model_name="M",replica="0",stage="1"}`` (per stage, may lag high)
             ``vllm_omni:num_requests_running{model_name="M"}``                 (whole pipeline)

Anything wrong with the page becomes an `EnginePageError` with a short reason (a metric label), never another
exception.
"""

from __future__ import annotations

import base64
import http.client
import math
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

STAGE_METRIC = b"vllm:num_requests_running"
PIPELINE_METRIC = b"vllm_omni:num_requests_running"
_PREFIXES = (STAGE_METRIC, PIPELINE_METRIC)

DEFAULT_TIMEOUT_S = 3.0  # well below Prometheus' default 10 s scrape timeout
DEFAULT_MAX_PAGE_BYTES = 4 << 20  # a real vLLM 0.32 page is ~57 KB; vllm-omni's ~80 KB
_CHUNK = 64 << 10


class EnginePageError(Exception):
    """The page could not be used. `reason` is a short stable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, order=True)
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


def scan_page(data: bytes) -> EnginePage:
    """Read the running-count series out of a Prometheus text (or OpenMetrics) page."""
    running: dict[EngineKey, int] = {}
    pipeline: dict[str, int] = {}
    for line in _candidate_lines(data):
        name, rest = _split_name(line)
        if name not in _PREFIXES:
            continue  # a sibling whose name merely starts the same way, e.g. `..._total`
        labels, value = _parse_series(rest, line)
        if name == PIPELINE_METRIC:
            _put(pipeline, _label(labels, "model_name"), value, line)
        else:
            _put(running, _engine_key(labels), value, line)
    if not running and not pipeline:
        raise EnginePageError("no_running_series", "no vllm:num_requests_running series on the page")
    return EnginePage(running, pipeline)


def _candidate_lines(data: bytes) -> Iterator[bytes]:
    """The lines starting with either name, in page order. Found with `bytes.find` (C speed) rather than by
    splitting the page: a real page has ~600 lines and 1-4 of interest (docs/benchmarks.md, target 2)."""
    starts = [0] if data.startswith(_PREFIXES) else []
    for prefix in _PREFIXES:
        needle = b"\n" + prefix
        at = data.find(needle)
        while at != -1:
            starts.append(at + 1)
            at = data.find(needle, at + 1)
    for start in sorted(starts):
        end = data.find(b"\n", start)
        yield (data[start:] if end == -1 else data[start:end]).rstrip(b"\r")


def _split_name(line: bytes) -> tuple[bytes, bytes]:
    for i, byte in enumerate(line):
        if byte in b"{ \t":
            return line[:i], line[i:]
    return line, b""


def _put(target: dict[EngineKey, int] | dict[str, int], key: object, value: int, line: bytes) -> None:
    if key in target:
        raise EnginePageError("duplicate_series", _show(line))
    target[key] = value  # type: ignore[index]


def _show(line: bytes) -> str:
    return line[:200].decode("utf-8", "replace")


def _parse_series(rest: bytes, line: bytes) -> tuple[dict[str, str], int]:
    """`{labels} value [timestamp]` (the part after the name) -> (labels, running count)."""
    labels: dict[str, str] = {}
    if rest.startswith(b"{"):
        labels, rest = _parse_labels(rest[1:], line)
    return labels, _count(rest, line)


def _parse_labels(rest: bytes, line: bytes) -> tuple[dict[str, str], bytes]:
    """Parse `a="x",b="y"}` (exposition-format escapes) and return the labels and what follows the brace."""
    try:
        text = rest.decode("utf-8")
    except UnicodeDecodeError:
        raise EnginePageError("malformed", _show(line)) from None
    labels: dict[str, str] = {}
    i = 0
    while True:
        while i < len(text) and text[i] in " ,":
            i += 1
        if i < len(text) and text[i] == "}":
            return labels, text[i + 1 :].encode()
        eq = text.find("=", i)
        if eq == -1 or eq + 1 >= len(text) or text[eq + 1] != '"':
            raise EnginePageError("malformed", _show(line))
        key = text[i:eq].strip()
        value, i = _quoted(text, eq + 2, line)
        if not key or key in labels:
            raise EnginePageError("malformed", _show(line))
        labels[key] = value


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _quoted(text: str, start: int, line: bytes) -> tuple[str, int]:
    out: list[str] = []
    i = start
    while i < len(text):
        char = text[i]
        if char == '"':
            return "".join(out), i + 1
        if char == "\\" and i + 1 < len(text):
            out.append(_ESCAPES.get(text[i + 1], "\\" + text[i + 1]))
            i += 2
            continue
        out.append(char)
        i += 1
    raise EnginePageError("malformed", _show(line))


def _count(rest: bytes, line: bytes) -> int:
    parts = rest.split()
    if not 1 <= len(parts) <= 2:
        raise EnginePageError("malformed", _show(line))
    try:
        value = float(parts[0])
    except ValueError:
        raise EnginePageError("malformed", _show(line)) from None
    if not math.isfinite(value) or value < 0:
        raise EnginePageError("bad_value", _show(line))
    return int(value)  # gauges of whole requests; a fraction would be a bug upstream, truncated


def _label(labels: dict[str, str], name: str) -> str:
    value = labels.get(name)
    if value is None:
        raise EnginePageError("missing_label", f"series without {name}")
    return value


def _engine_key(labels: dict[str, str]) -> EngineKey:
    """vLLM names the data-parallel engine `engine`; vllm-omni names it `replica` and adds `stage`."""
    index = labels.get("engine", labels.get("replica", "0"))
    stage = labels.get("stage", "0")
    if not (index.isdigit() and stage.isdigit()):
        raise EnginePageError("bad_label", f"engine={index!r} stage={stage!r} are not indices")
    return EngineKey(_label(labels, "model_name"), int(stage), int(index))


# -- fetching ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineTarget:
    """A configured engine metrics URL. `target` is the URL without credentials (safe as a label)."""

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
        clean = urllib.parse.urlunsplit((parts.scheme, netloc, path, parts.query, ""))
        auth = None
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        return cls(url=clean, target=clean, authorization=auth)


def fetch_page(
    target: EngineTarget,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_bytes: int = DEFAULT_MAX_PAGE_BYTES,
) -> bytes:
    """GET the page within `timeout_s` in total (not per read: a trickling server is cut off too)."""
    deadline = time.monotonic() + timeout_s
    parts = urllib.parse.urlsplit(target.url)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.netloc, timeout=timeout_s)
    else:
        conn = http.client.HTTPConnection(parts.netloc, timeout=timeout_s)
    try:
        return _get(conn, target, parts, deadline, max_bytes)
    except EnginePageError:
        raise
    except TimeoutError:
        raise EnginePageError("timeout", f"no complete answer within {timeout_s:g} s") from None
    except http.client.IncompleteRead as exc:  # a chunked body cut short
        raise EnginePageError("truncated", f"connection closed mid-page ({exc!r})"[:200]) from None
    except (OSError, http.client.HTTPException) as exc:
        raise EnginePageError("unreachable", f"{type(exc).__name__}: {exc}"[:200]) from None
    finally:
        conn.close()


def _get(
    conn: http.client.HTTPConnection,
    target: EngineTarget,
    parts: urllib.parse.SplitResult,
    deadline: float,
    max_bytes: int,
) -> bytes:
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    headers = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"}
    if target.authorization:
        headers["Authorization"] = target.authorization
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    if response.status != 200:
        raise EnginePageError("http_status", f"HTTP {response.status} {response.reason}")
    declared = response.getheader("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise EnginePageError("too_large", f"Content-Length {declared} > limit {max_bytes}")
    return _read_body(conn, response, deadline, max_bytes)


def _read_body(
    conn: http.client.HTTPConnection, response: http.client.HTTPResponse, deadline: float, max_bytes: int
) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EnginePageError("timeout", "page not complete before the deadline")
        if conn.sock is not None:
            conn.sock.settimeout(remaining)
        chunk = response.read1(_CHUNK)
        if not chunk:
            if response.length:  # http.client ends a body shorter than its Content-Length without a word
                raise EnginePageError("truncated", f"connection closed {response.length} bytes before the end")
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise EnginePageError("too_large", f"more than {max_bytes} bytes")
        chunks.append(chunk)


def read_engine(
    target: EngineTarget, timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_PAGE_BYTES
) -> EnginePage:
    """Fetch and scan one engine page; raises only EnginePageError."""
    data = fetch_page(target, timeout_s, max_bytes)
    return scan_page(data)
