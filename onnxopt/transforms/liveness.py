"""Liveness of the main graph's values over a node order, and orders that lower its peak: the
core of ``onnxopt.transforms.memory`` (which documents the model), apart so that the pass table
(``onnxopt.library.passes``) can run :func:`reorder` without an import circle. Sizes come from a model
with onnx's inferred types (``infer``: a function giving the ModelProto), then from what the model
declares."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx.inliner
import onnx_ir as ir

from onnxopt.ir.io import proto_graphs, to_ir
from onnxopt.ir.kernels import kernel_defs
from onnxopt.ir.shapes import tensor_nbytes

_UNKNOWN = None
# onnxruntime's CPU kernels whose output is a view of input 0 (KernelDefBuilder().Alias(0, 0)), and
# those that may write output 0 into input 0's buffer (MayInplace(0, 0)): the unary activations, and
# Softmax and LogSoftmax of float (softmax.cc; its double kernels do not)
_VIEWS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
_IN_PLACE = frozenset({"Relu", "LeakyRelu", "Sigmoid", "Tanh", "Clip", "Elu", "Selu", "HardSigmoid", "Softplus",
                       "Softsign", "ThresholdedRelu", "Softmax", "LogSoftmax"})
_IN_PLACE_FLOAT_ONLY = frozenset({"Softmax", "LogSoftmax"})


def _bytes_of(dtype: int, dims) -> int | None:
    if dtype in (0, onnx.TensorProto.STRING) or dims is None:
        return _UNKNOWN
    n = 1
    for d in dims:
        if not isinstance(d, int) or d < 0:
            return _UNKNOWN
        n *= d
    try:
        bits = ir.DataType(dtype).bitwidth
    except (ValueError, TypeError):
        return _UNKNOWN
    return (n * bits + 7) // 8


def _proto_dims(tp: onnx.TypeProto):
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return 0, None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tp.tensor_type.shape.dim]
    return tp.tensor_type.elem_type, dims


def _ir_dims(value: ir.Value):
    if value.type is None or value.shape is None or not isinstance(value.type, ir.TensorType):
        return 0, None
    return value.type.dtype.value, [d if isinstance(d, int) else None for d in value.shape]


class _Inferred(dict):
    """name -> (element type, dims) of the inferred types, each read from its TypeProto when first asked
    for (a model's weights are declared too, and most are never asked for)."""

    def __init__(self, types: dict[str, onnx.TypeProto]):
        super().__init__()
        self._types = types

    def __contains__(self, name) -> bool:
        return name in self._types

    def __missing__(self, name):
        dims = _proto_dims(self._types[name])
        self[name] = dims
        return dims

    def get(self, name, default=None):
        return self[name] if name in self._types else default


def inferred_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """The types ``proto`` declares (an inference's result), by value name: the first declaration
    (inputs, outputs, values; the main graph's, then its subgraphs')."""
    types: dict[str, onnx.TypeProto] = {}
    for g in proto_graphs(proto.graph):
        for field in (g.input, g.output, g.value_info):
            for info in field:
                name = info.name
                if name and name not in types:
                    types[name] = info.type
    return types


class Sizes:
    """Bytes of every value of ``model`` (None where unknown), from onnx's shape inference, then
    from what the model declares."""

    def __init__(self, model: ir.Model, infer: Callable[[ir.Model], onnx.ModelProto | dict[str, onnx.TypeProto]]):
        try:
            got = infer(model)  # (a ModelProto inference gave, or the types by name already read from one)
        except Exception:  # noqa: BLE001 - inference refusing the model: what it declares is all we know
            got = None
        types = got if isinstance(got, dict) else inferred_types(got) if got is not None else {}
        self._types = types
        self._inferred = _Inferred(types)
        self._cache: dict[ir.Value, int | None] = {}

    def dtype(self, value: ir.Value) -> int:
        """``value``'s element type (onnx's number; 0 where unknown)."""
        dtype = _ir_dims(value)[0]
        return dtype or self._inferred.get(value.name, (0, None))[0]

    def dims(self, value: ir.Value) -> tuple[int, list[int]] | None:
        """(element type, dimensions) of ``value`` where every dimension is a known number, else None."""
        dtype, dims = _ir_dims(value)
        if _bytes_of(dtype, dims) is None and value.name in self._inferred:
            dtype, dims = self._inferred[value.name]
        return None if _bytes_of(dtype, dims) is None else (dtype, dims)

    def __call__(self, value: ir.Value) -> int | None:
        got = self._cache.get(value, -1)
        if got != -1:
            return got
        size = _bytes_of(*_ir_dims(value))
        if size is None and value.name in self._inferred:
            size = _bytes_of(*self._inferred[value.name])
        self._cache[value] = size
        return size


def _symbols(proto: onnx.ModelProto) -> set[str]:
    """The dimension names ``proto`` declares (inputs, outputs and values of every graph)."""
    return {d.dim_param for g in proto_graphs(proto.graph) for info in (*g.input, *g.output, *g.value_info)
            if info.type.HasField("tensor_type") for d in info.type.tensor_type.shape.dim if d.dim_param}


def plan_shapes(proto: onnx.ModelProto) -> dict[str, tuple]:
    """The shapes onnxruntime's allocation planner knows of ``proto``'s main-graph values, as it
    infers them at session creation: onnx's shape inference without data propagation, the inputs'
    dimensions as declared; per value, (element bits, dims) with symbols as names. Values with no
    shape, or a dimension with neither number nor name, are left out (its planner, ``SameShape``,
    matches an unknown dimension only by a name both share, so it reuses no buffer for them). A
    name onnx's inference invents for a dimension it cannot determine (``unk__12``: a Reshape to a
    shape computed at run time) is no name: onnxruntime's inference, node by node, invents none
    (bert-legacy: no buffer of its layers is reused in its run). Empty where inference refuses
    the model."""
    declared = _symbols(proto)
    try:
        proto = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=False)
    except Exception:  # noqa: BLE001 - inference refusing the model: the planner reuses nothing we know of
        return {}
    out = {}
    for info in (*proto.graph.input, *proto.graph.output, *proto.graph.value_info):
        tt = info.type.tensor_type if info.type.HasField("tensor_type") else None
        if tt is None or not tt.HasField("shape") or tt.elem_type in (0, onnx.TensorProto.STRING):
            continue
        dims = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif d.dim_param and d.dim_param in declared:
                dims.append(d.dim_param)
            else:
                break
        else:
            if dims:
                out[info.name] = (ir.DataType(tt.elem_type).bitwidth, tuple(dims))
    return out


