"""The kv-exporter Grafana dashboard, built with grafana-foundation-sdk.

`python -m deploy.generate` writes it to dashboards/kv-exporter.json (and the Kubernetes copy); the tests check
that the committed JSON is what this code builds. Queries use raw metrics only (docs/CONTRACTS.md), never the
recording rules, so the dashboard works on a Prometheus that has not loaded deploy/prometheus.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import prometheus as prom_model

from kv_exporter.sidecar.thresholds import HEADROOM_MARGIN_FRACTION

UID = "kv-exporter"
TITLE = "kv-exporter: model-local KV"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
# What Grafana 11.0-11.3 write (the compose stack runs 11.3; vLLM's own dashboards use it too). The SDK flavour in
# requirements-dev.txt targets Grafana 10.1 (schema 36); the migrations from 36 to 39 touch nothing this dashboard
# uses (tests/deploy/test_dashboard.py checks the fields they rewrite are absent).
SCHEMA_VERSION = 39
GRAFANA_VERSION = "11.0.0"  # the oldest that writes SCHEMA_VERSION

# Variables are named after the labels they filter (as in vLLM's dashboards), so a query's filter for a scope
# is one matcher per label. A scope lists the variables that apply to a family's labels. `cluster` is a global
# ruler's (Thanos, Mimir) or Prometheus' external label, `node` the shipped monitors' (from the pod's node name):
# target labels, on every series.
Scope = tuple[str, ...]
HOST: Scope = ("cluster", "job", "node", "instance")
# A GPU's series carry the pod of the engines using it where they share one (none where several do: All keeps them).
GPU: Scope = (*HOST, "namespace", "pod", "gpu")
# The worker's pod: two pods of one model on one node (the DaemonSet layout) are two engines to the panels.
ENGINE: Scope = (*HOST, "namespace", "pod", "model_name", "stage", "engine")
DECLARATION: Scope = (*ENGINE, "gpu")
# Labels that identify one engine, and one declaration series (CONTRACTS.md), for `on (...)` matches.
ENGINE_KEY = "cluster, job, instance, namespace, pod, model_name, stage, engine"
DECL_KEY = (
    "cluster, job, instance, namespace, pod, container, model_name, stage, engine, owner, cache, scope, driver, "
    "gpu, UUID"
)
DECL_INFO = "dtype, capacity_source, rows_fixed, rows_reason, allocation_note"

Panel = Any  # an SDK panel builder (timeseries.Panel, stat.Panel, table.Panel)


def sel(metric: str, scope: Scope) -> str:
    """`metric` filtered by the dashboard's variables for `scope`."""
    matchers = ", ".join(f'{label}=~"${label}"' for label in scope)
    return f"{metric}{{{matchers}}}" if scope else metric


def query(expr: str, legend: str, ref: str, *, instant: bool = False) -> prom.Dataquery:
    q = prom.Dataquery().expr(expr).legend_format(legend).ref_id(ref)
    return q.instant() if instant else q.range()


ALL = model.VariableOption(selected=True, text=["All"], value=["$__all"])


def chained(name: str, label: str, metric: str, parents: Scope, help_text: str) -> dash.QueryVariable:
    """A multi-select variable with All whose values are `name`'s values among the series the parents select."""
    variable = (
        dash.QueryVariable(name)
        .label(label)
        .description(help_text)
        .datasource(DATASOURCE)
        .query(f"label_values({sel(metric, parents)}, {name})")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .current(ALL)
    )
    # All as `.*` keeps series whose label is empty or absent (a declaration on no known GPU, a Prometheus with no
    # cluster label, a target without a node); `job` and `instance` are on every series: `.+`, as grafana's
    # dashboard-linter wants (the health row's `up` is kept to the jobs that run kv-exporter by its query).
    return variable.all_value(".+" if name in ("job", "instance") else ".*")


# Every exporter exports its build info, and every engine it knows has a manifest count (0 when undeclared).
EXPORTERS = "model_local_kv_exporter_build_info"
ENGINES = "model_local_kv_engine_manifests"
# Every worker's pod is on its declarations: an engine's own series carry only its first rank's (two pods of one
# model on one node are one engine to the exporter, two pods here).
DECLARED = "model_local_kv_declaration_info"


