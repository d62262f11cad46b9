"""A decoder's attention, with or without a key/value cache -> com.microsoft GroupQueryAttention (ort-cpu).

What is matched, from the pieces of rules/_attention_parts.py, rooted at the head merge as the encoder
fusion (rules/attention.py) is:

    out = head_merge(softmax(masked_scores(heads(Q') @ repeat(cache(K'))^T)) @ repeat(cache(V')))

- Q' and K' are a projection split into heads, optionally rotated by com.microsoft RotaryEmbedding (which
  rules/rotary.py makes of the exporters' ``x * cos + rotate_half(x) * sin``); V' the same without rotary.
- ``cache(x)`` is ``Concat(past, x)`` on the sequence axis (the kv form: the Concat is the model's
  ``present``) or ``x`` alone (a prefill without a cache).
- ``repeat`` is transformers' ``repeat_kv``: ``Unsqueeze -> Expand -> Reshape`` (with an Identity in dynamo
  exports), or nothing where every query head has its own key head.

Matched by semantics, not by one exporter's node sequence: every Reshape, Transpose, Unsqueeze and Expand on
the way is followed as a *layout* (rules/_head_layouts.py) with the atoms B, S (new tokens), T (keys: past +
new), G (key/value heads), R (query heads per key/value head, N = G x R, key/value head outermost, as
transformers' repeat_kv and GroupQueryAttention both group them) and D. The condition proves that Q reaches
the first MatMul as [B, G*R, S, D], K as [B, G*R, D, T] (its R a broadcast), V the second as [B, G*R, T, D]
and the output leaves as [B, S, G*R*D]; the scales' product is the op's ``scale``.

The mask is kept exactly as the model computes it: the additive mask the scores receive (causal, padding,
sliding window, whatever it holds) becomes the op's ``attention_bias`` [B|1, 1, S, T] and the op runs with
``causal=0`` (``causal=1`` where one token is new: its query sees every key either way, and the kernel is ~20%
faster so: 0.48 vs 0.58 ms at batch 4, past 512, 8/2 heads of 64, 1 thread), ``seqlens_k = T - 1`` and
``total_sequence_length = T`` for every row, so it attends exactly the
keys the original does, left padding included (onnxruntime-genai's models instead read lengths from the
mask, which is exact for right padding only). Rotary stays a RotaryEmbedding node (on the 3-D projection):
the op's own rotary takes positions from ``seqlens_k``, not the model's ``position_ids``. torch's NaN guard
(``Where(IsNaN(p), 0, p)``) with a -inf mask is kept as in rules/attention.py (the mask floored to the
lowest float, the rows no key reaches zeroed by one Mul).

The op writes the present key and value (past + new): ``group_query_attention_present`` then replaces the
model's own ``Concat(past, new)`` with the op's output (no second copy of the cache). onnxruntime refuses a
past with several new tokens at batch > 1 (measured, onnxruntime 1.32): a cached attention whose new
length is not 1 and whose batch is not 1 is refused.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from onnxopt.core.pattern import ANY, Absorbed, Explain, Match, Op, Or, Repeat, Rule, Var
from onnxopt.ir.shapes import infer, same_dim, same_symbol, shape_elements
from onnxopt.ir.util import constant_tensor
from onnxopt.rules._attention_parts import (MAX_VIEWS, MS, attention_output, dim_through, dims_of, head_norm, head_split,
                                            layout_step, masked_scores, one_reader, prime_shapes,
                                            scaled_dot_product, softmax, view_step)
from onnxopt.rules._head_layouts import (Layouts, NoFit, ancestors, apply_view, dtype_through, finite_mask, group_of_dim,
                                         scale_factor, scale_refusal, show_layout, split_heads, target_elements,
                                         zero_masked_rows)
from onnxopt.rules._semantic import earlier, kernel
from onnxopt.rules._mask_probe import CUDA_WINDOW_EXTRA, causal_padding_window, read_input, window_extra
from onnxopt.targets import ORT_CPU, ORT_CUDA

PRESENT_KEY = "onnxopt.present_of"  # on the fused node: the names of the Concats its present outputs replace

# --------------------------------------------------------------------------------------------
# The pattern


def _heads(p: str, domain: str = MS):
    """``x<p>`` split into heads; Q's and K's also RMS-normalized per head (QK-norm: ``head_norm``; the
    standard path, rules/standard_attention.py, refuses a norm: its replacement takes none yet)."""
    return Or(head_split(p), head_norm(p)) if p in ("q", "k") else head_split(p)


def _rotated(p: str, domain: str = MS):
    """RotaryEmbedding (of ``domain``) of the heads of ``x<p>`` (``<p>_rot``; the views before it ``<p>_pre``)."""
    pre = Repeat(layout_step, _heads(p, domain), max=4, name=f"{p}_pre")
    if domain == MS:
        return Op("RotaryEmbedding", pre, Var(f"{p}_pos"), Var(f"{p}_cos"), Var(f"{p}_sin"), domain=MS,
                  name=f"{p}_rot", uses=one_reader)
    # the standard op (rules/standard_rotary.py's: X, cos_cache, sin_cache, no position_ids)
    return Op("RotaryEmbedding", pre, Var(f"{p}_cos"), Var(f"{p}_sin"), domain=domain, name=f"{p}_rot", uses=one_reader)


def _new(p: str, domain: str = MS):
    """This step's keys or values: heads, rotated or not, and views (``<p>_post``)."""
    return Repeat(layout_step, Or(_rotated(p, domain), _heads(p, domain)), max=4, name=f"{p}_post")


