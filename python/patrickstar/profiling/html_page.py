"""report.html: one self-contained page (inline SVG and a little JS, nothing fetched)."""
from __future__ import annotations

import html
from typing import Iterable

from ..vocabulary import Tier
from .analysis import GiB, MiB, Analysis, mib, reserved_mib

__all__ = ["render_html"]


_TIER_COLORS = {Tier.DEVICE: "#d62728", Tier.HOST: "#1f77b4", Tier.NVME: "#2ca02c",
                None: "#eeeeee"}


def _svg_memory_panels(a: Analysis, width: int = 1100) -> str:
    rows = a.rows
    if not rows:
        return "<p>No moments were recorded.</p>"
    panels = []
    height, left, top, bottom = 170, 70, 20, 30
    plot_w = width - left - 20
    n = len(rows)

    def x(i: int) -> float:
        return left + (plot_w * i / max(1, n - 1))

    for t, name in enumerate(a.tier_names):
        model = [r["model"][t] for r in rows]
        non_model = [r["non_model"][t] for r in rows]
        budget = a.tiers[t]["budget_bytes"]
        held = max(m + nm for m, nm in zip(model, non_model))
        # A budget far above what the tier held (the NVMe tier's default budget is the free
        # space of its disk, tens of GiB against MiB of chunks) scaled the data to a flat line
        # at 0: the panel is then scaled to the data and says where the budget is.
        off_chart = held > 0 and budget > 4 * held
        peak = max(held, 1) if off_chart else max(held, budget, 1)
        scale = (height - top - bottom) / peak

        def y(v: float) -> float:
            return height - bottom - v * scale

        base = f"{x(0):.1f},{y(0):.1f} " + " ".join(
            f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(model)) + f" {x(n - 1):.1f},{y(0):.1f}"
        stacked = [m + nm for m, nm in zip(model, non_model)]
        upper = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(stacked))
        lower = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in reversed(list(enumerate(model))))
        parts = [f'<svg class="chart" width="{width}" height="{height}" '
                 f'viewBox="0 0 {width} {height}" role="img">',
                 f'<text x="{left}" y="14" class="title">{html.escape(name)} '
                 f'({a.tier_kinds[t]})</text>',
                 f'<polygon points="{base}" fill="{_TIER_COLORS.get(a.tier_kinds[t])}" '
                 f'fill-opacity="0.75"><title>model data</title></polygon>',
                 f'<polygon points="{upper} {lower}" fill="#ff7f0e" fill-opacity="0.6">'
                 f'<title>non-model data</title></polygon>']
        if off_chart:
            parts.append(f'<text x="{left + plot_w - 4}" y="{top - 6}" text-anchor="end" '
                         f'class="small">budget {mib(budget)} (above the chart)</text>')
        elif budget:
            parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(budget):.1f}" '
                         f'y2="{y(budget):.1f}" stroke="black" stroke-dasharray="6,4">'
                         f'<title>budget {mib(budget)}</title></line>'
                         f'<text x="{left + plot_w - 4}" y="{y(budget) - 4:.1f}" '
                         f'text-anchor="end" class="small">budget {mib(budget)}</text>')
        for frac in (0, 0.5, 1):
            value = peak * frac
            parts.append(f'<text x="{left - 6}" y="{y(value) + 4:.1f}" text-anchor="end" '
                         f'class="small axis">{_axis_mib(value, peak)}</text>')
        for i, r in enumerate(rows):
            if r["end_of_iteration"]:
                parts.append(f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{top}" '
                             f'y2="{height - bottom}" stroke="#999" stroke-width="0.5"/>')
        parts.append(f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle" '
                     f'class="small">moment ({n} closed moments; grey lines end iterations)'
                     f'</text></svg>')
        panels.append("".join(parts))
    legend = ('<p class="legend"><span style="background:#d62728"></span>device model data '
              '<span style="background:#1f77b4"></span>host model data '
              '<span style="background:#2ca02c"></span>NVMe model data '
              '<span style="background:#ff7f0e"></span>non-model data '
              '<span class="dash"></span>budget</p>')
    return legend + "\n".join(panels)


