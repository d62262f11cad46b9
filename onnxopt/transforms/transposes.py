"""Transpose optimization: a whole-graph pass that pushes Transposes down the graph through the ops
that do not care about layout, until they meet another Transpose (and merge or cancel with it), by a
cost in elements moved.

The cost of a graph is the sum, over its Transposes, of the elements each moves: a Transpose that
moves only size-1 dimensions costs nothing (it is a Reshape, rule ``transpose_to_reshape``), and a
dimension that is not a number counts as a parameter ``s``: a cost is a polynomial in ``s``,
compared as ``s`` grows (``2s`` is more than ``1000``, ``s - 8`` is more than ``0``).

For each Transpose ``T`` (perm ``p``) the pass walks the chain ``T -> O1 -> O2 -> ...``: a push
through ``O`` makes ``O`` read ``T``'s input directly, in ``T``'s input layout (axes attributes and
per-axis constants remapped), transposes ``O``'s other layout-following inputs the other way
(constants are permuted; a value made by a Transpose takes a composed one, which cancels when the
two are inverse; any other value gets a new Transpose, after an Unsqueeze to the output's rank for
a broadcasting operand of lower rank), and puts a Transpose after ``O``'s outputs. Where several
nodes read ``T``, a chain starts at each of them in turn (``T`` stays for the others, and goes once
the chain has pushed every one of its readers: SiLU's ``Mul(x, Sigmoid(x))``). A chain goes on
while the carried Transpose has one reader; it ends where it has several (those that are
Transposes merge with it, the others keep it), at a graph output, or at an op it cannot pass.
Every prefix of the chain is scored: the Transposes added, less those merged and those left with
no reader. The pass commits the prefix with the lowest total when that total is below zero: a
sequence whose single steps raise the cost but whose end lowers it is found, and a committed
sequence never raises it. It repeats until no chain pays (``_MAX_ROUNDS``).

Ops pushed through (``_handler``): element-wise unary ops and Cast, Clip, broadcasting binaries
(and Where, PRelu), Concat, Split, Reduce*, ArgMax/ArgMin, Softmax/LogSoftmax/Hardmax (opset 13+),
Gather (data), Pad, Slice, Squeeze, Unsqueeze, Resize, QuantizeLinear/DequantizeLinear (per-axis
``axis`` remapped; blocked quantization refused) and Reshape where it only inserts or removes
size-1 dimensions (static shapes). Only the main graph is rewritten.

Not exact in exact mode's sense: a reduction, Softmax or Resize over a different memory layout may
round differently in onnxruntime's kernels (the element-wise pushes are bit-identical).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from onnxopt.ir.util import REPLACED_KEY, RULE_KEY, constant_tensor, inherit_metadata, opset_of, redirect, use_count
from onnxopt.ir.shapes import DECLARED, infer, infer_proto, opsets_of, tensor_nbytes
from onnxopt.core.passes import SETTLED  # noqa: F401  (the key this pass sets)
from onnxopt.ir.util import moves_data, perm_of  # noqa: F401

_MAX_STEPS = 12  # ops one chain pushes through
# an option the pipeline sets for its last driver round, once this pass is done (rules that wait
# for it, such as transpose_to_reshape, then apply)
_MAX_ROUNDS = 16


# --------------------------------------------------------------------------------------------
# Cost: a polynomial in the parameter s (a dimension that is not a number)


@dataclasses.dataclass(frozen=True)
class Cost:
    """``sum(coef * s**degree)``; ordered as ``s`` grows."""

    terms: tuple = ()  # ((degree, coef), ...) sorted by degree, no zero coefficient

    @staticmethod
    def of(d: dict) -> Cost:
        return Cost(tuple(sorted((k, v) for k, v in d.items() if v)))

    def __add__(self, other: Cost) -> Cost:
        d = dict(self.terms)
        for k, v in other.terms:
            d[k] = d.get(k, 0) + v
        return Cost.of(d)

    def __neg__(self) -> Cost:
        return Cost(tuple((k, -v) for k, v in self.terms))

    def __sub__(self, other: Cost) -> Cost:
        return self + (-other)

    def sign(self) -> int:
        return 0 if not self.terms else (1 if self.terms[-1][1] > 0 else -1)

    def __lt__(self, other: Cost) -> bool:
        return (self - other).sign() < 0

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        return " + ".join(f"{v}" if k == 0 else f"{v}*s^{k}" if k > 1 else f"{v}*s" if k == 1 else f"{v} node(s)"
                          for k, v in reversed(self.terms))


ZERO = Cost()


def numel(shape: Sequence) -> Cost:
    n, degree = 1, 0
    for d in shape:
        if isinstance(d, int):
            n *= d
        else:
            degree += 1
    return Cost.of({degree: n})


def transpose_cost(in_shape: Sequence, perm: Sequence[int]) -> Cost:
    return numel(in_shape) if moves_data(in_shape, perm) else ZERO


NODE = Cost(((-1, 1),))  # one Transpose node: below any element count, it breaks ties between equal moves


def _plan_cost(in_shape: Sequence, perm: Sequence[int]) -> Cost:
    """What the planner counts for a Transpose: the elements it moves, then one node unless the
    perm is the identity (no node is made): of two plans that move as much, the one with fewer
    Transposes wins (a Transpose of size-1 dimensions only moves nothing but is still a node)."""
    return transpose_cost(in_shape, perm) + (ZERO if is_identity(perm) else NODE)


def inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def compose(first: Sequence[int], second: Sequence[int]) -> list[int]:
    """The perm of Transpose(Transpose(x, first), second)."""
    return [first[i] for i in second]


def is_identity(perm: Sequence[int]) -> bool:
    return list(perm) == list(range(len(perm)))


def pre_shape(t_shape: Sequence, perm: Sequence[int]) -> list:
    """The shape of x where Transpose(x, perm) has ``t_shape``."""
    out = [None] * len(perm)
    for a, p in enumerate(perm):
        out[p] = t_shape[a]
    return out


def _dims(value: ir.Value | None, opsets) -> list | None:
    shape = infer(value, opsets)
    if shape is None:
        return None
    return [d if isinstance(d, int) else (d.value if d.value is not None else object()) for d in shape]


def graph_cost(model: ir.Model) -> tuple[int, Cost, int | None]:
    """The main graph's Transposes: how many, the elements they move (a Cost), and the bytes they
    move per inference when every shape is static (else None)."""
    opsets = opsets_of(model)
    count, total, nbytes = 0, ZERO, 0
    for node in model.graph:
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        count += 1
        dims = _dims(node.inputs[0], opsets)
        perm = perm_of(node, None if dims is None else len(dims))
        if dims is None or perm is None:
            nbytes = None
            total += Cost.of({1: 1})
            continue
        c = transpose_cost(dims, perm)
        total += c
        x = node.inputs[0]
        if nbytes is not None:
            if any(k > 0 for k, _ in c.terms) or x.type is None:
                nbytes = None
            elif c.terms:
                nbytes += int(c.terms[0][1] * x.type.dtype.itemsize)
    return count, total, nbytes


def transpose_summary(model: ir.Model) -> dict:
    """:func:`graph_cost` for reports: ``{"count", "elements" (text, ``s`` a symbolic dimension),
    "bytes" (None where a moved shape is not static)}``."""
    count, elements, nbytes = graph_cost(model)
    return {"count": count, "elements": str(elements), "bytes": nbytes}


_FULL_INFERENCE_BYTES = 256 << 20  # report: onnx's shape inference on models with fewer weight bytes


def report_summary(model: ir.Model) -> dict:
    """:func:`transpose_summary` of ``model`` for optimize's report, ``model`` left as it is (the shape
    inference it needs must not change what the rules see or what is written): taken on the model
    onnx's inference returns (shape arithmetic propagated: it sees further) where its weights are under
    256 MiB, else on a clone with onnxopt's own inference. No clone is made where the model is serialized
    (serializing changes nothing), and none of a model without Transposes."""
    if not any(n.op_type == "Transpose" for n in model.graph):
        return {"count": 0, "elements": "0", "bytes": 0}
    weights = sum(tensor_nbytes(v.const_value) for v in model.graph.initializers.values()
                  if v.const_value is not None)
    inferred = None
    if weights < _FULL_INFERENCE_BYTES:
        try:
            inferred = ir.serde.deserialize_model(infer_proto(ir.serde.serialize_model(model)))  # (bounded)
        except Exception:  # noqa: BLE001 - the figures then come from onnxopt's own inference
            inferred = None
    return transpose_summary(inferred if inferred is not None else model.clone())


# --------------------------------------------------------------------------------------------
# What a push through one op does


@dataclasses.dataclass
class Step:
    """A push of a Transpose (perm ``p``) through ``node``, which reads it at ``carried`` (input
    indices). ``follow``: other inputs that are in the op's layout (transposed by ``inv(p_ext)``,
    after an Unsqueeze to rank ``rank`` if lower); ``arrays``: constant inputs replaced by these
    arrays; ``attrs``: attributes set; ``out_perms``: the perm of the Transpose after each output
    (in the new layout); ``cost``: the change in cost of the other inputs."""

    node: ir.Node
    carried: list[int]
    p_ext: list[int]
    rank: int
    follow: list[int] = dataclasses.field(default_factory=list)
    arrays: dict = dataclasses.field(default_factory=dict)
    attrs: dict = dataclasses.field(default_factory=dict)
    out_perms: list = dataclasses.field(default_factory=list)
    cost: Cost = ZERO
    others: dict = dataclasses.field(default_factory=dict)  # idx -> ("const", array) / ("compose", x, perm) / ("new", k)
    sources: list = dataclasses.field(default_factory=list)  # (Transpose read through a composed one, its cost)
    # the second node of a diamond (the carried value read by a unary op U and by this node, which
    # also reads U's output, as SiLU's Mul(x, Sigmoid(x))): inputs reading the value before U
    diamond: list[int] = dataclasses.field(default_factory=list)


UNARY = frozenset("""Abs Acos Acosh Asin Asinh Atan Atanh BitwiseNot Cast Ceil Celu Cos Cosh Elu Erf Exp Floor Gelu
HardSigmoid HardSwish Identity IsInf IsNaN LeakyRelu Log Mish Neg Not Reciprocal Relu Round Selu Sigmoid Sign Sin Sinh
Softplus Softsign Sqrt Tan Tanh ThresholdedRelu""".split())
BROADCAST = frozenset("""Add Sub Mul Div Pow Max Min Mean Sum Equal Less Greater LessOrEqual GreaterOrEqual And Or Xor
Mod BitShift BitwiseAnd BitwiseOr BitwiseXor Where PRelu""".split())
REDUCE = frozenset("""ReduceMean ReduceSum ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum
ReduceLogSumExp ReduceSumSquare""".split())
_AXES_INPUT_SINCE = {"ReduceSum": 13}  # the other Reduce ops take axes as an input from opset 18


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    if a is None:
        return default
    if a.is_ref():
        raise _Skip(f"attribute {name} is a reference")
    v = a.value
    return list(v) if isinstance(v, Sequence) and not isinstance(v, (str, bytes)) else v


class _Skip(Exception):
    pass


def _const(node: ir.Node, i: int) -> np.ndarray | None:
    """Input ``i`` of ``node`` as an array; None when absent; _Skip when not a constant."""
    if i >= len(node.inputs) or node.inputs[i] is None:
        return None
    t = constant_tensor(node.inputs[i])
    if t is None:
        raise _Skip(f"input {i} of {node.op_type} is not a constant")
    return t.numpy()


def _from_labels(old: list, new: list) -> list[int]:
    """q with Transpose(new_layout, q) == old_layout, given each layout's axis labels."""
    return [new.index(label) for label in old]


