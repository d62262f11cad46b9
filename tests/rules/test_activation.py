"""rules/activation.py: GELU (erf form) -> com.microsoft Gelu (or the opset-20 Gelu), the tanh form ->
com.microsoft FastGelu, a 1-D bias added before -> BiasGelu / FastGelu's bias input.

Each form the exporters write (and the associations and operand orders a newer exporter may
choose) fuses, checked with onnxruntime CPU before and after (fp32, rtol = atol = 1e-5); each
refusal names its reason; the rules run on the onnxruntime targets only. The zoo's BERT, GPT-2
and MiniLM (both exporters) fuse one GELU per layer with the same outputs (rtol 1e-4)."""

from __future__ import annotations

import collections
import math

import numpy as np
import onnx
import pytest
from conftest import run_ort
from helpers import init, model, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize

from . import zoo_cases
from .zoo_cases import every_fusion  # noqa: F401 (a fixture)
from .check import fires, refuses

TOL = 1e-5
CPU = zoo_cases.ORT_CPU
SQRT2 = math.sqrt(2.0)
K = math.sqrt(2.0 / math.pi)
H = 8


def n(op, ins, outs, **kw):
    return helper.make_node(op, ins, [outs] if isinstance(outs, str) else outs, name=f"{op}_{outs}", **kw)


def build(nodes, consts, *, opset=17, dtype=TensorProto.FLOAT, ms=False, shape=("b", "s", H), outs=("y",)):
    """Input x [b, s, H] -> nodes -> y; ``consts``: name -> number or array (float32 unless an array)."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [init(k, np.asarray(v, dtype=np_dtype)) for k, v in consts.items()]
    m = model(nodes, [tinfo("x", list(shape), dtype)], [tinfo(o, len(shape), dtype) for o in outs], inits,
              opset=opset)
    if ms:
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


def ops(m) -> collections.Counter:
    return collections.Counter(f"{x.domain}:{x.op_type}" if x.domain else x.op_type for x in m.graph.node)


# --- the erf form --------------------------------------------------------------------------------

def gelu_legacy(x="x", y="y", div=True):
    """torch.onnx legacy: ((x * (1 + erf(x / sqrt2))) * 0.5)."""
    return [n("Div" if div else "Mul", [x, "c_sqrt2" if div else "c_rsqrt2"], "g_u"), n("Erf", ["g_u"], "g_e"),
            n("Add", ["g_e", "c_one"], "g_a"), n("Mul", [x, "g_a"], "g_m"), n("Mul", ["g_m", "c_half"], y)]


def gelu_dynamo(x="x", y="y"):
    """torch.onnx dynamo: x * (0.5 * (1 + erf(x / sqrt2)))."""
    return [n("Div", [x, "c_sqrt2"], "g_u"), n("Erf", ["g_u"], "g_e"), n("Add", ["c_one", "g_e"], "g_a"),
            n("Mul", ["c_half", "g_a"], "g_h"), n("Mul", [x, "g_h"], y)]


def gelu_half_first(x="x", y="y"):
    """(0.5 * x) * (1 + erf(x * 0.7071)), as GPT-2's tanh form is written."""
    return [n("Mul", [x, "c_half"], "g_h"), n("Mul", ["c_rsqrt2", x], "g_u"), n("Erf", ["g_u"], "g_e"),
            n("Add", ["g_e", "c_one"], "g_a"), n("Mul", ["g_h", "g_a"], y)]


def gelu_div2(x="x", y="y"):
    """(x * (1 + erf(x / sqrt2))) / 2."""
    return [n("Div", [x, "c_sqrt2"], "g_u"), n("Erf", ["g_u"], "g_e"), n("Add", ["g_e", "c_one"], "g_a"),
            n("Mul", ["g_a", x], "g_m"), n("Div", ["g_m", "c_two"], y)]


GELU_CONSTS = {"c_sqrt2": SQRT2, "c_rsqrt2": 1 / SQRT2, "c_one": 1.0, "c_half": 0.5, "c_two": 2.0}


@pytest.mark.parametrize("form", [gelu_legacy, gelu_dynamo, gelu_half_first, gelu_div2,
                                  lambda: gelu_legacy(div=False)],
                         ids=["legacy", "dynamo", "half-first", "div2", "mul-rsqrt2"])
def test_gelu_forms(form):
    out, _ = fires("gelu", build(form(), GELU_CONSTS), tol=TOL, **CPU)
    assert ops(out) == {"com.microsoft:Gelu": 1}


