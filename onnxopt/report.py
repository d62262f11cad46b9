"""Every terminal table of the command line: optimize's before/after table, ``--list-rules``,
the verification report and its one-line summary, and bisect's report. (The JSON reports are
written by ``onnxopt.cli``.)"""

from __future__ import annotations

from collections.abc import Sequence

from . import passes, targets
from .pattern import Rule
from .verify import LOW_PRECISION, PROVIDERS, problem_text
from .verify.compare import short_number
from .verify.inputs import dims_text


def table(rows: list[tuple], header: tuple) -> str:
    """Rows under a header, columns aligned (the first left, the others right)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def format_optimize(report, src: str, dst: str) -> str:
    """``optimize()``'s report (``onnxopt.api.Report``): nodes per op type before and after, the
    rules tried, the rewrites and the time."""
    d = report.as_dict()
    ops = sorted(set(report.before) | set(report.after))
    rows = [(op, report.before.get(op, 0), report.after.get(op, 0),
             f"{report.after.get(op, 0) - report.before.get(op, 0):+d}") for op in ops]
    rows.append(("total", d["nodes_before"], d["nodes_after"], f"{d['nodes_after'] - d['nodes_before']:+d}"))
    out = [f"onnxopt {src} -> {dst}", "", table(rows, ("op type", "before", "after", "change"))]
    fired = [(name, st.tried, st.fired, st.refused, f"{st.seconds * 1e3:.1f}")
             for name, st in report.rules.items() if st.tried]
    if fired:
        out += ["", table(fired, ("rule", "tried", "fired", "refused", "ms"))]
    s = d["seconds"]
    out += ["", f"{report.rewrites} rewrites; time: load {s['load']:.3f} s, rewrite {s['rewrite']:.3f} s, "
                f"save {s['save']:.3f} s, total {s['total']:.3f} s"]
    out += [f"warning: {w}" for w in report.warnings]
    return "\n".join(out)


def rule_lines(rules: Sequence[Rule], graph_passes: Sequence[str]) -> list[str]:
    """``--list-rules``: one line per rule (name, op type, priority, targets, exact or not, summary),
    then one per whole-graph pass."""
    def valid(names) -> str:
        return ",".join(t for t in targets.TARGETS if t in names)

    def exact(flag) -> str:
        return "exact" if flag else "-" if flag is False else "?"

    lines = [f"{rule.name:<28} {rule.pattern.op_type:<20} p={rule.priority:<3} [{valid(rule.targets)}] "
             f"{exact(rule.exact):<5}  {rule.summary}" for rule in rules]
    return lines + [f"{name:<28} {'(graph pass)':<20} {'':<5} [{valid(targets.TARGETS)}] "
                    f"{exact(passes.BY_NAME[name].exact):<5}  {passes.BY_NAME[name].doc}" for name in graph_passes]


def _output_rows(rows: list[dict]) -> list[tuple]:
    out = []
    for r in rows:
        status = "ok" if r["ok"] else f"DIFFERS ({r['problem']})" if r.get("problem") else "DIFFERS"
        shape = (dims_text(r["shape_after"]) if "shape_after" in r else
                 f"seq[{r['length']}]" if "length" in r else r.get("kind", "-"))
        out.append((r["name"], shape, r.get("dtype_after", "-"),
                    short_number(r.get("max_abs")), short_number(r.get("max_rel")), short_number(r.get("p99_abs")),
                    short_number(r.get("cosine"), 7), f"{r.get('out_of_tolerance', '-')}/{r.get('elements', '-')}",
                    f"{short_number(r.get('rtol'))}/{short_number(r.get('atol'))}", status))
    return out


_OUT_HEADER = ("output", "shape", "dtype", "max abs", "max rel", "p99 abs", "cosine", "out of tol", "rtol/atol",
               "status")


def _named(value: str, producer: dict | None) -> str:
    return f"{value!r}" + (f" ({producer['op_type']} {producer['name']!r})" if producer else "")


def _culprit_lines(c: dict, label: str = "culprit") -> list[str]:
    """The first diverging value, its producer, and a rule only where ``onnxopt.verify.culprit`` tied one."""
    if not c.get("value"):
        return [f"{label}: {c.get('message')}"] if c.get("message") else []
    n = c["node"]
    if c.get("rule"):
        how = (f", created by rule {c['rule']} from {', '.join(c['replaced'])}: from the values those nodes read, "
               "it computes a different one")
    elif n.get("provenance"):
        how = f", a node a rewrite made in place of {', '.join(n['provenance']['sources'])}"
    else:
        how = ", an original node"
    lines = [f"{label}: first diverging value {c['value']!r} (of {c['compared_values']} shared), produced by "
             f"{n['op_type']} {n['name']!r}{how}", f"  {problem_text(c['stats'])}"]
    read_before = ", ".join(_named(r["name"], r["producer"]) for r in c.get("read_before", [])) or "only weights"
    lines += [f"  it reads {_named(i['now'], i['producer_now'])}, which agrees with no value the original read "
              f"there ({read_before})" for i in c.get("inputs", []) if not i["agrees"]]
    if c.get("reason"):
        lines.append(f"  no rule is named: {c['reason']}")
    return lines


def _bisect_lines(report: dict) -> list[str]:
    b = report.get("bisect")
    if b is None:
        return [f"to find the rewrite: {report['bisect_command']}"] if report.get("bisect_command") else []
    if "skipped" in b:
        return [f"bisect {b['skipped']}; to find the rewrite: {report.get('bisect_command', 'onnxopt bisect')}"]
    return ["", format_bisect(b)]


def format_verification(report: dict) -> str:
    """``onnxopt.verify.verify``'s report: the inputs, then per provider the outputs compared, the
    kernels, the latency and the culprit; the cross-provider comparisons, bisect's result and the verdict."""
    lines = [f"verify {report['original']} -> {report['optimized']}"]
    ins = ", ".join(f"{k} {dims_text(v['shape'])} {v['dtype']} ({v['source']}"
                    + (f", {v['range'][0]}..{v['range'][1]}" if "range" in v else "") + ")"
                    for k, v in report["inputs"].items())
    lines.append(f"inputs (seed {report['seed']}): {ins or 'none'}")
    if report.get("low_precision"):
        lines.append(f"fp16/bf16/int8 model: float32 outputs compared at rtol {LOW_PRECISION[0]}, atol "
                     f"{LOW_PRECISION[1]}")
    for p, e in report["providers"].items():
        lines += ["", f"== {p.upper()} ({PROVIDERS[p]}): {'outputs agree' if e['ok'] else 'OUTPUTS DIFFER'}",
                  table(_output_rows(e["outputs"]), _OUT_HEADER)]
        if e.get("error"):
            lines.append(e["error"])
            continue
        if p == "cuda":
            lines.append("(CUDA outputs are compared with TF32 off, use_tf32=0; latency runs with the defaults)")
        kb, ka = e["kernels"]["before"], e["kernels"]["after"]
        prov = lambda k: ", ".join(f"{n.replace('ExecutionProvider', '')} {c}" for n, c in k["by_provider"].items())  # noqa: E731
        lines.append(f"kernels per run: {kb['kernels']} -> {ka['kernels']} ({ka['kernels'] - kb['kernels']:+d}); "
                     f"by provider: before {prov(kb) or '-'}; after {prov(ka) or '-'}; "
                     f"Memcpy {kb['memcpy']} -> {ka['memcpy']}")
        ops = sorted(set(kb["by_op"]) | set(ka["by_op"]))
        changed = [(op, kb["by_op"].get(op, 0), ka["by_op"].get(op, 0)) for op in ops
                   if kb["by_op"].get(op, 0) != ka["by_op"].get(op, 0)]
        if changed:
            lines.append(table([(op, b, a, f"{a - b:+d}") for op, b, a in changed],
                                ("kernels by op type", "before", "after", "change")))
        lat = e.get("latency")
        if lat and "before" in lat and "after" in lat:
            lines.append(f"latency ({lat['rounds']} interleaved runs after {lat['warmup']} warm-up): "
                         f"median {lat['before']['median_ms']:.3f} -> {lat['after']['median_ms']:.3f} ms "
                         f"(x{lat.get('ratio_median', float('nan')):.3f}), p90 {lat['before']['p90_ms']:.3f} -> "
                         f"{lat['after']['p90_ms']:.3f} ms (x{lat.get('ratio_p90', float('nan')):.3f})")
        lines += _culprit_lines(e.get("culprit") or {})
    for key, by_label in report.get("cross_provider", {}).items():
        for label, rows in by_label.items():
            model = "original" if label == "before" else "optimized"
            lines += ["", f"== {key}, {model} model (informational)",
                      table(_output_rows(rows), _OUT_HEADER)]
    lines += _bisect_lines(report)
    lines += ["", "verdict: " + ("outputs agree on " + ", ".join(report["providers"]) if report["ok"]
                                 else summary_line(report))]
    return "\n".join(lines)


