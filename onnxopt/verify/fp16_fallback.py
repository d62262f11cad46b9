"""The float16 conversion, measured: ``optimize(precision="fp16")`` with verification data.

:func:`convert_fp16_checked` runs the float32 model and its float16 conversion (in float16
arithmetic, :mod:`onnxopt.verify.fp16`) on the data, and keeps the fewest heavy nodes in float32 that
bring every output within the fp16 policy's fidelity bounds (:data:`onnxopt.targets.FP16_MAX_ERROR`,
...). The conversion itself is :mod:`onnxopt.transforms.precision`'s; this module only measures it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt import targets
from onnxopt.errors import UsageError
from onnxopt.ir.io import first_line
from onnxopt.targets import FP16_MAX_ERROR, FP16_MIN_COSINE, FP16_MIN_TOP1
from onnxopt.transforms.precision import DEFAULT_BLOCK_OPS, Fp16Report, check_convertible, planned, value_ranges
from onnxopt.verify.compare import compare_fp16
from onnxopt.verify.fp16 import Fp16Unavailable, run_fp16

MAX_CANDIDATES = 400  # heavy nodes ranked one by one at most (one onnxruntime session each)


def _badness(ref: list, got: list) -> float:
    """The worst output's distance to the fidelity bounds: <= 1 when every float output meets them
    (cosine, max abs error over the range, top-1 for logits; onnxopt.verify.compare_fp16)."""
    worst = 0.0
    for (name, a), (_, b) in zip(ref, got):
        if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
            continue
        row = compare_fp16(a, b, name)
        cos = row.get("cosine")
        parts = [row.get("error_of_range", float("inf")) / FP16_MAX_ERROR,
                 float("inf") if cos is None else (1 - cos) / (1 - FP16_MIN_COSINE)]
        if "top1_agreement" in row:
            parts.append((1 - row["top1_agreement"]) / (1 - FP16_MIN_TOP1))
        worst = max(worst, *parts)
    return worst


def convert_fp16_checked(model: ir.Model, feeds, *, keep_io_types: bool = True, block_ops: Iterable[str] | None = None,
                         target: str | None = None, max_kept: float = 0.25, progress=None,
                         clamp_sentinels: bool | None = None) -> Fp16Report:
    """:func:`convert_fp16`, measured: the float32 ``model`` runs on onnxruntime's CPU provider on
    ``feeds`` (one dict of inputs, or a list of them), its value ranges there decide which values
    cannot be float16 (``ranges`` of :func:`convert_fp16`), and the conversion runs in float16
    arithmetic (``onnxopt.verify.fp16``: every op's output rounded to float16, which onnxruntime's
    CPU provider does not do); when an output misses the
    fidelity bounds (``onnxopt.verify.compare_fp16``), each heavy float16 node (MatMul, Conv, ...) is
    kept in float32 alone and ranked by the fidelity that gives, and the fewest top-ranked nodes that
    bring every output within the bounds (at most ``max_kept`` of them) stay float32. Where no such
    set exists the plain conversion is kept. ``Report.fallback`` has the figures either way."""
    import onnxruntime as ort

    check_convertible(model)
    target = targets.normalize(target)
    block = frozenset(DEFAULT_BLOCK_OPS if block_ops is None else block_ops)
    feeds_list = [feeds] if isinstance(feeds, dict) else list(feeds)
    progress = progress or (lambda step, done=0, total=0: None)
    for k, node in enumerate(model.graph):  # candidates are kept by name
        if not node.name:
            node.name = f"node_{k}_{node.op_type}"
    fp32 = ir.serde.serialize_model(model).SerializeToString()
    so = ort.SessionOptions()
    so.log_severity_level = 4  # (a refusal is reported once, as a one-line error)

    def run(data: bytes) -> list:
        sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        return [list(zip(names, sess.run(None, f))) for f in feeds_list]

    arithmetic = []

    def run_half(proto: onnx.ModelProto) -> list:
        # in float16 arithmetic (every op's output rounded to float16): onnxruntime's CPU provider
        # computes many float16 ops in float32, hiding overflow and rounding (verify.fp16)
        try:
            got, how = run_fp16(proto, feeds_list)
        except Fp16Unavailable as exc:
            got, how = run(proto.SerializeToString()), f"onnxruntime cpu ({exc})"
        arithmetic[:] = [how]
        return got

    def attempt(keep: frozenset):
        m = ir.serde.deserialize_model(onnx.load_from_string(fp32))
        conv = planned(m, keep_io_types=keep_io_types, block_ops=block, target=target, keep_nodes=keep,
                       clamp_sentinels=clamp_sentinels, ranges=ranges)
        rep = conv.apply()
        got = run_half(ir.serde.serialize_model(m))
        return max(_badness(r, g) for r, g in zip(ref, got)), rep, conv

    progress("fp16: measuring fidelity")
    try:
        ref = run(fp32)
    except Exception as exc:  # noqa: BLE001 - onnxruntime refuses the model or the inputs: the user's to fix
        raise UsageError(f"onnxruntime (cpu) cannot run the original model on the verification inputs, so the "
                         f"float16 conversion cannot be measured: {first_line(exc, 300)}") from None
    progress("fp16: measuring value ranges")
    try:
        ranges = value_ranges(fp32, feeds_list)
    except Exception:  # noqa: BLE001 - a value onnxruntime will not expose: bounds from the weights instead
        ranges = None
    bad0, _, conv0 = attempt(frozenset())
    runs = 1
    info = {"feeds": len(feeds_list), "badness_before": round(bad0, 4), "kept": [], "runs": runs}
    keep: frozenset = frozenset()
    if bad0 > 1:
        cands = [n.name for n, p in conv0.plans.items() if p.kind == "fp16" and not p.light]
        info["candidates"] = len(cands)
        if len(cands) > MAX_CANDIDATES:
            info["skipped"] = f"{len(cands)} candidate nodes (more than {MAX_CANDIDATES})"
        else:
            scores = []
            for i, name in enumerate(cands):
                progress("fp16: ranking nodes by fidelity", i, len(cands))
                scores.append((attempt(frozenset({name}))[0], i, name))
            runs += len(cands)
            ranked = [name for _, _, name in sorted(scores)]
            limit = max(1, int(max_kept * len(cands)))
            found = None
            k = 1
            while k <= limit:  # doubling, then bisection, on the number of top-ranked nodes kept
                runs += 1
                if attempt(frozenset(ranked[:k]))[0] <= 1:
                    found = k
                    break
                k *= 2
            if found is None and k // 2 < limit:
                runs += 1
                if attempt(frozenset(ranked[:limit]))[0] <= 1:
                    found, k = limit, limit
            if found is not None:
                lo = k // 2 + 1 if k > 1 else 1
                hi = found
                while lo < hi:
                    mid = (lo + hi) // 2
                    runs += 1
                    if attempt(frozenset(ranked[:mid]))[0] <= 1:
                        hi = mid
                    else:
                        lo = mid + 1
                keep = frozenset(ranked[:hi])
            else:
                info["gave_up"] = f"no set of up to {limit} float32 nodes meets the bounds; plain conversion kept"
    rep = planned(model, keep_io_types=keep_io_types, block_ops=block, target=target, keep_nodes=keep,
                  clamp_sentinels=clamp_sentinels, ranges=ranges).apply()
    if keep:
        got = run_half(ir.serde.serialize_model(model))
        info["badness_after"] = round(max(_badness(r, g) for r, g in zip(ref, got)), 4)
        runs += 1
    else:
        info["badness_after"] = info["badness_before"]
    info.update(kept=sorted(keep), runs=runs, ok=info["badness_after"] <= 1, arithmetic=arithmetic[0])
    rep.fallback = info
    return rep


__all__ = ["MAX_CANDIDATES", "convert_fp16_checked"]
