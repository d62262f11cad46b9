"""rules/normalization.py: LayerNormalization and RMS normalization from their decompositions,
SkipLayerNormalization (and SkipSimplifiedLayerNormalization) from Add (+ bias) + the
normalization, and the folds of a scale or shift after a fused node.

Each decomposition the exporters write (torch.onnx legacy at opset < 17 writes LayerNorm as
ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add; hand-written LayerNorms; Llama's RMSNorm as
Pow/ReduceMean/Add/Sqrt/Reciprocal-or-Div/Mul/Mul), in either operand order, fuses, checked with
onnxruntime CPU before and after (fp32, rtol = atol = 1e-5); each refusal names its reason. The
zoo's BERT, GPT-2 and MiniLM (both exporters) fuse every LayerNormalization with the residual Add
before it into SkipLayerNormalization (2 per layer + the embeddings' one, + GPT-2's final one)
with the same outputs (1e-4 of their range) at two shapes."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import pytest
from conftest import run_ort
from helpers import init, model, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize

from . import zoo_cases
from .zoo_cases import every_fusion  # noqa: F401 (a fixture)
from .check import fires, mismatches, refuses

TOL = 1e-5
CPU = zoo_cases.ORT_CPU
H = 8
RNG = np.random.default_rng(0)
GAMMA = RNG.uniform(0.5, 1.5, H).astype(np.float32)
BETA = RNG.standard_normal(H).astype(np.float32)


def n(op, ins, out, **kw):
    return helper.make_node(op, ins, [out], name=f"{op}_{out}", **kw)


def build(nodes, consts, *, opset=17, dtype=TensorProto.FLOAT, shape=("b", "s", H), extra_inputs=(), ms=False):
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [init(k, np.asarray(v).astype(np_dtype) if np.asarray(v).dtype.kind == "f" else np.asarray(v))
             for k, v in consts.items()]
    ins = [tinfo("x", list(shape), dtype)] + [tinfo(name, list(s), dtype) for name, s in extra_inputs]
    m = model(nodes, ins, [tinfo("y", len(shape), dtype)], inits, opset=opset)
    if ms:
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


def ops(m) -> collections.Counter:
    return collections.Counter(f"{x.domain}:{x.op_type}" if x.domain else x.op_type for x in m.graph.node)


def mean(x, out, opset, axes=(-1,)):
    """ReduceMean over ``axes``, keepdims: axes as an attribute before opset 18, an input from 18."""
    if opset >= 18:
        return [n("ReduceMean", [x, "axes"], out)]
    return [n("ReduceMean", [x], out, axes=list(axes))]


# --- LayerNormalization ----------------------------------------------------------------------------

def ln_nodes(*, opset=17, square="pow", divide="div", affine=True, swap=False, axes=(-1,), eps=True):
    """torch.onnx legacy's LayerNorm (opset < 17), in the variants other exporters and hand-written
    models use: d * d for the square, Mul by Reciprocal(Sqrt) or by Div(1, Sqrt), operands swapped."""
    nodes = mean("x", "mu", opset, axes) + [n("Sub", ["x", "mu"], "d")]
    nodes += [n("Pow", ["d", "two"], "sq")] if square == "pow" else [n("Mul", ["d", "d"], "sq")]
    nodes += mean("sq", "var", opset, axes)
    if eps:
        nodes += [n("Add", ["eps", "var"] if swap else ["var", "eps"], "ve"), n("Sqrt", ["ve"], "sd")]
    else:
        nodes += [n("Sqrt", ["var"], "sd")]
    if divide == "div":
        nodes += [n("Div", ["d", "sd"], "nd")]
    elif divide == "reciprocal":
        nodes += [n("Reciprocal", ["sd"], "r"), n("Mul", ["r", "d"] if swap else ["d", "r"], "nd")]
    else:
        nodes += [n("Div", ["one", "sd"], "r"), n("Mul", ["d", "r"], "nd")]
    if affine:
        nodes += [n("Mul", ["gamma", "nd"] if swap else ["nd", "gamma"], "sc"),
                  n("Add", ["beta", "sc"] if swap else ["sc", "beta"], "y")]
    else:
        nodes += [n("Identity", ["nd"], "y")]
    return nodes


LN_CONSTS = {"two": 2.0, "eps": 1e-5, "one": 1.0, "gamma": GAMMA, "beta": BETA, "axes": np.array([-1])}


@pytest.mark.parametrize("kw", [dict(), dict(square="mul"), dict(divide="reciprocal"), dict(divide="one-div"),
                                dict(swap=True, divide="reciprocal"), dict(affine=False), dict(opset=18),
                                dict(eps=False)],
                         ids=["legacy", "d*d", "reciprocal", "1/sqrt", "swapped", "no-affine", "opset18",
                              "no-eps"])
def test_layer_normalization_forms(kw):
    m = build(ln_nodes(**kw), LN_CONSTS, opset=kw.get("opset", 17))
    out, _ = fires("layer_normalization", m, tol=TOL, **CPU)
    counts = ops(out)
    assert counts["LayerNormalization"] == 1 and not counts["ReduceMean"] and not counts["Sqrt"], counts


def test_layer_normalization_positive_axis():
    """Axes [2] on a rank-3 input is the last axis."""
    m = build(ln_nodes(axes=(2,)), LN_CONSTS)
    out, _ = fires("layer_normalization", m, tol=TOL, **CPU)
    assert ops(out)["LayerNormalization"] == 1


def test_layer_normalization_portable_untouched():
    m = build(ln_nodes(), LN_CONSTS)
    assert "LayerNormalization" not in ops(optimize(m))


@pytest.mark.parametrize("kw,reason", [
    (dict(opset=16), "LayerNormalization needs opset 17 (the model imports 16)"),
    (dict(axes=(1,)), "a mean is over axes [1], not the last one"),
])
def test_layer_normalization_refuses(kw, reason):
    m = build(ln_nodes(**kw), LN_CONSTS, opset=kw.get("opset", 17), shape=("b", 3, H))
    refuses("layer_normalization", m, reason, **CPU)


@pytest.mark.parametrize("dtype,eps,reason", [
    (TensorProto.FLOAT, 1e-40, "the epsilon is subnormal in float32"),
    (TensorProto.DOUBLE, 1e-50, "the epsilon rounds to 0 in float32"),
], ids=["subnormal", "double-to-zero"])
def test_normalization_refuses_an_epsilon_float32_cannot_hold(dtype, eps, reason):
    """Issue 27: the fused op's epsilon is a float32 attribute; an epsilon that rounds to 0 there
    turns a row of zeros into NaN (0 / sqrt(0)), one that rounds to a subnormal is flushed to 0
    where denormals are off. Refused with the reason, for both fusions."""
    consts = {**LN_CONSTS, "eps": eps}
    refuses("layer_normalization", build(ln_nodes(), consts, dtype=dtype), reason, **CPU)
    rms = build(rms_nodes(residual=True), {**RMS_CONSTS, "eps": eps}, dtype=dtype,
                extra_inputs=[("res", ("b", "s", H))])
    refuses("rms_normalization", rms, reason, **CPU)


def test_layer_normalization_refuses_per_row_scale():
    m = build(ln_nodes(), {**LN_CONSTS, "gamma": RNG.uniform(0.5, 1.5, (3, 1)).astype(np.float32)},
              shape=("b", 3, H))
    refuses("layer_normalization", m, "the scale varies along another axis than the last", **CPU)


def test_layer_normalization_refuses_shared_centred_input():
    nodes = ln_nodes(affine=False)[:-1] + [n("Add", ["nd", "d"], "y")]
    refuses("layer_normalization", build(nodes, LN_CONSTS), "the centred input is read elsewhere", **CPU)


def test_layer_normalization_refuses_not_a_square():
    """The pattern says what is under the Sqrt: where it is not, the reason names what is missing."""
    nodes = [n("Pow", ["x", "three"], "c"), *mean("c", "v", 17), n("Sqrt", ["v"], "s"), n("Div", ["x", "s"], "y")]
    for rule in ("layer_normalization", "rms_normalization"):
        mismatches(rule, build(nodes, {"three": 3.0}), "the mean under the Sqrt is not of a square", **CPU)
        mismatches(rule, build([n("Sqrt", ["x"], "s"), n("Div", ["x", "s"], "y")], {}),
                   "Sqrt does not take a mean", **CPU)


# --- RMS normalization ----------------------------------------------------------------------------

def rms_nodes(*, form="reciprocal", opset=17, weight=True, swap=False, residual=False, square="pow", eps=True):
    """Llama's RMSNorm: x * rsqrt(mean(x^2) + eps) * w (torch.onnx dynamo: Reciprocal(Sqrt); legacy:
    Div(1, Sqrt)); also x / sqrt(...), x * x for the square, no epsilon. ``residual``: of the sum
    x + res (input "res")."""
    x, nodes = ("xs", [n("Add", ["x", "res"], "xs")]) if residual else ("x", [])
    nodes += [n("Pow", [x, "two"], "sq") if square == "pow" else n("Mul", [x, x], "sq"), *mean("sq", "var", opset)]
    if eps:
        nodes += [n("Add", ["eps", "var"] if swap else ["var", "eps"], "ve"), n("Sqrt", ["ve"], "sd")]
    else:
        nodes += [n("Sqrt", ["var"], "sd")]
    if form == "reciprocal":
        nodes += [n("Reciprocal", ["sd"], "rc"), n("Mul", ["rc", x] if swap else [x, "rc"], "nd")]
    elif form == "one-div":
        nodes += [n("Div", ["one", "sd"], "rc"), n("Mul", [x, "rc"], "nd")]
    else:
        nodes += [n("Div", [x, "sd"], "nd")]
    nodes += [n("Mul", ["w", "nd"] if swap else ["nd", "w"], "y")] if weight else [n("Identity", ["nd"], "y")]
    return nodes


RMS_CONSTS = {"two": 2.0, "eps": 1e-6, "one": 1.0, "w": GAMMA, "axes": np.array([-1])}


@pytest.mark.parametrize("kw", [dict(), dict(form="one-div"), dict(form="div"), dict(swap=True),
                                dict(weight=False), dict(opset=18), dict(square="mul", form="div"), dict(eps=False)],
                         ids=["dynamo", "legacy", "div", "swapped", "no-weight", "opset18", "x*x", "no-eps"])
def test_rms_normalization_forms(kw):
    """Before opset 23 (no ONNX RMS op), the RMSNorm of a residual sum becomes com.microsoft
    SkipSimplifiedLayerNormalization, a valid model; alone it is refused (issue 27: it became
    onnxruntime's SimplifiedLayerNormalization in the ONNX domain, which onnx.checker refuses)."""
    opset = kw.get("opset", 17)
    m = build(rms_nodes(residual=True, **kw), RMS_CONSTS, opset=opset, extra_inputs=[("res", ("b", "s", H))])
    out, _ = fires("rms_normalization", m, tol=TOL, **CPU)
    counts = ops(out)
    assert counts["com.microsoft:SkipSimplifiedLayerNormalization"] == 1, counts
    assert set(counts) <= {"com.microsoft:SkipSimplifiedLayerNormalization", "Identity"}, counts
    onnx.checker.check_model(out, full_check=True)
    refuses("rms_normalization", build(rms_nodes(**kw), RMS_CONSTS, opset=opset),
            "ONNX has no RMS normalization before opset 23", **CPU)


def test_rms_normalization_sum_read_on():
    """A pre-norm residual stream: the sum is read after the norm too; the fused node's fourth
    output gives it."""
    nodes = rms_nodes(residual=True)
    nodes[-1] = n("Mul", ["nd", "w"], "yn")
    nodes.append(n("Add", ["yn", "xs"], "y"))
    m = build(nodes, RMS_CONSTS, extra_inputs=[("res", ("b", "s", H))])
    out, _ = fires("rms_normalization", m, tol=TOL, **CPU)
    assert ops(out) == {"com.microsoft:SkipSimplifiedLayerNormalization": 1, "Add": 1}
    onnx.checker.check_model(out, full_check=True)


def test_rms_normalization_opset23_standard():
    """At opset 23 the installed onnxruntime (1.2x) has the standard RMSNormalization's CPU kernel."""
    out, _ = fires("rms_normalization", build(rms_nodes(opset=23), RMS_CONSTS, opset=23), tol=TOL, **CPU)
    assert ops(out) == {"RMSNormalization": 1}


def test_rms_normalization_opset23_residual_is_skip():
    """At opset 23 too, the RMSNorm of a residual sum is one SkipSimplifiedLayerNormalization."""
    m = build(rms_nodes(opset=23, residual=True), RMS_CONSTS, opset=23, extra_inputs=[("res", ("b", "s", H))])
    out, _ = fires("rms_normalization", m, tol=TOL, **CPU)
    assert ops(out) == {"com.microsoft:SkipSimplifiedLayerNormalization": 1}


def test_rms_normalization_refuses():
    """Each pattern refuses the other's form, with the reason: an RMS normalization of a centred
    value is the layer normalization (whatever makes that rule refuse it: here opset 16)."""
    for opset in (17, 16):
        mismatches("rms_normalization", build(ln_nodes(), LN_CONSTS, opset=opset),
                   "a mean is subtracted (layer_normalization's form)", **CPU)
    mismatches("layer_normalization", build(rms_nodes(), RMS_CONSTS), "no mean is subtracted", **CPU)


def test_rms_normalization_refuses_unknown_hidden_size():
    m = build(rms_nodes(weight=False), RMS_CONSTS, shape=("b", "s", "h"))
    refuses("rms_normalization", m, "the last dimension is unknown", **CPU)


# --- what the patterns say (rules/_normalization_parts.py, tried at the Sqrt) ----------------------------


def test_layer_normalization_is_named_after_its_sqrt_and_lists_what_it_replaced_inside_out():
    """The fused node takes the Sqrt's name and place (the pattern is tried at the Sqrt); its
    provenance lists the nodes from the Sqrt out: what the Sqrt reads, the division, the centring,
    the scale, the shift; the output keeps its name."""
    out, _ = fires("layer_normalization", build(ln_nodes(divide="reciprocal"), LN_CONSTS), tol=TOL, **CPU)
    (node,) = [x for x in out.graph.node if x.op_type == "LayerNormalization"]
    assert node.name == "Sqrt_sd::layer_normalization" and node.output[0] == "y"
    meta = {p.key: p.value for p in node.metadata_props}
    assert json.loads(meta["onnxopt.replaced"]) == ["Sqrt_sd", "Add_ve", "ReduceMean_var", "Pow_sq", "Reciprocal_r",
                                                    "Mul_nd", "Sub_d", "ReduceMean_mu", "Mul_sc", "Add_y"]


def test_layer_normalization_takes_the_scale_only_where_the_division_is_read_by_it_alone():
    """The longest form that fits: where the normalized value is also read elsewhere, the fusion
    ends at the division (a LayerNormalization with a scale of ones), the scale and shift stay."""
    nodes = ln_nodes()[:-1] + [n("Add", ["sc", "nd"], "y")]  # (nd read by the scale and by the sum)
    out, _ = fires("layer_normalization", build(nodes, LN_CONSTS), tol=TOL, **CPU)
    assert ops(out) == {"LayerNormalization": 1, "Mul": 1, "Add": 1}
    ln = next(x for x in out.graph.node if x.op_type == "LayerNormalization")
    assert len(ln.input) == 2  # (no shift)


def test_normalization_refuses_a_sqrt_read_twice():
    """The Sqrt must be read by the division alone (it goes with the rewrite)."""
    nodes = ln_nodes()[:-1] + [n("Add", ["sc", "beta"], "yb"), n("Add", ["yb", "sd"], "y")]
    mismatches("layer_normalization", build(nodes, LN_CONSTS), "'sd' (Sqrt) has 2 uses", **CPU)


def test_normalization_refuses_a_sqrt_no_division_reads():
    nodes = ln_nodes(affine=False)[:-2] + [n("Relu", ["sd"], "y")]
    for rule in ("layer_normalization", "rms_normalization"):
        mismatches(rule, build(nodes, LN_CONSTS), "the Sqrt is not read by a division of the input", **CPU)


def test_rms_normalization_of_a_difference_that_is_not_centred_fuses():
    """x - Relu(x) is no centring (Not(centred) lets it through): its RMS normalization fuses;
    x - ReduceMean(z) of another value neither; only x - mean(x) is the layer form."""
    for sub in ([n("Relu", ["x"], "r"), n("Sub", ["x", "r"], "xd")],
                [*mean("res", "mz", 23), n("Sub", ["x", "mz"], "xd")]):
        nodes = [*sub] + [_renamed(node, "x", "xd") for node in rms_nodes(opset=23, form="div")]
        m = build(nodes, RMS_CONSTS, opset=23, extra_inputs=[("res", ("b", "s", H))])
        out, _ = fires("rms_normalization", m, tol=TOL, **CPU)
        assert ops(out)["RMSNormalization"] == 1 and not ops(out)["Sqrt"], ops(out)
        mismatches("layer_normalization", m, "no mean is subtracted", **CPU)


def _renamed(node, old: str, new: str):
    node.input[:] = [new if i == old else i for i in node.input]
    return node


# --- the folds after a fused node -------------------------------------------------------------------

def test_scale_folds():
    w2 = RNG.uniform(0.5, 1.5, H).astype(np.float32)
    ln = build([n("LayerNormalization", ["x", "gamma", "beta"], "l", axis=-1), n("Mul", ["l", "w2"], "m"),
                n("Add", ["bb", "m"], "y")], {"gamma": GAMMA, "beta": BETA, "w2": w2, "bb": BETA})
    out, _ = fires("layer_normalization_affine_fold", ln, times=2, tol=TOL, **CPU)
    assert ops(out) == {"LayerNormalization": 1}
    sln = build([n("SimplifiedLayerNormalization", ["x", "gamma"], "l", axis=-1, epsilon=1e-6),
                 n("Mul", ["w2", "l"], "y")], {"gamma": GAMMA, "w2": w2})
    out, _ = fires("rms_normalization_scale_fold", sln, tol=TOL, check=False, **CPU)
    assert ops(out) == {"SimplifiedLayerNormalization": 1}
    rms = build([n("RMSNormalization", ["x", "gamma"], "l", axis=-1), n("Mul", ["l", "w2"], "y")],
                {"gamma": GAMMA, "w2": w2}, opset=23)
    out, _ = fires("rms_normalization_std_scale_fold", rms, tol=TOL, **CPU)
    assert ops(out) == {"RMSNormalization": 1}


def test_skip_scale_fold_takes_the_weight_and_keeps_the_sum():
    """An exporter's RMSNorm weight Mul left after SkipSimplifiedLayerNormalization (a Cast stood between when
    it was fused) goes into its gamma; the input + skip output (the next residual) reads the same."""
    w2 = RNG.uniform(0.5, 1.5, H).astype(np.float32)
    skip = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "r", "gamma"], ["l", "", "", "sum"],
                            domain="com.microsoft", name="sln", epsilon=1e-6)
    m = build([skip, n("Mul", ["w2", "l"], "m"), n("Add", ["m", "sum"], "y")], {"gamma": GAMMA, "w2": w2},
              extra_inputs=[("r", ("b", "s", H))], ms=True)
    out, _ = fires("skip_simplified_layer_normalization_scale_fold", m, tol=TOL, **CPU)
    assert ops(out) == {"com.microsoft:SkipSimplifiedLayerNormalization": 1, "Add": 1}
    unread = build([skip, n("Mul", ["l", "x"], "y")], {"gamma": GAMMA}, extra_inputs=[("r", ("b", "s", H))], ms=True)
    refuses("skip_simplified_layer_normalization_scale_fold", unread, "not followed by a Mul", **CPU)


