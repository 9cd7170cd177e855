"""`kv-exporter serve | report | demo` (also `python -m kv_exporter ...`)."""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from kv_exporter import __version__
from kv_exporter.manifest import DEFAULT_LIMITS, DEFAULT_MANIFEST_DIR
from kv_exporter.sidecar.app import ExporterApp
from kv_exporter.sidecar.engine_page import DEFAULT_MAX_PAGE_BYTES, DEFAULT_TIMEOUT_S, EngineTarget
from kv_exporter.sidecar.http import DEFAULT_LISTEN_ADDRESS, ExporterServer, parse_listen_address

log = logging.getLogger("kv_exporter")

SHUTDOWN_MARGIN_S = 5.0  # beyond the engine timeout, for reading manifests and rendering a scrape

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)?\s*$")
_FACTORS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def parse_size(text: str) -> int:
    """`80GiB`, `512 MiB`, `1073741824` -> bytes (IEC units only: GPU memory is counted in them)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 80GiB, 512MiB, 1073741824)")
    return int(float(match.group(1)) * _FACTORS[match.group(2)])


def _positive_size(text: str) -> int:
    size = parse_size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def parse_simulated_gpu(text: str) -> tuple[int, int]:
    """`TOTAL:USED`, e.g. `80GiB:60GiB`."""
    total, sep, used = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--simulate-gpu wants TOTAL:USED, e.g. 80GiB:60GiB; got {text!r}")
    sizes = parse_size(total), parse_size(used)
    if sizes[0] <= 0 or not 0 <= sizes[1] <= sizes[0]:
        raise argparse.ArgumentTypeError(f"--simulate-gpu needs 0 <= USED <= TOTAL, TOTAL > 0; got {text!r}")
    return sizes


def _listen_address(text: str) -> str:
    try:
        parse_listen_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _engine_url(text: str) -> EngineTarget:
    try:
        return EngineTarget.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _common(parser: argparse.ArgumentParser, default_listen: str) -> None:
    parser.add_argument(
        "--listen-address",
        type=_listen_address,
        default=default_listen,
        help=f"[host]:port to serve on (default {default_listen})",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="default info"
    )


def _limits(serve: argparse.ArgumentParser) -> None:
    from kv_exporter.sidecar.snapshot import DEFAULT_MAX_SERIES, SERIES_PER_DECLARATION, SERIES_PER_ENGINE

    serve.add_argument(
        "--manifest-max-bytes",
        type=_positive_size,
        default=DEFAULT_LIMITS.max_bytes,
        help="larger manifest files are rejected unread (reason too_large; default %(default)s bytes)",
    )
    serve.add_argument(
        "--manifest-max-declarations",
        type=_positive_int,
        default=DEFAULT_LIMITS.max_declarations,
        help="manifests with more declarations are rejected (reason too_many_declarations; default %(default)s)",
    )
    serve.add_argument(
        "--max-series",
        type=_positive_int,
        default=DEFAULT_MAX_SERIES,
        help=f"cap on the series live manifests add ({SERIES_PER_DECLARATION} a declaration, {SERIES_PER_ENGINE} an "
        "engine); the newest manifests past it are left out whole (default %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    from kv_exporter.sidecar.demo import DEMO_LISTEN_ADDRESS

    parser = argparse.ArgumentParser(prog="kv-exporter", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kv-exporter {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the Prometheus exporter")
    serve.add_argument("--manifest-dir", default=DEFAULT_MANIFEST_DIR, help="default %(default)s")
    serve.add_argument(
        "--engine-url",
        action="append",
        type=_engine_url,
        default=[],
        metavar="URL",
        help="an engine's metrics URL (repeatable); http://host:port means http://host:port/metrics",
    )
    serve.add_argument(
        "--engine-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds per engine page fetch, in total; keep below the scrape timeout (default %(default)s)",
    )
    serve.add_argument(
        "--engine-max-bytes",
        type=parse_size,
        default=DEFAULT_MAX_PAGE_BYTES,
        help="largest engine page accepted (default %(default)s bytes)",
    )
    _limits(serve)
    gpu = serve.add_mutually_exclusive_group()
    gpu.add_argument("--no-nvml", action="store_true", help="do not read GPUs (no per-GPU series)")
    gpu.add_argument(
        "--simulate-gpu",
        type=parse_simulated_gpu,
        metavar="TOTAL:USED",
        help='use one simulated GPU instead of NVML (series labelled source="simulated"), e.g. 80GiB:60GiB',
    )
    serve.add_argument(
        "--web.config.file",
        dest="web_config_file",
        metavar="PATH",
        help="exporter-toolkit web configuration (TLS, basic auth); needs the 'web' extra",
    )
    _common(serve, DEFAULT_LISTEN_ADDRESS)

    report = commands.add_parser("report", help="print the declarations in a manifest folder")
    report.add_argument("--manifest-dir", default=DEFAULT_MANIFEST_DIR, help="default %(default)s")
    report.add_argument("--max-num-seqs", type=_positive_int, help="rows for max_num_seqs-driven caches")
    report.add_argument("--json", action="store_true", help="JSON instead of a table")

    demo = commands.add_parser("demo", help="simulated engines, reference manifests and a simulated GPU")
    _common(demo, DEMO_LISTEN_ADDRESS)
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(3600):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_serve(args: argparse.Namespace) -> int:
    from kv_exporter.gpu import GpuReader, NvmlReader, SimulatedGpu
    from kv_exporter.manifest import ManifestLimits
    from kv_exporter.sidecar.collection import Collection, CollectionSettings
    from kv_exporter.sidecar.http import serve_in_thread, server_url

    reader: GpuReader | None = None
    if args.simulate_gpu:
        reader = SimulatedGpu(total=args.simulate_gpu[0], used=args.simulate_gpu[1])
    elif not args.no_nvml:
        reader = NvmlReader()
    settings = CollectionSettings(
        manifest_dir=args.manifest_dir,
        targets=tuple(args.engine_url),
        fetch_timeout_s=args.engine_timeout,
        max_page_bytes=args.engine_max_bytes,
        manifest_limits=ManifestLimits(args.manifest_max_bytes, args.manifest_max_declarations),
        max_series=args.max_series,
    )
    collection = Collection(settings, reader)
    try:
        server = _listen(args, ExporterApp(collection))
    except (OSError, ValueError) as exc:  # WebConfigError is a ValueError
        collection.close()
        print(f"kv-exporter: cannot serve on {args.listen_address}: {exc}", file=sys.stderr)
        return 1
    serve_in_thread(server)
    log.info("serving %s/metrics (manifests in %s, %d engine page(s))", server_url(server), args.manifest_dir,
             len(settings.targets))  # fmt: skip
    try:
        _wait_for_signal()
    finally:
        # A scrape in progress waits for its engine pages (at most the engine timeout), then renders.
        if not server.stop(grace_s=args.engine_timeout + SHUTDOWN_MARGIN_S):
            log.warning("stopped with a scrape still being answered")
        collection.close()
        if isinstance(reader, NvmlReader):
            reader.close()
    return 0


def _listen(args: argparse.Namespace, app: ExporterApp) -> ExporterServer:
    """The HTTP server, with the exporter-toolkit web configuration when one is given."""
    from kv_exporter.sidecar.http import build_server

    if not args.web_config_file:
        return build_server(args.listen_address, app)
    from kv_exporter.web.reload import ReloadStatusCollector, WebConfigReloader

    reloader = WebConfigReloader(args.web_config_file)  # refuses to start on a bad file, as the toolkit does
    app.registry.register(ReloadStatusCollector(reloader))
    return build_server(args.listen_address, app, reloader)


def run_demo(args: argparse.Namespace) -> int:
    from kv_exporter.sidecar.demo import describe, start_demo

    try:
        demo = start_demo(args.listen_address)
    except OSError as exc:
        print(f"kv-exporter demo: cannot listen on {args.listen_address}: {exc}", file=sys.stderr)
        return 1
    print(describe(demo), flush=True)
    try:
        _wait_for_signal()
    finally:
        demo.close()
    return 0


def run_report(args: argparse.Namespace) -> int:
    from kv_exporter.sidecar.report import run_report as report

    text, status = report(args.manifest_dir, args.max_num_seqs, args.json)
    (sys.stdout if status != 2 else sys.stderr).write(text)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level if hasattr(args, "log_level") else "warning")
    commands = {"serve": run_serve, "demo": run_demo, "report": run_report}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