def _repeat_step(rest):
    """A view, a scale, or a step of repeat_kv (Expand of a size-1 axis; an Identity)."""
    return Or(view_step(rest), Op("Expand", rest, ANY, uses=one_reader), Op("Identity", rest, uses=one_reader))


def _cached(p: str, what: str, domain: str = MS):
    """``<p>``'s keys/values as the MatMul reads them: the cache Concat (``<p>_cat``, shared: it is the model's
    present, read on) of ``past_<p>`` and this step's, or this step's alone; then repeat_kv and views
    (``<p>_views``)."""
    cat = Op("Concat", Var(f"past_{p}"), _new(p, domain), name=f"{p}_cat", shared=True)
    return Explain(Repeat(_repeat_step, Or(cat, _new(p, domain)), max=MAX_VIEWS, name=f"{p}_views"),
                   f"{what} is not a projection's heads (normalized, rotated, cached, repeated)")


def _query(domain: str = MS):
    return Explain(Repeat(view_step, Or(_rotated("q", domain), _heads("q", domain)), max=MAX_VIEWS - 1,
                          name="q_views"),
                   "Q is not a projection's heads (normalized per head or not, rotated or not)")

def _merged(attn):
    """The root: the Reshape that merges the heads, after any views (``merge_views``: a Transpose, or the
    Reshape a Transpose of a size-1 axis became), all absorbed (the layouts say whether they merge)."""
    return Op("Reshape", Absorbed(Repeat(layout_step, attn, max=MAX_VIEWS - 1, name="merge_views")), "shape",
              name="out")


def decoder_attention(rotary_domain: str = MS):
    """The decoder's attention pattern, its rotary the ``rotary_domain``'s RotaryEmbedding (com.microsoft here;
    rules/standard_attention.py's: the standard op's)."""
    return _merged(attention_output(softmax(masked_scores(
        scaled_dot_product(_query(rotary_domain), _cached("k", "K", rotary_domain)), softcap=True)),
        _cached("v", "V", rotary_domain)))


DECODER_ATTENTION = decoder_attention()


# --------------------------------------------------------------------------------------------
# The condition


def _expand(ctx: Layouts, layout: list[tuple], node: ir.Node) -> list[tuple]:
    """repeat_kv's Expand: a size-1 axis broadcast to R; every other axis kept."""
    target = node.inputs[1]
    prime_shapes(target, ctx.m.opsets)
    elements = target_elements(ctx, target)
    if elements is None or len(elements) != len(layout):
        raise NoFit("an Expand of the keys has no readable target of its rank")
    out = []
    for group, e in zip(layout, elements):
        size = 1
        for atom in group:
            size *= ctx.size(atom) or 0
        if isinstance(e, int):
            if e == 1 or (group and e == size):
                out.append(group)
            elif not group and e == ctx.size("R"):
                out.append(("R",))
            else:
                raise NoFit(f"an Expand of the keys makes a dimension of {e}, not one of the query heads per key head")
        elif ctx.norm([group_of_dim(ctx, e)])[0] == group:
            out.append(group)
        else:
            raise NoFit("an Expand of the keys broadcasts to a size not read from the heads")
    return out


def _step(ctx: Layouts, layout: list[tuple], node: ir.Node) -> list[tuple]:
    if node.op_type == "Expand":
        return _expand(ctx, layout, node)
    if node.op_type == "Identity":
        return layout
    return apply_view(ctx, layout, node)


def _chain(ctx: Layouts, layout: list[tuple], nodes) -> list[tuple]:
    for node in nodes:
        layout = _step(ctx, layout, node)
        ctx.layouts[node.outputs[0]] = layout
    return layout


def _rotary_ok(m: Match, ctx: Layouts, p: str, layout: list[tuple], heads: tuple) -> None:
    """The RotaryEmbedding reads the heads as [B, heads, S, D] (the 4-D form) or [B, S, heads*D]: then the
    same op on the 3-D projection [B, S, heads*D] rotates the same elements by the same positions."""
    node = m.node(f"{p}_rot")
    if node is None:
        return
    want4 = layout == ctx.norm([("B",), heads, ("S",), ("D",)])
    want3 = layout == ctx.norm([("B",), ("S",), heads + ("D",)])
    if not (want4 or want3):
        raise NoFit(f"the rotary of {p.upper()} reads {show_layout(layout)}, not [B,heads,S,D]")
    if node.attributes.get("interleaved") is not None and node.attributes["interleaved"].value not in (0, 1):
        raise NoFit("the rotary's interleaved attribute is not 0 or 1")


_NORM_NODES = ("square", "mean", "eps_add", "sqrt", "reciprocal", "divide", "scale", "norm_op")


def _norm_nodes(m: Match, p: str) -> list[ir.Node]:
    """The nodes of ``<p>``'s per-head normalization (QK-norm), in data order; [] where there is none."""
    if p not in ("q", "k"):  # (V is never normalized: the pattern has no norm for it)
        return []
    return [n for n in (m.node(f"{p}_{k}") for k in _NORM_NODES) if n is not None]


def _ints_of(value: ir.Value | None) -> list[int] | None:
    t = constant_tensor(value) if value is not None else None
    return None if t is None or t.numpy().dtype.kind not in "iu" else [int(a) for a in t.numpy().reshape(-1)]


