"""CUDA probe of the attention-mask forms onnxruntime's fused attention ops take (issue 29, step 0).

Which form of the key-padding mask should an encoder's fused Attention read on CUDA: the additive float
``attention_bias`` [B,1,S,T] (what onnxopt wrote before), the raw 2-D int32 mask [B,T] as ``mask_index``
(with ``mask_filter_value`` set to the exporter's fill, and ``unidirectional`` for causal masks), or the
1-D sequence lengths (what onnxruntime's transformers optimizer writes for BERT; exact only for right
padding)? And MultiHeadAttention's ``key_padding_mask``? For each form, dtype (fp32, fp16) and batch this
prints the largest error against a float64 reference of the exported computation (softmax of
``scores + fill * (1 - m)``, left and right padding, one row with every key masked), whether NaN appeared,
and the median latency of one session run at BERT-base shape (H 768, 12 heads, S 128) at batch 1 and 8.

    python3 -m scripts.gpu.probe_attention --json OUT.json [--provider CUDAExecutionProvider] [--runs 200]

Runs on the CPU provider too (correctness only is meaningful there). Writes one JSON document.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

from scripts.data.benefit import time_bound_runs

FILL32 = float(np.finfo(np.float32).min)


def _model(kind: str, dtype: str, b: int, s: int, h: int, n: int, *, causal: bool, filter_value: float | None,
           opset: int = 17) -> onnx.ModelProto:
    """One fused attention node; the mask input's form is `kind`."""
    et = TensorProto.FLOAT16 if dtype == "fp16" else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x", et, ["B", "S", h])]
    attrs = {"num_heads": n}
    if filter_value is not None:
        attrs["mask_filter_value"] = filter_value
    if kind.startswith("mha"):
        # MultiHeadAttention on separate Q, K, V (the weights applied outside): query/key/value [B,S,H]
        inputs = [helper.make_tensor_value_info(v, et, ["B", "S", h]) for v in ("q", "k", "v")]
        ins = ["q", "k", "v", ""]
        if kind == "mha-key-padding-2d":
            inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, ["B", "S"]))
            ins.append("mask")
        elif kind == "mha-bias":
            inputs.append(helper.make_tensor_value_info("bias", et, ["B", 1, "S", "S"]))
            ins += ["", "bias"]
        if causal:
            attrs["unidirectional"] = 1
        node = helper.make_node("MultiHeadAttention", ins, ["y"], domain="com.microsoft", **attrs)
    else:
        inputs += [helper.make_tensor_value_info("w", et, [h, 3 * h]), helper.make_tensor_value_info("bqkv", et, [3 * h])]
        ins = ["x", "w", "bqkv"]
        if kind == "bias":
            inputs.append(helper.make_tensor_value_info("bias", et, ["B", 1, "S", "S"]))
            ins += ["", "", "bias"]
        elif kind == "raw-2d":
            inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, ["B", "S"]))
            ins.append("mask")
        elif kind == "lengths-1d":
            inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, ["B"]))
            ins.append("mask")
        if causal:
            attrs["unidirectional"] = 1
        node = helper.make_node("Attention", ins, ["y"], domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], "probe", inputs, [helper.make_tensor_value_info("y", et, ["B", "S", h])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def _reference(x, w, bqkv, m, n, causal, fill):
    """float64 softmax attention with the exporter's additive mask fill*(1-m) (and the causal factor)."""
    b, s, h = x.shape
    d = h // n
    qkv = x.astype(np.float64) @ w.astype(np.float64) + bqkv.astype(np.float64)
    q, k, v = (qkv[..., i * h:(i + 1) * h].reshape(b, s, n, d).transpose(0, 2, 1, 3) for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    keep = np.broadcast_to(m[:, None, None, :].astype(bool), scores.shape).copy()
    if causal:
        keep &= np.tril(np.ones((s, s), bool))[None, None]
    scores = scores + np.where(keep, 0.0, fill)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    out = (p @ v).transpose(0, 2, 1, 3).reshape(b, s, h)
    return out, keep


def _feeds(kind, dtype, x, w, bqkv, m, n, causal, fill):
    npt = np.float16 if dtype == "fp16" else np.float32
    if kind.startswith("mha"):
        h = x.shape[-1]
        qkv = (x.astype(np.float64) @ w.astype(np.float64) + bqkv).astype(npt)
        feeds = {"q": qkv[..., :h], "k": qkv[..., h:2 * h], "v": qkv[..., 2 * h:]}
    else:
        feeds = {"x": x.astype(npt), "w": w.astype(npt), "bqkv": bqkv.astype(npt)}
    if kind in ("bias", "mha-bias"):
        b, s = m.shape
        keep = np.broadcast_to(m[:, None, None, :].astype(bool), (b, 1, s, s)).copy()
        if causal and kind == "bias":
            pass  # unidirectional adds the causal part inside the kernel
        feeds["bias"] = np.where(keep, 0.0, fill).astype(npt)
    elif kind in ("raw-2d", "mha-key-padding-2d"):
        feeds["mask"] = m.astype(np.int32)
    elif kind == "lengths-1d":
        feeds["mask"] = m.sum(1).astype(np.int32)
    return feeds


def _session(model, provider):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    providers = [provider] if provider == "CPUExecutionProvider" else [provider, "CPUExecutionProvider"]
    return ort.InferenceSession(model.SerializeToString(), so, providers=providers)


def _case(kind, dtype, causal, filter_value, provider, fill, *, b=3, s=6, h=16, n=2, seed=0):
    """Correctness on a small case: right padding, left padding, one row with every key masked."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, s, h)).astype(np.float32)
    w = (rng.standard_normal((h, 3 * h)) / np.sqrt(h)).astype(np.float32)
    bqkv = (0.1 * rng.standard_normal(3 * h)).astype(np.float32)
    m = np.ones((b, s), np.int64)
    m[0, 4:] = 0  # right padding
    m[1, :2] = 0  # left padding
    m[2, :] = 0   # every key masked
    if kind == "lengths-1d":
        m[1] = 1  # lengths cannot say left padding; the case is about right padding only
        m[2, :] = 0
    result = {"form": kind, "dtype": dtype, "causal": causal, "mask_filter_value": filter_value, "fill": fill}
    try:
        sess = _session(_model(kind, dtype, b, s, h, n, causal=causal, filter_value=filter_value), provider)
        y = sess.run(None, _feeds(kind, dtype, x, w, bqkv, m, n, causal, fill))[0].astype(np.float64)
    except Exception as exc:  # noqa: BLE001 - a probe records what onnxruntime says
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        return result
    ref, keep = _reference(x, w, bqkv, m, n, causal, FILL32)
    any_key = keep.any(-1).any(1)  # [B, S]: rows that see at least one key
    result["nan"] = bool(np.isnan(y).any())
    result["max_abs_rows_with_keys"] = float(np.nanmax(np.abs(y - ref)[any_key])) if any_key.any() else None
    empty = ~any_key
    result["max_abs_empty_rows_vs_uniform"] = float(np.nanmax(np.abs(y - ref)[empty])) if empty.any() else None
    result["max_abs_empty_rows_vs_zero"] = float(np.nanmax(np.abs(y)[empty])) if empty.any() else None
    return result


def _latency(kind, dtype, causal, filter_value, provider, fill, b, runs, *, s=128, h=768, n=12):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((b, s, h)).astype(np.float32)
    w = (rng.standard_normal((h, 3 * h)) / np.sqrt(h)).astype(np.float32)
    bqkv = (0.1 * rng.standard_normal(3 * h)).astype(np.float32)
    m = np.ones((b, s), np.int64)
    m[:, s - s // 4:] = 0  # right padding: every form may read it
    row = {"form": kind, "dtype": dtype, "causal": causal, "batch": b, "seq": s}
    try:
        sess = _session(_model(kind, dtype, b, s, h, n, causal=causal, filter_value=filter_value), provider)
        feeds = _feeds(kind, dtype, x, w, bqkv, m, n, causal, fill)
        dev = "cuda" if provider == "CUDAExecutionProvider" else "cpu"
        times = time_bound_runs(sess, feeds, dev, runs, 20)
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        return row
    q = statistics.quantiles(times, n=10)
    row.update(median_ms=statistics.median(times), p10_ms=q[0], p90_ms=q[-1])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--provider", default="CUDAExecutionProvider")
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args(argv)
    import onnxruntime as ort

    doc = {"onnxruntime": ort.__version__, "provider": args.provider, "python": platform.python_version(),
           "correctness": [], "latency": []}
    try:
        import subprocess

        doc["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
    except OSError:
        doc["gpu"] = None
    forms = ["bias", "raw-2d", "lengths-1d", "mha-key-padding-2d", "mha-bias"]
    for dtype in ("fp32", "fp16"):
        for kind in forms:
            for causal in (False, True):
                if kind == "lengths-1d" and causal:
                    continue
                fills = [(None, FILL32), (FILL32, FILL32), (-10000.0, -10000.0)]
                if dtype == "fp16":
                    fills.append((float(np.finfo(np.float16).min), float(np.finfo(np.float16).min)))
                for filter_value, fill in fills:
                    if kind in ("bias", "mha-bias") and filter_value is not None:
                        continue  # the float mask carries its own fill
                    r = _case(kind, dtype, causal, filter_value, args.provider, fill)
                    doc["correctness"].append(r)
                    print(json.dumps(r), flush=True)
    for dtype in ("fp32", "fp16"):
        for b in (1, 8):
            for kind in forms:
                fv = FILL32 if kind in ("raw-2d", "mha-key-padding-2d") else None
                r = _latency(kind, dtype, False, fv, args.provider, FILL32, b, args.runs)
                doc["latency"].append(r)
                print(json.dumps(r), flush=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
