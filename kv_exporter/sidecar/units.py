"""Bytes as people read them, for the landing page and `report` (metrics always carry plain bytes)."""

from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(value: int) -> str:
    """IEC units, two decimals (4,653,056 -> "4.44 MiB"); exact below 1 KiB; keeps the sign."""
    if abs(value) < 1024:
        return f"{value} B"
    scaled = float(value)
    for unit in _UNITS[:-1]:
        scaled /= 1024
        if abs(scaled) < 1024:
            return f"{scaled:.2f} {unit}"
    return f"{scaled / 1024:.2f} {_UNITS[-1]}"