def _norm_ok(m: Match, ctx: Layouts, p: str, layout: list[tuple]) -> list[tuple]:
    """``<p>``'s per-head RMS normalization (if any) normalizes each head's D elements alone: over the
    last axis of a layout whose last dimension is D, the epsilon one number, the weight one per D (or one);
    the layout of what it reads and writes (the same elements, the same order)."""
    nodes = _norm_nodes(m, p)
    if not nodes:
        return layout
    views = (*m.chain(f"{p}_norm_views"), *filter(None, [m.node(f"{p}_norm_view")]))
    layout = _chain(ctx, layout, views)
    if len(layout) != 4 or layout[-1] != ctx.norm([("D",)])[0]:
        raise NoFit(f"{p.upper()} is normalized over the last axis of {show_layout(layout)}, not over D")
    d = ctx.size("D")
    op = m.node(f"{p}_norm_op")
    if op is not None:
        axis = op.attributes.get("axis")
        if axis is not None and axis.value not in (-1, 3):
            raise NoFit(f"{p.upper()}'s {op.op_type} normalizes from axis {axis.value}, not the last one")
        eps = op.attributes.get("epsilon")
        eps = 1e-5 if eps is None else eps.value
    else:
        mean = m.node(f"{p}_mean")
        keep = mean.attributes.get("keepdims")
        axes = _ints_of(mean.inputs[1]) if len(mean.inputs) > 1 and mean.inputs[1] is not None \
            else (list(mean.attributes["axes"].value) if mean.attributes.get("axes") is not None else None)
        if (keep is not None and keep.value != 1) or axes not in ([-1], [3]):
            raise NoFit(f"{p.upper()}'s RMS normalization does not average the last axis (keeping it)")
        eps = float(m.const(f"{p}_eps").reshape(-1)[0]) if m.node(f"{p}_eps_add") is not None else 0.0
    if not eps >= 0:
        raise NoFit(f"{p.upper()}'s RMS normalization adds {eps}, not a number >= 0")
    gamma = m.const(f"{p}_gamma")
    if gamma is not None and (gamma.ndim > 4 or any(k != 1 for k in gamma.shape[:-1])
                              or gamma.size not in (1, d) or gamma.dtype.kind != "f"):
        raise NoFit(f"{p.upper()}'s normalization weight has shape {list(gamma.shape)}, not [D]")
    for node in nodes[nodes.index(m.node(f"{p}_divide") or op):]:  # (the division, the weight: the same layout)
        ctx.layouts[node.outputs[0]] = layout
    return layout


def _new_part(m: Match, ctx: Layouts, p: str, heads: tuple, length: str) -> list[tuple]:
    """Follow ``<p>``'s split (per-head normalization and rotary) up to what the cache Concat (or the repeat)
    reads."""
    split = m.node(f"{p}_split")
    layout = split_heads(ctx, m[f"x{p}"], split, "B", length, heads)
    ctx.layouts[split.outputs[0]] = layout
    layout = _norm_ok(m, ctx, p, layout)
    if m.node(f"{p}_rot") is not None:
        layout = _chain(ctx, layout, m.chain(f"{p}_pre"))
        _rotary_ok(m, ctx, p, layout, heads)
        ctx.layouts[m.node(f"{p}_rot").outputs[0]] = layout
    return layout if p == "q" else _chain(ctx, layout, m.chain(f"{p}_post"))


def _cache(m: Match, ctx: Layouts, p: str, layout: list[tuple]) -> list[tuple]:
    """The Concat of the past and this step's [B, G, S, D] on the sequence axis: [B, G, T, D]."""
    cat = m.node(f"{p}_cat")
    if cat is None:
        return layout
    if layout != ctx.norm([("B",), ("G",), ("S",), ("D",)]):
        raise NoFit(f"the cache is concatenated with {show_layout(layout)}, not [B,G,S,D]")
    axis = cat.attributes.get("axis")
    if axis is None or axis.value not in (2, -2):
        raise NoFit("the cache is not concatenated on the sequence axis")
    past = m[f"past_{p}"]
    dims = dims_of(past, m.opsets)
    if dims is None or len(dims) != 4 or dims[1] != ctx.size("G") or dims[3] != ctx.size("D"):
        raise NoFit("the past is not [B, G, P, D] with G and D known")
    if dtype_through(past, m.opsets) != dtype_through(m[f"x{p}"], m.opsets):
        raise NoFit("the past's type is not the projection's")
    out = ctx.norm([("B",), ("G",), ("T",), ("D",)])
    ctx.layouts[cat.outputs[0]] = out
    return out


def _length_sources(m: Match, ctx: Layouts) -> None:
    """Graph inputs [B, T] (the attention mask: dynamo's repeat_kv reads its lengths from it) and [B, S]
    known by their dimensions' symbols, so a Reshape/Expand target reading them is understood."""
    xq, cat = m["xq"], m.node("k_cat")
    if cat is not None:
        ctx.sum_of = lambda a, c: _keys_length(m, ctx, a, c)
    for p in ("q", "k", "v"):  # the projections and what they project: [B, S, ...]
        for a in ancestors(m[f"x{p}"], m.opsets):
            ctx.sources.setdefault(a, ("B", "S"))
    for g in m.graph.inputs:
        if g.shape is not None and len(g.shape) > 2 and same_dim(g, 0, xq, 0):
            # (a past of any layer: exporters read the batch from one for all; its other dimensions are
            # atoms of their own, which no layout of the heads has)
            ctx.layouts.setdefault(g, [("B",)] + [(f"{g.name}[{k}]",) for k in range(1, len(g.shape))])
        if g.shape is None or len(g.shape) != 2 or not same_dim(g, 0, xq, 0):
            continue
        if same_dim(g, 1, xq, 1):
            ctx.sources.setdefault(g, ("B", "S"))
        elif cat is not None and same_symbol(g, 1, cat.outputs[0], 2):
            ctx.sources.setdefault(g, ("B", "T"))


