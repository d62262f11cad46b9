"""Every terminal table of the command line: optimize's summary, ``--list-rules``, the
verification report and its one-line summary, and bisect's report. (The JSON reports are written
by ``onnxopt.cli``; ``onnxopt.reporting.console`` draws these on a terminal.)

A report is a :class:`Doc`: a string, its plain text (what a pipe, a file or a script gets: no
escape codes, tables as aligned columns under a dashed rule), that keeps its blocks (lines,
:class:`Styled` lines, :class:`Table` s) for ``onnxopt.reporting.console`` to draw with rich and colour."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from onnxopt.core import passes
from onnxopt import targets
from onnxopt.core.pattern import Rule
from onnxopt.verify import LOW_PRECISION, PROVIDERS, problem_text
from onnxopt.verify.compare import short_number
from onnxopt.ir.input_shapes import dims_text


class Styled(str):
    """Text with a style for the terminal (rich's style names: "bold", "red", "dim green"); plain
    text is the string itself."""

    style: str

    def __new__(cls, text: str, style: str = "") -> Styled:
        obj = super().__new__(cls, text)
        obj.style = style
        return obj


@dataclasses.dataclass
class Table:
    """Rows under a header, in sections (each under its title, or None) that share the columns.
    ``align``: "l" or "r" per column (default: the first left, the others right)."""

    header: tuple
    sections: list[tuple[str | None, list[tuple]]]
    align: str = ""

    @property
    def aligns(self) -> str:
        return self.align or "l" + "r" * (len(self.header) - 1)

    def __str__(self) -> str:
        rows = [r for _, section in self.sections for r in section]
        widths = [max(len(str(r[i])) for r in [self.header, *rows]) for i in range(len(self.header))]

        def fmt(r):
            cells = (str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(r, widths, self.aligns))
            return "  ".join(cells).rstrip()

        if self.aligns[-1] == "l":  # (a text column's rule stops at its header: its lines may be long)
            widths[-1] = len(str(self.header[-1]))
        blocks = [[*([title] if title else []), fmt(self.header), "  ".join("-" * w for w in widths),
                   *map(fmt, section)] for title, section in self.sections]
        return "\n\n".join("\n".join(b) for b in blocks)


def table(rows: list[tuple], header: tuple, align: str = "") -> Table:
    return Table(header, [(None, rows)], align)


class Doc(str):
    """A report: its plain text, and its ``blocks`` (strings, Styled strings, Tables; a Doc among
    them is flattened) for ``onnxopt.reporting.console``."""

    blocks: tuple

    def __new__(cls, blocks: Sequence) -> Doc:
        flat = [part for b in blocks for part in (b.blocks if isinstance(b, Doc) else (b,))]
        obj = super().__new__(cls, "\n".join(map(str, flat)))
        obj.blocks = tuple(flat)
        return obj


def _change(n: int) -> Styled:
    return Styled(f"{n:+d}", "green" if n < 0 else "yellow" if n > 0 else "dim")


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def format_optimize(report, src: str, dst: str, sizes: tuple[int | None, int | None] = (None, None)) -> Doc:
    """``optimize()``'s report (``onnxopt.api.Report``): the op types whose node count changed
    (the others on one row), the rules that fired, the warnings, then what changed in one line and
    where it went, with the time. ``sizes``: the input's and the output's bytes (model and data
    files), where known."""
    d = report.as_dict()
    before, after = report.before, report.after
    ops = sorted(set(before) | set(after), key=lambda op: (after.get(op, 0) - before.get(op, 0), op))
    rows = [(op, before.get(op, 0), after.get(op, 0), _change(after.get(op, 0) - before.get(op, 0)))
            for op in ops if before.get(op, 0) != after.get(op, 0)]
    same = [op for op in ops if before.get(op, 0) == after.get(op, 0)]
    if same:
        kept = sum(before[op] for op in same)
        rows.append((Styled("unchanged", "dim"), kept, kept, _change(0)))
    n0, n1 = d["nodes_before"], d["nodes_after"]
    rows.append((Styled("total", "bold"), n0, n1, _change(n1 - n0)))
    out = [Styled(f"onnxopt {src} -> {dst}", "bold"), "", table(rows, ("op type", "before", "after", "change"))]
    fired = sorted(((name, st) for name, st in report.rules.items() if st.fired or st.errors),
                   key=lambda item: (-item[1].fired, item[0]))
    if fired:
        errors = any(st.errors for _, st in fired)
        out += ["", table([(name, st.tried, st.fired, st.refused, *([st.errors] if errors else []),
                            f"{st.seconds * 1e3:.1f}") for name, st in fired],
                          ("rule", "tried", "fired", "refused", *(["errors"] if errors else []), "ms"))]
    idle = [st for st in report.rules.values() if st.tried and not (st.fired or st.errors)]
    out += format_skipped(getattr(report, "skipped", None) or [], d.get("settings", {}).get("target", ""))
    out += format_fusions(getattr(report, "fusions", None) or {})
    if getattr(report, "transposes", None):
        out += ["", format_transposes(report.transposes)]
    if getattr(report, "memory", None):
        out += ["", format_memory(report.memory)]
    if getattr(report, "precision", None):
        out += ["", format_precision(report.precision)]
    if getattr(report, "advice", None):
        out += ["", format_advice(report.advice)]
    out += [""] + [Styled(f"warning: {w}", "yellow") for w in report.warnings]
    pct = f", {100 * (n1 - n0) / n0:+.1f}%" if n0 else ""
    ran = (f"{report.rewrites} rewrites by {len(fired)} rule{'s' * (len(fired) != 1)}" if fired
           else "no rule applied")
    ran += f"; {len(idle)} more tried without firing ({sum(st.seconds for st in idle) * 1e3:.0f} ms)" if idle else ""
    out.append(Styled(f"nodes {n0} -> {n1} ({n1 - n0:+d}{pct}); {ran}", "bold"))
    s = d["seconds"]
    size = f" ({_size(sizes[0])} -> {_size(sizes[1])})" if None not in sizes else ""
    out.append(f"wrote {dst}{size} in {s['total']:.2f} s: load {s['load']:.2f} s, rewrite {s['rewrite']:.2f} s"
               + (f", verify {s['verify']:.2f} s" if "verify" in s else "") + f", save {s['save']:.2f} s")
    return Doc(out)


def format_transposes(t: Mapping) -> str:
    """One line: the main graph's Transposes before and after, and the bytes (or elements, where a
    shape is symbolic) they move per inference."""
    def moved(side):
        return _size(side["bytes"]) if side.get("bytes") is not None else f"{side['elements']} elements"
    b, a = t["before"], t["after"]
    note = " (s: the symbolic dimensions)" if None in (b.get("bytes"), a.get("bytes")) else ""
    return f"transposes: {b['count']} -> {a['count']}, moving {moved(b)} -> {moved(a)} per inference{note}"


def format_memory(m: Mapping) -> str:
    """One line: the main graph's peak activation memory before and after (``onnxopt.transforms.memory``), with
    "at least" where a value's size is unknown (counted as 0)."""
    def side(p):
        return ("at least " if p.get("lower_bound") else "") + _size(p["peak_bytes"])
    note = " (reordered)" if m.get("reordered") else ""
    b, a = m["before"].get("onnxruntime_peak_bytes"), m["after"].get("onnxruntime_peak_bytes")
    ort = f"; in onnxruntime's order {_size(b)} -> {_size(a)}" if None not in (b, a) and (b, a) != (
        m["before"]["peak_bytes"], m["after"]["peak_bytes"]) else ""
    at = m["before"].get("at") or m["after"].get("at")
    source = "the shapes the verification data ran at" if m.get("at_source") == "data" else \
        "the verifier's generated shapes"
    at = f" (symbolic inputs at {', '.join(f'{k} {dims_text(v)}' for k, v in at.items())}: {source})" if at else ""
    return f"peak activation memory: {side(m['before'])} -> {side(m['after'])}{note}{ort}{at}"


