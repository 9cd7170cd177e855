"""The landing page at /: what a person checks first. Plain HTML and CSS, no script, no external resources.

Every text that comes from a manifest or an engine page is escaped: those are written by other processes. Per GPU a
bar shows used memory, the growth the declarations still allow and the headroom left, coloured as the shipped
alerts would judge it (`thresholds`); tables wrap rather than run off a 1280 px screen.
"""

from __future__ import annotations

import html
import os
import time
from collections.abc import Iterable, Sequence

from kv_exporter import __version__
from kv_exporter.printable import printable
from kv_exporter.sidecar.limits import BINDING_DEVICE
from kv_exporter.sidecar.observed import EngineObservation, ObservedState, OwnerView
from kv_exporter.sidecar.records import ManifestEntry
from kv_exporter.sidecar.running import RunningState
from kv_exporter.sidecar.snapshot import DeclarationView, EngineView, GpuView, Snapshot
from kv_exporter.sidecar.thresholds import (
    HEADROOM_MARGIN_FRACTION,
    UNEXPLAINED_ALERT_FRACTION,
    HeadroomState,
    exceeds_declaration,
    headroom_margin,
    headroom_state,
)
from kv_exporter.sidecar.units import human_bytes

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #1b1b1b; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; } h3 { font-size: 1em; margin: 0 0 .4em; }
table { border-collapse: collapse; margin: .4em 0; max-width: 100%; }
th, td { border: 1px solid #c8c8c8; padding: .25em .6em; text-align: left; vertical-align: top; }
td { overflow-wrap: anywhere; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
th { white-space: nowrap; background: #f0f0f0; }
small, .sub { display: block; color: #555; font-size: .85em; }
.ok { color: #1d6b1d; } .low { color: #8a5300; font-weight: bold; } .over, .bad { color: #a40000; font-weight: bold; }
.simulated { background: #fff3c4; padding: .1em .4em; border-radius: .2em; }
.note { color: #555; max-width: 60em; }
.gpu { max-width: 70em; margin: .8em 0 1.4em; }
.bar { position: relative; display: flex; height: 1.8em; margin: .5em 0 .3em; border: 1px solid #777;
       background: #fff; }
.seg { height: 100%; }
.used { background: #5f6b7a; } .growth { background: #4a78c2; }
.beyond { background: repeating-linear-gradient(45deg, #6a3fa0 0 6px, #a98bd1 6px 12px); }
.headroom.ok { background: #2e7d32; } .headroom.low { background: #e0a100; }
.overflow { background: repeating-linear-gradient(45deg, #b71c1c 0 6px, #e57373 6px 12px); }
.marker, .total { position: absolute; top: -.4em; bottom: -.4em; }
.marker { border-left: 2px dashed #111; } .total { border-left: 3px solid #111; }
.legend { list-style: none; padding: 0; margin: .3em 0; display: flex; flex-wrap: wrap; gap: .3em 1.4em; }
.swatch { display: inline-block; width: .9em; height: .9em; margin-right: .35em; vertical-align: -.1em; }
.swatch.marker, .swatch.total { position: static; width: 0; height: 1em; margin: 0 .5em 0 .3em; }
.state { padding: .1em .5em; border-radius: .2em; color: #fff; font-weight: bold; }
.state.ok { background: #2e7d32; } .state.low { background: #8a5300; } .state.over { background: #a40000; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _bytes(value: int, css: str = "") -> str:
    return f'<td class="num {css}" title="{value} B">{_e(human_bytes(value))}</td>'


def _num(value: object) -> str:
    return f'<td class="num">{_e(value)}</td>'


def _cell(value: object, css: str = "") -> str:
    return f'<td class="{css}">{_e(value)}</td>' if css else f"<td>{_e(value)}</td>"


def _table(caption_id: str, headers: Sequence[str], rows: Iterable[str]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(f"<tr>{row}</tr>" for row in rows)
    return f'<table id="{caption_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _gpu_row(view: GpuView) -> str:
    source = view.source if view.source != "simulated" else "SIMULATED"
    css = "simulated" if view.source == "simulated" else ""
    safe = "-" if view.safe_max_num_seqs is None else view.safe_max_num_seqs
    headroom_css = headroom_state(view.headroom, view.declared_ceiling).value
    return (
        _num(view.memory.index)
        + f'<td><span class="{css}">{_e(source)}</span></td>'
        + _bytes(view.memory.total)
        + _bytes(view.memory.used)
        + _bytes(view.projected_peak)
        + f'<td class="num {headroom_css}" title="{view.headroom} B">{_e(human_bytes(view.headroom))}</td>'
        + _num(safe)
    )


_ALERTS = {
    HeadroomState.OK: "no alert",
    HeadroomState.LOW: "ModelLocalKVHeadroomLow",
    HeadroomState.OVER: "ModelLocalKVProjectedPeakAboveGPUMemory",
}


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.3f}%"


def _item(swatch: str, text: str) -> str:
    return f'<li><span class="swatch {swatch}"></span>{_e(text)}</li>'


def _limit_name(view: GpuView) -> str:
    """What the bar ends at: the device's total, or the binding worker cap in the device's terms."""
    return "total" if view.binding == BINDING_DEVICE else "worker allocator cap"


def _gpu_bar(view: GpuView) -> str:
    """used now | growth the declarations still allow | headroom to the binding limit, on a scale that also fits an
    overflow."""
    total, used, peak, limit = view.memory.total, view.memory.occupied, view.projected_peak, view.limit
    state = headroom_state(view.headroom, view.declared_ceiling)
    over = state is HeadroomState.OVER
    scale = max(total, peak, 1)
    beyond = view.unexplained_growth  # the growth observation adds: after the declared growth, within the limit
    declared = peak - used - beyond
    last = ("overflow", peak - limit) if over else (f"headroom {state.value}", limit - peak)
    shown_declared = min(declared, limit - used)
    beyond_segment = [("beyond", min(beyond, limit - used - shown_declared))] if beyond else []
    segments = [("used", used), ("growth", shown_declared), *beyond_segment, last]
    bar = "".join(f'<div class="seg {css}" style="width:{_share(max(0, b), scale)}"></div>' for css, b in segments)
    threshold = round(limit - headroom_margin(view.declared_ceiling))
    bar += f'<div class="marker" style="left:{_share(threshold, scale)}" title="alert threshold"></div>'
    if over or limit < total:
        bar += f'<div class="total" style="left:{_share(limit, scale)}" title="{_e(_limit_name(view))}"></div>'
    share = f" ({view.headroom / total:.1%} of total)" if total > 0 else ""
    legend = (
        _item("used", f"used now {human_bytes(used)}")
        + _item("growth", f"growth the declarations still allow {human_bytes(declared)}")
        + (
            _item("beyond", f"growth beyond the declarations (observed, per running sequence) {human_bytes(beyond)}")
            if beyond
            else ""
        )
        + (_item("total", f"{_limit_name(view)} {human_bytes(limit)}") if over or limit < total else "")
        + (
            _item("overflow", f"over {_limit_name(view)} by {human_bytes(peak - limit)}")
            if over
            else _item(f"headroom {state.value}", f"headroom {human_bytes(view.headroom)}{share}")
        )
        + _item(
            "marker",
            f"alert below {HEADROOM_MARGIN_FRACTION:.0%} of the declared ceiling (shipped default; an override in "
            "your Prometheus rules is not visible here)",
        )
    )
    title = f"GPU {_e(view.memory.index)} · {_e(view.memory.name)} · {_e(view.memory.uuid)}"
    badge = f'<span class="state {state.value}">{_e(_ALERTS[state])}</span>'
    return (
        f'<div class="gpu" id="gpu-{_e(view.memory.index)}" data-state="{state.value}"><h3>{title} {badge}</h3>'
        f'<div class="bar">{bar}</div><ul class="legend">{legend}</ul></div>'
    )


def _gpu_section(snapshot: Snapshot) -> str:
    gpu = snapshot.gpu
    if not gpu.enabled:
        status = "<p>GPU reading is disabled (<code>--no-nvml</code>): no per-GPU projection.</p>"
    elif gpu.error is not None:
        status = f'<p class="bad">GPU reader ({_e(gpu.source)}) unavailable: {_e(gpu.error)}</p>'
    else:
        status = ""
    headers = (  # name and UUID head each GPU's bar
        "gpu",
        "source",
        "total",
        "used",
        "projected peak",
        "headroom",
        "safe max_num_seqs",
    )
    projected = [v for v in snapshot.gpus if v.projected]
    bars = "".join(_gpu_bar(v) for v in projected)
    table = _table("gpus", headers, (_gpu_row(v) for v in projected)) if projected else ""
    bars += "".join(
        f'<p class="note">GPU {_e(v.memory.index)} ({_e(v.memory.uuid)}): {v.other_processes} compute process(es) '
        "that no manifest here accounts for share it, so it is not projected here: engines of several pods on one "
        "GPU are the node-wide exporter's (docs/deploy.md).</p>"
        for v in snapshot.gpus
        if not v.projected
    )
    note = (
        '<p class="note">projected peak = used + the sum over the GPU\'s live declarations of (ceiling - '
        "estimate) - what their owners already hold beyond the estimate (in used already) + the growth of bytes "
        "no declaration explains; headroom = the limit met first (the GPU's total, or a worker's allocator cap) - "
        "projected peak. Colours as the shipped alerts judge it: red, projected peak past that limit; amber, headroom "
        f"below {HEADROOM_MARGIN_FRACTION:.0%} of the GPU's declared ceiling (shipped default).</p>"
    )
    return f"<h2>GPUs</h2>{status}{bars}{table}{note}"


def _engine_row(view: EngineView, observation: EngineObservation | None) -> str:
    running = "?" if view.running is None else view.running
    limit = "?" if view.max_num_seqs is None else view.max_num_seqs
    up = '<td class="ok">up</td>' if view.up else '<td class="bad">unreadable</td>'
    most = "" if view.most is None else f"most {view.most} over the window"
    difference = "" if view.page_difference is None else f"page {view.page_difference:+d}"
    return (
        _with_sub(view.key.model_name, f"stage {view.key.stage} · engine {view.key.engine}", "engine")
        + up
        + f'<td class="num">{_e(f"{running} / {limit}")}<span class="sub">{_e(most)}</span></td>'
        + _num(view.manifests)
        + _steps_cell(view)
        + _observation_cell(observation)
        + _with_sub(view.target or "", difference)
    )


def _steps_cell(view: EngineView) -> str:
    if not view.manifests:
        return _cell("-")
    css = {RunningState.STEPPING: "ok", RunningState.IDLE: "ok", RunningState.ABSENT: ""}.get(view.state, "bad")
    return _cell(view.state.value, css)


def _observation_cell(observation: EngineObservation | None) -> str:
    if observation is None:
        return _cell("-")
    css = {ObservedState.OK: "ok", ObservedState.OFF: ""}.get(observation.state, "bad")
    age = "" if observation.age_s is None else f'<span class="sub">{_e(f"{observation.age_s:.0f} s ago")}</span>'
    return f'<td class="{css}">{_e(observation.state.value)}{age}</td>'


def _engine_section(snapshot: Snapshot) -> str:
    engines, pages = snapshot.engines, snapshot.pages
    observed = {o.key: o for o in snapshot.observed.engines}
    headers = ("model", "count", "running / max_num_seqs", "manifests", "step record", "observation", "read from")
    rows = (_engine_row(v, observed.get(v.key)) for v in engines)
    table = _table("engines", headers, rows) if engines else "<p>No engines.</p>"
    page_rows = (
        _cell(p.target)
        + (_cell("up", "ok") if p.page is not None else _cell(f"down: {p.error}", "bad"))
        + _num(f"{p.seconds * 1000:.1f} ms")
        for p in pages
    )
    page_table = _table("pages", ("engine page", "state", "waited for"), page_rows) if pages else ""
    note = (
        '<p class="note">running: what the engine\'s workers run now, from their step records (read from '
        '"workers"); most: the most any step ran over <code>--running-window</code>; an engine whose workers keep '
        "no step record (step record absent: an older hook) is read from its engine page, where one is configured "
        "(<code>--engine-url</code>), which also shows how far the page is from the workers (page +n).</p>"
    )
    return f"<h2>Engines</h2>{table}{page_table}{note}"


def _with_sub(main: object, sub: object, css: str = "") -> str:
    """A cell with a second, smaller line (secondary facts wrap under the main one instead of widening the table)."""
    return f'<td class="{css}">{_e(main)}<span class="sub">{_e(sub)}</span></td>'


def _bytes_rows(value: int, rows: int) -> str:
    return f'<td class="num" title="{value} B">{_e(human_bytes(value))}<span class="sub">{_e(rows)} rows</span></td>'


def _declaration_row(view: DeclarationView) -> str:
    placed, d = view.placed, view.declaration
    return (
        _with_sub(view.model_name, f"stage {placed.engine.stage} · engine {placed.engine.engine}", "engine")
        + _with_sub(d.name, d.owner, "cache")
        + _with_sub(d.rows.value, d.scope.value, "rows")
        + _num(placed.placement.gpu)
        + _bytes(d.bytes_per_row)
        + _bytes_rows(view.ceiling_bytes, placed.ceiling_rows)
        + _bytes_rows(view.estimate_bytes, view.estimate_rows)
        + (_bytes(view.peak_bytes) if view.peak_bytes is not None else _cell("-"))
    )


def _declaration_section(views: Sequence[DeclarationView]) -> str:
    headers = ("model", "cache / owner", "rows from / scope", "gpu", "per row", "ceiling", "estimate", "peak")
    if not views:
        return "<h2>Declarations</h2><p>No live declarations.</p>"
    note = (
        '<p class="note">ceiling: rows at max_num_seqs (or the fixed rows); estimate: rows at the running count; '
        "peak: rows at the most any step ran over the window (where the workers keep a step record).</p>"
    )
    return "<h2>Declarations</h2>" + _table("declarations", headers, (_declaration_row(v) for v in views)) + note


def _owner_row(view: OwnerView) -> str:
    declared = _bytes(view.ceiling_bytes) if view.declares else '<td class="num bad">declares nothing</td>'
    return (
        _with_sub(view.key.model_name, f"stage {view.key.stage} · engine {view.key.engine}", "engine")
        + _cell(view.owner)
        + _num(view.placement.gpu)
        + declared
        + _bytes(view.observed_bytes)
        + (_bytes(view.peak_bytes) if view.peak_followed else '<td class="num">not followed</td>')
        + _bytes(view.unexplained_bytes, _unexplained_css(view))
        + _num(view.caches)
    )


def _unexplained_css(view: OwnerView) -> str:
    """As the shipped alerts judge it: red where one fires, amber for an excess within the tolerance."""
    if exceeds_declaration(view.ceiling_bytes, view.unexplained_bytes) or (view.peak_bytes and not view.declares):
        return "over"
    return "low" if view.unexplained_bytes else ""


def _observed_section(owners: Sequence[OwnerView]) -> str:
    headers = ("model", "owner", "gpu", "declared ceiling", "observed", "peak", "unexplained", "caches")
    if not owners:
        return "<h2>Observed beside declared</h2><p>No observation to show (see each engine's observation state).</p>"
    note = (
        '<p class="note">observed: what the owner\'s live transformers caches hold at the last sample, each storage '
        "once; peak: the most they held at any instant since the sample before (caches a step makes and frees "
        "included; not followed where the workers run with KV_EXPORTER_OBSERVE_PEAK=0); unexplained: the peak "
        "(the observed figure where it is not followed) beyond the declared ceiling (all of it where nothing is "
        "declared); red where "
        f"an alert fires (beyond {UNEXPLAINED_ALERT_FRACTION:.0%} of the ceiling, shipped default, or undeclared), "
        "amber within that tolerance.</p>"
    )
    table = _table("observed", headers, (_owner_row(v) for v in owners))
    return "<h2>Observed beside declared</h2>" + table + note


def _manifest_row(entry: ManifestEntry) -> str:
    css = {"live": "ok", "stale": "", "invalid": "bad"}[entry.verdict.state.value]
    why = entry.error.detail if entry.error is not None else entry.verdict.why
    path = printable(entry.path)  # a file name need not be UTF-8
    name = f'<td title="{_e(path)}">{_e(os.path.basename(path))}</td>'
    return name + _cell(entry.verdict.state.value, css) + _cell(why)


def _manifest_section(snapshot: Snapshot) -> str:
    folder = f"<p>Folder <code>{_e(printable(snapshot.manifest_folder))}</code>"
    if snapshot.manifest_folder_error:
        folder += f' <span class="bad">unreadable: {_e(snapshot.manifest_folder_error)}</span>'
    folder += "</p>"
    rows = (_manifest_row(e) for e in snapshot.manifests)
    table = _table("manifests", ("file", "state", "why"), rows) if snapshot.manifests else "<p>None.</p>"
    note = (
        '<p class="note">Per-process GPU figures appear only where the engine shares a pid namespace with '
        "the GPU reader (NVML reports host pids).</p>"
    )
    return f"<h2>Manifests</h2>{folder}{table}{note}"


_SIMULATED_BANNER = '<p><span class="simulated">SIMULATED GPU: the GPU figures below are made up.</span></p>'


def render_landing(snapshot: Snapshot, telemetry_path: str = "/metrics") -> str:
    taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.taken_at))
    simulated = any(v.source == "simulated" for v in snapshot.gpus)
    banner = _SIMULATED_BANNER if simulated else ""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="refresh" content="10"><title>kv-exporter</title>'
        f"<style>{_STYLE}</style></head><body>"
        f"<h1>kv-exporter {_e(__version__)}</h1>"
        "<p>Model-local KV caches: declared ceilings, live estimates, and what the caches really hold. "
        f'<a href="{_e(telemetry_path)}">{_e(telemetry_path)}</a> · '
        f'<a href="/healthz">/healthz</a> · collected {_e(taken)} in {snapshot.duration_s * 1000:.1f} ms</p>'
        f"{banner}{_gpu_section(snapshot)}{_engine_section(snapshot)}"
        f"{_observed_section(snapshot.observed.owners)}{_declaration_section(snapshot.declarations)}"
        f"{_manifest_section(snapshot)}"
        "</body></html>\n"
    )