def before(name: str, scope: Scope = ENGINE) -> Scope:
    return scope[: scope.index(name)]


# Import (Grafana's "Import dashboard"): the data source is asked for once and becomes the variable's default.
DS_INPUT = "DS_PROMETHEUS"


def variables() -> list[Any]:
    source = dash.DatasourceVariable("datasource").label("Data source").type("prometheus")
    return [
        source.current(model.VariableOption(selected=True, text="Prometheus", value="${" + DS_INPUT + "}")),
        chained("cluster", "Cluster", EXPORTERS, (), "The cluster (a global ruler's or Prometheus' external label)"),
        chained("job", "Job", EXPORTERS, before("job"), "Prometheus scrape job of the kv-exporter sidecars"),
        chained("node", "Node", EXPORTERS, before("node"), "The Kubernetes node the sidecar's pod runs on"),
        chained("instance", "Instance", EXPORTERS, before("instance"), "A kv-exporter sidecar (host:port scraped)"),
        chained("namespace", "Namespace", DECLARED, HOST, "Kubernetes namespace of the engine's pod"),
        chained("pod", "Pod", DECLARED, before("pod"), "The engine's pod (kube-state-metrics' pod label)"),
        chained("model_name", "Model", ENGINES, before("model_name"), "vLLM's served model name"),
        chained("stage", "Stage", ENGINES, before("stage"), "vllm-omni stage id (0 for plain vLLM)"),
        chained("engine", "Engine", ENGINES, before("engine"), "vLLM's data-parallel engine (vllm-omni's replica)"),
        # The GPUs the engines' declarations sit on: the GPUs whose figures an exporter reports.
        chained("gpu", "GPU", DECLARED, HOST, "GPU index as NVML reports it"),
    ]


def legend_table() -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["lastNotNull", "max"])
    )


def graph(title: str, description: str, unit: str, targets: list[prom.Dataquery]) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .legend(legend_table())
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
        .fill_opacity(10)
    )
    for target in targets:
        panel = panel.with_target(target)
    return panel


OWNER_KEY = "cluster, instance, namespace, pod, model_name, stage, engine, owner, cache"
OWNER_LEGEND = "{{instance}} {{pod}} · {{model_name}} s{{stage}} e{{engine}} · {{owner}} / {{cache}}"


def by_owner(title: str, description: str, metric: str) -> timeseries.Panel:
    """A per-declaration byte metric, summed per owner and cache and stacked."""
    expr = f"sum by ({OWNER_KEY}) ({sel(metric, DECLARATION)})"
    return (
        graph(title, description, "bytes", [query(expr, OWNER_LEGEND, "A")])
        .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
        .fill_opacity(40)
    )


def single(title: str, description: str, unit: str, expr: str, legend: str) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .with_target(query(expr, legend, "A", instant=True))
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(common.BigValueGraphMode.NONE)
        .color_mode(common.BigValueColorMode.BACKGROUND)
    )


def thresholds(*steps: tuple[float | None, str]) -> dash.ThresholdsConfig:
    return (
        dash.ThresholdsConfig()
        .mode(model.ThresholdsMode.ABSOLUTE)
        .steps([model.Threshold(value=value, color=color) for value, color in steps])
    )


GPU_LEGEND = "{{instance}} · GPU {{gpu}}"
WORKER_LEGEND = "{{instance}} {{pod}} · {{model_name}} s{{stage}} e{{engine}} · GPU {{gpu}}"
WORKER_KEY = "job, instance, namespace, pod, model_name, stage, engine, gpu, UUID"
ENGINE_LEGEND = "{{instance}} {{pod}} · {{model_name}} s{{stage}} e{{engine}}"
DASHED = [model.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})]


# Headroom to the limit met first, as a share of the model-local KV declared on the GPU (ModelLocalKVHeadroomLow's
# measure, docs/alerts.md).
HEADROOM_SHARE = (
    f"{sel('model_local_kv_gpu_headroom_bytes', GPU)} / {sel('model_local_kv_gpu_declared_ceiling_bytes', GPU)}"
)
TOP = 10  # rows of the fleet row's rankings: readable at a hundred engines


