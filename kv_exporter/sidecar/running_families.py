"""The families of what the engines' workers run (their step records), beside `families`' engine gauges."""

from __future__ import annotations

from collections.abc import Sequence

from kv_exporter.sidecar import metrics_table as table
from kv_exporter.sidecar.exposition import GaugeRows
from kv_exporter.sidecar.running import RunningState
from kv_exporter.sidecar.snapshot import EngineView


def running_families(
    engines: Sequence[tuple[tuple[str, ...], EngineView]],
) -> tuple[GaugeRows, GaugeRows, GaugeRows]:
    """The window's most, the records' state and the page's difference, for each engine (its labels and view)."""
    most = table.RUNNING_MAX.rows()
    state = table.RUNNING_STATE.rows()
    difference = table.PAGE_DIFFERENCE.rows()
    for labels, view in engines:
        if view.most is not None:
            most.add_metric(labels, view.most)
        if view.manifests:  # an engine only a page shows has no workers here
            for name in RunningState:
                state.add_metric((*labels, name.value), int(name is view.state))
        if view.page_difference is not None:
            difference.add_metric(labels, view.page_difference)
    return most, state, difference