def format_fusions(fusions: Mapping[str, Mapping]) -> list:
    """One line per fusion that had candidates: hits, misses and the reasons it missed."""
    lines = []
    for name, f in sorted(fusions.items()):
        if not (f["hits"] or f["missed"]):
            continue
        why = "; ".join(f"{reason} ({n})" for reason, n in f["reasons"].items())
        lines.append(f"  {name}: {f['hits']} fused" + (f", {f['missed']} missed: {why}" if f["missed"] else ""))
    return ["", "fusions:", *lines] if lines else []


def format_precision(p: Mapping) -> str:
    """The float16 conversion in one paragraph: nodes converted and kept, Casts, weight bytes."""
    kept = sorted(p.get("kept_fp32", {}).items(), key=lambda kv: -kv[1])[:4]
    mib = 1 << 20
    text = (f"float16: {p.get('nodes_fp16', 0)} nodes converted, {p.get('nodes_fp32', 0)} kept float32"
            + (" (" + ", ".join(f"{k} x{n}" for k, n in kept) + ")" if kept else "")
            + f"; {p.get('casts', 0)} Casts; weights {p.get('weight_bytes_before', 0) / mib:.1f} -> "
            f"{p.get('weight_bytes_after', 0) / mib:.1f} MiB; input and output types "
            + ("kept" if p.get("keep_io_types", True) else "float16"))
    rg = p.get("ranges")
    if rg and rg.get("values_kept"):  # values float16 cannot hold (precision.Converter._limits)
        text += (f"; {rg['values_kept']} value(s) float16 cannot hold, by "
                 + ("the data" if rg.get("source", "").startswith("values at the data") else
                    "bounds from the weights and constants") + ": " + ", ".join(
                     f"{k} ({v})" for k, v in list(rg.get("values", {}).items())[:3]))
    if rg and not rg.get("source", "").startswith("values at the data"):
        text += "; float16's range judged by bounds from the weights only (with --verify, at its inputs too)"
    fb = p.get("fallback")
    if fb:
        text += f"; fidelity fallback: {fb}" if not isinstance(fb, Mapping) else \
            f"; fidelity fallback kept {len(fb.get('kept', fb.get('nodes', [])))} more node(s) float32"
    return text


