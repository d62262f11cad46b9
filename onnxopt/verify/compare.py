"""Comparing outputs: tolerances by dtype, one array against another (max absolute and relative
error, mean and 99th percentile of the absolute error, cosine similarity, elements out of
tolerance, NaN/Inf mismatches), every kind of value onnxruntime returns, and the outputs of two
models matched by name and position."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from onnxopt.errors import UsageError
from onnxopt.ir.input_shapes import dims_text
from onnxopt.targets import FP16_MAX_ERROR, FP16_MIN_COSINE, FP16_MIN_TOP1  # noqa: F401  (the fp16 policy's bounds)


# Default tolerances by output dtype: (rtol, atol); an element passes when
# |after - before| <= atol + rtol * |before| (numpy.isclose's rule).
TOLERANCES = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
    "int8": (0.0, 1.0),  # one quantization step
    "uint8": (0.0, 1.0),
}
EXACT = (0.0, 0.0)  # every other dtype (integers, bool, strings): exact
LOW_PRECISION = (1e-2, 1e-3)  # float32/64 outputs of a model that computes in fp16/bf16/int8
# A quantized (int8) model against its float model: no elementwise tolerance fits int8 (one
# quantization step of a wide activation is far above 1e-2), so each float output passes when its
# SQNR, 10 log10(sum ref^2 / sum (ref - test)^2), is at least this: a noise energy under 1% of the
# signal's. Well-calibrated int8 CNNs measure 25-40 dB; a saturated or badly placed quantization
# falls to 10-17 dB (onnxruntime's per-channel QDQ of the PP-OCR classifier: 16.5 dB).
INT8_MIN_SQNR_DB = 20.0
_LOW_PRECISION_TYPES = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT8,
                        onnx.TensorProto.UINT8}
_QUANT_OPS = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
              "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul", "MatMulNBits", "QAttention"}


def is_quantized(proto: onnx.ModelProto) -> bool:
    """The main graph computes in int8: QuantizeLinear/DequantizeLinear or integer kernels
    (QLinearConv, MatMulInteger, ... and onnxruntime's com.microsoft QLinear* ops)."""
    return any(n.op_type in _QUANT_OPS or n.op_type.startswith("QLinear") or n.op_type == "QGemm"
               for n in proto.graph.node)


def sqnr_energies(reference, test) -> tuple[float, float]:
    """(signal, noise) energies in float64: sum ref^2 and sum (ref - test)^2; shapes must match."""
    ref = np.asarray(reference, dtype=np.float64)
    got = np.asarray(test, dtype=np.float64)
    if ref.shape != got.shape:
        raise UsageError(f"SQNR: shapes differ: {list(ref.shape)} (reference) vs {list(got.shape)}")
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.sum(ref * ref)), float(np.sum((ref - got) ** 2))


def sqnr_from_energies(signal: float, noise: float) -> float:
    """10 log10(signal / noise) dB: +inf without noise (identical, zero signals included), -inf for
    noise on a zero signal, NaN when either energy is NaN."""
    if signal != signal or noise != noise:
        return float("nan")
    if noise == 0:
        return float("inf")
    if signal == 0:
        return float("-inf")
    if noise == float("inf"):
        return float("nan") if signal == float("inf") else float("-inf")
    return 10.0 * float(np.log10(signal / noise))


def sqnr_db(reference, test) -> float:
    """``10 log10(sum ref^2 / sum (ref - test)^2)`` in dB, computed in float64 (see
    :func:`sqnr_from_energies` for identical arrays, zero signals and NaN)."""
    return sqnr_from_energies(*sqnr_energies(reference, test))


def compare_int8(before, after, min_db: float = INT8_MIN_SQNR_DB) -> dict:
    """One output of a quantized model against its float model's: the statistics of
    :func:`compare_value` at the low-precision tolerances (informational), its SQNR, and the verdict
    by SQNR >= ``min_db`` for a float tensor (other values as :func:`compare_value` judges them)."""
    row = compare_value(before, after, low_precision=True)
    if _value_kind(before) == _value_kind(after) == "tensor" and _kind(before.dtype) == "float" \
            and before.shape == after.shape and before.dtype == after.dtype:
        db = sqnr_db(before, after)
        row.update(sqnr_db=db, ok=bool(db >= min_db), tolerance=f"int8 model: SQNR >= {min_db:g} dB")
        if not row["ok"]:
            row["problem"] = f"SQNR {db:.1f} dB < {min_db:g} dB"
    return row




