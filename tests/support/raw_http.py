"""Raw bytes to an HTTP server and what came back: the status of each answer and whether the connection closed.

For requests no HTTP client library will send (malformed heads, smuggled bodies, trickled bytes). Standard library
only, so that it can drive any server: ours, a sidecar from an older checkout, Debian's node_exporter.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

# Sent once the first answer is in, unless it announced a close: the server answers the requests of a connection in
# order and closes after this one, so every answer up to the end of the connection is read, and the last is this one's.
FOLLOW_UP = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
ANSWER_S = 20.0  # a scrape of a loaded sidecar


@dataclass(frozen=True)
class Exchange:
    statuses: tuple[int, ...]
    closes: bool  # an answer said `Connection: close`, or the server closed instead of answering the follow-up


class Answers:
    """Answers read off a socket one by one, framed by Content-Length, chunks or the end of the connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.ended = False  # the server closed (or reset) the connection

    def _fill(self, timeout: float) -> bool:
        if self.ended:
            return False
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return False
        except ConnectionError:
            chunk = b""
        self.ended = not chunk
        self.buffer += chunk
        return bool(chunk)

    def _take(self, size: int, timeout: float) -> bytes | None:
        while len(self.buffer) < size:
            if not self._fill(timeout):
                return None
        taken, self.buffer = self.buffer[:size], self.buffer[size:]
        return taken

    def _line(self, timeout: float) -> bytes | None:
        while b"\r\n" not in self.buffer:
            if not self._fill(timeout):
                return None
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def next(self, timeout: float, head_request: bool = False) -> tuple[int, dict[str, str]] | None:
        """The next whole answer's status and headers (lower-case names); None if none comes within `timeout`."""
        while b"\r\n\r\n" not in self.buffer:
            if not self._fill(timeout):
                return None
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            return 0, {}  # no status line: an HTTP/0.9 answer, or garbage
        status = int(rest[:3])
        if head_request or status < 200 or status in (204, 304):
            return status, headers
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while (size_line := self._line(timeout)) is not None and int(size_line.split(b";")[0], 16):
                if self._take(int(size_line.split(b";")[0], 16) + 2, timeout) is None:
                    return None
            if size_line is None or self._line(timeout) is None:  # the last chunk, then the empty trailer line
                return None
        elif "content-length" in headers:
            if self._take(int(headers["content-length"]), timeout) is None:
                return None
        else:  # delimited by the end of the connection
            while self._fill(timeout):
                pass
            self.buffer = b""
        return status, headers


def exchange(address: tuple[str, int], raw: bytes) -> Exchange:
    """Send `raw` on a fresh connection; every answer to it, and whether the connection then serves another request."""
    with socket.create_connection(address, timeout=ANSWER_S) as sock:
        sock.sendall(raw)
        answers = Answers(sock)
        first = answers.next(ANSWER_S, head_request=raw.startswith(b"HEAD "))
        if first is None:
            return Exchange((), True)
        if first[1].get("connection", "").lower() == "close" or answers.ended:
            return Exchange((first[0],), True)
        try:
            sock.sendall(FOLLOW_UP)
        except OSError:
            return Exchange((first[0],), True)
        later = []
        while (answer := answers.next(ANSWER_S)) is not None:
            later.append(answer[0])
    # The last answer is the follow-up's; any before it answered something `raw` carried (a body read as a request).
    return Exchange((first[0], *later[:-1]), not later)


def closed_within(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the server closed `sock` (what it sends meanwhile is dropped); None if it did not."""
    started = time.monotonic()
    while (left := started + timeout - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return time.monotonic() - started
        except TimeoutError:
            return None
        except ConnectionError:
            return time.monotonic() - started
    return None