def _inlined_ops(model: ir.Model) -> list[str]:
    """The ONNX-domain ops of ``model``'s nodes that onnxruntime's CPU session replaces by their
    function body: no CPU kernel registered for the node's version of the op, and ONNX defines it
    as a function (HardSwish, CastLike, Mish, ...). Empty where onnxruntime cannot tell its kernels."""
    kernels = kernel_defs()
    if kernels is None:
        return []
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if opset is None:
        return []
    cpu: dict[str, list[tuple[int, int]]] = {}
    for op, domain, lo, hi, provider, _ in kernels:
        if domain == "" and provider == "CPUExecutionProvider":
            cpu.setdefault(op, []).append((lo, hi))
    ops = []
    for op in sorted({n.op_type for n in model.graph.all_nodes() if n.domain in ("", "ai.onnx")}):
        try:
            schema = onnx.defs.get_schema(op, opset, "")
        except onnx.defs.SchemaError:
            continue
        if (schema.has_function or schema.has_context_dependent_function) and not any(
                lo <= schema.since_version <= hi for lo, hi in cpu.get(op, ())):
            ops.append(op)
    return ops


def onnxruntime_graph(model: ir.Model) -> tuple[ir.Model, frozenset[int]]:
    """``model`` as onnxruntime's CPU session runs it: a node with no CPU kernel whose op ONNX
    defines as a function is replaced, at session creation, by the function's nodes
    (``graph_partitioner.cc``: ``InlineNodes``, every such node in node order, then
    ``Graph::InlineFunction``), which are numbered after every node of the file (its profile shows
    HardSwish run as HardSigmoid and Mul of node indices past the file's last). Their values are
    allocated like any other: HardSwish(x) = x * HardSigmoid(x) holds x, the HardSigmoid and the
    product at once, where one HardSwish output was counted. Returns ``model`` itself and no
    positions when no node is inlined; else a new model (onnx's inliner, each body in place of its
    node) and the positions of the inlined nodes, which onnxruntime numbers last."""
    ops = _inlined_ops(model)
    if not ops:
        return model, frozenset()
    def replaced(node: ir.Node) -> bool:
        return node.domain in ("", "ai.onnx") and node.op_type in ops

    proto = onnx.inliner.inline_selected_functions(
        ir.serde.serialize_model(model), [(domain, op) for op in ops for domain in ("", "ai.onnx")],
        inline_schema_functions=True)
    inlined = to_ir(proto, copy=False)
    kept = {n.outputs[0].name for n in model.graph if n.outputs and not replaced(n)}
    late = frozenset(i for i, n in enumerate(inlined.graph) if not (n.outputs and n.outputs[0].name in kept))
    _name_bodies(list(model.graph), list(inlined.graph), replaced)
    return inlined, late


