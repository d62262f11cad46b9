"""The embedding fusion for onnxruntime (targets ort-cpu and ort-cuda only; ``portable`` never sees it).

    LayerNorm(word[input_ids] + position[0..S-1] (+ segment[segment_ids]))
        -> com.microsoft EmbedLayerNormalization

Matched by what the nodes compute, from the pieces of rules/_embedding_parts.py: two or three
embedding Gathers of constant tables summed by Adds in any association and operand order, one of
them a position embedding whose ids are provably 0..S-1 (a Slice of a constant buffer equal to
arange, or ``Range(0, S, 1)`` under an optional Unsqueeze/Expand; S read back through the shape
arithmetic as the ids' own sequence length) or a graph input (passed as the op's input 8), or that
Gather folded at fixed shapes into a constant [1, S, H] (passed as an S-row position table), then
normalized over the last axis (BERT's and MiniLM's embedding LayerNorm; GPT-2's first ln_1, whose
input the residual reads too: output 2):

- ``embed_layer_normalization``: the sum under a LayerNormalization (priority 5: before
  ``skip_layer_normalization``, which would otherwise take two of the embeddings);
- ``embed_layer_normalization_skip``: the sum already made a SkipLayerNormalization of two of its
  parts (no bias input), where that rule got there first (the driver visits the embedding's nodes
  again after it fires).

The fused node: ``EmbedLayerNormalization(Cast(input_ids, int32), Cast(segment_ids, int32) or "",
word, position, segment or "", gamma, beta[, "", Cast(position_ids, int32)])``, ``epsilon`` the
normalization's. Output 0 takes the normalization's place; output 1 (mask_index) is left unread
(the mask input is empty); output 2 (embedding_sum) takes the sum's place where the sum is read
elsewhere too. The int32 Casts of graph inputs are shared: an existing ``Cast(x, to=int32)``
before the normalization is reused, a new one is named ``<x>_int32`` (so a later rule finds it).
Which of two token embeddings is the word and which the segment is immaterial to the kernel (it
sums both alike); the one with the larger table is passed as the word. So is which of the Gathers
by graph inputs is the position one where the position ids are an input: the largest table is
the word's, the next largest the position's (ids computed otherwise are then refused).

Refused, with the reason: a table that is not a constant (the pattern) or not 2-D; widths that
differ from each other or from gamma; a position table (or buffer) shorter than a known S; ids not
int32/int64, input ids not 2-D, segment ids not of the input ids' shape; position ids not provably
0..S-1 (an offset, as RoBERTa's padding_idx + 1; the pattern); a sum without position embedding
(the pattern); an element type without a kernel on the target (CPU: float only; CUDA: float and
float16, onnxruntime's OperatorKernels.md); the normalization's statistics outputs read.

Not fused: the legacy GPT-2 export, whose Range reads S from Shape of the word embedding's output (the
word Gather has a second reader; a shape rule reading that Shape from the ids would let it fuse).

Semantics: not exact (``exact=False``): the kernel sums and normalizes in its own order (fp32
within 1e-5 on the zoo BERT/MiniLM; the CUDA kernel within 1e-6 of numpy in fp32, 4e-3 in fp16 on
values ~4, every input form, onnxruntime-gpu 1.31.1 on an H100). Ids outside the table differ:
Gather reads a negative id from the table's end and fails on one >= its rows; the CPU kernel fails
on both ("input index out of range", onnxruntime 1.32), the CUDA kernel fails on neither and gives
another row (1.31.1) -- as with the peer's fusion, valid token ids (0 <= id < rows) are assumed.
int64 ids are cast to int32 (as onnxruntime's transformers optimizer does).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from onnxopt.core.pattern import Around, Const, Match, Op, Opt, Or, Rule
from onnxopt.ir.shapes import is_dim_of, same_dim, scalar_element, shape_elements
from onnxopt.ir.util import constant_tensor
from onnxopt.targets import ORT_CPU, ORT_CUDA

from onnxopt.rules._embedding_parts import embedding_sum, is_graph_input as _graph_input
from onnxopt.rules._semantic import dtype_of, kernel, scalar, typed

ORT = (ORT_CPU, ORT_CUDA)
INTS = (ir.DataType.INT32, ir.DataType.INT64)
CUDA_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)  # onnxruntime's OperatorKernels.md (CUDA provider)
DEFAULT_EPSILON = {"LayerNormalization": 1e-5, "SkipLayerNormalization": 1e-12}

EMBED_LN = Op("LayerNormalization",
              Or(*(Op("Add", a, b, commutative=True, name="sum_add", shared=True) for a, b in embedding_sum())),
              Const("gamma"), Opt(Const("beta")), name="norm")
EMBED_SKIP_LN = Around("norm", Or(*(
    Op("SkipLayerNormalization", x, y, Const("gamma"), Opt(Const("beta")), domain="com.microsoft", name="norm")
    for a, b in embedding_sum() for x, y in ((a, b), (b, a)))))


class _Table(NamedTuple):
    """A constant table's shape and numpy type, read without copying its data (a vocabulary is ~100 MB)."""
    shape: tuple
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _table(value: ir.Value) -> _Table:
    tensor = constant_tensor(value)
    return _Table(tuple(tensor.shape), np.dtype(tensor.dtype.numpy()))


