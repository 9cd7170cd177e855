"""Helper process: the real `kv-exporter serve` (cli.main, unchanged) with NVML simulated as `--gpus` devices.

`--simulate-gpu` gives one simulated GPU; the benchmark deployment spans 8. The only thing replaced here is the
simulated device class the CLI instantiates (NVML is the one part allowed to be faked): each device has the
`--simulate-gpu` total and used figures, the UUIDs the benchmark manifests record, and `--engine-pid` using
1 GiB on it (so the per-process NVML path runs as in a hostPID DaemonSet).

    python bench/sidecar.py --gpus 8 --engine-pid PID -- serve --manifest-dir D --engine-url U ... \
        --simulate-gpu 80GiB:60GiB --listen-address 127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchlib import gpu_uuid  # stdlib only: keeps this process's footprint the exporter's own

# The checkout before any installed copy; or KVX_BENCH_SOURCE, another copy of the package (an earlier commit,
# for before/after figures: see deployment.source_at).
sys.path.insert(0, os.environ.get("KVX_BENCH_SOURCE") or str(Path(__file__).resolve().parents[1]))

from kv_exporter import cli, nvml
from kv_exporter.gpu import GpuMemory, GpuScan, SimulatedGpu

GIB = 1 << 30


class SimulatedGpus:
    """`count` simulated devices behind the GpuReader interface (source "simulated", as the CLI's)."""

    def __init__(self, total: int, used: int, count: int, engine_pid: int | None) -> None:
        processes = {engine_pid: GIB} if engine_pid else {}
        self.devices = [
            SimulatedGpu(total=total, used=used, index=i, uuid=gpu_uuid(i), processes=processes) for i in range(count)
        ]
        self.pid_namespace = self.devices[0].pid_namespace
        self.source = self.devices[0].source

    def scan(self) -> GpuScan:
        return GpuScan(tuple(d.device(d.index) for d in self.devices))

    def device(self, index: int) -> GpuMemory:
        return self._at(index).device(index)

    def process_memory(self, index: int) -> dict[int, int]:
        return self._at(index).process_memory(index)

    def _at(self, index: int) -> SimulatedGpu:
        if not 0 <= index < len(self.devices):
            raise nvml.GpuReadError("invalid_argument", "no such simulated device", index)
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

    # cli.run_serve imports SimulatedGpu from kv_exporter.gpu when it runs: this is the class it will find.
    nvml.SimulatedGpu = simulated  # type: ignore[misc,assignment]
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    return cli.main(serve_args)


if __name__ == "__main__":
    sys.exit(main())