def format_skipped(skipped: Sequence[Mapping], target: str) -> list:
    """The rules left out for the target (``Report.skipped``): those the measured benefit table
    leaves out, one line each with its reason and evidence; those not valid for the target, on one
    line."""
    out = []
    benefit = [s for s in skipped if s.get("why") == "benefit"]
    other = [s["rule"] for s in skipped if s.get("why") == "target"]
    if benefit:
        out += ["", Styled(f"skipped for {target} by the measured benefit table (onnxopt/data/benefit.json):", "bold")]
        out += [f"  {s['reason']}" for s in benefit]
    if other:
        shown = ", ".join(other[:8]) + (f", ... ({len(other) - 8} more in the JSON report)" if len(other) > 8 else "")
        out += [Styled(f"{len(other)} rule{'s' * (len(other) != 1)} not valid for {target}: {shown}", "dim")]
    return out


def format_advice(advice: Mapping) -> Doc:
    """Session advice (``onnxopt.targets.advice.advise``): the provider options the model benefits from,
    with the evidence, those that do not apply and why, and the CPU islands."""
    out = [Styled(f"session advice for {advice['target']}:", "bold")]
    for o in advice.get("provider_options", ()):
        tag = "measured" if o.get("measured") else "not measured"
        out.append(Styled(f"  {o['option']}={o['value']} ({o['why']}; {tag}): {o['evidence']}", "green"))
        if o.get("caveat"):
            out.append(Styled(f"    but {o['caveat']}", "yellow"))
    opts = [o["flag"] for o in advice.get("provider_options", ()) if o.get("advised")]
    if opts:
        out.append(f"  see it: onnxopt verify ORIGINAL OPTIMIZED --providers cuda {' '.join(opts)}")
    for o in advice.get("not_advised", ()):
        out.append(Styled(f"  not {o['option']}: {o.get('evidence') or o.get('why')}", "dim"))
    isl = advice.get("cpu_islands") or {}
    if isl:
        if isl.get("cpu_nodes"):
            ops = ", ".join(f"{op} {n}" for op, n in list(isl["by_op"].items())[:8])
            why = ", ".join(f"{r} {n}" for r, n in isl["by_reason"].items())
            out.append(Styled(f"  CPU islands: {isl['cpu_nodes']} of {isl['nodes']} nodes would run on the CPU under "
                              f"onnxruntime's CUDA provider ({why}): {ops}", "yellow"))
            if isl.get("dynamic_inputs"):
                out.append("  fixing the dynamic inputs (--input-shape) lets onnxopt fold the shape arithmetic")
        else:
            out.append(f"  CPU islands: none of {isl['nodes']} nodes would run on the CPU under onnxruntime's CUDA "
                       "provider (static estimate)")
    return Doc(out)


