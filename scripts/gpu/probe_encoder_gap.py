"""CUDA probe of the gap left on BERT-base eager legacy (issue 29): where do onnxopt's few extra microseconds
against onnxruntime's transformers optimizer go, and which exact mask build closes them?

The peer's graph reads the attention mask as 1-D sequence lengths (EmbedLayerNormalization's mask_index: the
count of ones per row), which is exact only for right padding; onnxopt builds an additive attention_bias
[B,1,S,T] once (exact for any mask) with five small nodes. This probe builds the benchmark's model with the
project's builder (scripts.bench.targets), optimizes it with both tools, derives variants of onnxopt's graph by
surgery, and measures every variant of one precision and batch in one interleaved run:

- ``original``, ``peer`` (optimize_model, model_type bert, num_heads 12, hidden_size 768, ``--opt-level``,
  use_gpu; fp16 by its converter with keep_io_types), ``onnxopt`` (``--target ort-cuda``);
- ``onnxopt-expand``: the same exact bias built as Where on [B,1,1,T] then Expand to the shape of the mask's
  [B,1,T,1] view (Shape of a GPU tensor, read on the host without a copy): 3 kernels instead of 4;
- ``onnxopt-bias-input``: the bias fed as a graph input (what any build could save at most);
- ``onnxopt-lengths``: onnxopt's graph with the peer's mask form (EmbedLayerNormalization's mask_index as the
  Attention's 1-D mask; NOT exact for left padding): what the graphs differ by besides the mask.

For each: nodes, kernels by provider and Memcpy (onnxruntime's profiler), the largest error against the
original on a right-padded and a left-padded batch, latency (session.run with host inputs, as the target
benchmark times it; median, p10, p90, samples) and the ratio to the peer with its 90% paired bootstrap
interval. With ``--cupti`` a child process also records the CUDA kernels of 20 runs of each (torch's profiler;
GPU time per run and kernel launches per run).

    python3 -m scripts.gpu.probe_encoder_gap --json OUT.json [--model bert-base-eager-legacy] [--runs 300]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _consumers(g):
    out = {}
    for n in g.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def _prune(g) -> None:
    """Drop nodes whose outputs nothing reads (backwards from the graph outputs)."""
    live = {o.name for o in g.output}
    keep = []
    for n in reversed(list(g.node)):
        if any(o in live for o in n.output):
            keep.append(n)
            live.update(i for i in n.input if i)
    del g.node[:]
    g.node.extend(reversed(keep))


def _bias_value(g) -> tuple[str, list]:
    """The Attention nodes' attention_bias input (the 6th) and those nodes."""
    att = [n for n in g.node if n.op_type == "Attention" and len(n.input) > 5 and n.input[5]]
    names = {n.input[5] for n in att}
    if len(names) != 1:
        raise RuntimeError(f"expected one shared attention_bias, found {sorted(names)}")
    return names.pop(), att


def variant_expand(m: onnx.ModelProto, mask: str) -> onnx.ModelProto:
    m = onnx.ModelProto.FromString(m.SerializeToString())
    g = m.graph
    bias, _ = _bias_value(g)
    where = next(n for n in g.node if bias in n.output)
    zero, fill = where.input[1], where.input[2]
    g.initializer.extend([numpy_helper.from_array(np.array([1, 2], np.int64), "probe_axes_12"),
                          numpy_helper.from_array(np.array([1, 3], np.int64), "probe_axes_13")])
    new = [helper.make_node("Cast", [mask], ["probe_keep"], to=TensorProto.BOOL),
           helper.make_node("Unsqueeze", ["probe_keep", "probe_axes_12"], ["probe_keep_b11t"]),
           helper.make_node("Where", ["probe_keep_b11t", zero, fill], ["probe_bias_b11t"]),
           helper.make_node("Unsqueeze", [mask, "probe_axes_13"], ["probe_rows_b1s1"]),
           helper.make_node("Shape", ["probe_rows_b1s1"], ["probe_shape"]),
           helper.make_node("Expand", ["probe_bias_b11t", "probe_shape"], [bias])]
    where.output[0] = "probe_unused_bias"
    idx = list(g.node).index(where)
    for k, n in enumerate(new):
        g.node.insert(idx + 1 + k, n)
    _prune(g)
    return m


