"""Helper process: the real `kv-exporter serve` (its CLI's main, unchanged) with NVML simulated as `--gpus` devices.

`--simulate-gpu` gives one simulated GPU; the benchmark deployment spans 8. The only thing replaced here is the
simulated device class the CLI instantiates (NVML is the one part allowed to be faked): each device has the
`--simulate-gpu` total and used figures, the UUIDs the benchmark manifests record, and `--engine-pid` using
1 GiB on it (so the per-process NVML path runs as in a hostPID DaemonSet). Started by tests.support.sidecar:

    python -m bench.sidecar --gpus 8 --engine-pid PID -- serve --manifest-dir D --engine-url U ... \
        --simulate-gpu 80GiB:60GiB --web.listen-address 127.0.0.1:0

The kv_exporter it runs is the first on the path: the checkout's, or an earlier commit's (`--compare-with`:
bench.deployment.start_sidecar runs it in that copy's folder), in this layout or the one before kv_exporter/sidecar/.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import kv_exporter
from tests.support.constants import GIB, gpu_uuid  # standard library only: the footprint stays the exporter's own


def exporter_modules() -> tuple[ModuleType, ModuleType]:
    """The CLI and the GPU module of the kv_exporter on the path (found by its files, not by import fallbacks)."""
    if (Path(kv_exporter.__file__).parent / "sidecar" / "cli.py").exists():
        return importlib.import_module("kv_exporter.sidecar.cli"), importlib.import_module("kv_exporter.gpu")
    return importlib.import_module("kv_exporter.cli"), importlib.import_module("kv_exporter.nvml")


cli, gpu = exporter_modules()
SimulatedGpu = gpu.SimulatedGpu  # the class itself, before main() puts SimulatedGpus in its place


class SimulatedGpus:
    """`count` simulated devices behind the GpuReader interface (source "simulated", as the CLI's)."""

    def __init__(self, total: int, used: int, count: int, engine_pid: int | None) -> None:
        processes = {engine_pid: GIB} if engine_pid else {}
        self.devices = [
            SimulatedGpu(total=total, used=used, index=i, uuid=gpu_uuid(i), processes=processes) for i in range(count)
        ]
        self.pid_namespace = self.devices[0].pid_namespace
        self.source = self.devices[0].source

    def scan(self) -> Any:
        return gpu.GpuScan(tuple(d.device(d.index) for d in self.devices))

    def device(self, index: int) -> Any:
        return self._at(index).device(index)

    def process_memory(self, index: int) -> dict[int, int]:
        result: dict[int, int] = self._at(index).process_memory(index)
        return result

    def _at(self, index: int) -> Any:
        if not 0 <= index < len(self.devices):
            raise gpu.GpuReadError("invalid_argument", "no such simulated device", index)
        return self.devices[index]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--engine-pid", type=int)
    parser.add_argument("serve_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    count, engine_pid = args.gpus, args.engine_pid

    def simulated(total: int, used: int) -> SimulatedGpus:
        return SimulatedGpus(total, used, count, engine_pid)

    # The CLI imports SimulatedGpu from the GPU module when it serves: this is the class it will find.
    gpu.SimulatedGpu = simulated
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    exit_code: int = cli.main(serve_args)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