def _targets_text(names) -> str:
    return "all" if set(names) >= set(targets.TARGETS) else ",".join(t for t in targets.TARGETS if t in names)


def _exactness(thing) -> str:
    exact = getattr(thing, "exact", None)
    return "?" if exact is None else "exact" if exact else "tolerance"


def format_rules(rules: Sequence[Rule], graph_passes: Sequence[str], families: Mapping[int, str],
                 target: str, skipped: Sequence[Mapping] = ()) -> Doc:
    """``--list-rules``: a header, the rules grouped by family (``families``: ``id(rule)`` -> the
    file it comes from, in the order to show them), each with its root op type, priority, targets
    and exactness, then the whole-graph passes; ``skipped`` (``registry.select``'s record): the rules
    the measured benefit table leaves out for the target, with why."""
    groups: dict[str, list[Rule]] = {}
    for rule in rules:
        groups.setdefault(families.get(id(rule), "other rules"), []).append(rule)
    head = Styled(f"{len(rules)} rules in {len(groups)} famil{'ies' if len(groups) != 1 else 'y'} and "
                  f"{len(graph_passes)} graph passes, for target {target} (--target {'|'.join(targets.TARGETS)})",
                  "bold")
    legend = ("targets: where a rule may run (all: " + ", ".join(targets.TARGETS) + "); exactness: exact (the "
              "same bits on onnxruntime's CPU provider), tolerance (within float rounding), ? (not declared)")
    sections = [(Styled(f"{family}: {len(members)} rule{'s' * (len(members) != 1)}", "bold cyan"),
                 [(r.name, r.pattern.op_type, r.priority, _targets_text(r.targets), _exactness(r), r.summary)
                  for r in members]) for family, members in groups.items()]
    out = [head, Styled(legend, "dim")]
    if sections:
        out += ["", Table(("rule", "matches", "priority", "targets", "exactness", "does"), sections, "llrlll")]
    if graph_passes:
        rows = [(p.name, p.phase.when, _exactness(p), p.doc) for p in passes.lookup(graph_passes)]
        out += ["", Table(("pass", "runs", "exactness", "does"),
                          [(Styled("graph passes (onnxopt/library/passes.py)", "bold cyan"), rows)], "llll")]
    benefit = [s for s in skipped if s.get("why") == "benefit"]
    if benefit:
        out += ["", Styled(f"left out for {target} by the measured benefit table (onnxopt/data/benefit.json):", "bold")]
        out += [f"  {s['reason']}" for s in benefit]
    return Doc(out)


