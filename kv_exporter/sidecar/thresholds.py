"""The shipped alert thresholds, for what people look at: the landing page's colours and marker, the dashboard's.

deploy/prometheus/kv-exporter.rules.yml records the same defaults (`model_local_kv:headroom_margin_fraction:default`,
`model_local_kv:unexplained_alert_fraction:default`); tests/deploy/test_rules.py fails when they differ, and checks
through promtool that `headroom_state` says what the shipped alerts do at and around each boundary. An operator's
override (their own rule file) is not visible from here, so whatever shows these figures says "shipped default".
"""

from __future__ import annotations

from enum import Enum

# ModelLocalKVOwnerExceedsDeclaration fires while an owner holds more than its declared ceiling by this fraction.
UNEXPLAINED_ALERT_FRACTION = 0.05
# ModelLocalKVHeadroomLow fires while the headroom to the binding limit is 0 or more but below this fraction of the
# GPU's declared ceiling: an owner within the tolerance above (not alerted) would no longer fit. Not a fraction of the
# GPU's total: vLLM leaves 8-10 % of it free by design (0.92 / 0.9) and about a GiB in 0.34's extensible mode, so any
# such share is crossed by a healthy server (docs/alerts.md, "Thresholds").
HEADROOM_MARGIN_FRACTION = UNEXPLAINED_ALERT_FRACTION


def exceeds_declaration(ceiling: int, unexplained: int) -> bool:
    """What ModelLocalKVOwnerExceedsDeclaration judges (an owner declaring nothing is the other alert's)."""
    return ceiling > 0 and unexplained / ceiling > UNEXPLAINED_ALERT_FRACTION


class HeadroomState(Enum):
    """Which shipped alert a GPU's projected peak would raise."""

    OK = "ok"
    LOW = "low"  # ModelLocalKVHeadroomLow (warning)
    OVER = "over"  # ModelLocalKVProjectedPeakAboveGPUMemory (critical): past the binding limit


def headroom_margin(declared_ceiling: int) -> float:
    """The headroom below which ModelLocalKVHeadroomLow warns (shipped default)."""
    return HEADROOM_MARGIN_FRACTION * declared_ceiling


def headroom_state(headroom: int, declared_ceiling: int) -> HeadroomState:
    """The same comparisons, in the same floating point, as the alert expressions: `headroom` to the binding limit."""
    if headroom < 0:
        return HeadroomState.OVER
    if headroom < headroom_margin(declared_ceiling):
        return HeadroomState.LOW
    return HeadroomState.OK
