"""Scaled dot-product attention -> onnxruntime's com.microsoft Attention / MultiHeadAttention.

Targets ``ort-cpu`` and ``ort-cuda`` only (``portable`` emits standard ops). The pattern says
what is matched, from the pieces of rules/_attention_parts.py (shared with later attention fusions):

    out = head_merge(softmax(masked_scores(scaled_dot_product(heads(Q), heads(K)))) @ heads(V))

rooted at the Reshape that merges the heads (``Reshape(Transpose(...))``: the rewrite replaces
these two and absorbs what lies under them). The match is semantic, not one exporter's node
sequence: the views the pattern binds are read by the condition as layouts, the scales as numbers:

- the views: every Reshape and Transpose between a projection ``X`` ([B, S, H]) and the MatMuls,
  and between the second MatMul and the root, is followed as a *layout*: the tensor's dimensions
  as groups of the atoms B, S (query length), T (key length), N (heads), D (head size). A Reshape's
  target is read as numbers, 0s (copy), -1 and dimensions read back through Shape/Gather/Slice/
  Concat arithmetic (``onnxopt.ir.shapes.shape_elements``), so dynamic-shape exports (the legacy
  exporter's Shape->Gather->Concat, the dynamo exporter's 4-D -> 3-D -> transpose -> 4-D key) and
  folded fixed-shape ones are one case. Q must reach the first MatMul as [B,N,S,D], K as [B,N,D,T],
  V the second as [B,N,T,D], and the root's output must be [B,S,N*D]: a view that breaks this is
  refused with its reason.
- the scale: Mul/Div by scalar constants on Q, on K, or on the scores; their product is the fused
  op's ``scale`` (no scale is ``scale=1``, not the ops' default 1/sqrt(D)). A product that rounds
  to 0 in float32 (the attribute's type, where 0 means the default 1/sqrt(D)), to a subnormal or
  to inf is refused (float16 models: in float16 too).
- the mask: an additive mask (Add on the scores, before Softmax). Where it is made from a key-padding
  mask m [B, T] that is a graph input (``key_padding_bias`` in rules/_attention_parts.py:
  ``Where(keep, 0, fill)``, ``(1 - keep) * fill``, transformers 4's sdpa masked_fill) and
  ``read_key_padding`` proves, element by element, that keep[b, n, s, t] = bool(m[b, t]) (and
  t <= s: causal) -- the exporters' index arithmetic (transformers 5's Flatten + Gather at b*T + t,
  the dynamo exporter's GatherND of stacked [b, t], their folded constants at fixed shapes) read by
  the node types' semantics, not matched as one node sequence -- the mask is reduced once for all
  layers (``_MASK_FORM``, by target):
  - ort-cpu: the fused op reads m itself, cast to int32 once (``attention_mask_int32``, every layer
    the same value): Attention's ``mask_index`` [B, T] / MultiHeadAttention's ``key_padding_mask``,
    ``mask_filter_value`` = the exporter's fill (omitted at -10000, the ops' default; the lowest
    float32 for -inf), ``unidirectional=1`` for a causal mask. Measured on this 2-core EPYC (1 thread,
    BERT-base shape S128 H768 N12, one Attention): raw vs attention_bias 9.19 vs 9.17 ms at b1,
    61.7 vs 61.8 ms at b8 (causal 9.36/9.29, 84.1/84.8): even, outputs identical; the raw form
    needs no [B,1,T,T] tensor and one node.
  - ort-cuda: an ``attention_bias`` [B, 1, T, T] built once from m by data operations only
    (Cast/Unsqueeze/CumSum/LessOrEqual/And/Where: no Shape arithmetic, which onnxruntime's CUDA
    provider runs on the CPU), read by every layer: the lead's CUDA probe (H200, onnxruntime-gpu
    1.31.1) found the raw 2-D mask not exact for causal rows with no key (2.1 off, with or without
    mask_filter_value) and 35% slower at b8 fp16, attention_bias exact and as fast or faster.
  The standard opset-23 Attention takes the bias form too. A mask that is not proven key padding of a
  graph input (computed from activations, an index addressing another element, a window, an offset)
  keeps the additive mask as ``attention_bias``, Expanded to [B|1, N|1, S, T] where its shape is not
  proven (S and T read from the graph input carrying their symbol, so every layer builds the same
  Expand and the common-subexpression pass keeps one); the fused node's ``onnxopt.attention_mask``
  metadata (``MASK_KEY``) says which form it took and, for attention_bias, why. The contract: exact
  up to rounding for 0/1 masks (bool(m) exports keep any nonzero key; the kernels keep m > 0, and the
  transformers-4 forms compute 1 - m: masks of other values are outside it). Never the 1-D
  sequence-length mask_index (it assumes right padding).
- Softmax over the last axis, optionally guarded by ``Where(IsNaN(p), 0, p)`` (torch's safe softmax
  in sdpa exports): the guard only changes rows where every key is masked (all -inf scores); there
  the fused op gives NaN (with -inf masks) or a uniform average (with finite ones) instead of 0.
  The guard is kept as one Mul per layer by a factor computed once: from m ([B, 1, 1]: any key of
  the row; [B, T, 1] causal: any key up to the query, a running sum) for a key-padding mask, from
  the additive mask (max over keys > -inf, [B|1, S, 1]) otherwise.

What it becomes:
- ``com.microsoft Attention`` (one packed QKV GEMM) where Q, K and V are projections of one input:
  a Split of ``MatMul(x, W[H_in, 3H]) (+ b)`` (GPT-2's c_attn) or three ``MatMul(x, W_i) (+ b_i)``
  of the same x with constant weights (BERT): the weights are concatenated;
- ``com.microsoft MultiHeadAttention`` (query, key, value [B, S, H]) otherwise;
- the standard ``Attention`` (opset 23, 3-D Q/K/V, ``q_num_heads``/``kv_num_heads``) instead, when the
  model already imports opset 23 or more and the installed onnxruntime runs that op for the target's
  provider and the dtype (tried once on a tiny model, cached: ``standard_attention_runs``).

The output's last dimension is set to N*D where shape inference left it unknown (GPT-2's merge
Reshape reads its target from shapes): the Conv1D flatten after it then folds, and
``gemm_flatten_to_matmul`` turns the attention's c_proj Gemm into a MatMul as it does the others.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from onnxopt.core.pattern import Match, Rule
from onnxopt.ir.shapes import infer, same_symbol, shape_elements
from onnxopt.ir.util import constant_tensor

from onnxopt.rules._attention_parts import (MS, attention_output, dims_of, head_merge, heads, masked_scores,
                                            one_reader, read_key_padding, scaled_dot_product, softmax)
from onnxopt.rules._head_layouts import (Layouts, NoFit, ancestors, apply_view, dtype_through, finite_mask,
                                         follow_heads, located, scale_factor, scale_refusal, show_layout,
                                         zero_masked_rows)
from onnxopt.rules._semantic import earlier, reduce_max, unsqueeze

_FLOATS = {"ort-cpu": (ir.DataType.FLOAT,), "ort-cuda": (ir.DataType.FLOAT, ir.DataType.FLOAT16),
           # (rules/standard_attention.py: portable, the standard op only, its kernel checked there)
           "portable": (ir.DataType.FLOAT, ir.DataType.FLOAT16)}


# --------------------------------------------------------------------------------------------
# The condition


def attention_condition(m: Match):
    target = m.options.get("target")
    floats = _FLOATS.get(target)
    if floats is None:
        return f"not for target {target}"
    guarded = m.node("guard") is not None
    rank_axis = m.node("softmax").attributes.get("axis")
    axis = -1 if rank_axis is None and m.opset("") >= 13 else (rank_axis.value if rank_axis is not None else 1)
    if axis not in (-1, 3):
        return "Softmax is not over the last axis"
    # the scales on the scores, from the Softmax back: after the mask (their product must be 1), before it
    scale, mask = 1.0, m["mask"]
    for node in reversed(m.chain("scores_scales")):
        scale *= scale_factor(node)
    if mask is not None and scale != 1.0:
        return "the mask is added before a scale"
    for node in reversed(m.chain("qk_scales")):
        scale *= scale_factor(node)
    ctx = Layouts(m)
    try:
        lq, lk, lv = (located(m, p) for p in "qkv")
        xq, xk, xv = lq[1], lk[1], lv[1]
        sq, sk, sv = lq[2], lk[2], lv[2]
        # self-attention (the key's projection and the query's read one input): one length atom
        qa = ancestors(xq, m.opsets)
        ka = ancestors(xk, m.opsets)
        t = "S" if set(qa) & set(ka) else "T"
        for atom, anc in (("S", qa), (t, ka), (t, ancestors(xv, m.opsets))):
            for a in anc:
                ctx.sources.setdefault(a, ("B", atom))
        follow_heads(ctx, lq, "B", "S", [("B",), ("N",), ("S",), ("D",)], "Q")
        follow_heads(ctx, lk, "B", t, [("B",), ("N",), ("D",), (t,)], "K")
        follow_heads(ctx, lv, "B", t, [("B",), ("N",), (t,), ("D",)], "V")
        if sv != 1.0:
            raise NoFit("V is scaled")
        layout = ctx.norm([("B",), ("N",), ("S",), ("D",)])
        ctx.layouts[m.node("pv").outputs[0]] = layout
        for node in (*m.chain("merge_views"), m.node("tr"), m.node("out")):
            layout = apply_view(ctx, layout, node)
            ctx.layouts[node.outputs[0]] = layout
        reshape = layout != ctx.norm([("B",), ("S",), ("N", "D")])
        if reshape:  # merged and then flattened further ([B*S, N*D] for a Gemm): the fused op, reshaped
            before = ctx.layouts[m.node("tr").outputs[0]]
            elements = shape_elements(m["shape"])
            if [a for g in layout for a in g] != [a for g in ctx.norm([("B",), ("S",), ("N", "D")]) for a in g] \
                    or elements is None or not _zeros_fit(elements, m.attr("out", "allowzero", 0), before, ctx):
                return f"the attention output is not merged into [B,S,N*D] (it is {show_layout(layout)})"
    except NoFit as exc:
        return str(exc)
    dtype = dtype_through(xq, m.opsets)
    if dtype not in floats or dtype_through(xk, m.opsets) != dtype or dtype_through(xv, m.opsets) != dtype:
        return f"type {dtype or 'unknown'} has no fused kernel on {target}"
    scale *= sq * sk
    if reason := scale_refusal(scale, dtype):
        return reason
    bias, padding, why = None, None, None
    if mask is not None:
        padding, why = _key_padding(m, t, dtype)
        if padding is None:
            bias = _mask_plan(m, ctx, mask, xq, xk, t)
            if isinstance(bias, str):
                return bias
    # torch's NaN guard zeroes the rows where every key is masked with -inf; the fused ops give NaN
    # there (which the next layer spreads to every row, 0 * NaN), so the guard is kept around them
    keep_guard = guarded and mask is not None and not finite_mask(mask)
    return {"xq": xq, "xk": xk, "xv": xv, "dtype": dtype, "scale": scale, "keep_guard": keep_guard,
            "mask": mask, "expand": bias, "padding": padding, "mask_form": why,
            "num_heads": ctx.size("N"), "head": ctx.size("D"), "guarded": guarded, "reshape": reshape}


def _zeros_fit(elements, allowzero, before, ctx) -> bool:
    """A 0 in the root's target copies a dimension of its input; the fused op's output [B, S, N*D]
    must have the same one there."""
    if allowzero:
        return True
    mine = ctx.norm([("B",), ("S",), ("N", "D")])
    return all(not (isinstance(e, int) and e == 0) or (i < 2 and before[i] == mine[i])
               for i, e in enumerate(elements))


def _key_padding(m: Match, t: str, dtype: ir.DataType) -> tuple[dict | None, str | None]:
    """(facts, None) where the additive mask is a key-padding mask (and a causal factor) of a 2-D
    graph input, with the form the fused op takes it in (``form``, see ``_MASK_FORM``), else (None,
    the reason it keeps the attention_bias path, Expanded per layer where its shape is unproven)."""
    if m["keep"] is None:
        return None, "the mask is not Where(keep, 0, fill) nor (1 - keep) * fill"
    found = read_key_padding(m["keep"], m.opsets)
    if isinstance(found, str):
        return None, found
    fill = float(m.const("fill").reshape(-1)[0])
    if math.isnan(fill) or fill >= 0:
        return None, f"the mask's fill value {fill} is not negative"
    standard = m.opset("") >= 23 and standard_attention_runs(m.options.get("target"), dtype)
    form = "bias" if standard else _MASK_FORM.get(m.options.get("target"), "bias")
    if found.causal and t != "S":
        return None, "the mask is causal over keys that are not the queries"
    if form == "bias" and t != "S":
        return None, "the keys are not the queries (the bias built from the mask is [B, 1, T, T])"
    return {"input": found.mask, "causal": found.causal, "fill": fill, "form": form,
            "filter": _mask_filter(fill, dtype, m.options.get("target"))}, None


# How a key-padding mask reaches the fused op, by target (measured, see the module docstring):
# - "raw": the 2-D mask cast to int32 (Attention's mask_index, MultiHeadAttention's key_padding_mask),
#   mask_filter_value the exporter's fill, unidirectional=1 for a causal one;
# - "bias": the additive attention_bias [B, 1, T, T] built once from the 2-D mask for every layer,
#   by data operations only (no Shape arithmetic, which onnxruntime's CUDA provider runs on the CPU).
# CUDA (H200, onnxruntime-gpu 1.31.1, the lead's probe /work/main/scripts/results/targets/
# cuda-probe-attention.json): the raw mask gives rows whose every key is masked by a causal mask
# another answer than the original (2.1 off, with or without mask_filter_value) and is 35% slower
# at b8 fp16; attention_bias is exact and the fastest or even everywhere.
_MASK_FORM = {"ort-cuda": "bias", "ort-cpu": "raw"}


def _mask_filter(fill: float, dtype: ir.DataType, target: str | None) -> float:
    """The fused op's ``mask_filter_value`` for the exporter's fill: the fill itself where float32
    holds it, the lowest float32 for -inf (the kernels add it to the masked scores: -inf would make
    the rows whose every key is masked NaN, where the original's NaN guard gives 0; a finite value
    that large absorbs every score, so such a row is the uniform average the original's finite
    masks give, and the guard's factor zeroes it)."""
    low = float(np.finfo(np.float32).min)
    return low if not math.isfinite(fill) or fill < low else float(np.float32(fill))


def _mask_plan(m: Match, ctx: Layouts, mask: ir.Value, xq: ir.Value, xk: ir.Value, t: str):
    """False when the mask is already [B|1, N|1, S, T]; True when it must be Expanded to S, T;
    a reason string when it cannot be used."""
    dims = dims_of(mask, m.opsets)
    if dtype_through(mask, m.opsets) != dtype_through(xq, m.opsets):
        return "the mask's type is not the scores'"
    if dims is None:
        return "the mask's rank is unknown"
    if len(dims) != 4:
        return f"the mask has rank {len(dims)}, not 4"

    def same(k, atom, x):
        d, size = dims[k], ctx.size(atom)
        if isinstance(d, int):
            return size is not None and d == size
        return d is not None and same_symbol(mask, k, x, 1)

    proven = same(2, "S", xq) and same(3, t, xk)
    for d, atom in ((dims[0], "B"), (dims[1], "N")):
        if isinstance(d, int) and d != 1 and d != ctx.size(atom):
            return "the mask does not broadcast to the scores"
    if not proven and m.opset("") < 15:
        return "the mask's shape is not proven [.., S, T] (opset < 15: no Shape start/end to expand it)"
    return not proven


# --------------------------------------------------------------------------------------------
# The replacement


def _projection(x: ir.Value):
    """(input, weight, bias or None) when x = MatMul(input, W) (+ b), W and b constant, read once."""
    node = x.producer()
    bias = None
    if node is not None and node.op_type == "Add" and node.domain in ("", "ai.onnx"):
        a, c = node.inputs
        for mm, b in ((a, c), (c, a)):
            if constant_tensor(b) is not None and mm.producer() is not None and mm.producer().op_type == "MatMul":
                bias, x = constant_tensor(b).numpy(), mm
                break
        else:
            return None
        if not one_reader(x):
            return None
        node = x.producer()
    if node is None or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    w = constant_tensor(node.inputs[1])
    if w is None or w.numpy().ndim != 2:
        return None
    w = w.numpy()
    if bias is not None and bias.shape != (w.shape[1],):
        return None
    return node.inputs[0], w, bias


def _split_sizes(split: ir.Node) -> list[int] | None:
    """A Split's sizes (input or attribute), None when it splits equally; its axis must be the last (2)."""
    axis = split.attributes.get("axis")
    if (0 if axis is None else axis.value) not in (-1, 2):
        return [-1]  # (no fit)
    sizes = constant_tensor(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
    if sizes is not None:
        return sizes.numpy().reshape(-1).tolist()
    return list(split.attributes["split"].value) if "split" in split.attributes else None


def _packed(plan, opsets) -> tuple[ir.Value, np.ndarray, np.ndarray | None] | None:
    """(input, packed W [H_in, 3H], packed bias) when Q, K and V are projections of one input."""
    xq, xk, xv = plan["xq"], plan["xk"], plan["xv"]
    if len({xq, xk, xv}) != 3:
        return None
    # GPT-2: Split(MatMul(x, W) + b) into three equal parts on the last axis (Q, K, V: outputs 0, 1, 2;
    # the dynamo export may take them from two Splits of the one packed value)
    splits = [v.producer() for v in (xq, xk, xv)]
    if all(sp is not None and sp.op_type == "Split" and sp.domain in ("", "ai.onnx") for sp in splits):
        packed = splits[0].inputs[0]
        dims = xq.shape if xq.shape is not None else dims_of(xq, opsets)
        h = dims[-1] if dims else None
        ok = isinstance(h, int) and all(one_reader(v) for v in (xq, xk, xv))
        for k, (sp, v) in enumerate(zip(splits, (xq, xk, xv))):
            ok = ok and sp.inputs[0] is packed and len(sp.outputs) == 3 and sp.outputs[k] is v \
                and _split_sizes(sp) in (None, [h] * 3)
        # every reader of the packed value is one of these Splits, and only Q, K and V are read from them
        readers = {n for n, _ in packed.uses()}
        ok = ok and not packed.is_graph_output() and readers <= set(splits) and all(
            not o.uses() or o in (xq, xk, xv) for sp in readers for o in sp.outputs)
        if ok:
            proj = _projection(packed)
            if proj is not None and proj[1].shape[1] == 3 * h:
                return proj
        return None
    # BERT: three MatMuls of one input
    projs = [_projection(v) if one_reader(v) else None for v in (xq, xk, xv)]
    if any(p is None for p in projs) or len({p[0] for p in projs}) != 1:
        return None
    ws = [p[1] for p in projs]
    if len({w.shape for w in ws}) != 1 or len({w.dtype for w in ws}) != 1:
        return None
    w = np.concatenate(ws, axis=1)
    if all(p[2] is None for p in projs):
        return projs[0][0], w, None
    bias = np.concatenate([p[2] if p[2] is not None else np.zeros(ws[0].shape[1], ws[0].dtype) for p in projs])
    return projs[0][0], w, bias.astype(w.dtype)


def attention_replacement(m: Match, b):
    plan = m.plan
    n, scale = int(plan["num_heads"]), float(np.float32(plan["scale"]))
    dtype = plan["dtype"]
    name = m.node("out").name or "attention"
    if m.opset("") >= 23 and standard_attention_runs(m.options.get("target"), dtype):
        inputs = [plan["xq"], plan["xk"], plan["xv"], _bias(m, b, plan["xq"], plan["xk"])]
        while inputs[-1] is None:
            inputs.pop()
        return _out(m, b, _noted(m, b.op("Attention", *inputs, q_num_heads=n, kv_num_heads=n, scale=scale)))
    packed = _packed(plan, m.opsets)
    raw, attrs = None, {}
    if plan["padding"] is not None and plan["padding"]["form"] == "raw":
        raw, attrs = _raw_mask(m, b), _mask_attrs(plan["padding"])
    if packed is not None:
        x, w, bias = packed
        dims = dims_of(x, m.opsets)
        if dims is not None and len(dims) == 3:
            wv = b.const(w, name=f"{name}_qkv_weight")
            bv = b.const(bias if bias is not None else np.zeros(w.shape[1], w.dtype), name=f"{name}_qkv_bias")
            # (the mask's lengths read from x: reading Q or K would keep their projection alive)
            inputs = [x, wv, bv, raw, None, None if raw is not None else _bias(m, b, x, x)]
            while inputs[-1] is None:
                inputs.pop()
            return _out(m, b, _noted(m, b.op("Attention", *inputs, domain=MS, num_heads=n, scale=scale, **attrs)))
    inputs = [plan["xq"], plan["xk"], plan["xv"], None, raw,
              None if raw is not None else _bias(m, b, plan["xq"], plan["xk"])]
    while inputs[-1] is None:
        inputs.pop()
    return _out(m, b, _noted(m, b.op("MultiHeadAttention", *inputs, domain=MS, num_heads=n, scale=scale, **attrs)))


MASK_KEY = "onnxopt.attention_mask"  # on the fused node: the form its mask took, and why where not from the 2-D mask


def _noted(m: Match, y: ir.Value) -> ir.Value:
    """y, its node noting how the mask reached it (``MASK_KEY``): "none", "mask_index"/
    "key_padding_mask" (the 2-D mask, raw), "attention_bias from the 2-D mask" (built once), or
    "attention_bias: <why the mask was not read as key padding>"."""
    plan, node = m.plan, y.producer()
    if plan["mask"] is None:
        note = "none"
    elif plan["padding"] is None:
        note = f"attention_bias: {plan['mask_form']}"
    elif plan["padding"]["form"] == "raw":
        note = "mask_index" if node.op_type == "Attention" else "key_padding_mask"
    else:
        note = "attention_bias from the 2-D mask"
    node.metadata_props[MASK_KEY] = note
    return y


def _mask_attrs(padding: dict) -> dict:
    attrs = {} if padding["filter"] == _DEFAULT_FILTER else {"mask_filter_value": padding["filter"]}
    if padding["causal"]:
        attrs["unidirectional"] = 1
    return attrs


_DEFAULT_FILTER = -10000.0  # the fused ops' mask_filter_value when the attribute is absent


def _raw_mask(m: Match, b) -> ir.Value:
    """The 2-D key-padding mask as the fused ops take it: the graph input cast to int32 once for
    every layer (a later layer reads the Cast an earlier one made; the common-subexpression pass
    merges any left)."""
    src = m.plan["padding"]["input"]
    if isinstance(src.type, ir.TensorType) and src.type.dtype == ir.DataType.INT32:
        return src
    name = f"{src.name}_int32"
    found = earlier(m, name)
    if found is not None:
        return found
    cast = b.name(b.op("Cast", src, to=int(ir.DataType.INT32)), name)
    cast.type, cast.shape = ir.TensorType(ir.DataType.INT32), src.shape
    return cast


def _rows_seen(m: Match, b) -> ir.Value:
    """[B, S or 1, 1] in the scores' type: 1 where a query sees at least one key, 0 where every key
    is masked: max over t of m[b, t] (key padding), its running sum over t up to s (causal, S = T),
    computed once from the 2-D mask for every layer."""
    padding, dtype = m.plan["padding"], m.plan["dtype"]
    src = padding["input"]
    name = f"{src.name}_rows_seen" + ("_causal" if padding["causal"] else "")
    found = earlier(m, name)
    if found is not None:
        return found
    keys = b.op("Cast", src, to=int(dtype))
    if padding["causal"]:
        seen = b.op("CumSum", keys, b.const(np.array(1, np.int64), name="attention_keys_axis"))
    else:
        seen = reduce_max(m, b, keys, [1], name="attention_keys_axis")
    any_key = b.op("Cast", b.op("Greater", seen, b.const(np.array(0, dtype.numpy()), name="attention_zero")),
                   to=int(dtype))
    rows = b.name(unsqueeze(m, b, any_key, [2], name="attention_rows_axis"), name)
    lead = list(src.shape) if src.shape is not None else [None, None]
    for v, dims in ((keys, lead), (seen, lead if padding["causal"] else lead[:1] + [1]), (any_key, None),
                    (rows, (lead if padding["causal"] else lead[:1] + [1]) + [1])):
        v.type = ir.TensorType(dtype)
        if dims is not None:
            v.shape = ir.Shape(dims)
    return rows


def _bias(m: Match, b, s_of: ir.Value, t_of: ir.Value) -> ir.Value | None:
    """The attention_bias: the additive mask, Expanded to [B|1, N|1, S, T] where its shape is not
    proven (its own first two dimensions, S and T read as dimension 1 of ``s_of`` and ``t_of``)."""
    mask = m.plan["mask"]
    if mask is not None and m.plan["padding"] is not None:
        return _padding_bias(m, b)
    if mask is not None and m.plan["keep_guard"]:  # -inf -> the lowest finite value: no NaN rows
        lowest = np.array(np.finfo(m.plan["dtype"].numpy()).min, m.plan["dtype"].numpy())
        mask = b.op("Max", mask, b.const(lowest, name="attention_mask_floor"))
    if mask is None or not m.plan["expand"]:
        return mask
    lead = b.op("Shape", mask, start=0, end=2)
    s_src, t_src = _length_source(m, s_of), _length_source(m, t_of)
    s = b.op("Shape", s_src[0], start=s_src[1], end=s_src[1] + 1)
    t = s if t_src == s_src else b.op("Shape", t_src[0], start=t_src[1], end=t_src[1] + 1)
    return b.op("Expand", mask, b.op("Concat", lead, s, t, axis=0))


def _padding_bias(m: Match, b) -> ir.Value:
    """The additive attention_bias [B, 1, T, T] of a key-padding mask m [B, T] (self-attention),
    built once for every layer from m by data operations only (so every node runs where the data
    is; no Shape, Concat or Expand):

        keep[b, 0, s, t] = bool(m[b, t]) and (t <= s, causal) and true (m >= m: the [B, 1, T, 1] frame)
        bias = Where(keep, 0, fill)

    where the positions s, t are running sums of ones over the keys (equal shifts of 0..T-1) and the
    fill is the exporter's (-inf made the lowest finite value where the NaN guard is kept: those rows
    are then finite and the guard's factor zeroes them)."""
    padding, dtype = m.plan["padding"], m.plan["dtype"]
    src = padding["input"]
    name = f"{src.name}_attention_bias" + ("_causal" if padding["causal"] else "")
    found = earlier(m, name)
    if found is not None:
        return found
    npd = dtype.numpy()
    fill = padding["fill"]
    if m.plan["keep_guard"]:
        fill = max(fill, float(np.finfo(npd).min))
    lead = list(src.shape) if src.shape is not None else [None, None]

    def unsqueezed(v, axes):
        return unsqueeze(m, b, v, axes, name="attention_mask_axes")

    is_bool = isinstance(src.type, ir.TensorType) and src.type.dtype == ir.DataType.BOOL
    kept = src if is_bool else b.op("Cast", src, to=int(ir.DataType.BOOL))
    every = b.op("Or", src, b.op("Not", src)) if is_bool else b.op("GreaterOrEqual", src, src)  # all true
    keys = unsqueezed(kept, [1, 2])  # [B, 1, 1, T]
    if padding["causal"]:
        position = b.op("CumSum", b.op("Cast", every, to=int(ir.DataType.INT32)),
                        b.const(np.array(1, np.int64), name="attention_keys_axis"))  # [B, T]: 1..T
        frame = b.op("LessOrEqual", unsqueezed(position, [1, 2]), unsqueezed(position, [1, 3]))  # t <= s
    else:
        frame = unsqueezed(every, [1, 3])  # [B, 1, T, 1], all true
    keep = b.op("And", frame, keys)
    bias = b.name(b.op("Where", keep, b.const(np.array(0, npd), name="attention_mask_zero"),
                       b.const(np.array(fill, npd), name="attention_mask_fill")), name)
    bias.type, bias.shape = ir.TensorType(dtype), ir.Shape([lead[0], 1, lead[1], lead[1]])
    return bias


def _length_source(m: Match, x: ir.Value) -> tuple[ir.Value, int]:
    """Where to read dimension 1 of x (a length): a graph input's dimension carrying the same named
    symbol where there is one, so every layer reads the same value and builds the same Expand (the
    common-subexpression pass keeps one for all of them), else x's own."""
    dims_of(x, m.opsets)
    for g in m.graph.inputs:
        for j in range(len(g.shape) if g.shape is not None else 0):
            if same_symbol(x, 1, g, j):
                return g, j
    return x, 1


# (portable: the standard op as the installed onnxruntime's CPU provider runs it, rules/standard_attention.py)
_PROVIDERS = {"ort-cpu": "CPUExecutionProvider", "ort-cuda": "CUDAExecutionProvider",
              "portable": "CPUExecutionProvider"}
_STANDARD: dict[tuple, bool] = {}


def standard_attention_runs(target: str | None, dtype: ir.DataType) -> bool:
    """The installed onnxruntime runs the standard (opset 23) Attention for ``target``'s provider and
    ``dtype``: tried once on a tiny model (3-D Q/K/V, an additive [B,1,S,T] mask), the answer cached."""
    key = (target, dtype)
    if key not in _STANDARD:
        _STANDARD[key] = _try_standard(_PROVIDERS.get(target), dtype)
    return _STANDARD[key]


def _try_standard(provider: str | None, dtype: ir.DataType) -> bool:
    try:
        import onnxruntime as ort
        from onnx import helper
    except ImportError:
        return False
    if provider is None or provider not in ort.get_available_providers():
        return False
    elem, npd = int(dtype), dtype.numpy()
    b, s, n, d = 2, 3, 2, 4
    graph = helper.make_graph(
        [helper.make_node("Attention", ["q", "k", "v", "m"], ["y"], q_num_heads=n, kv_num_heads=n, scale=0.5)], "probe",
        [helper.make_tensor_value_info(x, elem, [b, s, n * d]) for x in "qkv"]
        + [helper.make_tensor_value_info("m", elem, [b, 1, s, s])], [helper.make_tensor_value_info("y", elem, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=[provider])
        rng = np.random.default_rng(0)
        feeds = {x: rng.standard_normal((b, s, n * d)).astype(npd) for x in "qkv"}
        feeds["m"] = np.zeros((b, 1, s, s), npd)
        y = sess.run(None, feeds)[0]
    except Exception:  # noqa: BLE001 - no kernel, or one that fails: the contrib ops are used
        return False
    return y.shape == (b, s, n * d) and bool(np.all(np.isfinite(y)))


def _out(m: Match, b, y: ir.Value) -> ir.Value:
    """The fused op's output (reshaped as the root was, where it flattened further), with the root's
    type and shape: onnx's shape inference knows no contrib op, and the layers after this one need
    their shapes to fuse."""
    root = m.root.outputs[0]
    shape = infer(root, m.opsets)
    xq = m.plan["xq"]
    if m.plan["keep_guard"]:
        qs = dims_of(xq, m.opsets)
        lead = qs[:2] if qs is not None and len(qs) == 3 else [None, None]
        n, d = int(m.plan["num_heads"]), int(m.plan["head"])
        y.type = ir.TensorType(m.plan["dtype"])
        y.shape = ir.Shape(lead + [n * d])
        if m.plan["padding"] is not None:  # the rows no key reaches, known from the 2-D mask alone
            y = b.op("Mul", y, _rows_seen(m, b))
            y.type, y.shape = ir.TensorType(m.plan["dtype"]), ir.Shape(lead + [n * d])
        else:
            y = zero_masked_rows(m, b, y, lead)
    if m.plan["reshape"]:
        y.type = ir.TensorType(m.plan["dtype"])
        qs = infer(xq, m.opsets)
        if qs is not None and len(qs) == 3:
            y.shape = ir.Shape([qs[0], qs[1], m.plan["num_heads"] * m.plan["head"]])
        y = b.op("Reshape", y, m["shape"], attrs=list(m.node("out").attributes.values()))
    y.type = root.type if root.type is not None else ir.TensorType(m.plan["dtype"])
    if shape is not None:
        dims = list(shape)
        if not m.plan["reshape"] and len(dims) == 3:
            # [B, S, N*D]: what the fused op is proven to give fills what inference left unknown (GPT-2's
            # merge Reshape reads its target from shapes; a Gemm's flatten reads the last one back)
            qs = dims_of(xq, m.opsets)
            known = (qs[:2] if qs is not None and len(qs) == 3 else [None, None]) + [
                int(m.plan["num_heads"]) * int(m.plan["head"])]
            dims = [d if isinstance(d, int) or k is None else k for d, k in zip(dims, known)]
        y.shape = ir.Shape(dims)
    return y


# out = merge_heads(Softmax(scale * Q @ K^T + mask) @ V): the pieces in rules/_attention_parts.py
ENCODER_ATTENTION = head_merge(attention_output(
    softmax(masked_scores(scaled_dot_product(heads("q", "Q"), heads("k", "K")))), heads("v", "V")))

RULES = [
    Rule("attention_fusion",
         ENCODER_ATTENTION,
         attention_replacement, condition=attention_condition, priority=5,
         targets=("ort-cpu", "ort-cuda"), benefit="attention", exact=False,
         doc="Scaled dot-product attention (Q/K/V heads through any Reshape/Transpose views, scalar scales, an "
             "additive padding/causal mask, Softmax with or without the NaN guard) becomes com.microsoft Attention "
             "(packed QKV weights, where Q, K and V project one input) or MultiHeadAttention; a key-padding "
             "mask of a 2-D graph input is reduced once for all layers (mask_index on ort-cpu, one "
             "attention_bias built by data ops on ort-cuda), any other mask is the fused op's attention_bias."),
]
