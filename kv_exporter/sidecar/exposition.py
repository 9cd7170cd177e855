"""The exposition fast path: prometheus_client's text and OpenMetrics output, byte for byte, for the exporter's own
families, without re-validating and re-escaping every label of every series on every scrape.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample, Timestamp
from prometheus_client.utils import floatToGoString


class GaugeRows(GaugeMetricFamily):
    """A gauge family that keeps its series as (label values, value) rows.

    prometheus_client's `Sample` objects (a label dict each) are built only when something asks for `samples`;
    `Exposition` reads `rows`. On a page of a few hundred declaration series, making and re-reading those dicts was a
    third of the scrape (docs/decisions/0002-own-exposition-renderer.md).
    A label whose value is empty is left out of its series: Prometheus reads an empty label as an absent one, and
    under `honor_labels` an empty one would delete the target's label of that name (a worker without pod
    information must not erase the pod and namespace its target carries).
    """

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        self.label_names = tuple(labels)
        self.rows: list[tuple[tuple[str, ...], float]] = []
        self.frozen = False
        super().__init__(name, documentation, labels=list(labels))

    def add_metric(self, labels: Sequence[str], value: float, timestamp: float | Timestamp | None = None) -> None:
        if self.frozen:
            raise ValueError(f"{self.name}: frozen")
        if timestamp is not None or len(labels) != len(self.label_names):
            raise ValueError(f"{self.name}: want {len(self.label_names)} label values and no timestamp")
        self.rows.append((tuple(labels), value))

    def freeze(self) -> GaugeRows:
        """No more series: `Exposition` then renders this family once and reuses the text while it is passed the
        same object."""
        self.frozen = True
        return self

    @property
    def samples(self) -> list[Sample]:
        names, sample_name = self.label_names, self.name + ("_total" if self.type == "counter" else "")
        return [
            Sample(sample_name, {k: v for k, v in zip(names, labels, strict=True) if v}, value)
            for labels, value in self.rows
        ]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:  # Metric.__init__ sets [], which is all there is to set
            raise AttributeError(f"{self.name}: add series with add_metric")


class CounterRows(GaugeRows):
    """A counter family kept as rows, as `GaugeRows` keeps a gauge's (the same fast path, the same empty labels left
    out); its series are `<name>_total`."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        super().__init__(name, documentation, labels)
        self.type = "counter"


_LEGACY_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")  # unchanged by every escaping handled below
_SAME_FOR_LEGACY_NAMES = ("underscores", "allow-utf-8")  # escapings that leave such names as they are
_go_float: Callable[[float], str] = floatToGoString  # the value spelling both encoders use (untyped upstream)


class Fixed(Collector):
    """Already-collected families, for prometheus_client's encoders."""

    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


class Exposition:
    """prometheus_client's text and OpenMetrics output, byte for byte, for gauge and counter families with
    legacy names (all the exporter's own), at a fraction of the cost.

    prometheus_client validates and escapes every label of every sample on every scrape (~20 us a series
    here; 8 GPUs x 3 stages x 6 declarations took ~17 ms of a 21 ms scrape). Label sets and most values repeat
    from scrape to scrape, so their rendered text is kept while in use (what a page did not use is dropped),
    leaving dictionary lookups per series; `GaugeRows` families are read without building label dicts at all.
    `render` returns None for anything outside that path (other metric types, units, exemplars, timestamps,
    other escapings); the caller then uses prometheus_client's encoder.
    """

    def __init__(self) -> None:
        self._labels: _LabelTexts = {}
        self._values: dict[float, str] = {}
        self._frozen: dict[bool, _FrozenTexts] = {False: {}, True: {}}  # per format: OpenMetrics or not

    def render(self, metrics: Iterable[Metric], content_type: str) -> bytes | None:
        chunks = self.chunks(metrics, content_type)
        return None if chunks is None else b"".join(chunks)

    def chunks(self, metrics: Iterable[Metric], content_type: str) -> list[bytes] | None:
        """The page as one piece per family (frozen ones made once): a page joined in one piece is a block past
        glibc's mmap threshold (kept at 128 KiB by `allocator`), page-faulted in anew on every scrape (0.47 ms
        against 0.02 ms for 225 KB, docs/decisions/0007-fixed-mmap-threshold.md)."""
        if _escaping(content_type) not in _SAME_FOR_LEGACY_NAMES:
            return None
        openmetrics = content_type.startswith("application/openmetrics-text")
        page = _Page(openmetrics, self._labels, self._values, self._frozen[openmetrics])
        if not all(page.family(metric) for metric in metrics):
            return None
        # Keep what this page used; concurrent renders at worst miss the cache.
        self._labels, self._values, self._frozen[openmetrics] = page.labels, page.values, page.frozen
        return [*page.chunks, b"# EOF\n"] if openmetrics else page.chunks


