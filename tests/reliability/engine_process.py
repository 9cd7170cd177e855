"""A stand-in engine process for the restart tests: it publishes one manifest per rank through the real writer, with
its own pid and start time (so the sidecar checks it in /proc), serves the recorded vLLM page with its running
count on 127.0.0.1:PORT, and on SIGTERM removes its manifests, as the hook does on a clean exit.

    python -m tests.reliability.engine_process FOLDER PORT RUNNING RANKS
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from types import FrameType

from kv_exporter.manifest import write_manifest
from tests.reliability.sidecar import SwitchableEngineServer, live_manifest
from tests.unit.fake_engine import vllm_page_with


def main(folder: str, port: int, running: int, ranks: int) -> int:
    base = live_manifest()
    paths = [
        write_manifest(folder, dataclasses.replace(base, engine=dataclasses.replace(base.engine, tp_rank=rank)))
        for rank in range(ranks)
    ]
    server = SwitchableEngineServer(port, vllm_page_with(running, base.engine.model_name))

    def stop(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=server.shutdown).start()  # shutdown() waits for serve_forever: not from here

    signal.signal(signal.SIGTERM, stop)
    print(f"ready {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        for path in paths:
            path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