def test_scale_fold_refuses_a_scale_that_underflows():
    """Issue 27: gamma 1e-20 times a following 1e-20 is 1e-40, a float32 subnormal: not folded."""
    nodes = [n("LayerNormalization", ["x", "gamma", "beta"], "l", axis=-1), n("Mul", ["l", "w2"], "m"),
             n("Mul", ["m", "big"], "y")]
    m = build(nodes, {"gamma": np.full(H, 1e-20, np.float32), "beta": np.zeros(H, np.float32),
                      "w2": np.full(H, 1e-20, np.float32), "big": np.float32(1e38)})
    refuses("layer_normalization_affine_fold", m, "the folded scale is subnormal in float32", **CPU)


def test_scale_fold_refusals():
    ln = build([n("LayerNormalization", ["x", "gamma", "beta"], "l", axis=-1), n("Mul", ["l", "x"], "y")],
               {"gamma": GAMMA, "beta": BETA})
    refuses("layer_normalization_affine_fold", ln, "not followed by a Mul (or Add) by a constant", **CPU)
    sln = build([n("SimplifiedLayerNormalization", ["x", "gamma"], "l", axis=-1), n("Add", ["l", "b"], "y")],
                {"gamma": GAMMA, "b": BETA})
    refuses("rms_normalization_scale_fold", sln, "not followed by a Mul", check=False, **CPU)
    rms = build([n("RMSNormalization", ["x", "gamma"], "l", axis=-1),
                 n("Mul", ["l", "w2"], "y")], {"gamma": GAMMA, "w2": RNG.uniform(1, 2, (3, 1))}, opset=23,
                shape=("b", 3, H))
    refuses("rms_normalization_std_scale_fold", rms, "the constant varies along another axis", **CPU)


