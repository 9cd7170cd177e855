"""One connection as the connection loop (`kv_exporter.transport.connections`) keeps it, and the limits it applies."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from enum import Enum

from kv_exporter.transport.request_head import Request
from kv_exporter.web.tls import HANDSHAKE_TIMEOUT_S, Handshake

DEFAULT_MAX_CONNECTIONS = 512  # Prometheus' own --web.max-connections default
DEFAULT_MAX_REQUESTS = 40  # node_exporter's --web.max-requests default (0: no limit)


@dataclass(frozen=True)
class Limits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_requests: int = DEFAULT_MAX_REQUESTS  # scrapes answered at once; past it, 503 as promhttp answers
    head_timeout_s: float = 10.0  # a request head is a few hundred bytes sent at once
    idle_timeout_s: float = 300.0  # longer than any scrape interval, so Prometheus keeps its connection
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    write_timeout_s: float = 30.0


class State(Enum):
    HANDSHAKE = "handshake"
    HEAD = "head"  # waiting for (the rest of) a request head
    BODY = "body"  # dropping a small body before the request is answered
    BUSY = "busy"  # a worker is answering
    WRITE = "write"
    LINGER = "linger"  # our side is shut; reading what the client still sends, then closing


class Connection:
    __slots__ = ("buffer", "close_after", "deadline", "discard", "events", "fd", "handshake", "out", "request",
                 "scanned", "sock", "state")  # fmt: skip

    def __init__(self, sock: socket.socket, state: State, deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # a TLS socket takes over the descriptor; the selector keeps knowing it by number
        self.state = state
        self.deadline = deadline
        self.buffer = bytearray()
        self.scanned = 0  # how much of `buffer` was searched for the end of a head
        self.events = 0  # what the selector watches for
        self.handshake: Handshake | None = None
        self.request: Request | None = None
        self.discard = 0
        self.out: list[memoryview] = []  # what is left to send
        self.close_after = False