def _norm(a: int, r: int) -> int:
    if not -r <= a < r:
        raise _Skip("axis out of range")
    return a % r


def _remove_axes(p: list[int], axes: list[int]) -> list[int]:
    """The output perm after removing ``axes`` (of the transposed layout)."""
    r = len(p)
    old = [p[a] for a in range(r) if a not in axes]
    removed = {p[a] for a in axes}
    new = [l for l in range(r) if l not in removed]
    return _from_labels(old, new)


def _handler(node: ir.Node, carried: list[int], p: list[int], opsets) -> Step:
    """The push of a Transpose by ``p`` read at inputs ``carried`` through ``node``; _Skip when it
    cannot be pushed."""
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        raise _Skip(f"{node.domain}.{op}")
    opset = opset_of(opsets, "")
    r = len(p)
    step = Step(node, carried, p, r)
    only_first = carried == [0]
    if op in UNARY or op == "Clip" or op in ("QuantizeLinear", "DequantizeLinear"):
        if not only_first:
            raise _Skip(f"{op} reads the Transpose at another input")
        if op in ("QuantizeLinear", "DequantizeLinear"):
            if _attr(node, "block_size", 0):
                raise _Skip("blocked quantization")
            scale = node.inputs[1]
            sdims = _dims(scale, opsets)
            if sdims is None:
                raise _Skip("scale shape unknown")
            if len(sdims) == 1 and sdims[0] != 1:
                step.attrs["axis"] = p[_norm(_attr(node, "axis", 1), r)]
        step.out_perms = [p]
        return step
    if op in BROADCAST:
        if op == "PRelu" and not only_first:
            raise _Skip("PRelu reads the Transpose as its slope")
        ranks = []
        for i, v in enumerate(node.inputs):
            d = _dims(v, opsets)
            if d is None:
                raise _Skip(f"rank of input {i} unknown")
            ranks.append(len(d))
        rank = max(ranks)
        ext = list(range(rank - r)) + [rank - r + q for q in p]
        step.p_ext, step.rank = ext, rank
        step.follow = [i for i in range(len(node.inputs)) if i not in carried]
        step.out_perms = [ext]
        return step
    if op == "Concat":
        step.follow = [i for i in range(len(node.inputs)) if i not in carried]
        for i in step.follow:
            d = _dims(node.inputs[i], opsets)
            if d is None or len(d) != r:
                raise _Skip("Concat input of another rank")
        step.attrs["axis"] = p[_norm(_attr(node, "axis"), r)]
        step.out_perms = [p]
        return step
    if not only_first:
        raise _Skip(f"{op} reads the Transpose at input {carried}")
    if op == "Split":
        step.attrs["axis"] = p[_norm(_attr(node, "axis", 0), r)]
        step.out_perms = [p] * len(node.outputs)
        return step
    if op in REDUCE or op in ("ArgMax", "ArgMin"):
        keep = _attr(node, "keepdims", 1)
        if op in ("ArgMax", "ArgMin"):
            axes = [_norm(_attr(node, "axis", 0), r)]
            step.attrs["axis"] = p[axes[0]]
        elif opset >= _AXES_INPUT_SINCE.get(op, 18):
            arr = _const(node, 1)
            if arr is None or arr.size == 0:
                if arr is not None and _attr(node, "noop_with_empty_axes", 0):
                    step.out_perms = [p]
                    return step
                axes = list(range(r))
            else:
                axes = sorted({_norm(int(a), r) for a in arr.reshape(-1)})
                step.arrays[1] = np.array(sorted(p[a] for a in axes), dtype=np.int64)
        else:
            attr = _attr(node, "axes")
            axes = list(range(r)) if attr is None else sorted({_norm(int(a), r) for a in attr})
            if attr is not None:
                step.attrs["axes"] = sorted(p[a] for a in axes)
        step.out_perms = [p if keep else _remove_axes(p, axes)]
        return step
    if op in ("Softmax", "LogSoftmax", "Hardmax"):
        if opset < 13:
            raise _Skip(f"{op} before opset 13 flattens at its axis")
        step.attrs["axis"] = p[_norm(_attr(node, "axis", -1), r)]
        step.out_perms = [p]
        return step
    if op == "Gather":
        d = _dims(node.inputs[1], opsets)
        if d is None:
            raise _Skip("indices rank unknown")
        a = _norm(_attr(node, "axis", 0), r)
        idx = [("i", k) for k in range(len(d))]
        t = [p[j] for j in range(r)]
        old = t[:a] + idx + t[a + 1:]
        x = list(range(r))
        new = x[:p[a]] + idx + x[p[a] + 1:]
        step.attrs["axis"] = p[a]
        step.out_perms = [_from_labels(old, new)]
        return step
    if op == "Pad":
        if opset < 11:
            raise _Skip("Pad before opset 11")
        axes = _const(node, 3)
        if axes is not None:
            step.arrays[3] = np.array([p[_norm(int(a), r)] for a in axes.reshape(-1)], dtype=axes.dtype)
        else:
            pads = _const(node, 1)
            if pads is None or pads.size != 2 * r:
                raise _Skip("pads unknown")
            new = np.empty_like(pads.reshape(-1))
            for a in range(r):
                new[p[a]], new[r + p[a]] = pads.reshape(-1)[a], pads.reshape(-1)[r + a]
            step.arrays[1] = new
        step.out_perms = [p]
        return step
    if op == "Slice":
        if opset < 10:
            raise _Skip("Slice before opset 10")
        starts = _const(node, 1) if constant_tensor(node.inputs[1]) is not None else None
        axes = _const(node, 3)
        if axes is None:
            if starts is None:
                raise _Skip("Slice without axes or constant starts")
            axes = np.arange(starts.size, dtype=np.int64)
        new = np.array([p[_norm(int(a), r)] for a in axes.reshape(-1)], dtype=axes.dtype)
        step.arrays[3] = new
        step.out_perms = [p]
        return step
    if op in ("Squeeze", "Unsqueeze"):
        if opset >= 13:
            arr = _const(node, 1)
            axes = None if arr is None else [int(a) for a in arr.reshape(-1)]
        else:
            axes = _attr(node, "axes")
        if axes is None:
            raise _Skip(f"{op} without axes")
        if op == "Squeeze":
            axes = sorted({_norm(a, r) for a in axes})
            new_axes = sorted(p[a] for a in axes)
            q = _remove_axes(p, axes)
        else:
            n = r + len(axes)
            axes = sorted({_norm(a, n) for a in axes})
            new_axes = axes
            it_t, it_x = iter(p), iter(range(r))
            old = [("u", j) if j in axes else next(it_t) for j in range(n)]
            new = [("u", j) if j in axes else next(it_x) for j in range(n)]
            q = _from_labels(old, new)
        if opset >= 13:
            step.arrays[1] = np.array(new_axes, dtype=np.int64)
        else:
            step.attrs["axes"] = new_axes
        step.out_perms = [q]
        return step
    if op == "Resize":
        if opset < 13:
            raise _Skip("Resize before opset 13")
        if _attr(node, "axes") is not None:
            step.attrs["axes"] = [p[_norm(int(a), r)] for a in _attr(node, "axes")]
        else:
            for i, per in ((1, 2), (2, 1), (3, 1)):
                arr = _const(node, i)
                if arr is None or arr.size == 0:
                    continue
                flat = arr.reshape(-1)
                if flat.size != per * r:
                    raise _Skip("Resize input of another length")
                new = flat.copy()
                for k in range(per):
                    for a in range(r):
                        new[k * r + p[a]] = flat[k * r + a]
                step.arrays[i] = new
        step.out_perms = [p]
        return step
    if op == "Reshape":
        t = _dims(node.inputs[0], opsets)
        out = _dims(node.outputs[0], opsets)
        if t is None or out is None or not all(isinstance(d, int) for d in t) or \
                not all(isinstance(d, int) for d in out):
            raise _Skip("Reshape shapes not static")
        if 0 in t:
            raise _Skip("Reshape of an empty tensor")
        if [d for d in t if d != 1] != [d for d in out if d != 1]:
            splits = _merge_groups(out, t)  # each axis of t split into a run of out's
            if splits is not None:
                inv = inverse(p)
                old = [(a, k) for a, g in enumerate(splits) for k in range(len(g))]
                new = [(inv[l], k) for l in range(r) for k in range(len(splits[inv[l]]))]
                step.arrays[1] = np.array([out[splits[a][k]] for a, k in new], dtype=np.int64)
                step.out_perms = [_from_labels(old, new)]
                return step
            groups = _merge_groups(t, out)
            if groups is None:
                raise _Skip("Reshape does more than merge or split dimensions or insert or remove size-1 ones")
            for g in groups:
                xs = [p[a] for a in g]
                if xs != list(range(xs[0], xs[0] + len(xs))):
                    raise _Skip("Reshape merges dimensions that are not adjacent, in order, before the Transpose")
            order = sorted(range(len(groups)), key=lambda j: p[groups[j][0]])
            step.arrays[1] = np.array([out[j] for j in order], dtype=np.int64)
            step.out_perms = [_from_labels(list(range(len(out))), order)]
            return step
        labels = [p[a] for a in range(r) if t[a] != 1]  # the non-1 dims of t, by their x axis
        xs = sorted(labels)
        pre = pre_shape(t, p)
        new_shape, it, old, new = [], iter(xs), [], []
        it_old = iter(labels)
        for j, d in enumerate(out):
            if d == 1:
                new_shape.append(1)
                old.append(("o", j))
                new.append(("o", j))
            else:
                lab = next(it)
                new_shape.append(pre[lab])
                new.append(lab)
                old.append(next(it_old))
        step.arrays[1] = np.array(new_shape, dtype=np.int64)
        step.out_perms = [_from_labels(old, new)]
        return step
    raise _Skip(f"no push through {op}")