def _output_rows(rows: list[dict]) -> list[tuple]:
    out = []
    for r in rows:
        sqnr = f"SQNR {r['sqnr_db']:.1f} dB" if isinstance(r.get("sqnr_db"), float) else ""
        if "error_of_range" in r:  # a float16 model against its float32 original: its own criterion
            sqnr = f"error {r['error_of_range']:.2%} of range" + (
                f", top-1 {r['top1_agreement']:.1%}" if r.get("top1_agreement") is not None else "")
        status = (Styled(f"ok ({sqnr})" if sqnr else "ok", "green") if r["ok"] else
                  Styled(f"DIFFERS ({r['problem']})" if r.get("problem") else "DIFFERS", "bold red"))
        shape = (dims_text(r["shape_after"]) if "shape_after" in r else
                 f"seq[{r['length']}]" if "length" in r else r.get("kind", "-"))
        out.append((r["name"], shape, r.get("dtype_after", "-"),
                    short_number(r.get("max_abs")), short_number(r.get("max_rel")), short_number(r.get("p99_abs")),
                    short_number(r.get("cosine"), 7),
                    "-" if "error_of_range" in r else f"{r.get('out_of_tolerance', '-')}/{r.get('elements', '-')}",
                    "fp16 bounds" if "error_of_range" in r else f"{short_number(r.get('rtol'))}/{short_number(r.get('atol'))}",
                    status))
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
    lines = [Styled(f"{label}: first diverging value {c['value']!r} (of {c['compared_values']} shared), produced "
                    f"by {n['op_type']} {n['name']!r}{how}", "red"), f"  {problem_text(c['stats'])}"]
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


def format_verification(report: dict) -> Doc:
    """``onnxopt.verify.verify``'s report: the inputs, then per provider the outputs compared, the
    kernels, the latency and the culprit; the cross-provider comparisons, bisect's result and the verdict."""
    lines = [Styled(f"verify {report['original']} -> {report['optimized']}", "bold")]
    ins = ", ".join(f"{k} {dims_text(v['shape'])} {v['dtype']} ({v['source']}"
                    + (f", {v['range'][0]}..{v['range'][1]}" if "range" in v else "")
                    + ("; sizes the model does not declare, chosen by onnxopt: " + ", ".join(
                        f"dimension {a} = {v['shape'][int(a)]} ({why})" for a, why in v["chosen"].items())
                       + "; --input-shape sets them" if v.get("chosen") else "") + ")"
                    for k, v in report["inputs"].items())
    lines.append(f"inputs (seed {report['seed']}): {ins or 'none'}")
    if report.get("provider_options"):
        lines.append("provider options: " + "; ".join(f"{p}: " + ", ".join(f"{k}={v}" for k, v in o.items())
                                                      for p, o in report["provider_options"].items()))
    for line in report.get("edges") or ():  # (other input/output layouts: onnxopt.transforms.edges)
        lines.append(line)
    if report.get("int8"):
        lines.append(f"int8 model against its float model: {report['int8']['criterion']} (the elementwise figures, at "
                     f"rtol {LOW_PRECISION[0]}, atol {LOW_PRECISION[1]}, for information)")
    elif report.get("fp16"):
        lines.append(f"float16 model against its float32 original: {report['fp16']['criterion']}")
    elif report.get("low_precision"):
        lines.append(f"fp16/bf16/int8 model: float32 outputs compared at rtol {LOW_PRECISION[0]}, atol "
                     f"{LOW_PRECISION[1]}")
    for p, e in report["providers"].items():
        lines += ["", Styled(f"== {p.upper()} ({PROVIDERS[p]}): {'outputs agree' if e['ok'] else 'OUTPUTS DIFFER'}",
                             "bold green" if e["ok"] else "bold red"),
                  table(_output_rows(e["outputs"]), _OUT_HEADER)]
        if e.get("error"):
            lines.append(Styled(e["error"], "red"))
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
            lines.append(table([(op, b, a, _change(a - b)) for op, b, a in changed],
                                ("kernels by op type", "before", "after", "change")))
        lat = e.get("latency")
        if lat and "before" in lat and "after" in lat:
            lines += _latency_lines(lat)
        if e.get("decode"):
            from onnxopt.verify import decode_text

            lines.append(Styled(decode_text(e["decode"]), "" if e["decode"]["ok"] else "bold red"))
        lines += _culprit_lines(e.get("culprit") or {})
    lines += _fp16_arith_lines(report.get("fp16") or report.get("fp16_arithmetic") or {})
    for key, by_label in report.get("cross_provider", {}).items():
        for label, rows in by_label.items():
            model = "original" if label == "before" else "optimized"
            lines += ["", Styled(f"== {key}, {model} model (informational)", "bold"),
                      table(_output_rows(rows), _OUT_HEADER)]
    if report.get("coverage"):
        lines += ["", format_coverage(report["coverage"])]
    lines += _bisect_lines(report)
    arith = (report.get("fp16") or report.get("fp16_arithmetic") or {}).get("arithmetic")
    lines += ["", Styled("verdict: " + ("outputs agree on " + ", ".join(report["providers"])
                                        + (f" and in {_arith_short(arith)}" if arith else "") if report["ok"]
                                        else summary_line(report)), "bold green" if report["ok"] else "bold red")]
    return Doc(lines)


