"""Peak activation memory by liveness, and a node order that lowers it.

:func:`peak` walks the main graph's nodes in their order: a node's outputs are allocated when it
runs and freed after the last node that reads them (a node with subgraphs reads what its bodies
read from outside); graph outputs live to the end. Graph inputs are counted, alive from the start
to the end (the caller owns them; the runtime cannot free them); their total is ``inputs_bytes``.
Initializers and Constant nodes' tensors are weights, counted apart (``weights_bytes``) and never in
the curve (a runtime holds them for the session's life; onnxruntime makes Constants initializers). The figure at
a node is what is alive while it runs: its inputs and its outputs together. A node with subgraphs
(If, Loop, Scan) is charged, while it runs, every value its bodies compute, all at once (every
branch of an If, one iteration of a Loop): conservative.

Sizes come from onnx's shape inference (data propagation on; ``onnxopt.ir.shapes.infer_model``, weights
not serialized). A dimension inference leaves symbolic (or a value it gives no shape, a string
tensor) makes the value's size unknown: it is listed in ``unknown`` and counted as 0, and the peak
is then a lower bound (``lower_bound``). ``input_shapes`` (``onnxopt.ir.input_shapes``'s grammar) fixes
symbols first. Element sizes are ``bitwidth`` bits (sub-byte types packed: ``ceil(n * bits / 8)``).

:func:`reorder` (the pipeline's last pass, ``memory_reordering``) changes only the order of the
main graph's nodes, never a node: among topological orders it tries a greedy list scheduler that
runs next the ready node that frees the most for what it allocates (ties: the original order), and
a depth-first order that finishes one operand before starting the next (Sethi-Ullman's order for
trees, taken on the DAG), and keeps the one with the lowest peak only when it is strictly below the
current order's. A graph with a node output of unknown size is left alone (fix the symbols with
``input_shapes`` to have it reordered).

In a pipeline, the input is inferred once, for the baseline (``baseline``: from the ModelProto the
file was parsed into where the model is as read, else serialized without its weights); after the
rewrites the passes take those types again for every value that is the tensor it was (``_carried``:
the same object, or a replacement that took its name), type the few values a rewrite made by onnx's
inference of their producer alone (``_infer_new``: a static shape is a fact), and infer the graph
again only where that leaves a size open or the run shapes changed. A symbolic model is sized at the run shapes fixed in
place and restored after (``_at_shapes``), not on a copy; the recomputation pass that changes
nothing and the reordering pass share one Liveness (``_analysed``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import onnx
import onnx_ir as ir

from onnxopt.ir import io
from onnxopt.errors import UsageError
from onnxopt.ir.input_shapes import fix, normalize
from onnxopt.ir.util import SAME_AS_KEY, graphs
from onnxopt.transforms.liveness import (Liveness, Sizes, inferred_types, onnxruntime_graph, onnxruntime_order,
                                         plan_shapes, reorder as _reorder, result)
from onnxopt.ir.shapes import infer_proto, light_proto, light_source, symbolic_infer


def _as_ir(model) -> ir.Model:
    """``model`` itself when it is an onnx_ir.Model (not to be changed), else a new one."""
    if isinstance(model, ir.Model):
        return model
    if isinstance(model, onnx.ModelProto):
        return io.to_ir(model)
    if isinstance(model, (str, os.PathLike)):
        return io.load(model, check=False).model
    raise UsageError(f"memory.peak takes a path, an onnx.ModelProto or an onnx_ir.Model, not {type(model).__name__}")


def peak(model, input_shapes=None, *, curve: bool = True, order: str = "graph") -> dict:
    """Peak activation memory of ``model`` (a path, onnx.ModelProto or onnx_ir.Model) in its node
    order: ``peak_bytes``, ``peak_at`` (node index and name), ``alive_at_peak`` ([value, bytes],
    largest first), ``curve`` (bytes alive while each node runs), ``onnxruntime_peak_bytes`` (the
    peak in the order onnxruntime runs the nodes in, whatever ``order``), ``weights_bytes``,
    ``inputs_bytes`` (counted in every figure), ``unknown`` (values of unknown or symbolic size,
    counted as 0) and ``lower_bound`` (some are). JSON-ready; the same model gives the same dict.
    ``order``: "graph" (the nodes' order in the model) or "onnxruntime": the graph onnxruntime's CPU
    session runs (ops it has no CPU kernel for but ONNX defines as functions, HardSwish or CastLike,
    inlined: ``onnxopt.transforms.liveness.onnxruntime_graph``; Constant nodes' values are weights), in the
    order it runs the nodes (``onnxopt.transforms.liveness.onnxruntime_order``), with the buffers its
    allocation plan shares (views, activations in place, and released buffers taken again for
    values of the same shape as its planner knows it, which keeps them allocated in between; its
    planner's shapes: onnx's inference without data propagation on the model as given, before
    ``input_shapes``, names inference invents for unknown dimensions not being names) and the
    working memory its kernels allocate (``onnxopt.transforms.liveness.kernel_scratch``: Where's two
    selections, a Softmax's transposes, a ConvTranspose's columns); ``peak_at``'s index is then a
    step of that order. ``onnxruntime_peak_bytes`` in results of the graph order leaves the reuse
    and the inlining out (they need a second shape inference)."""
    if order not in ("graph", "onnxruntime"):
        raise UsageError(f"memory.peak: order {order!r}: choose graph or onnxruntime")
    return _peak(model, input_shapes, curve, order, _infer)


def _peak(model, input_shapes, curve: bool, order: str, infer) -> dict:
    planned, late = None, frozenset()
    m = _as_ir(model)
    if order == "onnxruntime":
        # the graph its session runs (function bodies inlined), and what its planner knows of it: the
        # model as given, inputs as declared
        m, late = onnxruntime_graph(m)
        planned = plan_shapes(ir.serde.serialize_model(m))
    with _at_shapes(m, input_shapes):  # (the caller's model left as it was)
        g = Liveness(m, Sizes(m, infer), planned, late)
        steps = range(len(g.nodes)) if order == "graph" else onnxruntime_order(g)
        return result(g, steps, curve=curve, runtime=order == "onnxruntime")


@contextlib.contextmanager
def _at_shapes(model: ir.Model, shapes):
    """For the duration, ``model``'s inputs fixed to ``shapes`` (``onnxopt.ir.input_shapes.fix``, not
    refined: an inference follows), its values' shapes as they were afterwards (fix changes nothing
    else): what a copy fixed at those shapes would be, without the copy."""
    if not shapes:
        yield model
        return
    kept = [(v, v.shape) for g in graphs(model) for v in (*g.inputs, *g.outputs, *(o for n in g for o in n.outputs))]
    try:
        fix(model, normalize(shapes), refine=False)
        yield model
    finally:
        for value, shape in kept:
            if value.shape is not shape:
                value.shape = shape


def reorder(model: ir.Model, touched=None) -> int:
    """The ``memory_reordering`` pass: ``onnxopt.transforms.liveness.reorder`` with onnx's shape inference
    (weights not serialized; onnxruntime's symbolic inference where onnx's leaves sizes open), inputs
    with symbolic dimensions taken at the shapes the verifier runs them at (``run_shapes``: the first
    dimension 1, others 16); returns 1 when the order changed."""
    return _reorder(model, _sized_once, _analysed(model))


def report_peak(model: ir.Model) -> dict:
    """:func:`peak` of ``model`` without the curve, at the shapes the verifier runs it at where its
    inputs have symbolic dimensions (the first 1, others 16, a symbol the same everywhere), those
    recorded as ``at``: optimize's report's figure (the model is left as it is)."""
    from onnxopt.ir.input_shapes import symbolic_run_shapes

    return _peak_at(model, symbolic_run_shapes(model), _infer)


def _peak_at(model: ir.Model, shapes: dict, infer) -> dict:
    """:func:`report_peak`'s figure at ``shapes`` (the run shapes; empty for static inputs), sized by ``infer``."""
    result = _peak(model, shapes or None, False, "graph", infer)
    return {**result, "at": shapes} if shapes else result