def _merge_groups(t: list[int], out: list[int]) -> list[list[int]] | None:
    """The axes of ``t`` each dimension of ``out`` merges (consecutive runs), when the Reshape
    only merges dimensions (no size-1 ones on either side); else None."""
    if 1 in t or 1 in out:
        return None
    groups, i = [], 0
    for d in out:
        g, prod = [], 1
        while prod < d and i < len(t):
            prod *= t[i]
            g.append(i)
            i += 1
        if prod != d or not g:
            return None
        groups.append(g)
    return groups if i == len(t) else None


def _existing_transpose(w: ir.Value, perm: list[int], graph, avoid) -> ir.Node | None:
    """A Transpose of ``w`` by ``perm`` the graph already has (not one of ``avoid``): reading it
    costs nothing (a residual branch read in both layouts)."""
    for r in _readers(w):
        if r.op_type == "Transpose" and r.domain in ("", "ai.onnx") and r.graph is graph and r not in avoid \
                and perm_of(r, len(perm)) == list(perm):
            return r
    return None


def _other_costs(step: Step, opsets, avoid=(), no_compose=()) -> Cost:
    """The cost change of bringing ``step.follow`` inputs into the new layout; fills step.others.
    ``avoid``: Transposes not to reuse (those the chain may remove); ``no_compose``: Transposes not
    to read through either (those the enclosing plan removes)."""
    node, inv = step.node, inverse(step.p_ext)
    total = ZERO
    for i in step.follow:
        w = node.inputs[i]
        if w is None:
            continue
        d = _dims(w, opsets)
        k = step.rank - len(d)
        tensor = constant_tensor(w)
        if tensor is not None:
            arr = tensor.numpy()
            step.others[i] = ("const", np.ascontiguousarray(np.transpose(arr.reshape([1] * k + list(arr.shape)), inv)))
            continue
        producer = w.producer()
        if k == 0 and producer is not None and producer.op_type == "Transpose" and producer.domain in ("", "ai.onnx") \
                and producer.graph is node.graph and producer not in no_compose:
            xd = _dims(producer.inputs[0], opsets)
            rperm = perm_of(producer, None if xd is None else len(xd))
            if xd is not None and rperm is not None:
                composed = compose(rperm, inv)
                total += _plan_cost(xd, composed)  # (the producer's cost goes if it dies: plan_chain)
                step.sources.append((producer, _plan_cost(xd, rperm)))
                step.others[i] = ("compose", producer.inputs[0], composed)
                continue
        same = _existing_transpose(w, inv, node.graph, avoid) if k == 0 else None
        if same is not None:
            step.others[i] = ("reuse", same)
            continue
        total += _plan_cost([1] * k + list(d), inv)
        step.others[i] = ("new", k)
    return total