def is_logits(name: str, value) -> bool:
    """Whether an output is scores over classes or a vocabulary, whose top-1 agreement is judged."""
    if not isinstance(value, np.ndarray) or _kind(value.dtype) != "float" or value.ndim < 2 or value.shape[-1] < 2:
        return False
    return "logit" in name.lower() or (value.ndim == 2 and value.shape[-1] >= 1000)


@np.errstate(all="ignore")
def compare_fp16(before, after, name: str = "") -> dict:
    """One output of a float16 model against its float32 original's: :func:`compare_value`'s
    statistics at the low-precision tolerances (informational) and the fidelity verdict: cosine
    >= FP16_MIN_COSINE, max abs error <= FP16_MAX_ERROR x the original's range, top-1 agreement
    >= FP16_MIN_TOP1 for logits (``error_of_range``, ``top1_agreement`` in the row)."""
    row = compare_value(before, after, low_precision=True)
    if not (_value_kind(before) == _value_kind(after) == "tensor" and _kind(before.dtype) == "float"
            and before.shape == after.shape and before.dtype == after.dtype):
        return row
    a = before.astype(np.float64)
    finite = a[np.isfinite(a)]
    span = float(finite.max() - finite.min()) if finite.size else 0.0
    if span == 0 and finite.size:  # a constant output: the error against its magnitude
        span = float(np.abs(finite).max())
    max_abs = row.get("max_abs", 0.0)
    frac = 0.0 if max_abs == 0 else (max_abs / span if span > 0 else float("inf"))
    if frac != frac:  # NaN: a non-finite mismatch
        frac = float("inf")
    cosine = row.get("cosine")
    problems = []
    if cosine is None or cosine < FP16_MIN_COSINE:
        problems.append(f"cosine {short_number(cosine, 6)} < {FP16_MIN_COSINE:g}")
    if frac > FP16_MAX_ERROR:
        problems.append(f"max abs error {frac:.3%} of the range > {FP16_MAX_ERROR:.0%}")
    criterion = f"fp16 model: cosine >= {FP16_MIN_COSINE:g}, max abs error <= {FP16_MAX_ERROR:.0%} of the range"
    row["error_of_range"] = frac
    if is_logits(name, before) and before.size:
        agree = float(np.mean(np.argmax(before, axis=-1) == np.argmax(after, axis=-1)))
        row["top1_agreement"] = agree
        criterion += f", top-1 >= {FP16_MIN_TOP1:.0%}"
        if agree < FP16_MIN_TOP1:
            problems.append(f"top-1 agreement {agree:.2%} < {FP16_MIN_TOP1:.0%}")
    row.update(ok=not problems, tolerance=criterion)
    if problems:
        row["problem"] = "; ".join(problems)
    else:
        row.pop("problem", None)
    return row


def is_fp16(proto: onnx.ModelProto) -> bool:
    """The model computes in float16 (weights of that type or Casts to it) and is not quantized."""
    if any(n.op_type in _QUANT_OPS for n in proto.graph.node):
        return False
    if any(i.data_type == onnx.TensorProto.FLOAT16 for i in proto.graph.initializer):
        return True
    return any(n.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in n.attribute)
               for n in proto.graph.node)


def is_low_precision(proto: onnx.ModelProto) -> bool:
    """The model computes in fp16/bf16 or int8: weights of those types (initializers or Constant
    nodes), Casts to them (mixed-precision exports) or quantization ops."""
    if any(i.data_type in _LOW_PRECISION_TYPES for i in proto.graph.initializer):
        return True
    for n in proto.graph.node:
        if n.op_type in _QUANT_OPS:
            return True
        for a in n.attribute:
            if (n.op_type == "Constant" and a.name == "value" and a.t.data_type in _LOW_PRECISION_TYPES) or (
                    n.op_type == "Cast" and a.name == "to" and a.i in _LOW_PRECISION_TYPES):
                return True
    return False