def merged_table(
    title: str,
    description: str,
    columns: list[tuple[str, str, str, str]],
    sort_by: str | None = None,
    descending: bool = False,
) -> table.Panel:
    """One row per series, the instant queries' values side by side: (expr, ref, column, unit) per query, sorted by
    `sort_by` (the first column by default), so the worst rows come first at any fleet size."""
    panel = (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .show_header(True)
        .cell_height(common.TableCellHeight.SM)
    )
    for expr, ref, _, _ in columns:
        panel = panel.with_target(query(expr, "", ref, instant=True).format(prom_model.PromQueryFormat.TABLE))
    renames = {("Value" if len(columns) == 1 else f"Value #{ref}"): name for _, ref, name, _ in columns}
    hidden = {name: True for name in ("Time", "__name__", "job")}
    sort = [{"field": sort_by or columns[0][2], "desc": descending}]
    panel = (
        panel.with_transformation(model.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            model.DataTransformerConfig(id_val="organize", options={"excludeByName": hidden, "renameByName": renames})
        )
        .with_transformation(model.DataTransformerConfig(id_val="sortBy", options={"sort": sort}))
    )
    for _, _, name, unit in columns:
        panel = panel.override_by_name(name, [model.DynamicConfigValue(id_val="unit", value=unit)])
    return panel


def fleet_row() -> list[Panel]:
    """The fleet at a glance: counts, then the worst GPUs, models and owners (TOP each), at any fleet size."""
    at_risk = single(
        "GPUs at risk",
        "GPUs whose headroom at the projected peak is below the shipped ModelLocalKVHeadroomLow default "
        f"({HEADROOM_MARGIN_FRACTION:.0%} of the model-local KV declared on them), the ones below 0 included.",
        "none",
        f"count(({HEADROOM_SHARE}) < {HEADROOM_MARGIN_FRACTION}) or vector(0)",
        "GPUs at risk",
    ).thresholds(thresholds((None, "green"), (1, "orange")))
    over = single(
        "GPUs that cannot hold their declared peak",
        "GPUs whose projected peak at max_num_seqs is above the limit met first "
        "(ModelLocalKVProjectedPeakAboveGPUMemory).",
        "none",
        f"count(({HEADROOM_SHARE}) < 0) or vector(0)",
        "GPUs over memory",
    ).thresholds(thresholds((None, "green"), (1, "red")))
    unreadable = single(
        "Engines without a running count",
        "Engines no configured metrics page reports (their estimates use 0 rows for max_num_seqs-driven caches).",
        "none",
        f"count({sel('model_local_kv_engine_up', ENGINE)} == 0) or vector(0)",
        "engines unreadable",
    ).thresholds(thresholds((None, "green"), (1, "orange")))
    down = single(
        "Exporters down",
        "kv-exporter targets Prometheus failed to scrape (ModelLocalKVExporterDown).",
        "none",
        f"count(({SCRAPED}) == 0) or vector(0)",
        "exporters down",
    ).thresholds(thresholds((None, "green"), (1, "red")))
    by_model = (
        f"bottomk({TOP}, min by (model_name) (({HEADROOM_SHARE}) * on (cluster, job, instance, gpu) group_right () "
        f"group by (cluster, job, instance, gpu, model_name) ({sel(DECLARED, DECLARATION)})))"
    )
    unexplained = "cluster, instance, namespace, pod, model_name, stage, engine, owner"
    rankings = [
        ("Worst headroom per GPU", "The GPUs with the least headroom at the projected peak, as a share of the "
         "model-local KV declared on them.", f"bottomk({TOP}, {HEADROOM_SHARE})", "headroom share", "percentunit",
         False),
        ("Worst headroom per model", "Per served model, the least headroom share among the GPUs holding its "
         "declarations.", by_model, "headroom share", "percentunit", False),
        ("Lowest safe max_num_seqs", "The GPUs whose projected peak allows the fewest running sequences.",
         f"bottomk({TOP}, {sel('model_local_kv_gpu_safe_max_num_seqs', GPU)})", "safe max_num_seqs", "none", False),
        ("Most unexplained bytes", "The owners holding the most beyond their declared ceiling (all of it for an "
         "owner declaring nothing).", f"topk({TOP}, sum by ({unexplained}) "
         f"({sel('model_local_kv_unexplained_bytes', DECLARATION)}))", "unexplained", "bytes", True),
    ]  # fmt: skip
    tables = [
        merged_table(title, description, [(expr, "A", column, unit)], descending=desc)
        for title, description, expr, column, unit, desc in rankings
    ]
    stats = [panel.height(4).span(6) for panel in (at_risk, over, unreadable, down)]
    return [*stats, *(panel.height(8).span(12) for panel in tables)]