def _name_bodies(nodes: list[ir.Node], expanded: list[ir.Node], replaced) -> None:
    """Name the unnamed nodes of each inlined body after the node they replace ("hs/Mul"): the
    inliner writes each body in its node's place, a body ending where its node's outputs are all
    produced. Stops at the first place the two lists do not line up so."""
    j = 0
    for node in nodes:
        if not replaced(node):
            if j >= len(expanded) or [o.name for o in expanded[j].outputs] != [o.name for o in node.outputs]:
                return
            j += 1
            continue
        wanted = {o.name for o in node.outputs if o.name}
        label, taken = node.name or node.op_type, set()
        while wanted and j < len(expanded):
            body = expanded[j]
            j += 1
            if not body.name:
                name, k = f"{label}/{body.op_type}", 1
                while name in taken:
                    name, k = f"{label}/{body.op_type}_{k}", k + 1
                body.name = name
                taken.add(name)
            wanted -= {o.name for o in body.outputs}


def _body_nodes(node: ir.Node):
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs = [attr.value]
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs = list(attr.value)
        else:
            continue
        for g in graphs:
            for inner in g:
                yield inner
                yield from _body_nodes(inner)


def _nbytes(dims, bits: int) -> int:
    return (math.prod(dims) * bits + 7) // 8


def kernel_scratch(node: ir.Node, sizes: Sizes, opset: int | None = None) -> int:
    """Bytes onnxruntime's CPU kernel for ``node`` allocates for itself while it runs, alive with the
    node's inputs and outputs (through the kernel's allocator: with the memory arena off, one malloc
    each, freed before the node returns), where the graph's shapes give them (``opset``: the
    model's ONNX opset, for a node that does not name its own):

    - Where (``where_op.cc``, ``Where<T>::Compute``) broadcasts in two passes before it writes its
      output: ``UntypedSelect`` allocates X_selection (condition ? X : 0) and Y_selection
      (condition ? 0 : Y), each of the shape of the condition broadcast with that operand, and
      ``UntypedMerge`` then allocates the output with both alive.
    - Softmax and LogSoftmax from opset 13 over an axis that is not the last
      (``softmax.cc``, ``ComputeImplOpset13``) transpose that axis last into a temporary of the
      input's size and compute into a second before transposing back into the output.
    - ConvTranspose (``conv_transpose.cc``, ``DoConvTranspose``) computes each image's columns into
      a buffer of (output channels / group) x kernel size x input image size elements.

    Other kernels: 0 (the CPU Conv's im2col buffer, MLAS's, is at most 64 KiB a thread)."""
    if node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None:
        return 0
    op = node.op_type
    if op == "Where" and len(node.inputs) == 3 and all(v is not None for v in node.inputs):
        cond, x, y = (sizes.dims(v) for v in node.inputs)
        if cond is None or x is None or y is None:
            return 0
        bits = ir.DataType(x[0]).bitwidth
        total = 0
        for operand in (x, y):
            try:
                total += _nbytes(np.broadcast_shapes(tuple(cond[1]), tuple(operand[1])), bits)
            except ValueError:  # (shapes that do not broadcast: the session would refuse the model)
                return 0
        return total
    if op in ("Softmax", "LogSoftmax"):
        x = sizes.dims(node.inputs[0])
        version = node.version or opset
        if x is None or not x[1] or version is None or version < 13:
            return 0
        axis = node.attributes.get_int("axis", -1)
        rank = len(x[1])
        return 0 if axis % rank == rank - 1 else 2 * _nbytes(x[1], ir.DataType(x[0]).bitwidth)
    if op == "ConvTranspose" and len(node.inputs) >= 2 and node.inputs[1] is not None:
        x, w = sizes.dims(node.inputs[0]), sizes.dims(node.inputs[1])
        if x is None or w is None or len(x[1]) < 3 or len(w[1]) != len(x[1]):
            return 0
        return _nbytes([w[1][1], *w[1][2:], *x[1][2:]], ir.DataType(x[0]).bitwidth)
    return 0


