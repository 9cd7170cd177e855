"""The kv-exporter Grafana dashboard, built with grafana-foundation-sdk.

`python deploy/generate.py` writes it to dashboards/kv-exporter.json (and the Kubernetes copy); the tests check
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

UID = "kv-exporter"
TITLE = "kv-exporter: model-local KV"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
# The scrape job the alerts and the dashboard agree on (deploy/prometheus/kv-exporter.rules.yml).
EXPORTER_JOB = 'job="kv-exporter"'

ENGINE = 'model_name=~"$model", stage=~"$stage"'
DECL = 'model_name=~"$model", stage=~"$stage", gpu=~"$gpu"'
GPU = 'gpu=~"$gpu"'
# Labels that identify one declaration series (CONTRACTS.md), used to join the info metric's text labels.
DECL_KEY = "job, instance, model_name, stage, engine, owner, cache, scope, driver, gpu, UUID"
DECL_INFO = "dtype, capacity_source, rows_fixed, rows_reason, allocation_note"

Panel = Any  # an SDK panel builder (timeseries.Panel, stat.Panel, table.Panel)


def query(expr: str, legend: str, ref: str, *, instant: bool = False) -> prom.Dataquery:
    q = prom.Dataquery().expr(expr).legend_format(legend).ref_id(ref)
    return q.instant() if instant else q.range()


def label_variable(name: str, label: str, query_text: str, help_text: str) -> dash.QueryVariable:
    return (
        dash.QueryVariable(name)
        .id(name)
        .label(label)
        .description(help_text)
        .datasource(DATASOURCE)
        .query(query_text)
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(model.VariableOption(selected=True, text="All", value="$__all"))
    )


def variables() -> list[Any]:
    return [
        dash.DatasourceVariable("datasource").id("datasource").label("Data source").type("prometheus"),
        label_variable(
            "model", "Model", "label_values(model_local_kv_max_num_seqs, model_name)", "vLLM's served model name"
        ),
        label_variable(
            "stage",
            "Stage",
            'label_values(model_local_kv_max_num_seqs{model_name=~"$model"}, stage)',
            "vllm-omni stage id (0 for plain vLLM)",
        ),
        label_variable(
            "gpu", "GPU", "label_values(model_local_kv_gpu_memory_total_bytes, gpu)", "GPU index as NVML reports it"
        ),
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


def stacked(title: str, description: str, expr: str) -> timeseries.Panel:
    return (
        graph(title, description, "bytes", [query(expr, "{{model_name}} s{{stage}} {{owner}} / {{cache}}", "A")])
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


def gpu_row() -> list[Panel]:
    memory = graph(
        "GPU memory: used, projected peak, total",
        "Used is NVML's figure now. Projected peak adds every live declaration's ceiling minus its estimate: "
        "the memory the GPU needs once each running engine reaches max_num_seqs.",
        "bytes",
        [
            query(f"model_local_kv_gpu_memory_used_bytes{{{GPU}}}", "used · GPU {{gpu}} {{instance}}", "A"),
            query(
                f"model_local_kv_gpu_projected_peak_bytes{{{GPU}}}",
                "projected peak · GPU {{gpu}} {{instance}}",
                "B",
            ),
            query(f"model_local_kv_gpu_memory_total_bytes{{{GPU}}}", "total · GPU {{gpu}} {{instance}}", "C"),
        ],
    ).override_by_regexp(
        "^total.*", [model.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})]
    )
    headroom = single(
        "Headroom at the projected peak",
        "Total minus projected peak; negative means the GPU cannot hold the declared KV at max_num_seqs.",
        "bytes",
        f"model_local_kv_gpu_headroom_bytes{{{GPU}}}",
        "GPU {{gpu}} {{instance}}",
    ).thresholds(thresholds((None, "red"), (0, "orange"), (8 * 2**30, "green")))
    ratio = single(
        "Projected peak / total",
        "Share of the GPU's memory the projected peak takes.",
        "percentunit",
        f"model_local_kv_gpu_projected_peak_bytes{{{GPU}}} / model_local_kv_gpu_memory_total_bytes{{{GPU}}}",
        "GPU {{gpu}} {{instance}}",
    ).thresholds(thresholds((None, "green"), (0.9, "orange"), (1, "red")))
    safe = single(
        "Safe max_num_seqs",
        "Largest max_num_seqs whose projected peak still fits on the GPU.",
        "none",
        f"model_local_kv_gpu_safe_max_num_seqs{{{GPU}}}",
        "GPU {{gpu}} {{instance}}",
    ).thresholds(thresholds((None, "blue")))
    return [memory.height(9).span(24), headroom.height(5).span(8), ratio.height(5).span(8), safe.height(5).span(8)]


def kv_row() -> list[Panel]:
    ceiling = stacked(
        "Ceiling by owner / cache (rows at max_num_seqs)",
        "Declared model-local KV at max_num_seqs (rows_fixed for fixed-row caches), stacked per owner and cache.",
        f"sum by (model_name, stage, owner, cache) (model_local_kv_ceiling_bytes{{{DECL}}})",
    )
    estimate = stacked(
        "Estimate by owner / cache (rows at the running count)",
        "Declared bytes at the live running count (capped at max_num_seqs), stacked per owner and cache.",
        f"sum by (model_name, stage, owner, cache) (model_local_kv_estimated_bytes{{{DECL}}})",
    )
    return [ceiling.height(9).span(12), estimate.height(9).span(12)]


def engine_row() -> list[Panel]:
    running = graph(
        "Running sequences vs max_num_seqs",
        "The engine's running count as read from its metrics page, against its configured max_num_seqs.",
        "none",
        [
            query(
                f"model_local_kv_running_sequences{{{ENGINE}}}",
                "running · {{model_name}} s{{stage}} e{{engine}}",
                "A",
            ),
            query(
                f"model_local_kv_max_num_seqs{{{ENGINE}}}",
                "max_num_seqs · {{model_name}} s{{stage}} e{{engine}}",
                "B",
            ),
        ],
    ).override_by_regexp(
        "^max_num_seqs.*",
        [model.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})],
    )
    engine_up = up_stat(
        "Engine running count readable",
        "1 when a metrics page reports this engine's running count.",
        f"model_local_kv_engine_up{{{ENGINE}}}",
        "{{model_name}} s{{stage}} e{{engine}}",
    )
    manifests = single(
        "Manifests per engine",
        "Valid manifests matched to the engine; 0 for an engine on a page that no manifest declares.",
        "none",
        f"model_local_kv_engine_manifests{{{ENGINE}}}",
        "{{model_name}} s{{stage}} e{{engine}}",
    ).thresholds(thresholds((None, "red"), (1, "green")))
    return [running.height(8).span(12), engine_up.height(8).span(6), manifests.height(8).span(6)]


def joined(metric: str) -> str:
    """`metric` carrying the declaration's text labels, so every table query has identical label sets."""
    return f"{metric}{{{DECL}}} * on ({DECL_KEY}) group_left ({DECL_INFO}) model_local_kv_declaration_info{{{DECL}}}"