def gpu_row() -> list[Panel]:
    memory = graph(
        "GPU memory: used, projected peak, limit, total",
        "Used is NVML's figure now. Projected peak adds every live declaration's ceiling minus its estimate: "
        "the memory the GPU needs once each running engine reaches max_num_seqs. Limit is where the first limit is "
        "met: the total, or sooner where a worker's allocator cap binds (vLLM 0.34). Each GPU is reported by the "
        "one exporter whose engines use it.",
        "bytes",
        [
            query(sel("model_local_kv_gpu_memory_used_bytes", GPU), f"used · {GPU_LEGEND}", "A"),
            query(sel("model_local_kv_gpu_projected_peak_bytes", GPU), f"projected peak · {GPU_LEGEND}", "B"),
            query(sel("model_local_kv_gpu_memory_total_bytes", GPU), f"total · {GPU_LEGEND}", "C"),
            query(sel("model_local_kv_gpu_limit_bytes", GPU), f"limit · {GPU_LEGEND}", "D"),
        ],
    ).override_by_regexp("^(total|limit).*", DASHED)
    per_gpu = merged_table(
        "Per GPU: headroom, safe max_num_seqs, processes no manifest accounts for",
        "Each GPU, the least headroom first: headroom to the limit met first / the model-local KV declared on the GPU "
        f"(red below 0, ModelLocalKVProjectedPeakAboveGPUMemory; orange below {HEADROOM_MARGIN_FRACTION:.0%}, "
        "ModelLocalKVHeadroomLow's shipped default, an override in your own rule file is not reflected here), the "
        "headroom in bytes, the largest max_num_seqs whose projected peak still fits on the GPU and under every "
        "worker's allocator cap, and compute processes that are not this exporter's engines' workers (above 0 the "
        "GPU is not projected here: docs/deploy.md).",
        [
            (HEADROOM_SHARE, "A", "headroom share", "percentunit"),
            (sel("model_local_kv_gpu_headroom_bytes", GPU), "B", "headroom", "bytes"),
            (sel("model_local_kv_gpu_safe_max_num_seqs", GPU), "C", "safe max_num_seqs", "none"),
            (sel("model_local_kv_gpu_other_processes", GPU), "D", "other processes", "none"),
        ],
    )
    binding = merged_table(
        "Limit met first, per GPU",
        "Which limit the projected peak meets first: device (the GPU's memory) or worker (a worker's allocator cap, "
        "vLLM 0.34's extensible KV cache); the headroom and the alerts are to that limit.",
        [(f"{sel('model_local_kv_gpu_limit_binding', GPU)} == 1", "A", "binding", "none")],
    )
    went = graph(
        "Where the memory went, per engine",
        "The engine's own paged KV cache as its workers read it (vLLM's budget; an extensible cache's committed "
        "pages) beside the model-local KV its owners hold (observed), per engine and GPU; NVML's used above. Where "
        "torch's allocator is capped (vLLM 0.34) the worker's cap and headroom are model_local_kv_worker_* "
        "(docs/metrics.md).",
        "bytes",
        [
            query(sel("model_local_kv_engine_kv_cache_bytes", DECLARATION), f"engine KV cache · {WORKER_LEGEND}", "A"),
            query(
                f"sum by ({WORKER_KEY}) ({sel('model_local_kv_observed_bytes', DECLARATION)})",
                f"model-local observed · {WORKER_LEGEND}",
                "B",
            ),
        ],
    )
    return [memory.height(9).span(24), per_gpu.height(8).span(16), binding.height(8).span(8), went.height(9).span(24)]


