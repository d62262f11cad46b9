"""Every output is valid ONNX and a fixpoint (issue 27 item 4).

For each target (portable, ort-cpu, ort-cuda) and each model: the small models the fusion tests
build (attention blocks in BERT, GPT-2 and cross-attention styles, LayerNorm/RMSNorm with and
without the residual Add, GELU forms, Conv + BatchNormalization, the RMSNorm alone and at opset 23)
and the zoo's transformers and a CNN where the zoo cache has them. The optimized model passes
``onnx.checker.check_model(full_check=True)`` (the attention fusion's com.microsoft Attention had no
com.microsoft import; the RMS fusion wrote onnxruntime's SimplifiedLayerNormalization in the ONNX
domain, which onnx does not define), onnxopt reads it again as an input (the checked bytes path),
and optimizing it again with the same options gives the same bytes.
"""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto

from onnxopt import optimize

from . import test_activation as act
from . import test_normalization as norm
from . import zoo_cases
from .test_attention import FORMS, attention_model
from .test_fusion import conv_bn_model
from .zoo_cases import every_fusion  # noqa: F401 (a fixture)

TARGETS = ["portable", "ort-cpu", "ort-cuda"]


def _rms_shared():
    nodes = norm.rms_nodes(residual=True)
    nodes[-1] = norm.n("Mul", ["nd", "w"], "yn")
    nodes.append(norm.n("Add", ["yn", "xs"], "y"))
    return norm.build(nodes, norm.RMS_CONSTS, extra_inputs=[("res", ("b", "s", norm.H))])


SYNTHETIC = {
    **{"attention-" + "-".join(str(v) for v in form.values()): (lambda form=form: attention_model(**form))
       for form in FORMS},
    "attention-fp16": lambda: attention_model(dtype=TensorProto.FLOAT16),
    "attention-underflowing-scale": lambda: _tiny_scale(attention_model(mask=None, guard=False)),
    "layer-norm": lambda: norm.build(norm.ln_nodes(), norm.LN_CONSTS),
    "skip-layer-norm-shared": lambda: norm.skip_model(shared=True),
    "rms-norm-residual": lambda: norm.build(norm.rms_nodes(residual=True), norm.RMS_CONSTS,
                                            extra_inputs=[("res", ("b", "s", norm.H))]),
    "rms-norm-residual-read-on": _rms_shared,
    "rms-norm-alone": lambda: norm.build(norm.rms_nodes(form="div"), norm.RMS_CONSTS),
    "rms-norm-opset23": lambda: norm.build(norm.rms_nodes(opset=23), norm.RMS_CONSTS, opset=23),
    "gelu-bias": lambda: act.build([act.n("Add", ["x", "c_b"], "xb"), *act.gelu_legacy(x="xb")],
                                   {**act.GELU_CONSTS, "c_b": act.np.linspace(-1, 1, act.H)}),
    "fast-gelu": lambda: act.build(act.fast_gelu_gpt2(), act.FAST_CONSTS),
    "conv-bn": lambda: conv_bn_model(),
}


def _tiny_scale(m: onnx.ModelProto) -> onnx.ModelProto:
    for i in m.graph.initializer:
        if i.name == "qk_scale":
            i.CopyFrom(onnx.numpy_helper.from_array(act.np.array(1e-25, act.np.float32), i.name))
    return m


def _check_output(m: onnx.ModelProto, target: str) -> onnx.ModelProto:
    out = optimize(m, target=target)
    onnx.checker.check_model(out, full_check=True)
    data = out.SerializeToString()
    again = optimize(data, target=target)  # (bytes: parsed and checked as any input file is)
    assert again == data, "a second optimize with the same options changed the model"
    return out


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_synthetic_outputs_are_valid_fixpoints(name, target, every_fusion):
    _check_output(SYNTHETIC[name](), target)


def test_fused_outputs_import_their_domains(every_fusion):
    """The attention fusion's output imports com.microsoft (it did not: onnx.checker failed); the
    RMSNorm of a residual sum is com.microsoft SkipSimplifiedLayerNormalization, none is
    SimplifiedLayerNormalization in the ONNX domain."""
    out = _check_output(attention_model(), "ort-cpu")
    assert {o.domain: o.version for o in out.opset_import}.get("com.microsoft") == 1
    assert any(n.op_type == "Attention" and n.domain == "com.microsoft" for n in out.graph.node)
    out = _check_output(SYNTHETIC["rms-norm-residual"](), "ort-cuda")
    assert [(n.domain, n.op_type) for n in out.graph.node] == [("com.microsoft", "SkipSimplifiedLayerNormalization")]


ZOO = ["bert-legacy", "gpt2-dynamo", "minilm-legacy", "mobilenet_v2-legacy"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_outputs_are_valid_fixpoints(name):
    m = zoo_cases.load(name)
    for target in TARGETS:
        _check_output(m, target)


def test_fusion_in_a_subgraph_imports_the_domain_in_the_model(every_fusion):
    """A GELU inside an If branch becomes com.microsoft Gelu; the import is the model's (a
    subgraph's imports are not written): the output passes the checker."""
    from onnx import helper

    branch = helper.make_graph(act.gelu_dynamo("x", "g"), "then", [], [helper.make_tensor_value_info("g", 1, None)])
    other = helper.make_graph([act.n("Relu", ["x"], "r")], "else", [], [helper.make_tensor_value_info("r", 1, None)])
    m = act.build([act.n("ReduceSum", ["x"], "s", keepdims=0), act.n("Greater", ["s", "c_zero"], "c"),
                   helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)],
                  {**act.GELU_CONSTS, "c_zero": 0.0})
    out = _check_output(m, "ort-cpu")
    node = next(n for n in out.graph.node if n.op_type == "If")
    body = next(a.g for a in node.attribute if a.name == "then_branch")
    assert [(n.domain, n.op_type) for n in body.node] == [("com.microsoft", "Gelu")]


def test_a_rule_writing_an_op_onnx_does_not_define_is_refused():
    """The driver refuses a rewrite into an operator of onnx's domain that onnx does not define at
    the model's opset (what rms_normalization did with SimplifiedLayerNormalization), with the
    reason; the model is left valid."""
    from onnxopt.core.pattern import Op, Rule

    rule = Rule("to_simplified", Op("Relu", "x"), lambda m, b: b.op("SimplifiedLayerNormalization", m["x"]))
    m = act.build([act.n("Relu", ["x"], "y")], {})
    out, report = optimize(m, rules=[rule], return_report=True)
    assert report.rules["to_simplified"].fired == 0
    assert any("onnx defines no SimplifiedLayerNormalization in domain 'ai.onnx' at opset 17" in r
               for r in report.rules["to_simplified"].reasons)
    onnx.checker.check_model(out, full_check=True)


def test_declare_domains_imports_what_nodes_use():
    """io.give_back's last step: a contrib op's domain, and a local function's (in the model and in
    the function), are imported."""
    import onnx_ir as ir
    from onnx import helper

    from onnxopt.ir.util import declare_domains

    fn = helper.make_function("local", "f", ["a"], ["b"], [helper.make_node("Gelu", ["a"], ["b"], domain="com.microsoft")],
                              opset_imports=[helper.make_opsetid("", 17)])
    m = act.build([helper.make_node("f", ["x"], ["y"], domain="local")], {})
    m.functions.append(fn)
    model = ir.from_proto(m)
    assert sorted(declare_domains(model)) == ["f:com.microsoft", "local"]
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    assert declare_domains(model) == []
