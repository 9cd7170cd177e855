"""GET one page over HTTP/1.1 with hard limits: one wall-clock deadline for the whole exchange, a size cap, and the
rules Go's net/http client applies to a response (Prometheus scrapes with it: what it refuses is refused here).

The deadline covers connecting, the TLS handshake, the request, the status line, the headers, interim 1xx answers,
chunk framing and the body: every socket operation waits at most for what is left of it, so a server that trickles
any part costs at most the timeout, and the reason is then always `timeout`. (http.client, used before, gave each
socket read the whole timeout: a server sending a header line or a `100 Continue` now and then held a scrape for as
long as it liked.) Name resolution is the one step no deadline covers: targets are normally IP addresses or names
in the node's hosts file.

Go's rules followed (net/http's transport, transfer and internal/chunked): at most 5 interim 1xx answers (101 is
final); Content-Length digits only, repeated only with the same value; Transfer-Encoding only `chunked`, and only on
HTTP/1.1, where it overrides Content-Length; chunk-size lines end in CRLF, hold hex digits (an extension after `;`
is ignored), at most 4096 bytes; each chunk's data ends in CRLF; framing may not outweigh the data by more than
16 KiB; trailers are header lines. A head (status line and headers) of more than 64 KiB is refused: Go allows
10 MiB, a metrics server sends well under 1 KiB.
"""

from __future__ import annotations

import socket
import ssl
import time
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
    """The body of a 200 answer to `GET url` (http or https), all of it within `timeout_s`; raises FetchError."""
    parts = urllib.parse.urlsplit(url)
    conn = _Connection(time.monotonic() + timeout_s, timeout_s)
    try:
        conn.open(parts)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = [f"GET {path} HTTP/1.1", f"Host: {parts.netloc}", f"User-Agent: kv-exporter/{__version__}"]
        request += [f"{name}: {value}" for name, value in headers.items()]
        conn.send(("\r\n".join([*request, "Connection: close", "", ""])).encode("latin-1"))
        version, fields = _final_head(conn)
        return _body(conn, version, fields, max_body)
    except TimeoutError:  # a socket operation ran out of the time left
        raise FetchError(TIMEOUT, f"no complete answer within {timeout_s:g} s") from None
    except ConnectionError as exc:
        raise conn.closed(f"{type(exc).__name__}: {exc}") from None
    except OSError as exc:
        raise FetchError(UNREACHABLE, f"{type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


class _Connection:
    """A socket whose every operation waits at most until the deadline, with a read buffer."""

    def __init__(self, deadline: float, timeout_s: float) -> None:
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.sock: socket.socket | None = None
        self.buffer = bytearray()
        self.received = 0  # bytes of answer so far: none means the server never answered

    def _left(self, sock: socket.socket) -> socket.socket:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise FetchError(TIMEOUT, f"no complete answer within {self.timeout_s:g} s")
        sock.settimeout(left)
        return sock

    def open(self, parts: urllib.parse.SplitResult) -> None:
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        error: OSError = OSError(f"no address for {host}")
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                self._left(sock).connect(address)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            self.sock = sock
            break
        else:
            raise error
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if parts.scheme == "https":
            context = ssl.create_default_context()
            tls = context.wrap_socket(self.sock, server_hostname=host, do_handshake_on_connect=False)
            self.sock = tls
            self._left(tls)
            tls.do_handshake()  # CPython bounds the whole handshake by the socket timeout

    def send(self, data: bytes) -> None:
        assert self.sock is not None
        self._left(self.sock).sendall(data)

    def fill(self) -> bool:
        """Read more into the buffer; False at the end of the stream."""
        assert self.sock is not None
        chunk = self._left(self.sock).recv(_RECV)
        self.received += len(chunk)
        self.buffer += chunk
        return bool(chunk)

    def line(self, limit: int, reason: str, what: str) -> bytes:
        """The next line without its LF (a CR before it kept), at most `limit` bytes; `reason` when longer."""
        scanned = 0
        while (end := self.buffer.find(b"\n", scanned)) == -1:
            scanned = len(self.buffer)
            if scanned > limit:
                raise FetchError(reason, f"{what} longer than {limit} bytes")
            if not self.fill():
                raise self.closed(f"connection closed in the {what}")
        if end > limit:
            raise FetchError(reason, f"{what} longer than {limit} bytes")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        return line

    def read(self, most: int) -> bytes:
        """Up to `most` bytes (at least one), b"" at the end of the stream."""
        if not self.buffer and not self.fill():
            return b""
        data = bytes(self.buffer[:most])
        del self.buffer[:most]
        return data

    def exactly(self, size: int, what: str) -> bytes:
        while len(self.buffer) < size:
            if not self.fill():
                raise self.closed(f"connection closed in the {what}")
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def closed(self, detail: str) -> FetchError:
        """The connection ended early: before any answer the server is as good as unreachable."""
        return FetchError(TRUNCATED if self.received else UNREACHABLE, detail)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


Fields = dict[bytes, list[bytes]]  # lower-case header name -> its values, in order


def _final_head(conn: _Connection) -> tuple[bytes, Fields]:
    """The status line and headers of the final answer, past the interim ones; raises for anything but 200."""
    for _ in range(MAX_INTERIM_ANSWERS + 1):
        line = conn.line(MAX_HEAD_BYTES, TOO_LARGE, "status line")
        version, status, phrase = _status_line(line)
        fields = _fields(conn, MAX_HEAD_BYTES - len(line))
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


def _fields(conn: _Connection, limit: int) -> Fields:
    """Header lines up to the empty line (continuation lines joined), `limit` bytes in all."""
    fields: Fields = {}
    last: list[bytes] | None = None
    size = 0
    while line := conn.line(limit - size, TOO_LARGE, "header section").rstrip(b"\r"):
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


def _body(conn: _Connection, version: bytes, fields: Fields, max_body: int) -> bytes:
    length = _content_length(fields.get(b"content-length", []))
    codings = fields.get(b"transfer-encoding", [])
    if codings and version >= b"1.1":  # Go ignores Transfer-Encoding before HTTP/1.1
        if len(codings) != 1 or codings[0].lower() != b"chunked":
            raise FetchError(BAD_RESPONSE, f"unsupported transfer encoding {b', '.join(codings)[:80]!r}")
        return _chunked(conn, max_body)
    if length is not None and length > max_body:
        raise FetchError(TOO_LARGE, f"Content-Length {length} > limit {max_body}")
    chunks: list[bytes] = []
    size = 0
    want = max_body + 1 if length is None else length
    while size < want and (chunk := conn.read(want - size)):
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


def _chunked(conn: _Connection, max_body: int) -> bytes:
    chunks: list[bytes] = []
    size = excess = 0
    while True:
        line = conn.line(MAX_CHUNK_LINE, BAD_RESPONSE, "chunk-size line")
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
            _fields(conn, MAX_HEAD_BYTES)  # the trailer
            return b"".join(chunks)
        if size + length > max_body:
            raise FetchError(TOO_LARGE, f"more than {max_body} bytes")
        size += length
        while length:
            data = conn.read(length)
            if not data:
                raise FetchError(TRUNCATED, "connection closed inside a chunk")
            chunks.append(data)
            length -= len(data)
        if conn.exactly(2, "end of a chunk") != b"\r\n":
            raise FetchError(BAD_RESPONSE, "chunk data not followed by CRLF")
