"""Float16 arithmetic for judging a float16 model: every op's output rounded to float16.

onnxruntime's CPU provider computes many float16 ops in float32 (it inserts Casts around the ops it
has no float16 kernel for and removes the Cast pairs between them), so a float16 model's values
never pass through float16 there: a MatMul reaching 409,600 gives a finite answer on the CPU and
inf on a GPU. Judging a float16 model by its CPU outputs therefore misses overflow and the
rounding of large intermediate values.

:func:`run_fp16` runs a model in float16 arithmetic as onnx's reference evaluator
(``onnx.reference.ReferenceEvaluator``) computes in declared types -- every value declared float16
holds a float16 number -- but fast enough for models of tens of millions of parameters: the model
is rewritten (:func:`emulated`) so that each float16 value is computed in float32 by onnxruntime's
kernel and rounded to float16 at once (a Cast to float16 and back, which onnxruntime keeps: a value
beyond 65504 becomes inf, one above float16's spacing loses its low bits), as float16 kernels that
accumulate in float32 do on a GPU. Float16 weights and inputs become float32 exactly. It runs on
the CPU, or on CUDA where asked and present; a model the rewrite cannot take (float16 inside a
subgraph, an op onnxruntime refuses in float32) runs on onnx's reference evaluator instead, below
:data:`REFERENCE_MAX_PARAMS` parameters.

Overflow and rounding are judged at the inputs given or generated only: another input may reach
values these did not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from onnxopt.ir.util import fresh_namer

F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
REFERENCE_MAX_PARAMS = 50_000_000  # onnx's reference evaluator, the fallback: numpy, slow beyond this

EMULATED = "float16 (every op's output rounded to float16; each op computed in float32 by onnxruntime {provider}, " \
           "then rounded, as float16 kernels accumulating in float32 do)"
REFERENCE = "float16 (onnx's reference evaluator, in the model's declared types)"
AT_INPUTS = "overflow and float16 rounding judged at these inputs only"


class Fp16Unavailable(Exception):
    """The model cannot be run in float16 arithmetic here (the reason in one line)."""


def value_dtypes(proto: onnx.ModelProto) -> dict[str, int]:
    """Element type of every main-graph value: declared, else from the producer's schema (onnx's or
    onnxruntime's for com.microsoft ops; a type variable takes its bound input's type)."""
    import onnx_ir as ir

    from onnxopt.ir.optypes import infer_dtypes

    model = ir.serde.deserialize_model(proto)
    found = infer_dtypes(model.graph, dict(model.opset_imports))
    out: dict[str, int] = {}
    for v in [*model.graph.inputs, *model.graph.initializers.values()]:
        if v.name and v.type is not None:
            out[v.name] = int(v.dtype.value)
    for v, dt in found.items():
        if v.name and dt is not None:
            out[v.name] = int(dt.value)
    return out


def _has_fp16_subgraph(proto: onnx.ModelProto) -> bool:
    def graph_has(g: onnx.GraphProto) -> bool:
        for n in g.node:
            for a in n.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    if f"elem_type: {F16}\n" in str(sub) or "data_type: 10\n" in str(sub) or graph_has(sub):
                        return True
        return False

    return graph_has(proto.graph)


def emulated(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` computing in float32 with every float16 value rounded to float16 where it is made:
    float16 weights become float32 (exactly), Casts to float16 cast to float32, and each node output
    declared float16 is followed by a Cast to float16 and back. Graph inputs and outputs keep their
    names and types. Raises :class:`Fp16Unavailable` for float16 inside a subgraph."""
    if _has_fp16_subgraph(proto):
        raise Fp16Unavailable("float16 values inside a subgraph (If/Loop/Scan)")
    dtypes = value_dtypes(proto)
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    g = m.graph
    names = {*dtypes, *(i.name for i in g.input), *(o.name for o in g.output)}
    for n in g.node:
        names.update(n.input)
        names.update(n.output)

    fresh = fresh_namer(names)

    def cast(src: str, dst: str, to: int) -> onnx.NodeProto:
        return onnx.helper.make_node("Cast", [src], [dst], name=fresh(f"{dst}_fp16emu"), to=to)

    def to_f32(t: onnx.TensorProto) -> None:
        arr = onnx.numpy_helper.to_array(t).astype(np.float32)
        t.CopyFrom(onnx.numpy_helper.from_array(arr, t.name))

    for t in g.initializer:
        if t.data_type == F16:
            to_f32(t)
    for t in g.sparse_initializer:
        if t.values.data_type == F16:
            raise Fp16Unavailable("a float16 sparse initializer")
    outputs = {o.name for o in g.output}
    rename: dict[str, str] = {}  # float16 value -> its float32 (rounded) twin, for readers
    head: list[onnx.NodeProto] = []
    for i in g.input:
        if i.type.tensor_type.elem_type == F16:
            rename[i.name] = fresh(f"{i.name}_f32")
            head.append(cast(i.name, rename[i.name], F32))
    body: list[onnx.NodeProto] = []
    for node in g.node:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        for k, name in enumerate(new.input):
            if name in rename:
                new.input[k] = rename[name]
        for a in new.attribute:
            if new.op_type == "Cast" and a.name == "to" and a.i == F16:
                a.i = F32
            elif a.name in ("dtype",) and a.type == onnx.AttributeProto.INT and a.i == F16:
                a.i = F32
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F16:
                to_f32(a.t)
        tail = []
        for k, name in enumerate(new.output):
            if not name or dtypes.get(name) != F16:
                continue
            pre, half = fresh(f"{name}_f32pre"), fresh(f"{name}_f16")
            new.output[k] = pre
            twin = fresh(f"{name}_f32") if name in outputs else name
            tail += [cast(pre, half, F16), cast(half, twin, F32)]
            if name in outputs:
                rename[name] = twin
                tail.append(cast(half, name, F16))  # the graph output keeps its float16 type and name
        body.append(new)
        body.extend(tail)
    del g.node[:]
    g.node.extend(head + body)
    del g.value_info[:]  # (float16 types changed: onnxruntime infers them again)
    return m


