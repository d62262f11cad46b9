"""Heads as layouts: what the attention fusions prove about the views between a projection and the MatMuls.

A tensor's dimensions are read as groups of *atoms* ("B" batch, "S" query length, "T" key length, "N"
heads, "D" head size; the decoder fusion adds "G" key/value heads and "R" query heads per key/value
head, N = G x R): a group's size is the product of its atoms' sizes (an empty group is a dimension of
size 1; atoms of size 1 are dropped: they do not change where an element lies). Following a chain of
Reshape/Transpose/Unsqueeze/Squeeze nodes from a projection [B, S, H] split into heads tells where each
element went; two chains that reach a MatMul with the same atoms in the same places multiply the
elements the fused op multiplies. Shared by rules/attention.py and rules/group_query_attention.py; a
question with no answer raises ``NoFit`` with the reason the rule gives.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from onnxopt.core.pattern import Match
from onnxopt.ir.shapes import infer, scalar_element, shape_elements
from onnxopt.ir.util import constant_tensor

from onnxopt.rules._attention_parts import (MS, SAME_SHAPE, dim_through, dims_of, float_scalar, is_scale,
                                           minus_one_kept, prime_shapes)
from onnxopt.rules._semantic import reduce_max, squeeze, unrepresentable


class NoFit(Exception):
    """A layout question with no answer; the message is the reason (short, no node names)."""


# --------------------------------------------------------------------------------------------
# Layouts: a tensor's dimensions as groups of atoms ("B", "S", "T", "N", "D"); a group's size is
# the product of its atoms' sizes (an empty group is a dimension of size 1). Atoms of size 1 are
# dropped: they do not change where an element lies.


class Layouts:
    def __init__(self, m: Match):
        self.m = m
        self.sizes: dict[str, int | None] = {}
        self.layouts: dict[ir.Value, list[tuple]] = {}  # every value whose layout is known
        self.sources: dict[ir.Value, tuple[str, str]] = {}  # projection -> (batch atom, length atom)
        self.sum_of = None  # (element, element) -> the element their sum is, or None (see _element)

    def size(self, atom: str) -> int | None:
        return self.sizes.get(atom)

    def set_size(self, atom: str, size: int | None) -> None:
        old = self.sizes.get(atom)
        if old is not None and size is not None and old != size:
            raise NoFit(f"{atom} is {old} in one place and {size} in another")
        if size is not None or atom not in self.sizes:
            self.sizes[atom] = size

    def norm(self, groups) -> list[tuple]:
        return [tuple(a for a in g if self.size(a) != 1) for g in groups]


def dtype_through(value: ir.Value, opsets, depth: int = 0) -> ir.DataType | None:
    """value's element type (inferred), looking through the contrib ops other fusions make and
    taking a projection's from its constant weight."""
    if value.type is None:
        infer(value, opsets)
    if isinstance(value.type, ir.TensorType):
        return value.type.dtype
    node = value.producer()
    if node is None or depth > 6 or not (node.domain in ("", "ai.onnx") and node.op_type in ("MatMul", "Add", "Split")
                                         or node.domain == MS and node.op_type in SAME_SHAPE):
        return None
    for v in node.inputs:
        t = constant_tensor(v)
        if t is not None and node.op_type != "Split":
            return t.dtype
    return dtype_through(node.inputs[0], opsets, depth + 1)


def group_of_dim(ctx: Layouts, ref) -> tuple:
    """The group a ("dim", value, k) reference stands for."""
    _, value, k = ref
    layout = ctx.layouts.get(value)
    if layout is not None and -len(layout) <= k < len(layout):
        return layout[k]
    if value in ctx.sources:  # dimension k of a projection [B, S, H]
        b, s = ctx.sources[value]
        if k in (0, -3):
            return (b,)
        if k in (1, -2):
            return (s,)
        return ("N", "D")
    raise NoFit("a reshape reads the shape of a value outside the attention")


def take_atoms(ctx: Layouts, atoms: list, want: int, reverse: bool) -> tuple[tuple, list]:
    """Atoms from one end of ``atoms`` whose sizes multiply to ``want``."""
    taken, rest = [], list(atoms)
    prod = 1
    while prod != want:
        if not rest:
            raise NoFit(f"a reshape dimension {want} does not fit the heads")
        atom = rest.pop() if reverse else rest.pop(0)
        size = ctx.size(atom)
        if size is None:
            raise NoFit(f"a reshape dimension {want} meets a dimension of unknown size")
        prod *= size
        taken.append(atom)
        if prod > want or want % prod:
            raise NoFit(f"a reshape dimension {want} does not fit the heads")
    return (tuple(reversed(taken)) if reverse else tuple(taken)), rest


