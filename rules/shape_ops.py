"""Shape and data-movement ops that change nothing, chains of them, and shapes that can be constants
(Transposes have their own family, rules/transpose.py).

Exact: each rule keeps every value and every output's shape and dtype. Reshape targets built from
the input's own Shape (``Shape -> Gather -> Unsqueeze -> Concat -> Reshape``) are read back with
``onnxopt.ir.shapes.shape_elements``; a dimension the target copies becomes a 0 in a constant target.
That one, reshape_shape_from_input, is not exact in exact mode's sense (``Rule.exact``): a constant
target lets onnxruntime's own optimizer rewrite the graph around it differently (README, Exact mode).
"""

from __future__ import annotations

import numpy as np

from onnxopt.core.pattern import Const, Match, Op, Opt, Rule, forward
from onnxopt.ir.shapes import is_dim_of, same_symbol, shape_elements

from onnxopt.rules._exact import exact_removal

_x = forward("x")
_NO_END = 1 << 62  # a Slice end this large means "to the end" whatever the axis' size


def _axes(m: Match, node: str, input_name: str) -> list[int] | None:
    """Squeeze/Unsqueeze axes from the input (opset 13+) or the attribute, sorted."""
    if input_name in m:
        return sorted(int(a) for a in m.const(input_name).reshape(-1))
    attr = m.attr(node, "axes")
    return None if attr is None else sorted(int(a) for a in attr)


# --- Reshape ------------------------------------------------------------------------------------


def reshape_chain_condition(m: Match):
    if m.attr("outer", "allowzero", 0) != 1 and np.any(m.const("shape") == 0):
        return "the outer shape copies dimensions (0) from its input"
    return None


def reshape_chain_replacement(m: Match, b):
    return b.op("Reshape", m["x"], m["shape"], attrs=m.node("outer").attributes.values())


def reshape_elimination_condition(m: Match):
    """Every target dimension is x's own (the same number, or 0 copying it), but for one -1, which
    then is x's dimension there too, a number or not ([-1, 6, 1, 1] of x [N, 6, 1, 1])."""
    dims = m.dims("x")
    if dims is None:
        return "rank unknown"
    target = list(m.const("shape").reshape(-1))
    if len(target) != len(dims):
        return "rank changes"
    allowzero = m.attr("reshape", "allowzero", 0) == 1
    for t, d in zip(target, dims):
        if (d is not None and t == d) or (t == 0 and not allowzero):
            continue
        if t == -1 and target.count(-1) == 1:
            continue
        return "input shape not static" if d is None else "shape changes"
    return None


def reshape_to_unsqueeze_condition(m: Match):
    """The plan: the axes an Unsqueeze inserts where the Reshape's target is x's dimensions in order
    (a number, 0 copying x's dimension at that position, or one -1 standing for one of x's) with 1s
    between them. Unsqueeze keeps the dimensions' symbols where a Reshape with -1 gives its output a
    new one, which keeps onnxruntime from seeing that two branches have the same batch (it then
    neither fuses a residual Add into a Conv nor broadcasts without Reshapes)."""
    dims = m.dims("x")
    if dims is None:
        return "rank unknown"
    target = [int(t) for t in m.const("shape").reshape(-1)]
    if len(target) <= len(dims):
        return "does not raise the rank"
    if target.count(-1) > 1:
        return "more than one -1"
    if 0 in target and m.attr("reshape", "allowzero", 0) == 1:
        return "allowzero with a 0"
    axes, i = [], 0
    for j, t in enumerate(target):
        d = dims[i] if i < len(dims) else "end"
        if d != "end" and ((d is not None and t == d) or (t == 0 and j == i) or t == -1):
            i += 1
        elif t == 1:
            axes.append(j)
        else:
            return "not x's dimensions with 1s between"
    if i != len(dims):
        return "not x's dimensions with 1s between"
    return axes