# --------------------------------------------------------------------------------------------
# Planning a chain


@dataclasses.dataclass
class Plan:
    transpose: ir.Node | None  # None for a branch (it starts at the chain's carried value)
    steps: list[Step]
    delta: Cost
    merges: list = dataclasses.field(default_factory=list)  # (output index, Transpose reading it)
    # where the chain's carried value is read by several nodes: the chains pushed into some of
    # them (each a Plan without a transpose); the others keep reading the Transpose
    branches: list = dataclasses.field(default_factory=list)


def _readers(value: ir.Value) -> list[ir.Node]:
    seen: list[ir.Node] = []
    for node in value.consumers():
        if node not in seen:
            seen.append(node)
    return seen


def _sole_transpose_reader(y: ir.Value) -> ir.Node | None:
    if y.is_graph_output():
        return None
    readers = _readers(y)
    if len(readers) == 1 and readers[0].op_type == "Transpose" and readers[0].domain in ("", "ai.onnx") \
            and readers[0].graph is y.graph:
        return readers[0]
    return None


def _diamond(v: ir.Value, readers: list[ir.Node]) -> tuple[ir.Node, ir.Node] | None:
    """``(U, M)`` where ``v`` is read by exactly a unary element-wise ``U`` and by ``M``, and ``U``'s
    output only by ``M`` (SiLU's ``Mul(x, Sigmoid(x))``, ``x * HardSigmoid(x)``): the chain goes
    through both, as one element-wise op of ``v``."""
    if len(readers) != 2:
        return None
    for u, m in (readers, readers[::-1]):
        if u.op_type in UNARY and u.domain in ("", "ai.onnx") and len(u.outputs) == 1 and u.graph is m.graph \
                and not u.outputs[0].is_graph_output() and _readers(u.outputs[0]) == [m] \
                and m.op_type in BROADCAST and m.domain in ("", "ai.onnx"):
            return u, m
    return None


