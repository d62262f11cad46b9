"""The static diff page: one self-contained HTML file (no script, no network) with the summary, the
created, removed and changed nodes, the mapping, and how to open both models in Netron.

May import: nothing of onnxopt (it reads the mapping and the summary as dicts).
"""

from __future__ import annotations

import html
import json
import os
import shlex
from pathlib import Path


def html_page(before_path: str, after_path: str, m: dict, summ: dict, on_disk: tuple[bool, bool] = (True, True)) -> str:
    """One self-contained page (no script, no network): summary, created nodes, the mapping, and how
    to open each model in Netron (``on_disk``: whether each of the two names a file; a model in memory
    is only named)."""
    def e(x) -> str:
        return html.escape(str(x))
    rows = "".join(f"<tr><td>{e(op)}</td><td>{x}</td><td>{y}</td><td>{y - x:+d}</td></tr>"
                   for op, (x, y) in summ["op_types"].items())
    rules = "".join(f"<li>{e(r)}: fired {c} time(s)</li>" for r, c in summ["rules"].items()) or "<li>none recorded</li>"
    created = "".join(
        f"<tr id='n-{e(c['after'])}'><td>{e(c['after'])}</td><td>{e(c['rule'] or '(alignment)')}</td>"
        f"<td>{e(', '.join(c['replaced']))}</td><td>{e(', '.join(m['pairs'].get(c['after'], [])))}</td></tr>"
        for c in m["created"])
    removed = e(", ".join(m["removed"])) or "none"
    changed = e(", ".join(c["after"] if c["after"] == c["before"] else f"{c['before']} -> {c['after']}"
                          for c in m["changed"])) or "none"
    verify = ""
    for p, r in (summ.get("verification") or {}).items():
        verify += (f"<tr><td>{e(p)}</td><td>{e(r.get('kernels_before'))}</td><td>{e(r.get('kernels_after'))}</td>"
                   f"<td>{e(r.get('median_ms_before'))}</td><td>{e(r.get('median_ms_after'))}</td>"
                   f"<td>{e(r.get('latency_verdict') or r.get('latency_ratio'))}</td></tr>")
    if verify:
        verify = ("<h2>Verification</h2><table><tr><th>provider</th><th>kernels before</th><th>kernels after</th>"
                  f"<th>median ms before</th><th>median ms after</th><th>ratio</th></tr>{verify}</table>")
    bp, ap = (os.path.abspath(p) if disk else p for p, disk in zip((before_path, after_path), on_disk))
    counts = summ["counts"]
    if all(on_disk):
        netron = f"""<p>Netron serves one model per process: start one for each, then open the links.</p>
<pre>pip install netron   # or: pip install "onnxopt[diff]"
netron --port 8081 {e(shlex.quote(bp))} &amp;
netron --port 8082 {e(shlex.quote(ap))} &amp;</pre>
<p><a href="http://localhost:8081/">BEFORE in Netron (port 8081)</a> &middot;
<a href="http://localhost:8082/">AFTER in Netron (port 8082)</a> &middot; the side-by-side live view:
<code>python -m onnxopt diff {e(shlex.quote(bp))} {e(shlex.quote(ap))}</code></p>"""
    else:
        netron = ("<p>A model given in memory has no file to open: save it (onnx.save) and run "
                  "<code>python -m onnxopt diff BEFORE AFTER</code> for both side by side in Netron.</p>")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>onnxopt diff: {e(Path(before_path).name)} -> {e(Path(after_path).name)}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;margin:.5em 0}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left}}code{{background:#eee;padding:1px 4px}}
tr:target{{background:#ffd}}</style></head><body>
<h1>onnxopt diff</h1>
<p>BEFORE <code>{e(bp)}</code> ({summ['nodes_before']} nodes) &rarr; AFTER <code>{e(ap)}</code>
({summ['nodes_after']} nodes). Mapping from {e(m['method'])}: {counts['created']} created ({counts['fused']} fused
many&rarr;one), {counts['removed']} removed, {counts['changed']} changed, {counts['kept']} kept.</p>
<h2>Open in Netron</h2>
{netron}
<h2>Summary</h2><h3>Rules fired</h3><ul>{rules}</ul>{verify}
<h3>Op types</h3><table><tr><th>op</th><th>before</th><th>after</th><th>change</th></tr>{rows}</table>
<h2>Created nodes</h2><table><tr><th>AFTER node</th><th>rule</th><th>replaced (as recorded)</th>
<th>BEFORE nodes it stands for</th></tr>{created}</table>
<h2>Removed nodes</h2><p>{removed}</p><h2>Changed nodes</h2><p>{changed}</p>
<h2>Mapping (JSON)</h2><pre id="mapping">{e(json.dumps(m, indent=1))}</pre>
</body></html>
"""