def kv_row() -> list[Panel]:
    ceiling = by_owner(
        "Ceiling by owner / cache (rows at max_num_seqs)",
        "Declared model-local KV at max_num_seqs (rows_fixed for fixed-row caches), stacked per owner and cache.",
        "model_local_kv_ceiling_bytes",
    )
    estimate = by_owner(
        "Estimate by owner / cache (rows at the running count)",
        "Declared bytes at the sequences the engine runs now (its workers' latest step, capped at max_num_seqs), "
        "stacked per owner and cache.",
        "model_local_kv_estimated_bytes",
    )
    peak = by_owner(
        "Estimated peak by owner / cache (rows at the window's most)",
        "Declared bytes at the most sequences any step ran over the exporter's --running-window (the scrape "
        "interval): the peak between two scrapes, which a count at the scrape instant misses.",
        "model_local_kv_estimated_peak_bytes",
    )
    return [ceiling.height(9).span(8), estimate.height(9).span(8), peak.height(9).span(8)]


OBSERVED_KEY = "cluster, instance, namespace, pod, model_name, stage, engine, owner"
OBSERVED_LEGEND = "{{instance}} {{pod}} · {{model_name}} s{{stage}} e{{engine}} · {{owner}}"


def observed_row() -> list[Panel]:
    """What the caches really hold, per owner, beside what the owner declares."""
    held = f"sum by ({OBSERVED_KEY}) ({sel('model_local_kv_observed_bytes', DECLARATION)})"
    peak = f"sum by ({OBSERVED_KEY}) ({sel('model_local_kv_observed_peak_bytes', DECLARATION)})"
    ceiling = f"sum by ({OBSERVED_KEY}) ({sel('model_local_kv_ceiling_bytes', DECLARATION)})"
    beside = graph(
        "Observed (at the sample, peak) vs declared ceiling by owner",
        "What the owner's live model-local KV holds at each sample and the most it held between two samples "
        "(caches a step makes and frees included), each storage once, beside its declarations' ceiling at "
        "max_num_seqs. A peak above the ceiling: the declaration is low (see Unexplained).",
        "bytes",
        [
            query(held, f"observed · {OBSERVED_LEGEND}", "A"),
            query(peak, f"peak · {OBSERVED_LEGEND}", "C"),
            query(ceiling, f"ceiling · {OBSERVED_LEGEND}", "B"),
        ],
    ).override_by_regexp("^ceiling.*", DASHED)
    unexplained = graph(
        "Unexplained bytes by owner",
        "The observed peak beyond the owner's declared ceiling; all of an undeclared owner's peak. The shipped alert "
        "pages beyond 5 % of the ceiling (docs/alerts.md).",
        "bytes",
        [
            query(
                f"sum by ({OBSERVED_KEY}) ({sel('model_local_kv_unexplained_bytes', DECLARATION)})",
                OBSERVED_LEGEND,
                "A",
            )
        ],
    )
    state = merged_table(
        "Observation per engine",
        "Each engine's observation state (ok, off, unavailable, failing, stale, absent or rejected), those that are "
        "not ok first.",
        [(f"{on_gpus('model_local_kv_observation_state')} == 1", "A", "is", "none")],
        sort_by="state",
    )
    return [beside.height(9).span(12), unexplained.height(9).span(12), state.height(8).span(24)]


def on_gpus(metric: str) -> str:
    """A per-engine family (it has no `gpu` label) following the GPU selection: every engine but those whose
    declarations all sit on GPUs not selected. With All nothing is left out, and neither is an engine declaring
    nothing (no GPU to select it by: an engine that runs without manifests must stay visible)."""
    info = DECLARED
    elsewhere = f'{sel(info, ENGINE)[:-1]}, gpu!~"$gpu"}}'
    only_elsewhere = f"({elsewhere} unless on ({ENGINE_KEY}) {sel(info, DECLARATION)})"
    return f"{sel(metric, ENGINE)} unless on ({ENGINE_KEY}) {only_elsewhere}"