def plan_chain(t: ir.Node, opsets, max_steps: int = _MAX_STEPS) -> Plan | str:
    """The best prefix of a chain of pushes starting at Transpose ``t``, or why there is none. Where
    several nodes read ``t``, a chain starts at each of them (``t`` stays for the others unless the
    chain comes to read it through them all, as SiLU's Mul(x, Sigmoid(x)) does)."""
    readers = _readers(t.outputs[0])
    firsts = [None] if len(readers) <= 1 or t.outputs[0].is_graph_output() else \
        [r for r in readers if not (r.op_type == "Transpose" and r.domain in ("", "ai.onnx"))]
    best: Plan | str = "no reader to push into"
    reasons = []
    for first in firsts:
        plan = _walk(t, opsets, max_steps, first)
        if isinstance(plan, str):
            reasons.append(plan)
        elif isinstance(best, str) or plan.delta < best.delta:
            best = plan
    if isinstance(best, str):
        best = reasons[0] if reasons else best
    return best


_MAX_FORK_DEPTH = 2  # branches within branches
_MAX_FORK = 4  # readers a fork tries


def _plan_nodes(plan: Plan) -> set[ir.Node]:
    """The nodes a plan rewrites or removes (its steps, merged Transposes, branches)."""
    out = {st.node for st in plan.steps} | {z for _, z in plan.merges}
    for b in plan.branches:
        out |= _plan_nodes(b)
    return out


