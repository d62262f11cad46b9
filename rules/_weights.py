"""Folding constants into a convolution's weights and bias, exactly up to rounding: the checks the
conv and BatchNormalization families share (this module holds no rules).

A fold that moves a factor or an offset into weights changes how results round, as onnxruntime's
own Conv fusions do; it must change nothing more. So it refuses a zero factor (conv * 0 is -0.0
where the conv is negative and NaN where it overflows, zero weights give +0.0), constants or
weights holding inf or NaN, and folded values that overflow, flush to 0 or become subnormal where
they were normal: then NaN and infinities of the input propagate as before, and no weight keeps
fewer bits than its type holds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from onnxopt.core.pattern import Match, Refuse


def non_finite(arrays: dict[str, np.ndarray | None]) -> str | None:
    """The refusal for folding constants of which one holds inf or NaN, else None."""
    for name, array in arrays.items():
        if array is not None and not np.all(np.isfinite(array)):
            return f"{name} holds inf or NaN"
    return None


def folded_refusal(name: str, after: np.ndarray, before: np.ndarray | None = None) -> str | None:
    """Why folded weights or bias ``after`` (in their own type) could change results beyond
    rounding, else None: they overflow, or (``before``: the values a factor scaled) a nonzero
    weight rounds to 0 and its input no longer counts, or a weight that was a normal number
    becomes a subnormal one (it keeps fewer bits than the type's: a large input then gives
    more than rounding's difference; the original scaled the sum, which stays normal)."""
    if not np.all(np.isfinite(after)):
        return f"the folded {name} overflow"
    if before is not None:
        if np.any((after == 0) & (before != 0)):
            return f"the folded {name} underflow to 0"
        if after.dtype.kind == "f":
            tiny = _tiny(after.dtype)
            if np.any((np.abs(after) < tiny) & (np.abs(before) >= tiny)):
                return f"the folded {name} underflow to subnormal numbers"
    return None


def _tiny(dtype) -> float:
    """The smallest normal number of the float type (ml_dtypes' for bfloat16 and the like)."""
    try:
        return float(np.finfo(dtype).tiny)
    except (TypeError, ValueError):
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).tiny)


def fold_weights(m: Match, factor: np.ndarray, fold: Callable[[], tuple], *,
                 bias_scaled: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """``fold()``: the weights ``m.const("w")`` and bias ``m.const("b")`` (or None) with the
    per-output-channel ``factor`` folded in, when that equals scaling the conv's result up to
    rounding (NaN and infinities of the input included); raises Refuse otherwise (see the module).
    ``bias_scaled``: the new bias is the old one times the factor (so it must not underflow
    where the old one did not, as the weights)."""
    if np.any(factor == 0):
        raise Refuse("a zero factor")
    w, bias = m.const("w"), m.const("b")
    reason = non_finite({"the weights": w, "the bias": bias})
    if reason is None:
        with np.errstate(over="ignore", under="ignore"):
            new_w, new_b = fold()
        reason = folded_refusal("weights", new_w, w)
        if reason is None and new_b is not None:
            reason = folded_refusal("bias", new_b, bias if bias_scaled else None)
    if reason:
        raise Refuse(reason)
    return new_w, new_b
