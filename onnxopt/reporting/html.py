"""The optimize report as one self-contained HTML page (``onnxopt MODEL -o OUT --report R.html``).

:func:`build` gathers what the page shows for a finished optimization (the models on disk, its
``Report``): the static cost analysis of both models (``onnxopt.inspect.analysis``: FLOPs, bytes, parameters
by op type), their memory over time (``onnxopt.transforms.memory``), and, where the optimization was verified,
the latency by op type that onnxruntime's profiler measures (:mod:`onnxopt.verify.profile`).
:func:`render` draws that dict: the before/after tables, the rules that fired, horizontal bar charts of
where FLOPs, bytes and measured latency go by op type, the memory curves, the verification's tables
(``onnxopt.reporting.text.format_verification``'s, as on the terminal) and a link to the diff page.

The page needs no network and runs no script: inline CSS, inline SVG generated here. It shows no
time the optimizer itself took (rule and load/save times stay in the terminal and JSON reports), so
the same input gives the same bytes; only the measured latencies (the verification's and the
profile's) differ between runs, and without ``--verify`` nothing is measured.
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from urllib.parse import quote

from onnxopt import __version__
from onnxopt.inspect.analysis import analyze
from onnxopt.transforms.memory import peak
from onnxopt.reporting.text import Doc, Styled, Table, format_verification

BAR_ROWS = 14  # op types drawn per chart; the rest are one "other" bar
CURVE_POINTS = 1500  # the memory curve is drawn through at most this many points (each a bucket's maximum)

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:16px 28px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#c4cad6;word-break:break-all}
main{padding:8px 28px 40px;max-width:1400px}
section{background:#fff;border:1px solid #dde1e8;border-radius:6px;margin:16px 0;padding:12px 18px}
h2{font-size:16px;margin:4px 0 10px}h3{font-size:14px;margin:12px 0 6px}
table{border-collapse:collapse;margin:6px 0 10px}
th,td{padding:3px 10px;border-bottom:1px solid #eceff3;text-align:right;white-space:nowrap}
th{background:#f0f2f5;font-weight:600}th.l,td.l{text-align:left}
th.w,td.w{white-space:normal;text-align:left;max-width:560px;overflow-wrap:anywhere}
tr.same td{color:#8a93a3}.down{color:#167a3a}.up{color:#a15c00}
.green{color:#167a3a}.red{color:#b3261e}.yellow{color:#8a6100}.dim{color:#8a93a3}.bold{font-weight:600}
p.line{margin:2px 0;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px;white-space:pre-wrap}
.pair{display:flex;flex-wrap:wrap;gap:24px}.pair figure{margin:0}
figcaption{font-weight:600;margin:4px 0}
.note{color:#5b6474;font-size:13px}.unavailable{color:#8a6100}
svg text{font:11px system-ui,sans-serif;fill:#1d2330}
svg .bar{fill:#4a78c2}svg.after .bar{fill:#2e9d63}svg .axis{stroke:#9aa3b2;stroke-width:1}
svg .curve{fill:none;stroke:#4a78c2;stroke-width:1.5}svg.after .curve{stroke:#2e9d63}
svg .peak{fill:#b3261e}
"""


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _size(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def _count(n) -> str:
    """A large count: 1234567 -> 1.23 M; small ones as they are."""
    if n is None:
        return "-"
    n = float(n)
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:g}"


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f} ms"


def _change(before, after, fmt=str) -> str:
    if before is None or after is None:
        return "<td>-</td>"
    d = after - before
    cls = "down" if d < 0 else "up" if d > 0 else "dim"
    pct = f" ({100 * d / before:+.1f}%)" if before else ""
    sign = "-" if d < 0 else "+" if d > 0 else "±"
    return f'<td class="{cls}">{sign}{_e(fmt(abs(d)))}{pct}</td>'


def _latency_change(lat: Mapping) -> str:
    """A measured latency's change cell: the verdict of its interval (``onnxopt.verify.latency_text``),
    coloured only when the interval excludes 1.0; a report without one (older) shows the ratio, uncoloured."""
    from onnxopt.reporting.text import latency_style
    from onnxopt.verify import latency_text

    if "verdict" not in lat:
        ratio = lat.get("ratio_median")
        return f'<td class="dim">{_e(f"x{ratio:.3f}" if isinstance(ratio, (int, float)) else "-")}</td>'
    cls = {"green": "down", "yellow": "up"}.get(latency_style(lat), "dim")
    threads = lat.get("threads")
    how = f"; {lat.get('rounds')} interleaved rounds" + (
        "" if threads is None else f", {threads or 'default'} thread{'s' if threads != 1 else ''}")
    return f'<td class="{cls}">{_e(latency_text(lat) + how)}</td>'