def _fork(v: ir.Value, shape: list, p: list[int], readers: list[ir.Node], is_transpose: list[bool], opsets,
          max_steps: int, depth: int, avoid: set) -> tuple[Cost, list[Plan]] | None:
    """The carried value ``v`` (in the transposed layout, its Transpose ``p`` not made yet) is read
    by several nodes: the chains pushed into them (:func:`_walk` from ``v``), and the cost of the
    Transpose that stays for the readers not pushed (none when every one is). Transposes among the
    readers are merged by the caller: with the chain's own (``avoid``), no branch reuses or
    composes with them. Branches are taken best first, none touching a node another takes (two
    reductions of ``v`` meeting at one Add). Returns ``(cost, branches)``, or None when no branch pays."""
    others = [r for r, tr in zip(readers, is_transpose) if not tr]
    if not others or len(others) > _MAX_FORK:
        return None
    avoid = set(avoid) | {r for r, tr in zip(readers, is_transpose) if tr}
    keep = _plan_cost(pre_shape(shape, p), p)
    plans = [_walk(None, opsets, max_steps, r, start=(v, shape, p), depth=depth + 1, avoid=avoid) for r in others]
    found, taken = [], set()
    for b in sorted((b for b in plans if isinstance(b, Plan)), key=lambda b: b.delta):
        nodes = _plan_nodes(b)
        if not nodes & taken:
            found.append(b)
            taken |= nodes
    found.sort(key=lambda b: others.index(b.steps[0].node))  # (the graph's order: the same output each time)
    paying = [b for b in found if b.delta.sign() < 0]
    best = None
    if paying:  # the paying branches; the Transpose stays for the rest
        best = (sum((b.delta for b in paying), ZERO) + (keep if len(paying) < len(others) else ZERO), paying)
    if len(found) == len(others):  # every branch, the Transpose gone
        every = sum((b.delta for b in found), ZERO)
        if best is None or every < best[0]:
            best = (every, found)
    return best


def _walk(t: ir.Node | None, opsets, max_steps: int, first: ir.Node | None, start=None, depth: int = 0,
          avoid: set = frozenset()) -> Plan | str:
    """The best prefix of the chain from Transpose ``t`` (through ``first`` where ``t`` has several
    readers); or, for a branch (``t`` None), from ``start = (v, shape, p)``: the carried value
    ``v``, its shape and the perm its Transpose would have, into its reader ``first``. ``avoid``:
    Transposes the enclosing plan removes, which the chain neither reuses nor composes with."""
    if t is not None:
        x, v = t.inputs[0], t.outputs[0]
        xd, td = _dims(x, opsets), _dims(v, opsets)
        if xd is None or td is None:
            return "shape unknown"
        p = perm_of(t, len(xd))
        if p is None or len(p) != len(xd):
            return "perm unknown"
        sources = {t: _plan_cost(xd, p)}  # Transposes that go once every reader is pushed
    else:
        v, td, p = start
        sources = {}
    graph = v.graph if v.producer() is None else v.producer().graph
    cum = ZERO  # the cost of the Transposes added so far, less those of the merged ones
    pushed: set[ir.Node] = set()
    reused: set[ir.Node] = set()  # Transposes the graph has that a step reads: they stay

    def dead() -> Cost:
        total = ZERO
        for node, cost in sources.items():
            out = node.outputs[0]
            if node not in reused and not out.is_graph_output() and all(r in pushed for r in _readers(out)):
                total += cost
        return total

    steps: list[Step] = []
    best: Plan | None = None
    shape = td  # the carried value's shape, in the transposed layout
    reason = "no reader to push into"
    forced = diamond_v = None
    for _ in range(max_steps):
        readers = _readers(v)
        is_transpose = [r.op_type == "Transpose" and r.domain in ("", "ai.onnx") and r.graph is graph
                        for r in readers]
        if forced is not None:  # the second node of a diamond
            o, forced = forced, None
        elif steps or first is None:
            pair = _diamond(v, readers) if not v.is_graph_output() and not any(is_transpose) else None
            if pair is not None:  # push through both, U now and the node reading both next
                o, forced, diamond_v = pair[0], pair[1], v
            elif v.is_graph_output() or len(readers) != 1 or is_transpose[0]:
                # the chain ends: the Transposes reading the carried one merge with it, and the
                # carried one stays for the other readers (a graph output among them), unless
                # chains pushed into them pay (a fork)
                if steps:
                    end, merges = cum - dead(), []
                    if v.is_graph_output() or not all(is_transpose):
                        end = end + _plan_cost(pre_shape(shape, p), p)
                    for r, tr in zip(readers, is_transpose):
                        if tr:
                            z = perm_of(r, len(p))
                            end = end + _plan_cost(pre_shape(shape, p), compose(p, z)) - _plan_cost(shape, z)
                            merges.append((0, r))
                    if best is None or end < best.delta:
                        best = Plan(t, list(steps), end, merges)
                    fork = None if v.is_graph_output() or depth >= _MAX_FORK_DEPTH else \
                        _fork(v, shape, p, readers, is_transpose, opsets, max_steps - len(steps), depth,
                              {*avoid, *sources, *pushed, *reused})
                    if fork is not None:
                        keep = _plan_cost(pre_shape(shape, p), p) if not all(is_transpose) else ZERO
                        forked = end - keep + fork[0]
                        if forked < best.delta:
                            best = Plan(t, list(steps), forked, merges, fork[1])
                reason = ("a graph output" if v.is_graph_output() else "read by several nodes" if len(readers) > 1
                          else "meets a Transpose" if readers else "not read")
                break
            else:
                o = readers[0]
        else:
            o = first
        if o.graph is not graph:
            reason = "read in a subgraph"
            break
        carried = [i for i, inp in enumerate(o.inputs)
                   if inp is v or (forced is None and diamond_v is not None and inp is diamond_v)]
        try:
            step = _handler(o, carried, p, opsets)
            step.cost = _other_costs(step, opsets, avoid={*sources, *pushed, *avoid}, no_compose=avoid)
        except _Skip as exc:
            reason = str(exc)
            break
        if forced is not None and step.out_perms != [p]:
            reason = f"{o.op_type} changes the layout"
            break
        if forced is None and diamond_v is not None:
            step.diamond = [i for i, inp in enumerate(o.inputs) if inp is not None and inp is diamond_v]
            diamond_v = None
        outs = []
        for y, q in zip(o.outputs, step.out_perms):
            yd = _dims(y, opsets)
            if yd is None or len(yd) != len(q):
                outs = None
                break
            outs.append((y, yd, q))
        if outs is None:
            reason = "output shape unknown"
            break
        cum = cum + step.cost
        steps.append(step)
        pushed.add(o)
        reused.update(how[1] for how in step.others.values() if how[0] == "reuse")
        for producer, cost in step.sources:
            sources.setdefault(producer, cost)
        end, merges = cum - dead(), []
        for k, (y, yd, q) in enumerate(outs):
            z = _sole_transpose_reader(y) if len(outs) > 1 else None
            if z is not None:
                zp = perm_of(z, len(q))
                end = end + _plan_cost(pre_shape(yd, q), compose(q, zp)) - _plan_cost(yd, zp)
                merges.append((k, z))
            else:
                end = end + _plan_cost(pre_shape(yd, q), q)
        if forced is None and (best is None or end < best.delta):  # (not between a diamond's two nodes)
            best = Plan(t, list(steps), end, merges)
        if len(outs) != 1:
            reason = "several outputs"
            break
        v, shape, p = outs[0][0], outs[0][1], outs[0][2]
    if best is None:
        return reason
    if best.delta.sign() >= 0:
        return f"no prefix lowers the cost (best {best.delta}; stopped: {reason})"
    return best