def baseline(model: ir.Model) -> None:
    """Record ``model``'s :func:`report_peak` (as the pipeline receives it) for the
    ``memory_recomputation`` pass, and for optimize's report as its "before"; and the types its
    inference gave, with the values they are of, for the passes after the rewrites
    (:func:`_carried`)."""
    from onnxopt.ir.input_shapes import symbolic_run_shapes
    from onnxopt.transforms.recompute import BASELINE_KEY, CARRIED_KEY

    shapes = symbolic_run_shapes(model)
    light = None if shapes else light_source(model)  # (the proto read, where the model is as read)
    inferred = []

    def infer(m: ir.Model) -> dict:
        inferred.append(inferred_types(_infer(m, light if m is model else None)))
        return inferred[-1]

    model.graph.meta[BASELINE_KEY] = _peak_at(model, shapes, infer)
    if inferred:
        values = {v.name: v for g in graphs(model) for v in (*g.inputs, *(o for n in g for o in n.outputs)) if v.name}
        model.graph.meta[CARRIED_KEY] = (shapes, inferred[-1], values)


def recompute(model: ir.Model, touched=None) -> int:
    """The ``memory_recomputation`` pass (``onnxopt.transforms.recompute``), sized as :func:`reorder` sizes."""
    from onnxopt.transforms.recompute import recompute as _recompute

    return _recompute(model, _sized_once, _analysed(model))


