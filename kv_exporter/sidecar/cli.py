"""`kv-exporter serve | report | demo` (also `python -m kv_exporter ...`)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kv_exporter.manifest import DEFAULT_LIMITS, DEFAULT_MANIFEST_DIR
from kv_exporter.sidecar.app import DEFAULT_TELEMETRY_PATH, ExporterApp
from kv_exporter.sidecar.arguments import (
    engine_url,
    listen_address,
    non_negative_int,
    parse_simulated_gpu,
    parse_size,
    positive_int,
    positive_size,
    running_window,
)
from kv_exporter.sidecar.buildinfo import build_info
from kv_exporter.sidecar.collection import DEFAULT_COLLECTION_TIMEOUT_S
from kv_exporter.sidecar.engine_page import DEFAULT_MAX_PAGE_BYTES, DEFAULT_TIMEOUT_S
from kv_exporter.sidecar.logs import FORMATS, LEVELS, setup_logging
from kv_exporter.sidecar.running import DEFAULT_WINDOW_S
from kv_exporter.sidecar.server import DEFAULT_LISTEN_ADDRESS, DEMO_LISTEN_ADDRESS, ExporterServer
from kv_exporter.sidecar.stopping import StopRequest
from kv_exporter.transport.connection import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_REQUESTS, Limits

log = logging.getLogger("kv_exporter")

SHUTDOWN_MARGIN_S = 5.0  # beyond the engine timeout, for reading manifests and rendering a scrape
# Beyond that grace, what closing the collection and the process takes; past it the stop watchdog ends the process.
STOP_MARGIN_S = 5.0
DEMO_STOP_BOUND_S = 10.0  # the demo's threads stop within ~1 s; its engines' join waits 5 s at most


class _Version(argparse.Action):
    """--version as one unwrapped line (argparse's own action wraps it at the terminal width)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(build_info().line())
        parser.exit()


def _log_level(text: str) -> str:
    if text not in LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LEVELS)}, got {text!r}")
    return text


def _common(parser: argparse.ArgumentParser, default_listen: str, repeatable: bool = False) -> None:
    """The exporter-toolkit's own flags, spelled as node_exporter spells them."""
    if repeatable:  # node_exporter listens on each one given
        parser.add_argument(
            "--web.listen-address",
            dest="listen_addresses",
            type=listen_address,
            action="append",
            metavar="ADDRESS",
            help=f"[host]:port to serve on, repeatable: each one is served (default {default_listen})",
        )
        parser.set_defaults(default_listen_address=default_listen)
    else:
        parser.add_argument(
            "--web.listen-address",
            dest="listen_address",
            type=listen_address,
            default=default_listen,
            metavar="ADDRESS",
            help=f"[host]:port to serve on (default {default_listen})",
        )
    parser.add_argument(
        "--web.telemetry-path",
        dest="telemetry_path",
        type=_telemetry_path,
        default=DEFAULT_TELEMETRY_PATH,
        metavar="PATH",
        help="path under which to expose the metrics (default %(default)s)",
    )
    parser.add_argument(
        "--log.level",
        dest="log_level",
        type=_log_level,
        default="info",
        metavar="{" + ",".join(LEVELS) + "}",
        help="default info",
    )
    parser.add_argument(
        "--log.format", dest="log_format", choices=FORMATS, default=FORMATS[0], help="default %(default)s"
    )


def _telemetry_path(text: str) -> str:
    if not text.startswith("/") or text in ("/", "/healthz", "/index.html") or "?" in text or "#" in text:
        raise argparse.ArgumentTypeError(f"must be a path such as /metrics, other than / and /healthz; got {text!r}")
    return text