# --------------------------------------------------------------------------------------------
# Applying a plan


class _Apply:
    def __init__(self, model: ir.Model, namer: Callable[[str], str]):
        self.model = model
        self.graph = model.graph
        self.namer = namer
        self.opset = opset_of(opsets_of(model), "")
        self.new_nodes: list[ir.Node] = []
        self.lost: list[ir.Value] = []

    def _value(self, hint: str, like: ir.Value | None = None, shape=None) -> ir.Value:
        v = ir.Value(name=self.namer(hint))
        if like is not None and like.type is not None:
            v.type = like.type
        if shape is not None:
            v.shape = ir.Shape(shape)
        return v

    def _node(self, before: ir.Node, op: str, inputs, attrs=(), n_out=1, hint="transpose", outputs=None) -> ir.Node:
        name = self.namer(f"{hint}::transpose_push")
        outs = outputs or [self._value(f"{name}_out") for _ in range(n_out)]
        node = ir.Node("", op, inputs, attributes=list(attrs), outputs=outs, name=name)
        self.graph.insert_before(before, node)
        self.new_nodes.append(node)
        return node

    def _before(self, o: ir.Node) -> set[ir.Node]:
        """The nodes before ``o`` in the graph's order."""
        seen = set()
        for n in self.graph:
            if n is o:
                return seen
            seen.add(n)
        return seen

    def _const(self, array: np.ndarray, hint: str) -> ir.Value:
        tensor = ir.Tensor(np.ascontiguousarray(array))
        v = ir.Value(name=self.namer(hint), shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                     const_value=tensor)
        tensor.name = v.name
        self.graph.register_initializer(v)
        return v

    def transpose(self, before: ir.Node, x: ir.Value, perm: list[int], hint: str) -> ir.Value:
        if is_identity(perm):
            return x
        node = self._node(before, "Transpose", [x], [ir.AttrInt64s("perm", perm)], hint=hint)
        return node.outputs[0]

    def step(self, step: Step, pre: ir.Value, before_pre: ir.Value | None = None) -> list[ir.Value]:
        """Rewrite ``step.node`` to read ``pre`` (``before_pre`` at a diamond's inputs: the value the
        step before read); returns its new outputs (in the new layout), the old outputs
        redirected to Transposes of them."""
        o = step.node
        start = len(self.new_nodes)
        hint = (o.name or o.op_type).split("::")[0]
        inputs = list(o.inputs) + [None] * (max([*step.arrays, 0]) + 1 - len(o.inputs))
        for i in step.carried:
            inputs[i] = before_pre if i in step.diamond else pre
        for i, how in step.others.items():
            w = o.inputs[i]
            if how[0] == "const":
                inputs[i] = self._const(how[1], f"{w.name or 'const'}_t")
            elif how[0] == "compose":
                inputs[i] = self.transpose(o, how[1], how[2], hint)
            elif how[0] == "reuse":  # (moved before o where it comes later: its input is o's)
                same = how[1]
                if same not in self._before(o):
                    self.graph.remove(same)
                    self.graph.insert_before(o, same)
                inputs[i] = same.outputs[0]
            else:
                k = how[1]
                if k:
                    if self.opset >= 13:
                        axes = self._const(np.arange(k, dtype=np.int64), "unsqueeze_axes")
                        w = self._node(o, "Unsqueeze", [w, axes], hint=hint).outputs[0]
                    else:
                        w = self._node(o, "Unsqueeze", [w], [ir.AttrInt64s("axes", list(range(k)))],
                                       hint=hint).outputs[0]
                inputs[i] = self.transpose(o, w, inverse(step.p_ext), hint)
        for i, array in step.arrays.items():
            inputs[i] = self._const(array, f"{hint}_{i}")
        attrs = {a.name: a for a in o.attributes.values()}
        for k, val in step.attrs.items():
            attrs[k] = ir.AttrInt64(k, val) if isinstance(val, int) else ir.AttrInt64s(k, list(val))
        outs = [self._value(f"{y.name or hint}_pre", y) for y in o.outputs]
        for y, q, new in zip(o.outputs, step.out_perms, outs):
            if y.shape is not None:
                new.shape = ir.Shape(pre_shape(list(y.shape), q))
        node = ir.Node(o.domain, o.op_type, inputs, attributes=list(attrs.values()), outputs=outs,
                       name=self.namer(f"{hint}::transpose_push"), overload=o.overload)
        self.graph.insert_before(o, node)
        self.new_nodes.append(node)
        for y, q, new in zip(o.outputs, step.out_perms, outs):
            t = self.transpose(o, new, q, hint)
            if t is not new:
                t.type, t.shape = y.type, y.shape
                if DECLARED in y.meta:
                    t.meta[DECLARED] = y.meta[DECLARED]
            redirect(y, t)
        replaced = json.dumps([o.name or o.op_type])
        for made in self.new_nodes[start:]:
            inherit_metadata(made, [o])
            made.metadata_props[RULE_KEY] = "transpose_optimization"
            made.metadata_props[REPLACED_KEY] = replaced
        self.lost += [v for v in o.inputs if v is not None]
        self.graph.remove(o, safe=True)
        return outs

    def plan(self, plan: Plan, pre: ir.Value | None = None) -> None:
        """Apply ``plan`` (a branch: from ``pre``, the carried value's new producer's output)."""
        pre = before = plan.transpose.inputs[0] if plan.transpose is not None else pre
        for step in plan.steps:
            outs = self.step(step, pre, before)
            before, pre = pre, outs[0]
        for k, z in plan.merges:
            pre = outs[k]
            q = plan.steps[-1].out_perms[k]
            composed = compose(q, perm_of(z, len(q)))
            y = z.outputs[0]
            t = self.transpose(z, pre, composed, (z.name or "transpose").split("::")[0])
            if t is pre and (y.is_graph_output() and not _can_take(pre)):
                t = self._node(z, "Identity", [pre], hint=z.name or "identity").outputs[0]
            if t is not pre and t.producer() is not None and t.producer() in self.new_nodes:
                made = t.producer()
                inherit_metadata(made, [z])
                made.metadata_props[RULE_KEY] = "transpose_optimization"
                made.metadata_props[REPLACED_KEY] = json.dumps([z.name or z.op_type])
            redirect(y, t)
            self.lost += [v for v in z.inputs if v is not None]
            self.graph.remove(z, safe=True)
        for branch in plan.branches:  # (each reads the last step's output in the new layout)
            self.plan(branch, outs[0])


