"""The shipped alert thresholds, for what people look at: the landing page's colours and marker, the dashboard's.

deploy/prometheus/kv-exporter.rules.yml records the same default (`model_local_kv:headroom_alert_fraction:default`);
tests/deploy/test_rules.py fails when the two differ, and checks through promtool that `headroom_state` says what the
shipped alerts do at and around each boundary. An operator's override (their own rule file) is not visible from here,
so whatever shows these figures says "shipped default".
"""

from __future__ import annotations

from enum import Enum

# ModelLocalKVHeadroomLow fires while headroom / total is below this fraction (and not below 0).
HEADROOM_ALERT_FRACTION = 0.10
# ModelLocalKVOwnerExceedsDeclaration fires while an owner holds more than its declared ceiling by this fraction.
UNEXPLAINED_ALERT_FRACTION = 0.05


def exceeds_declaration(ceiling: int, unexplained: int) -> bool:
    """What ModelLocalKVOwnerExceedsDeclaration judges (an owner declaring nothing is the other alert's)."""
    return ceiling > 0 and unexplained / ceiling > UNEXPLAINED_ALERT_FRACTION


class HeadroomState(Enum):
    """Which shipped alert a GPU's projected peak would raise."""

    OK = "ok"
    LOW = "low"  # ModelLocalKVHeadroomLow (warning)
    OVER = "over"  # ModelLocalKVProjectedPeakAboveGPUMemory (critical)


def headroom_state(total: int, projected_peak: int) -> HeadroomState:
    """The same comparisons, in the same floating point, as the alert expressions."""
    if projected_peak > total:
        return HeadroomState.OVER
    if total > 0 and (total - projected_peak) / total < HEADROOM_ALERT_FRACTION:
        return HeadroomState.LOW
    return HeadroomState.OK