def check_tolerances(rtol: float | None, atol: float | None) -> None:
    for name, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and not (np.isfinite(v) and v >= 0):
            raise UsageError(f"--{name} {v}: must be a finite number, not negative")


def tolerance(dtype: str, low_precision: bool = False, rtol: float | None = None,
              atol: float | None = None) -> tuple[float, float, str]:
    """(rtol, atol, where they come from) for an output of ``dtype``."""
    if low_precision and dtype in ("float32", "float64"):
        base, why = LOW_PRECISION, f"{dtype} output of a fp16/bf16/int8 model"
    elif dtype in TOLERANCES:
        base, why = TOLERANCES[dtype], f"default for {dtype}"
    else:
        base, why = EXACT, f"exact for {dtype}"
    if rtol is not None or atol is not None:
        why = "given"
    return (base[0] if rtol is None else rtol), (base[1] if atol is None else atol), why


def _kind(dtype: np.dtype) -> str:
    """"float" (numpy's floats and ml_dtypes' bfloat16/float8/float4), "int" (integers, bool,
    int4/uint4) or "other" (strings, objects): how values of ``dtype`` are compared."""
    if dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("float", "bfloat"))):
        return "float"
    if dtype.kind in "iub" or (dtype.kind == "V" and dtype.name.startswith(("int", "uint"))):
        return "int"
    return "other"


def _item(v):
    """A JSON-ready Python value of one element."""
    v = v.item() if hasattr(v, "item") else v
    return v if isinstance(v, (bool, int, float, str)) else float(v) if np.isreal(v) else str(v)


