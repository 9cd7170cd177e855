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

from kv_exporter.sidecar.thresholds import HEADROOM_ALERT_FRACTION

UID = "kv-exporter"
TITLE = "kv-exporter: model-local KV"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
# What Grafana 11.0-11.3 write (the compose stack runs 11.3; vLLM's own dashboards use it too). The SDK flavour in
# requirements-dev.txt targets Grafana 10.1 (schema 36); the migrations from 36 to 39 touch nothing this dashboard
# uses (tests/deploy/test_dashboard.py checks the fields they rewrite are absent).
SCHEMA_VERSION = 39

# Variables are named after the labels they filter (as in vLLM's dashboards), so a query's filter for a scope
# is one matcher per label. A scope lists the variables that apply to a family's labels.
Scope = tuple[str, ...]
HOST: Scope = ("job", "instance")
GPU: Scope = (*HOST, "gpu")
# The worker's pod: two pods of one model on one node (the DaemonSet layout) are two engines to the panels.
ENGINE: Scope = (*HOST, "namespace", "pod", "model_name", "stage", "engine")
DECLARATION: Scope = (*ENGINE, "gpu")
# Labels that identify one engine, and one declaration series (CONTRACTS.md), for `on (...)` matches.
ENGINE_KEY = "job, instance, namespace, pod, model_name, stage, engine"
DECL_KEY = "job, instance, namespace, pod, container, model_name, stage, engine, owner, cache, scope, driver, gpu, UUID"
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
    # All as `.*` keeps series whose label is empty (a declaration on no known GPU). Not for `job`: the health
    # row reads `up`, which every scrape job has, so All there must mean the jobs that run kv-exporter (Grafana's
    # default: the variable's values, joined).
    return variable if name == "job" else variable.all_value(".*")


# Every exporter exports its build info, and every engine it knows has a manifest count (0 when undeclared).
EXPORTERS = "model_local_kv_exporter_build_info"
ENGINES = "model_local_kv_engine_manifests"
# Every worker's pod is on its declarations: an engine's own series carry only its first rank's (two pods of one
# model on one node are one engine to the exporter, two pods here).
DECLARED = "model_local_kv_declaration_info"


def variables() -> list[Any]:
    return [
        dash.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        chained("job", "Job", EXPORTERS, (), "Prometheus scrape job of the kv-exporter sidecars"),
        chained("instance", "Instance", EXPORTERS, ("job",), "A kv-exporter sidecar (host:port Prometheus scrapes)"),
        chained("namespace", "Namespace", DECLARED, HOST, "Kubernetes namespace of the engine's pod"),
        chained("pod", "Pod", DECLARED, (*HOST, "namespace"), "The engine's pod (kube-state-metrics' pod label)"),
        chained("model_name", "Model", ENGINES, ENGINE[:4], "vLLM's served model name"),
        chained("stage", "Stage", ENGINES, ENGINE[:5], "vllm-omni stage id (0 for plain vLLM)"),
        chained(
            "engine",
            "Engine",
            ENGINES,
            ENGINE[:6],
            "vLLM's data-parallel engine index (vllm-omni's replica)",
        ),
        chained("gpu", "GPU", "model_local_kv_gpu_memory_total_bytes", HOST, "GPU index as NVML reports it"),
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


OWNER_KEY = "instance, namespace, pod, model_name, stage, engine, owner, cache"
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


UP_DOWN = [
    model.ValueMap(
        options={
            "0": model.ValueMappingResult(text="DOWN", color="red"),
            "1": model.ValueMappingResult(text="UP", color="green"),
        }
    )
]


def up_stat(title: str, description: str, expr: str, legend: str) -> stat.Panel:
    return (
        single(title, description, "none", expr, legend)
        .mappings(UP_DOWN)
        .thresholds(thresholds((None, "red"), (1, "green")))
    )


GPU_LEGEND = "{{instance}} · GPU {{gpu}}"
ENGINE_LEGEND = "{{instance}} {{pod}} · {{model_name}} s{{stage}} e{{engine}}"
DASHED = [model.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})]