def _dim(value: ir.Value, k: int):
    shape = value.shape
    return None if shape is None or not -len(shape) <= k < len(shape) else shape[k]


def _is_sequence(element, ids: ir.Value) -> bool:
    """A shape element (a number or a DimRef) is the ids' sequence length (dimension 1)."""
    if element is None:
        return False
    if isinstance(element, int):
        return isinstance(_dim(ids, 1), int) and _dim(ids, 1) == element
    return is_dim_of(element, ids, 1)


def _one_element(value: ir.Value):
    """A scalar or 1-element shape value read back (a number or a DimRef), else None."""
    element = scalar_element(value)
    if element is not None:
        return element
    elements = shape_elements(value)
    return elements[0] if elements is not None and len(elements) == 1 else None


def _ints(value: ir.Value | None) -> list[int] | None:
    tensor = constant_tensor(value) if value is not None else None
    if tensor is None:
        return None
    arr = tensor.numpy()
    return [int(v) for v in arr.reshape(-1)] if arr.dtype.kind in "iu" else None


def _full_shape(value: ir.Value, ids: ir.Value) -> bool:
    """``value`` is proven of the input ids' shape [batch, sequence]."""
    return value.shape is not None and len(value.shape) == 2 and same_dim(value, 0, ids, 0) \
        and same_dim(value, 1, ids, 1)