# --- SkipLayerNormalization -------------------------------------------------------------------------

def skip_model(*, bias=True, shared=False, skip_shape=("b", "s", H), rms=False, swap=False):
    """y = LN((x + bias) + r) [+ the sum, as a pre-LN residual stream reads it]."""
    nodes = []
    a = "x"
    if bias:
        nodes.append(n("Add", ["bias", "x"] if swap else ["x", "bias"], "xb"))
        a = "xb"
    nodes.append(n("Add", ["r", a] if swap else [a, "r"], "s"))
    if rms:
        nodes.append(n("SimplifiedLayerNormalization", ["s", "gamma"], "l", axis=-1, epsilon=1e-6))
    else:
        nodes.append(n("LayerNormalization", ["s", "gamma", "beta"], "l", axis=-1, epsilon=1e-5))
    nodes.append(n("Add", ["l", "s"], "y") if shared else n("Identity", ["l"], "y"))
    return build(nodes, {"bias": BETA, "gamma": GAMMA, "beta": BETA}, extra_inputs=[("r", skip_shape)])


@pytest.mark.parametrize("kw", [dict(), dict(bias=False), dict(shared=True), dict(swap=True),
                                dict(skip_shape=(1, "s", H)), dict(skip_shape=("s", H))],
                         ids=["bias", "no-bias", "residual-read", "swapped", "skip-1SH", "skip-SH"])