def _axis_mib(value: float, peak: float) -> str:
    """An axis label in MiB with as many decimals as a peak of that size needs (a panel of a
    0.4 MiB peak read '0 MiB' three times in whole MiB); in GiB from a peak of 1 GiB up, as
    mib() prints sizes."""
    unit, name = (GiB, "GiB") if peak >= GiB else (MiB, "MiB")
    decimals = 0 if peak >= 8 * unit else 1 if peak >= unit else 2
    return f"{value / unit:.{decimals}f} {name}"


# Pixels per character of the heat map's 11px labels, generous for system-ui's widest digits
# and lower-case letters, so the left margin holds the longest label ('chunk 47 variance_scale'
# was cut at a fixed 150 px).
_LABEL_CHAR_PX = 6.5


def _svg_heatmap(a: Analysis, max_columns: int = 400, max_chunks: int = 256,
                 width: int = 1100) -> str:
    rows = a.rows[-max_columns:]
    if not rows or not a.chunks:
        return "<p>No chunk locations to show.</p>"
    locations = a.locations(rows)
    chunk_ids = sorted(a.chunks)[:max_chunks]
    labels = {cid: f"chunk {cid} {a.chunks[cid].get('kind', '')}" for cid in chunk_ids}
    longest = max(len(label) for label in labels.values())
    left, top = max(150, int(longest * _LABEL_CHAR_PX) + 8), 10
    cell_h = max(3, min(14, 600 // max(1, len(chunk_ids))))
    plot_w = width - left - 10
    cell_w = plot_w / len(rows)
    height = top + cell_h * len(chunk_ids) + 30
    parts = [f'<svg id="heatmap" class="chart" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">']
    for row_index, cid in enumerate(chunk_ids):
        y = top + row_index * cell_h
        label = labels[cid]
        if cell_h >= 8:
            parts.append(f'<text x="{left - 4}" y="{y + cell_h - 2}" text-anchor="end" '
                         f'class="small">{html.escape(label)}</text>')
        places = locations[cid]
        start = 0
        for i in range(1, len(places) + 1):
            if i == len(places) or places[i] != places[start]:
                tier = places[start]
                kind = a.tier_kinds[tier] if tier >= 0 else None
                where = a.tier_label(tier)
                parts.append(f'<rect class="cell" x="{left + start * cell_w:.2f}" y="{y}" '
                             f'width="{(i - start) * cell_w:.2f}" height="{cell_h - 0.5}" '
                             f'fill="{_TIER_COLORS.get(kind, "#999")}" data-chunk="{cid}" '
                             f'data-where="{html.escape(where)}"><title>{html.escape(label)}: '
                             f'{html.escape(where)}</title></rect>')
                start = i
    first, last = rows[0], rows[-1]
    parts.append(f'<text x="{left}" y="{height - 8}" class="small">iteration {first["iteration"]}'
                 f' moment {first["moment"]}</text><text x="{left + plot_w}" y="{height - 8}" '
                 f'text-anchor="end" class="small">iteration {last["iteration"]} moment '
                 f'{last["moment"]}</text></svg>')
    note = ""
    if len(a.chunks) > max_chunks or len(a.rows) > max_columns:
        note = (f'<p class="small">Showing {len(chunk_ids)} of {len(a.chunks)} chunks and the '
                f'last {len(rows)} of {len(a.rows)} moments.</p>')
    legend = ('<p class="legend"><span style="background:#d62728"></span>device '
              '<span style="background:#1f77b4"></span>host '
              '<span style="background:#2ca02c"></span>NVMe '
              '<span style="background:#eeeeee"></span>no payload</p>')
    return legend + note + "".join(parts) + '<p id="heat-info" class="small">&nbsp;</p>'


def _svg_time_split(a: Analysis, width: int = 1100) -> str:
    its = a.iterations
    if not its:
        return "<p>No complete iteration was recorded.</p>"
    keys = [("compute_ns", "compute", "#7f7f7f"), ("move_wait_ns", "waiting for moves", "#d62728"),
            ("collective_ns", "waiting for collectives", "#9467bd"),
            ("optimizer_ns", "optimizer", "#17becf")]
    left, bar_h = 90, 16
    plot_w = width - left - 80  # room for the total after the longest bar
    longest = max(it["total_ns"] for it in its) or 1
    shown = its[-40:]
    height = 10 + len(shown) * (bar_h + 4) + 10
    parts = [f'<svg class="chart" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">']
    for row, it in enumerate(shown):
        y = 10 + row * (bar_h + 4)
        parts.append(f'<text x="{left - 6}" y="{y + bar_h - 4}" text-anchor="end" '
                     f'class="small">iteration {it["iteration"]}</text>')
        x = left
        for key, label, color in keys:
            w = plot_w * it[key] / longest
            if w > 0:
                parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{bar_h}" '
                             f'fill="{color}"><title>{label}: {it[key] / 1e6:.2f} ms'
                             f'</title></rect>')
            x += w
        parts.append(f'<text x="{x + 4:.1f}" y="{y + bar_h - 4}" class="small">'
                     f'{it["total_ns"] / 1e6:.1f} ms</text>')
    parts.append("</svg>")
    legend = '<p class="legend">' + " ".join(
        f'<span style="background:{c}"></span>{label}' for _, label, c in keys) + "</p>"
    return legend + "".join(parts)


def _table(headers: list[str], rows: Iterable[list], table_id: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    head = f"<thead><tr>{head}</tr></thead>" if any(headers) else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    ident = f' id="{table_id}"' if table_id else ""
    return f'<table class="sortable"{ident}>{head}<tbody>{body}</tbody></table>'


_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;
color:#222;max-width:1150px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f3f3f3;cursor:pointer}
.small{font-size:11px;fill:#444;color:#444}.title{font-size:13px;font-weight:600}
.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;
vertical-align:middle}.legend .dash{border-top:2px dashed #000;height:0;width:18px}
.findings li{margin:4px 0}.chart{display:block;margin:6px 0}
"""

_SCRIPT = """
(function(){
  var info=document.getElementById('heat-info');
  var heat=document.getElementById('heatmap');
  if(heat&&info){heat.addEventListener('mouseover',function(ev){
    var t=ev.target;if(t&&t.dataset&&t.dataset.chunk!==undefined){
      info.textContent='chunk '+t.dataset.chunk+': '+t.dataset.where;}});}
  var tables=document.querySelectorAll('table.sortable');
  tables.forEach(function(table){
    table.querySelectorAll('th').forEach(function(th,col){
      th.addEventListener('click',function(){
        var body=table.tBodies[0];var rows=Array.prototype.slice.call(body.rows);
        var asc=th.dataset.asc!=='1';th.dataset.asc=asc?'1':'0';
        rows.sort(function(a,b){var x=a.cells[col].textContent,y=b.cells[col].textContent;
          var nx=parseFloat(x),ny=parseFloat(y);
          var c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);return asc?c:-c;});
        rows.forEach(function(r){body.appendChild(r);});});});});
  var ready=document.createElement('div');ready.id='report-ready';
  ready.setAttribute('data-charts',String(document.querySelectorAll('svg.chart').length));
  document.body.appendChild(ready);
})();
"""


def render_html(raw: dict, summary: dict, analysis: Analysis | None = None) -> str:
    a = analysis or Analysis(raw)
    run = summary["run"]
    findings = "".join(f"<li>{html.escape(f)}</li>" for f in summary["findings"])
    tier_rows = [[name, t["kind"], mib(t["budget_bytes"]) if t["budget_bytes"] else "unlimited",
                  mib(t["peak_model_bytes"]), mib(t["peak_non_model_bytes"]),
                  mib(t["peak_total_bytes"]), reserved_mib(t), mib(t["bytes_in"]),
                  mib(t["bytes_out"]), t["evictions"]] for name, t in summary["tiers"].items()]
    eviction_rows = [[r["description"], r["count"], mib(r["bytes"]),
                      "-" if r["mean_next_use_distance"] is None
                      else f"{r['mean_next_use_distance']:.1f}"]
                     for r in summary["evictions"]["top_causes"]]
    mean = summary["time"]["steady_state_mean"]
    split = ", ".join(f"{label} {mean.get(key, 0) * 1e3:.1f} ms"
                      for key, label in (("compute_s", "compute"),
                                         ("move_wait_s", "waiting for moves"),
                                         ("collective_s", "collectives"),
                                         ("optimizer_s", "optimizer")))
    hit = summary["prefetch"]["hit_rate"]
    chunks = summary["chunks"]

    def owned(nbytes) -> str:  # Note [Model data of a data-parallel rank] in summary.py
        if run.get("world_size", 1) > 1 and nbytes is not None:
            return f" (this rank owns {mib(nbytes)})"
        return ""

    facts = _table(["", ""], [
        ["precision / device", f"{run.get('precision')} / {run.get('device')}"],
        ["iterations (complete) / moments", f"{run['iterations']} / {run['moments']}"],
        ["mean step time after warm-up", f"{mean['total_s'] * 1e3:.1f} ms ({split})"
                                         if "total_s" in mean
                                         else "n/a (no complete iteration was recorded)"],
        ["bytes moved", f"{mib(summary['moves']['bytes'])} in {summary['moves']['count']} "
                        f"copies, {summary['moves']['wait_s'] * 1e3:.1f} ms waited"],
        ["prefetch hit rate", "n/a" if hit is None else f"{hit:.0%}"],
        ["chunk size", f"{chunks['chunk_elements']} elements, {chunks['num_chunks']} chunks, "
                       f"{mib(chunks['model_data_bytes'])} model data"
                       f"{owned(chunks.get('owned_bytes'))}, "
                       f"{mib(chunks['wasted_bytes'])} wasted"],
        ["model data by kind", ", ".join(
            f"{kind} {k['dtype']} {mib(k['bytes'])}{owned(k.get('owned_bytes'))}"
            for kind, k in chunks.get("by_kind", {}).items()) or "-"],
        ["non-model data measured as", run.get("non_model_measure", "")],
    ])
    collectives = summary.get("collectives", {})
    collective_rows = [[name, c["count"], mib(c["bytes"]), f"{c['time_s'] * 1e3:.1f}",
                        f"{c.get('wait_s', c['time_s']) * 1e3:.1f}"]
                       for name, c in collectives.get("by_name", {}).items()]
    collective_table = (
        _table(["collective", "count", "payload", "issue to finish (ms)", "blocked (ms)"],
               collective_rows, "collectives") if collective_rows
        else "<p>No collectives (one rank, or none recorded).</p>")
    # (the distance counts chunk accesses of the warm-up trace, not moments nor time; "-":
    # evicted while warming up, or never used again)
    eviction_table = (_table(["cause", "evictions", "bytes",
                              "mean next-use distance (chunk accesses)"],
                             eviction_rows, "evictions") if eviction_rows
                      else "<p>No evictions.</p>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>PatrickStar-C++ memory profile</title><style>{_STYLE}</style></head>
<body>
<h1>PatrickStar-C++ memory profile</h1>
<h2>Findings</h2><ul class="findings">{findings}</ul>
<h2>Run</h2>{facts}
<h2>Memory by tier over moments</h2>{_svg_memory_panels(a)}
<h2>Per tier</h2>{_table(["tier", "kind", "budget", "peak model data", "peak non-model data",
                          "peak total", "slab pool reserved at stop", "moved in", "moved out",
                          "evictions"], tier_rows, "tiers")}
<h2>Step time</h2>{_svg_time_split(a)}
<h2>Where each chunk is (chunk x moment)</h2>{_svg_heatmap(a)}
<h2>Top eviction causes</h2>{eviction_table}
<h2>Collectives</h2>{collective_table}
<script>{_SCRIPT}</script>
</body></html>
"""
