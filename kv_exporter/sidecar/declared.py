"""What only the manifests decide: each live declaration placed on its GPU with its ceiling, in page order.

None of it depends on a running count, so it is built when a manifest is read and reused until the manifest's
declarations, engine, pod, max_num_seqs or placement change (a worker rewriting its manifest with a new observation
changes none of them). Reuse is by identity all the way down: an unchanged input gives the same object, which lets the
metric families and the exposition reuse what they made from it in turn
(docs/decisions/0014-render-what-did-not-change-once.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kv_exporter.manifest import Declaration, Manifest, PodInfo
from kv_exporter.sidecar.engine_page import EngineKey
from kv_exporter.sidecar.records import DeviceKey, Placement, engine_key


@dataclass(frozen=True, slots=True)
class PlacedDeclaration:
    """One declaration of a live manifest, on the GPU its manifest sits on, with the figures every scrape reads."""

    engine: EngineKey
    placement: Placement
    pod: PodInfo
    declaration: Declaration
    max_num_seqs: int
    ceiling_rows: int
    ceiling_bytes: int
    scales: bool  # rows follow the running count (up to max_num_seqs); else rows_fixed

    def rows_at(self, running: int | None) -> int:
        """Rows live at the engine's running count (None: unreadable, 0 rows), capped at max_num_seqs."""
        return self.declaration.rows_at(0 if running is None else min(running, self.max_num_seqs))


def place(manifest: Manifest, placement: Placement) -> tuple[PlacedDeclaration, ...]:
    key, seqs = engine_key(manifest), manifest.max_num_seqs
    placed = []
    for d in manifest.declarations:
        rows = d.row_count(seqs)
        placed.append(
            PlacedDeclaration(
                key, placement, manifest.pod, d, seqs, rows, d.bytes_per_row * rows, d.rows.scales_with_max_num_seqs
            )
        )
    return tuple(placed)


@dataclass(frozen=True, eq=False)
class Declared:
    """Every exported live declaration, sorted as the page lists them: by engine, GPU label, owner and cache name."""

    ordered: tuple[PlacedDeclaration, ...]
    placed: tuple[tuple[PlacedDeclaration, ...], ...]  # per manifest, what `ordered` was sorted from
    by_engine: tuple[tuple[EngineKey, tuple[int, ...]], ...]  # each engine and where its declarations are in `ordered`
    by_device: dict[DeviceKey, tuple[int, ...]]  # each placement's device key and the same


def declared(placed: Sequence[tuple[PlacedDeclaration, ...]]) -> Declared:
    ordered = sorted(
        itertools.chain.from_iterable(placed),
        key=lambda p: (p.engine, p.placement.gpu, p.declaration.owner, p.declaration.name),
    )
    by_engine: dict[EngineKey, list[int]] = {}
    by_device: dict[DeviceKey, list[int]] = {}
    for index, one in enumerate(ordered):
        by_engine.setdefault(one.engine, []).append(index)
        by_device.setdefault(one.placement.key, []).append(index)
    return Declared(
        tuple(ordered),
        tuple(placed),
        tuple((engine, tuple(at)) for engine, at in by_engine.items()),
        {key: tuple(at) for key, at in by_device.items()},
    )


_Placed = tuple[PlacedDeclaration, ...]


class _Key:
    """A dictionary key whose hash is computed once: the value a manifest is placed by holds its declarations, and
    hashing those again on every scrape would cost most of what reusing them saves."""

    __slots__ = ("hash", "value")

    def __init__(self, value: Hashable) -> None:
        self.value = value
        self.hash = hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.hash == other.hash and self.value == other.value


class DeclaredCache:
    """The last scrape's `place` and `declared` results, returned again for the same inputs.

    A manifest object the store re-used is found by identity; a re-read one by the value of what `place` reads (and
    then still gives the objects made before). Whatever a scrape did not ask for is dropped at `end_scrape`.
    """

    def __init__(self) -> None:
        self._by_object: dict[int, tuple[Manifest, Placement, _Key, _Placed]] = {}
        self._by_value: dict[_Key, _Placed] = {}
        self._used_objects: dict[int, tuple[Manifest, Placement, _Key, _Placed]] = {}
        self._used_values: dict[_Key, _Placed] = {}
        self._declared = {True: declared(()), False: declared(())}

    def place(self, manifest: Manifest, placement: Placement) -> _Placed:
        known = self._by_object.get(id(manifest))
        if known is not None and known[1] == placement:  # the entry holds the manifest: its id is not reused
            key, result = known[2], known[3]
        else:
            key = _Key((manifest.engine, manifest.pod, manifest.max_num_seqs, manifest.declarations, placement))
            found = self._used_values.get(key) or self._by_value.get(key)
            result = place(manifest, placement) if found is None else found
        self._used_values[key] = result
        self._used_objects[id(manifest)] = (manifest, placement, key, result)
        return result

    def declared(self, placed: Sequence[_Placed], exported: bool = True) -> Declared:
        """`exported`: the declarations on the page, or those the series cap left out (the projection still counts
        them): each set is kept apart, so neither is sorted again on every scrape while it stays the same."""
        last = self._declared[exported]
        if len(last.placed) != len(placed) or any(a is not b for a, b in zip(last.placed, placed, strict=True)):
            last = self._declared[exported] = declared(placed)
        return last

    def end_scrape(self) -> None:
        self._by_object, self._used_objects = self._used_objects, {}
        self._by_value, self._used_values = self._used_values, {}