def variant_bias_input(m: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    m = onnx.ModelProto.FromString(m.SerializeToString())
    g = m.graph
    bias, _ = _bias_value(g)
    where = next(n for n in g.node if bias in n.output)
    where.output[0] = "probe_unused_bias"
    elem = TensorProto.FLOAT16 if any(i.name == where.input[1] and i.data_type == TensorProto.FLOAT16
                                      for i in g.initializer) else TensorProto.FLOAT
    g.input.append(helper.make_tensor_value_info(bias, elem, ["B", 1, "S", "S"]))
    _prune(g)
    return m, bias


def variant_lengths(m: onnx.ModelProto, mask: str) -> onnx.ModelProto:
    m = onnx.ModelProto.FromString(m.SerializeToString())
    g = m.graph
    _, att = _bias_value(g)
    eln = next(n for n in g.node if n.op_type == "EmbedLayerNormalization")
    while len(eln.input) < 8:
        eln.input.append("")
    eln.input[7] = "probe_mask_int32"
    while len(eln.output) < 2:
        eln.output.append("")
    eln.output[1] = "probe_mask_index"
    g.node.insert(list(g.node).index(eln), helper.make_node("Cast", [mask], ["probe_mask_int32"], to=TensorProto.INT32))
    for n in att:
        ins = list(n.input)[:5]
        while len(ins) < 4:
            ins.append("")
        ins[3] = "probe_mask_index"
        del n.input[:]
        n.input.extend(ins[:4])
    _prune(g)
    return m


PROVIDER = "cuda"


def _peer(src: str, dst: str, precision: str, opt_level: int) -> dict:
    from onnxruntime.transformers.optimizer import optimize_model

    model = optimize_model(src, model_type="bert", num_heads=12, hidden_size=768, opt_level=opt_level,
                           use_gpu=PROVIDER == "cuda")
    if isinstance(model, str):
        raise RuntimeError("optimize_model did not optimize (no GPU?)")
    stats = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
    if precision == "fp16":
        model.convert_float_to_float16(keep_io_types=True)
    model.save_model_to_file(dst)
    return stats


def _session(path, profile: str | None = None):
    from scripts.bench.targets import make_session

    return make_session(path, PROVIDER, profile_prefix=profile, spin=False)


def _kernels(path, feeds) -> dict:
    """Kernels of one profiled run after a warm-up (onnxopt.verify.runtime.run_profiled)."""
    from onnxopt.verify.runtime import run_profiled

    _, k, _ = run_profiled(path, feeds, PROVIDER, warmup=1)
    return {key: k[key] for key in ("kernels", "by_provider", "memcpy", "by_op")}


def _latency(entries: dict[str, tuple[str, dict]], runs: int, warmup: int) -> dict:
    """Every entry timed in one interleaved run (onnxopt.verify.runtime.measure_latency, its own inputs each)."""
    from onnxopt.verify.runtime import measure_latency

    lat = measure_latency({n: p for n, (p, _) in entries.items()}, {}, provider=PROVIDER, runs=runs, warmup=warmup,
                          budget_s=1e9, min_rounds=runs, gap_s=0.0, spin=False,
                          entry_inputs={n: f for n, (_, f) in entries.items()})
    out = {}
    for n, r in lat["results"].items():
        a = np.array(r["times_ms"])
        out[n] = {"median_ms": round(float(np.median(a)), 4), "p10_ms": round(float(np.percentile(a, 10)), 4),
                  "p90_ms": round(float(np.percentile(a, 90)), 4), "samples_ms": [round(float(t), 5) for t in a]}
    return out


CUPTI_CHILD = r"""
import json, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
sys.path[:0] = json.loads(sys.argv[2])
from scripts.bench.targets import make_session
import numpy as np
spec = json.loads(open(sys.argv[1]).read())
res = {}
for name, (path, npz) in spec["entries"].items():
    feeds = dict(np.load(npz))
    s = make_session(path, "cuda", spin=False)
    for _ in range(10):
        s.run(None, feeds)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            s.run(None, feeds)
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    tot = {}
    for e in ev:
        t = tot.setdefault(e.name, [0, 0.0])
        t[0] += 1
        t[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    top = sorted(tot.items(), key=lambda kv: -kv[1][1])[:25]
    res[name] = {"events_per_run": len(ev) / 20, "gpu_us_per_run": sum(v[1] for v in tot.values()) / 20,
                 "top": [[k, v[0] / 20, round(v[1] / 20, 2)] for k, v in top]}
print(json.dumps(res))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert-base-eager-legacy")
    ap.add_argument("--json", required=True)
    ap.add_argument("--work", default="/tmp/probe-gap")
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--opt-level", type=int, default=99, help="the peer's opt_level (99: its best on this model)")
    ap.add_argument("--cases", default="fp32:1,fp16:1,fp16:8")
    ap.add_argument("--cupti", action="store_true")
    ap.add_argument("--provider", default="cuda", help="cpu: a dry run of the surgery and the checks here")
    args = ap.parse_args(argv)
    global PROVIDER
    PROVIDER = args.provider
    from onnxopt import optimize
    from onnxopt.verify.runtime import ratio_interval
    from scripts.bench import targets as T

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bm = T.get_model(args.model)
    src = work / f"{args.model}.onnx"
    t0 = time.perf_counter()
    if not src.exists():
        bm.build(src, None, False)
    import onnxruntime as ort

    report: dict = {"model": args.model, "machine": platform.node(), "ort": ort.__version__,
                    "build_s": round(time.perf_counter() - t0, 1), "peer_opt_level": args.opt_level, "cases": {}}
    try:
        report["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip()
    except OSError:
        report["gpu"] = "?"
    mask = "attention_mask"
    for case in args.cases.split(","):
        prec, batch = case.split(":")
        batch = int(batch)
        c: dict = {"variants": {}}
        report["cases"][case] = c
        paths = {"original": str(src)}
        peer = work / f"peer-{prec}.onnx"
        if not peer.exists():
            c["peer_fused"] = _peer(str(src), str(peer), prec, args.opt_level)
        paths["peer"] = str(peer)
        ours = work / f"onnxopt-{prec}.onnx"
        if not ours.exists():
            kw = {"precision": prec} if prec != "fp32" else {}
            optimize(str(src), target="ort-cuda", output=str(ours), **kw)  # (the CUDA graph, on either provider)
        paths["onnxopt"] = str(ours)
        om = onnx.load(str(ours))
        for name, make in (("onnxopt-expand", lambda: variant_expand(om, mask)),
                           ("onnxopt-lengths", lambda: variant_lengths(om, mask))):
            p = work / f"{name}-{prec}.onnx"
            try:
                onnx.save(make(), str(p))
                paths[name] = str(p)
            except Exception as exc:  # noqa: BLE001
                c["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        bias_model, bias_name = variant_bias_input(om)
        p = work / f"onnxopt-bias-input-{prec}.onnx"
        onnx.save(bias_model, str(p))
        paths["onnxopt-bias-input"] = str(p)

        feeds = bm.feeds(batch, 0, False)  # (the benchmark's: latency)
        right, left = dict(feeds), dict(feeds)  # fidelity: the last row padded by 17 on the right, on the left
        rm, lm = np.ones_like(feeds[mask]), np.ones_like(feeds[mask])
        rm[-1, -17:] = 0
        lm[-1, :17] = 0
        right[mask], left[mask] = rm, lm
        ref = {}
        so_ref = T.make_session(str(src), PROVIDER, exact=True)
        for tag, f in (("right", right), ("left", left)):
            ref[tag] = so_ref.run(None, f)
        del so_ref
        # the bias the original computes, fed to the bias-input variant: (1 - m) * fill, [B,1,S,S]
        where = next(n for n in om.graph.node if n.op_type == "Where" and bias_name in n.output)
        inits = {i.name: numpy_helper.to_array(i) for i in om.graph.initializer}
        zero, fill = inits[where.input[1]], inits[where.input[2]]

        def bias_feed(f):
            keep = f[mask][:, None, None, :] != 0
            b = np.where(keep, zero, fill).astype(zero.dtype)
            return np.ascontiguousarray(np.broadcast_to(b, (b.shape[0], 1, b.shape[3], b.shape[3])))

        entries = {}
        for name, path in paths.items():
            v = c["variants"].setdefault(name, {})
            proto = onnx.load(path, load_external_data=False)
            v["nodes"] = len(proto.graph.node)
            v["op_types"] = dict(sorted({n.op_type: sum(1 for x in proto.graph.node if x.op_type == n.op_type)
                                         for n in proto.graph.node}.items()))
            try:
                onnx.checker.check_model(path)
            except Exception as exc:  # noqa: BLE001
                v["checker"] = str(exc).splitlines()[0]
            fd = dict(feeds)
            if name == "onnxopt-bias-input":
                fd[bias_name] = bias_feed(feeds)
            try:
                s = _session(path)
                names = {i.name for i in s.get_inputs()}
                errs = {}
                for tag, f in (("right", right), ("left", left)):
                    if name == "onnxopt-bias-input":
                        f = {**f, bias_name: bias_feed(f)}
                    got = s.run(None, {k: x for k, x in f.items() if k in names})
                    errs[tag] = [round(float(np.abs(np.asarray(a, np.float32) - r).max()), 6) for a, r in zip(got, ref[tag])]
                v["max_abs_vs_original"] = errs
                del s
                v["kernels"] = _kernels(path, {k: x for k, x in fd.items() if k in names})
                entries[name] = (path, {k: x for k, x in fd.items() if k in names})
            except Exception as exc:  # noqa: BLE001
                v["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        lat = _latency(entries, args.runs, args.warmup)
        for name, r in lat.items():
            c["variants"][name]["latency"] = r
        if "peer" in lat:
            for name, r in lat.items():
                ci = ratio_interval(lat["peer"]["samples_ms"], r["samples_ms"])
                c["variants"][name]["x_peer"] = round(ci["ratio"], 4)
                c["variants"][name]["x_peer_interval"] = [round(x, 4) for x in ci["interval"]]
        if args.cupti:
            spec = {"entries": {}}
            for name, (path, fd) in entries.items():
                npz = work / f"feeds-{name}-{case.replace(':', '-')}.npz"
                np.savez(npz, **fd)
                spec["entries"][name] = [path, str(npz)]
            sp = work / "cupti.json"
            sp.write_text(json.dumps(spec))
            try:
                r = subprocess.run([sys.executable, "-c", CUPTI_CHILD, str(sp), json.dumps(sys.path)],
                                   capture_output=True, text=True, timeout=240)
                c["cupti"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
                    {"error": (r.stderr or "").strip().splitlines()[-3:]}
            except Exception as exc:  # noqa: BLE001
                c["cupti"] = {"error": f"{type(exc).__name__}: {exc}"}
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(case, {n: (v.get("latency", {}).get("median_ms"), v.get("x_peer"), v.get("x_peer_interval"),
                         v.get("kernels", {}).get("kernels"), v.get("kernels", {}).get("by_provider"),
                         v.get("max_abs_vs_original"), v.get("error"))
                     for n, v in c["variants"].items()}, flush=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
