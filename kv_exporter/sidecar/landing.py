"""The landing page at /: what a person checks first. Plain HTML, no script, no external resources.

Every text that comes from a manifest or an engine page is escaped: those are written by other processes.
"""

from __future__ import annotations

import html
import os
import time
from collections.abc import Iterable, Sequence

from kv_exporter import __version__
from kv_exporter.sidecar.records import ManifestEntry, PageResult
from kv_exporter.sidecar.snapshot import DeclarationView, EngineView, GpuView, Snapshot
from kv_exporter.sidecar.units import human_bytes

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #1b1b1b; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .4em 0; }
th, td { border: 1px solid #c8c8c8; padding: .25em .6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
th { white-space: nowrap; }
th { background: #f0f0f0; }
.bad { color: #a40000; font-weight: bold; } .ok { color: #1d6b1d; }
.simulated { background: #fff3c4; padding: .1em .4em; border-radius: .2em; }
.note { color: #555; max-width: 60em; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _bytes(value: int) -> str:
    return f'<td class="num" title="{value} B">{_e(human_bytes(value))}</td>'


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
    headroom_css = "bad" if view.headroom < 0 else "ok"
    return (
        _num(view.memory.index)
        + _cell(view.memory.uuid)
        + _cell(view.memory.name)
        + f'<td><span class="{css}">{_e(source)}</span></td>'
        + _bytes(view.memory.total)
        + _bytes(view.memory.used)
        + _bytes(view.projected_peak)
        + f'<td class="num {headroom_css}" title="{view.headroom} B">{_e(human_bytes(view.headroom))}</td>'
        + _num(safe)
    )


def _gpu_section(snapshot: Snapshot) -> str:
    gpu = snapshot.gpu
    if not gpu.enabled:
        status = "<p>GPU reading is disabled (<code>--no-nvml</code>): no per-GPU projection.</p>"
    elif gpu.error is not None:
        status = f'<p class="bad">GPU reader ({_e(gpu.source)}) unavailable: {_e(gpu.error)}</p>'
    else:
        status = ""
    headers = (
        "gpu",
        "UUID",
        "name",
        "source",
        "total",
        "used",
        "projected peak",
        "headroom",
        "safe max_num_seqs",
    )
    table = _table("gpus", headers, (_gpu_row(v) for v in snapshot.gpus)) if snapshot.gpus else ""
    note = (
        '<p class="note">projected peak = used + the sum over the GPU\'s live declarations of (ceiling - '
        "estimate); headroom = total - projected peak.</p>"
    )
    return f"<h2>GPUs</h2>{status}{table}{note}"


def _engine_row(view: EngineView) -> str:
    running = "?" if view.running is None else view.running
    limit = "?" if view.max_num_seqs is None else view.max_num_seqs
    up = '<td class="ok">up</td>' if view.up else '<td class="bad">unreadable</td>'
    return (
        _cell(view.key.model_name)
        + _num(view.key.stage)
        + _num(view.key.engine)
        + up
        + _num(f"{running} / {limit}")
        + _num(view.manifests)
        + _cell(view.target or "")
    )


def _engine_section(engines: Sequence[EngineView], pages: Sequence[PageResult]) -> str:
    headers = ("model", "stage", "engine", "page", "running / max_num_seqs", "manifests", "read from")
    table = _table("engines", headers, (_engine_row(v) for v in engines)) if engines else "<p>No engines.</p>"
    page_rows = (
        _cell(p.target)
        + (_cell("up", "ok") if p.page is not None else _cell(f"down: {p.error}", "bad"))
        + _num(f"{p.seconds * 1000:.1f} ms")
        for p in pages
    )
    page_table = _table("pages", ("engine page", "state", "fetch"), page_rows) if pages else ""
    none = "" if pages else "<p>No <code>--engine-url</code> configured: running counts are unknown.</p>"
    return f"<h2>Engines</h2>{table}{page_table}{none}"


def _declaration_row(view: DeclarationView) -> str:
    d = view.declaration
    return (
        _cell(view.model_name)
        + _num(view.stage)
        + _num(view.engine)
        + _cell(d.owner)
        + _cell(d.name)
        + _cell(d.scope.value)
        + _cell(d.rows.value)
        + _cell(view.gpu)
        + _bytes(d.bytes_per_row)
        + _num(view.ceiling_rows)
        + _bytes(view.ceiling_bytes)
        + _num(view.estimate_rows)
        + _bytes(view.estimate_bytes)
    )


def _declaration_section(views: Sequence[DeclarationView]) -> str:
    headers = (
        "model",
        "stage",
        "engine",
        "owner",
        "cache",
        "scope",
        "driver",
        "gpu",
        "per row",
        "ceiling rows",
        "ceiling",
        "estimate rows",
        "estimate",
    )
    if not views:
        return "<h2>Declarations</h2><p>No live declarations.</p>"
    return "<h2>Declarations</h2>" + _table("declarations", headers, (_declaration_row(v) for v in views))


def _manifest_row(entry: ManifestEntry) -> str:
    css = {"live": "ok", "stale": "", "invalid": "bad"}[entry.verdict.state.value]
    why = entry.error.detail if entry.error is not None else entry.verdict.why
    name = f'<td title="{_e(entry.path)}">{_e(os.path.basename(entry.path))}</td>'
    return name + _cell(entry.verdict.state.value, css) + _cell(why)


def _manifest_section(snapshot: Snapshot) -> str:
    folder = f"<p>Folder <code>{_e(snapshot.manifest_folder)}</code>"
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


def render_landing(snapshot: Snapshot) -> str:
    taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.taken_at))
    simulated = any(v.source == "simulated" for v in snapshot.gpus)
    banner = _SIMULATED_BANNER if simulated else ""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="refresh" content="10"><title>kv-exporter</title>'
        f"<style>{_STYLE}</style></head><body>"
        f"<h1>kv-exporter {_e(__version__)}</h1>"
        f'<p>Model-local KV caches: declared ceilings vs live estimates. <a href="/metrics">/metrics</a> · '
        f'<a href="/healthz">/healthz</a> · collected {_e(taken)} in {snapshot.duration_s * 1000:.1f} ms</p>'
        f"{banner}{_gpu_section(snapshot)}{_engine_section(snapshot.engines, snapshot.pages)}"
        f"{_declaration_section(snapshot.declarations)}{_manifest_section(snapshot)}"
        "</body></html>\n"
    )