def _own_dims_target(m: Match) -> list[int] | None:
    """The Reshape's target as constants, with 0 where it copies x's own dimension at the same
    position (the same value, or one with the same named symbol); None when it is built otherwise."""
    elements = shape_elements(m["shape"])
    if elements is None:
        return None
    x, dims = m["x"], m.dims("x")
    rank = None if dims is None else len(dims)
    out = []
    for j, e in enumerate(elements):
        if isinstance(e, int):
            if e == 0:
                return None  # a literal 0 already copies; keep the arithmetic simple
            out.append(e)
        elif rank is not None and j < rank and is_dim_of(e, x, j):
            out.append(0)
        elif e[1].shape is not None and isinstance(e[1].shape[e[2]], int) and int(e[1].shape[e[2]]) > 0:
            out.append(int(e[1].shape[e[2]]))  # (a static 0 would read as "copy")
        else:
            return None
    return None if out.count(-1) > 1 else _without_minus_one(m, out)


def _without_minus_one(m: Match, target: list[int]) -> list[int]:
    """A -1 where the Reshape's output has a known size, or the symbol of x's dimension at that
    position, is that size or a copy (0): then no -1 is left to meet a copied 0 of a zero-sized
    dimension."""
    if -1 not in target:
        return target
    j = target.index(-1)
    out, dims = m.root.outputs[0], m.output_dims()
    if dims is None or len(dims) != len(target):
        return target
    if dims[j] is not None and dims[j] > 0:
        return target[:j] + [dims[j]] + target[j + 1:]
    x_dims = m.dims("x")
    if x_dims is not None and j < len(x_dims) and same_symbol(out, j, m["x"], j):
        return target[:j] + [0] + target[j + 1:]
    return target


def reshape_shape_from_input_condition(m: Match):
    if m["shape"].producer() is None:
        return "the shape is already a constant"
    target = _own_dims_target(m)
    if target is None:
        return "the shape is not built from constants and the input's own dimensions"
    if m.attr("reshape", "allowzero", 0) == 1 and -1 in target and 0 in target:
        # onnxruntime accepts 0 with -1 under allowzero=1 (the spec does not); allowzero=0 would not
        return "allowzero=1 with -1: a copied dimension of 0 would change meaning"
    return target  # the plan: the constant target


def reshape_shape_from_input_replacement(m: Match, b):
    # A 0 copies the dimension it stands for, which is the value the original computed, so the
    # new Reshape copies (allowzero 0) even where the original had allowzero=1 (it has no literal 0).
    attrs = [a for a in m.node("reshape").attributes.values() if a.name != "allowzero"]
    return b.op("Reshape", m["x"], b.const(np.array(m.plan, dtype=np.int64), name="shape"), attrs=attrs)


def flatten_elimination_condition(m: Match):
    dims = m.dims("x")
    if dims is None or len(dims) != 2 or m.attr("flatten", "axis", 1) not in (1, -1):
        return "not a 2-D input flattened at axis 1"
    return None


# --- Squeeze / Unsqueeze --------------------------------------------------------------------------


def squeeze_unsqueeze_condition(m: Match):
    inner, outer = _axes(m, "inner", "a1"), _axes(m, "outer", "a2")
    if inner is None or outer is None:
        return "axes not given"
    if any(a < 0 for a in inner + outer):
        return "negative axes"
    if inner != outer:
        return "different axes"
    return None


def unsqueeze_chain_condition(m: Match):
    """The plan: the axes of one Unsqueeze doing both."""
    a1, a2, dims = _axes(m, "inner", "a1"), _axes(m, "outer", "a2"), m.dims("x")
    if a1 is None or a2 is None or dims is None:
        return "axes or rank unknown"
    middle, final = len(dims) + len(a1), len(dims) + len(a1) + len(a2)
    a1 = sorted(a % middle for a in a1)
    a2 = sorted(a % final for a in a2)
    if len(set(a1)) != len(a1) or len(set(a2)) != len(a2):
        return "repeated axes"
    kept = [p for p in range(final) if p not in a2]  # the intermediate's axes, in the final tensor
    return sorted(set(a2) | {kept[a] for a in a1})


