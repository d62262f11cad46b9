"""``onnxopt inspect``'s report as text: the tables of :func:`onnxopt.inspect.analysis.analyze`'s dict
(inputs and outputs, opsets, op counts, parameters, FLOPs and bytes, the top nodes and what bounds them)."""

from __future__ import annotations

from onnxopt.reporting.text import Doc, Styled, table


def _si(x, unit="") -> str:
    if x is None:
        return "-"
    for k, p in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= p:
            return f"{x / p:.3g} {k}{unit}".rstrip()
    return f"{x:g} {unit}".rstrip()


def _bytes(n) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def format_inspect(report: dict, model: str, top: int = 10):
    """The report as ``Doc``: inputs and outputs, opsets, op counts, parameters by
    dtype, totals, and the top ``top`` nodes by FLOPs and by bytes."""
    dev = report["device"]
    dims = lambda s: "?" if s is None else ("x".join(map(str, s)) if s else "scalar")  # noqa: E731
    out = [Styled(f"inspect {model}", "bold"), ""]
    out.append(table([(v["name"], "input", v["dtype"] or "-", dims(v["shape"])) for v in report["inputs"]]
                     + [(v["name"], "output", v["dtype"] or "-", dims(v["shape"])) for v in report["outputs"]],
                     ("value", "kind", "dtype", "shape"), "llll"))
    out += ["", "opsets: " + ", ".join(f"{d} {v}" for d, v in report["opsets"].items())]
    ops = list(report["op_types"].items())
    out += ["", table([(op, n) for op, n in ops], ("op type", "nodes"))]
    p = report["params"]
    rows = [(dt, f"{d['count']:,}", _bytes(d["bytes"])) for dt, d in p["by_dtype"].items()]
    rows.append((Styled("total", "bold"), f"{p['count']:,}", _bytes(p["bytes"])))
    out += ["", table(rows, ("parameters", "count", "bytes"))]
    out += ["", f"FLOPs: {_si(report['flops'])} ({report['flops']:,}; 2 per multiply-accumulate); "
                f"bytes read {_bytes(report['bytes_read'])}, written {_bytes(report['bytes_written'])}; "
                f"intensity {report['intensity'] if report['intensity'] is not None else '-'} FLOPs/byte"]
    if report["symbolic"]:
        expr = report["expr"]["flops"]
        if len(expr) > 160:
            expr = expr[:160].rsplit(" + ", 1)[0] + " + ... (the whole polynomial: --json)"
        syms = report.get("symbols") or {"inputs": [], "undetermined": []}
        notes = []
        if syms["inputs"]:
            notes.append(f"symbolic dimensions set to 1 (give them with --input-shape): {', '.join(syms['inputs'])}")
        if syms["undetermined"]:
            notes.append("dimensions shape inference could not determine, set to 1 (--input-shape cannot set "
                         f"them): {', '.join(syms['undetermined'])}")
        out.append(Styled(f"{'; '.join(notes)}; FLOPs = {expr}", "yellow"))
    if report["uncounted_op_types"]:
        out.append(f"not counted (0 FLOPs): {', '.join(report['uncounted_op_types'])}")
    if report["nodes_with_unknown_shapes"]:
        out.append(f"nodes with unknown shapes (counted as 0): {report['nodes_with_unknown_shapes']}")
    ridge = ", ".join(f"{dt} {r:g}" for dt, r in dev["ridge"].items())
    out.append(f"device: {dev['name']} ({dev['key']}): bandwidth {_si(dev['bandwidth'], 'B/s')}, peak "
               + ", ".join(f"{dt} {_si(v, 'FLOP/s')}" for dt, v in dev["peak_flops"].items())
               + f"; ridge (FLOPs/byte) {ridge}; source: {dev['source']}")
    header = ("node", "op", "FLOPs", "read", "written", "FLOPs/byte", "bound")

    def row(n):
        return (n["name"], n["op"], _si(n["flops"]), _bytes(n["bytes_read"]), _bytes(n["bytes_written"]),
                "-" if n["intensity"] is None else f"{n['intensity']:.3g}",
                Styled(n["bound"] or "-", "green" if n["bound"] == "compute" else "yellow"))

    nodes = report["nodes"]
    if top > 0 and nodes:
        by_f = sorted(nodes, key=lambda n: -n["flops"])[:top]
        by_b = sorted(nodes, key=lambda n: -(n["bytes_read"] + n["bytes_written"]))[:top]
        nodes_word = "node" if len(by_f) == 1 else "nodes"
        out += ["", Styled(f"top {len(by_f)} {nodes_word} by FLOPs", "bold"),
                table([row(n) for n in by_f], header, "llrrrrl"),
                "", Styled(f"top {len(by_b)} {nodes_word} by bytes moved", "bold"),
                table([row(n) for n in by_b], header, "llrrrrl")]
        bound = {"compute": 0, "memory": 0}
        for n in nodes:
            if n["bound"]:
                bound[n["bound"]] += 1
        out += ["", f"nodes compute-bound: {bound['compute']}, memory-bound: {bound['memory']} (on {dev['key']})"]
    return Doc(out)


__all__ = ["format_inspect"]