def _table(header: Sequence[str], rows: Sequence[Sequence], align: str = "", cls: Sequence[str] = ()) -> str:
    """An HTML table; cells are escaped text, except those given as ("<td>...</td>",) (raw cells)."""
    align = align or "l" + "r" * (len(header) - 1)
    out = ["<table><thead><tr>" + "".join(f'<th class="{a}">{_e(h)}</th>' for h, a in zip(header, align))
           + "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        rc = f' class="{cls[i]}"' if i < len(cls) and cls[i] else ""
        cells = []
        for c, a in zip(row, align):
            if isinstance(c, tuple):
                cells.append(c[0])
            else:
                style = getattr(c, "style", "")
                cells.append(f'<td class="{a} {_e(style)}">{_e(c)}</td>' if style else f'<td class="{a}">{_e(c)}</td>')
        out.append(f"<tr{rc}>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _doc_html(doc: Doc) -> str:
    """A terminal report (``onnxopt.reporting.text.Doc``) as HTML: its tables as tables, its lines as lines
    with their styles."""
    out = []
    for block in doc.blocks:
        if isinstance(block, Table):
            for title, rows in block.sections:
                if title:
                    out.append(f'<p class="line {_e(getattr(title, "style", ""))}">{_e(title)}</p>')
                out.append(_table([str(h) for h in block.header], rows, block.aligns))
        elif isinstance(block, Doc):
            out.append(_doc_html(block))
        elif str(block):
            style = block.style if isinstance(block, Styled) else ""
            out.append(f'<p class="line {_e(style)}">{_e(block)}</p>')
    return "\n".join(out)


# -- charts -------------------------------------------------------------------------------------


def _rows(before: Mapping[str, float], after: Mapping[str, float], limit: int = BAR_ROWS) -> list[str]:
    """The op types to draw, largest first (by the larger of their two values; name on ties); beyond
    ``limit`` the rest become one "other" row (its key: None)."""
    ops = [op for op in set(before) | set(after) if (before.get(op) or 0) > 0 or (after.get(op) or 0) > 0]
    ops.sort(key=lambda op: (-max(before.get(op) or 0, after.get(op) or 0), op))
    return ops if len(ops) <= limit else [*ops[:limit - 1], None]


def _value(side: Mapping[str, float], op, shown: Sequence) -> float:
    if op is None:
        return float(sum(v or 0 for k, v in side.items() if k not in shown))
    return float(side.get(op) or 0)


_LABEL_W, _BAR_W, _VALUE_W, _ROW_H = 150, 240, 80, 18


def _bar_chart(name: str, label: str, rows: Sequence, side: Mapping[str, float], scale: float, fmt) -> str:
    """One horizontal bar chart: a bar per row, its width ``value / scale`` of the bar area."""
    shown = [r for r in rows if r is not None]
    others = len([k for k, v in side.items() if k not in shown and (v or 0) > 0])
    width = _LABEL_W + _BAR_W + _VALUE_W
    height = max(1, len(rows)) * _ROW_H + 6
    parts = [f'<figure><figcaption>{_e(label)}</figcaption>'
             f'<svg class="chart bars {_e(name.rsplit("-", 1)[-1])}" data-chart="{_e(name)}" role="img" '
             f'aria-label="{_e(name)}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">',
             f'<line class="axis" x1="{_LABEL_W}" y1="0" x2="{_LABEL_W}" y2="{height - 4}"/>']
    for i, op in enumerate(rows):
        v = _value(side, op, shown)
        w = round(_BAR_W * v / scale, 2) if scale > 0 else 0.0
        y = i * _ROW_H + 2
        text = f"other ({others})" if op is None else op
        short = text if len(text) <= 22 else text[:21] + "…"
        parts.append(f'<text x="{_LABEL_W - 6}" y="{y + 12}" text-anchor="end"><title>{_e(text)}</title>'
                     f'{_e(short)}</text>'
                     f'<rect class="bar" x="{_LABEL_W}" y="{y}" width="{w}" height="{_ROW_H - 5}" '
                     f'data-op="{_e(text)}" data-value="{v!r}"><title>{_e(text)}: {_e(fmt(v))}</title></rect>'
                     f'<text x="{_LABEL_W + w + 4}" y="{y + 12}">{_e(fmt(v))}</text>')
    parts.append("</svg></figure>")
    return "".join(parts)


def _bar_pair(name: str, before: Mapping[str, float], after: Mapping[str, float], fmt, what: str) -> str:
    """Before and after side by side, the same op types in the same order, on the same scale."""
    rows = _rows(before, after)
    if not rows:
        return f'<p class="note">no {_e(what)} recorded</p>'
    scale = max(max(_value(before, op, rows), _value(after, op, rows)) for op in rows)
    tb, ta = sum(v or 0 for v in before.values()), sum(v or 0 for v in after.values())
    return ('<div class="pair">' + _bar_chart(f"{name}-before", f"before: {fmt(tb)}", rows, before, scale, fmt)
            + _bar_chart(f"{name}-after", f"after: {fmt(ta)}", rows, after, scale, fmt) + "</div>")


def _points(curve: Sequence[float], limit: int = CURVE_POINTS) -> list[tuple[int, float]]:
    """(node index, bytes) to draw: every point, or each bucket's maximum for a long curve (peaks kept)."""
    n = len(curve)
    if n <= limit:
        return list(enumerate(float(v) for v in curve))
    out = []
    for b in range(limit):
        lo, hi = b * n // limit, (b + 1) * n // limit
        i = max(range(lo, hi), key=lambda j: curve[j])
        out.append((i, float(curve[i])))
    return out


_CW, _CH, _PAD_L, _PAD_B = 440, 200, 64, 22


def _line_chart(name: str, label: str, mem: Mapping, ymax: float) -> str:
    curve = mem.get("curve") or []
    pts = _points(curve)
    n = max(1, len(curve) - 1)
    plot_w, plot_h = _CW - _PAD_L - 10, _CH - _PAD_B - 10
    xy = [(round(_PAD_L + plot_w * i / n, 2), round(10 + plot_h * (1 - (v / ymax if ymax > 0 else 0)), 2))
          for i, v in pts]
    peak_at = (mem.get("peak_at") or {})
    parts = [f'<figure><figcaption>{_e(label)}</figcaption>'
             f'<svg class="chart line {_e(name.rsplit("-", 1)[-1])}" data-chart="{_e(name)}" '
             f'data-points="{len(pts)}" role="img" aria-label="{_e(name)}" xmlns="http://www.w3.org/2000/svg" '
             f'width="{_CW}" height="{_CH}" viewBox="0 0 {_CW} {_CH}">',
             f'<line class="axis" x1="{_PAD_L}" y1="10" x2="{_PAD_L}" y2="{10 + plot_h}"/>',
             f'<line class="axis" x1="{_PAD_L}" y1="{10 + plot_h}" x2="{_PAD_L + plot_w}" y2="{10 + plot_h}"/>',
             f'<text x="{_PAD_L - 4}" y="14" text-anchor="end">{_e(_size(ymax))}</text>',
             f'<text x="{_PAD_L - 4}" y="{10 + plot_h}" text-anchor="end">0</text>',
             f'<text x="{_PAD_L}" y="{_CH - 4}">node 0</text>',
             f'<text x="{_PAD_L + plot_w}" y="{_CH - 4}" text-anchor="end">node {len(curve) - 1}</text>']
    if xy:
        parts.append('<polyline class="curve" points="' + " ".join(f"{x},{y}" for x, y in xy) + '"/>')
    idx = peak_at.get("index")
    if isinstance(idx, int) and 0 <= idx < len(curve):
        px = round(_PAD_L + plot_w * idx / n, 2)
        py = round(10 + plot_h * (1 - (float(curve[idx]) / ymax if ymax > 0 else 0)), 2)
        parts.append(f'<circle class="peak" cx="{px}" cy="{py}" r="3.5"><title>peak {_e(_size(curve[idx]))} after '
                     f'{_e(peak_at.get("name", ""))}</title></circle>')
    parts.append("</svg></figure>")
    return "".join(parts)


# -- sections -----------------------------------------------------------------------------------


def _unavailable(what: str, reason) -> str:
    return f'<p class="unavailable">{_e(what)}: not available ({_e(reason or "not gathered")})</p>'


def _summary(data: Mapping) -> str:
    r = data["report"]
    an = data.get("analysis") if isinstance(data.get("analysis"), Mapping) else {}
    ab, aa = an.get("before") or {}, an.get("after") or {}
    mem = _memory(data)
    sizes = data.get("sizes") or {}
    rows = [("nodes", r["nodes_before"], r["nodes_after"], str),
            ("op types", len(r["op_types_before"]), len(r["op_types_after"]), str),
            ("model bytes (with data files)", sizes.get("before"), sizes.get("after"), _size)]
    if ab and aa:
        rows += [("parameters", (ab.get("params") or {}).get("count"), (aa.get("params") or {}).get("count"), _count),
                 ("parameter bytes", (ab.get("params") or {}).get("bytes"), (aa.get("params") or {}).get("bytes"),
                  _size),
                 ("FLOPs per run", ab.get("flops"), aa.get("flops"), _count),
                 ("bytes read per run", ab.get("bytes_read"), aa.get("bytes_read"), _size),
                 ("bytes written per run", ab.get("bytes_written"), aa.get("bytes_written"), _size)]
    if mem and mem.get("before") and mem.get("after"):
        rows.append(("peak activation memory", mem["before"].get("peak_bytes"), mem["after"].get("peak_bytes"), _size))
    for p, e in ((r.get("verification") or {}).get("providers") or {}).items():
        k = e.get("kernels") or {}
        if "before" in k and "after" in k:
            rows.append((f"kernels per run ({p})", k["before"]["kernels"], k["after"]["kernels"], str))
        lat = e.get("latency") or {}
        if "before" in lat and "after" in lat:
            rows.append((f"median latency ({p}, measured)", lat["before"]["median_ms"], lat["after"]["median_ms"],
                         lat))
    body = _table(("", "before", "after", "change"),
                  [(label, _ms(b), _ms(a), (_latency_change(fmt),)) if isinstance(fmt, Mapping) else
                   (label, fmt(b) if b is not None else "-", fmt(a) if a is not None else "-",
                    (_change(b, a, fmt),)) for label, b, a, fmt in rows])
    s = r.get("settings") or {}
    settings = ", ".join(f"{k} {v}" for k, v in s.items() if v not in (None, {}, [], False)) or "defaults"
    if data.get("at"):
        where = data.get("at_source") or "the verifier's shapes"
        settings += (f"; FLOPs, bytes and memory of the symbolic inputs at {where}: "
                     + ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in data["at"].items()))
    cfg = data.get("config")
    extra = (f'<p class="note">configuration: {_e(", ".join(f"{k}={v}" for k, v in cfg.items()))}</p>'
             if isinstance(cfg, Mapping) and cfg else "")
    lines = [f'<p class="note">settings: {_e(settings)}; {r["rewrites"]} rewrites'
             + ("; stopped at the rewrite limit" if r.get("hit_limit") else "") + "</p>", extra]
    warnings = r.get("warnings") or []
    if warnings:
        lines.append("<ul>" + "".join(f'<li class="yellow">warning: {_e(w)}</li>' for w in warnings) + "</ul>")
    return _section("summary", "Before and after", body + "".join(lines))


def _ops(r: Mapping) -> str:
    b, a = r["op_types_before"], r["op_types_after"]
    ops = sorted(set(b) | set(a), key=lambda op: (a.get(op, 0) - b.get(op, 0), op))
    rows = [(op, b.get(op, 0), a.get(op, 0), (_change(b.get(op, 0), a.get(op, 0)),)) for op in ops]
    cls = ["same" if b.get(op, 0) == a.get(op, 0) else "" for op in ops]
    rows.append((Styled("total", "bold"), r["nodes_before"], r["nodes_after"],
                 (_change(r["nodes_before"], r["nodes_after"]),)))
    return _section("ops", "Nodes by op type", _table(("op type", "before", "after", "change"), rows, cls=cls))


def _rules(r: Mapping) -> str:
    rules = r.get("rules") or {}
    fired = sorted(((n, st) for n, st in rules.items() if st.get("fired") or st.get("errors")),
                   key=lambda kv: (-kv[1].get("fired", 0), kv[0]))
    idle = sorted(n for n, st in rules.items() if st.get("tried") and not (st.get("fired") or st.get("errors")))
    body = (_table(("rule", "tried", "fired", "refused", "errors", "top refusals"),
                   [(n, st.get("tried", 0), st.get("fired", 0), st.get("refused", 0), st.get("errors", 0),
                     "; ".join(f"{k} ({v})" for k, v in (st.get("top_refusals") or {}).items()) or "-")
                    for n, st in fired], "lrrrrw")
            if fired else '<p class="note">no rule applied</p>')
    if idle:
        body += f'<p class="note">{len(idle)} more tried without firing: {_e(", ".join(idle))}</p>'
    fusions = {k: f for k, f in sorted((r.get("fusions") or {}).items()) if f.get("hits") or f.get("missed")}
    if fusions:
        body += "<h3>Fusions</h3>" + _table(
            ("fusion", "fused", "missed", "why missed"),
            [(k, f["hits"], f["missed"], "; ".join(f"{w} ({n})" for w, n in (f.get("reasons") or {}).items()) or "-")
             for k, f in fusions.items()], "lrrw")
    skipped = r.get("skipped") or []
    if skipped:
        body += f'<p class="note">left out for the target: {_e(", ".join(s.get("rule", "?") for s in skipped))}</p>'
    return _section("rules", f"Rules fired ({r.get('rewrites', 0)} rewrites)", body)


def _cost(data: Mapping) -> str:
    an = data.get("analysis")
    parts = []
    if isinstance(an, Mapping) and an.get("before") and an.get("after"):
        bb, ba = an["before"].get("by_op_type") or {}, an["after"].get("by_op_type") or {}
        conv = an["after"].get("flops_convention") or an["before"].get("flops_convention")
        parts.append("<h3>FLOPs by op type</h3>"
                     + (f'<p class="note">{_e(conv)}</p>' if conv else "")
                     + _bar_pair("flops", {k: v.get("flops") or 0 for k, v in bb.items()},
                                 {k: v.get("flops") or 0 for k, v in ba.items()}, _count, "FLOPs"))
        parts.append("<h3>Bytes moved by op type (read + written)</h3>"
                     + _bar_pair("bytes", {k: (v.get("bytes_read") or 0) + (v.get("bytes_written") or 0)
                                           for k, v in bb.items()},
                                 {k: (v.get("bytes_read") or 0) + (v.get("bytes_written") or 0) for k, v in ba.items()},
                                 _size, "bytes"))
    else:
        reason = an.get("unavailable") if isinstance(an, Mapping) else None  # (None: "not gathered")
        parts.append("<h3>FLOPs and bytes by op type</h3>" + _unavailable("static cost analysis", reason))
    prof = data.get("profile")
    parts.append("<h3>Measured latency by op type</h3>")
    if isinstance(prof, Mapping) and prof.get("before") is not None and prof.get("after") is not None:
        parts.append(f'<p class="note">kernel time per run from onnxruntime\'s profiler '
                     f'({_e(prof.get("provider", "cpu"))}, {_e(prof.get("runs", "?"))} runs after '
                     f'{_e(prof.get("warmup", "?"))} warm-up'
                     + (', both models interleaved' if prof.get("interleaved") else "")
                     + (f', {_e(prof["threads"] or "onnxruntime default")} intra-op thread'
                        f'{"" if prof["threads"] == 1 else "s"}' if "threads" in prof else "")
                     + f', graph optimizations '
                     f'{_e(prof.get("optimization", "ORT_ENABLE_ALL"))} as the verifier\'s latency sessions): op types '
                     "as onnxruntime ran them after its own fusions; measured, so they vary between runs: whether the "
                     "whole model got faster is the summary's latency verdict, with its interval</p>"
                     + _bar_pair("latency", prof["before"], prof["after"], _ms, "kernel time"))
    else:
        reason = prof.get("unavailable") if isinstance(prof, Mapping) else "measured only with --verify"
        parts.append(_unavailable("latency by op type", reason))
    return _section("cost", "Where the cost goes", "".join(parts))


def _memory(data: Mapping):
    mem = data.get("memory")
    if mem is None:
        mem = (data.get("report") or {}).get("memory")
    return mem


def _memory_section(data: Mapping) -> str:
    mem = _memory(data)
    if not (isinstance(mem, Mapping) and mem.get("before") and mem.get("after")):
        reason = mem.get("unavailable") if isinstance(mem, Mapping) else None  # (None: "not gathered")
        return _section("memory", "Memory over time", _unavailable("the memory curve", reason))
    b, a = mem["before"], mem["after"]
    ymax = max([float(v) for v in (b.get("curve") or [0]) + (a.get("curve") or [0])] + [0.0])
    body = ('<p class="note">activation bytes alive while each node runs, in execution order' +
            (" (the optimized model's nodes reordered to lower the peak)" if mem.get("reordered") else "") +
            "; the dot marks the peak" + ("; some sizes are unknown (symbolic): the figures are lower bounds"
                                          if b.get("lower_bound") or a.get("lower_bound") else "") + "</p>")
    body += '<div class="pair">' + "".join(
        _line_chart(f"memory-{side}", f"{side}: peak {_size(m.get('peak_bytes'))}", m, ymax)
        for side, m in (("before", b), ("after", a))) + "</div>"
    rows = []
    for side, m in (("before", b), ("after", a)):
        at = m.get("peak_at") or {}
        alive = m.get("alive_at_peak") or []
        top = ", ".join(f"{name} {_size(n)}" for name, n in alive[:3]) + (f", ... ({len(alive)} values)"
                                                                            if len(alive) > 3 else "")
        rows.append((side, _size(m.get("peak_bytes")), f"{at.get('name', '-')} (#{at.get('index', '-')})",
                     _size(m.get("weights_bytes")), top or "-", len(m.get("unknown") or [])))
    body += _table(("", "peak", "at node", "weights", "largest alive at the peak", "unknown sizes"), rows,
                   "lrwrwr")
    return _section("memory", "Memory over time", body)


def _verification(r: Mapping) -> str:
    v = r.get("verification")
    if not v:
        return _section("verification", "Verification",
                        '<p class="note">not verified (add --verify cpu to compare the outputs on onnxruntime, '
                        "with kernels and latency)</p>")
    return _section("verification", "Verification", _doc_html(format_verification(v)))


def _diff(data: Mapping) -> str:
    link = data.get("diff_page")
    if not link:
        return _section("diff", "Diff", '<p class="note">no diff page was written (add --diff PAGE.html)</p>')
    href = quote(str(link).replace(os.sep, "/"), safe="/")
    return _section("diff", "Diff", f'<p>node by node: <a id="diff-link" href="{_e(href)}">{_e(link)}</a></p>')


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>\n{body}\n</section>'


def render(data: Mapping) -> str:
    """The page (a str) for ``data``: ``input``, ``output`` (names as shown), ``report``
    (``Report.as_dict()``), ``analysis`` (``{"before", "after"}``: ``onnxopt.inspect.analysis.analyze``'s dicts),
    ``memory`` (``{"before", "after", "reordered"}``: ``onnxopt.transforms.memory.peak``'s dicts; else the
    report's own), ``profile`` (``{"before": {op: ms}, "after": {...}, "provider", "runs", "warmup",
    "optimization"}``), ``diff_page`` (a link relative to the page), ``sizes`` (``{"before", "after"}``:
    the models' bytes) and ``config`` (the settings file's values), each optional but ``report``; a
    section whose data is None, or a dict ``{"unavailable": reason}``, says it is not available."""
    r = data["report"]
    title = f"onnxopt {data.get('input', 'BEFORE')} -> {data.get('output', 'AFTER')}"
    sections = [_summary(data), _ops(r), _rules(r), _cost(data), _memory_section(data), _verification(r), _diff(data)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>"
            f"<header><h1>onnxopt report</h1><p>{_e(data.get('input', 'BEFORE'))} &rarr; "
            f"{_e(data.get('output', 'AFTER'))}</p></header>\n<main>\n" + "\n".join(sections)
            + f'\n<p class="note">onnxopt {_e(__version__)}</p>\n</main></body></html>\n')


# -- the inspect page ---------------------------------------------------------------------------


def _single_bars(name: str, side: Mapping[str, float], fmt, what: str) -> str:
    rows = _rows(side, {})
    if not rows:
        return f'<p class="note">no {_e(what)} recorded</p>'
    scale = max(_value(side, op, rows) for op in rows)
    return _bar_chart(name, f"total: {fmt(sum(v or 0 for v in side.values()))}", rows, side, scale, fmt)


def _top_nodes(nodes: Sequence[Mapping], key, top: int) -> str:
    ranked = sorted((n for n in nodes if isinstance(key(n), (int, float))), key=lambda n: (-key(n), n.get("name", "")))
    rows = [(n.get("name", ""), n.get("op", ""), _count(n.get("flops")), _size(n.get("bytes_read")),
             _size(n.get("bytes_written")), "-" if n.get("intensity") is None else f"{n['intensity']:.3g}",
             n.get("bound") or "-") for n in ranked[:top]]
    return _table(("node", "op", "FLOPs", "read", "written", "FLOPs/byte", "bound"), rows, "wlrrrrl")


def render_inspect(model: str, an: Mapping, mem: Mapping | None = None, top: int = 20) -> str:
    """The inspect page (``onnxopt inspect MODEL --html PAGE``): ``an`` is ``onnxopt.inspect.analysis.analyze``'s
    dict, ``mem`` ``onnxopt.transforms.memory.peak``'s (or ``{"unavailable": reason}``); no script, no network."""
    def shape(v) -> str:
        dims = v.get("shape")
        return "?" if dims is None else "x".join(str(d) for d in dims) or "scalar"

    io_rows = [(v.get("name"), kind, v.get("dtype"), shape(v)) for kind in ("input", "output")
               for v in an.get(kind + "s") or []]
    params = an.get("params") or {}
    prow = [(dt, _count(x.get("count")), _size(x.get("bytes"))) for dt, x in (params.get("by_dtype") or {}).items()]
    prow.append(("total", _count(params.get("count")), _size(params.get("bytes"))))
    dev = an.get("device") or {}
    model_body = (_table(("value", "kind", "dtype", "shape"), io_rows, "llll")
                  + '<p class="note">opsets: ' + _e(", ".join(f"{d or 'ai.onnx'} {v}" for d, v in
                                                             (an.get("opsets") or {}).items())) + "</p>"
                  + "<h3>Parameters</h3>" + _table(("dtype", "count", "bytes"), prow, "lrr")
                  + "<h3>Nodes by op type</h3>"
                  + _table(("op type", "nodes"), [(op, n) for op, n in (an.get("op_types") or {}).items()], "lr"))
    totals = (f'<p>FLOPs {_e(_count(an.get("flops")))}; bytes read {_e(_size(an.get("bytes_read")))}, written '
              f'{_e(_size(an.get("bytes_written")))}; device {_e(dev.get("name", "-"))} '
              f'({_e(dev.get("source", ""))})</p><p class="note">{_e(an.get("flops_convention", ""))}'
              + (f'; {_e(an.get("symbols_note", ""))}' if an.get("symbolic") else "") + "</p>")
    by = an.get("by_op_type") or {}
    cost = (totals + "<h3>FLOPs by op type</h3>"
            + _single_bars("flops-model", {k: v.get("flops") or 0 for k, v in by.items()}, _count, "FLOPs")
            + "<h3>Bytes moved by op type (read + written)</h3>"
            + _single_bars("bytes-model", {k: (v.get("bytes_read") or 0) + (v.get("bytes_written") or 0)
                                           for k, v in by.items()}, _size, "bytes")
            + f"<h3>Top {top} nodes by FLOPs</h3>" + _top_nodes(an.get("nodes") or [], lambda n: n.get("flops"), top)
            + f"<h3>Top {top} nodes by bytes moved</h3>"
            + _top_nodes(an.get("nodes") or [], lambda n: (n.get("bytes_read") or 0) + (n.get("bytes_written") or 0)
                         if n.get("bytes_read") is not None else None, top))
    if isinstance(mem, Mapping) and mem.get("peak_bytes") is not None:
        ymax = max([float(v) for v in mem.get("curve") or [0]] + [0.0])
        at = mem.get("peak_at") or {}
        alive = mem.get("alive_at_peak") or []
        memory = (_line_chart("memory-model", f"peak {_size(mem.get('peak_bytes'))} at {at.get('name', '-')}", mem, ymax)
                  + f'<p class="note">weights apart: {_e(_size(mem.get("weights_bytes")))}; '
                  f'{len(mem.get("unknown") or [])} value(s) of unknown size'
                  + (_e("; symbolic inputs at the verifier's shapes: " + ", ".join(
                      f"{k} {'x'.join(map(str, v))}" for k, v in mem["at"].items())) if mem.get("at") else "")
                  + '</p>' + _table(("alive at the peak", "bytes"), [(nm, _size(b)) for nm, b in alive[:top]], "wr"))
    else:
        memory = _unavailable("the memory curve", mem.get("unavailable") if isinstance(mem, Mapping) else None)
    sections = [_section("model", "Model", model_body), _section("cost", "Where the cost goes", cost),
                _section("memory", "Memory over time", memory)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e('onnxopt inspect ' + model)}</title><style>{_CSS}</style></head>\n<body>"
            f"<header><h1>onnxopt inspect</h1><p>{_e(model)}</p></header>\n<main>\n" + "\n".join(sections)
            + f'\n<p class="note">onnxopt {_e(__version__)}</p>\n</main></body></html>\n')