def engine_row() -> list[Panel]:
    running = graph(
        "Running sequences vs max_num_seqs",
        "What the engine's workers run (their latest step, from their step records; an older hook's engines: "
        "the engine's page at the scrape), the most any step ran over the exporter's --running-window, and the "
        "configured max_num_seqs.",
        "none",
        [
            query(on_gpus("model_local_kv_running_sequences"), f"running · {ENGINE_LEGEND}", "A"),
            query(on_gpus("model_local_kv_running_sequences_max"), f"most · {ENGINE_LEGEND}", "C"),
            query(on_gpus("model_local_kv_max_num_seqs"), f"max_num_seqs · {ENGINE_LEGEND}", "B"),
        ],
    ).override_by_regexp("^max_num_seqs.*", DASHED)
    engines = merged_table(
        "Engines: running count readable, manifests",
        "Per engine, those with a problem first: 1 when its running count is known (its workers' step records, else "
        "a metrics page); the valid manifests matched to it (0 for an engine on a page that no manifest declares).",
        [
            (on_gpus("model_local_kv_engine_up"), "A", "readable", "none"),
            (on_gpus(ENGINES), "B", "manifests", "none"),
        ],
        sort_by="readable",
    )
    steps = merged_table(
        "Step records per engine",
        "Where the workers' step records stand: stepping, idle, stalled (a step running for a minute), unreadable, "
        "torn (a writer died mid-write), invalid, absent (an older hook: the page's count).",
        [(f"{on_gpus('model_local_kv_running_state')} == 1", "A", "is", "none")],
        sort_by="state",
    )
    return [
        running.height(8).span(12),
        engines.height(8).span(12),
        steps.height(8).span(24),
    ]


def joined(metric: str) -> str:
    """`metric` carrying the declaration's text labels, so every table query has identical label sets."""
    info = sel(DECLARED, DECLARATION)
    return f"{sel(metric, DECLARATION)} * on ({DECL_KEY}) group_left ({DECL_INFO}) {info}"


def declaration_table() -> list[Panel]:
    columns = [
        ("model_local_kv_bytes_per_row", "A", "bytes / row"),
        ("model_local_kv_capacity_positions", "B", "positions"),
        ("model_local_kv_ceiling_bytes", "C", "ceiling"),
        ("model_local_kv_estimated_bytes", "D", "estimate"),
        ("model_local_kv_estimated_peak_bytes", "E", "estimated peak"),
    ]
    panel = (
        table.Panel()
        .title("Declarations")
        .description(
            "What each cache owner declared, per exporter (instance): geometry source (capacity_source), why its "
            "row count is what it is (rows_reason), and the bytes it implies."
        )
        .datasource(DATASOURCE)
        .unit("bytes")
        .show_header(True)
        .cell_height(common.TableCellHeight.SM)
    )
    for metric, ref, _ in columns:
        panel = panel.with_target(query(joined(metric), "", ref, instant=True).format(prom_model.PromQueryFormat.TABLE))
    hidden = {name: True for name in ("Time", "__name__", "job")}
    renames = {f"Value #{ref}": title for _, ref, title in columns}
    panel = panel.with_transformation(model.DataTransformerConfig(id_val="merge", options={})).with_transformation(
        model.DataTransformerConfig(id_val="organize", options={"excludeByName": hidden, "renameByName": renames})
    )
    positions = model.DynamicConfigValue(id_val="unit", value="none")
    return [panel.override_by_name("positions", [positions]).height(10).span(24)]


# `up` is in every scrape job: kept to the jobs (of each cluster) that run a kv-exporter, down ones included.
SCRAPED = (
    f"{sel('up', HOST)} and on (cluster, job) group by (cluster, job) (last_over_time({sel(EXPORTERS, HOST)}[1h]))"
)


