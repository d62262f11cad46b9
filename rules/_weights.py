"""Folding constants into a convolution's weights and bias, exactly up to rounding: the checks the
conv and BatchNormalization families share (this module holds no rules).

A fold that moves a factor or an offset into weights changes how results round, as onnxruntime's
own Conv fusions do; it must change nothing more. So it refuses a zero factor (conv * 0 is -0.0
where the conv is negative and NaN where it overflows, zero weights give +0.0), constants or
weights holding inf or NaN, and folded values that overflow or flush to 0: then NaN and infinities
of the input propagate as before.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from onnxopt.pattern import Match, Refuse


def non_finite(arrays: dict[str, np.ndarray | None]) -> str | None:
    """The refusal for folding constants of which one holds inf or NaN, else None."""
    for name, array in arrays.items():
        if array is not None and not np.all(np.isfinite(array)):
            return f"{name} holds inf or NaN"
    return None


def folded_refusal(name: str, after: np.ndarray, before: np.ndarray | None = None) -> str | None:
    """Why folded weights or bias ``after`` (in their own type) could change results beyond
    rounding, else None: they overflow, or (``before``: the values a factor scaled) a nonzero
    weight rounds to 0 and its input no longer counts."""
    if not np.all(np.isfinite(after)):
        return f"the folded {name} overflow"
    if before is not None and np.any((after == 0) & (before != 0)):
        return f"the folded {name} underflow to 0"
    return None


def fold_weights(m: Match, factor: np.ndarray, fold: Callable[[], tuple]) -> tuple[np.ndarray, np.ndarray | None]:
    """``fold()``: the weights ``m.const("w")`` and bias ``m.const("b")`` (or None) with the
    per-output-channel ``factor`` folded in, when that equals scaling the conv's result up to
    rounding (NaN and infinities of the input included); raises Refuse otherwise (see the module)."""
    if np.any(factor == 0):
        raise Refuse("a zero factor")
    w, bias = m.const("w"), m.const("b")
    reason = non_finite({"the weights": w, "the bias": bias})
    if reason is None:
        with np.errstate(over="ignore", under="ignore"):
            new_w, new_b = fold()
        reason = folded_refusal("weights", new_w, w)
        if reason is None and new_b is not None:
            reason = folded_refusal("bias", new_b)
    if reason:
        raise Refuse(reason)
    return new_w, new_b