def _positions_reason(m: Match, ids: ir.Value, pos: ir.Value | None) -> str | None:
    """Why the position ids are not proven 0..S-1 (S: the ids' dimension 1), or None; ``pos``: the
    position ids input, where they are one."""
    not_arange = "position ids are not 0..S-1"
    if pos is not None:
        if dtype_of(pos, m.opsets) not in INTS:
            return "the position ids input is not int32/int64"
        if pos.shape is None or len(pos.shape) != 2:
            return "the position ids input is not 2-D"
        if not same_dim(pos, 1, ids, 1):
            return "the position ids input's sequence length is not proven the input ids'"
        if not (_dim(pos, 0) == 1 or same_dim(pos, 0, ids, 0)):
            return "the position ids input's batch is neither 1 nor the input ids'"
        return None
    if m.node("position_slice") is not None:
        buffer = m.const("position_buffer")
        if buffer.ndim not in (1, 2) or (buffer.ndim == 2 and buffer.shape[0] != 1) or buffer.dtype.kind not in "iu":
            return f"{not_arange} (the sliced buffer is not an integer row)"
        row = buffer.reshape(-1)
        if not np.array_equal(row, np.arange(row.size)):
            return f"{not_arange} (the sliced buffer is not 0, 1, 2, ... (an offset))"
        axes, steps = _ints(m["position_axes"]), _ints(m["position_steps"])
        # (without axes a Slice takes axis 0: the buffer's positions only where it is 1-D)
        on_positions = axes in ([-1], [buffer.ndim - 1]) if m["position_axes"] is not None else buffer.ndim == 1
        if _ints(m["position_starts"]) != [0] or not on_positions \
                or (m["position_steps"] is not None and steps != [1]):
            return f"{not_arange} (the Slice does not start at 0 along the buffer with step 1)"
        if not _is_sequence(_one_element(m["position_end"]), ids):
            return f"{not_arange} (the Slice's end is not proven the input ids' sequence length)"
        seq = _dim(ids, 1)
        if isinstance(seq, int) and row.size < seq:
            return f"the position ids buffer has {row.size} entries, fewer than the sequence length {seq}"
        return None
    # Range(0, S, 1) or CumSum(ConstantOfShape([S], 1), 0, exclusive=1) [-> Unsqueeze(0)] [-> Expand]
    if m.node("position_cumsum") is not None:
        ones = m.node("position_ones").attributes.get("value")
        ones = None if ones is None else ones.value.numpy()
        if ones is None or ones.dtype != np.int64 or ones.reshape(-1).tolist() != [1] \
                or _ints(m["position_cumsum_axis"]) != [0] or m.attr("position_cumsum", "exclusive", 0) != 1 \
                or m.attr("position_cumsum", "reverse", 0) != 0:
            return f"{not_arange} (the CumSum does not count int64 ones from 0 along axis 0)"
    elif scalar(m["range_start"]) != 0 or scalar(m["range_delta"]) != 1:
        return f"{not_arange} (the Range does not count from 0 by 1)"
    if not _is_sequence(_one_element(m["position_end"]), ids):
        return f"{not_arange} (the Range's end is not proven the input ids' sequence length)"
    unsqueeze = m.node("position_unsqueeze")
    if unsqueeze is not None:
        axes = _ints(m["position_unsqueeze_axes"]) if m["position_unsqueeze_axes"] is not None else \
            m.attr("position_unsqueeze", "axes")
        if axes is None or list(axes) != [0]:
            return f"{not_arange} (the Range is not unsqueezed on axis 0)"
    if m.node("position_expand") is not None:
        target = shape_elements(m["position_expand_shape"])
        if target is None or len(target) > 2 or not (target[-1] == 1 or _is_sequence(target[-1], ids)):
            return f"{not_arange} (the positions are expanded to a shape not proven [batch, S])"
    return None


def _int32(value: ir.Value, m: Match, b) -> ir.Value:
    """``value`` as int32: itself, an existing ``Cast(value, to=int32)`` computed before the
    normalization, or a new Cast named ``<value>_int32``."""
    if dtype_of(value, m.opsets) == ir.DataType.INT32:
        return value
    norm = m.node("norm")
    before = set()
    for node in m.graph:
        if node is norm:
            break
        before.add(node)
    for use in value.uses():
        node = use.node
        to = node.attributes.get("to")
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node in before \
                and to is not None and to.value == int(ir.DataType.INT32):
            return node.outputs[0]
    cast = b.op("Cast", value, to=int(ir.DataType.INT32))
    cast.name = b._namer(f"{value.name}_int32")  # (deterministic, for a later rule to find)
    cast.type = ir.TensorType(ir.DataType.INT32)
    if value.shape is not None:
        cast.shape = ir.Shape(list(value.shape))
    return cast


def _target(m: Match) -> str:
    return m.options.get("target", ORT_CPU)