_ARITHMETIC = {"Add": lambda a, c: a + c, "Sub": lambda a, c: a - c, "Mul": lambda a, c: a * c,
               "Div": lambda a, c: a // c if c and a % c == 0 else None}  # (ONNX's integer Div truncates)


def _number(ctx: Layouts, element) -> int | None:
    """A target element as a number: itself, or the size of the heads' group it reads where known."""
    if isinstance(element, int):
        return element
    try:
        group = group_of_dim(ctx, element)
    except NoFit:
        return None
    size = 1
    for atom in group:
        if ctx.size(atom) is None:
            return None
        size *= ctx.size(atom)
    return size


def _element(ctx: Layouts, value: ir.Value, depth: int = 0):
    """A scalar as a target element: a number, a dimension read (``("dim", value, k)``), or arithmetic on
    them: Add/Sub/Mul/Div of numbers and of dimensions whose heads' group has a known size (a legacy export's
    head count ``Div(Gather(Shape(q), 1), n_rep)``), or a sum of dimensions that ``ctx.sum_of`` names (a
    decoder's keys, past + new); else None."""
    element = scalar_element(value)
    node = value.producer()
    if element is not None or node is None or depth > 6 or node.domain not in ("", "ai.onnx") \
            or node.op_type not in _ARITHMETIC or len(node.inputs) != 2:
        return element
    a, c = (_element(ctx, v, depth + 1) for v in node.inputs)
    if a is None or c is None:
        return None
    na, nc = _number(ctx, a), _number(ctx, c)
    if na is not None and nc is not None:
        return _ARITHMETIC[node.op_type](na, nc)
    if node.op_type == "Add" and ctx.sum_of is not None:
        return ctx.sum_of(a, c)
    return None


def target_elements(ctx: Layouts, value: ir.Value | None) -> list | None:
    """A Reshape/Expand target as ``shape_elements`` reads it, or, where one of its parts is arithmetic on
    the heads' dimensions, with that part's number (a Concat of such parts, each Unsqueezed)."""
    elements = shape_elements(value)
    if elements is not None or value is None:
        return elements
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Concat":
        parts = [target_elements(ctx, v) for v in node.inputs]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if node.op_type == "Unsqueeze" or node.op_type == "Reshape" and len(node.inputs) == 2 \
            and constant_tensor(node.inputs[1]) is not None \
            and constant_tensor(node.inputs[1]).numpy().reshape(-1).tolist() in ([1], [-1]):
        element = _element(ctx, node.inputs[0])  # (a scalar made 1-D)
        return None if element is None else [element]
    if node.op_type == "Where" and len(node.inputs) == 3:
        return _minus_one_replaced(ctx, node)
    return None


def _minus_one_replaced(ctx: Layouts, node: ir.Node) -> list | None:
    """torch's ``expand(-1, ...)`` in a legacy export: ``Where(Equal(t, c), fill, t)`` with constants c and
    fill: element i is fill[i] where t[i] == c[i], else t[i]. A dimension read from a shape is never
    negative, so against a negative c[i] it is kept."""
    cond, fill, t = node.inputs
    eq = cond.producer()
    fills = constant_tensor(fill)
    if eq is None or eq.op_type != "Equal" or eq.domain not in ("", "ai.onnx") or fills is None \
            or eq.inputs[0] is not t:
        return None
    versus = constant_tensor(eq.inputs[1])
    elements = target_elements(ctx, t)
    if versus is None or elements is None:
        return None
    return minus_one_kept(elements, versus.numpy().reshape(-1).tolist(), fills.numpy().reshape(-1).tolist())


def reshape_layout(ctx: Layouts, layout: list[tuple], node: ir.Node) -> list[tuple]:
    shape_value = node.inputs[1] if len(node.inputs) > 1 else None
    prime_shapes(shape_value, ctx.m.opsets)
    elements = target_elements(ctx, shape_value)
    if elements is None:
        raise NoFit("a reshape target is not readable")
    allowzero = node.attributes.get("allowzero")
    allowzero = allowzero is not None and allowzero.value == 1
    tokens = []
    for i, e in enumerate(elements):
        if isinstance(e, int):
            if e == 0 and not allowzero:
                if i >= len(layout):
                    raise NoFit("a reshape copies a dimension its input lacks")
                tokens.append(("group", layout[i]))
            elif e == -1:
                tokens.append(("rest",))
            elif e < 0:
                raise NoFit("a reshape target is negative")
            else:
                tokens.append(("int", e))
        else:
            tokens.append(("group", ctx.norm([group_of_dim(ctx, e)])[0]))
    if sum(1 for t in tokens if t[0] == "rest") > 1:
        raise NoFit("a reshape target has two -1")
    atoms = [a for g in layout for a in g]

    def fill(toks, atoms, reverse):
        out = []
        for t in (reversed(toks) if reverse else toks):
            if t[0] == "group":
                g = t[1]
                n = len(g)
                part = atoms[len(atoms) - n:] if reverse else atoms[:n]
                if tuple(part) != g:
                    raise NoFit("a reshape moves data across heads")
                atoms = atoms[:len(atoms) - n] if reverse else atoms[n:]
                out.append(g)
            else:
                g, atoms = take_atoms(ctx, atoms, t[1], reverse)
                out.append(g)
        return (out[::-1] if reverse else out), atoms

    if ("rest",) in tokens:
        k = tokens.index(("rest",))
        left, atoms = fill(tokens[:k], atoms, False)
        right, atoms = fill(tokens[k + 1:], atoms, True)
        return left + [tuple(atoms)] + right
    out, atoms = fill(tokens, atoms, False)
    if atoms:
        raise NoFit("a reshape target does not cover its input")
    return out


def split_heads(ctx: Layouts, x: ir.Value, node: ir.Node, b: str, s: str, heads: tuple = ("N",)) -> list[tuple]:
    """The first Reshape of a projection x [B, S, H] into [B, S, N, D] (or its 3-D flattenings). The
    heads dimension is the group ``heads``: one atom takes its size; several (a decoder's query heads
    ("G", "R"), key/value heads outermost) must have every size but the last known, the last being
    what is left."""
    dims = dims_of(x, ctx.m.opsets)
    if dims is None or len(dims) != 3:
        raise NoFit("a projection is not [B, S, H] with H known")
    # (a dimension recorded as unknown read again through the nodes that made it: Phi-3 legacy's second layer)
    dims = [d if isinstance(d, int) else dim_through(x, k, ctx.m.opsets) for k, d in enumerate(dims)]
    if not isinstance(dims[2], int):
        raise NoFit("a projection is not [B, S, H] with H known")
    h = dims[2]
    ctx.set_size(b, dims[0] if isinstance(dims[0], int) else None)
    ctx.set_size(s, dims[1] if isinstance(dims[1], int) else None)
    shape_value = node.inputs[1] if len(node.inputs) > 1 else None
    prime_shapes(shape_value, ctx.m.opsets)
    elements = shape_elements(shape_value)
    if elements is not None and len(elements) == 3 and ctx.size(b) == 1:
        elements = [1] + elements  # (a batch of 1 dropped: [S, N, D])
    if elements is None or len(elements) != 4:
        raise NoFit("the heads are not split by a 4-D reshape")
    allowzero = node.attributes.get("allowzero")
    allowzero = allowzero is not None and allowzero.value == 1
    for i, atom in ((0, b), (1, s)):
        e = elements[i]
        ok = (e == 0 and not allowzero) or (isinstance(e, int) and e > 0 and e == ctx.size(atom)) \
            or (not isinstance(e, int) and ctx.norm([group_of_dim(ctx, e)])[0] == ctx.norm([(atom,)])[0])
        if not ok and e == -1 and all(isinstance(v, int) and v > 0 for v in elements[1:]):
            ok = i == 0 and ctx.size(s) in (elements[1],) and elements[2] * elements[3] == h
        if not ok:
            raise NoFit("the heads' reshape does not keep batch and sequence")
    n, d = elements[2], elements[3]
    if n == -1 and isinstance(d, int) and d > 0 and h % d == 0:
        n = h // d
    elif d == -1 and isinstance(n, int) and n > 0 and h % n == 0:
        d = h // n
    if not (isinstance(n, int) and isinstance(d, int) and n > 0 and d > 0 and n * d == h):
        raise NoFit("the heads' reshape does not split H into N x D")
    known = 1
    for atom in heads[:-1]:
        size = ctx.size(atom)
        if size is None:
            raise NoFit(f"the size of {atom} is not known where the heads are split")
        known *= size
    if n % known:
        raise NoFit(f"{n} heads are not a multiple of {known}")
    ctx.set_size(heads[-1], n // known)
    ctx.set_size("D", d)
    return ctx.norm([(b,), (s,), tuple(heads), ("D",)])


def apply_view(ctx: Layouts, layout, node: ir.Node) -> list[tuple]:
    if node.op_type == "Transpose":
        perm = node.attributes.get("perm")
        perm = list(perm.value) if perm is not None else list(range(len(layout)))[::-1]
        if sorted(perm) != list(range(len(layout))):
            raise NoFit("a transpose does not fit the heads' rank")
        return [layout[p] for p in perm]
    if node.op_type == "Reshape":
        return reshape_layout(ctx, layout, node)
    if node.op_type in ("Unsqueeze", "Squeeze"):
        axes = node.inputs[1] if len(node.inputs) > 1 else None
        axes = constant_tensor(axes).numpy().reshape(-1).tolist() if axes is not None else (
            list(node.attributes["axes"].value) if "axes" in node.attributes else None)
        if axes is None:
            raise NoFit("a squeeze has no constant axes")
        if node.op_type == "Unsqueeze":
            rank = len(layout) + len(axes)
            inserted = {a % rank for a in axes}
            groups = iter(layout)
            return [() if k in inserted else next(groups) for k in range(rank)]
        removed = {a % len(layout) for a in axes}
        if any(layout[k] for k in removed):
            raise NoFit("a squeeze removes a dimension of the heads")
        return [g for k, g in enumerate(layout) if k not in removed]
    return layout  # a scale


def follow_heads(ctx: Layouts, located, b: str, s: str, want: list[tuple], what: str) -> None:
    """Prove the located chain gives a projection's heads in layout ``want``."""
    nodes, start, _ = located
    if not nodes:
        raise NoFit(f"{what} is not a reshape of a projection into heads")
    layout = split_heads(ctx, start, nodes[0], b, s)
    ctx.layouts[nodes[0].outputs[0]] = layout
    for node in nodes[1:]:
        layout = apply_view(ctx, layout, node)
        ctx.layouts[node.outputs[0]] = layout
    if layout != ctx.norm(want):
        raise NoFit(f"{what} does not reach the MatMul as {show_layout(want)}")


def small_const(value: ir.Value | None) -> bool:
    t = constant_tensor(value)
    return t is not None and len(t.shape) <= 1


def _last_axis_only(node: ir.Node, opsets) -> bool:
    """node (a Slice) slices its rank-3 input on the last axis alone (constant axes)."""
    axes = constant_tensor(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    dims = dims_of(node.inputs[0], opsets)
    return axes is not None and dims is not None and len(dims) == 3 \
        and all(int(a) % 3 == 2 for a in axes.numpy().reshape(-1))


def ancestors(x: ir.Value, opsets) -> list[ir.Value]:
    """x and the values whose first two dimensions are x's: through Split, a Slice of the last axis,
    Add/Mul/Sub/Div of a constant of rank <= 1, MatMul (x @ W), LayerNormalization and the contrib
    normalizations (a few steps up)."""
    out = [x]
    for _ in range(4):
        node = x.producer()
        if node is None:
            break
        if node.domain == MS and node.op_type in SAME_SHAPE and x is node.outputs[0]:
            nxt = node.inputs[0]
        elif node.domain not in ("", "ai.onnx"):
            break
        elif node.op_type in ("Split", "MatMul", "LayerNormalization"):
            nxt = node.inputs[0]
        elif node.op_type == "Slice" and _last_axis_only(node, opsets):  # (a fused qkv's part: Phi-3 legacy)
            nxt = node.inputs[0]
        elif node.op_type in ("Add", "Sub", "Mul", "Div") and len(node.inputs) == 2:
            a, c = node.inputs  # (a constant of rank <= 1 cannot add dimensions)
            nxt = a if small_const(c) else c if small_const(a) else None
        else:
            break
        if nxt is None:
            break
        dims = dims_of(nxt, opsets)
        if dims is None or len(dims) != 3:
            break
        out.append(nxt)
        x = nxt
    return out


def show_layout(groups) -> str:
    return "[" + ",".join("*".join(g) or "1" for g in groups) + "]"


def scale_factor(node: ir.Node) -> float:
    """The factor a scale step (see _attention_parts.scale_step) multiplies by: a Mul's scalar operand
    (the second where it is one), 1 / a Div's; 1 for a view."""
    if node.op_type == "Mul":
        a, c = node.inputs
        return float_scalar(c) if float_scalar(c) is not None else float_scalar(a)
    if node.op_type == "Div":
        return 1.0 / float_scalar(node.inputs[1])
    return 1.0


def located(m: Match, p: str) -> tuple[list[ir.Node], ir.Value, float]:
    """(the head split and the views after it, the projection, the product of the scales on the
    way) of what ``heads(p)`` bound; the product taken from the MatMul back."""
    views = m.chain(f"{p}_views")
    scale = 1.0
    for node in reversed(views):
        scale *= scale_factor(node)
    return [m.node(f"{p}_split"), *views], m[f"x{p}"], scale


# --------------------------------------------------------------------------------------------
# The fused ops' scale, and the rows no key reaches


def scale_refusal(scale: float, dtype: ir.DataType) -> str | None:
    """Why the product of the scales cannot be the fused op's ``scale`` (a float32 attribute), or
    None: 0 means 1/sqrt(head_size) to the fused ops, so a product that rounds to 0 (1e-25 on Q and
    on K: 1e-50) would change the answer, as would inf or a subnormal; a float16 model's kernels may
    apply it in float16, where it must be a normal number too."""
    if scale == 0.0 or not math.isfinite(scale):  # (the factors are nonzero and finite: float64 ran out)
        return f"the attention scale (the product of the scales) is {scale} in float64"
    reason = unrepresentable("the attention scale (the product of the scales)", scale, np.float32)
    if reason is None and dtype == ir.DataType.FLOAT16:
        reason = unrepresentable("the attention scale (the product of the scales)", scale, np.float16)
    return reason


def finite_mask(mask: ir.Value) -> bool:
    """The additive mask holds no -inf: a finite constant, or Where(c, a, b) of finite constants."""
    t = constant_tensor(mask)
    if t is not None:
        return bool(np.all(np.isfinite(t.numpy())))
    node = mask.producer()
    if node is None or node.op_type != "Where" or node.domain not in ("", "ai.onnx"):
        return False
    arrays = [constant_tensor(v) for v in node.inputs[1:]]
    return all(a is not None and bool(np.all(np.isfinite(a.numpy()))) for a in arrays)


def zero_masked_rows(m: Match, b, y: ir.Value, lead: list, mask: ir.Value | None = None) -> ir.Value:
    """y [B, S, N*D] with the rows (query, head) whose keys are all masked with -inf set to 0, as the
    NaN guard after the Softmax does: y * (max over keys of the mask > -inf); ``mask``: the additive mask
    to read (default the plan's)."""
    dt = m.plan["dtype"].numpy()
    n, d = int(m.plan["num_heads"]), int(m.plan["head"])
    mask = m.plan["mask"] if mask is None else mask
    top = reduce_max(m, b, mask, [-1], name="attention_keys_axis")
    any_key = b.op("Cast", b.op("Greater", top, b.const(np.array(-np.inf, dt), name="attention_ninf")),
                   to=int(m.plan["dtype"]))  # [B|1, N|1, S, 1]
    per_row = b.op("Transpose", any_key, perm=[0, 2, 1, 3])  # [B|1, S, N|1, 1]
    dims = dims_of(mask, m.opsets)
    if dims is not None and len(dims) == 4 and dims[1] == 1:  # one factor for every head: y [B, S, N*D] * [B|1, S, 1]
        rows = squeeze(m, b, per_row, [2], name="attention_heads_axis")
        zeroed = b.op("Mul", y, rows)
        zeroed.type, zeroed.shape = ir.TensorType(m.plan["dtype"]), ir.Shape(lead + [n * d])
        return zeroed
    y4 = b.op("Reshape", y, b.const(np.array([0, 0, n, d], np.int64), name="attention_heads"))
    zeroed = b.op("Mul", y4, per_row)
    merged = b.op("Reshape", zeroed, b.const(np.array([0, 0, n * d], np.int64), name="attention_merged"))
    for v, dims in ((y4, lead + [n, d]), (zeroed, lead + [n, d]), (merged, lead + [n * d])):
        v.type, v.shape = ir.TensorType(m.plan["dtype"]), ir.Shape(dims)  # (the next layers' shapes need them)
    return merged