def _can_take(v: ir.Value) -> bool:
    return not (v.is_graph_output() or v.is_graph_input() or v.is_initializer())


def _remove_dead_transposes(graph: ir.Graph, values: Sequence[ir.Value]) -> int:
    removed = 0
    stack = [v.producer() for v in values if v is not None and v.producer() is not None]
    while stack:
        node = stack.pop()
        if node.graph is not graph:
            continue
        if any(use_count(o) or o.is_graph_output() for o in node.outputs):
            continue
        if node.op_type not in ("Transpose", "Unsqueeze", "Identity"):
            continue
        inputs = [v for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        removed += 1
        stack += [v.producer() for v in inputs if v.producer() is not None]
    return removed


def optimize_transposes(model: ir.Model, touched=None) -> int:
    """The pass: commit chains of pushes that lower the cost, until none does; returns how many
    chains were committed."""
    from onnxopt.core.pattern import Namer

    opsets = opsets_of(model)
    graph = model.graph
    committed = 0
    namer = Namer(model)
    for _ in range(_MAX_ROUNDS):
        done = 0
        for node in list(graph):
            if node.graph is not graph or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
                continue
            plan = plan_chain(node, opsets)
            if isinstance(plan, str):
                continue
            apply = _Apply(model, namer)
            apply.plan(plan)
            _remove_dead_transposes(graph, apply.lost + [plan.transpose.outputs[0]])
            if plan.transpose.graph is graph and not any(use_count(o) or o.is_graph_output()
                                                         for o in plan.transpose.outputs):
                graph.remove(plan.transpose, safe=True)
            if touched is not None:
                readers = [r for n in apply.new_nodes if n.graph is graph for o in n.outputs for r in o.consumers()]
                touched([n for n in apply.new_nodes if n.graph is graph] + readers, apply.lost)
            done += 1
        committed += done
        if not done:
            break
    return committed