def _embed_condition(m: Match):
    norm = m.node("norm")
    skip = norm.op_type == "SkipLayerNormalization"
    for out in norm.outputs[1:3]:
        if out.uses() or out.is_graph_output():
            return "the normalization's mean or inverse deviation outputs are used"
    if not skip and m.attr("norm", "stash_type", 1) != 1:
        return "stash_type 0 (statistics in the input's type)"
    # the roles: with the position ids proven 0..S-1 that Gather is the position embedding and the larger
    # of the others the word's; with explicit ids only (graph inputs), which is which does not change the
    # sum the kernel computes (each table gathered by its own ids): the largest table is the word's (the
    # vocabulary), the next largest gathered by a graph input the position's, the other the segment's
    entries = [(m["table0"], m["ids0"], _table(m["table0"]))]
    if m["table1"] is not None:
        entries.append((m["table1"], m["ids1"], _table(m["table1"])))
    folded = m["position_values"] is not None  # (the position Gather folded at fixed shapes)
    position = (m["position_values"], None, _table(m["position_values"])) if folded else \
        (m["position_table"], m["position_input"], _table(m["position_table"]))
    if position[1] is not None:
        entries.append(position)
    for arr in (e[2] for e in entries + [position]):
        if arr.ndim != 2:
            break
    else:
        entries.sort(key=lambda e: -e[2].shape[0])
    (word, ids, word_arr), rest = entries[0], entries[1:]
    if position[1] is not None:
        # (all of them graph inputs: ids computed otherwise, such as RoBERTa's positions from padding_idx + 1,
        # are refused rather than passed as the segment's)
        if not rest or not all(_graph_input(e[1]) for e in rest):
            return "position ids are not 0..S-1 (nor a graph input)"
        position = rest[0]
        rest = [e for e in rest if e is not position]
    segment = rest[0] if rest else None
    position, pos_ids, pos_arr = position
    if folded:  # [1, S, H] or [S, H], S the ids' static length: a table of S rows gathered at 0..S-1
        seq = _dim(ids, 1) if ids.shape is not None else None
        if not (pos_arr.ndim == 2 or (pos_arr.ndim == 3 and pos_arr.shape[0] == 1)) or not isinstance(seq, int) \
                or pos_arr.shape[-2] != seq:
            return (f"the constant added (shape {list(pos_arr.shape)}) is not [1, S, H] with S the input ids' "
                    "static sequence length")
        pos_arr = _Table(pos_arr.shape[-2:], pos_arr.dtype)
    tables = [("word", word_arr), ("position", pos_arr)] + ([("segment", segment[2])] if segment else [])
    for what, arr in tables:
        if arr.ndim != 2:
            return f"the {what} table is not 2-D (shape {list(arr.shape)})"
    widths = {what: arr.shape[1] for what, arr in tables}
    if len(set(widths.values())) != 1:
        return "the tables' widths differ (" + ", ".join(f"{k} {v}" for k, v in widths.items()) + ")"
    h = word_arr.shape[1]
    gamma, beta = m.const("gamma"), m.const("beta")
    for what, p in (("scale", gamma), ("shift", beta)):
        if p is not None and (p.ndim != 1 or p.shape[0] != h):
            return f"the normalization's {what} is not 1-D of the tables' width {h}"
    dtype = ir.DataType.from_numpy(word_arr.dtype)
    if any(arr.dtype != word_arr.dtype for _, arr in tables) or gamma.dtype != word_arr.dtype \
            or (beta is not None and beta.dtype != word_arr.dtype):
        return "the tables and the normalization's scale and shift are not of one type"
    target = _target(m)
    has_kernel = kernel("EmbedLayerNormalization", "com.microsoft", 1, target, dtype)
    if (target == ORT_CPU and has_kernel is False) or (target == ORT_CUDA and dtype not in CUDA_TYPES):
        return f"no EmbedLayerNormalization kernel for {dtype.name.lower()} on {target}"
    if not skip:
        rank = None if norm.outputs[0].shape is None else len(norm.outputs[0].shape)
        axis = m.attr("norm", "axis", -1)
        if axis != -1 and axis != (rank or 0) - 1:
            return f"normalizes from axis {axis}, not the last"
    # the ids
    all_ids = [("input", ids)] + ([("segment", segment[1])] if segment else [])
    if pos_ids is not None:
        all_ids.append(("position", pos_ids))
    for what, v in all_ids:
        if dtype_of(v, m.opsets) not in INTS:
            return f"the {what} ids are not int32/int64"
    if ids.shape is None or len(ids.shape) != 2:
        return "the input ids are not 2-D [batch, sequence]"
    if segment is not None and not _full_shape(segment[1], ids):
        return "the segment ids are not proven of the input ids' shape"
    if not folded and (reason := _positions_reason(m, ids, pos_ids)):
        return reason
    seq = _dim(ids, 1)
    if isinstance(seq, int) and pos_arr.shape[0] < seq:
        return f"the position table has {pos_arr.shape[0]} rows, fewer than the sequence length {seq}"
    # the sum, where read elsewhere: output 2
    total = norm.outputs[3] if skip and len(norm.outputs) > 3 else None if skip else norm.inputs[0]
    fused = {norm}
    if total is not None and (total.is_graph_output() or {u.node for u in total.uses()} - fused):
        readers = {u.node for u in total.uses()} - fused
        for node in m.graph:
            if node is norm:
                break
            if node in readers:
                return "the sum is read before the normalization"
        m.outputs = [norm.outputs[0], total]
    else:
        m.outputs = [norm.outputs[0]]
    default = DEFAULT_EPSILON[norm.op_type]
    return {"word": word, "ids": ids, "segment": segment, "position": position, "position_ids": pos_ids,
            "folded_rows": pos_arr.shape if folded and len(_table(position).shape) == 3 else None, "epsilon": float(m.attr("norm", "epsilon", default)),
            "sum": total if len(m.outputs) == 2 else None, "h": h, "dtype": word_arr.dtype}