class Liveness:
    """The main graph as liveness needs it: per node, the values it reads that a main-graph node
    produced (its bodies' outer reads included), what it allocates, its subgraph charge and the
    working memory onnxruntime's kernel for it allocates (:func:`kernel_scratch`, counted in
    runtime figures only)."""

    def __init__(self, model: ir.Model, sizes: Sizes, planned: dict[str, tuple] | None = None,
                 late: frozenset[int] = frozenset()):
        graph = model.graph
        # the shapes onnxruntime's planner knows (plan_shapes): with them, runtime figures take its
        # reuse of released buffers into account
        self.planned = planned
        # positions of the nodes onnxruntime numbers after every node of the file (the bodies of
        # the functions it inlines: onnxruntime_graph), which its order's ties follow
        self.late = late
        self.graph = graph
        self.nodes = list(graph)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.unknown: list[str] = []
        seen_unknown = set()

        def note(value):
            if value.name not in seen_unknown:
                seen_unknown.add(value.name)
                self.unknown.append(value.name or "(unnamed)")

        self.size: dict[ir.Value, int] = {}
        self.inputs_bytes = 0
        self.input_values = []
        for v in graph.inputs:
            if v.is_initializer():
                continue
            s = sizes(v)
            if s is None:
                note(v)
            self.input_values.append((v, s or 0))
            self.inputs_bytes += s or 0
        self.weights_bytes = sum(tensor_nbytes(v.const_value) for v in graph.initializers.values()
                                 if v.const_value is not None)
        self.outputs = {v for v in graph.outputs}
        self.reads: list[list[ir.Value]] = []
        self.extra: list[int] = []
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
        self.scratch = [kernel_scratch(node, sizes, opset) for node in self.nodes]
        self.float_input = {node for node in self.nodes if node.op_type in _IN_PLACE_FLOAT_ONLY and node.inputs
                            and node.inputs[0] is not None
                            and sizes.dtype(node.inputs[0]) == ir.DataType.FLOAT.value}
        for node in self.nodes:
            constant = node.op_type == "Constant" and node.domain in ("", "ai.onnx")
            for o in node.outputs:
                s = sizes(o)
                if s is None:
                    note(o)
                if constant and o not in self.outputs:
                    # a weight, as an initializer is (a runtime holds it for the session's life):
                    # counted apart, never in the curve
                    self.weights_bytes += s or 0
                    s = 0
                self.size[o] = s or 0
            reads = [v for v in node.inputs if v is not None]
            charge = 0
            for inner in _body_nodes(node):
                reads += [v for v in inner.inputs if v is not None]
                for o in inner.outputs:
                    s = sizes(o)
                    if s is None:
                        note(o)
                    charge += s or 0
            produced_here = self.index
            self.reads.append(list(dict.fromkeys(
                v for v in reads if v.producer() is not None and v.producer() in produced_here)))
            self.extra.append(charge)
        self.readers: dict[ir.Value, list[int]] = {}
        for i, reads in enumerate(self.reads):
            for v in reads:
                self.readers.setdefault(v, []).append(i)

    def simulate(self, order: Sequence[int], runtime: bool = False):
        """The curve (bytes alive while each node runs) for the node indices in ``order``, and the
        last step at which each value is alive. ``runtime``: as onnxruntime's CPU allocation plan
        shares buffers (:meth:`_plan`), with its kernels' working memory (:func:`kernel_scratch`)."""
        pos = {k: i for i, k in enumerate(order)}
        end = len(order)
        last: dict[ir.Value, int] = {}
        for step, k in enumerate(order):
            for o in self.nodes[k].outputs:
                last[o] = end if o in self.outputs else max((pos[r] for r in self.readers.get(o, ())), default=step)
        if runtime:
            buffer, ends = self._plan(order, last)
        else:
            buffer = {o: o for k in order for o in self.nodes[k].outputs}
            ends = last
        frees: list[list[ir.Value]] = [[] for _ in range(end + 1)]
        for b, e in ends.items():
            if buffer.get(b) is b:
                frees[e].append(b)
        alive = self.inputs_bytes
        curve = []
        for step, k in enumerate(order):
            for o in self.nodes[k].outputs:
                if buffer.get(o) is o:
                    alive += self.size[o]
            curve.append(alive + self.extra[k] + (self.scratch[k] if runtime else 0))
            for b in frees[step]:
                alive -= self.size[b]
        if runtime:  # a shared allocation is listed under its first value, alive as long as it is held
            last = {v: (ends[v] if buffer[v] is v else -1) for v in buffer}
        return curve, last, pos

    def _plan(self, order: Sequence[int], last: dict):
        """onnxruntime's allocation plan, as its planner makes it in ``order``
        (``allocation_planner.cc``, ``ComputeSingleStreamReusePlan``): a Constant node's value is a
        weight (the session makes it an initializer when it loads the graph); a graph output is
        allocated for the caller; else each node output (1) is a view of input 0 for a view op
        (Reshape, Squeeze, Unsqueeze, Flatten, Identity: no allocation; of a graph input or weight,
        nothing to hold); (2) else takes input 0's buffer for an activation that may run in place
        (Relu, Clip, Sigmoid, ...) where that input dies at the node and the planner knows both
        shapes the same (``FindReusableInput``: ``SameSize`` of the planner's shapes; where they
        are not computed, the sizes); (3) else takes a buffer of its shape as the planner knows it
        whose values have all died (the one freed last: ``FindReusableTensor``); (4) else is
        allocated. A buffer is released after the last of the values it held, so one taken again
        stays allocated in between. Returns each output's buffer (the value it was allocated for)
        and each buffer's release step."""
        buffer: dict[ir.Value, ir.Value] = {}
        ends: dict[ir.Value, int] = {}
        free: list[ir.Value] = []  # released buffers, the last released first
        dying: dict[int, list[ir.Value]] = {}
        for step, k in enumerate(order):
            node = self.nodes[k]
            share = None
            onnx_op = node.domain in ("", "ai.onnx")
            if onnx_op and node.op_type == "Constant":
                continue
            if node.outputs and node.inputs and node.inputs[0] is not None and onnx_op \
                    and node.outputs[0] not in self.outputs:
                first, out = node.inputs[0], node.outputs[0]
                if node.op_type in _VIEWS:
                    share = buffer.get(first, "input")
                elif node.op_type in _IN_PLACE and first in buffer and ends[buffer[first]] == step \
                        and (node.op_type not in _IN_PLACE_FLOAT_ONLY or node in self.float_input) \
                        and first not in self.outputs and (
                            self.size.get(first) == self.size[out] if self.planned is None
                            else self.planned.get(first.name) is not None
                            and self.planned.get(first.name) == self.planned.get(out.name)):
                    share = buffer[first]
            for n, o in enumerate(node.outputs):
                if n == 0 and share == "input":
                    continue
                if n != 0 or share is None:
                    share = None
                    key = self.planned.get(o.name) if self.planned is not None and o not in self.outputs else None
                    if key is not None:
                        share = next((b for b in free if self.planned.get(b.name) == key), None)
                    if share is not None:
                        free.remove(share)
                if share is None:
                    buffer[o] = o
                    ends[o] = last[o]
                    dying.setdefault(last[o], []).append(o)
                else:
                    buffer[o] = share
                    if last[o] > ends[share]:
                        ends[share] = last[o]
                        dying.setdefault(last[o], []).append(share)
                share = None
            for b in dying.pop(step, ()):
                if ends[b] == step and self.planned is not None and b.name in self.planned:
                    free.insert(0, b)
        return buffer, ends

    def peak_of(self, order: Sequence[int], runtime: bool = False) -> int:
        curve = self.simulate(order, runtime)[0]
        return max(curve, default=self.inputs_bytes)

    # The peak in the nodes' order and the runtime peak in onnxruntime's (:func:`onnxruntime_order`),
    # each simulated once for this graph (the passes and the report ask for both).
    @functools.cached_property
    def graph_peak(self) -> int:
        return self.peak_of(range(len(self.nodes)))

    @functools.cached_property
    def runtime_peak(self) -> int:
        return self.peak_of(onnxruntime_order(self), runtime=True)

    def peaks(self) -> tuple[int, int]:
        return self.graph_peak, self.runtime_peak

    # -- orders -----------------------------------------------------------------------------

    def _preds(self) -> list[list[int]]:
        return [sorted({self.index[v.producer()] for v in reads}) for reads in self.reads]

    def greedy(self) -> list[int]:
        """List scheduling: next, the ready node whose run adds the least (its outputs' bytes less
        the bytes of the inputs it is the last reader of); ties to the original order."""
        preds = self._preds()
        succs: list[list[int]] = [[] for _ in self.nodes]
        waiting = [len(p) for p in preds]
        for i, p in enumerate(preds):
            for j in p:
                succs[j].append(i)
        left = {v: len(r) for v, r in self.readers.items()}
        ready = [i for i, w in enumerate(waiting) if w == 0]
        order = []
        while ready:
            best, best_key = None, None
            for i in ready:
                gain = sum(self.size[o] for o in self.nodes[i].outputs)
                freed = sum(self.size[v] for v in self.reads[i] if left[v] == 1 and v not in self.outputs)
                key = (gain - freed, i)
                if best_key is None or key < best_key:
                    best, best_key = i, key
            ready.remove(best)
            order.append(best)
            for v in self.reads[best]:
                left[v] -= 1
            for s in succs[best]:
                waiting[s] -= 1
                if waiting[s] == 0:
                    ready.append(s)
        return order

    def depth_first(self) -> list[int]:
        """Post-order from the graph's sinks: each node's operands one after the other, the one that
        needs the most memory to compute first (Sethi-Ullman's order, with a subtree's need estimated
        as the bytes it produces), so one operand is finished before the next is started."""
        preds = self._preds()
        need = [0] * len(self.nodes)
        for i in range(len(self.nodes)):  # (the original order is topological)
            own = sum(self.size[o] for o in self.nodes[i].outputs)
            need[i] = max([own, *(need[j] for j in preds[i])])
        has_succ = [False] * len(self.nodes)
        for p in preds:
            for j in p:
                has_succ[j] = True
        sinks = [i for i in range(len(self.nodes)) if not has_succ[i]]
        done = [False] * len(self.nodes)
        order = []
        for root in sinks:
            stack = [(root, False)]
            while stack:
                i, expanded = stack.pop()
                if done[i]:
                    continue
                if expanded:
                    done[i] = True
                    order.append(i)
                    continue
                stack.append((i, True))
                # pushed in reverse: the neediest operand is popped (computed) first
                for j in sorted(preds[i], key=lambda j: (need[j], -j)):
                    if not done[j]:
                        stack.append((j, False))
        return order


