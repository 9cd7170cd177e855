"""One HTTP/1.x connection on the asyncio loop, as an `asyncio.BufferedProtocol`: request heads read as Go's net/http
reads them (`request_head`), each complete request handed to the application, the answer written under asyncio's
flow control, and the close made the way Go makes it. `kv_exporter.transport.server` accepts connections and keeps them.

asyncio gives the loop, TLS (handshake and shutdown timeouts), buffered writes and flow control. What is written here
is what Go's server does and asyncio does not: deadlines per request phase (`Limits`), the TLS port answering plain
HTTP, a body read and dropped rather than served, and a close that lingers so that the last answer is not destroyed
by a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from kv_exporter.transport.request_head import (
    MAX_HEAD_BYTES,
    BadRequest,
    Request,
    check_request_line_start,
    head_length,
    parse_head,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 512  # Prometheus' own --web.max-connections default
DEFAULT_MAX_REQUESTS = 40  # node_exporter's --web.max-requests default (0: no limit)
LINGER_S = 0.5  # how long a closing connection may go on receiving before it is closed (Go's rstAvoidanceDelay)
_LINGER_BYTES = 64 << 10
# A head up to this size is parsed on the loop (~14 us for a scraper's few hundred bytes); a larger one, on the
# server's head thread, so a client sending 64 KiB of header lines cannot hold up the other connections.
INLINE_HEAD_BYTES = 4 << 10

# What Go's net/http answers when plain HTTP reaches a TLS port, and the record starts it recognises as HTTP.
PLAIN_HTTP_TO_TLS_RESPONSE = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
_HTTP_RECORD_STARTS = (b"GET /", b"HEAD ", b"POST ", b"PUT /", b"OPTIO")
_TLS_HANDSHAKE_RECORD = b"\x16"

TLS = tuple[ssl.SSLContext, frozenset[str] | None]  # a new connection's context and its client_allowed_sans
Reply = tuple[tuple[bytes, ...], bool]  # the bytes to send (a head, then a body many answers may share), close after


@dataclass(frozen=True)
class Limits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_requests: int = DEFAULT_MAX_REQUESTS  # scrapes answered at once; past it, 503 as promhttp answers
    head_timeout_s: float = 10.0  # a request head is a few hundred bytes sent at once
    idle_timeout_s: float = 300.0  # longer than any scrape interval, so Prometheus keeps its connection
    handshake_timeout_s: float = 10.0  # from the accept to the end of the TLS handshake
    write_timeout_s: float = 30.0


class State(Enum):
    HANDSHAKE = "handshake"  # before a transport: reading the first byte, or in the TLS handshake
    HEAD = "head"  # waiting for (the rest of) a request head
    PARSE = "parse"  # a large head being parsed off the loop
    BODY = "body"  # dropping a small body before the request is answered
    BUSY = "busy"  # the application is answering
    WRITE = "write"  # the answer is being sent
    LINGER = "linger"  # our side is shut; reading what the client still sends, then closing
    CLOSED = "closed"


# The deadlines that wait for the client's bytes; the write deadline waits for it to read ours instead.
_WAITING_FOR_CLIENT = frozenset((State.HANDSHAKE, State.HEAD, State.BODY, State.LINGER))
# A connection past its deadline with input unread is looked at again after this: a few turns of the loop, which
# read that input first.
UNREAD_INPUT_GRACE_S = 0.1


class Host(Protocol):
    """What a connection asks of the server that keeps it."""

    limits: Limits
    draining: bool  # answers from now on close their connection
    inbox: memoryview  # what every connection receives into, copied out at once

    def handle(self, request: Request) -> asyncio.Future[Reply]: ...
    def parse(self, head: bytes) -> asyncio.Future[Request]: ...  # `parse_head`, on a thread of its own
    def waiting(self, conn: Connection, first: bool = False) -> None: ...  # may be dropped for a newcomer
    def busy(self, conn: Connection) -> None: ...  # being answered: never dropped
    def forget(self, conn: Connection) -> None: ...
    def deadline_at(self, deadline: float) -> None: ...  # a connection's deadline: sweep by then


class Connection(asyncio.BufferedProtocol):
    def __init__(self, host: Host, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.host = host
        self.sock = sock  # kept for `has_input`, below any TLS layer
        self.loop = loop
        self.state = State.HANDSHAKE
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.scanned = 0  # how much of `buffer` was searched for the end of a head
        self.discard = 0  # body bytes still to drop
        self.close_after = False
        self.deadline = math.inf  # the server's sweep closes the connection once it passes (none while answered)
        self._refusal: bytes | None = None  # not TLS on the TLS port: sent (maybe Go's 400), then close
        self._plain = b""  # the first bytes of such a connection
        self._allowed_sans: frozenset[str] | None = None
        self._request: Request | None = None
        self._tls = False
        self._starting: asyncio.Task[None] | None = None

    # -- starting: plain, or TLS once the first byte shows a handshake --------------------------------------------

    def start(self, tls: TLS | None) -> None:
        limits = self.host.limits
        if tls is None:
            self.expire_in(limits.head_timeout_s)
            self._starting = self.loop.create_task(self._open(None))
            return
        self.expire_in(limits.handshake_timeout_s)
        context, self._allowed_sans = tls
        self.loop.add_reader(self.sock.fileno(), self._first_bytes, context)

    def _first_bytes(self, context: ssl.SSLContext) -> None:
        """A TLS handshake record goes on to the handshake; plain HTTP gets Go's answer; anything else is closed."""
        try:
            if not self._plain and self.sock.recv(1, socket.MSG_PEEK) == _TLS_HANDSHAKE_RECORD:
                self.loop.remove_reader(self.sock.fileno())
                self._starting = self.loop.create_task(self._open(context))
                return
            chunk = self.sock.recv(len(_HTTP_RECORD_STARTS[0]) - len(self._plain))  # taken, not peeked: no busy wait
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.abort()
            return
        self._plain += chunk
        if chunk and len(self._plain) < len(_HTTP_RECORD_STARTS[0]):
            return
        self.loop.remove_reader(self.sock.fileno())
        # Closed either way, after Go's answer to plain HTTP; through a lingering close, so that neither that answer
        # nor the end of the connection is lost to a reset.
        self._refusal = PLAIN_HTTP_TO_TLS_RESPONSE if self._plain.startswith(_HTTP_RECORD_STARTS) else b""
        self._starting = self.loop.create_task(self._open(None))

    async def _open(self, context: ssl.SSLContext | None) -> None:
        """The transport over the accepted socket: asyncio calls `connection_made` once it is ready (for TLS, once
        the handshake is done, within what is left of the handshake deadline)."""
        if context is None:
            opening = self.loop.connect_accepted_socket(lambda: self, self.sock)
        else:
            remaining = max(0.001, self.deadline - self.loop.time())
            if sys.version_info >= (3, 11):
                opening = self.loop.connect_accepted_socket(
                    lambda: self, self.sock, ssl=context, ssl_handshake_timeout=remaining, ssl_shutdown_timeout=LINGER_S
                )
            else:  # no TLS shutdown timeout before 3.11: the linger deadline cuts the shutdown short instead
                opening = self.loop.connect_accepted_socket(
                    lambda: self, self.sock, ssl=context, ssl_handshake_timeout=remaining
                )
        try:
            await opening
        except OSError as exc:  # ssl.SSLError and the handshake timeout among them; scanners would flood a log
            log.debug("%s failed: %s", "connection" if context is None else "TLS handshake", exc)
            self.abort()

    # -- asyncio's callbacks ------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._starting = None
        transport.set_write_buffer_limits(high=0)  # paused while anything is unsent: resume_writing means sent
        if self._refusal is not None:
            self.host.busy(self)
            self._send((self._refusal,), close=True)
            return
        if self._allowed_sans is not None:
            # Only a TLS port with client_allowed_sans gets here: web.tls stays off the plain serving path's start-up.
            from kv_exporter.web.tls import peer_allowed

            if not peer_allowed(transport.get_extra_info("peercert"), self._allowed_sans):
                log.debug("TLS client certificate carries none of client_allowed_sans")
                self.abort()
                return
        self.state = State.HEAD
        self._tls = transport.get_extra_info("sslcontext") is not None
        if self._tls:
            self.expire_in(self.host.limits.head_timeout_s)
        self.host.waiting(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        # The server's one receive buffer: asyncio's own reads allocate 256 KiB each, over glibc's mmap threshold
        # (fixed by the sidecar), so each read would be an mmap and an munmap.
        return self.host.inbox

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self._received(self.host.inbox[:nbytes])
        except Exception:  # a bug that one connection's bytes trigger costs that connection only
            log.exception("closing a connection after an unexpected error")
            self.abort()

    def eof_received(self) -> bool:
        if self.state in (State.PARSE, State.BUSY, State.WRITE):
            self.close_after = True  # a client that shut its side after its request still gets the answer
            return True  # (a TLS transport closes anyway: its reading is paused while answering, below)
        return False  # the client is gone: close

    def resume_writing(self) -> None:
        self._written()  # nothing is left unsent (the high-water mark is 0); TLS may say so within `write`

    def connection_lost(self, exc: Exception | None) -> None:
        self._close_state()

    # -- requests -----------------------------------------------------------------------------------------------------

    def _received(self, data: memoryview) -> None:
        if self.state is State.LINGER:
            self.discard -= len(data)
            if self.discard <= 0:
                self.abort()
            return
        now = self.loop.time()
        if self.state is State.HEAD and not self.buffer and self.deadline - now > self.host.limits.head_timeout_s:
            self.set_deadline(now + self.host.limits.head_timeout_s)  # an idle connection starts a request
        self.buffer += data
        if self.state in (State.HEAD, State.BODY):
            self._advance()
        elif len(self.buffer) > MAX_HEAD_BYTES and self.transport is not None:
            self.transport.pause_reading()  # pipelined past a head's worth while answering: the rest waits

    def _advance(self) -> None:
        """Take what the buffer holds: a head, then the body to drop, then the request goes to the application."""
        if self.state is State.HEAD:
            length = head_length(self.buffer, self.scanned)
            if length < 0 or length > MAX_HEAD_BYTES:
                self.scanned = len(self.buffer)
                try:
                    check_request_line_start(self.buffer)
                    if len(self.buffer) > MAX_HEAD_BYTES:
                        raise BadRequest(431, "request head larger than 64 KiB")
                except BadRequest as exc:
                    self._refuse(exc)
                return
            head = bytes(self.buffer[:length])
            del self.buffer[:length]
            self.scanned = 0
            if length > INLINE_HEAD_BYTES:  # ~20 ms at 64 KiB of header lines: not on the loop every connection needs
                self._parse_aside(head)
                return
            try:
                request = parse_head(head)
            except BadRequest as exc:
                self._refuse(exc)
                return
            self._parsed(request)
        dropped = min(self.discard, len(self.buffer))
        del self.buffer[:dropped]
        self.discard -= dropped
        if self.discard == 0 and self._request is not None:
            request, self._request = self._request, None
            self._dispatch(request)

    def _parsed(self, request: Request) -> None:
        self.discard = request.discard
        self.state = State.BODY
        self._request = request

    def _parse_aside(self, head: bytes) -> None:
        """A large head is parsed on the server's head thread; the connection waits, paused, like one answered."""
        assert self.transport is not None
        self.state = State.PARSE
        self.host.busy(self)  # its request has arrived: never dropped for a newcomer
        self.deadline = math.inf
        self.transport.pause_reading()
        self.host.parse(head).add_done_callback(self._parsed_aside)

    def _parsed_aside(self, future: asyncio.Future[Request]) -> None:
        if self.state is not State.PARSE or future.cancelled():
            return
        assert self.transport is not None
        exc = future.exception()
        if isinstance(exc, BadRequest):
            self._refuse(exc)
            return
        if exc is not None:
            log.error("closing a connection: its head could not be read", exc_info=exc)
            self.abort()
            return
        self.host.waiting(self)
        self.expire_in(self.host.limits.head_timeout_s)  # for the body to drop
        self.transport.resume_reading()
        self._parsed(future.result())
        self._advance()

    def _dispatch(self, request: Request) -> None:
        assert self.transport is not None
        self.state = State.BUSY
        self.host.busy(self)
        self.deadline = math.inf  # no deadline for the application: the collection has its own
        if self._tls:  # asyncio's TLS closes at the client's end of input: wait with it in the kernel
            self.transport.pause_reading()
        self.host.handle(request).add_done_callback(self._answered)

    def _answered(self, future: asyncio.Future[Reply]) -> None:
        if self.state is not State.BUSY:  # closed meanwhile
            return
        if future.cancelled() or future.exception() is not None:
            log.error("closing a connection: its answer failed", exc_info=None if future.cancelled() else
                      future.exception())  # fmt: skip
            self.abort()
            return
        data, close = future.result()
        self._send(data, close or self.host.draining)

    def _refuse(self, exc: BadRequest) -> None:
        log.debug("refused a request: %s", exc)
        self.host.busy(self)
        self._send((exc.answer(),), close=True)

    # -- answers and closing ------------------------------------------------------------------------------------------

    def _send(self, data: tuple[bytes, ...], close: bool) -> None:
        assert self.transport is not None
        self.state = State.WRITE
        self.close_after = self.close_after or close  # already set when the client has shut its side
        self.expire_in(self.host.limits.write_timeout_s)
        # One system call for head and body, as the hand-written loop made with sendmsg: asyncio joins them before
        # 3.12 and sends them without a copy from 3.12 on.
        self.transport.writelines([part for part in data if part])
        if not self.transport.get_write_buffer_size():
            self._written()

    def _written(self) -> None:
        if self.state is not State.WRITE or self.transport is None:
            return
        if self.close_after:
            self._linger()
            return
        self.state = State.HEAD
        self.host.waiting(self)
        limits = self.host.limits
        self.expire_in(limits.head_timeout_s if self.buffer else limits.idle_timeout_s)
        self.transport.resume_reading()
        if self.buffer:  # a pipelined request came with the last one
            self._advance()

    def _linger(self) -> None:
        """Shut our side, then read for a moment: closing with unread input makes the kernel reset the connection,
        which can destroy our last answer before the client reads it. TLS sends its close_notify and waits for the
        client's as long (asyncio's ssl_shutdown_timeout)."""
        assert self.transport is not None
        self.state = State.LINGER
        self.discard = _LINGER_BYTES
        self.buffer.clear()
        self.host.waiting(self, first=True)  # the first to go when room is needed
        self.expire_in(LINGER_S)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        try:
            self.transport.write_eof()
        except OSError:  # the client is gone (its kernel reset our answer: ENOTCONN), as Go ignores CloseWrite's error
            log.debug("the client was gone before the answer ended")
            self.abort()
            return
        self.transport.resume_reading()

    def has_input(self) -> bool:
        """Whether the client has sent bytes not read yet (in the kernel, below any TLS layer)."""
        try:
            return bool(socket.socket.recv(self.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # nothing there (EAGAIN), or reset: nothing worth keeping
            return False

    def expire_in(self, seconds: float) -> None:
        self.set_deadline(self.loop.time() + seconds)

    def set_deadline(self, deadline: float) -> None:
        self.deadline = deadline
        self.host.deadline_at(deadline)

    def expire(self) -> None:
        """Past its deadline (the server's sweep found it). Unless the client's bytes wait unread while it waits for
        them: then the loop fell behind, not the client (this process was starved or stopped: a busy engine on the
        same cores starves it for seconds), and it looks again once the loop has read them."""
        if self.state in _WAITING_FOR_CLIENT and self.has_input():
            log.debug("past its %s deadline with input unread: read first", self.state.value)
            self.expire_in(UNREAD_INPUT_GRACE_S)
            return
        log.debug("closing a connection past its %s deadline", self.state.value)
        self.abort()

    def abort(self) -> None:
        """Close now: a deadline, the connection cap, a refusal, the server stopping."""
        if self.state is State.CLOSED:
            return
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows
        elif self._starting is not None:
            self._starting.cancel()  # a handshake in progress: asyncio closes its transport
        else:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
        self._close_state()

    def _close_state(self) -> None:
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        self.deadline = math.inf
        self.host.forget(self)
