"""Reading an HTTP/1.x request head as Go's net/http reads it (the exporter-toolkit's server, so node_exporter's):
what is refused with which status, and how the body is framed so that it is never read as a request.

Pure functions over bytes; `kv_exporter.transport.connections` feeds them. Every refusal closes the connection, as in
Go. Where this differs from Go on purpose, docs/reliability.md (*Differences from node_exporter*) says so.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus

# Go allows 1 MiB. A head is a few hundred bytes; 64 KiB bounds what each of --web.max-connections can hold.
MAX_HEAD_BYTES = 64 << 10
# A body up to this size is read and dropped, keeping the connection; a larger one is left unread and the
# connection closed after the answer (Go's maxPostHandlerReadBytes).
MAX_DISCARDED_BODY_BYTES = 256 << 10

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE_BYTE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # control characters but HTAB (Go's httpguts)
_HOST = re.compile(rb"[0-9A-Za-z!$%&'()*+,\-.:;=\[\]_~]*")  # Go's validHostByte
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_TARGET_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")
_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_ABSOLUTE = re.compile(rb"[A-Za-z][A-Za-z0-9+.\-]*://[^/?]*")  # scheme://authority, before the path


class BadRequest(Exception):
    """The request cannot be served; answered with `status` and the connection closed, before any handler runs."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason

    def answer(self) -> bytes:
        """Go's answer: no configured headers (no handler ran), the reason in a plain-text body."""
        phrase = HTTPStatus(self.status).phrase
        body = f"{self.status} {phrase}: {self.reason}\n".encode()
        head = f"HTTP/1.1 {self.status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
        return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # percent-decoded, without the query
    version: tuple[int, int]
    headers: Mapping[str, tuple[str, ...]]  # lower-case names, values in arrival order
    discard: int  # body bytes to read and drop before answering
    close: bool  # close after the answer: the client asked, or a body is left unread

    def header(self, name: str) -> str | None:
        """The first value, as Go's Header.Get."""
        values = self.headers.get(name.lower())
        return values[0] if values else None


def head_length(buffer: bytes | bytearray, scanned: int = 0) -> int:
    """The length of the head at the start of `buffer`, up to and including its empty line; -1 while incomplete.

    `scanned`: how much of the buffer an earlier call already searched, so a trickled head is not rescanned.
    """
    if buffer[:1] == b"\n" or buffer[:2] == b"\r\n":
        return buffer.index(b"\n") + 1  # an empty request line, refused by `parse_head`
    start = max(0, scanned - 2)
    ends = [i + n for i, n in ((buffer.find(b"\n\n", start), 2), (buffer.find(b"\n\r\n", start), 3)) if i >= 0]
    return min(ends) if ends else -1


def check_request_line_start(buffer: bytes | bytearray) -> None:
    """Refuse a head at once when its first line already cannot be a request line (a TLS handshake sent to the
    plain port, binary garbage) instead of waiting for the rest of it until the head deadline."""
    end = buffer.find(b"\n")
    line = bytes(buffer[: end if end >= 0 else len(buffer)])
    if _TARGET_CONTROL.search(line[:-1] if line.endswith(b"\r") else line):
        raise BadRequest(400, "malformed HTTP request")


def parse_head(head: bytes) -> Request:
    """The request in `head` (as `head_length` cut it), or `BadRequest` with Go's status for it."""
    lines = [line[:-1] if line.endswith(b"\r") else line for line in head.split(b"\n")]
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        raise BadRequest(400, "malformed HTTP request")
    method, target, version = _request_line(lines[0])
    headers = _headers(lines[1:])
    if len(headers.get("host", ())) > 1:
        raise BadRequest(400, "too many Host headers")
    discard, unread = _body(headers)
    if version[0] != 1:
        raise BadRequest(505, "unsupported protocol version")
    hosts = headers.get("host", ())
    if version >= (1, 1) and not hosts:
        raise BadRequest(400, "missing required Host header")
    if hosts and not _HOST.fullmatch(hosts[0].encode("latin-1")):
        raise BadRequest(400, "malformed Host header")
    expect = _tokens(headers, "expect")
    if expect and "100-continue" not in expect:
        raise BadRequest(417, "unsupported Expect")
    if discard and "100-continue" in expect:
        discard, unread = 0, True  # the client waits for a 100 Continue we never send: leave the body unread
    connection = _tokens(headers, "connection")
    close = unread or "close" in connection or (version == (1, 0) and "keep-alive" not in connection)
    return Request(method, _path(target), version, headers, discard, close)


