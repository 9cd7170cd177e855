"""The baseline exporter: prometheus_client's own `start_http_server` serving a registry of plain `Gauge`s that
holds exactly the series kv-exporter printed (same names, labels and values), and nothing else.

`equivalent_spec(text)` turns one kv-exporter page into that registry's description (JSON); the helper process
`python -m bench.baseline_server --spec FILE --port P` serves it on 127.0.0.1 and prints one JSON line
`{"pid": ..., "series": N}` once serving, then runs until SIGTERM. `build_registry(spec)` is the same registry
in-process (for `generate_latest` timings).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from bench.benchlib import Children, module_argv, read_json_line, wait_until_serving
from tests.support.net import free_port

Spec = list[dict[str, Any]]


def equivalent_spec(text: str) -> Spec:
    """Every sample of a text-format page as a gauge series, grouped by sample name. A `Gauge` has one set of label
    names, so a series that leaves a label out (kv-exporter never prints an empty value) gets it empty here: the same
    series to Prometheus, a few bytes more on the baseline's page."""
    by_name: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            entry = by_name.setdefault(
                sample.name, {"name": sample.name, "help": family.documentation, "labels": set(), "samples": []}
            )
            entry["labels"].update(sample.labels)
            entry["samples"].append([sample.labels, sample.value])
    for entry in by_name.values():
        entry["labels"] = sorted(entry["labels"])
        entry["samples"] = [[[labels.get(n, "") for n in entry["labels"]], value] for labels, value in entry["samples"]]
    return list(by_name.values())


def series_count(spec: Spec) -> int:
    return sum(len(entry["samples"]) for entry in spec)


def build_registry(spec: Spec) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for entry in spec:
        gauge = Gauge(entry["name"], entry["help"] or entry["name"], entry["labels"], registry=registry)
        for values, value in entry["samples"]:
            (gauge.labels(*values) if values else gauge).set(value)
    return registry


def write_spec(spec: Spec, folder: Path) -> Path:
    path = folder / f"baseline-spec-{series_count(spec)}.json"
    path.write_text(json.dumps(spec))
    return path


def baseline_argv(spec_file: Path, port: int) -> list[str]:
    return module_argv("baseline_server", "--spec", str(spec_file), "--port", str(port))


def start_baseline(kids: Children, spec: Spec, folder: Path) -> tuple[int, int]:
    """Serve `spec` from a baseline process; returns its (pid, port) once it answers."""
    port = free_port()
    proc = kids.start(baseline_argv(write_spec(spec, folder), port), stdout=subprocess.PIPE)
    read_json_line(proc, timeout_s=120)
    wait_until_serving("127.0.0.1", port)
    return proc.pid, port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--port", required=True, type=int)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    spec = json.loads(args.spec.read_text())
    server, thread = start_http_server(args.port, addr="127.0.0.1", registry=build_registry(spec))
    print(json.dumps({"pid": os.getpid(), "series": series_count(spec)}), flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    server.server_close()
    thread.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
