"""The culprit of a difference: the first value, in the optimized graph's order, present in both
graphs by name, whose values diverge; the node that produced it, and the rule that created that
node (``onnxopt.rule`` provenance) where the divergence can be tied to one."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import onnx

from onnxopt.ir.util import REPLACED_KEY as _REPLACED, RULE_KEY as _RULE, SOURCES_KEY as _SOURCES
from onnxopt.verify.compare import compare_value
from onnxopt.verify.runtime import OrtModel, host_value, session


def value_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Tensor types of the main graph's values and weights (declared, else from onnx's shape
    inference), for exposing them as outputs."""
    types: dict[str, onnx.TypeProto] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False)
        infos = list(inferred.graph.value_info) + list(inferred.graph.output)
    except Exception:  # noqa: BLE001 - inference is best effort here
        infos = []
    elem_types = [(vi.name, vi.type.tensor_type.elem_type) for vi in [*proto.graph.value_info, *proto.graph.output,
                                                                      *infos] if vi.type.HasField("tensor_type")]
    elem_types += [(i.name, i.data_type) for i in proto.graph.initializer]
    for name, elem_type in elem_types:
        if elem_type and name not in types:
            t = onnx.TypeProto()
            t.tensor_type.elem_type = elem_type  # shape left out: any shape
            types[name] = t
    return types


def _fetch(model: OrtModel, names: Iterable[str], types: Mapping[str, onnx.TypeProto],
           feeds: Mapping[str, np.ndarray], provider: str) -> dict:
    """The values ``names`` take in ``model``: graph inputs from ``feeds``, the others (those with
    a known type) exposed as outputs of one run with onnxruntime's graph optimizations off, so
    each value is the graph's own."""
    names = list(dict.fromkeys(names))
    values = {n: feeds[n] for n in names if n in feeds}
    wanted = [n for n in names if n not in feeds and n in types]
    if wanted:
        sess = session(model.with_outputs(wanted, types), provider, optimization="disable", exact=True)
        outs = sess.run(wanted, {i.name: feeds[i.name] for i in sess.get_inputs()})
        values.update(zip(wanted, map(host_value, outs)))
    return values


CHUNKS = 4  # the shared values are compared in this many parts (see find_culprit)


def find_culprit(original: OrtModel, optimized: OrtModel, feeds: Mapping[str, np.ndarray], provider: str = "cpu", *,
                 low_precision: bool = False, rtol: float | None = None, atol: float | None = None) -> dict:
    """The first value of the optimized graph (in its node order) that the original graph also
    has by name and whose values differ beyond tolerance, the node that produced it, and, where
    the divergence can be tied to one, the rule to blame (see :func:`_tie`)."""
    opt_proto, orig_proto = optimized.proto, original.proto
    inits = {i.name for i in opt_proto.graph.initializer} | {i.name for i in orig_proto.graph.initializer}
    produced_orig = {o for n in orig_proto.graph.node for o in n.output if o}
    order, producer = [], {}
    for node in opt_proto.graph.node:
        for o in node.output:
            if o and o in produced_orig and o not in inits:
                order.append(o)
                producer[o] = node
    t_orig, t_opt = value_types(orig_proto), value_types(opt_proto)
    names = [n for n in order if n in t_orig and n in t_opt
             and t_orig[n].tensor_type.elem_type == t_opt[n].tensor_type.elem_type]
    result: dict = {"compared_values": len(names)}
    if not names:
        result["message"] = "the two graphs share no intermediate value names"
        return result
    def agree(a, b) -> bool:
        return compare_value(a, b, low_precision=low_precision, rtol=rtol, atol=atol)["ok"]

    # In CHUNKS parts of about equal bytes, in order, stopping at the first that diverges: the values
    # of both models held at once are a part's, so about half of one model's values (not all of
    # both: 2.1 GB for a 4.7 MB detector at 640x640); a divergence early in the graph costs two runs.
    for part in _parts(names, _value_bytes(opt_proto, feeds)):
        before = _fetch(original, part, t_orig, feeds, provider)
        after = _fetch(optimized, part, t_opt, feeds, provider)
        for name in part:
            stats = compare_value(before[name], after[name], low_precision=low_precision, rtol=rtol, atol=atol)
            if not stats["ok"]:
                del before, after
                node = producer[name]
                result.update(value=name, stats=stats, node=_describe(node))
                result.update(_tie(original, optimized, node, (t_orig, t_opt), feeds, provider, agree))
                return result
        del before, after
    result["message"] = ("every shared intermediate value agrees; the difference arises in values the "
                         "optimized graph renamed or removed, or in onnxruntime's own graph optimizations")
    return result