def _unexpanded(m: Match, mask: ir.Value) -> tuple[ir.Value, ir.Node | None]:
    """(the mask before an Expand that only repeats it, the Where around that Expand or None): ``Expand(x)``
    -> x, ``Where(Expand(keep), a, b)`` -> ``Where(keep, a, b)`` (a and b constants). An Expand never
    shrinks, and the layouts proved the merged output [B, S, N*D]: the scores plus the mask have the scores'
    shape, so the Expand added nothing the Add's broadcast does not (legacy exports expand the causal mask to
    a target computed at run time, which no shape says is [B, 1, S, T])."""
    node = mask.producer()
    if node is not None and node.op_type == "Expand" and node.domain in ("", "ai.onnx"):
        return node.inputs[0], None
    if node is not None and node.op_type == "Where" and node.domain in ("", "ai.onnx"):
        inner = node.inputs[0].producer()
        if inner is not None and inner.op_type == "Expand" and inner.domain in ("", "ai.onnx") \
                and all(constant_tensor(v) is not None for v in node.inputs[1:]):
            return inner.inputs[0], node
    return mask, None


def _reads(value: ir.Value | None, wanted: set, limit: int = 400) -> bool:
    """value is computed from one of ``wanted`` (a walk up the producers, at most ``limit`` values)."""
    todo, seen = [value], set()
    while todo and len(seen) < limit:
        v = todo.pop()
        if v is None or id(v) in seen:
            continue
        if v in wanted:
            return True
        seen.add(id(v))
        node = v.producer()
        if node is not None:
            todo.extend(node.inputs)
    return bool(todo)  # (not walked to the end: assumed to read it)


def _key_slice(m: Match, mask: ir.Value, caches: set):
    """(Slice, Where or None) where the mask reads the keys (``caches``: the cache Concats, or the keys'
    projection without a cache) only for their length: ``[Where(]Slice(x, 0, end, [-1|3])[, a, b)]`` (a, b
    constants; transformers 4.57's ``causal_mask[:, :, :, :key.shape[-2]]``), ``end`` a dimension proven the
    keys' length (the cache Concat's sequence dimension, or the projection's) and ``x`` not reading them: the
    rewrite slices to its own T (the present the op writes cannot feed its own mask, and the keys it absorbs
    need not stay for a Shape). Else the reason."""
    reason = "the mask reads the cache (the present the op writes would feed its own mask)"
    node, where = mask.producer(), None
    if node is not None and node.op_type == "Where" and node.domain in ("", "ai.onnx") \
            and all(constant_tensor(v) is not None for v in node.inputs[1:]):
        node, where = node.inputs[0].producer(), node
    if node is None or node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 4:
        return reason
    ins = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, axes = (constant_tensor(v) if v is not None else None for v in (ins[1], ins[3]))
    steps = constant_tensor(ins[4]) if ins[4] is not None else None
    if starts is None or axes is None or starts.numpy().reshape(-1).tolist() != [0] \
            or axes.numpy().reshape(-1).tolist() not in ([3], [-1]) \
            or (ins[4] is not None and (steps is None or steps.numpy().reshape(-1).tolist() != [1])):
        return reason
    prime_shapes(ins[2], m.opsets)
    end = shape_elements(ins[2])
    cat = m.node("k_cat")
    keys = dim_through(cat.outputs[0], 2, m.opsets) if cat is not None else dim_through(m["xk"], 1, m.opsets)
    if end is None or len(end) != 1 or not isinstance(end[0], tuple) or _reads(ins[0], caches) \
            or str(dim_through(end[0][1], end[0][2], m.opsets)) != str(keys) \
            or keys is None or str(keys).startswith("unk__") or getattr(keys, "value", keys) is None:
        return reason
    return node, where


def _keys_length(m: Match, ctx: Layouts, a, c):
    """past + new, read from a past's sequence dimension and the new tokens' (dynamo's ``sym_size`` sum), is
    the keys' length T: the cache Concat's sequence dimension."""
    past = m["past_k"]
    for x, y in ((a, c), (c, a)):
        if isinstance(x, int) or isinstance(y, int) or not same_symbol(x[1], x[2], past, 2):
            continue
        try:
            new = group_of_dim(ctx, y)
        except NoFit:
            continue
        if ctx.norm([new])[0] == ctx.norm([("S",)])[0] and ctx.norm([("S",)])[0]:
            return ("dim", m.node("k_cat").outputs[0], 2)
    return None