def _limits(serve: argparse.ArgumentParser) -> None:
    from kv_exporter.sidecar.budget import (
        DEFAULT_MAX_LABEL_BYTES,
        DEFAULT_MAX_SERIES,
        SERIES_PER_DECLARATION,
        SERIES_PER_ENGINE,
        SERIES_PER_OWNER,
        SERIES_PER_PAGE_ENGINE,
    )

    serve.add_argument(
        "--manifest-max-bytes",
        type=positive_size,
        default=DEFAULT_LIMITS.max_bytes,
        help="larger manifest files are rejected unread (reason too_large; default %(default)s bytes)",
    )
    serve.add_argument(
        "--manifest-max-declarations",
        type=positive_int,
        default=DEFAULT_LIMITS.max_declarations,
        help="manifests with more declarations are rejected (reason too_many_declarations; default %(default)s)",
    )
    serve.add_argument(
        "--max-series",
        type=positive_int,
        default=DEFAULT_MAX_SERIES,
        help=f"cap on the series live manifests add ({SERIES_PER_DECLARATION} a declaration, {SERIES_PER_OWNER} an "
        f"owner, {SERIES_PER_ENGINE} an engine) and engines only a page shows ({SERIES_PER_PAGE_ENGINE} each); the "
        "manifest that would pass it is left out whole, alone, in file-name order (default %(default)s)",
    )
    serve.add_argument(
        "--max-label-bytes",
        type=positive_size,
        default=DEFAULT_MAX_LABEL_BYTES,
        help="cap on the bytes of label values those series carry, counted with --max-series (default %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-exporter", description=__doc__)
    _version(parser)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the Prometheus exporter")
    serve.add_argument("--manifest-dir", default=DEFAULT_MANIFEST_DIR, help="default %(default)s")
    serve.add_argument(
        "--running-window",
        type=running_window,
        default=DEFAULT_WINDOW_S,
        metavar="SECONDS",
        help="the most any step ran over this many seconds (the scrape interval; default %(default)g)",
    )
    serve.add_argument(
        "--engine-url",
        action="append",
        type=engine_url,
        default=[],
        metavar="URL",
        help="an engine's metrics URL, repeatable, optional: the count of workers without a step record, else a "
        "cross-check; http://host:port means http://host:port/metrics",
    )
    serve.add_argument(
        "--engine-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds per engine page fetch, in total; keep below the scrape timeout (default %(default)s)",
    )
    serve.add_argument(
        "--collection-timeout",
        type=float,
        default=DEFAULT_COLLECTION_TIMEOUT_S,
        metavar="SECONDS",
        help="a collection running longer counts as stuck: scrapes waiting on it answer 503 and /healthz fails until "
        "it returns; more than --engine-timeout (default %(default)s)",
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
    serve.add_argument(
        "--web.systemd-socket",
        dest="systemd_socket",
        action="store_true",
        help="serve on the sockets systemd passes (socket activation) instead of --web.listen-address",
    )
    serve.add_argument(
        "--web.disable-exporter-metrics",
        dest="exporter_metrics",
        action="store_false",
        help="leave the exporter's own process_* and python_* metrics out of the page",
    )
    serve.add_argument(
        "--web.max-requests",
        dest="max_requests",
        type=non_negative_int,
        default=DEFAULT_MAX_REQUESTS,
        metavar="N",
        help="scrapes answered at once; past it, 503 (0: no limit; default %(default)s)",
    )
    serve.add_argument(
        "--web.max-connections",
        dest="max_connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="connections held at once; past it, the one waiting longest for a request is dropped (default "
        "%(default)s)",
    )
    _common(serve, DEFAULT_LISTEN_ADDRESS, repeatable=True)

    report = commands.add_parser("report", help="print the declarations in a manifest folder, beside what they hold")
    report.add_argument(
        "folder", nargs="?", metavar="DIR", help=f"the manifest folder (default {DEFAULT_MANIFEST_DIR})"
    )
    report.add_argument("--manifest-dir", help="the same, as an option")
    report.add_argument("--max-num-seqs", type=positive_int, help="rows for max_num_seqs-driven caches")
    report.add_argument("--json", action="store_true", help="JSON instead of a table")

    demo = commands.add_parser("demo", help="simulated engines, reference manifests and a simulated GPU")
    _common(demo, DEMO_LISTEN_ADDRESS)
    for command in (serve, report, demo):  # as node_exporter: --version wherever the flags are read
        _version(command)
    return parser


def _version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action=_Version, help="show the version, revision and Python, and exit")


def run_serve(args: argparse.Namespace) -> int:
    from kv_exporter.gpu import GpuReader, NvmlReader, SimulatedGpu
    from kv_exporter.manifest import ManifestLimits
    from kv_exporter.sidecar.allocator import keep_heaps_returnable
    from kv_exporter.sidecar.collection import Collection, CollectionSettings
    from kv_exporter.sidecar.garbage import collect_less_often
    from kv_exporter.sidecar.server import serve_in_thread, server_urls

    grace_s = args.engine_timeout + SHUTDOWN_MARGIN_S
    stop = StopRequest.install(bound_s=grace_s + STOP_MARGIN_S)
    keep_heaps_returnable()
    collect_less_often()
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
        deadline_s=args.collection_timeout,
        max_label_bytes=args.max_label_bytes,
        running_window_s=args.running_window,
    )
    collection = Collection(settings, reader)
    try:
        server = _listen(args, ExporterApp(collection, args.telemetry_path, args.exporter_metrics))
    except MissingExtra as exc:
        collection.close()
        print(f"kv-exporter: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # WebConfigError is a ValueError
        collection.close()
        where = "systemd's sockets" if args.systemd_socket else ", ".join(_listen_addresses(args))
        print(f"kv-exporter: cannot serve on {where}: {exc}", file=sys.stderr)
        return 1
    serve_in_thread(server)
    served = " ".join(url + args.telemetry_path for url in server_urls(server))
    log.info("serving %s (manifests in %s, %d engine page(s))", served, args.manifest_dir, len(settings.targets))
    try:
        stop.wait()
    finally:
        # A scrape in progress waits for its engine pages (at most the engine timeout), then renders.
        if not server.stop(grace_s=grace_s):
            log.warning("stopped with a scrape still being answered")
        collection.close()
        if isinstance(reader, NvmlReader):
            reader.close()
        stop.finished()
    return 0


class MissingExtra(Exception):
    """An option needs an optional dependency that is not installed; the message names the extra."""


def _listen_addresses(args: argparse.Namespace) -> list[str]:
    return args.listen_addresses or [args.default_listen_address]


def _listen(args: argparse.Namespace, app: ExporterApp) -> ExporterServer:
    """The HTTP server on each listen address (or systemd's sockets), with the exporter-toolkit web configuration
    when one is given."""
    from kv_exporter.sidecar.server import build_server, systemd_sockets

    limits = Limits(max_connections=args.max_connections, max_requests=args.max_requests)
    reloader = None
    if args.web_config_file:
        try:
            from kv_exporter.web.reload import ReloadStatusCollector, WebConfigReloader
        except ImportError as exc:  # pyyaml or bcrypt
            raise MissingExtra(
                f"--web.config.file needs the 'web' extra (pip install 'kv-exporter[web]'): {exc}"
            ) from None
        reloader = WebConfigReloader(args.web_config_file)  # refuses to start on a bad file, as the toolkit does
        from kv_exporter.sidecar.metrics_table import WEB_CONFIG_RELOAD as RELOAD

        app.registry.register(ReloadStatusCollector(reloader, RELOAD.name, RELOAD.help))
    where = systemd_sockets() if args.systemd_socket else _listen_addresses(args)
    return build_server(where, app, reloader, limits)


def run_demo(args: argparse.Namespace) -> int:
    from kv_exporter.sidecar.demo import describe, start_demo

    stop = StopRequest.install(bound_s=DEMO_STOP_BOUND_S)
    try:
        demo = start_demo(args.listen_address, args.telemetry_path)
    except OSError as exc:
        print(f"kv-exporter demo: cannot listen on {args.listen_address}: {exc}", file=sys.stderr)
        return 1
    print(describe(demo), flush=True)
    try:
        stop.wait()
    finally:
        demo.close()
        stop.finished()
    return 0


def run_report(args: argparse.Namespace) -> int:
    from kv_exporter.sidecar.report import run_report as report

    if args.folder and args.manifest_dir and args.folder != args.manifest_dir:
        print(f"kv-exporter report: two folders given ({args.folder}, {args.manifest_dir})", file=sys.stderr)
        return 2
    text, status = report(args.folder or args.manifest_dir or DEFAULT_MANIFEST_DIR, args.max_num_seqs, args.json)
    (sys.stdout if status != 2 else sys.stderr).write(text)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and args.collection_timeout <= args.engine_timeout:
        parser.error("--collection-timeout must be more than --engine-timeout: every collection reads the engines")
    # report prints every problem in its own output; the readers' log lines would say each a second time.
    setup_logging("error" if args.command == "report" else args.log_level, getattr(args, "log_format", "logfmt"))
    commands = {"serve": run_serve, "demo": run_demo, "report": run_report}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