def onnxruntime_order(g: Liveness) -> list[int]:
    """The order onnxruntime runs the graph in (its GraphViewer's default, ``ExecutionOrder::DEFAULT``):
    a depth-first post-order from the nodes no node reads (graph outputs, dead ends), the last of
    them first; at each node its producers pushed in node-index order (the file's order), so the
    last one is explored first; a node is placed when its producers are. The file's order matters
    to onnxruntime only through these ties. Nodes onnxruntime adds at session creation (``g.late``:
    function bodies it inlines) take node indices after every node of the file, in their order."""
    late = g.late
    index = (lambda i: i) if not late else (lambda i: (i in late, i))
    preds = [sorted(p, key=index) for p in g._preds()]
    has_succ = [False] * len(g.nodes)
    for p in preds:
        for j in p:
            has_succ[j] = True
    stack = [(i, False) for i in sorted(range(len(g.nodes)), key=index) if not has_succ[i]]
    visited = [False] * len(g.nodes)
    order = []
    while stack:
        i, leave = stack.pop()
        if leave:
            order.append(i)
            continue
        if visited[i]:
            continue
        visited[i] = True
        stack.append((i, True))
        stack.extend((j, False) for j in preds[i] if not visited[j])
    return order


def _moved(g: Liveness, order: Sequence[int]) -> Liveness:
    """``g`` with its nodes written in ``order`` (sizes shared, not recomputed)."""
    moved = Liveness.__new__(Liveness)
    moved.__dict__.update(g.__dict__)
    moved.__dict__.pop("graph_peak", None)  # (another order: its own peaks)
    moved.__dict__.pop("runtime_peak", None)
    moved.nodes = [g.nodes[k] for k in order]
    moved.index = {n: i for i, n in enumerate(moved.nodes)}
    moved.reads = [g.reads[k] for k in order]
    moved.extra = [g.extra[k] for k in order]
    moved.scratch = [g.scratch[k] for k in order]
    moved.late = frozenset(i for i, k in enumerate(order) if k in g.late)
    moved.readers = {}
    for i, reads in enumerate(moved.reads):
        for v in reads:
            moved.readers.setdefault(v, []).append(i)
    return moved