def _mask_dims(m: Match, ctx: Layouts, mask: ir.Value, t_of: ir.Value, t_axis: int):
    """(proven, unexpanded): proven True when the mask is [B|1, 1, S, T] (T: dimension ``t_axis`` of
    ``t_of``), False when it must be Expanded to S and T; unexpanded ``_unexpanded``'s pair where the mask is
    read from before an Expand, else None. Or a reason."""
    if dtype_through(mask, m.opsets) != dtype_through(m["xq"], m.opsets):
        return "the mask's type is not the scores'"
    dims = dims_of(mask, m.opsets)
    unexpanded = None
    if dims is not None and len(dims) == 4 and dims[1] != 1:
        inner, where = _unexpanded(m, mask)
        if inner is not mask:
            unexpanded = (inner, where)
            mask = inner
            dims = dims_of(mask, m.opsets)
    if dims is None or len(dims) != 4:
        return "the mask is not of rank 4"
    if dims[1] != 1 and dim_through(mask, 1, m.opsets) == 1:
        # (read through what made it: transformers 4.57's sdpa mask, a Slice of the keys of an Expand of
        # And([1, 1, S, T], padding [B, 1, 1, T]) to Where(Equal([B, -1, S, T], -1), 1, .), inferred [None]*4)
        dims = [dims[0], 1, *dims[2:]]
    if dims[1] != 1:
        return "the mask differs by head"
    if isinstance(dims[0], int) and dims[0] not in (1, ctx.size("B")):
        return "the mask does not broadcast over the batch"

    def same(k, atom, value, axis):
        d, size = dims[k], ctx.size(atom)
        if isinstance(d, int):
            return size is not None and d == size
        return d is not None and same_symbol(mask, k, value, axis)

    return same(2, "S", m["xq"], 1) and same(3, "T" if m.node("k_cat") is not None else "S", t_of, t_axis), unexpanded


def gqa_condition(m: Match):
    axis = m.node("softmax").attributes.get("axis")
    axis = -1 if axis is None and m.opset("") >= 13 else (axis.value if axis is not None else 1)
    if axis not in (-1, 3):
        return "Softmax is not over the last axis"
    if (m.node("k_cat") is None) != (m.node("v_cat") is None):
        return "the keys and the values are not both cached"
    cached = m.node("k_cat") is not None
    scale, mask = 1.0, m["mask"]
    for node in reversed(m.chain("scores_scales")):
        scale *= scale_factor(node)
    if mask is not None and scale != 1.0:
        return "the mask is added before a scale"
    softcap = 0.0
    if m.node("cap") is not None:  # cap * tanh(s / cap): the op's softcap (applied before the mask, as here)
        cap_in, cap_out = (float(m.const(c).reshape(-1)[0]) for c in ("cap_in", "cap_out"))
        if cap_in != cap_out or not cap_in > 0:
            return f"the soft-cap divides by {cap_in} and multiplies by {cap_out}"
        if scale != 1.0:
            return "the soft-capped scores are scaled again"
        softcap = cap_in
    for name in ("qk_scales", "q_views", "k_views"):
        for node in m.chain(name):
            scale *= scale_factor(node)
    if any(n.op_type in ("Mul", "Div") for n in m.chain("v_views")):
        return "V is scaled"
    ctx = Layouts(m)
    t = "T" if cached else "S"
    try:
        _length_sources(m, ctx)
        lk = _cache(m, ctx, "k", _new_part(m, ctx, "k", ("G",), "S"))
        lv = _cache(m, ctx, "v", _new_part(m, ctx, "v", ("G",), "S"))
        lq = _new_part(m, ctx, "q", ("G", "R"), "S")
        lq = _chain(ctx, lq, m.chain("q_views"))
        lk = _chain(ctx, lk, m.chain("k_views"))
        lv = _chain(ctx, lv, m.chain("v_views"))
        # the two ways the exporters multiply grouped heads: every query head with its key head repeated
        # (repeat_kv: [B, G*R, S, D] @ [B, G*R, D, T]), or the query heads of one key head as rows of one
        # matrix (torch's sdpa with enable_gqa, legacy: [B, G, R*S, D] @ [B, G, D, T])
        forms = {"repeated": (("B",), ("G", "R"), ("S",)), "grouped": (("B",), ("G",), ("R", "S"))}
        grouped = None
        for form, (bb, hh, rows) in forms.items():
            if lq == ctx.norm([bb, hh, rows, ("D",)]) and lk == ctx.norm([bb, hh, ("D",), (t,)]) \
                    and lv == ctx.norm([bb, hh, (t,), ("D",)]):
                grouped = form == "grouped"
                layout = ctx.norm([bb, hh, rows, ("D",)])
                break
        else:
            raise NoFit(f"Q, K and V reach the MatMuls as {show_layout(lq)}, {show_layout(lk)}, {show_layout(lv)}, "
                        "not [B,N,S,D], [B,N,D,T], [B,N,T,D] (nor grouped by key head)")
        ctx.layouts[m.node("pv").outputs[0]] = layout
        for node in (*m.chain("merge_views"), m.node("out")):
            layout = apply_view(ctx, layout, node)
            ctx.layouts[node.outputs[0]] = layout
        if layout != ctx.norm([("B",), ("S",), ("G", "R", "D")]):
            raise NoFit(f"the attention output is not merged into [B,S,N*D] (it is {show_layout(layout)})")
    except NoFit as exc:
        return str(exc)
    if not cached and m.node("q_rot") is None and m.node("k_rot") is None and ctx.size("R") in (None, 1):
        return "no cache, rotary or grouped heads: an encoder's attention (attention_fusion's)"
    xq = m["xq"]
    dtype = dtype_through(xq, m.opsets)
    if dtype is None or any(dtype_through(m[x], m.opsets) != dtype for x in ("xk", "xv")):
        return "Q, K and V differ in element type (or it is unknown)"
    target = m.options.get("target", ORT_CPU)
    if target == ORT_CUDA:
        runs_as = ir.DataType.FLOAT16 if dtype == ir.DataType.FLOAT and m.options.get("precision") == "fp16" \
            else dtype
        if runs_as not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            return (f"onnxruntime's CUDA GroupQueryAttention has float16 and bfloat16 kernels only (the model is "
                    f"{dtype.name.lower()}, --precision fp16 converts it)")
    elif kernel("GroupQueryAttention", MS, 1, target, dtype) is False:
        return f"no GroupQueryAttention kernel for {dtype.name.lower()} on {target}"
    if reason := scale_refusal(scale, dtype):
        return reason
    expand, unexpanded, key_slice = None, None, None
    if mask is not None and grouped and ctx.size("S") != 1 and ctx.size("R") not in (None, 1):
        return "the query heads are rows of one matrix per key head and the mask is not proven one row (S != 1)"
    if mask is not None:
        # T: the keys' length, the cache Concat's sequence dimension (the ids' without a cache)
        found = _mask_dims(m, ctx, mask, m.node("k_cat").outputs[0] if cached else xq, 2 if cached else 1)
        if isinstance(found, str):
            return found
        proven, unexpanded = found
        expand = not proven
        # the keys' length read from the keys (transformers 4.57): from the cache, a cycle once the present is
        # the op's (refused unless rebuilt); without one, what the op absorbs kept alive for a Shape (rebuilt)
        keys = {m.node("k_cat").outputs[0], m.node("v_cat").outputs[0]} if cached else {m["xk"]}
        if _reads(mask, keys):
            key_slice = _key_slice(m, mask, keys) if unexpanded is None else \
                "the mask reads the cache (the present the op writes would feed its own mask)"
            if isinstance(key_slice, str):
                if cached:
                    return key_slice
                key_slice = None
        if expand and m.opset("") < 15:
            return "the mask's shape is not proven [.., S, T] (opset < 15: no Shape start/end to expand it)"
    for p in ("q", "k"):
        rot = m.node(f"{p}_rot")
        if rot is not None and not one_reader(rot.inputs[0]):
            return f"the rotated {p.upper()}'s input is read elsewhere"
    guarded = m.node("guard") is not None
    want = ("B", "T") if cached else ("B", "S")
    length_input = next((g for g in m.graph.inputs if ctx.sources.get(g) == want), None)
    new_input = next((g for g in m.graph.inputs if ctx.sources.get(g) == ("B", "S")), None)
    lengths = None
    if m.options.get("padding", "any") != "any" or target == ORT_CUDA:
        lengths = _lengths_form(m, mask, new_input, dtype)
        if isinstance(lengths, str) and target == ORT_CUDA:
            return lengths
        if isinstance(lengths, str):  # (ort-cpu: the model's own mask as attention_bias, exact for any padding)
            lengths = None
    if cached and ctx.size("S") != 1 and ctx.size("B") != 1 and lengths is None:
        # (with --padding right the inputs are onnxruntime-genai's: a prompt at any batch after an empty past,
        # several tokens after a past at batch 1 only, as in its own models: the op's error otherwise)
        return ("the cache is extended by a length not proven 1 at a batch not proven 1 (onnxruntime's "
                "GroupQueryAttention refuses several new tokens after a past at batch > 1, and with --padding right "
                "takes onnxruntime-genai's inputs, a prompt after an empty past at any batch)")
    return {"lengths": lengths, "length_input": length_input, "new_input": new_input, "xq": xq, "xk": m["xk"], "xv": m["xv"], "dtype": dtype, "scale": scale, "mask": mask,
            "expand": expand, "keep_guard": guarded and mask is not None and not finite_mask(mask),
            "num_heads": ctx.size("G") * (ctx.size("R") or 1), "kv_heads": ctx.size("G"), "head": ctx.size("D"),
            "cached": cached, "softcap": softcap, "unexpanded": unexpanded, "key_slice": key_slice, "sizes": {a: ctx.size(a) for a in ("B", "S")}}


