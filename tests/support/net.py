"""Ports on 127.0.0.1, one HTTP request on a fresh connection, basic auth."""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
import urllib.parse

Headers = dict[str, str]


def free_port() -> int:
    """A port nothing listens on now (bound, then closed): for a server that must be told its port in advance."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def closed_port_url() -> str:
    """A metrics URL on 127.0.0.1 where nothing listens."""
    return f"http://127.0.0.1:{free_port()}/metrics"


def get(
    url: str,
    headers: Headers | None = None,
    timeout: float = 30.0,
    context: ssl.SSLContext | None = None,
) -> tuple[int, Headers, bytes]:
    """GET `url` on a fresh connection (HTTPS with `context`); any status is returned, a transport error raised."""
    parts = urllib.parse.urlsplit(url)
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection(parts.netloc, timeout=timeout)
    else:
        conn = http.client.HTTPSConnection(parts.netloc, timeout=timeout, context=context)
    try:
        conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def basic_authorization(user: str, password: str) -> str:
    """The Authorization header's value for HTTP basic auth."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
