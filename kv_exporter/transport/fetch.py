"""GET pages over HTTP/1.1 on an asyncio event loop with hard limits: one wall-clock deadline for the whole exchange,
a size cap, and the rules Go's net/http client applies to a response (Prometheus scrapes with it: what it refuses is
refused here). Several GETs run concurrently in one thread, and a connection the server leaves open is kept for the
next GET to the same origin (`Client`).

The deadline (the caller's, around the GET) covers name resolution, connecting, the TLS handshake, the request, the
status line, the headers, interim 1xx answers, chunk framing and the body, so a server that trickles any part costs
at most the timeout, and the reason is then always `timeout`. (http.client, used before, gave each socket read the whole
timeout: a server sending a header line or a `100 Continue` now and then held a scrape for as long as it liked.)

Go's rules followed (net/http's transport, transfer and internal/chunked): at most 5 interim 1xx answers (101 is
final); Content-Length digits only, repeated only with the same value; Transfer-Encoding only `chunked`, and only on
HTTP/1.1, where it overrides Content-Length; chunk-size lines end in CRLF, hold hex digits (an extension after `;`
is ignored), at most 4096 bytes; each chunk's data ends in CRLF; framing may not outweigh the data by more than
16 KiB; trailers are header lines. A head (status line and headers) of more than 64 KiB is refused: Go allows
10 MiB, a metrics server sends well under 1 KiB.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import urllib.parse
from collections.abc import Mapping

from kv_exporter import __version__

# Why a fetch failed: metric label values (`model_local_kv_engine_page_errors_total{reason}`).
UNREACHABLE, TIMEOUT, BAD_RESPONSE, HTTP_STATUS, TRUNCATED, TOO_LARGE = (
    "unreachable",  # no connection, or it was refused, reset or closed before any answer
    "timeout",  # the deadline passed, at whatever step
    "bad_response",  # not an HTTP/1.x answer Go's client would take (status line, headers, framing)
    "http_status",  # an answer other than 200
    "truncated",  # the connection closed before the end of the answer
    "too_large",  # the body, or one answer's head, over its cap
)
FETCH_ERROR_REASONS = (UNREACHABLE, TIMEOUT, BAD_RESPONSE, HTTP_STATUS, TRUNCATED, TOO_LARGE)

MAX_HEAD_BYTES = 64 << 10
MAX_INTERIM_ANSWERS = 5  # Go's max1xxResponses
MAX_CHUNK_LINE = 4096  # Go's maxLineLength for chunk-size lines
MAX_FRAMING_EXCESS = 16 << 10  # Go's allowance of framing bytes beyond 16 + 2 per data byte
_RECV = 64 << 10
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_HEX = frozenset(b"0123456789abcdefABCDEF")


class FetchError(Exception):
    """The page could not be fetched. `reason` is one of FETCH_ERROR_REASONS; `detail` is raw (EnginePageError, which
    carries it to pages and logs, makes it printable and short)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def get(url: str, headers: Mapping[str, str], timeout_s: float, max_body: int) -> bytes:
    """The body of a 200 answer to `GET url` (http or https), all of it within `timeout_s`, on a connection of its
    own; raises FetchError."""

    async def once() -> bytes:
        client = Client()
        try:
            return await asyncio.wait_for(client.get(url, headers, max_body), timeout_s)
        except asyncio.TimeoutError:
            raise timed_out(timeout_s) from None
        finally:
            client.close()

    return asyncio.run(once())


def timed_out(timeout_s: float) -> FetchError:
    """What a GET that ran past its deadline (the caller's, around it: `asyncio.wait_for`, ...) failed with."""
    return FetchError(TIMEOUT, f"no complete answer within {timeout_s:g} s")