def _lengths_form(m: Match, mask: ir.Value | None, new_input: ir.Value | None, dtype: ir.DataType) -> dict | str:
    """The op reading sequence lengths from the attention mask (``seqlens_k = sum - 1``, causal, a window
    where the mask has one) instead of the mask itself: the user promised right padding or none (``--padding``;
    ort-cuda's kernel takes no mask), and the mask is checked to be the causal mask of that padding
    (rules/_mask_probe.py); a window only without padding (the op counts it over a row's real keys). ``{"attention_mask": value, "window": W or None, "checked_keys": n}`` or the reason."""
    padding = m.options.get("padding", "any")
    if padding == "any":
        return ("onnxruntime's CUDA GroupQueryAttention takes no mask (it reads sequence lengths, exact only when "
                "the attention mask's padding is at the end of each row, --padding right, or absent, none)")
    if mask is None:
        return "no mask is added to the scores (a causal mask of the attention mask's padding is expected)"
    length_input = read_input(m, mask)
    if length_input is None:
        return "the mask does not read one integer graph input [batch, keys] (the attention mask)"
    answer = causal_padding_window(m, mask, length_input, new_input if new_input is not length_input else None,
                                   m["past_k"] if m.node("k_cat") is not None else None, dtype)
    if isinstance(answer, str):
        return f"{answer} (--padding {padding})"
    if answer["window"] is not None and padding == "right":
        return (f"a sliding window of {answer['window']} keys with padding (onnxruntime's GroupQueryAttention counts "
                "the window over a row's real keys, the model over its positions, padding included; exact without "
                "padding, --padding none)")
    extra = CUDA_WINDOW_EXTRA if m.options.get("target") == ORT_CUDA else window_extra()
    if answer["window"] is not None and extra is None:
        return "onnxruntime's GroupQueryAttention does not run here, so its window (local_window_size) cannot be read"
    return {"attention_mask": length_input, "window_extra": extra, **answer}


# --------------------------------------------------------------------------------------------
# The replacement


