"""The command line's value types: each turns one option's text into its value or an `argparse.ArgumentTypeError`
saying what was wrong (sizes in IEC units, the simulated GPU, listen addresses, engine URLs, the running window)."""

from __future__ import annotations

import argparse
import re

from kv_exporter.sidecar.engine_page import EngineTarget
from kv_exporter.sidecar.running import MAX_WINDOW_S
from kv_exporter.sidecar.server import parse_listen_address

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)?\s*$")
_FACTORS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def parse_size(text: str) -> int:
    """`80GiB`, `512 MiB`, `1073741824` -> bytes (IEC units only: GPU memory is counted in them)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 80GiB, 512MiB, 1073741824)")
    return int(float(match.group(1)) * _FACTORS[match.group(2)])


def positive_size(text: str) -> int:
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


def listen_address(text: str) -> str:
    try:
        parse_listen_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def engine_url(text: str) -> EngineTarget:
    try:
        return EngineTarget.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def running_window(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_WINDOW_S:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_WINDOW_S:g} seconds, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