def _tie(original: OrtModel, optimized: OrtModel, node: onnx.NodeProto, types: tuple[dict, dict],
         feeds: Mapping[str, np.ndarray], provider: str, agree: Callable[[object, object], bool]) -> dict:
    """Whether the rule behind ``node`` (the producer of the first diverging value) is to blame.

    It is when ``node`` was made by one rewrite of original nodes (its provenance: ``replaced``
    are original nodes) and every value that rewrite's nodes read agrees with a value the
    replaced nodes read in the original: the rewrite then computes a different value from the
    same inputs. Otherwise the result says what is known, without a rule: an input that now
    comes from elsewhere and differs (a rewrite upstream rerouted it and left no node: a rule
    that forwards a value, or a graph pass), a node made through several rewrites, an original
    node. ``onnxopt.verify.bisect.bisect`` then names the rewrite."""
    orig, opt = original.proto, optimized.proto
    meta = _meta(node)
    rule = meta.get(_RULE)
    replaced = _json_list(meta.get(_REPLACED)) if rule else [node.name]
    by_name: dict[str, list] = {}
    for n in orig.graph.node:
        by_name.setdefault(n.name, []).append(n)
    if rule and set(replaced) != set(_json_list(meta.get(_SOURCES))):
        return {"reason": "it was made through several rewrites (of " + ", ".join(_json_list(meta.get(_SOURCES)))
                          + "): which one went wrong is for bisect to find"}
    if not all(name and len(by_name.get(name, [])) == 1 for name in replaced):
        return {"reason": "the original nodes it stands for cannot be told apart by name"}
    region = _same_rewrite(opt, node) if rule else [node]
    read_before = _external_inputs([by_name[name][0] for name in replaced])
    constants_orig = _constants(orig)
    names_orig = {i.name for i in orig.graph.input} | constants_orig | {o for n in orig.graph.node for o in n.output}
    # the rewrite's own new weights have no counterpart; every other value it reads must have one
    read_now = [u for u in _external_inputs(region) if u in names_orig or u not in _constants(opt)]
    computed_before = [w for w in read_before if w not in constants_orig]
    t_orig, t_opt = types
    v_now = _fetch(optimized, read_now, t_opt, feeds, provider)
    v_before = _fetch(original, [*computed_before, *(u for u in read_now if u in names_orig)], t_orig, feeds,
                      provider)
    inputs = []
    for u in read_now:
        candidates = [u] if u in names_orig and u in read_before else []
        candidates += [w for w in computed_before if w != u]
        match = next((w for w in candidates if u in v_now and w in v_before and agree(v_before[w], v_now[u])), None)
        inputs.append({"now": u, "producer_now": _producer(opt, u), "before": match, "agrees": match is not None})
    out: dict = {"inputs": inputs,
                 "read_before": [{"name": w, "producer": _producer(orig, w)} for w in computed_before]}
    if any(not i["agrees"] for i in inputs):
        out["reason"] = ("a rewrite upstream rerouted what it reads and left no node (a rule that forwards a value, "
                         "or a graph pass)")
    elif rule:
        out.update(rule=rule, replaced=replaced)
    else:
        out["reason"] = "an original node whose inputs agree with the original's, yet computes a different value"
    return out


def _value_bytes(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Bytes of the main graph's values at the shapes of ``feeds`` (onnx's inference, bounded:
    ``onnxopt.ir.shapes.infer_proto``); values it cannot size are left out."""
    from onnxopt.ir.shapes import infer_proto

    light = onnx.ModelProto()
    light.CopyFrom(proto)
    del light.graph.value_info[:]
    names = {t.name for t in light.graph.initializer}
    light.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in light.graph.initializer if t.name not in {i.name for i in light.graph.input})
    del light.graph.initializer[:]
    for vi in light.graph.input:
        if vi.name in feeds and vi.name not in names:
            shape = vi.type.tensor_type.shape
            shape.Clear()
            for d in np.shape(feeds[vi.name]):
                shape.dim.add().dim_value = int(d)
    try:
        inferred = infer_proto(light)
    except Exception:  # noqa: BLE001 - sizes only balance the parts
        return {}
    out = {}
    for vi in (*inferred.graph.value_info, *inferred.graph.output):
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        if t.HasField("shape") and all(d >= 0 for d in dims) and t.elem_type:
            out[vi.name] = int(np.prod(dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
    return out


def _parts(names: list[str], sizes: Mapping[str, int]) -> list[list[str]]:
    """``names`` in order, cut into about CHUNKS parts of equal bytes (a value of unknown size counted
    as the average)."""
    known = [sizes[n] for n in names if n in sizes]
    mean = sum(known) / len(known) if known else 1
    weights = [sizes.get(n, mean) for n in names]
    budget = max(sum(weights) / CHUNKS, 1)
    parts, part, used = [], [], 0.0
    for n, w in zip(names, weights):
        if part and used + w > budget:
            parts.append(part)
            part, used = [], 0.0
        part.append(n)
        used += w
    if part:
        parts.append(part)
    return parts


def _json_list(text: str | None) -> list[str]:
    try:
        value = json.loads(text or "[]")
    except (ValueError, RecursionError):
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def _same_rewrite(proto: onnx.ModelProto, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``node`` and the nodes upstream of it that the same rewrite created (same provenance)."""
    key = [_meta(node).get(k) for k in (_RULE, _REPLACED, _SOURCES)]
    by_output = {o: n for n in proto.graph.node for o in n.output if o}
    region, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if id(n) in seen or [_meta(n).get(k) for k in (_RULE, _REPLACED, _SOURCES)] != key:
            continue
        seen.add(id(n))
        region.append(n)
        stack.extend(by_output[i] for i in n.input if i in by_output)
    return region


def _external_inputs(nodes: list[onnx.NodeProto]) -> list[str]:
    produced = {o for n in nodes for o in n.output}
    return list(dict.fromkeys(i for n in nodes for i in n.input if i and i not in produced))


def _constants(proto: onnx.ModelProto) -> set[str]:
    return {i.name for i in proto.graph.initializer} | {
        n.output[0] for n in proto.graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output}


def _producer(proto: onnx.ModelProto, name: str) -> dict | None:
    node = next((n for n in proto.graph.node if name in n.output), None)
    return _describe(node) if node is not None else None


def _meta(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def _describe(node: onnx.NodeProto) -> dict:
    """A node by name, op type, inputs and outputs, with the provenance a rewrite gave it (data
    about the node: the culprit's ``rule`` is what blames a rule)."""
    meta = _meta(node)
    d = {"name": node.name, "op_type": node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}",
         "inputs": list(node.input), "outputs": list(node.output)}
    if _RULE in meta:
        d["provenance"] = {"rule": meta[_RULE], "replaced": _json_list(meta.get(_REPLACED)),
                           "sources": _json_list(meta.get(_SOURCES))}
    return d