def _i64(b, values, name):
    return b.const(np.array(values, np.int64), name=name)


def _normalize(m: Match, b, p: str, heads: int) -> ir.Value:
    """``x<p>`` [B, S, heads*D], normalized per head as the model normalized its heads (QK-norm): the same
    nodes (so the same arithmetic) on its [B, S, heads, D] view, then back to [B, S, heads*D]."""
    x, nodes = m.plan[f"x{p}"], _norm_nodes(m, p)
    if not nodes:
        return x
    d = m.plan["head"]
    mapped = {m[f"{p}_norm_in"]: b.op("Reshape", x, _i64(b, [0, 0, heads, d], f"gqa_{p}_heads"))}
    for node in nodes:
        attrs = {k: a.value for k, a in node.attributes.items()}
        y = b.op(node.op_type, *(mapped.get(v, v) for v in node.inputs), domain=node.domain, **attrs)
        mapped[node.outputs[0]] = y
    y = b.op("Reshape", y, _i64(b, [0, 0, heads * d], f"gqa_{p}_merged"))
    y.type, y.shape = x.type, x.shape
    return y


def _rotate(m: Match, b, p: str, heads: int) -> ir.Value:
    """``x<p>`` [B, S, heads*D] (normalized per head where the model does), rotated as the model's
    RotaryEmbedding rotated its heads (same positions, tables and attributes; the 3-D form with num_heads)."""
    x, rot = _normalize(m, b, p, heads), m.node(f"{p}_rot")
    if rot is None:
        return x
    attrs = {k: a.value for k, a in rot.attributes.items()}
    attrs["num_heads"] = heads
    y = b.op("RotaryEmbedding", x, *rot.inputs[1:], domain=MS, **attrs)
    y.type, y.shape = x.type, x.shape
    return y


def new_and_total(m: Match, b) -> tuple[ir.Value, ir.Value]:
    """(S, T) as 1-D int64 [1] values, T = past + S (constants where the sizes are known), built once per
    rewrite (two equal Shape nodes would be one rewrite twice to the fixpoint driver); T read once for every
    layer from a graph input that carries it (the attention mask [B, T]; the ids [B, S] without a cache)."""
    xq, sizes, src, ids = m.plan["xq"], m.plan["sizes"], m.plan["length_input"], m.plan["new_input"]
    if sizes["S"] is not None:
        new = _i64(b, [sizes["S"]], "gqa_new_length")
    elif ids is not None:  # (the new tokens' count from a graph input: one Shape for every layer)
        name = f"{ids.name}_gqa_new_length"
        new = earlier(m, name) or b.name(b.op("Shape", ids, start=1, end=2), name)
    else:
        new = b.op("Shape", xq, start=1, end=2)
    if src is not None:
        name = f"{src.name}_gqa_total_length"
        return new, earlier(m, name) or b.name(b.op("Shape", src, start=1, end=2), name)
    if not m.plan["cached"]:
        return new, new
    return new, b.op("Add", b.op("Shape", m["past_k"], start=2, end=3), new)