# -- gathering ----------------------------------------------------------------------------------


def _model_bytes(path) -> int | None:
    from onnxopt.ir import io

    try:
        return sum(os.path.getsize(f) for f in io.files_read(path))
    except OSError:
        return None


def _both(fn, before, after, shapes):
    """``fn`` on both models; ``shapes``: one set of input shapes for both, or a pair (before's, after's)."""
    pair = shapes if isinstance(shapes, tuple) else (shapes, shapes)
    try:
        return {"before": fn(before, input_shapes=pair[0] or None), "after": fn(after, input_shapes=pair[1] or None)}
    except Exception as exc:  # noqa: BLE001 - the page says why the section is missing
        from onnxopt.ir.io import first_line

        return {"unavailable": first_line(exc, 200)}


def _profile(before: str, after: str, verification: Mapping, options: Mapping, runs: int) -> dict:
    from onnxopt.transforms import edges as layouts
    from onnxopt.ir.io import first_line
    from onnxopt.verify import make_inputs
    from onnxopt.verify import LATENCY_THREADS
    from onnxopt.verify.profile import GRAPH_OPTIMIZATION, op_type_latency_pair

    provider = next(iter(verification.get("providers") or {"cpu": None}))
    try:
        import onnx

        meta = [{p.key: p.value for p in onnx.load(m, load_external_data=False).metadata_props}
                for m in (before, after)]
        edges = layouts.edges_between(*meta)
        seed = options.get("seed") or 0
        common = {"int_ranges": options.get("int_ranges"), "npz": options.get("inputs"), "seed": seed}
        if edges:  # (the data given, as the verifier runs it: onnxopt.transforms.edges.edge_feeds)
            feeds, how = make_inputs(before, shapes=options.get("input_shapes"), pixels=layouts.pixel_inputs(edges),
                                     **common)
            fb, fa = layouts.edge_feeds(edges, feeds, seed, how)
        else:  # the optimized model's inputs (shapes fixed by --input-shape, if any) fit the original too
            fb = fa = make_inputs(after, **common)[0]
        threads = options.get("threads")
        threads = LATENCY_THREADS if threads is None else int(threads)
        pb, pa = op_type_latency_pair(before, after, fb, fa, provider, runs=runs, warmup=2, threads=threads,
                                      provider_options=options.get("provider_options"))
        return {"before": pb, "after": pa, "provider": provider, "runs": runs, "warmup": 2, "threads": threads,
                "interleaved": True, "optimization": GRAPH_OPTIMIZATION}
    except Exception as exc:  # noqa: BLE001
        return {"unavailable": f"profiling failed: {first_line(exc, 200)}"}