def unsqueeze(m: Match, b, x, axes: list[int]):
    """Unsqueeze(x, axes): the axes an input from opset 13, an attribute before."""
    if m.opset("") >= 13:
        return b.op("Unsqueeze", x, b.const(np.array(axes, dtype=np.int64), name="axes"))
    return b.op("Unsqueeze", x, axes=axes)


def unsqueeze_plan_replacement(m: Match, b):
    """Unsqueeze(x, the condition's axes)."""
    return unsqueeze(m, b, m["x"], m.plan)


# --- Expand, Slice, Pad, Concat, Split ----------------------------------------------------------------


def expand_elimination_condition(m: Match):
    dims = m.dims("x")
    if dims is None:
        return "input shape unknown"
    target = [int(s) for s in m.const("shape").reshape(-1)]
    if len(target) > len(dims):
        return "raises the rank"
    if not target and m.options.get("exact"):
        # (its ExpandElimination wants a target of at least one element; the Expand it keeps then
        # stands between the ops it would fuse, a MatMul and its bias Add)
        return "exact: onnxruntime does not remove an Expand to the empty shape itself"
    for t, d in zip(reversed(target), reversed(dims)):
        if t == 1 or (d is not None and t == d):
            continue
        return "expands"
    return None


def _slice_onnxruntime_keeps(m: Match, _verdict) -> bool:
    """onnxruntime's own slice elimination takes out a Slice whose every end is INT64_MAX (from
    0, step 1): exact mode needs no guard for that one."""
    return not bool(np.all(m.const("ends") == np.iinfo(np.int64).max))


def slice_elimination_condition(m: Match):
    starts, ends, steps = m.const("starts"), m.const("ends"), m.const("steps")
    if steps is not None and np.any(steps != 1):
        return "step is not 1"
    if np.any(starts != 0):
        return "does not start at 0"
    dims = m.dims("x")
    axes = m.const("axes") if "axes" in m else np.arange(len(ends))
    for axis, end in zip(axes.reshape(-1), ends.reshape(-1)):
        if end >= _NO_END:
            continue
        if dims is None or int(axis) >= len(dims) or int(axis) < -len(dims):
            return "cannot tell whether it covers the axis"
        d = dims[int(axis)]
        if d is None or end < d:
            return "cuts the axis"
    return None


def pad_elimination_condition(m: Match):
    return "pads" if np.any(m.const("pads") != 0) else None


def split_elimination_condition(m: Match):
    return "more than one output" if len(m.root.outputs) != 1 else None


# --- Range --------------------------------------------------------------------------------------


def range_scalar_inputs_condition(m: Match):
    """The plan: the inputs (start, limit, delta) that hold one element in a [1]-like shape."""
    one_element = [name for name in ("start", "limit", "delta")
                   if (dims := m.dims(name)) is not None and len(dims) > 0 and all(d == 1 for d in dims)]
    return one_element or "inputs are scalars or of unknown shape"


def range_scalar_inputs_replacement(m: Match, b):
    scalar = b.const(np.zeros((0,), dtype=np.int64), name="scalar_shape")
    inputs = [b.op("Reshape", m[name], scalar) if name in m.plan else m[name] for name in ("start", "limit", "delta")]
    return b.op("Range", *inputs)