def _onnxruntime_peak(g: Liveness, order: Sequence[int]) -> int:
    """The peak in the order onnxruntime would run the nodes in, were they written in ``order``
    (its ties follow the nodes' positions)."""
    moved = _moved(g, order)
    return moved.peak_of(onnxruntime_order(moved), runtime=True)


def result(g: Liveness, order: Sequence[int], curve=True, runtime: bool = False) -> dict:
    values, last, pos = g.simulate(order, runtime)
    top = max(values, default=g.inputs_bytes)
    if not runtime and isinstance(order, range) and order == range(len(g.nodes)):
        g.__dict__.setdefault("graph_peak", top)  # (the nodes' order simulated: its peak, for g.graph_peak)
    at = values.index(top) if values else None
    alive = []
    if at is not None:
        alive = [[v.name, s] for v, s in g.input_values]
        for step in range(at + 1):
            for o in g.nodes[order[step]].outputs:
                if last.get(o, -1) >= at and g.size[o]:
                    alive.append([o.name, g.size[o]])
        k = order[at]
        if g.extra[k]:
            alive.append([f"{g.nodes[k].name or g.nodes[k].op_type} (subgraph values)", g.extra[k]])
        if runtime and g.scratch[k]:
            alive.append([f"{g.nodes[k].name or g.nodes[k].op_type} (kernel working memory)", g.scratch[k]])
        alive.sort(key=lambda item: (-item[1], item[0]))
    out = {
        "peak_bytes": top,
        "peak_at": {"index": at, "name": g.nodes[order[at]].name if at is not None else None},
        "alive_at_peak": alive,
        "onnxruntime_peak_bytes": g.runtime_peak,
        "weights_bytes": g.weights_bytes,
        "inputs_bytes": g.inputs_bytes,
        "unknown": list(g.unknown),
        "lower_bound": bool(g.unknown),
    }
    if curve:
        out["curve"] = values
    return out