def test_skip_layer_normalization(kw):
    out, _ = fires("skip_layer_normalization", skip_model(**kw), tol=TOL, **CPU)
    counts = ops(out)
    assert counts["com.microsoft:SkipLayerNormalization"] == 1 and not counts["LayerNormalization"], counts
    assert counts["Add"] == (1 if kw.get("shared") else 0), counts
    node = next(x for x in out.graph.node if x.op_type == "SkipLayerNormalization")
    assert len(node.input) == (5 if kw.get("bias", True) else 4)


def test_skip_simplified_layer_normalization():
    out, _ = fires("skip_simplified_layer_normalization", skip_model(rms=True, shared=True), tol=TOL, check=False,
                   **CPU)
    assert ops(out)["com.microsoft:SkipSimplifiedLayerNormalization"] == 1


def test_skip_layer_normalization_refuses():
    refuses("skip_layer_normalization", skip_model(skip_shape=("b", 1, H)),
            "the operands broadcast in a way the fused op does not take", **CPU)
    refuses("skip_simplified_layer_normalization", skip_model(rms=True, skip_shape=("b", 1, H)),
            "the operands broadcast in a way", check=False, **CPU)
    m = skip_model(bias=False)
    m.graph.node[-2].attribute.append(helper.make_attribute("stash_type", 0))
    refuses("skip_layer_normalization", m, "stash_type 0", **CPU)


