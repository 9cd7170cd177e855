"""The families of what the engines' workers run (their step records), beside `families`' engine gauges."""

from __future__ import annotations

from collections.abc import Sequence

from kv_exporter.sidecar.exposition import GaugeRows
from kv_exporter.sidecar.running import RunningState
from kv_exporter.sidecar.snapshot import EngineView


def running_families(
    engines: Sequence[tuple[tuple[str, ...], EngineView]], label_names: tuple[str, ...]
) -> tuple[GaugeRows, GaugeRows, GaugeRows]:
    """The window's most, the records' state and the page's difference, for each engine (its labels and view)."""
    most = GaugeRows(
        "model_local_kv_running_sequences_max",
        "The most sequences any step of the engine's workers ran over the last --running-window seconds.",
        label_names,
    )
    state = GaugeRows(
        "model_local_kv_running_state",
        "1 for the state of the engine's step records (the worst of its workers'), 0 for the others: stepping, idle, "
        "stalled (one step has run for a minute), unreadable (a step's count unknown), torn (a write never ended: "
        "its writer died or hangs in it), invalid, absent (no record: the page's running count, if any).",
        (*label_names, "state"),
    )
    difference = GaugeRows(
        "model_local_kv_running_sequences_page_difference",
        "The engine page's running count at the scrape less the workers' latest step: a cross-check, never used in "
        "an estimate (only where both are known).",
        label_names,
    )
    for labels, view in engines:
        if view.most is not None:
            most.add_metric(labels, view.most)
        if view.manifests:  # an engine only a page shows has no workers here
            for name in RunningState:
                state.add_metric((*labels, name.value), int(name is view.state))
        if view.page_difference is not None:
            difference.add_metric(labels, view.page_difference)
    return most, state, difference