def latency_style(lat: Mapping) -> str:
    """The colour of a latency comparison: green or yellow only for a change whose interval excludes
    1.0 (``verdict`` "faster"/"slower"); a change within the noise is not coloured."""
    return {"faster": "green", "slower": "yellow"}.get(lat.get("verdict"), "")


def _latency_lines(lat: Mapping) -> list:
    threads = lat.get("threads")
    how = (f"{lat['rounds']} interleaved rounds after {lat['warmup']} warm-up"
           + (f", {'onnxruntime default' if threads == 0 else threads} intra-op thread"
              f"{'s' if threads != 1 else ''}" if threads is not None else ""))
    figures = (f"median {lat['before']['median_ms']:.3f} -> {lat['after']['median_ms']:.3f} ms, "
               f"p90 {lat['before']['p90_ms']:.3f} -> {lat['after']['p90_ms']:.3f} ms")
    if "verdict" not in lat:  # (a report from before the interval was kept)
        return [f"latency ({how}): {figures} (x{lat.get('ratio_median', float('nan')):.3f})"]
    from onnxopt.verify import latency_text

    return [f"latency ({how}): {figures}",
            Styled(f"latency: optimized {latency_text(lat)}", latency_style(lat))]


def _arith_short(arith: str) -> str:
    """'float16 arithmetic (every op's output rounded ...)' -> the words before the parenthesis, and its provider."""
    return "float16 arithmetic" + (" (onnx's reference evaluator)" if "reference" in arith else
                                   " (emulated: each op's output rounded to float16)")


def _fp16_arith_lines(f: Mapping) -> list:
    """The float16 model judged in float16 arithmetic (onnxopt.verify.fp16.judge)."""
    if "ok" not in f:
        return []
    head = "== FLOAT16 ARITHMETIC: " + ("outputs agree" if f["ok"] else "OUTPUTS DIFFER")
    lines = ["", Styled(head, "bold green" if f["ok"] else "bold red"),
             f"arithmetic: {f.get('arithmetic') or 'none could run'}; {f.get('note', '')}"]
    if f.get("error"):
        return lines + [Styled(f["error"], "red")]
    return lines + [table(_output_rows(f.get("outputs") or []), _OUT_HEADER)]


def summary_line(report: dict) -> str:
    """One line naming the worst output, the culprit and the rewrite bisect found, for errors."""
    p, entry = next(((p, e) for p, e in report["providers"].items() if not e["ok"]), (None, None))
    f = report.get("fp16") or report.get("fp16_arithmetic") or {}
    if entry is None and f.get("ok") is False:  # agree on the providers, not in float16 arithmetic
        if f.get("error"):
            return f["error"]
        r = next(r for r in f["outputs"] if not r["ok"])
        return (f"outputs differ in {_arith_short(f['arithmetic'])}: {r['name']}: {problem_text(r)} "
                f"({f.get('note', '')}; onnxruntime's CPU provider computes many float16 ops in float32)")
    if entry is None:
        return "outputs agree" + (f" (and in {_arith_short(f['arithmetic'])})" if f.get("arithmetic") else "")
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