def test_skip_layer_normalization_refuses_sum_read_first():
    """The sum is read by a node placed before the LayerNormalization: the fused node, which takes
    the LayerNormalization's place, would compute it too late."""
    nodes = [n("Add", ["x", "r"], "s"), n("Relu", ["s"], "early"),
             n("LayerNormalization", ["s", "gamma", "beta"], "l", axis=-1), n("Add", ["l", "early"], "y")]
    m = build(nodes, {"gamma": GAMMA, "beta": BETA}, extra_inputs=[("r", ("b", "s", H))])
    refuses("skip_layer_normalization", m, "the sum is read before the normalization", **CPU)


pytestmark = pytest.mark.usefixtures("every_fusion")


# --- the zoo ---------------------------------------------------------------------------------------

SKIP = {"bert": 2 * 4 + 1, "gpt2": 2 * 4 + 1, "minilm": 2 * 6 + 1}
BROADCAST = "the operands broadcast in a way the fused op does not take"
NO_EMBEDDING = ["embed_layer_normalization", "embed_layer_normalization_skip"]


@pytest.mark.parametrize("name", zoo_cases.TRANSFORMERS)
def test_zoo_skip_layer_normalization(name):
    """Every LayerNormalization of the exports (opset 17/18 exports write LayerNormalization, not
    its decomposition) takes the residual Add before it: 2 per layer, + the embeddings' sum, +
    GPT-2's final one (GPT-2's first is the embeddings' sum). With the input shapes fixed every
    one fuses; with dynamic axes those whose operands' sizes cannot be proven equal (the legacy
    exports' reshapes computed at run time lose the axes' names) stay unfused, with the reason.
    The outputs agree within 1e-4 of their range at two shapes, and with onnxruntime's own
    optimizations on too. (The embedding fusion, which takes BERT's and MiniLM's embedding sum and
    its normalization first, is left out: tests/rules/test_embedding.py has it.)"""
    src = zoo_cases.load(name)
    kind = name.split("-")[0]
    out, report = optimize(src, **CPU, return_report=True, disable=NO_EMBEDDING)
    counts = ops(out)
    st = report.rules["skip_layer_normalization"]
    assert counts["com.microsoft:SkipLayerNormalization"] == st.fired
    assert st.fired + counts["LayerNormalization"] == SKIP[kind], counts
    assert set(st.reasons) <= {BROADCAST}, dict(st.reasons)
    if name.endswith("dynamo"):
        assert st.fired == SKIP[kind]  # the dynamo exports name every axis
    zoo_cases.assert_close(name, src, out)
    zoo_cases.assert_close(name, src, out, ort_optimize=True)
    fixed, report = optimize(src, **CPU, input_shapes={i.name: [2, 16] for i in src.graph.input},
                             return_report=True, disable=NO_EMBEDDING)
    assert ops(fixed)["com.microsoft:SkipLayerNormalization"] == SKIP[kind]
    assert ops(fixed)["LayerNormalization"] == 0


def test_skip_layer_normalization_refuses_differently_named_dynamic_axes():
    """a[batch, seq, H] + b[batch, cond, H]: the Add broadcasts b when cond is 1, which the fused
    op refuses at run time: not proven equal, not fused."""
    nodes = [n("Add", ["x", "b"], "s"), n("LayerNormalization", ["s", "gamma", "beta"], "y", axis=-1)]
    m = build(nodes, {"gamma": GAMMA, "beta": BETA}, shape=("batch", "seq", H), extra_inputs=[("b", ("batch", "cond", H))])
    refuses("skip_layer_normalization", m, BROADCAST, **CPU)


# --- torch's own exports of the decompositions ------------------------------------------------------

