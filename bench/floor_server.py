"""The floor: a raw socket server answering every request with one captured response, byte for byte.

What serving a page costs when nothing is collected, rendered or compressed: kv-exporter's own answer (headers and
gzip body, as one scrape returned it) sent back on keep-alive connections, a thread per connection, no parsing
beyond finding the end of each request head. `python -m bench.floor_server --response FILE --port P` prints one JSON
line `{"pid": ...}` once listening, then serves until SIGTERM. `capture_response` builds FILE's bytes from a scrape.

With `--engine-port P` (repeated), it first reads each engine's page, as any exporter that reads its engines when
scraped must: the least that costs (one kept connection per engine, every request sent before any answer is read,
only Content-Length framing, nothing parsed), so that a scrape is also compared with the floor of reading live.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.benchlib import Children, module_argv, read_json_line, wait_until_serving
from tests.support.net import free_port

_END_OF_HEAD = b"\r\n\r\n"
_KEPT_HEADERS = ("Content-Type", "Content-Encoding")


def capture_response(body: bytes, headers: Mapping[str, str]) -> bytes:
    """An HTTP/1.1 200 carrying `body` with the scrape's content headers (type, encoding) and its length."""
    lines = ["HTTP/1.1 200 OK", *(f"{name}: {headers[name]}" for name in _KEPT_HEADERS if name in headers)]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def start_floor(kids: Children, response: bytes, folder: Path, engine_ports: Sequence[int] = ()) -> tuple[int, int]:
    """Serve `response` from a floor process (reading the engines on `engine_ports` first); its (pid, port) once it
    answers."""
    path = folder / "floor-response.bin"
    path.write_bytes(response)
    port = free_port()
    engines = [arg for engine in engine_ports for arg in ("--engine-port", str(engine))]
    argv = module_argv("floor_server", "--response", str(path), "--port", str(port), *engines)
    proc = kids.start(argv, stdout=subprocess.PIPE)
    read_json_line(proc)
    wait_until_serving("127.0.0.1", port)
    return proc.pid, port


def _serve(conn: socket.socket, response: bytes, engine_ports: Sequence[int]) -> None:
    engines = [socket.create_connection(("127.0.0.1", port)) for port in engine_ports]
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pending = b""
        while chunk := conn.recv(65536):
            pending += chunk
            while (end := pending.find(_END_OF_HEAD)) != -1:  # requests without bodies: GETs
                pending = pending[end + len(_END_OF_HEAD) :]
                _read_pages(engines)
                conn.sendall(response)


def _read_pages(engines: Sequence[socket.socket]) -> None:
    for engine in engines:
        engine.sendall(b"GET /metrics HTTP/1.1\r\nHost: engine\r\n\r\n")
    for engine in engines:
        answer = b""
        while (end := answer.find(_END_OF_HEAD)) == -1:
            answer += engine.recv(65536)
        length = int(answer[:end].lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(answer) < end + len(_END_OF_HEAD) + length:
            answer += engine.recv(65536)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--response", required=True, type=Path)
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("--engine-port", type=int, action="append", default=[])
    args = parser.parse_args()
    response = args.response.read_bytes()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    listener = socket.create_server(("127.0.0.1", args.port), backlog=128)
    print(json.dumps({"pid": os.getpid()}), flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve, args=(conn, response, args.engine_port), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