PEAK_KEY = "onnxopt.memory.peak"  # graph.meta (in memory only): the pass's result() of the order it leaves


def reorder(model: ir.Model, infer: Callable[[ir.Model], onnx.ModelProto], g: Liveness | None = None) -> int:
    """Reorder ``model``'s main graph (in place) to the candidate order with the lowest peak, when
    that is strictly below the current order's and the peak in the order onnxruntime runs the
    nodes in (:func:`onnxruntime_order`, which follows the file's order only in its ties) does not
    rise; returns 1 when it did, else 0. Nodes, values and results are unchanged. The peak of the
    order it leaves is kept in ``model.graph.meta[PEAK_KEY]`` (optimize's report takes it from there
    rather than infer the shapes again). ``g``: ``model``'s Liveness where the caller has it."""
    g = g if g is not None else Liveness(model, Sizes(model, infer))
    model.graph.meta[PEAK_KEY] = result(g, range(len(g.nodes)), curve=False)
    if len(g.nodes) < 3 or len(g.unknown) > len([v for v, _ in g.input_values if v.name in g.unknown]):
        # a value of unknown size (a symbolic dimension): the peak compared is not the one that runs
        return 0
    current = list(range(len(g.nodes)))
    best, (best_peak, ort_peak) = current, g.peaks()
    for order in (g.greedy(), g.depth_first()):
        if len(order) != len(current):  # (a cycle or a read we cannot place: leave the order alone)
            continue
        p = g.peak_of(order)
        if p < best_peak and _onnxruntime_peak(g, order) <= ort_peak:
            best, best_peak = order, p
    if best is current:
        return 0
    graph = model.graph
    nodes = [g.nodes[k] for k in best]
    graph.remove(g.nodes, safe=False)
    graph.extend(nodes)
    graph.meta[PEAK_KEY] = result(_moved(g, best), range(len(nodes)), curve=False)
    return 1