def _run_shapes(path, data: Mapping | None = None) -> dict:
    """The shapes the verifier runs a model's inputs with symbolic dimensions at
    (``onnxopt.verify.inputs.symbolic_run_shapes``; the graph read without its external weights):
    ``data``'s, the shapes the verification's data ran the original at (by input name), where they fit."""
    import onnx

    from onnxopt.ir import io
    from onnxopt.ir.input_shapes import RUN_SHAPES_KEY, symbolic_run_shapes

    try:
        model = io.to_ir(onnx.load(str(path), load_external_data=False))
    except Exception:  # noqa: BLE001 - the sections say what failed when they read the model
        return {}
    if data:
        model.graph.meta[RUN_SHAPES_KEY] = dict(data)
    return symbolic_run_shapes(model)


def _edited_shapes(path, data: Mapping) -> dict:
    """``data`` (shapes of the original's inputs) as the optimized model at ``path`` takes them
    where optimize changed its inputs' layout or made them raw pixels (``onnxopt.transforms.edges.edge_shape``)."""
    if not data:
        return {}
    import onnx

    from onnxopt.transforms import edges as layouts

    try:
        meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
        recs = (layouts.edges_of(meta) or {}).get("inputs", {})
    except Exception:  # noqa: BLE001
        return dict(data)
    return {k: layouts.edge_shape(recs[k], v) if k in recs else v for k, v in data.items()}