def _sized_once(model: ir.Model) -> dict[str, onnx.TypeProto] | onnx.ModelProto:
    """:func:`_sized`, taken again from ``model.graph.meta`` while the graph's nodes are the same
    objects in the same order (the two memory passes run back to back: where the first changed
    nothing, the second needs no second inference). The pipeline drops the entry when it ends."""
    from onnxopt.transforms.recompute import SIZES_KEY

    cached = _cached(model)
    if cached is not None:
        return cached[1]
    got = _carried(model)
    if got is None:
        got = _sized(model)
    model.graph.meta[SIZES_KEY] = [tuple(model.graph), got, None]
    return got


def _cached(model: ir.Model) -> list | None:
    """The memory passes' entry ``[nodes, types, Liveness or None]`` while the graph's nodes are those
    objects in that order (nothing in between changes a node otherwise)."""
    from onnxopt.transforms.recompute import SIZES_KEY

    cached = model.graph.meta.get(SIZES_KEY)
    if cached is None:
        return None
    seen = cached[0]
    if len(seen) != len(model.graph) or not all(a is b for a, b in zip(seen, model.graph)):
        return None
    return cached


def _analysed(model: ir.Model) -> Liveness:
    """``model``'s Liveness sized by :func:`_sized_once`, built once while its nodes stay the same
    (the recomputation pass that changes nothing and the reordering pass share it, and the peaks it
    simulated)."""
    _sized_once(model)
    cached = _cached(model)
    if cached[2] is None:
        cached[2] = Liveness(model, Sizes(model, _sized_once))
    return cached[2]


def _carried(model: ir.Model) -> dict | None:
    """The types the baseline's inference gave (``baseline``), for every value the memory passes size
    that is the tensor it was then: the same object under the same name, or a value that replaced it
    and took its name (``onnxopt.ir.util.redirect``); None (infer again) unless that sizes them all
    and the verifier's run shapes are the baseline's. Rewrites keep what a value is, so its type and
    shape hold: a pipeline whose rewrites made no value of their own needs no second inference."""
    from onnxopt.ir.input_shapes import symbolic_run_shapes
    from onnxopt.transforms.recompute import CARRIED_KEY

    carried = model.graph.meta.get(CARRIED_KEY)
    if carried is None:
        return None
    shapes, types, values = carried
    if (symbolic_run_shapes(model) or {}) != (shapes or {}):
        return None
    kept: dict[str, onnx.TypeProto] = {}
    needed: list[ir.Value] = []
    for g in graphs(model):  # (what Liveness sizes: the main graph's inputs, every node's outputs)
        for v in (*(g.inputs if g is model.graph else ()), *(o for n in g for o in n.outputs)):
            if v.is_initializer():
                continue
            needed.append(v)
            name = v.name
            if name in types and (values.get(name) is v or v.meta.get(SAME_AS_KEY) == name):
                kept[name] = types[name]
    sizes = Sizes(model, lambda _: kept)
    missing = [v for v in needed if sizes(v) is None]
    if missing:  # (a value sized already stays so: only these are sized again)
        if not _infer_new(model, missing, kept):
            return None
        sizes = Sizes(model, lambda _: kept)
        if any(sizes(v) is None for v in missing):
            return None
    return kept