@np.errstate(all="ignore")  # overflowing differences and non-finite values are handled explicitly
def compare(before: np.ndarray, after: np.ndarray, rtol: float, atol: float) -> dict:
    """Statistics of ``after`` against ``before``; ``ok`` when shapes and dtypes match and every
    element is within tolerance (|after - before| <= atol + rtol * |before|).

    Equal values pass (-0 equals 0, as IEEE has it); NaN must meet NaN and an infinity the same
    infinity. Any other pair with a NaN or an infinity is a non-finite mismatch: counted
    (``nan_mismatch``, ``inf_mismatch``), and it makes ``max_abs``/``max_rel`` NaN (a NaN on one
    side only) or inf, never hidden. ``mean_abs``, ``p99_abs`` and ``cosine`` are over the pairs
    where both are finite (``cosine`` is None when there are non-finite mismatches). ``example``
    is the first non-finite mismatch, else the largest difference out of tolerance."""
    out: dict = {"shape_before": list(before.shape), "shape_after": list(after.shape),
                 "dtype_before": before.dtype.name, "dtype_after": after.dtype.name, "rtol": rtol, "atol": atol}
    if before.shape != after.shape:
        out.update(ok=False, problem=f"shape {dims_text(before.shape)} in the original, {dims_text(after.shape)} now")
        return out
    if before.dtype != after.dtype:
        out.update(ok=False, problem=f"dtype {before.dtype.name} in the original, {after.dtype.name} now")
        return out
    n = int(before.size)
    out["elements"] = n
    kind = _kind(before.dtype)
    nonfinite = np.zeros(before.shape, bool)
    if kind == "other":  # strings, objects: equal or not
        bad = np.asarray(before != after, bool)
        d = rel = np.zeros(before.shape)
    elif kind == "int":  # exact arithmetic (int64 does not fit float64)
        wide = object if before.dtype.itemsize == 8 else np.int64
        a, b = before.astype(wide), after.astype(wide)
        d = np.abs(a - b).astype(np.float64)
        ref = np.abs(before.astype(np.float64))
        bad = (a != b) & (d > atol + rtol * ref)
        rel = d / np.maximum(np.maximum(ref, np.abs(after.astype(np.float64))), 1)
        d_finite = d
    else:
        a, b = before.astype(np.float64), after.astype(np.float64)
        nan_a, nan_b, inf_a, inf_b = np.isnan(a), np.isnan(b), np.isinf(a), np.isinf(b)
        finite = ~(nan_a | nan_b | inf_a | inf_b)
        nonfinite = ~finite & ~((a == b) | (nan_a & nan_b))
        nan_mismatch = int(np.count_nonzero(nan_a != nan_b))
        out.update(nan_before=int(nan_a.sum()), nan_after=int(nan_b.sum()), inf_before=int(inf_a.sum()),
                   inf_after=int(inf_b.sum()), nan_mismatch=nan_mismatch,
                   inf_mismatch=int(np.count_nonzero(nonfinite)) - nan_mismatch)
        d = np.where(finite, np.abs(a - b), 0.0)  # inf where two finite values are too far apart for float64
        ref = np.abs(a)
        bad = nonfinite | (finite & (d > atol + rtol * ref))
        # relative to the larger magnitude of the two: 2 at most (a sign flip), never 1e307 at a zero
        rel = np.where(d == 0, 0.0, d / np.maximum(np.maximum(ref, np.abs(b)), np.finfo(np.float64).tiny))
        av, bv = a[finite], b[finite]
        if nonfinite.any():
            out["cosine"] = None
        elif av.size:
            scale = max(float(np.abs(av).max()), float(np.abs(bv).max()))
            if scale > 0:  # scaled first: no overflow for values near the float64 limit
                av, bv = av / scale, bv / scale
            na, nb = float(np.linalg.norm(av)), float(np.linalg.norm(bv))
            cosine = 1.0 if na == nb == 0 else (float(av @ bv) / (na * nb) if na and nb else 0.0)
            out["cosine"] = min(1.0, max(-1.0, cosine))
        else:
            out["cosine"] = 1.0
        d_finite = d[finite]
    if kind != "other":
        out.update(max_abs=float(d.max()) if n else 0.0, max_rel=float(rel.max()) if n else 0.0,
                   mean_abs=float(d_finite.mean()) if d_finite.size else 0.0,
                   p99_abs=float(np.percentile(d_finite, 99)) if d_finite.size else 0.0)
        if out["p99_abs"] != out["p99_abs"]:  # interpolating between differences beyond float64
            out["p99_abs"] = float("inf")
        if out.get("nan_mismatch"):
            out.update(max_abs=float("nan"), max_rel=float("nan"))
        elif out.get("inf_mismatch"):
            out.update(max_abs=float("inf"), max_rel=float("inf"))
    out_tol = int(np.count_nonzero(bad))
    if out_tol:
        flat_nonfinite = nonfinite.ravel()
        first = bool(flat_nonfinite.any()) or kind == "other"
        k = int(np.argmax(flat_nonfinite if flat_nonfinite.any() else np.where(bad.ravel(), d.ravel(), -1.0)))
        out["example"] = {"index": [int(i) for i in np.unravel_index(k, before.shape)],
                          "before": _item(before.ravel()[k]), "after": _item(after.ravel()[k]),
                          "which": ("first non-finite mismatch" if flat_nonfinite.any() else
                                    "first difference" if first else "largest difference")}
    out["out_of_tolerance"] = out_tol
    out["ok"] = out_tol == 0
    return out


def _value_kind(v) -> str:
    return ("sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else
            "empty optional" if v is None else "tensor")


def _worst(values: list) -> float:
    return float("nan") if any(v != v for v in values) else max(values, default=0.0)


