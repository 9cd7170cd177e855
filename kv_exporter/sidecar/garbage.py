"""Python's cyclic garbage collector, run as often as a scrape's allocations need.

A scrape allocates container objects by the series (label tuples, rows, views) and frees every one of them by its
reference count: none ends in a cycle (`tests/unit/test_garbage.py`). The collector runs by the count of containers
allocated and not yet freed, though, and at its default young threshold (700) a scrape of 100,000 series set off ~80
young collections and a full one every other scrape, which walks every object the sidecar keeps (the placed
declarations, their frozen families, the manifests): a sixth of that scrape's CPU, against 3% at 6,000 series, so the
cost per series grew with the series (docs/decisions/0020-gc-young-threshold.md). At YOUNG_THRESHOLD that is ~5 young
collections a scrape and a full one in a dozen or more; cycles made elsewhere in the process wait a few thousand
allocations longer to be found.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000


def collect_less_often() -> None:
    """Raise the collector's young threshold to YOUNG_THRESHOLD (the older generations' stay Python's own)."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