def declaration_table() -> list[Panel]:
    columns = [
        ("model_local_kv_bytes_per_row", "A", "bytes / row"),
        ("model_local_kv_capacity_positions", "B", "positions"),
        ("model_local_kv_ceiling_bytes", "C", "ceiling"),
        ("model_local_kv_estimated_bytes", "D", "estimate"),
    ]
    panel = (
        table.Panel()
        .title("Declarations")
        .description(
            "What each cache owner declared: geometry source (capacity_source), why its row count is what it "
            "is (rows_reason), and the bytes it implies."
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
            "Prometheus' own up series for the kv-exporter job.",
            f"up{{{EXPORTER_JOB}}}",
            "{{instance}}",
        )
        .height(4)
        .span(6),
        up_stat("NVML", "1 when the exporter can query NVML.", "model_local_kv_nvml_up", "{{instance}}")
        .height(4)
        .span(6),
        up_stat(
            "Engine pages",
            "1 when the exporter read the engine metrics page.",
            "model_local_kv_engine_page_up",
            "{{target}}",
        )
        .height(4)
        .span(6),
        single(
            "Exporter version",
            "model_local_kv_exporter_build_info",
            "none",
            "model_local_kv_exporter_build_info",
            "{{version}} {{instance}}",
        )
        .text_mode(common.BigValueTextMode.NAME)
        .thresholds(thresholds((None, "blue")))
        .height(4)
        .span(6),
        graph(
            "Manifests by state",
            "live: counted; stale: writer gone; invalid: rejected.",
            "none",
            [query("sum by (state) (model_local_kv_manifests)", "{{state}}", "A")],
        )
        .height(7)
        .span(8),
        graph(
            "Manifest errors by reason",
            "Rejected manifest reads per reason (model_local_kv_manifest_errors_total).",
            "none",
            [
                query(
                    "sum by (reason) (increase(model_local_kv_manifest_errors_total[$__rate_interval]))",
                    "{{reason}}",
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
            [query("model_local_kv_scrape_duration_seconds", "{{instance}}", "A")],
        )
        .height(7)
        .span(8),
    ]


SECTIONS: list[tuple[str, Callable[[], list[Panel]]]] = [
    ("GPU memory", gpu_row),
    ("Model-local KV by owner and cache", kv_row),
    ("Engines", engine_row),
    ("Declarations", declaration_table),
    ("Exporter health", health_row),
]


def build() -> dash.Dashboard:
    board = (
        dash.Dashboard(TITLE)
        .uid(UID)
        .description("Attention KV that vllm-omni models keep outside vLLM's paged KV manager (kv-exporter).")
        .tags(["kv-exporter", "vllm"])
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


def dashboard() -> dict[str, Any]:
    """The dashboard as the JSON object Grafana's file provisioning loads."""
    encoded: dict[str, Any] = json.loads(json.dumps(build().build(), cls=JSONEncoder))
    return encoded


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