def summary_line(report: dict) -> str:
    """One line naming the worst output, the culprit and the rewrite bisect found, for errors."""
    p, entry = next(((p, e) for p, e in report["providers"].items() if not e["ok"]), (None, None))
    if entry is None:
        return "outputs agree"
    if entry.get("error"):
        text = entry["error"]
    else:
        r = next(r for r in entry["outputs"] if not r["ok"])
        text = f"outputs differ on {p}: {r['name']}: {problem_text(r)}"
    c = entry.get("culprit") or {}
    if c.get("value"):
        text += f"; first diverging value {c['value']!r} from {c['node']['op_type']} {c['node']['name']!r}"
        if c.get("rule"):
            text += f" (rule {c['rule']})"
    b = report.get("bisect") or {}
    if b.get("culprit_rule"):
        text += f"; bisect: rewrite {b['first_failing_rewrite']} of {b['rewrites']}, {b['culprit_rule']}"
    elif report.get("bisect_command"):
        text += f"; to find the rewrite: {report['bisect_command']}"
    return text


def format_bisect(report: dict) -> str:
    """``onnxopt.bisect.bisect``'s report: the rewrite after which outputs differ, its steps, the
    outputs and the first diverging value right after it; the culprit on the last line."""
    lines = [f"bisect {report['model']} on {report['provider']} ({report['rewrites']} rewrites in the full run)"]
    lines += [f"warning: {w}" for w in report.get("warnings", ())]
    if report["ok"]:
        return "\n".join(lines + [report["message"]])
    n = report["first_failing_rewrite"]
    lines.append(f"outputs differ after rewrite {n}" + (f" (the model is fine after {n - 1})" if n > 0 else ""))
    if report.get("message"):
        lines.append(report["message"])
    for s in report["steps"]:
        if "rule" in s:
            lines.append(f"  rule {s['rule']}: replaced {', '.join(s['replaced'])} with "
                         f"{', '.join(s['created']) or 'nothing (forwarded a value)'}")
        else:
            lines.append(f"  pass {s['pass']}: {s['rewrites']} merges")
    if report.get("error"):
        lines.append(f"  {report['error']}")
    if report.get("outputs"):
        lines.append(table(_output_rows(report["outputs"]), _OUT_HEADER))
    lines += _culprit_lines(report.get("culprit") or {}, "right after it")
    lines.append(f"culprit: {report.get('culprit_rule') or 'unknown'}")
    return "\n".join(lines)
