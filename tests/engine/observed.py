"""What the observed-architecture test reads: the model's own record of what it held, the sidecar's page, and the
worker's manifest, each as plain figures per owner.

A `Reading` is one scrape of the sidecar bracketed by two reads of the worker's manifest: when both reads show the
same sample (`taken_at`), that sample is the one the page was built from (the sampler rewrites the manifest with a
new `taken_at` each time, and the sidecar reads the file as it is during the scrape).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kv_exporter.manifest import Manifest, read_manifest
from kv_exporter.observation import Observation
from tests.engine.testplugin.kvx_testplugin import geometry as g
from tests.support.scrape import Samples, parse
from tests.support.sidecar import Sidecar

Held = tuple[int, int]  # (storage bytes, cache objects)
HOLDERS = tuple(g.REQUEST_POSITIONS)
OWNERS = (*HOLDERS, g.NEVER_OWNER)


def cache_bytes(positions: int) -> int:
    """One of the holders' per-request caches: K and V, every layer, KV head and position, fp32."""
    return 2 * g.SIDE_LAYERS * g.SIDE_KV_HEADS * g.SIDE_HEAD_DIM * positions * g.OBSERVED_ITEMSIZE


@dataclass(frozen=True)
class Change:
    begin: float
    end: float
    owners: dict[str, Held]


class HeldLog:
    """The model's record (kvx_testplugin/observed.py): every change of what its holders hold, in order."""

    def __init__(self, changes: list[Change]) -> None:
        self.changes = changes

    @classmethod
    def read(cls, path: Path) -> HeldLog:
        changes = []
        for line in path.read_text().splitlines():
            data = json.loads(line)
            owners = {owner: (held["bytes"], held["caches"]) for owner, held in data["owners"].items()}
            changes.append(Change(data["begin"], data["end"], owners))
        return cls(changes)

    def state_during(self, start: float, end: float) -> dict[str, Held] | None:
        """What the holders held throughout [start, end], or None when a change overlaps it (a sample taken then may
        have counted part of it). Changes run one after another in the worker's main thread."""
        state = None
        for change in self.changes:
            if change.end < start:
                state = change.owners
            elif change.begin > end:
                break
            else:
                return None
        return state


def sample_figures(observation: Observation) -> dict[str, Held]:
    return {owner.owner: (owner.bytes, owner.caches) for owner in observation.owners}


@dataclass(frozen=True)
class OwnerFigures:
    observed: int
    caches: int
    unexplained: int
    ceiling: int  # the sum of the owner's model_local_kv_ceiling_bytes; 0 when it declares nothing
    peak: int  # model_local_kv_observed_peak_bytes


@dataclass(frozen=True)
class Page:
    """The sidecar's page, as figures for the one engine of the test."""

    text: str
    samples: Samples

    def values(self, name: str, label: str) -> dict[str, float]:
        """`name`'s samples by the value of `label`."""
        return {dict(labels)[label]: value for (n, labels), value in self.samples.items() if n == name}

    def owners(self) -> dict[str, OwnerFigures]:
        observed = self.values("model_local_kv_observed_bytes", "owner")
        caches = self.values("model_local_kv_observed_caches", "owner")
        unexplained = self.values("model_local_kv_unexplained_bytes", "owner")
        peaks = self.values("model_local_kv_observed_peak_bytes", "owner")
        ceilings: dict[str, int] = {}
        for (name, labels), value in self.samples.items():
            if name == "model_local_kv_ceiling_bytes":
                owner = dict(labels)["owner"]
                ceilings[owner] = ceilings.get(owner, 0) + int(value)
        return {
            owner: OwnerFigures(
                int(value), int(caches[owner]), int(unexplained[owner]), ceilings.get(owner, 0), int(peaks[owner])
            )
            for owner, value in observed.items()
        }

    def state(self) -> str:
        [state] = [state for state, value in self.values("model_local_kv_observation_state", "state").items() if value]
        return state

    def running(self) -> int:
        [running] = self.values("model_local_kv_running_sequences", "engine").values()
        return int(running)


@dataclass(frozen=True)
class Reading:
    page: Page
    manifest: Manifest  # the one whose sample the page shows

    @property
    def observation(self) -> Observation:
        assert self.manifest.observation is not None
        return self.manifest.observation


def read_once(sidecar: Sidecar, manifest_path: Path) -> Reading | None:
    """One scrape and the sample it shows; None when the sampler rewrote the manifest during the scrape."""
    before = read_manifest(manifest_path)
    text = sidecar.text()
    after = read_manifest(manifest_path)
    if before.observation is None or after.observation is None:
        return None
    if before.observation.taken_at != after.observation.taken_at:
        return None
    return Reading(Page(text, parse(text)), after)


def distinct_samples(readings: list[Reading]) -> Iterator[Reading]:
    """The first reading of each sample."""
    seen: set[float] = set()
    for reading in readings:
        if reading.observation.taken_at not in seen:
            seen.add(reading.observation.taken_at)
            yield reading