def compare_value(before, after, *, low_precision: bool = False, rtol: float | None = None,
                  atol: float | None = None) -> dict:
    """One output of any kind onnxruntime returns: a tensor (:func:`compare`, with the dtype's
    tolerance), a sequence (same length, each element compared), a map (same keys, values
    compared; float values as float32, the type of ZipMap's) or an empty optional (None)."""
    kb, ka = _value_kind(before), _value_kind(after)
    if kb != ka:
        return {"ok": False, "problem": f"a {kb} in the original, a {ka} now"}
    if kb == "tensor":
        r, t, why = tolerance(before.dtype.name, low_precision, rtol, atol)
        return {**compare(before, after, r, t), "tolerance": why}
    if kb == "empty optional":
        return {"ok": True, "elements": 0}
    if kb == "map":
        if sorted(before, key=repr) != sorted(after, key=repr):
            return {"ok": False, "problem": "the map's keys differ"}
        keys = sorted(before, key=repr)
        as_array = lambda m: np.asarray([m[k] for k in keys], np.float32 if all(  # noqa: E731
            isinstance(m[k], float) for k in keys) else None)
        return {"kind": "map", **compare_value(as_array(before), as_array(after), low_precision=low_precision,
                                               rtol=rtol, atol=atol)}
    if len(before) != len(after):
        return {"ok": False, "kind": "sequence",
                "problem": f"a sequence of {len(before)} in the original, of {len(after)} now"}
    parts = [compare_value(b, a, low_precision=low_precision, rtol=rtol, atol=atol) for b, a in zip(before, after)]
    row = {"kind": "sequence", "length": len(parts), "elements": sum(p.get("elements", 0) for p in parts),
           "out_of_tolerance": sum(p.get("out_of_tolerance", 0) for p in parts),
           "max_abs": _worst([p["max_abs"] for p in parts if "max_abs" in p]),
           "max_rel": _worst([p["max_rel"] for p in parts if "max_rel" in p]),
           "ok": all(p["ok"] for p in parts)}
    bad = next((k for k, p in enumerate(parts) if not p["ok"]), None)
    if bad is not None:
        row["problem"] = f"element {bad}: {problem_text(parts[bad])}"
    return row


def compare_all(before: Sequence[tuple[str, object]], after: Sequence[tuple[str, object]], *,
                low_precision: bool = False, rtol: float | None = None, atol: float | None = None) -> list[dict]:
    """One row per output, matched by name and position (a caller may fetch outputs either way):
    an output missing, at another position or added fails."""
    names_before = [name for name, _ in before]
    names_after = [name for name, _ in after]
    rows = []
    for i, (name, value) in enumerate(before):
        j = names_after.index(name) if name in names_after else None
        if j is None:
            now = f" (output {i} is now {names_after[i]!r})" if i < len(after) else ""
            rows.append({"name": name, "ok": False, "problem": f"missing in the optimized model{now}"})
        elif j != i:
            rows.append({"name": name, "ok": False, "problem": f"output {i} in the original, output {j} now"})
        else:
            rows.append({"name": name, **compare_value(value, after[j][1], low_precision=low_precision, rtol=rtol,
                                                       atol=atol)})
    rows += [{"name": name, "ok": False, "problem": f"output {j} of the optimized model, not in the original"}
             for j, name in enumerate(names_after) if name not in names_before]
    return rows


def _number(x) -> str:
    return f"{x:.7g}" if isinstance(x, float) else repr(x)


def problem_text(row: dict) -> str:
    """What is wrong with one compared output, in words."""
    if row.get("problem"):
        return row["problem"]
    text = f"{row.get('out_of_tolerance')}/{row.get('elements')} elements out of tolerance"
    nonfinite = row.get("nan_mismatch", 0) + row.get("inf_mismatch", 0)
    if nonfinite:
        text += f" ({nonfinite} non-finite: {row.get('nan_mismatch', 0)} NaN, {row.get('inf_mismatch', 0)} inf)"
    ex = row.get("example")
    if ex:
        text += (f", {ex['which']}: {_number(ex['before'])} vs {_number(ex['after'])} "
                 f"at [{', '.join(map(str, ex['index']))}]")
    if "max_abs" in row:
        text += f"; max abs {short_number(row['max_abs'])}, max rel {short_number(row['max_rel'])}"
    return text


def short_number(x, digits: int = 3) -> str:
    """A statistic as the messages and tables write it: ``digits`` significant digits, "-" for None."""
    if x is None:
        return "-"
    if isinstance(x, float):
        if x == 0:
            return "0"
        return f"{x:.{digits}g}"
    return str(x)