def gpu_row() -> list[Panel]:
    memory = graph(
        "GPU memory: used, projected peak, total",
        "Used is NVML's figure now. Projected peak adds every live declaration's ceiling minus its estimate: "
        "the memory the GPU needs once each running engine reaches max_num_seqs.",
        "bytes",
        [
            query(sel("model_local_kv_gpu_memory_used_bytes", GPU), f"used · {GPU_LEGEND}", "A"),
            query(sel("model_local_kv_gpu_projected_peak_bytes", GPU), f"projected peak · {GPU_LEGEND}", "B"),
            query(sel("model_local_kv_gpu_memory_total_bytes", GPU), f"total · {GPU_LEGEND}", "C"),
        ],
    ).override_by_regexp("^total.*", DASHED)
    share = single(
        "Headroom at the projected peak, share of total",
        "(Total - projected peak) / total. Colours as the shipped alerts: red below 0 "
        f"(ModelLocalKVProjectedPeakAboveGPUMemory), orange below {HEADROOM_ALERT_FRACTION:.0%} "
        "(ModelLocalKVHeadroomLow, shipped default; an override in your own rule file is not reflected here).",
        "percentunit",
        f"{sel('model_local_kv_gpu_headroom_bytes', GPU)} / {sel('model_local_kv_gpu_memory_total_bytes', GPU)}",
        GPU_LEGEND,
    ).thresholds(thresholds((None, "red"), (0, "orange"), (HEADROOM_ALERT_FRACTION, "green")))
    headroom = single(
        "Headroom at the projected peak",
        "Total minus projected peak; negative means the GPU cannot hold the declared KV at max_num_seqs.",
        "bytes",
        sel("model_local_kv_gpu_headroom_bytes", GPU),
        GPU_LEGEND,
    ).thresholds(thresholds((None, "blue")))
    safe = single(
        "Safe max_num_seqs",
        "Largest max_num_seqs whose projected peak still fits on the GPU.",
        "none",
        sel("model_local_kv_gpu_safe_max_num_seqs", GPU),
        GPU_LEGEND,
    ).thresholds(thresholds((None, "blue")))
    return [memory.height(9).span(24), share.height(5).span(8), headroom.height(5).span(8), safe.height(5).span(8)]


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


OBSERVED_KEY = "instance, namespace, pod, model_name, stage, engine, owner"
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
    state = single(
        "Observation per engine",
        "The engine's observation state: ok, off, unavailable, failing, stale, absent or rejected.",
        "none",
        f"{on_gpus('model_local_kv_observation_state')} == 1",
        f"{ENGINE_LEGEND} · {{{{state}}}}",
    )
    return [beside.height(9).span(12), unexplained.height(9).span(12), state.height(5).span(24)]


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
    engine_up = up_stat(
        "Engine running count readable",
        "1 when the engine's running count is known: its workers' step records, else a metrics page.",
        on_gpus("model_local_kv_engine_up"),
        ENGINE_LEGEND,
    )
    steps = single(
        "Step records per engine",
        "Where the workers' step records stand: stepping, idle, stalled (a step running for a minute), unreadable, "
        "torn (a writer died mid-write), invalid, absent (an older hook: the page's count).",
        "none",
        f"{on_gpus('model_local_kv_running_state')} == 1",
        f"{ENGINE_LEGEND} · {{{{state}}}}",
    )
    difference = graph(
        "Engine page's running count less the workers'",
        "The cross-check with --engine-url: vLLM's page, read at the scrape, less the workers' latest step. Never "
        "used in an estimate; vLLM's page lags and answers late under load.",
        "none",
        [query(on_gpus("model_local_kv_running_sequences_page_difference"), ENGINE_LEGEND, "A")],
    )
    manifests = single(
        "Manifests per engine",
        "Valid manifests matched to the engine; 0 for an engine on a page that no manifest declares.",
        "none",
        on_gpus(ENGINES),
        ENGINE_LEGEND,
    ).thresholds(thresholds((None, "red"), (1, "green")))
    return [
        running.height(8).span(12),
        engine_up.height(8).span(6),
        manifests.height(8).span(6),
        steps.height(5).span(12),
        difference.height(5).span(12),
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


def health_row() -> list[Panel]:
    return [
        up_stat(
            "Exporter scraped",
            "Prometheus' own up series for the kv-exporter scrape jobs.",
            sel("up", HOST),
            "{{instance}}",
        )
        .height(4)
        .span(6),
        up_stat("NVML", "1 when the exporter can query NVML.", sel("model_local_kv_nvml_up", HOST), "{{instance}}")
        .height(4)
        .span(6),
        up_stat(
            "Engine pages",
            "1 when the exporter read the engine metrics page.",
            sel("model_local_kv_engine_page_up", HOST),
            "{{instance}} · {{target}}",
        )
        .height(4)
        .span(6),
        single(
            "Exporter version",
            "model_local_kv_exporter_build_info",
            "none",
            sel(EXPORTERS, HOST),
            "{{instance}} · {{version}}",
        )
        .text_mode(common.BigValueTextMode.NAME)
        .thresholds(thresholds((None, "blue")))
        .height(4)
        .span(6),
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
        .editable()
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
    return encoded


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