_LabelTexts = dict[tuple[str, ...], dict[tuple[str, ...], str]]  # label names -> label values -> `{...}` text
# id of a frozen family -> the family and its text; holding the family keeps its id from being reused meanwhile
_FrozenTexts = dict[int, tuple["GaugeRows", bytes]]


class _Page:
    """One rendering: the families so far, and the label and value texts it used (seeded from the last page's)."""

    def __init__(self, openmetrics: bool, labels: _LabelTexts, values: dict[float, str], frozen: _FrozenTexts) -> None:
        self.openmetrics = openmetrics
        self.previous_labels, self.previous_values, self.previous_frozen = labels, values, frozen
        self.labels: _LabelTexts = {}
        self.values: dict[float, str] = {}
        self.frozen: _FrozenTexts = {}
        self.chunks: list[bytes] = []  # one per family
        self.out: list[str] = []  # the lines of the family being rendered

    def family(self, metric: Metric) -> bool:
        sample_name = {"gauge": metric.name, "counter": f"{metric.name}_total"}.get(metric.type)
        if sample_name is None or metric.unit or not _LEGACY_NAME.match(metric.name):
            return False
        if isinstance(metric, GaugeRows) and metric.frozen:
            return self.frozen_family(metric, sample_name)
        done = self.lines(metric, sample_name)
        self.chunks.append("".join(self.out).encode())
        self.out.clear()
        return done

    def lines(self, metric: Metric, sample_name: str) -> bool:
        self.out.append(_header(metric.name, metric.documentation, metric.type, self.openmetrics))
        if isinstance(metric, GaugeRows):
            return self.series(sample_name, metric.label_names, metric.rows)
        rows = []
        for sample in metric.samples:
            if sample.name != sample_name or sample.timestamp is not None or sample.exemplar is not None:
                return False
            if getattr(sample, "native_histogram", None) is not None or "" in sample.labels.values():
                return False  # prometheus_client prints empty labels of other families; only GaugeRows omit them
            rows.append(((tuple(sample.labels), tuple(sample.labels.values())), sample.value))
        return all(self.series(sample_name, names, [(values, value)]) for (names, values), value in rows)

    def frozen_family(self, metric: GaugeRows, sample_name: str) -> bool:
        """A frozen family's text, made the first time this format is asked for it."""
        known = self.previous_frozen.get(id(metric))
        if known is None:
            if not self.lines(metric, sample_name):
                return False
            known = (metric, "".join(self.out).encode())
            self.out.clear()
        self.chunks.append(known[1])
        self.frozen[id(metric)] = known
        return True

    def series(self, sample_name: str, names: tuple[str, ...], rows: Iterable[tuple[tuple[str, ...], float]]) -> bool:
        texts = self.labels.get(names)
        if texts is None:
            if not all(_LEGACY_NAME.match(name) for name in names) or len(set(names)) != len(names):
                return False
            texts = self.labels[names] = {}
        previous = self.previous_labels.get(names, {})
        out = self.out
        for values, value in rows:
            text = texts.get(values)
            if text is None:
                text = previous.get(values)
                texts[values] = text = _label_text(names, values) if text is None else text
            out.append(f"{sample_name}{text} {self.value_text(value)}\n")
        return True

    def value_text(self, value: float) -> str:
        if not value:  # 0.0 and -0.0 compare equal but print differently
            return _go_float(value)
        text = self.values.get(value) or self.previous_values.get(value) or _go_float(value)
        self.values[value] = text
        return text


def _escaping(content_type: str) -> str:
    """The name escaping choose_encoder picked (it says so in the content type when it is not the default)."""
    for part in content_type.split(";"):
        key, _, value = part.strip().partition("=")
        if key == "escaping":
            return value
    return "underscores"


@functools.lru_cache(maxsize=1024)
def _header(name: str, documentation: str, kind: str, openmetrics: bool) -> str:
    doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
    if openmetrics:  # OpenMetrics escapes quotes in HELP too; the text format names counters with _total
        doc = doc.replace('"', r"\"")
    else:
        name = f"{name}_total" if kind == "counter" else name
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


def _label_text(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """`{a="x",b="y"}` sorted by name (as prometheus_client prints them), values escaped, empty ones left out."""
    pairs = sorted((name, value) for name, value in zip(names, values, strict=True) if value)
    if not pairs:
        return ""
    return "{" + ",".join(f'{name}="{_escape_value(value)}"' for name, value in pairs) + "}"


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value
