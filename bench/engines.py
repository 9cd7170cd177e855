"""Helper process: stand-in engines, one HTTP server per stage on 127.0.0.1, each serving the recorded real vLLM
page (~600 lines) with that stage's running count, which moves on every request (so nothing can be cached).

`python bench/engines.py --stages 3` prints one JSON line `{"pid": ..., "ports": [...]}` once serving, then runs
until SIGTERM. Its pid is the one the benchmark manifests name, so they pass the sidecar's liveness check.

The pages are prebuilt and served from one asyncio loop, so an engine answers in tens of microseconds: what the
benchmarks time is the sidecar, not the stand-in. (A real vLLM server renders its page with prometheus_client on
every request, ~10-20 ms on these cores; that time adds to any scrape of a sidecar reading it, whatever the
sidecar does.)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys

from deployment import MAX_NUM_SEQS, stage_page

NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def response(body: bytes) -> bytes:
    head = (
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class Engine:
    """One stage's page; each request gets the next running count (a prime stride through 0..max_num_seqs)."""

    def __init__(self, stage: int) -> None:
        self.responses = [response(stage_page(stage, running)) for running in range(MAX_NUM_SEQS + 1)]
        self.counter = itertools.count()
        self.served = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = (head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b"").split(b"?", 1)[0]
            if path == b"/metrics":
                self.served += 1
                writer.write(self.responses[(next(self.counter) * 7) % len(self.responses)])
            elif path == b"/served":  # how many pages this engine has served (benchmarks count collections)
                writer.write(response(str(self.served).encode()))
            else:
                writer.write(NOT_FOUND)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()


async def serve(stages: int) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    servers = [await asyncio.start_server(Engine(stage).handle, "127.0.0.1", 0) for stage in range(stages)]
    ports = [server.sockets[0].getsockname()[1] for server in servers]
    print(json.dumps({"pid": os.getpid(), "ports": ports}), flush=True)
    await stop.wait()
    for server in servers:
        server.close()
        await server.wait_closed()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, default=3)
    asyncio.run(serve(parser.parse_args().stages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