def health_row() -> list[Panel]:
    return [
        merged_table(
            "Exporters",
            "Per kv-exporter, the down ones first: Prometheus' own up series for its scrape, 1 when it can query "
            "NVML, and its version (model_local_kv_exporter_build_info).",
            [
                (SCRAPED, "A", "scraped", "none"),
                (sel("model_local_kv_nvml_up", HOST), "B", "NVML", "none"),
                (sel(EXPORTERS, HOST), "C", "build", "none"),
            ],
            sort_by="scraped",
        )
        .height(8)
        .span(12),
        merged_table(
            "Engine pages",
            "Per configured engine page, the unreadable ones first: 1 when the exporter read it.",
            [(sel("model_local_kv_engine_page_up", HOST), "A", "page read", "none")],
            sort_by="page read",
        )
        .height(8)
        .span(12),
        graph(
            "Manifests by state",
            "live: counted; stale: writer gone; invalid: rejected.",
            "none",
            [
                query(
                    f"sum by (instance, state) ({sel('model_local_kv_manifests', HOST)})",
                    "{{instance}} · {{state}}",
                    "A",
                )
            ],
        )
        .height(7)
        .span(8),
        graph(
            "Manifest errors by reason",
            "Rejected manifest reads per reason (model_local_kv_manifest_errors_total).",
            "none",
            [
                query(
                    "sum by (instance, reason) "
                    f"(increase({sel('model_local_kv_manifest_errors_total', HOST)}[$__rate_interval]))",
                    "{{instance}} · {{reason}}",
                    "A",
                )
            ],
        )
        .height(7)
        .span(8),
        graph(
            "Scrape duration",
            "Time the exporter spent building one scrape.",
            "s",
            [query(sel("model_local_kv_scrape_duration_seconds", HOST), "{{instance}}", "A")],
        )
        .height(7)
        .span(8),
    ]


SECTIONS: list[tuple[str, Callable[[], list[Panel]]]] = [
    ("Fleet", fleet_row),
    ("GPU memory", gpu_row),
    ("Model-local KV by owner and cache", kv_row),
    ("Observed beside declared", observed_row),
    ("Engines", engine_row),
    ("Declarations", declaration_table),
    ("Exporter health", health_row),
]

# vLLM's own dashboards carry the tag `vllm`. Variables are not passed along: model_name and engine would match
# there, but job and instance name kv-exporter's sidecars, not the engines.
VLLM_DASHBOARDS = (
    dash.DashboardLink("vLLM dashboards")
    .type(model.DashboardLinkType.DASHBOARDS)
    .tags(["vllm"])
    .as_dropdown(True)
    .include_vars(False)
    .keep_time(True)
)


def build() -> dash.Dashboard:
    board = (
        dash.Dashboard(TITLE)
        .uid(UID)
        .description("Attention KV that vllm-omni models keep outside vLLM's paged KV manager (kv-exporter).")
        .tags(["kv-exporter", "vllm"])
        .link(VLLM_DASHBOARDS)
        .readonly()  # provisioned from this file (dashboard-linter's uneditable-dashboard)
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
    )
    for variable in variables():
        board = board.with_variable(variable)
    panel_id = 0
    for title, section in SECTIONS:
        panel_id += 1
        board = board.with_row(dash.Row(title).id(panel_id))
        for panel in section():
            panel_id += 1
            board = board.with_panel(panel.id(panel_id))
    return board


# Written by the SDK's Grafana 10.1 models, dropped by Grafana since: the dashboard's `style`, a variable `id`
# (not part of the variable model), and the interval-variable fields `auto*` on query and data-source variables.
SDK_LEFTOVERS = {"dashboard": ("style",), "variable": ("id", "auto", "auto_count", "auto_min")}


def dashboard() -> dict[str, Any]:
    """The dashboard as the JSON object Grafana's file provisioning loads."""
    encoded: dict[str, Any] = json.loads(json.dumps(build().build(), cls=JSONEncoder))
    for key in SDK_LEFTOVERS["dashboard"]:
        encoded.pop(key, None)
    for variable in encoded["templating"]["list"]:
        for key in SDK_LEFTOVERS["variable"]:
            variable.pop(key, None)
    encoded["schemaVersion"] = SCHEMA_VERSION
    encoded["__inputs"] = [
        {
            "name": DS_INPUT,
            "label": "Prometheus",
            "description": "The Prometheus that scrapes the kv-exporter sidecars (the data source variable's default)",
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }
    ]
    encoded["__requires"] = [
        {"type": "grafana", "id": "grafana", "name": "Grafana", "version": GRAFANA_VERSION},
        {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        *(
            {"type": "panel", "id": kind, "name": kind.capitalize(), "version": ""}
            for kind in sorted({panel["type"] for panel in encoded["panels"] if panel["type"] != "row"})
        ),
    ]
    return encoded


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