def _torch_block():
    torch = pytest.importorskip("torch", reason="torch exports the decompositions")

    class Block(torch.nn.Module):
        """A hand-written LayerNorm (as older BERT code has it), GELU (erf), Llama's RMSNorm (its
        forward as transformers writes it: to float32, pow, mean, rsqrt, back, * weight), GELU (tanh)."""

        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.g = torch.nn.Parameter(torch.rand(H, generator=g) + 0.5)
            self.b = torch.nn.Parameter(torch.rand(H, generator=g))
            self.w = torch.nn.Parameter(torch.rand(H, generator=g) + 0.5)
            self.gelu = torch.nn.GELU()
            self.fast = torch.nn.GELU(approximate="tanh")

        def forward(self, x):
            u = x.mean(-1, keepdim=True)
            v = (x - u).pow(2).mean(-1, keepdim=True)
            h = self.g * ((x - u) / torch.sqrt(v + 1e-12)) + self.b
            h = self.gelu(h) * 2.0 + x  # (a product above the GELU's: the lowest one is the GELU)
            f = h.to(torch.float32)
            f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)
            h = self.w * f.to(h.dtype)
            return self.fast(h)

    return torch, Block().eval()


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_torch_exports(tmp_path, exporter):
    """torch.onnx's decompositions (opset 17 legacy, 18 dynamo) of a LayerNorm, GELU, RMSNorm and
    tanh-GELU each fuse on ort-cpu; outputs within 1e-5."""
    import warnings

    torch, block = _torch_block()
    x = torch.randn(2, 5, H)
    path = tmp_path / f"block-{exporter}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(block, (x,), str(path), input_names=["x"], output_names=["y"], opset_version=17,
                              dynamic_axes={"x": {0: "b", 1: "s"}}, dynamo=False)
        else:
            pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
            dim = torch.export.Dim
            torch.onnx.export(block, (x,), str(path), input_names=["x"], output_names=["y"], opset_version=18,
                              dynamic_shapes=({0: dim("b"), 1: dim("s")},), dynamo=True)
    src = onnx.load(str(path))
    out, report = optimize(src, **CPU, return_report=True)
    counts = ops(out)
    assert counts["LayerNormalization"] == 1 and counts["com.microsoft:Gelu"] == 1, counts
    # (the RMSNorm reads gelu(h) * 2 + x: the Add becomes its skip input)
    assert counts["com.microsoft:SkipSimplifiedLayerNormalization"] == 1, counts
    assert counts["com.microsoft:FastGelu"] == 1, counts
    assert not counts["ReduceMean"] and not counts["Erf"] and not counts["Tanh"], counts
    from conftest import run_ort

    feeds = {"x": np.random.default_rng(1).standard_normal((3, 7, H)).astype(np.float32)}
    for a, b in zip(run_ort(src, feeds), run_ort(out, feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_llama_rms_normalization(tmp_path, exporter):
    """A small transformers Llama (2 layers, random weights): of its 5 RMSNorms the 4 after a
    residual Add fuse into SkipSimplifiedLayerNormalization, the first (on the embeddings) stays
    (opset < 23: no ONNX op for it); logits within 1e-4 of their range, padded rows included; the
    output passes onnx.checker."""
    import warnings

    torch = pytest.importorskip("torch", reason="torch exports the model")
    pytest.importorskip("transformers", reason="transformers builds the model")
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    from conftest import run_ort

    from onnxopt.models.transformers_models import import_transformers

    transformers = import_transformers()
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.llama = llama

        def forward(self, ids, mask):
            return self.llama(input_ids=ids, attention_mask=mask, use_cache=False).logits

    ids, mask = torch.randint(0, 512, (2, 16)), torch.ones(2, 16, dtype=torch.int64)
    path = tmp_path / f"llama-{exporter}.onnx"
    names = dict(input_names=["input_ids", "attention_mask"], output_names=["logits"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            axes = {0: "b", 1: "s"}
            torch.onnx.export(Logits(), (ids, mask), str(path), opset_version=17, dynamo=False,
                              dynamic_axes={"input_ids": axes, "attention_mask": axes}, **names)
        else:
            b, s = torch.export.Dim("b"), torch.export.Dim("s", min=2, max=64)
            torch.onnx.export(Logits(), (ids, mask), str(path), opset_version=18, dynamo=True,
                              dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}), **names)
    src = onnx.load(str(path))
    out = optimize(src, **CPU)
    counts = ops(out)
    assert counts["com.microsoft:SkipSimplifiedLayerNormalization"] == 4, counts
    # the first (on the embeddings, no residual Add) stays: ONNX has no RMS op before opset 23
    assert not counts["SimplifiedLayerNormalization"] and counts["ReduceMean"] == 1, counts
    onnx.checker.check_model(out, full_check=True)
    rng = np.random.default_rng(0)
    for batch, seq in ((2, 16), (1, 9)):
        m = np.ones((batch, seq), np.int64)
        m[1:, seq // 2:] = 0
        feeds = {"input_ids": rng.integers(0, 512, (batch, seq)).astype(np.int64), "attention_mask": m}
        for a, o in zip(run_ort(src, feeds), run_ort(out, feeds), strict=True):
            np.testing.assert_allclose(o, a, rtol=1e-4, atol=1e-4 * float(np.abs(a).max()))


# --- float16 with float32 statistics (transformers' LlamaRMSNorm in a float16 export) --------------

F16 = TensorProto.FLOAT16
W16 = RNG.uniform(0.5, 1.5, H).astype(np.float16)
TOL16 = 4e-3  # a few float16 ulps at the outputs' magnitudes: the export rounds twice (after the
# normalization and after the weight), the fused kernels once


def rms16_nodes(*, residual=True, form="reciprocal", scale32=None, read_on=False, weight=True, upcast_read=False):
    """``weight16 * Cast<float16>(x32 * rsqrt(mean(x32^2) + eps))`` with ``x32 = Cast<float>(x16)``, x16
    the float16 residual sum x + res (``residual``) or x; torch.onnx dynamo's Reciprocal(Sqrt), legacy's
    Div(1, Sqrt) (``form="one-div"``). ``scale32``: a float32 scale before the Cast back (Gemma's
    (1 + w).float()); ``read_on``: the sum read after the norm (the next residual); ``upcast_read``: the
    float32 copy read elsewhere too."""
    x, nodes = ("xs", [n("Add", ["x", "res"], "xs")]) if residual else ("x", [])
    nodes += [n("Cast", [x], "x32", to=TensorProto.FLOAT), n("Pow", ["x32", "two"], "sq"),
              n("ReduceMean", ["sq", "axes"], "var"), n("Add", ["var", "eps"], "ve"), n("Sqrt", ["ve"], "sd")]
    if form == "reciprocal":
        nodes += [n("Reciprocal", ["sd"], "rc")]
    else:
        nodes += [n("Div", ["one", "sd"], "rc")]
    nodes += [n("Mul", ["x32", "rc"], "nd")]
    if scale32 is not None:
        nodes += [n("Mul", ["nd", "g32"], "nd_scaled")]
    nodes += [n("Cast", ["nd_scaled" if scale32 is not None else "nd"], "n16", to=F16)]
    last = "y" if not (read_on or upcast_read) else "yn"
    nodes += [n("Mul", ["w", "n16"], last)] if weight else [n("Identity", ["n16"], last)]
    if read_on:
        nodes += [n("Add", ["yn", x], "y")]
    if upcast_read:
        nodes += [n("Cast", ["x32"], "x16_again", to=F16), n("Add", ["yn", "x16_again"], "y")]
    return nodes


def rms16_model(*, opset=18, residual=True, scale32=None, **kw):
    consts = [init("two", np.float32(2.0)), init("eps", np.float32(1e-6)), init("one", np.float32(1.0)),
              init("w", W16), init("axes", np.array([-1], np.int64))]
    if scale32 is not None:
        consts.append(init("g32", np.asarray(scale32, np.float32)))
    ins = [tinfo("x", ["b", "s", H], F16)] + ([tinfo("res", ["b", "s", H], F16)] if residual else [])
    return model(rms16_nodes(residual=residual, scale32=scale32, **kw), ins, [tinfo("y", 3, F16)], consts,
                 opset=opset)


def hidden16(scale: float, residual=True, seed=1) -> dict:
    """float16 hidden states of a decoder's magnitude (``scale``: 300 makes x^2 overflow float16, so
    statistics taken in float16 would give inf)."""
    rng = np.random.default_rng(seed)
    feeds = {"x": (rng.standard_normal((2, 5, H)) * scale).astype(np.float16)}
    if residual:
        feeds["res"] = (rng.standard_normal((2, 5, H)) * scale).astype(np.float16)
    return feeds


def rms16_reference(feeds, *, residual=True) -> np.ndarray:
    """The RMSNorm in float64, weight applied: what both graphs round to float16."""
    x = feeds["x"].astype(np.float64) + (feeds["res"].astype(np.float64) if residual else 0)
    x = x.astype(np.float16).astype(np.float64) if residual else x  # (the float16 sum both compute)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * W16.astype(np.float64)


@pytest.mark.parametrize("scale", [1.0, 300.0], ids=["unit", "overflows-fp16-squares"])
@pytest.mark.parametrize("form", ["reciprocal", "one-div"], ids=["dynamo", "legacy"])
@pytest.mark.parametrize("target", ["ort-cpu", "ort-cuda"])
def test_rms_normalization_float16_upcast_is_skip_simplified(form, scale, target):
    """The residual sum in float16, cast up, normalized in float32, cast back and weighted in float16
    becomes one SkipSimplifiedLayerNormalization on the float16 operands and weight (its kernels take
    the statistics in float32), the weight inside, no Cast left; onnxruntime CPU's outputs agree with
    the export's within float16 rounding, both within 2 ulps of a float64 reference, at hidden states
    whose squares overflow float16 too; the sum read on comes from the fused node's fourth output."""
    m = rms16_model(form=form, read_on=True)
    feeds = hidden16(scale)
    out, _ = fires("rms_normalization", m, feeds=feeds, tol=TOL16 * scale, target=target)
    assert ops(out) == {"com.microsoft:SkipSimplifiedLayerNormalization": 1, "Add": 1}, ops(out)
    node = next(x for x in out.graph.node if x.op_type == "SkipSimplifiedLayerNormalization")
    w = next(i for i in out.graph.initializer if i.name == node.input[2])
    assert w.data_type == F16 and np.array_equal(onnx.numpy_helper.to_array(w), W16)
    onnx.checker.check_model(out, full_check=True)
    alone = rms16_model(form=form)  # (the normalization's own output, against float64)
    fused, _ = fires("rms_normalization", alone, feeds=feeds, tol=TOL16 * scale, target=target)
    ref = rms16_reference(feeds)
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    for graph in (alone, fused):
        got = run_ort(graph, feeds)[0].astype(np.float64)
        assert np.all(np.abs(got - ref) <= 2 * ulp), np.abs(got - ref).max()


def test_rms_normalization_float16_upcast_alone():
    """Without a residual Add: at opset 23 the standard RMSNormalization on the float16 input and weight
    (its stash_type 1 is this very computation: statistics in float32, normalized value cast back, then
    weighted); before opset 23 refused with the reason. (portable: rules/standard_normalization.py.)"""
    feeds = hidden16(1.0, residual=False)
    rule, target = "rms_normalization", "ort-cpu"
    out, _ = fires(rule, rms16_model(opset=23, residual=False), feeds=feeds, tol=TOL16, target=target)
    assert ops(out) == {"RMSNormalization": 1}, ops(out)
    node = out.graph.node[0]
    assert [(a.name, a.i) for a in node.attribute if a.name == "stash_type"] in ([], [("stash_type", 1)])
    assert onnx.numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == node.input[1])).dtype \
        == np.float16
    onnx.checker.check_model(out, full_check=True)
    refuses(rule, rms16_model(residual=False), "ONNX has no RMS normalization before opset 23 "
            "(the model imports 18)", feeds=feeds, target=target)


def test_rms_normalization_float16_upcast_float32_scale():
    """A float32 scale before the Cast back (Gemma's (1 + w).float()) is taken into the fused op where
    float16 holds it exactly, the float16 weight after the Cast left to the scale fold; refused with
    the reason where it does not."""
    feeds = hidden16(1.0)
    out, _ = fires("rms_normalization", rms16_model(scale32=W16.astype(np.float32) * 2), feeds=feeds, tol=2 * TOL16,
                   **CPU)
    assert ops(out) == {"com.microsoft:SkipSimplifiedLayerNormalization": 1, "Mul": 1}, ops(out)
    refuses("rms_normalization", rms16_model(scale32=np.full(H, 1 + 2 ** -12, np.float32)), feeds=feeds,
            reason="nor in float16 with float32 statistics, as the float32 scale is not exact in float16", **CPU)


def test_rms_normalization_float16_upcast_refuses_a_float32_copy_read_elsewhere():
    """The float32 copy read elsewhere: not the float16 form; the float32 one (before this form was
    known, the only one) on the Cast's output, which at opset 18 without an Add there is refused with
    both reasons; at opset 23 the float32 RMSNormalization, between the two Casts."""
    refuses("rms_normalization", rms16_model(upcast_read=True), "the float16 input's float32 copy is read elsewhere",
            feeds=hidden16(1.0), **CPU)
    out, _ = fires("rms_normalization", rms16_model(upcast_read=True, opset=23), feeds=hidden16(1.0), tol=TOL16,
                   **CPU)
    assert ops(out)["RMSNormalization"] == 1 and ops(out)["Cast"] == 3, ops(out)


def test_rms_normalization_float16_without_the_cast_back_stays_float32():
    """The float32 result read as float32 (no Cast back): the float32 form as before, on the Cast's
    output (a residual Add in float16 before the Cast is not the fused op's)."""
    nodes = rms16_nodes(weight=False)[:-2]  # (ends at the float32 normalized value "nd")
    nodes.append(n("Identity", ["nd"], "y"))
    consts = [init("two", np.float32(2.0)), init("eps", np.float32(1e-6)), init("axes", np.array([-1], np.int64))]
    m = model(nodes, [tinfo("x", ["b", "s", H], F16), tinfo("res", ["b", "s", H], F16)], [tinfo("y", 3)], consts,
              opset=23)
    out, _ = fires("rms_normalization", m, feeds=hidden16(1.0), tol=TOL, **CPU)
    assert ops(out) == {"Add": 1, "Cast": 1, "RMSNormalization": 1, "Identity": 1}, ops(out)


def test_llama_rms_normalization_float16_legacy_export(tmp_path):
    """transformers' LlamaRMSNorm in float16 through torch.onnx legacy (Cast up, Div(1, Sqrt), Cast back,
    weight; the dynamo exporter's Reciprocal spelling is rms16_nodes' default, its export too slow for
    here): the norm of the residual sum becomes SkipSimplifiedLayerNormalization in float16, the sum
    read on from its fourth output; the norm of the bare input is refused (opset 17); outputs within
    float16 rounding on onnxruntime CPU."""
    import warnings

    torch = pytest.importorskip("torch", reason="torch exports the model")
    pytest.importorskip("transformers", reason="transformers has LlamaRMSNorm")
    from onnxopt.models.transformers_models import import_transformers

    import_transformers()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = LlamaRMSNorm(64, eps=1e-6), LlamaRMSNorm(64, eps=1e-6)
            for norm in (self.n1, self.n2):
                torch.nn.init.uniform_(norm.weight, 0.5, 1.5)

        def forward(self, x, r):
            s = x + r
            return self.n1(s) + s, self.n2(x)

    torch.manual_seed(0)
    x, r = torch.randn(2, 5, 64).half(), torch.randn(2, 5, 64).half()
    path = tmp_path / "rms16-legacy.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Block().half().eval(), (x, r), str(path), opset_version=17, dynamo=False,
                          input_names=["x", "r"], dynamic_axes={"x": {0: "b", 1: "s"}, "r": {0: "b", 1: "s"}})
    src = onnx.load(str(path))
    out, report = fires("rms_normalization", src, feeds={"x": x.numpy(), "r": r.numpy()}, tol=8 * TOL16, **CPU)
    counts = ops(out)
    assert counts["com.microsoft:SkipSimplifiedLayerNormalization"] == 1 and counts["Pow"] == 1, counts
    assert "ONNX has no RMS normalization before opset 23" in " ".join(report.rules["rms_normalization"].reasons)
    skip = next(x for x in out.graph.node if x.op_type == "SkipSimplifiedLayerNormalization")
    assert len(skip.output) == 4 and skip.output[3]
    onnx.checker.check_model(out, full_check=True)
