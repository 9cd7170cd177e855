"""A scraped page parsed into samples (prometheus_client's own parser), and the look-ups the tests make on them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def pick(samples: Samples, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def absent(samples: Samples, name: str) -> bool:
    return not any(n == name for n, _ in samples)


def total(samples: Samples, name: str) -> float:
    """The sum of every sample of `name`."""
    return sum(v for (n, _), v in samples.items() if n == name)


def manifest_states(samples: Samples) -> tuple[float, ...]:
    """model_local_kv_manifests for the live, stale and invalid states."""
    return tuple(pick(samples, "model_local_kv_manifests", state=x) for x in ("live", "stale", "invalid"))


def declared_models(samples: Samples) -> set[str]:
    """The models whose declarations are on the page."""
    return {dict(ls)["model_name"] for n, ls in samples if n == "model_local_kv_ceiling_bytes"}