_LOCAL_LIMIT = 64  # values a rewrite made that are sized node by node (more: one inference of the graph)


def _infer_new(model: ir.Model, missing: list[ir.Value], kept: dict[str, onnx.TypeProto]) -> bool:
    """Type the few values the rewrites made (``missing``, main-graph node outputs) by onnx's inference
    of their producer alone, from the carried types of its inputs (and the data of its small
    constant inputs, as the light proto keeps them); True where every one comes out with a static
    shape (a fact, whatever inference of the whole graph would add), else False (infer the graph)."""
    from onnxopt.ir.shapes import INFER_DATA_LIMIT, opsets_of, tensor_nbytes
    from onnxopt.ir.util import STANDARD_DOMAINS, constant_tensor, subgraphs

    if len(missing) > _LOCAL_LIMIT:
        return False
    graph = model.graph
    position = {node: k for k, node in enumerate(graph)}
    opsets = opsets_of(model)
    imports = [onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]
    for value in sorted(missing, key=lambda v: position.get(v.producer(), -1)):
        if value.name in kept:
            continue
        node = value.producer()
        if node is None or node not in position or node.domain not in STANDARD_DOMAINS \
                or next(subgraphs(node), None) is not None:
            return False
        types, data = {}, {}
        for inp in node.inputs:
            if inp is None or not inp.name:
                continue
            tensor = constant_tensor(inp)
            if inp.name in kept:
                types[inp.name] = kept[inp.name]
            elif tensor is not None:
                types[inp.name] = onnx.helper.make_tensor_type_proto(tensor.dtype.value, list(tensor.shape.numpy()))
            else:
                return False
            if tensor is not None and tensor_nbytes(tensor) <= INFER_DATA_LIMIT:  # (as the light proto keeps it)
                data[inp.name] = ir.serde.serialize_tensor(tensor)
        try:
            schema = onnx.defs.get_schema(node.op_type, opsets.get("", 1), "")
            out = onnx.shape_inference.infer_node_outputs(schema, ir.serde.serialize_node(node), types, data,
                                                          opset_imports=imports, ir_version=model.ir_version)
        except Exception:  # noqa: BLE001 - no schema, or inference refuses it: infer the graph instead
            return False
        got = out.get(value.name)
        if got is None or not got.tensor_type.elem_type or not got.tensor_type.HasField("shape") or not all(
                d.HasField("dim_value") for d in got.tensor_type.shape.dim):
            return False
        kept[value.name] = got
    return True


def _sized(model: ir.Model) -> onnx.ModelProto:
    """Shapes for ``model``'s values by name, symbolic inputs at the verifier's run shapes (the model is
    not changed)."""
    from onnxopt.ir.input_shapes import symbolic_run_shapes

    with _at_shapes(model, symbolic_run_shapes(model)):
        return _infer(model)


def _infer(model: ir.Model, light: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """onnx's shape inference (as ``onnxopt.ir.shapes.infer_model``), and onnxruntime's symbolic inference where onnx's leaves
    a node output's size open (exported shape arithmetic, a symbolic dimension) and it knows more;
    ``light``: ``model``'s :func:`onnxopt.ir.shapes.light_proto`, where the caller has it."""
    light = light if light is not None else light_proto(model)
    proto = infer_proto(light)
    names = {o.name for n in model.graph for o in n.outputs if o.name}
    sized = _sized_names(proto, names)
    if not names <= sized:
        deeper = symbolic_infer(light)  # (the weights left out: it copies the model it is given)
        if deeper is not None and len(_sized_names(deeper, names)) > len(sized):
            return deeper
    return proto


def _sized_names(proto: onnx.ModelProto, among: set[str]) -> set[str]:
    """The values of ``among`` whose every dimension a shape inference made concrete."""
    return {vi.name for field in (proto.graph.value_info, proto.graph.output) for vi in field if vi.name in among
            and vi.type.tensor_type.HasField("shape")
            and all(d.HasField("dim_value") and d.dim_value >= 0 for d in vi.type.tensor_type.shape.dim)}


def without_curve(peak_result: Mapping) -> dict:
    return {k: v for k, v in peak_result.items() if k != "curve"}


__all__ = ["peak", "reorder", "report_peak", "without_curve"]
