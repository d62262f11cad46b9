"""A decoder's attention as the standard ``Attention`` (opset 23), for target ``portable``.

Matched by rules/group_query_attention.py's pattern and condition (``decoder_attention``, ``gqa_condition``)
with the rotary read as the standard ``RotaryEmbedding`` (rules/standard_rotary.py's output, which runs
first): Q/K heads of projections (rotated or not), keys and values from the model's ``Concat(past, new)``
cache or the new ones alone, transformers' ``repeat_kv`` or torch's grouped sdpa form, the scales, an
additive mask, soft-capping, Softmax with or without the NaN guard, the heads merged into [B, S, N*D].
The layouts the condition proves are the op's 3-D form, so it becomes:

    Attention(Q, K, V, attn_mask, past_key, past_value) -> Y [B, S, N*D], present_key, present_value

- Q, K, V: the 3-D projections [B, S, heads*D], rotated where the model rotated their heads by the same
  RotaryEmbedding on the 3-D form (``num_heads``; the same caches, so the same positions);
- ``q_num_heads`` = N and ``kv_num_heads`` = G (grouped-query attention: the op repeats the key heads as
  repeat_kv did), ``scale`` the product of the model's scales, ``softcap`` Gemma 2's cap;
- ``attn_mask``: the additive mask exactly as the model computes it (causal, padding, sliding window),
  Expanded to S and T where its shape is not proven, so every padding layout attends as the original;
  ``is_causal`` stays 0;
- the cache: ``past_key``/``past_value`` are the model's past inputs; the op's ``present_key``/
  ``present_value`` (past + new, [B, G, T, D]) replace the model's Concats (its present outputs). Where a
  node before the attention reads a Concat (Gemma 2's legacy export reads the keys' length from it), the
  op's output would come after its reader: the Concats stay and the op's present is not read (onnxruntime's
  kernel refuses a past without a present).

Torch's NaN guard with a -inf mask is kept as rules/attention.py keeps it (the mask floored to the lowest
float, the rows no key reaches zeroed by one Mul). Written only where the model imports opset >= 23 and
the installed onnxruntime has the kernel (rules/_standard_parts.py), else refused with the reason; the
condition's other refusals are group_query_attention's (including its one for a cached step of several new
tokens at batch > 1, which comes from onnxruntime's GroupQueryAttention and is kept here for one matcher).
An encoder's attention (no cache, rotary nor grouped heads) is ``standard_encoder_attention``'s: rules/attention.py's
pattern, condition and replacement (its standard-op path, which it takes at opset >= 23 where onnxruntime runs
the op: Q/K/V [B, S, N*D], ``q_num_heads`` = ``kv_num_heads`` = N, the mask as ``attn_mask``, a key-padding mask
of a 2-D graph input reduced once to one [B, 1, T, T] bias for every layer).

Not exact (``exact=False``): the kernel's softmax and sums run in its own order.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.core.pattern import Match, Rule
from onnxopt.ir.shapes import infer
from onnxopt.targets import PORTABLE

from onnxopt.rules._attention_parts import dims_of
from onnxopt.rules._head_layouts import zero_masked_rows
from onnxopt.rules._standard_parts import standard_refusal
from onnxopt.rules.attention import (ENCODER_ATTENTION, attention_condition, attention_replacement,
                                     standard_attention_runs)
from onnxopt.rules.group_query_attention import mask_bias, new_and_total, decoder_attention, gqa_condition

STANDARD_DECODER_ATTENTION = decoder_attention(rotary_domain="")


def _condition(m: Match):
    if any(m.node(f"{p}_{part}") is not None for p in ("q", "k") for part in ("square", "norm_op")):
        return "Q or K is normalized per head (QK-norm), which the standard path does not rebuild yet"
    plan = gqa_condition(m)
    if isinstance(plan, str):
        return plan
    if reason := standard_refusal("Attention", m.opset(""), plan["dtype"]):
        return reason
    outputs = [m.root.outputs[0]]
    plan["present"] = False
    if plan["cached"]:
        before = set()
        for node in m.graph:
            if node is m.root:
                break
            before.add(node)
        matched = set(m.nodes) | set(m.absorbed)
        presents = [m.node(name).outputs[0] for name in ("k_cat", "v_cat")]
        # the op's present replaces the model's Concat, unless a node before the attention reads it (Gemma 2's
        # legacy export reads the keys' length from it): then the Concat stays for it and the op writes no present
        if not any(({u.node for u in v.uses()} - matched) & before for v in presents):
            outputs += presents
            plan["present"] = True
    m.outputs = outputs
    return plan


def _rotate(m: Match, b, p: str, heads: int) -> ir.Value:
    """``x<p>`` [B, S, heads*D], rotated as the model's RotaryEmbedding rotated its heads (the same caches
    and attributes, the 3-D form with ``num_heads``)."""
    x, rot = m.plan[f"x{p}"], m.node(f"{p}_rot")
    if rot is None:
        return x
    attrs = {k: a.value for k, a in rot.attributes.items()}
    attrs["num_heads"] = heads
    y = b.op("RotaryEmbedding", x, *rot.inputs[1:], **attrs)
    y.type, y.shape = x.type, x.shape
    return y


def _replace(m: Match, b):
    p = m.plan
    q, k = _rotate(m, b, "q", p["num_heads"]), _rotate(m, b, "k", p["kv_heads"])
    new, total = new_and_total(m, b) if p["expand"] else (None, None)
    bias, guard = mask_bias(m, b, new, total)
    inputs = [q, k, p["xv"], bias, m["past_k"] if p["cached"] else None, m["past_v"] if p["cached"] else None]
    while inputs[-1] is None:
        inputs.pop()
    attrs = {"q_num_heads": p["num_heads"], "kv_num_heads": p["kv_heads"], "scale": float(np.float32(p["scale"]))}
    if p["softcap"]:
        attrs["softcap"] = float(np.float32(p["softcap"]))
    outs = b.op("Attention", *inputs, outputs=3 if p["cached"] else 1, **attrs)  # (onnxruntime: a past needs a present)
    outs = outs if isinstance(outs, tuple) else (outs,)
    y = outs[0]
    qs = dims_of(p["xq"], m.opsets)
    lead = qs[:2] if qs is not None and len(qs) == 3 else [None, None]
    y.type, y.shape = ir.TensorType(p["dtype"]), ir.Shape(lead + [p["num_heads"] * p["head"]])
    if p["cached"]:
        for out, name in zip(outs[1:], ("k_cat", "v_cat")):
            cat = m.node(name).outputs[0]
            out.type, out.shape = cat.type, cat.shape
    if p["keep_guard"]:
        y = zero_masked_rows(m, b, y, lead, guard)
    root = m.root.outputs[0]
    shape = infer(root, m.opsets)
    y.type = root.type if root.type is not None else ir.TensorType(p["dtype"])
    if shape is not None and len(shape) == 3:
        y.shape = ir.Shape([d if isinstance(d, int) else k for d, k in zip(shape, lead + [p["num_heads"] * p["head"]])])
    return [y, *outs[1:]] if p["present"] else y


def _encoder_condition(m: Match):
    plan = attention_condition(m)
    if isinstance(plan, str):
        return plan
    if reason := standard_refusal("Attention", m.opset(""), plan["dtype"]):
        return reason
    if not standard_attention_runs(PORTABLE, plan["dtype"]):  # (attention_replacement's own test: the standard op)
        return f"the installed onnxruntime does not run the standard Attention for {plan['dtype'].name.lower()}"
    return plan


RULES = [
    Rule("standard_attention", STANDARD_DECODER_ATTENTION, _replace, condition=_condition, priority=6,
         targets=(PORTABLE,), benefit="group_query_attention", exact=False,
         doc="A decoder's attention (Q and K heads rotated by the standard RotaryEmbedding or not, keys and values "
             "from a Concat(past, new) cache or not, repeat_kv, any additive mask, soft-capping, Softmax with or "
             "without the NaN guard) becomes the standard Attention (portable; opset >= 23 and onnxruntime's "
             "kernel): q_num_heads/kv_num_heads, the model's mask as attn_mask, past_key/past_value in and "
             "present_key/present_value replacing the model's cache Concats."),
    Rule("standard_encoder_attention", ENCODER_ATTENTION, attention_replacement, condition=_encoder_condition,
         priority=5, targets=(PORTABLE,), benefit="attention", exact=False,
         doc="An encoder's scaled dot-product attention (attention_fusion's forms: BERT, GPT-2, cross-attention) "
             "becomes the standard Attention (portable; opset >= 23 and onnxruntime's kernel) on the 3-D "
             "projections, the mask as attn_mask (a key-padding mask reduced once for all layers)."),
]