class Client:
    """GETs on the running event loop, keeping one idle connection per origin for the next GET to it, as Go's
    transport does: a connection is kept when the answer was HTTP/1.1, not `Connection: close`, its body framed
    (Content-Length or chunked) and read to its end with nothing after it. A kept connection the server has closed
    meanwhile (servers close idle ones: uvicorn, vLLM's, after 5 s) fails before any byte of answer; the GET is then
    sent again once on a new connection, within the same deadline (Go retries an idempotent request so).
    One client per event loop; its GETs may run concurrently."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], _Connection] = {}

    async def get(self, url: str, headers: Mapping[str, str], max_body: int) -> bytes:
        """The body of a 200 answer to `GET url`; raises FetchError. The caller's deadline (cancelling it, then
        `timed_out`) bounds every step, name resolution included."""
        parts = urllib.parse.urlsplit(url)
        origin = (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = [f"GET {path} HTTP/1.1", f"Host: {parts.netloc}", f"User-Agent: kv-exporter/{__version__}"]
        request += [f"{name}: {value}" for name, value in headers.items()]
        message = ("\r\n".join([*request, "", ""])).encode("latin-1")
        kept = self._idle.pop(origin, None)
        if kept is not None:
            try:
                return await self._exchange(kept, origin, message, max_body)
            except FetchError as exc:
                if kept.received or exc.reason not in (UNREACHABLE, TRUNCATED):
                    raise  # the server answered something: its answer stands
        conn = await _Connection.open(origin)
        return await self._exchange(conn, origin, message, max_body)

    async def _exchange(self, conn: _Connection, origin: tuple[str, str, int], message: bytes, max_body: int) -> bytes:
        keep = False
        conn.received = 0  # of this answer
        try:
            conn.writer.write(message)
            await conn.writer.drain()
            version, fields = await _final_head(conn)
            body = await _body(conn, version, fields, max_body)
            keep = _reusable(conn, version, fields)
            return body
        except ConnectionError as exc:
            raise conn.closed(f"{type(exc).__name__}: {exc}") from None
        except OSError as exc:
            raise FetchError(UNREACHABLE, f"{type(exc).__name__}: {exc}") from None
        finally:
            if keep:
                self._idle[origin] = conn
            else:
                conn.close()

    def close(self) -> None:
        """Close the kept connections."""
        for conn in self._idle.values():
            conn.close()
        self._idle.clear()


def _reusable(conn: _Connection, version: bytes, fields: Fields) -> bool:
    framed = b"content-length" in fields or b"transfer-encoding" in fields
    closing = any(b"close" in value.lower() for value in fields.get(b"connection", []))
    return version == b"1.1" and framed and not closing and not conn.buffer and not conn.reader.at_eof()


class _Connection:
    """A stream with a read buffer; the deadline around the exchange bounds every wait."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buffer = bytearray()
        self.received = 0  # bytes of the answer so far: none means the server never answered

    @classmethod
    async def open(cls, origin: tuple[str, str, int]) -> _Connection:
        scheme, host, port = origin
        try:
            context = ssl.create_default_context() if scheme == "https" else None
            reader, writer = await asyncio.open_connection(host, port, ssl=context)
        except OSError as exc:  # refused, no route, no address, a failed TLS handshake
            raise FetchError(UNREACHABLE, f"{type(exc).__name__}: {exc}") from None
        writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def fill(self) -> bool:
        """Read more into the buffer; False at the end of the stream."""
        chunk = await self.reader.read(_RECV)
        self.received += len(chunk)
        self.buffer += chunk
        return bool(chunk)

    async def line(self, limit: int, reason: str, what: str) -> bytes:
        """The next line without its LF (a CR before it kept), at most `limit` bytes; `reason` when longer."""
        scanned = 0
        while (end := self.buffer.find(b"\n", scanned)) == -1:
            scanned = len(self.buffer)
            if scanned > limit:
                raise FetchError(reason, f"{what} longer than {limit} bytes")
            if not await self.fill():
                raise self.closed(f"connection closed in the {what}")
        if end > limit:
            raise FetchError(reason, f"{what} longer than {limit} bytes")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        return line

    async def read(self, most: int) -> bytes:
        """Up to `most` bytes (at least one), b"" at the end of the stream."""
        if not self.buffer and not await self.fill():
            return b""
        data = bytes(self.buffer[:most])
        del self.buffer[:most]
        return data

    async def exactly(self, size: int, what: str) -> bytes:
        while len(self.buffer) < size:
            if not await self.fill():
                raise self.closed(f"connection closed in the {what}")
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def closed(self, detail: str) -> FetchError:
        """The connection ended early: before any answer the server is as good as unreachable."""
        return FetchError(TRUNCATED if self.received else UNREACHABLE, detail)

    def close(self) -> None:
        self.writer.close()


Fields = dict[bytes, list[bytes]]  # lower-case header name -> its values, in order


async def _final_head(conn: _Connection) -> tuple[bytes, Fields]:
    """The status line and headers of the final answer, past the interim ones; raises for anything but 200."""
    for _ in range(MAX_INTERIM_ANSWERS + 1):
        line = await conn.line(MAX_HEAD_BYTES, TOO_LARGE, "status line")
        version, status, phrase = _status_line(line)
        fields = await _fields(conn, MAX_HEAD_BYTES - len(line))
        if 100 <= status <= 199 and status != 101:
            continue  # an interim answer (100 Continue, 103 Early Hints): no body, the real one follows
        if status != 200:
            raise FetchError(HTTP_STATUS, f"HTTP {status} {phrase.decode('latin-1')}")
        return version, fields
    raise FetchError(BAD_RESPONSE, f"more than {MAX_INTERIM_ANSWERS} interim 1xx answers")