def test_gelu_inside_a_graph():
    """x is computed (and read elsewhere too); the GELU's output feeds another node."""
    nodes = [n("Relu", ["x"], "r"), *gelu_dynamo("r", "g"), n("Add", ["g", "r"], "y")]
    out, _ = fires("gelu", build(nodes, GELU_CONSTS), tol=TOL, **CPU)
    assert ops(out) == {"Relu": 1, "com.microsoft:Gelu": 1, "Add": 1}


def test_gelu_scaled_after():
    """gelu(x) * 3: the product above the GELU's stays a Mul reading the fused Gelu."""
    nodes = gelu_legacy(y="g") + [n("Mul", ["g", "c_three"], "y")]
    out, _ = fires("gelu", build(nodes, {**GELU_CONSTS, "c_three": 3.0}), tol=TOL, **CPU)
    assert ops(out) == {"com.microsoft:Gelu": 1, "Mul": 1}


def test_gelu_opset20_standard():
    """At opset 20 the installed onnxruntime (1.2x) has the standard Gelu's CPU kernel: it is used."""
    out, _ = fires("gelu", build(gelu_legacy(), GELU_CONSTS, opset=20), tol=TOL, **CPU)
    assert ops(out) == {"Gelu": 1}
    assert [o.domain for o in out.opset_import if o.domain == "com.microsoft"] == []


def test_gelu_cuda_target_fires():
    out, _ = fires("gelu", build(gelu_dynamo(), GELU_CONSTS), tol=TOL, target="ort-cuda")
    assert ops(out) == {"com.microsoft:Gelu": 1}


def test_gelu_portable_untouched():
    m = build(gelu_dynamo(), GELU_CONSTS)
    out = optimize(m)
    assert "com.microsoft:Gelu" not in ops(out) and "Gelu" not in ops(out)


@pytest.mark.parametrize("consts,reason", [
    ({**GELU_CONSTS, "c_sqrt2": 2.0}, "erf's input is not x / sqrt(2)"),
    ({**GELU_CONSTS, "c_half": 0.4}, "not 0.5 * x"),
    ({**GELU_CONSTS, "c_one": 2.0}, "is not followed by + 1"),
], ids=["scale", "half", "one"])
def test_gelu_refuses_other_constants(consts, reason):
    refuses("gelu", build(gelu_legacy(), consts), reason, **CPU)


def test_gelu_refuses_shared_erf():
    nodes = gelu_legacy(y="g") + [n("Add", ["g", "g_e"], "y")]
    refuses("gelu", build(nodes, GELU_CONSTS), "read by several nodes", **CPU)


def test_gelu_refuses_other_x():
    """x / sqrt2 under the erf, but another value z in the product."""
    nodes = [n("Relu", ["x"], "z"), n("Div", ["x", "c_sqrt2"], "g_u"), n("Erf", ["g_u"], "g_e"),
             n("Add", ["g_e", "c_one"], "g_a"), n("Mul", ["z", "g_a"], "g_m"), n("Mul", ["g_m", "c_half"], "y")]
    refuses("gelu", build(nodes, GELU_CONSTS), "not a polynomial of the product's x", **CPU)


def test_fast_gelu_refuses_double_on_cpu():
    """onnxruntime's CPU FastGelu takes float only (its registry says so)."""
    refuses("fast_gelu", build(fast_gelu_gpt2(), FAST_CONSTS, dtype=TensorProto.DOUBLE),
            "no FastGelu kernel for double on ort-cpu", **CPU)


# --- the tanh form -------------------------------------------------------------------------------

