"""The connection loop: one thread and a selector for every connection of the server. It accepts, runs TLS
handshakes, reads request heads (and drops small bodies) under deadlines, and writes the answers; each complete
request goes to a worker (`dispatch`), whose answer comes back through `answer`. A thousand idle or trickling
clients cost a thousand sockets, not a thousand threads.

Deadlines (`Limits`): a TLS handshake, a request head with its dropped body (from its first byte; from the accept on
a new connection), an idle keep-alive connection, an answer being written. At `max_connections` the connection that
has waited longest for its next request is dropped for the newcomer: a flood of idle connections cannot lock out a
scraper, which sends its request as soon as it connects.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kv_exporter.transport.connection import Connection, Limits, State
from kv_exporter.transport.request_head import (
    MAX_HEAD_BYTES,
    BadRequest,
    Request,
    check_request_line_start,
    head_length,
    parse_head,
)
from kv_exporter.web.tls import Handshake

log = logging.getLogger(__name__)

LINGER_S = 0.5  # how long a closing connection may go on sending before it is closed
_LINGER_BYTES = 64 << 10
_RECV_BYTES = 64 << 10
_SEND_BYTES = 256 << 10
_ACCEPTS_PER_WAKE = 64

Dispatch = Callable[[Connection, Request], None]
TLSForNewConnection = Callable[[], tuple[ssl.SSLContext, frozenset[str] | None] | None]
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def _has_input(conn: Connection) -> bool:
    """Whether the client has sent bytes the loop has not read yet: in the kernel (peeked below any TLS layer), or
    decrypted and held by the TLS layer."""
    if isinstance(conn.sock, ssl.SSLSocket) and conn.handshake is None and conn.sock.pending():
        return True
    try:
        return bool(socket.socket.recv(conn.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing there (EAGAIN), or reset: nothing worth keeping
        return False


class ConnectionLoop:
    def __init__(
        self, listeners: Sequence[socket.socket], dispatch: Dispatch, tls: TLSForNewConnection, limits: Limits
    ) -> None:
        for listener in listeners:
            listener.setblocking(False)
        self.limits = limits
        self.draining = False  # read by the workers: answers from now on close their connection
        self._listeners = {listener.fileno(): listener for listener in listeners}  # emptied once closed
        self._dispatch = dispatch
        self._tls = tls
        self._selector = selectors.DefaultSelector()
        self._connections: set[Connection] = set()
        self._waiting: OrderedDict[Connection, None] = OrderedDict()  # not being answered, longest-waiting first
        self._busy: set[Connection] = set()
        self._next_sweep = math.inf
        self._lock = threading.Condition()
        self._answers: list[tuple[Connection, tuple[bytes, ...], bool]] = []
        self._stop = self._drain_asked = self._drained = self._woken = False
        self._at_cap = self._accept_paused = False
        self._waker, self._wake_end = socket.socketpair()
        for end in (self._waker, self._wake_end):
            end.setblocking(False)
        self._finished = threading.Event()
        self._finished.set()  # not running
        self._inbox = memoryview(bytearray(_RECV_BYTES))

    # -- called from other threads ---------------------------------------------------------------------------------

    def answer(self, conn: Connection, data: tuple[bytes, ...], close: bool) -> None:
        """Send `data` (the head, then a body that may be shared by many answers), then go on or close."""
        with self._lock:
            self._answers.append((conn, data, close))
        self._wake()

    def drain(self, timeout_s: float) -> bool:
        """Stop accepting and close the idle connections; wait until no answer is pending. False on timeout."""
        self.draining = self._drain_asked = True
        self._wake()
        with self._lock:
            return self._lock.wait_for(lambda: self._drained and not self._busy, timeout_s)

    def stop(self) -> None:
        """End `run` (closing every connection) and wait for it."""
        self._stop = True
        self._wake()
        self._finished.wait()

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            with contextlib.suppress(OSError):
                self._wake_end.send(b"\0")

    # -- the loop ----------------------------------------------------------------------------------------------------

    def run(self) -> None:
        self._finished.clear()
        try:
            self._watch_listeners(True)
            self._selector.register(self._waker.fileno(), selectors.EVENT_READ)
            while not self._stop:
                timeout = None if self._next_sweep == math.inf else max(0.0, self._next_sweep - time.monotonic())
                for key, _ in self._selector.select(timeout):
                    if isinstance(key.data, Connection):
                        self._guarded(key.data)
                    elif key.fd in self._listeners:
                        self._accept(key.fd)
                    else:
                        self._woke()
                if time.monotonic() >= self._next_sweep:
                    self._sweep(time.monotonic())
        finally:
            for conn in list(self._connections):
                self._close(conn)
            self._close_listeners()
            self._finished.set()

    def close(self) -> None:
        """Close the listening sockets, unless `run` is running (it closes everything when it ends)."""
        if self._finished.is_set():
            self._close_listeners()

    def _close_listeners(self) -> None:
        self._watch_listeners(False)
        for listener in self._listeners.values():
            listener.close()
        self._listeners = {}

    def _watch_listeners(self, on: bool) -> None:
        for fd in self._listeners:
            with contextlib.suppress(KeyError, ValueError):
                if on:
                    self._selector.register(fd, selectors.EVENT_READ)
                else:
                    self._selector.unregister(fd)

    def _woke(self) -> None:
        with contextlib.suppress(OSError):
            self._waker.recv(4096)
        self._woken = False
        with self._lock:
            answers, self._answers = self._answers, []
        for conn, data, close in answers:
            if conn in self._connections:
                self._start_writing(conn, data, close or self.draining)
        if self._drain_asked and not self._drained:
            self._close_listeners()
            for conn in [c for c in self._connections if c not in self._busy]:
                self._close(conn)
            with self._lock:
                self._drained = True  # every connection left is being answered
                self._lock.notify_all()

    def _accept(self, fd: int) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            listener = self._listeners.get(fd)
            if listener is None or self._accept_paused:
                return
            try:
                sock, _ = listener.accept()
            except _WOULD_BLOCK:
                return
            except OSError as exc:  # out of descriptors: make room, or wait for a connection to close
                if exc.errno in (errno.EMFILE, errno.ENFILE) and not self._drop_longest_waiting():
                    self._watch_listeners(False)
                    self._accept_paused = True  # until a connection closes, or the next sweep
                    self._next_sweep = min(self._next_sweep, time.monotonic() + 1.0)
                return
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        if len(self._connections) >= self.limits.max_connections and not self._drop_longest_waiting():
            sock.close()  # every connection is being answered: the newcomer is the one to go
            return
        sock.setblocking(False)
        with contextlib.suppress(OSError):  # headers and body go out in separate segments without delay
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        now = time.monotonic()
        tls = self._tls()
        if tls is None:
            conn = Connection(sock, State.HEAD, now + self.limits.head_timeout_s)
        else:
            conn = Connection(sock, State.HANDSHAKE, now + self.limits.handshake_timeout_s)
            conn.handshake = Handshake(sock, *tls)
        self._connections.add(conn)
        self._waiting[conn] = None
        self._deadline(conn, conn.deadline)
        self._watch(conn, selectors.EVENT_READ)

    def _drop_longest_waiting(self) -> bool:
        """Close the connection waiting longest for a request; failing that, the answer stalled longest (a client
        that does not read). One a worker is answering is never dropped, nor one whose next bytes have arrived but
        were not read yet (a burst of accepts comes before the reads: a scraper's request sat unread while the
        newcomers of the same burst evicted it). False if there was none."""
        stalled = (conn for conn in self._busy if conn.state is State.WRITE)
        idle = (conn for conn in self._waiting if conn.state is State.LINGER or not _has_input(conn))
        victim = next(idle, None) or min(stalled, key=lambda conn: conn.deadline, default=None)
        if victim is None:
            return False
        if not self._at_cap:
            log.warning("%d connections open: dropping the longest-waiting ones for new ones (--web.max-connections)",
                        len(self._connections))  # fmt: skip
            self._at_cap = True
        self._close(victim)
        return True

    def _guarded(self, conn: Connection) -> None:
        """A bug that one connection's bytes trigger costs that connection, not the loop every connection needs."""
        try:
            self._ready(conn)
        except Exception:
            log.exception("closing a connection after an unexpected error")
            if conn in self._connections:
                self._close(conn)

    def _ready(self, conn: Connection) -> None:
        if conn.state is State.HANDSHAKE:
            self._shake(conn)
        elif conn.state in (State.HEAD, State.BODY):
            self._read(conn)
        elif conn.state is State.WRITE:
            self._write(conn)
        elif conn.state is State.LINGER:
            self._linger(conn)

    def _shake(self, conn: Connection) -> None:
        assert conn.handshake is not None
        step = conn.handshake.step()
        conn.sock = conn.handshake.sock
        if step == "read":
            self._watch(conn, selectors.EVENT_READ)
        elif step == "write":
            self._watch(conn, selectors.EVENT_WRITE)
        elif step == "refused":
            self._start_writing(conn, (conn.handshake.reply,), close=True)
        else:
            conn.handshake = None
            conn.state = State.HEAD
            self._deadline(conn, time.monotonic() + self.limits.head_timeout_s)
            self._watch(conn, selectors.EVENT_READ)
            self._read(conn)  # the request may already sit in the TLS layer

    def _receive(self, conn: Connection) -> memoryview | None:
        """What the client sent, in the loop's one receive buffer (no allocation per read): empty at its end or on
        an error; None when nothing is there yet."""
        try:
            size = conn.sock.recv_into(self._inbox)
        except _WOULD_BLOCK:
            return None
        except OSError:
            size = 0
        return self._inbox[:size]

    def _read(self, conn: Connection) -> None:
        data = self._receive(conn)
        if data is None:
            return
        if not data:
            self._close(conn)
            return
        now = time.monotonic()
        if conn.state is State.HEAD and not conn.buffer and conn.deadline - now > self.limits.head_timeout_s:
            self._deadline(conn, now + self.limits.head_timeout_s)  # an idle connection starts a request
        conn.buffer += data
        while isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():  # decrypted, so the selector cannot see it
            data = self._receive(conn)
            if not data:
                break
            conn.buffer += data
        self._advance(conn)

    def _advance(self, conn: Connection) -> None:
        """Take what the buffer holds: a head, then the body to drop, then the request goes to a worker."""
        if conn.state is State.HEAD:
            length = head_length(conn.buffer, conn.scanned)
            if length < 0 or length > MAX_HEAD_BYTES:
                conn.scanned = len(conn.buffer)
                try:
                    check_request_line_start(conn.buffer)
                    if len(conn.buffer) > MAX_HEAD_BYTES:
                        raise BadRequest(431, "request head larger than 64 KiB")
                except BadRequest as exc:
                    self._refuse(conn, exc)
                return
            head = bytes(conn.buffer[:length])
            del conn.buffer[:length]
            conn.scanned = 0
            try:
                conn.request = parse_head(head)
            except BadRequest as exc:
                self._refuse(conn, exc)
                return
            conn.discard = conn.request.discard
            conn.state = State.BODY
        dropped = min(conn.discard, len(conn.buffer))
        del conn.buffer[:dropped]
        conn.discard -= dropped
        if conn.discard == 0 and conn.request is not None:
            request, conn.request = conn.request, None
            self._hold(conn, State.BUSY)
            self._dispatch(conn, request)

    def _refuse(self, conn: Connection, exc: BadRequest) -> None:
        log.debug("refused a request: %s", exc)
        self._hold(conn, State.WRITE)
        self._start_writing(conn, (exc.answer(),), close=True)

    def _hold(self, conn: Connection, state: State) -> None:
        """The connection is being answered: no deadline for the worker, nobody drops it for a newcomer."""
        conn.state = state
        self._waiting.pop(conn, None)
        self._busy.add(conn)
        self._watch(conn, 0)

    def _start_writing(self, conn: Connection, data: tuple[bytes, ...], close: bool) -> None:
        conn.state = State.WRITE
        conn.out = [memoryview(part) for part in data if part]
        conn.close_after = close
        self._deadline(conn, time.monotonic() + self.limits.write_timeout_s)
        self._write(conn)

    def _write(self, conn: Connection) -> None:
        while conn.out:
            try:
                if isinstance(conn.sock, ssl.SSLSocket):
                    sent = conn.sock.send(conn.out[0][:_SEND_BYTES])
                else:  # one system call for head and body, no copy of the body
                    sent = conn.sock.sendmsg(conn.out)
            except ssl.SSLWantReadError:
                self._watch(conn, selectors.EVENT_READ)
                return
            except _WOULD_BLOCK:
                self._watch(conn, selectors.EVENT_WRITE)
                return
            except OSError:
                self._close(conn)
                return
            while sent:
                taken = min(sent, len(conn.out[0]))
                conn.out[0] = conn.out[0][taken:]
                sent -= taken
                if not conn.out[0]:
                    conn.out.pop(0)
        self._answered(conn)

    def _answered(self, conn: Connection) -> None:
        self._release(conn)
        if conn.close_after:
            self._start_lingering(conn)
            return
        conn.state = State.HEAD
        self._waiting[conn] = None
        wait = self.limits.head_timeout_s if conn.buffer else self.limits.idle_timeout_s
        self._deadline(conn, time.monotonic() + wait)
        self._watch(conn, selectors.EVENT_READ)
        if conn.buffer:  # a pipelined request came with the last one
            self._advance(conn)
        elif isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():
            self._read(conn)

    def _start_lingering(self, conn: Connection) -> None:
        """Shut our side, then read for a moment: closing with unread input makes the kernel reset the connection,
        which can destroy our last answer before the client reads it."""
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_WR)
        conn.state = State.LINGER
        conn.discard = _LINGER_BYTES
        self._waiting[conn] = None
        self._waiting.move_to_end(conn, last=False)  # the first to go when room is needed
        self._deadline(conn, time.monotonic() + LINGER_S)
        self._watch(conn, selectors.EVENT_READ)

    def _linger(self, conn: Connection) -> None:
        data = self._receive(conn)
        if data is None:
            return
        conn.discard -= len(data)
        if not data or conn.discard <= 0:
            self._close(conn)

    def _release(self, conn: Connection) -> None:
        if conn in self._busy:
            with self._lock:
                self._busy.discard(conn)
                self._lock.notify_all()

    def _close(self, conn: Connection) -> None:
        self._watch(conn, 0)
        conn.sock.close()
        self._connections.discard(conn)
        self._waiting.pop(conn, None)
        self._release(conn)
        if self._at_cap and len(self._connections) < self.limits.max_connections // 2:
            log.info("connections below the cap again: %d open", len(self._connections))
            self._at_cap = False
        if self._accept_paused:
            self._accept_paused = False
            self._watch_listeners(True)

    def _watch(self, conn: Connection, events: int) -> None:
        if events == conn.events:
            return
        if conn.events == 0:
            self._selector.register(conn.fd, events, conn)
        elif events == 0:
            self._selector.unregister(conn.fd)
        else:
            self._selector.modify(conn.fd, events, conn)
        conn.events = events

    def _deadline(self, conn: Connection, deadline: float) -> None:
        conn.deadline = deadline
        self._next_sweep = min(self._next_sweep, deadline)

    def _sweep(self, now: float) -> None:
        """Close the connections past their deadline; find the next deadline."""
        self._next_sweep = math.inf
        if self._accept_paused:  # out of descriptors a second ago: try again
            self._accept_paused = False
            self._watch_listeners(True)
        for conn in list(self._connections):
            if conn.state is State.BUSY:
                continue
            if conn.deadline <= now:
                log.debug("closing a connection past its %s deadline", conn.state.value)
                self._close(conn)
            else:
                self._next_sweep = min(self._next_sweep, conn.deadline)
