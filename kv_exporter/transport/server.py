"""The HTTP server: an asyncio loop in one thread holds every connection (`connection.Connection`); the application
answers each complete request through a future (`Handler`), on whatever thread it likes.

What is written here rather than taken from asyncio: the accept loop, because Go's server applies a connection cap
that makes room (at `max_connections` the connection that has waited longest for its next request is dropped for
the newcomer, so a flood of idle connections cannot lock out a scraper, which sends its request as soon as it
connects; a connection whose request has arrived is never dropped), because the TLS context is chosen per
connection (a rotated certificate applies from the next connection on), and because the first byte must be seen
before TLS starts (Go answers plain HTTP sent to the TLS port). `asyncio.Server` takes one fixed context and
accepts without limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import math
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kv_exporter.transport.connection import TLS, Connection, Limits, Reply, State
from kv_exporter.transport.request_head import Request, parse_head

log = logging.getLogger(__name__)

Handler = Callable[[Request], "asyncio.Future[Reply]"]
TLSForNewConnection = Callable[[], TLS | None]
_ACCEPTS_PER_WAKE = 64
_RECV_BYTES = 64 << 10
_SWEEP_SLACK_S = 0.001  # asyncio runs a timer up to its clock resolution early: a deadline due now is past
_ACCEPT_RETRY_S = 1.0  # out of descriptors with nothing to drop: accept again after this, or once one closes
# A sweep this late means the loop could not run (the process starved or stopped, or its host paused): its clients,
# often on the same machine, may have been held as long. It expires nothing, and looks again (at most) THAW_S later.
STALL_S = 0.25
THAW_S = 1.0


class Server:
    """Serves `handler` on `listeners`: `serve_forever` in one thread; `drain`, `stop`, `close` from another."""

    def __init__(
        self, listeners: Sequence[socket.socket], handler: Handler, tls: TLSForNewConnection, limits: Limits
    ) -> None:
        for listener in listeners:
            listener.setblocking(False)
        self.limits = limits
        self.draining = False  # read by the application: answers from now on close their connection
        self.inbox = memoryview(bytearray(_RECV_BYTES))
        self._listeners = list(listeners)  # emptied once closed
        self._handler = handler
        self._tls = tls
        self._connections: set[Connection] = set()
        self._waiting: OrderedDict[Connection, None] = OrderedDict()  # not being answered, longest-waiting first
        self._busy: set[Connection] = set()
        self._at_cap = self._accepting = False
        self._sweeping: asyncio.TimerHandle | None = None
        self._thawing = False  # the sweep now due follows a late one: it expires what is past, late or not
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._stop_asked = False
        self._stopped: asyncio.Event | None = None
        self._none_busy: asyncio.Event | None = None
        # One thread for large heads: they wait for each other, not the loop for them (a few would share the GIL
        # with the loop, one at a time leaves it half).
        self._head_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._finished = threading.Event()
        self._finished.set()  # not running

    # -- called from other threads ---------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        self._finished.clear()
        try:
            asyncio.run(self._serve())
        finally:
            self._close_listeners()
            self._finished.set()

    def drain(self, timeout_s: float) -> bool:
        """Stop accepting and close the idle connections; wait until no answer is pending. False on timeout."""
        self.draining = True
        with self._lock:
            loop = self._loop
        if loop is None:
            return True
        try:
            return asyncio.run_coroutine_threadsafe(self._drain(), loop).result(timeout_s)
        except (concurrent.futures.TimeoutError, RuntimeError):  # RuntimeError: the loop has ended
            return False

    def stop(self) -> None:
        """End `serve_forever` (closing every connection) and wait for it."""
        with self._lock:
            self._stop_asked = True
            if self._loop is not None and self._stopped is not None:
                with contextlib.suppress(RuntimeError):  # the loop is ending anyway
                    self._loop.call_soon_threadsafe(self._stopped.set)
        self._finished.wait()

    def close(self) -> None:
        """Close the listening sockets, unless `serve_forever` is running (it closes everything when it ends)."""
        if self._finished.is_set():
            self._close_listeners()

    # -- what connections ask (`connection.Host`) -------------------------------------------------------------------

    def handle(self, request: Request) -> asyncio.Future[Reply]:
        return self._handler(request)

    def parse(self, head: bytes) -> asyncio.Future[Request]:
        assert self._loop is not None and self._head_thread is not None
        return self._loop.run_in_executor(self._head_thread, parse_head, head)

    def waiting(self, conn: Connection, first: bool = False) -> None:
        self._release(conn)
        self._waiting[conn] = None
        if first:
            self._waiting.move_to_end(conn, last=False)

    def busy(self, conn: Connection) -> None:
        self._waiting.pop(conn, None)
        self._busy.add(conn)

    def forget(self, conn: Connection) -> None:
        self._connections.discard(conn)
        self._waiting.pop(conn, None)
        self._release(conn)
        if self._at_cap and len(self._connections) < self.limits.max_connections // 2:
            log.info("connections below the cap again: %d open", len(self._connections))
            self._at_cap = False
        if not self._accepting and self._listeners:  # paused, out of descriptors: one was just freed
            self._watch_listeners(True)

    def deadline_at(self, deadline: float) -> None:
        """One timer for every connection's deadline (a timer per connection, set and cancelled two or three times a
        request, cost more than the sweep: most new deadlines fall after the one already scheduled)."""
        if self._loop is None or deadline == math.inf:
            return
        if self._sweeping is None or deadline < self._sweeping.when():
            if self._sweeping is not None:
                self._sweeping.cancel()
            self._sweeping = self._loop.call_at(deadline, self._sweep)

    def _sweep(self) -> None:
        """Close the connections past their deadline; schedule the next sweep at the earliest deadline left. A sweep
        that runs more than STALL_S late gives the clients THAW_S first."""
        assert self._loop is not None and self._sweeping is not None
        due, self._sweeping = self._sweeping.when(), None
        now = self._loop.time()
        if now - due > STALL_S and not self._thawing:
            self._thawing = True
            self._sweeping = self._loop.call_later(THAW_S, self._sweep)
            return
        self._thawing = False
        now += _SWEEP_SLACK_S
        for conn in list(self._connections):
            if conn.deadline <= now:
                conn.expire()
        self.deadline_at(min((conn.deadline for conn in self._connections), default=math.inf))

    def _release(self, conn: Connection) -> None:
        self._busy.discard(conn)
        if not self._busy and self._none_busy is not None:
            self._none_busy.set()

    # -- the loop ----------------------------------------------------------------------------------------------------

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            self._loop = loop
            self._stopped = asyncio.Event()
            self._none_busy = asyncio.Event()
            if self._stop_asked:
                self._stopped.set()
        self._head_thread = concurrent.futures.ThreadPoolExecutor(1, "kv-exporter-heads")
        try:
            self._watch_listeners(True)
            await self._stopped.wait()
        finally:
            self._close_listeners()
            for conn in list(self._connections):
                conn.abort()
            self._head_thread.shutdown(wait=False, cancel_futures=True)
            with self._lock:
                self._loop = None

    async def _drain(self) -> bool:
        self._close_listeners()
        for conn in list(self._connections):
            if conn not in self._busy:
                conn.abort()
        assert self._none_busy is not None
        while self._busy:
            self._none_busy.clear()
            await self._none_busy.wait()
        return True

    def _watch_listeners(self, on: bool) -> None:
        loop = self._loop
        if loop is None or on == self._accepting:
            return
        self._accepting = on
        for listener in self._listeners:
            if on:
                loop.add_reader(listener.fileno(), self._accept, listener)
            else:
                loop.remove_reader(listener.fileno())

    def _close_listeners(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: it watches nothing any more
            self._watch_listeners(False)
        for listener in self._listeners:
            listener.close()
        self._listeners = []

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            if not self._accepting:
                return
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: make room, or wait for a connection to close
                if exc.errno in (errno.EMFILE, errno.ENFILE) and not self._drop_longest_waiting():
                    self._watch_listeners(False)
                    assert self._loop is not None
                    self._loop.call_later(_ACCEPT_RETRY_S, self._watch_listeners, True)
                return
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        if len(self._connections) >= self.limits.max_connections and not self._drop_longest_waiting():
            sock.close()  # every connection is being answered: the newcomer is the one to go
            return
        sock.setblocking(False)
        # Head and body go out in separate segments without waiting for an ACK (a 40 ms delayed-ACK stall on every
        # keep-alive scrape otherwise). asyncio sets it only on sockets whose `proto` says TCP, and an accepted
        # socket's says 0.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self._loop is not None
        conn = Connection(self, sock, self._loop)
        self._connections.add(conn)
        self._waiting[conn] = None
        conn.start(self._tls())

    def _drop_longest_waiting(self) -> bool:
        """Close the connection waiting longest for a request; failing that, the answer stalled longest (a client
        that does not read). One being answered is never dropped, nor one whose next bytes have arrived but were
        not read yet (a burst of accepts comes before the reads: a scraper's request sat unread while the
        newcomers of the same burst evicted it). False if there was none."""
        stalled = (conn for conn in self._busy if conn.state is State.WRITE)
        idle = (conn for conn in self._waiting if conn.state is State.LINGER or not conn.has_input())
        victim = next(idle, None) or min(stalled, key=lambda conn: conn.deadline, default=None)
        if victim is None:
            return False
        if not self._at_cap:
            log.warning("%d connections open: dropping the longest-waiting ones for new ones (--web.max-connections)",
                        len(self._connections))  # fmt: skip
            self._at_cap = True
        victim.abort()
        return True