def format_bisect(report: dict) -> Doc:
    """``onnxopt.verify.bisect.bisect``'s report: the rewrite after which outputs differ, its steps, the
    outputs and the first diverging value right after it; the culprit on the last line."""
    lines = [Styled(f"bisect {report['model']} on {report['provider']} ({report['rewrites']} rewrites in the full "
                    "run)", "bold")]
    if report.get("arithmetic"):  # a float16 model: outputs in float16 arithmetic (onnxopt.verify.fp16)
        lines.append(f"outputs in {report['arithmetic']}")
    lines += [Styled(f"warning: {w}", "yellow") for w in report.get("warnings", ())]
    if report["ok"]:
        return Doc(lines + [Styled(report["message"], "green")])
    n = report["first_failing_rewrite"]
    lines.append(Styled(f"outputs differ after rewrite {n}" + (f" (the model is fine after {n - 1})" if n > 0 else ""),
                        "red"))
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
    c = report.get("culprit") or {}
    lines += _culprit_lines(c, f"right after it, against {c['compared_with']}" if c.get("compared_with")
                            else "right after it")
    lines.append(Styled(f"culprit: {report.get('culprit_rule') or 'unknown'}", "bold red"))
    return Doc(lines)


def _db(x) -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "inf" if x == float("inf") else f"{x:.1f} dB"


