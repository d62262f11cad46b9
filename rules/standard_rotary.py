"""Rotary position embedding as the standard ``RotaryEmbedding`` (opset 23), for target ``portable``.

``x * cos + rotate_half(x) * sin`` on [B, N, S, h] (and partial rotary's ``Concat(that on q[..., :rot],
q[..., rot:])``): matched by rules/rotary.py's ``rotary_match`` (the same forms and refusals as the
com.microsoft fusion of onnxruntime's targets). The standard op takes the 4-D input as it is (no
``num_heads``: that is for a 3-D input) and, without ``position_ids``, its cos/sin caches as [B, S, rot/2]
per token: the model's own cos and sin, their first half on the last axis (the second repeats it:
half-periodic, which the match proves), so no position table is built and positions past a table's end
cannot happen. Where cos/sin have one row for the whole batch (B' = 1) the caches are Expanded to the
input's batch (the kernel takes no broadcast). ``rotary_embedding_dim`` = rot for partial rotary;
``interleaved`` = 0 (the matcher reads the half-split form only). One cache pair per cos/sin value, built
before the first layer's rewrite and read by every layer.

Written only where the model imports opset >= 23 and the installed onnxruntime has the kernel
(rules/_standard_parts.py), else refused with the reason. Not exact (``exact=False``): the kernel
computes ``x*c - y*s`` in its own order.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.core.pattern import Match, Op, Rule
from onnxopt.targets import PORTABLE

from onnxopt.rules._semantic import earlier, typed
from onnxopt.rules._standard_parts import standard_refusal
from onnxopt.rules.rotary import rotary_match


def _condition(m: Match):
    found = rotary_match(m)
    if isinstance(found, str):
        return found
    if reason := standard_refusal("RotaryEmbedding", m.opset(""), found["dtype"]):
        return reason
    m.nodes = found["nodes"]
    m.outputs = [found["out"]]
    return found


def _cache(m: Match, b, value: ir.Value, half: int) -> ir.Value:
    """``value[..., :half]`` as the op's [B, S, half] cache (Expanded to the input's batch where ``value``
    has one row for it), built once per value."""
    p = m.plan
    name = f"{value.name}_standard_rotary_cache"
    found = earlier(m, name)
    if found is not None:
        return found
    cache = b.op("Slice", value, b.const(np.array([0], np.int64), "zero"), b.const(np.array([half], np.int64), "half"),
                 b.const(np.array([-1], np.int64), "last"))
    if p["shared"]:
        batch = b.op("Shape", p["q"], start=0, end=1)
        cache = b.op("Expand", cache, b.op("Concat", batch, b.const(np.array([1, 1], np.int64), "ones"), axis=0))
    return b.name(cache, name)


def _replace(m: Match, b):
    p = m.plan
    half = p["rot"] // 2
    attrs = {"interleaved": 0}
    if p["head"] is None or p["rot"] != p["head"]:
        attrs["rotary_embedding_dim"] = p["rot"]
    y = b.op("RotaryEmbedding", p["q"], _cache(m, b, p["cos"], half), _cache(m, b, p["sin"], half), **attrs)
    return typed(y, p["q"], m)


RULES = [
    Rule("standard_rotary_embedding", Op("Neg", "x2"), _replace, condition=_condition, targets=(PORTABLE,),
         benefit="rotary_embedding", exact=False,
         doc="x * cos + Concat(-x[..., h/2:], x[..., :h/2]) * sin on [B, N, S, h] (cos and sin half-periodic), with "
             "partial rotary's pass-through, becomes the standard RotaryEmbedding (portable; opset >= 23 and "
             "onnxruntime's kernel) reading the model's own per-token cos/sin as [B, S, rot/2] caches."),
]