def _params(proto: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) for t in proto.graph.initializer)


def run_fp16(model, feeds_list: Sequence[Mapping[str, np.ndarray]], provider: str = "cpu"
             ) -> tuple[list[list[tuple[str, np.ndarray]]], str]:
    """``model`` (onnx.ModelProto, bytes or a path) run in float16 arithmetic on each of
    ``feeds_list``: the outputs of each run by name, and the arithmetic used (a phrase for reports).
    Raises :class:`Fp16Unavailable` when neither the emulation nor the reference evaluator can run it."""
    from onnxopt.verify.runtime import host_value, session

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model) if isinstance(model, str) \
        else onnx.load_from_string(model)
    try:
        emu = emulated(proto)
        sess = session(emu.SerializeToString(), provider, optimization="disable", exact=True)
        names = [o.name for o in sess.get_outputs()]
        runs = [list(zip(names, map(host_value, sess.run(None, {i.name: f[i.name] for i in sess.get_inputs()}))))
                for f in feeds_list]
        used = provider if provider == "cpu" or "CUDAExecutionProvider" in sess.get_providers() else "cpu"
        return runs, EMULATED.format(provider=used)
    except Exception as exc:  # noqa: BLE001 - the reference evaluator instead, for a model it can run in time
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    if _params(proto) > REFERENCE_MAX_PARAMS:
        raise Fp16Unavailable(f"float16 emulation failed ({why}) and the model has more than "
                              f"{REFERENCE_MAX_PARAMS:,} parameters for onnx's reference evaluator")
    try:
        from onnx.reference import ReferenceEvaluator

        ref = ReferenceEvaluator(proto)
        names = list(ref.output_names)
        runs = []
        with np.errstate(all="ignore"):
            for f in feeds_list:
                outs = ref.run(None, {k: f[k] for k in ref.input_names})
                runs.append(list(zip(names, (np.asarray(v) for v in outs))))
        return runs, REFERENCE
    except Exception as exc:  # noqa: BLE001
        raise Fp16Unavailable(f"float16 emulation failed ({why}); onnx's reference evaluator too: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}") from None


def judge(before: list[tuple[str, np.ndarray]], model, feeds: Mapping[str, np.ndarray], provider: str = "cpu",
          back=None) -> dict:
    """The float16 model ``model`` run in float16 arithmetic on ``feeds``, each output judged against the
    float32 original's ``before`` by fp16 fidelity (``compare_fp16``): ``{"arithmetic", "note", "ok",
    "outputs"}``, or ``{"arithmetic": None, "ok": False, "error"}`` when it cannot run. ``back``: a
    function taking the outputs to the original's layouts (a model with changed edges)."""
    from onnxopt.verify.compare import compare_all, compare_fp16

    try:
        (got,), how = run_fp16(model, [feeds], provider)
    except Fp16Unavailable as exc:
        return {"arithmetic": None, "ok": False, "note": AT_INPUTS,
                "error": f"the float16 model could not be run in float16 arithmetic: {exc}"}
    if back is not None:
        got = back(got)
    rows = compare_all(before, got, low_precision=True)  # (outputs matched by name and place)
    for i, (name, value) in enumerate(before):
        if i < len(got) and got[i][0] == name:
            rows[i] = {"name": name, **compare_fp16(value, got[i][1], name)}
    for r, (_, b), (_, v) in zip(rows, before, got):
        if isinstance(v, np.ndarray) and isinstance(b, np.ndarray) and v.dtype.kind == "f" and v.shape == b.shape \
                and (~np.isfinite(v) & np.isfinite(b)).any():
            # a non-finite value the original does not have is an overflow, whatever the statistics say
            n = int((~np.isfinite(v) & np.isfinite(b)).sum())
            r.update(ok=False, problem=f"{n} inf/NaN value(s) where the original is finite (float16 overflow)"
                     + (f"; {r['problem']}" if r.get("problem") else ""))
    return {"arithmetic": how, "note": AT_INPUTS, "ok": all(r["ok"] for r in rows), "outputs": rows}


def judge_pair(before_model, after_model, feeds_before: Mapping[str, np.ndarray], feeds_after: Mapping[str, np.ndarray],
               provider: str = "cpu", back=None, rtol: float | None = None, atol: float | None = None) -> dict:
    """Two float16 models (an fp16 model and its optimization) both run in float16 arithmetic and
    compared at the low-precision tolerances (or ``rtol``/``atol``): a rewrite that makes an
    intermediate value overflow or round differently in float16 shows here, not on onnxruntime's CPU
    provider. The same keys as :func:`judge`."""
    from onnxopt.verify.compare import compare_all

    try:
        (ref,), how = run_fp16(before_model, [feeds_before], provider)
        (got,), _ = run_fp16(after_model, [feeds_after], provider)
    except Fp16Unavailable as exc:
        return {"arithmetic": None, "ok": False, "note": AT_INPUTS,
                "error": f"the float16 models could not be run in float16 arithmetic: {exc}"}
    if back is not None:
        got = back(got)
    rows = compare_all(ref, got, low_precision=True, rtol=rtol, atol=atol)
    return {"arithmetic": how, "note": AT_INPUTS, "ok": all(r["ok"] for r in rows), "outputs": rows}


__all__ = ["AT_INPUTS", "Fp16Unavailable", "REFERENCE_MAX_PARAMS", "emulated", "judge", "judge_pair", "run_fp16",
           "value_dtypes"]