def _status_line(line: bytes) -> tuple[bytes, int, bytes]:
    """`HTTP/1.1 200 OK` -> (b"1.1", 200, b"OK"), as Go's ReadResponse splits it."""
    version, _, rest = line.rstrip(b"\r").partition(b" ")
    code, _, phrase = rest.lstrip(b" ").partition(b" ")
    number = version[5:]
    if not (version.startswith(b"HTTP/") and len(number) == 3 and number[1:2] == b"." and number[::2].isdigit()):
        raise FetchError(BAD_RESPONSE, f"malformed status line {line[:80]!r}")
    if not (len(code) == 3 and code.isdigit()):
        raise FetchError(BAD_RESPONSE, f"malformed status code in {line[:80]!r}")
    return number, int(code), phrase


async def _fields(conn: _Connection, limit: int) -> Fields:
    """Header lines up to the empty line (continuation lines joined), `limit` bytes in all."""
    fields: Fields = {}
    last: list[bytes] | None = None
    size = 0
    while line := (await conn.line(limit - size, TOO_LARGE, "header section")).rstrip(b"\r"):
        size += len(line) + 2
        if line[:1] in (b" ", b"\t"):
            if last is None:
                raise FetchError(BAD_RESPONSE, "header section starts with a continuation line")
            last[-1] += b" " + line.strip(b" \t")
            continue
        name, colon, value = line.partition(b":")
        if not colon or not name or not set(name) <= _TOKEN:
            raise FetchError(BAD_RESPONSE, f"malformed header line {line[:80]!r}")
        last = fields.setdefault(name.lower(), [])
        last.append(value.strip(b" \t"))
    return fields


async def _body(conn: _Connection, version: bytes, fields: Fields, max_body: int) -> bytes:
    length = _content_length(fields.get(b"content-length", []))
    codings = fields.get(b"transfer-encoding", [])
    if codings and version >= b"1.1":  # Go ignores Transfer-Encoding before HTTP/1.1
        if len(codings) != 1 or codings[0].lower() != b"chunked":
            raise FetchError(BAD_RESPONSE, f"unsupported transfer encoding {b', '.join(codings)[:80]!r}")
        return await _chunked(conn, max_body)
    if length is not None and length > max_body:
        raise FetchError(TOO_LARGE, f"Content-Length {length} > limit {max_body}")
    chunks: list[bytes] = []
    size = 0
    want = max_body + 1 if length is None else length
    while size < want and (chunk := await conn.read(want - size)):
        size += len(chunk)
        chunks.append(chunk)
    if size > max_body:
        raise FetchError(TOO_LARGE, f"more than {max_body} bytes")
    if length is not None and size < length:
        raise FetchError(TRUNCATED, f"connection closed {length - size} bytes before the end")
    return b"".join(chunks)


def _content_length(values: list[bytes]) -> int | None:
    """Go's rules: repeats must agree; digits only (an empty value means none)."""
    if len(set(values)) > 1:
        raise FetchError(BAD_RESPONSE, f"conflicting Content-Length headers {values[:4]!r}")
    if not values or not values[0]:
        return None
    if not values[0].isdigit() or len(values[0]) > 19 or int(values[0]) >= 1 << 63:
        raise FetchError(BAD_RESPONSE, f"bad Content-Length {values[0][:40]!r}")
    return int(values[0])


async def _chunked(conn: _Connection, max_body: int) -> bytes:
    chunks: list[bytes] = []
    size = excess = 0
    while True:
        line = await conn.line(MAX_CHUNK_LINE, BAD_RESPONSE, "chunk-size line")
        if not line.endswith(b"\r"):
            raise FetchError(BAD_RESPONSE, "chunk-size line ends in a bare LF")
        excess += len(line) + 3  # with its LF, and the CRLF after the data
        digits = line.rstrip(b" \t\r").partition(b";")[0]
        if not digits or not set(digits) <= _HEX or len(digits) > 16:
            raise FetchError(BAD_RESPONSE, f"malformed chunk size {line[:40]!r}")
        length = int(digits, 16)
        excess = max(0, excess - 16 - 2 * length)
        if excess > MAX_FRAMING_EXCESS:
            raise FetchError(BAD_RESPONSE, "chunked encoding holds too much framing for its data")
        if length == 0:
            await _fields(conn, MAX_HEAD_BYTES)  # the trailer
            return b"".join(chunks)
        if size + length > max_body:
            raise FetchError(TOO_LARGE, f"more than {max_body} bytes")
        size += length
        while length:
            data = await conn.read(length)
            if not data:
                raise FetchError(TRUNCATED, "connection closed inside a chunk")
            chunks.append(data)
            length -= len(data)
        if await conn.exactly(2, "end of a chunk") != b"\r\n":
            raise FetchError(BAD_RESPONSE, "chunk data not followed by CRLF")