def _data_shapes(path, verify_options: Mapping | None) -> dict:
    """``onnxopt.verify.inputs.data_shapes`` of the model at ``path`` (the original) for the verifier's options."""
    import onnx

    from onnxopt.ir import io
    from onnxopt.verify.inputs import data_shapes

    if not verify_options or (verify_options.get("inputs") is None and verify_options.get("feeds") is None):
        return {}
    try:
        return data_shapes(io.to_ir(onnx.load(str(path), load_external_data=False)), verify_options)
    except Exception:  # noqa: BLE001 - the sections say what failed when they read the model
        return {}


def build(input_path, output_path, report, *, page=None, diff_page=None, verify_options: Mapping | None = None,
          profile_runs: int = 10, config: Mapping | None = None) -> dict:
    """What :func:`render` draws for a finished optimization: ``input_path`` and ``output_path`` (the
    models, on disk), ``report`` (``onnxopt.api.Report`` or its ``as_dict()``); ``page``: where the
    page goes (the diff link is made relative to its folder); ``diff_page``: the diff page's path;
    ``verify_options``: the verifier's (inputs, int_ranges, seed, threads, provider_options), for
    the profile, which runs only where the report has a verification (on its first provider)."""
    d = report if isinstance(report, Mapping) else report.as_dict()
    shapes = {k: v for k, v in ((d.get("settings") or {}).get("input_shapes") or {}).items()
              if all(isinstance(x, int) for x in v)}
    at = None
    if not shapes:  # symbolic inputs: sized as the verifier runs them (its latency is taken at those shapes):
        # at the shapes of its data where it was given some (one set of shapes per report)
        data = _data_shapes(input_path, verify_options) if d.get("verification") else {}
        shapes = (_run_shapes(input_path, data), _run_shapes(output_path, _edited_shapes(output_path, data)))
        at = shapes[0] or None
        at_source = "the shapes the verification's data ran at" if data else "the verifier's shapes"
        if not any(shapes):
            shapes = {}
    analysis = _both(analyze, str(input_path), str(output_path), shapes)
    memory = d.get("memory")
    if not (memory and all((memory.get(side) or {}).get("curve") is not None for side in ("before", "after"))):
        # (the Report keeps the peaks without their curves: the curves are taken from the models on disk)
        curves = _both(peak, str(input_path), str(output_path), shapes)
        memory = {**curves, "reordered": bool((memory or {}).get("reordered"))} if "before" in curves else curves
    profile = None
    if d.get("verification") and profile_runs:
        profile = _profile(str(input_path), str(output_path), d["verification"], verify_options or {}, profile_runs)
    link = None
    if diff_page is not None:
        start = os.path.dirname(os.path.abspath(page)) if page is not None else os.getcwd()
        link = os.path.relpath(os.path.abspath(diff_page), start)
    return {"input": str(input_path), "output": str(output_path), "report": d, "analysis": analysis,
            "memory": memory, "profile": profile, "diff_page": link,
            **({"at": at, "at_source": at_source} if at else {}),
            "sizes": {"before": _model_bytes(input_path), "after": _model_bytes(output_path)},
            **({"config": dict(config)} if config else {})}