def _request_line(line: bytes) -> tuple[str, bytes, tuple[int, int]]:
    parts = line.split(b" ", 2)
    if len(parts) != 3:
        raise BadRequest(400, "malformed HTTP request")  # HTTP/0.9's `GET /` among others
    method, target, proto = parts
    version = _VERSION.fullmatch(proto)
    if version is None:
        raise BadRequest(400, "malformed HTTP version")
    if not _TOKEN.fullmatch(method):
        raise BadRequest(400, "invalid method")
    if _TARGET_CONTROL.search(target) or _BAD_ESCAPE.search(target):
        raise BadRequest(400, "malformed request target")
    if target == b"*" and method not in (b"OPTIONS", b"PRI"):
        raise BadRequest(400, "* is for OPTIONS only")
    if target != b"*" and not target.startswith(b"/") and not _ABSOLUTE.match(target):
        raise BadRequest(400, "malformed request target")
    if method == b"PRI" and target == b"*":
        raise BadRequest(400, "HTTP/2 is not served")  # the h2c preface
    return method.decode("ascii"), target, (int(version[1]), int(version[2]))


def _headers(lines: list[bytes]) -> dict[str, tuple[str, ...]]:
    fields: list[tuple[bytes, bytes]] = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):  # obs-fold: Go joins it to the previous value
            if not fields:
                raise BadRequest(400, "malformed MIME header initial line")
            fields[-1] = (fields[-1][0], fields[-1][1] + b" " + line.strip(b" \t"))
            continue
        name, colon, value = line.partition(b":")
        if not colon:
            raise BadRequest(400, "malformed MIME header line")
        if not name:
            continue  # Go skips a field with an empty name
        if not _TOKEN.fullmatch(name):
            raise BadRequest(400, "invalid header name")
        fields.append((name.lower(), value.strip(b" \t")))
    # Values gathered in lists, made tuples once: growing a tuple per repeated name made a head of 13,000 `a:b`
    # lines cost ~0.8 s of the server's loop (quadratic).
    gathered: dict[str, list[str]] = {}
    for name, value in fields:
        if _BAD_VALUE_BYTE.search(value):
            raise BadRequest(400, "invalid header value")
        gathered.setdefault(name.decode("ascii"), []).append(value.decode("latin-1"))
    return {key: tuple(values) for key, values in gathered.items()}


def _body(headers: Mapping[str, tuple[str, ...]]) -> tuple[int, bool]:
    """(bytes to read and drop, whether a body stays unread)."""
    lengths = set(headers.get("content-length", ()))
    if len(lengths) > 1:
        raise BadRequest(400, "differing Content-Length headers")
    length = next(iter(lengths), None)
    if length is not None and not (length.isdigit() and length.isascii() and len(length) < 19):
        raise BadRequest(400, "bad Content-Length")
    codings = headers.get("transfer-encoding")
    if codings is not None:
        if len(codings) != 1 or codings[0].lower() != "chunked":
            raise BadRequest(501, "unsupported transfer encoding")
        if length is not None:  # Go drops the Content-Length; RFC 9112 6.1 says it ought to be an error
            raise BadRequest(400, "both Transfer-Encoding and Content-Length")
        return 0, True  # nothing here takes a body: a chunked one is never decoded, the connection closes instead
    size = int(length or 0)
    return (size, False) if size <= MAX_DISCARDED_BODY_BYTES else (0, True)


def _tokens(headers: Mapping[str, tuple[str, ...]], name: str) -> set[str]:
    return {token.strip().lower() for value in headers.get(name, ()) for token in value.split(",") if token.strip()}


def _path(target: bytes) -> str:
    if target == b"*":
        return "*"
    absolute = _ABSOLUTE.match(target)
    path = target[absolute.end() :] if absolute else target
    path = path.split(b"?", 1)[0] or b"/"
    return urllib.parse.unquote_to_bytes(path).decode("latin-1")