def _embed_replace(m: Match, b):
    plan = m.plan
    norm = m.node("norm")
    segment = plan["segment"]
    beta = m["beta"] if m["beta"] is not None else b.const(np.zeros(plan["h"], dtype=plan["dtype"]),
                                                            name="embed_ln_beta")
    position = plan["position"]
    if plan["folded_rows"] is not None:  # [1, S, H] -> a table [S, H]
        position = b.const(m.const("position_values").reshape(plan["folded_rows"]), name="position_embedding_rows")
    ins = [_int32(plan["ids"], m, b), _int32(segment[1], m, b) if segment else None, plan["word"],
           position, segment[0] if segment else None, m["gamma"], beta]
    if plan["position_ids"] is not None:
        ins += [None, _int32(plan["position_ids"], m, b)]
    outs = b.op("EmbedLayerNormalization", *ins, domain="com.microsoft", outputs=3 if plan["sum"] else 2,
                epsilon=plan["epsilon"])
    y = typed(outs[0], norm.outputs[0], m)
    if plan["sum"] is not None:
        return [y, typed(outs[2], plan["sum"], m)]
    return y


_DOC = ("word[ids] + position[0..S-1 or a position ids input] (+ segment[segment ids]), Adds in any order, "
        "normalized over the last axis {}, becomes com.microsoft EmbedLayerNormalization (int32 ids; output 2 "
        "gives the sum where it is read elsewhere).")

RULES = [
    Rule("embed_layer_normalization", EMBED_LN, _embed_replace, condition=_embed_condition, targets=ORT, priority=5,
         benefit="embed_layer_normalization", exact=False, doc=_DOC.format("by LayerNormalization")),
    Rule("embed_layer_normalization_skip", EMBED_SKIP_LN, _embed_replace, condition=_embed_condition, targets=ORT,
         benefit="embed_layer_normalization", exact=False,
         doc=_DOC.format("by a SkipLayerNormalization (no bias) of two of its parts")),
]