def fast_gelu_gpt2(x="x", y="y", cube="pow"):
    """GPT-2 (both exporters): 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""
    if cube == "pow":
        c = [n("Pow", [x, "c_three"], "f_p")]
    else:
        c = [n("Mul", [x, x], "f_sq"), n("Mul", ["f_sq", x], "f_p")]
    return [n("Mul", [x, "c_half"], "f_h"), *c, n("Mul", ["f_p", "c_k2"], "f_c"), n("Add", [x, "f_c"], "f_s"),
            n("Mul", ["f_s", "c_k"], "f_t"), n("Tanh", ["f_t"], "f_th"), n("Add", ["f_th", "c_one"], "f_a"),
            n("Mul", ["f_h", "f_a"], y)]


FAST_CONSTS = {"c_half": 0.5, "c_three": 3.0, "c_k2": 0.044715, "c_k": K, "c_one": 1.0}


@pytest.mark.parametrize("cube", ["pow", "mul"])
def test_fast_gelu(cube):
    out, _ = fires("fast_gelu", build(fast_gelu_gpt2(cube=cube), FAST_CONSTS), tol=TOL, **CPU)
    assert ops(out) == {"com.microsoft:FastGelu": 1}


def test_fast_gelu_expanded_polynomial():
    """tanh(k * x + k * 0.044715 * x^3): the product distributed."""
    nodes = [n("Mul", ["x", "c_half"], "f_h"), n("Pow", ["x", "c_three"], "f_p"), n("Mul", ["f_p", "c_kk"], "f_c"),
             n("Mul", ["c_k", "x"], "f_l"), n("Add", ["f_l", "f_c"], "f_t"), n("Tanh", ["f_t"], "f_th"),
             n("Add", ["c_one", "f_th"], "f_a"), n("Mul", ["f_a", "f_h"], "y")]
    out, _ = fires("fast_gelu", build(nodes, {**FAST_CONSTS, "c_kk": K * 0.044715}), tol=TOL, **CPU)
    assert ops(out) == {"com.microsoft:FastGelu": 1}


def test_fast_gelu_refuses_other_coefficient():
    refuses("fast_gelu", build(fast_gelu_gpt2(), {**FAST_CONSTS, "c_k2": 0.1}), "tanh's input is not", **CPU)


def test_fast_gelu_refuses_plain_tanh():
    refuses("fast_gelu", build([n("Tanh", ["x"], "t"), n("Mul", ["t", "x"], "y")], {}), "not followed by + 1",
            **CPU)


# --- biases --------------------------------------------------------------------------------------

def ms_model(op, *, bias_shape=(H,), opset=17, **attrs):
    rng = np.random.default_rng(0)
    nodes = [n("Add", ["x", "bias"], "xb"),
             helper.make_node(op, ["xb"], ["y"], name=op, domain="" if op == "Gelu" and opset >= 20 else "com.microsoft",
                              **attrs)]
    m = build(nodes, {"bias": rng.standard_normal(bias_shape).astype(np.float32)}, ms=True, opset=opset)
    return m


def test_bias_gelu():
    out, _ = fires("bias_gelu", ms_model("Gelu"), tol=TOL, **CPU)
    assert ops(out) == {"com.microsoft:BiasGelu": 1}


def test_bias_gelu_std():
    out, _ = fires("bias_gelu_std", ms_model("Gelu", opset=20), tol=TOL, **CPU)
    assert ops(out) == {"com.microsoft:BiasGelu": 1}


def test_fast_gelu_bias():
    out, _ = fires("fast_gelu_bias", ms_model("FastGelu"), tol=TOL, **CPU)
    assert ops(out) == {"com.microsoft:FastGelu": 1}
    assert len(out.graph.node[0].input) == 2


@pytest.mark.parametrize("rule,op,opset", [("bias_gelu", "Gelu", 17), ("bias_gelu_std", "Gelu", 20),
                                           ("fast_gelu_bias", "FastGelu", 17)])
def test_bias_refusals(rule, op, opset):
    refuses(rule, ms_model(op, bias_shape=(1, H), opset=opset), "rank 2, not 1", **CPU)
    refuses(rule, ms_model(op, bias_shape=(1,), opset=opset), "the bias has 1 values, the last dimension is 8",
            **CPU)


def test_bias_refuses_unknown_last_dim():
    m = ms_model("Gelu")
    m.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "h"
    refuses("bias_gelu", m, "the last dimension of the input is unknown", **CPU)


pytestmark = pytest.mark.usefixtures("every_fusion")


# --- the zoo -------------------------------------------------------------------------------------

FUSED = {"bert": "com.microsoft:Gelu", "gpt2": "com.microsoft:FastGelu", "minilm": "com.microsoft:BiasGelu"}


@pytest.mark.parametrize("name", zoo_cases.TRANSFORMERS)
def test_zoo_gelu(name):
    """One GELU per layer fuses (MiniLM's with its bias: BERT's and GPT-2's random-weight biases
    are zero, folded away); the outputs agree within 1e-4 of their range at two shapes."""
    src = zoo_cases.load(name)
    kind = name.split("-")[0]
    out, report = optimize(src, **CPU, return_report=True,
                           disable=["skip_layer_normalization", "layer_normalization", "rms_normalization"])
    counts = ops(out)
    assert counts[FUSED[kind]] == zoo_cases.LAYERS[kind], counts
    assert counts["Erf"] == 0 and counts["Pow"] == 0
    if kind != "gpt2":  # the pooler's tanh is no GELU: the miss is reported with its reason
        assert counts["Tanh"] == 1
        refusals = report.as_dict()["rules"]["fast_gelu"]["top_refusals"]
        assert "the Tanh output is a graph output" in str(refusals), refusals
    zoo_cases.assert_close(name, src, out)
