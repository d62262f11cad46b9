"""Exact mode's guard for rules that take a node out (this module holds no rules).

A node that computes nothing (an identity Transpose, a Reshape to the shape it has, Squeeze after
Unsqueeze, a one-input Concat...) can still change what onnxruntime computes: its graph optimizer
fuses pairs of adjacent nodes (MatMul + Add into Gemm, Conv + Add/Mul/BatchNormalization into the
weights, MatMul + a scalar Mul, Add + LayerNormalization...), and a node between them stops the
fusion. Removing one that onnxruntime keeps joins the two, and the fused kernel rounds otherwise:
MatMul -> Reshape(to its own shape) -> Add(bias) rounds twice; MatMul -> Add is one Gemm, which
rounds once. onnxruntime itself removes Identity, Dropout, a Cast to the same type, Expand to a
shape covered, cancelling Transposes and x op neutral-scalar, so those rules need no guard.

:func:`exact_removal` wraps the condition of a rule whose replacement forwards x (the node goes):
in exact mode it refuses unless the removal joins nothing -- x is a graph input or a constant, or
what the node gave is read by no node (a graph output only).
"""

from __future__ import annotations

from collections.abc import Callable

from onnxopt.core.pattern import Match


def joins_nodes(m: Match, what: str) -> str | None:
    """Exact mode: why taking the matched ``what`` out from between x's producer and the readers
    of its output could change onnxruntime's fusions, else None."""
    producer = m["x"].producer()
    if producer is None or producer.op_type == "Constant":
        return None
    readers = sorted({node.op_type for node, _ in m.root.outputs[0].uses()})
    if not readers:
        return None
    return (f"exact: onnxruntime keeps this {what}; without it {producer.op_type} would feed "
            f"{'/'.join(readers)} directly, which its optimizer may fuse (other rounding)")


def exact_removal(condition: Callable | None, what: str, forwards: Callable[[Match, object], bool] | None = None):
    """``condition`` (None: always accepts), then in exact mode :func:`joins_nodes`. ``forwards(m,
    verdict)``: whether this match's replacement takes the node out (default: always)."""

    def guarded(m: Match):
        verdict = condition(m) if condition is not None else None
        if isinstance(verdict, str) or verdict is False or not m.options.get("exact"):
            return verdict
        if forwards is not None and not forwards(m, verdict):
            return verdict
        return joins_nodes(m, what) or verdict

    guarded.__name__ = getattr(condition, "__name__", f"{what}_condition")
    guarded.__doc__ = getattr(condition, "__doc__", None)
    return guarded