def _sequence_lengths(m: Match, b, total: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(seqlens_k [B] = T - 1 for every row, total_sequence_length = T) as int32 (once for every layer where
    T is read from a graph input)."""
    src = m.plan["length_input"]
    if src is not None:
        names = f"{src.name}_gqa_seqlens_k", f"{src.name}_gqa_total_sequence_length"
        found = [earlier(m, n) for n in names]
        if all(v is not None for v in found):
            return found[0], found[1]
    batch = m.plan["sizes"]["B"]
    rows = _i64(b, [batch], "gqa_batch") if batch is not None else \
        b.op("Shape", src if src is not None else m.plan["xq"], start=0, end=1)
    last = b.op("Expand", b.op("Sub", total, _i64(b, [1], "gqa_one")), rows)
    seqlens = b.op("Cast", last, to=int(ir.DataType.INT32))
    scalar = b.op("Cast", b.op("Reshape", total, _i64(b, [], "gqa_scalar")), to=int(ir.DataType.INT32))
    if src is not None:
        seqlens, scalar = b.name(seqlens, names[0]), b.name(scalar, names[1])
    return seqlens, scalar


def mask_bias(m: Match, b, new: ir.Value, total: ir.Value) -> tuple[ir.Value | None, ir.Value | None]:
    """(the op's attention_bias, the mask the NaN guard's rows are read from: before the floor and the Expand,
    so one factor serves every head)."""
    mask = m.plan["mask"]
    if mask is None:
        return None, None
    if m.plan["key_slice"] is not None:  # (sliced to the op's own T: not the cache's, which the op writes)
        cut, where = m.plan["key_slice"]
        mask = b.op("Slice", cut.inputs[0], cut.inputs[1], total, *cut.inputs[3:])
        mask.type, mask.shape = cut.outputs[0].type, cut.outputs[0].shape
        if where is not None:
            mask = b.op("Where", mask, *where.inputs[1:])
            mask.type, mask.shape = where.outputs[0].type, where.outputs[0].shape
    if m.plan["unexpanded"] is not None:
        inner, where = m.plan["unexpanded"]
        if where is not None:
            mask = b.op("Where", inner, *where.inputs[1:])
            mask.type, mask.shape = ir.TensorType(m.plan["dtype"]), inner.shape
        else:
            mask = inner
    guard = mask
    if m.plan["keep_guard"]:  # -inf -> the lowest finite value: no NaN rows (the guard's Mul zeroes them)
        lowest = np.array(np.finfo(m.plan["dtype"].numpy()).min, m.plan["dtype"].numpy())
        mask = b.op("Max", mask, b.const(lowest, name="attention_mask_floor"))
    if not m.plan["expand"]:
        return mask, guard
    return b.op("Expand", mask, b.op("Concat", b.op("Shape", mask, start=0, end=2), new, total, axis=0)), guard


def _mask_lengths(m: Match, b) -> tuple[ir.Value, ir.Value]:
    """(seqlens_k = ReduceSum(attention_mask) - 1 per row, total_sequence_length = its length) as int32, once
    for every layer: onnxruntime-genai's models' reading of a right-padded mask."""
    am = m.plan["lengths"]["attention_mask"]
    names = f"{am.name}_gqa_mask_seqlens_k", f"{am.name}_gqa_mask_total_length"
    found = [earlier(m, n) for n in names]
    if all(v is not None for v in found):
        return found[0], found[1]
    kept = b.op("ReduceSum", am, _i64(b, [1], "gqa_keys_axis"), keepdims=0)
    seqlens = b.op("Cast", b.op("Sub", kept, _i64(b, [1], "gqa_one")), to=int(ir.DataType.INT32))
    total = b.op("Cast", b.op("Reshape", b.op("Shape", am, start=1, end=2), _i64(b, [], "gqa_scalar")),
                 to=int(ir.DataType.INT32))
    return b.name(seqlens, names[0]), b.name(total, names[1])


def gqa_replacement(m: Match, b):
    p = m.plan
    if p["lengths"] is not None:
        seqlens, total_scalar = _mask_lengths(m, b)
    else:
        new, total = new_and_total(m, b)
        seqlens, total_scalar = _sequence_lengths(m, b, total)
    q, k = _rotate(m, b, "q", p["num_heads"]), _rotate(m, b, "k", p["kv_heads"])
    if p["lengths"] is not None:
        bias = guard = None
        window = p["lengths"]["window"]
        mask_attrs = {"local_window_size": window - p["lengths"]["window_extra"]} if window else {}  # (causal: 1)
    else:
        bias, guard = mask_bias(m, b, new, total)
        mask_attrs = {"causal": int(p["sizes"]["S"] == 1)}
    inputs = [q, k, p["xv"],
              m["past_k"] if p["cached"] else None, m["past_v"] if p["cached"] else None, seqlens,
              total_scalar, None, None, None, bias]
    while inputs[-1] is None:
        inputs.pop()
    node_out = b.op("GroupQueryAttention", *inputs, domain=MS, outputs=3, num_heads=p["num_heads"],
                    kv_num_heads=p["kv_heads"], scale=float(np.float32(p["scale"])), **mask_attrs,
                    **({"softcap": float(np.float32(p["softcap"]))} if p["softcap"] else {}))
    y = node_out[0]
    node = y.producer()
    if p["cached"]:
        node.metadata_props[PRESENT_KEY] = json.dumps([m.node("k_cat").outputs[0].name,
                                                       m.node("v_cat").outputs[0].name])
    root = m.root.outputs[0]
    qs = dims_of(p["xq"], m.opsets)
    lead = qs[:2] if qs is not None and len(qs) == 3 else [None, None]
    y.type, y.shape = ir.TensorType(p["dtype"]), ir.Shape(lead + [p["num_heads"] * p["head"]])
    for k, name in ((1, "k_cat"), (2, "v_cat")):
        if p["cached"]:
            cat = m.node(name).outputs[0]
            node_out[k].type, node_out[k].shape = cat.type, cat.shape
    if p["keep_guard"] and guard is not None:
        y = zero_masked_rows(m, b, y, lead, guard)
    shape = infer(root, m.opsets)
    y.type = root.type if root.type is not None else ir.TensorType(p["dtype"])
    if shape is not None and len(shape) == 3:
        y.shape = ir.Shape([d if isinstance(d, int) else k for d, k in zip(shape, lead + [p["num_heads"] * p["head"]])])
    return y


# --------------------------------------------------------------------------------------------
# The present: the op's own output instead of the model's Concat


def _present_condition(m: Match):
    cat = m.root
    name = cat.outputs[0].name
    for user, _ in m["past"].uses():
        if user.op_type == "GroupQueryAttention" and user.domain == MS and PRESENT_KEY in user.metadata_props:
            names = json.loads(user.metadata_props[PRESENT_KEY])
            if name in names:
                return {"value": user.outputs[1 + names.index(name)]}
    return "no GroupQueryAttention writes this cache"


def _present_replacement(m: Match, b):
    return m.plan["value"]


RULES = [
    Rule("group_query_attention", DECODER_ATTENTION, gqa_replacement, condition=gqa_condition, priority=6,
         targets=(ORT_CPU, ORT_CUDA), benefit="group_query_attention", exact=False,
         doc="A decoder's attention (Q and K heads rotated by RotaryEmbedding or not, keys and values from a "
             "Concat(past, new) cache or not, transformers' repeat_kv, any additive mask, Softmax with or "
             "without the NaN guard) becomes com.microsoft GroupQueryAttention with the model's own mask as "
             "attention_bias (causal=0: exact for any padding) and the rotary kept on the 3-D projections."),
    Rule("group_query_attention_present", Op("Concat", "past", "new"), _present_replacement,
         condition=_present_condition, targets=(ORT_CPU, ORT_CUDA), benefit="group_query_attention", exact=False,
         doc="The model's present Concat(past, new) that a GroupQueryAttention already writes becomes that "
             "op's present output (its new keys rotated by the 3-D RotaryEmbedding: equal up to rounding)."),
]
