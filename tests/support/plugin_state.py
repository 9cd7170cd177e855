"""The plugin's process-wide state, taken back between tests and between a benchmark's arms.

The product keeps this state for its process's life (each kind of warning logged once, the upstream collector looked
up once, one observer) and ships no way to forget it: what a test or a benchmark arm needs of a fresh process is taken
back here, from the outside.
"""

from __future__ import annotations

from kv_exporter.plugin import collect, observe, oncelog


def forget_warnings() -> None:
    """Every kind of warning logs again the next time it happens."""
    oncelog._warned.clear()


def forget_upstream_collector() -> None:
    """The next collection looks vllm-omni's collector up again (a test may have installed or removed it)."""
    collect._upstream = None


def stop_observing() -> None:
    """Stop the sampling thread, take the hooks off every class, and start again from a new observer."""
    observe.stop()
    observe._observer.registry.detach()
    observe._observer = observe._Observer()