RULES = [
    Rule("reshape_chain", Op("Reshape", Op("Reshape", "x", "s1"), Const("shape"), name="outer"),
         reshape_chain_replacement, condition=reshape_chain_condition,
         exact=True, doc="Reshape(Reshape(x, s1), s2) is Reshape(x, s2) when s2 copies no dimension (no 0)."),
    Rule("reshape_flatten_chain", Op("Reshape", Op("Flatten", "x"), Const("shape"), name="outer"),
         reshape_chain_replacement, condition=reshape_chain_condition,
         exact=True, doc="Reshape(Flatten(x), s) is Reshape(x, s) when s copies no dimension (no 0)."),
    Rule("reshape_elimination", Op("Reshape", "x", Const("shape"), name="reshape"), _x,
         condition=exact_removal(reshape_elimination_condition, "Reshape"),
         exact=True, doc="Reshape to the shape x already has (static) is x."),
    Rule("reshape_to_unsqueeze", Op("Reshape", "x", Const("shape"), name="reshape"), unsqueeze_plan_replacement,
         condition=reshape_to_unsqueeze_condition, exact=True,
         doc="Reshape that only inserts size-1 dimensions (x's own in order, copied by 0 or one of them "
             "as -1) is an Unsqueeze, which keeps the dimensions' symbols."),
    Rule("reshape_shape_from_input", Op("Reshape", "x", "shape", name="reshape"), reshape_shape_from_input_replacement,
         condition=reshape_shape_from_input_condition,
         exact=False,
         doc="Reshape whose target shape is assembled (Shape/Gather/Slice/Unsqueeze/Concat) from constants "
             "and x's own dimensions at the same positions (the same value, or the same named symbol) takes a "
             "constant shape, with 0 for the copied ones."),
    Rule("flatten_elimination", Op("Flatten", "x", name="flatten"), _x, condition=exact_removal(flatten_elimination_condition, "Flatten"),
         exact=True, doc="Flatten of a 2-D value at axis 1 is the value."),
    Rule("squeeze_unsqueeze", Op("Squeeze", Op("Unsqueeze", "x", Opt(Const("a1")), name="inner"), Opt(Const("a2")),
                                 name="outer"), _x, condition=exact_removal(squeeze_unsqueeze_condition, "Unsqueeze and Squeeze"),
         exact=True, doc="Squeeze(Unsqueeze(x, axes), axes) is x."),
    Rule("unsqueeze_squeeze", Op("Unsqueeze", Op("Squeeze", "x", Opt(Const("a1")), name="inner"), Opt(Const("a2")),
                                 name="outer"), _x, condition=exact_removal(squeeze_unsqueeze_condition, "Squeeze and Unsqueeze"),
         exact=True, doc="Unsqueeze(Squeeze(x, axes), axes) is x (the squeezed axes had size 1)."),
    Rule("unsqueeze_chain", Op("Unsqueeze", Op("Unsqueeze", "x", Opt(Const("a1")), name="inner"), Opt(Const("a2")),
                               name="outer"), unsqueeze_plan_replacement, condition=unsqueeze_chain_condition,
         exact=True, doc="Unsqueeze(Unsqueeze(x, a1), a2) is one Unsqueeze with both sets of axes."),
    Rule("expand_elimination", Op("Expand", "x", Const("shape")), _x, condition=expand_elimination_condition,
         exact=True, doc="Expand to a shape x already covers is x."),
    Rule("slice_elimination", Op("Slice", "x", Const("starts"), Const("ends"), Opt(Const("axes")), Opt(Const("steps"))),
         _x, condition=exact_removal(slice_elimination_condition, "Slice", _slice_onnxruntime_keeps), exact=True, doc="Slice from 0 to past the end with step 1 is x."),
    Rule("pad_elimination", Op("Pad", "x", Const("pads"), Opt("value"), Opt("axes")), _x,
         condition=exact_removal(pad_elimination_condition, "Pad"), exact=True, doc="Pad by zeros on every side is x."),
    Rule("concat_elimination", Op("Concat", "x"), _x, condition=exact_removal(None, "Concat"), exact=True,
         doc="Concat of one input is it (the pattern takes one input)."),
    Rule("split_elimination", Op("Split", "x", Opt(Const("split"))), _x, condition=exact_removal(split_elimination_condition, "Split"),
         exact=True, doc="Split into one piece is x."),
    Rule("range_scalar_inputs", Op("Range", "start", "limit", "delta"), range_scalar_inputs_replacement,
         condition=range_scalar_inputs_condition,
         exact=True,
         doc="Range inputs known to hold one element in a [1]-like shape become scalars, as the spec requires "
             "(onnxruntime's shape inference rejects them once their shapes are known)."),
]