def format_quantize(report, src: str, dst: str) -> Doc:
    """``quantize()``'s report (``onnxopt.quantize.api.QuantizeReport``): the target's rules, the
    calibration, fidelity (output SQNR, the worst layers, the fallback), the integer-kernel coverage,
    the latency check, and what was written."""
    d = report.as_dict()
    s, cal, fid = d["settings"], d["calibration"], d["fidelity"]
    out = [Styled(f"onnxopt quantize {src} -> {dst}", "bold"), ""]
    tr = s.get("target_rules") or {}
    out.append(f"target {s['target']}: activations {tr.get('activation_dtype', '?')}, weights "
               f"{tr.get('weight_dtype', '?')} {'per channel' if s['per_channel'] else 'per tensor'}, "
               f"reduce_range {'on' if tr.get('reduce_range') else 'off'}")
    out += [Styled(f"  - {rule}", "dim") for rule in tr.get("followed", ())]
    out.append(f"calibration: {cal['method']} over {cal['calibrated_on']} sample(s), {cal['tensors']} tensors; "
               f"{cal['held_out']} held out for fidelity")
    est = fid.get("estimate") or {}
    ci = est.get("interval_db") or {}
    rows = [(name, _db(v)) + ((f"{_db(ci[name][0])} .. {_db(ci[name][1])}" if ci.get(name) else "-",)
                               if est else ()) for name, v in fid["output_sqnr_db"].items()]
    where = (f"on {est['samples']} {'held-out' if est.get('held_out') else 'calibration'} sample(s)"
             if est else "")
    out += ["", table(rows, ("output", f"SQNR vs float {where}".strip()) + (
        (f"{100 * est.get('confidence', 0.9):.0f}% interval (bootstrap over the samples)",) if est else ()))]
    worst = list(fid["layer_sqnr_db"].items())[:5]
    if worst:
        out += ["", table([(name, _db(v)) for name, v in worst], ("worst layers (tensor)", "SQNR"))]
    fb = fid.get("fallback")
    if fb:
        excluded = fb.get("excluded") or []
        out.append(f"fallback: {len(excluded)} node(s) left float to reach {_db(fid['min_db'])}"
                   + (f": {', '.join(excluded[:6])}{' ...' if len(excluded) > 6 else ''}" if excluded else ""))
    if d.get("coverage"):
        out += ["", format_coverage(d["coverage"], islands=12)]
    lat = d.get("latency")
    if lat and lat.get("mode") == "table":
        out.append("")
        if lat.get("ratio") is not None:
            out.append(f"keep-float auto, by the shipped cost table ({lat.get('table')}, {lat.get('threads')}-thread "
                       f"figures): int8 x{lat['ratio']:.3f} of float over the {lat.get('nodes')} quantized node(s) it "
                       "covers; the entries that decided:")
            out.append(table([(e["entry"], e["nodes"], f"{100 * e['share']:.1f}%", f"x{e['ratio']:.3f}")
                              for e in (lat.get("entries") or [])[:8]],
                             ("table entry", "nodes", "share of float time", "int8/float")))
    elif lat:
        out.append("")
        f, q = lat.get("float_ms", {}), lat.get("int8_ms", {})
        out.append(f"latency ({lat.get('rounds')} interleaved rounds): float median {f.get('median', 0):.3f} ms "
                   f"(p10 {f.get('p10', 0):.3f}, p90 {f.get('p90', 0):.3f}), int8 median {q.get('median', 0):.3f} ms "
                   f"(p10 {q.get('p10', 0):.3f}, p90 {q.get('p90', 0):.3f}): x{lat.get('ratio', 0):.3f}"
                   + (f", 90% interval x{lat['ratio_ci90'][0]:.3f}-x{lat['ratio_ci90'][1]:.3f}"
                      if lat.get("ratio_ci90") else "")
                   + (f", {lat['threads'] or 'default'} thread(s), measured on this machine" if "threads" in lat else ""))
    out += [""] + [Styled(f"warning: {w}", "yellow") for w in d["warnings"]]
    style = "bold green" if report.kept == "int8" else "bold yellow"
    out.append(Styled(f"kept {report.kept}: {report.reason}", style))
    out.append(f"wrote {dst} in {d['seconds'].get('total', 0):.1f} s ("
               + ", ".join(f"{k} {v:.1f} s" for k, v in d["seconds"].items() if k != "total") + ")")
    return Doc(out)


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def format_coverage(cov: dict, *, islands: int = 40) -> Doc:
    """``onnxopt.quantize.coverage.Coverage.as_dict()``: which nodes onnxruntime runs as integer
    kernels, by op type, then the float islands with the reason for each (the first ``islands``;
    the JSON report has them all), and the Q/DQ left in the graph it runs."""
    if "error" in cov:
        return Doc([Styled(f"integer kernels: not known ({cov['error']})", "yellow")])
    s = cov["summary"]
    head = (f"integer kernels ({cov['provider'].upper()}): {s['compute_integer']}/{s['compute_nodes']} compute nodes "
            f"({_percent(s['compute_integer'], s['compute_nodes'])}), {s['movement_integer']} data-movement ops on "
            f"8-bit tensors")
    out = [Styled(head, "bold")]
    kernels: dict[str, dict[str, int]] = {}
    for n in cov["integer"]:
        k = n["kernel"] if n["kind"] != "fused" else "(fused)"
        kernels.setdefault(n["op"], {})
        kernels[n["op"]][k] = kernels[n["op"]].get(k, 0) + 1
    rows = []
    for op, c in cov["by_op"].items():
        runs_as = ", ".join(f"{k} {v}" for k, v in sorted(kernels.get(op, {}).items()))
        integer, floats = c["integer"] + c["movement_integer"], c["float"] + c["movement_float"]
        rows.append((op, integer, Styled(str(floats), "yellow") if floats else floats, runs_as or "-"))
    out.append(table(rows, ("op type", "integer", "float", "runs as"), "lrrl"))
    groups: dict[tuple, list[str]] = {}  # islands with the same op, kernel and reason on one row
    for n in cov["float_islands"] + cov["float_movement"]:
        groups.setdefault((n["op"], n["kernel"], n["reason"]), []).append(n["node"])
    if groups:
        shown = [(names[0] if len(names) == 1 else f"{len(names)} nodes, e.g. {names[0]}", op, kernel, reason)
                 for (op, kernel, reason), names in list(groups.items())[:islands]]
        out += ["", table(shown, ("float island", "op", "runs as", "why"), "llll")]
        if len(groups) > islands:
            out.append(Styled(f"... and {len(groups) - islands} more rows (in the JSON report)", "dim"))
    q = cov["qdq_left"]
    added = ", ".join(f"{n} {op}" for op, n in cov["added"].items())
    out.append(f"left in onnxruntime's graph: {q.get('quantize', 0)} QuantizeLinear, {q.get('dequantize', 0)} "
               f"DequantizeLinear of activations, {q.get('dequantize_constant', 0)} of weights"
               + (f"; added by onnxruntime: {added}" if added else ""))
    return Doc(out)
