"""onnxscript's rewrite rules (RewriteRule, RewriteRuleSet) run inside onnxopt's driver: they fire
with their checks, appear in onnxopt's statistics and provenance, and their bugs are loud.

Real rules from onnxscript's own library on real exports (BERT from the dynamo exporter,
torchvision mobilenet_v2), compared with onnxscript's own ``rewrite()`` and with the original on
onnxruntime; a hand-written rule with a check; a rules file from the command line; the features
that cannot be mapped refused with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import assert_same_outputs, run_ort
from helpers import model, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize
from onnxopt.errors import RuleBug, RuleError
from onnxopt.ir.util import REPLACED_KEY, RULE_KEY

pytest.importorskip("onnxscript", reason="onnxscript (the 'export' extra) provides the rules")
from onnxscript import rewriter  # noqa: E402
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleClassBase, RewriteRuleSet  # noqa: E402
from onnxscript.rewriter.rules import common as library  # noqa: E402

# onnxscript's common rules, as its own rewrite() would take them (commuted variants too)
LIBRARY = RewriteRuleSet([
    library.add_0_rule, library.sub_0_rule, library.mul_by_1_rule, library.div_by_1_rule,
    library.dropout_inference_rule, library.dropout_zero_rule, library.no_op_cast_rule, library.no_op_expand_rule,
    library.no_op_transpose_rule, library.transpose_transpose_rule, library.unsqueeze_unsqueeze_rule,
    library.reshape_reshape_rule, library.cast_cast_rule, library.flatten_to_reshape_rule,
    library.squeeze_reshape_1d_rule, library.one_reshape_matmul_reshape_rule,
    library.two_reshapes_matmul_reshape_rule, library.cast_constant_of_shape_rule,
    library.cast_constant_of_shape_without_value_rule, library.collapse_slice_rule, library.collapse_slice2_rule,
    library.slice_split_rule, library.materialize_reshape_shape_rule, library.remove_optional_bias_from_gemm_rule,
], commute=True)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    pytest.importorskip("torch", reason="torch (the 'export' extra) exports BERT")
    pytest.importorskip("transformers", reason="transformers (the 'export' extra) builds BERT")
    from onnxopt.models import transformers_models

    root = tmp_path_factory.mktemp("bert")
    return transformers_models.export("bert", root / "bert-dynamo.onnx", exporter="dynamo", cache=root)


def _bert_feeds(path, batch, seq):
    from onnxopt.models import inputs

    names = [i.name for i in onnx.load(path).graph.input]
    return inputs.text_feeds(names, batch, seq, 1000, seed=seq)


def _same_on_ort(before, after, feeds, rtol=1e-5):
    for want, got in zip(run_ort(before, feeds), run_ort(after, feeds)):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5)


def _provenance(proto) -> Counter:
    """Rule -> the rewrites its nodes in ``proto`` come from (one per distinct replaced list)."""
    made = {}
    for node in proto.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        if RULE_KEY in meta:
            made.setdefault(meta[RULE_KEY], set()).add(meta[REPLACED_KEY])
    return Counter({rule: len(rewrites) for rule, rewrites in made.items()})


# -- onnxscript's library on a real model ------------------------------------------------------


def test_library_rules_fire_in_onnxopts_driver_like_onnxscripts_rewrite(bert):
    original = onnx.load(bert)
    out, report = optimize(original, rules=LIBRARY, return_report=True)
    fired = report.fired
    assert {"CastIdentity", "UnsqueezeUnsqueeze", "TransposeIdentity", "add_0_rule"} <= set(fired), fired
    # statistics as for onnxopt's rules: tried, matched, refused with onnxscript's reasons
    cast = report.rules["CastIdentity"]
    assert cast.tried >= cast.matched > cast.fired > 0 and cast.refused > 0
    assert cast.reasons["Input and output types are not the same"] == cast.refused
    assert report.rules["MaterializeReshapeShape"].reasons  # its check's own words
    # provenance: every node a rule made names it (and what it replaced)
    made = _provenance(out)
    assert made == Counter(fired)
    replaced = [json.loads({p.key: p.value for p in n.metadata_props}[REPLACED_KEY]) for n in out.graph.node
                if any(p.key == RULE_KEY and p.value == "UnsqueezeUnsqueeze" for p in n.metadata_props)]
    assert all(len(names) == 2 for names in replaced)
    # the same graph as onnxscript's own driver makes with the same rules
    theirs = rewriter.rewrite(onnx.load(bert), LIBRARY)
    assert Counter(n.op_type for n in out.graph.node) == Counter(n.op_type for n in theirs.graph.node)
    assert len(out.graph.node) < len(original.graph.node)
    for batch, seq in ((1, 7), (3, 16)):
        _same_on_ort(original, out, _bert_feeds(bert, batch, seq))


def test_onnxscript_rule_beside_the_builtin_rules_on_a_real_cnn(tmp_path):
    """extra_rules: onnxscript's batch-norm fusion in the full pipeline, onnxopt's own disabled."""
    pytest.importorskip("torch", reason="torch (the 'export' extra) exports mobilenet_v2")
    from onnxopt.models import torchvision_models

    try:
        torchvision_models.import_torchvision()
    except ImportError:
        pytest.skip("torchvision (the 'export' extra) builds mobilenet_v2")
    src = torchvision_models.export("mobilenet_v2", tmp_path / "mobilenet_v2.onnx", exporter="legacy")
    out, report = optimize(onnx.load(src), extra_rules=[library.fuse_batchnorm_into_conv_rule],
                           disable=["conv_bn_fold"], return_report=True)
    assert report.fired["FuseBatchNormIntoConv"] == report.before["BatchNormalization"] > 10
    assert "BatchNormalization" not in report.after and "conv_bn_fold" not in report.rules
    assert _provenance(out)["FuseBatchNormIntoConv"] == report.fired["FuseBatchNormIntoConv"]
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    _same_on_ort(onnx.load(src), out, {"input": x}, rtol=1e-4)


# -- a hand-written rule with a check ------------------------------------------------------------


def _divisor_pattern(op, x, c):
    return op.Div(x, c)


def _divisor_is_a_float_scalar(context, x, c):
    if c.const_value is None:
        return MatchResult().fail("the divisor is not a constant")
    value = c.const_value.numpy()
    if value.size != 1 or value.dtype.kind != "f":
        return MatchResult().fail("the divisor is not a float scalar")
    return True


def _times_reciprocal(op, x, c):
    value = c.const_value.numpy()
    return op.Mul(x, op.Constant(value=ir.tensor((1 / value).astype(value.dtype))))


DIV_TO_MUL = RewriteRule(_divisor_pattern, _times_reciprocal, _divisor_is_a_float_scalar, name="div_to_mul_reciprocal")


def test_hand_written_rule_fires_on_a_real_model(bert):
    out, report = optimize(onnx.load(bert), rules=[DIV_TO_MUL], return_report=True)
    divs = sum(n.op_type == "Div" for n in onnx.load(bert).graph.node)
    assert report.fired == {"div_to_mul_reciprocal": divs} and divs > 0  # BERT's GELU: x / sqrt(2)
    assert "Div" not in report.after and _provenance(out) == {"div_to_mul_reciprocal": divs}
    _same_on_ort(onnx.load(bert), out, _bert_feeds(bert, 2, 9), rtol=1e-4)


def test_hand_written_rule_check_refuses_with_its_reason():
    nodes = [helper.make_node("Div", ["x", "two"], ["a"], name="by_two"),
             helper.make_node("Div", ["a", "d"], ["b"], name="by_input"),
             helper.make_node("Div", ["b", "pair"], ["y"], name="by_pair")]
    m = model(nodes, [tinfo("x", [2, 3]), tinfo("d", [2, 3])], [tinfo("y", [2, 3])],
              [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
               helper.make_tensor("pair", TensorProto.FLOAT, [2, 1], [2.0, 4.0])])
    out, report = optimize(m, rules=[DIV_TO_MUL], return_report=True)
    st = report.rules["div_to_mul_reciprocal"]
    assert (st.tried, st.matched, st.fired, st.refused) == (3, 3, 1, 2)
    assert st.reasons == {"the divisor is not a constant": 1, "the divisor is not a float scalar": 1}
    assert [n.op_type for n in out.graph.node] == ["Constant", "Mul", "Div", "Div"]
    rng = np.random.default_rng(0)
    assert_same_outputs(m, out, {"x": rng.standard_normal((2, 3)).astype(np.float32),
                                 "d": rng.uniform(1, 2, (2, 3)).astype(np.float32)})


# -- features: commute, several output nodes, visitors -------------------------------------------


def test_commuted_variants_are_one_rule():
    nodes = [helper.make_node("Mul", ["x", "one"], ["a"], name="right"),
             helper.make_node("Mul", ["one", "a"], ["b"], name="left"),
             helper.make_node("Relu", ["b"], ["y"], name="relu")]
    m = model(nodes, [tinfo("x", [4])], [tinfo("y", [4])], [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    out, report = optimize(m, rules=library.mul_by_1_rule.commute(), return_report=True)
    assert report.fired == {"mul_by_1_rule": 2}  # (onnxscript's unnamed rule, named by its module variable)
    assert [n.op_type for n in out.graph.node] == ["Identity", "Identity", "Relu"]
    assert_same_outputs(m, out, {"x": np.arange(4, dtype=np.float32) - 2})


def _rotate_half(last_dim=8):
    """Slices of the two halves of the last axis (the rotary embedding's rotate_half), the upper
    half first: onnxscript's matcher takes the first pair of Slice nodes that fits the pattern's
    structure, and with the lower half first that is (lower, lower), which its check refuses, in
    its own rewrite() as in onnxopt's driver."""
    ints = lambda name, v: helper.make_tensor(name, TensorProto.INT64, [1], [v])  # noqa: E731
    nodes = [helper.make_node("Slice", ["x", "half", "end", "last"], ["hi"], name="slice_hi"),
             helper.make_node("Slice", ["x", "zero", "half", "last"], ["lo"], name="slice_lo"),
             helper.make_node("Neg", ["hi"], ["neg"], name="neg"),
             helper.make_node("Concat", ["neg", "lo"], ["y"], axis=-1, name="concat")]
    inits = [ints("zero", 0), ints("half", last_dim // 2), ints("end", last_dim), ints("last", -1)]
    # (opset 18: the rule makes a Split with num_outputs whatever the model's opset)
    return model(nodes, [tinfo("x", [2, last_dim])], [tinfo("y", [2, last_dim])], inits, opset=18)


def test_a_pattern_with_two_output_nodes_replaces_both():
    m = _rotate_half()
    out, report = optimize(m, rules=[library.slice_split_rule], return_report=True)
    assert report.fired == {"SlicesSplit": 1}
    assert [n.op_type for n in out.graph.node] == ["Split", "Neg", "Concat"]
    assert [n.op_type for n in rewriter.rewrite(m, [library.slice_split_rule]).graph.node] == \
        ["Split", "Neg", "Concat"]  # as onnxscript's own driver does
    split = out.graph.node[0]
    assert {p.key: p.value for p in split.metadata_props}[REPLACED_KEY] == '["slice_lo", "slice_hi"]'
    assert_same_outputs(m, out, {"x": np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)})


def _pair_rule() -> RewriteRule:
    """Add(x, y) and Mul(x, z), two output nodes, become Sub and Div."""

    def pair(op, x, y, z):
        return op.Add(x, y), op.Mul(x, z)

    def fused(op, x, y, z):
        return op.Sub(x, y), op.Div(x, z)

    return RewriteRule(pair, fused, name="pair")


def test_a_replacement_reading_a_later_value_is_refused():
    """Two output nodes, the second reading a value computed after the first: a replacement
    placed before the first could not read it; refused, the model left as it was."""

    nodes = [helper.make_node("Add", ["x", "y"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["z"], name="later"),
             helper.make_node("Mul", ["x", "z"], ["p"], name="mul"),
             helper.make_node("Concat", ["s", "p"], ["out"], axis=0, name="concat")]
    m = model(nodes, [tinfo("x", [3]), tinfo("y", [3])], [tinfo("out", [6])])
    out, report = optimize(m, rules=[_pair_rule()], return_report=True)
    assert report.fired == {} and report.rules["pair"].refused == 1
    assert report.rules["pair"].reasons == {"the replacement reads 'z', computed after 'add'": 1}
    assert [n.op_type for n in out.graph.node] == ["Add", "Relu", "Mul", "Concat"]


def test_an_output_read_before_the_root_is_refused():
    """Two output nodes, the second (Mul) first in the graph with a reader before the first (Add):
    the replacement, placed before the Add, would come after that reader; refused, the model
    left as it was (onnxscript's own rewrite() leaves it unsorted)."""

    nodes = [helper.make_node("Mul", ["x", "z"], ["p"], name="mul"),
             helper.make_node("Relu", ["p"], ["r"], name="early_reader"),
             helper.make_node("Add", ["x", "y"], ["s"], name="add"),
             helper.make_node("Concat", ["s", "r"], ["out"], axis=0, name="concat")]
    m = model(nodes, [tinfo("x", [3]), tinfo("y", [3]), tinfo("z", [3])], [tinfo("out", [6])])
    out, report = optimize(m, rules=[_pair_rule()], return_report=True)
    assert report.fired == {} and report.rules["pair"].reasons == {"'p' is read before 'add', where the "
                                                                  "replacement would compute it": 1}
    onnx.checker.check_model(out)
    assert [n.op_type for n in out.graph.node] == ["Mul", "Relu", "Add", "Concat"]


class _CountingRule(RewriteRuleClassBase):
    """Relu(Relu(x)) -> Relu(x), counting its setup and cleanup (graph_pre/post_visitor)."""

    events: list = []

    def setup(self):
        self.events.append("setup")

    def cleanup(self):
        self.events.append("cleanup")

    def pattern(self, op, x):
        return op.Relu(op.Relu(x))

    def check(self, context, x):
        self.events.append("check")
        return True

    def rewrite(self, op, x):
        return op.Relu(x)


def test_setup_and_cleanup_frame_each_driver_run():
    _CountingRule.events = []
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Relu", ["b"], ["y"])]
    m = model(nodes, [tinfo("x", [2])], [tinfo("y", [2])])
    out, report = optimize(m, rules=[_CountingRule.rule()], return_report=True)
    assert report.fired == {"_CountingRule": 2} and [n.op_type for n in out.graph.node] == ["Relu"]
    events = _CountingRule.events
    assert events[0] == "setup" and events[-1] == "cleanup" and events.count("setup") == events.count("cleanup")
    assert "check" in events


# -- what cannot be mapped, and bugs -------------------------------------------------------------


def _relu_relu(op, x):
    return op.Relu(op.Relu(x))


def _custom_relu(op, x):
    return op.MyRelu(x, _domain="custom")


def test_unmappable_features_are_refused_with_one_line():
    as_function = RewriteRule(_relu_relu, _custom_relu, as_function=True, name="relus_as_function")
    m = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", [2])], [tinfo("y", [2])])
    cases = [
        (as_function, r"^onnxscript rule relus_as_function: as_function=True .* is not supported by onnxopt's driver$"),
        (_CountingRule, r"^onnxscript rule _CountingRule: a RewriteRuleClassBase; pass its rule\(\)"),
        (_CountingRule(), r"^onnxscript rule _CountingRule: a RewriteRuleClassBase; pass its rule\(\)"),
        (rewriter.pattern.Pattern(_relu_relu, name="just_a_pattern"),
         r"^onnxscript rule just_a_pattern: a Pattern matches but rewrites nothing"),
    ]
    for rules, message in cases:
        with pytest.raises(RuleError, match=message) as err:
            optimize(m, extra_rules=[rules])
        assert "\n" not in str(err.value)


def _boom(context, x):
    return {}["missing"]


def test_a_bug_in_a_check_is_loud():
    buggy = RewriteRule(_relu_relu, lambda op, x: op.Relu(x), _boom, name="buggy")
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r1"), helper.make_node("Relu", ["a"], ["y"], name="r2")]
    m = model(nodes, [tinfo("x", [2])], [tinfo("y", [2])])
    with pytest.raises(RuleBug, match=r"^rule buggy raised KeyError: 'missing' in its condition at node 'r2'$"):
        optimize(m, rules=[buggy], strict=True)
    out, report = optimize(m, rules=[buggy], strict=False, return_report=True)
    assert report.errors == [{"rule": "buggy", "node": "r2", "phase": "condition",
                              "exception": "KeyError: 'missing'"}]
    assert report.rules["buggy"].errors == 1 and "buggy" in report.warnings[0]
    assert [n.op_type for n in out.graph.node] == ["Relu", "Relu"]


# -- the command line ----------------------------------------------------------------------------


RULES_FILE = """\
    from onnxscript.rewriter import MatchResult, RewriteRule
    from onnxscript.rewriter.rules.common import no_op_cast_rule, unsqueeze_unsqueeze_rule


    def div(op, x, c):
        return op.Div(x, c)


    def constant_divisor(context, x, c):
        return True if c.const_value is not None else MatchResult().fail("not a constant")


    def times_reciprocal(op, x, c):
        return op.Mul(x, op.Reciprocal(c))


    div_rule = RewriteRule(div, times_reciprocal, constant_divisor)
    RULES = [div_rule, no_op_cast_rule, unsqueeze_unsqueeze_rule]
"""


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "onnxopt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd)


def test_rules_file_with_onnxscript_rules_from_the_command_line(bert, tmp_path):
    rules = tmp_path / "my_rules.py"
    rules.write_text(textwrap.dedent(RULES_FILE))
    dst, report = tmp_path / "out.onnx", tmp_path / "report.json"
    run = _cli(bert, "-o", dst, "--rules", rules, "--json", report)
    assert run.returncode == 0, run.stderr
    assert "div_rule" in run.stdout and "UnsqueezeUnsqueeze" in run.stdout  # the rules table names them
    stats = json.loads(report.read_text())["rules"]
    assert stats["div_rule"]["fired"] > 0 and stats["UnsqueezeUnsqueeze"]["fired"] > 0
    assert stats["CastIdentity"]["tried"] > 0
    made = _provenance(onnx.load(dst))
    assert made["div_rule"] == stats["div_rule"]["fired"]
    _same_on_ort(onnx.load(bert), onnx.load(dst), _bert_feeds(bert, 2, 11), rtol=1e-4)
    listed = _cli("--list-rules", "--rules", rules)
    assert listed.returncode == 0 and "div_rule" in listed.stdout


def test_rules_file_with_an_unmappable_rule_exits_2_with_one_line(tmp_path):
    rules = tmp_path / "bad_rules.py"
    rules.write_text(textwrap.dedent("""\
        from onnxscript.rewriter import RewriteRule
        def relus(op, x): return op.Relu(op.Relu(x))
        def call(op, x): return op.MyRelu(x, _domain="custom")
        RULES = [RewriteRule(relus, call, as_function=True, name="relus_as_function")]
    """))
    src = tmp_path / "m.onnx"
    onnx.save(model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", [2])], [tinfo("y", [2])]), src)
    run = _cli(src, "-o", tmp_path / "out.onnx", "--rules", rules)
    assert run.returncode == 2 and not (tmp_path / "out.onnx").exists()
    assert run.stderr.splitlines() == [
        f"onnxopt: error: rules file {rules}: onnxscript rule relus_as_function: as_function=True (the matched "
        "nodes become a model-local function) is not supported by onnxopt's driver"]


def test_neither_onnxscript_nor_graphsurgeon_is_imported_by_onnxopt():
    """Both are optional: onnxopt imports them only when it meets their objects."""
    code = ("import sys, onnx\nfrom onnx import helper\nfrom onnxopt import optimize\n"
            "x = helper.make_tensor_value_info('x', 1, [2])\ny = helper.make_tensor_value_info('y', 1, [2])\n"
            "m = helper.make_model(helper.make_graph([helper.make_node('Identity', ['x'], ['y'])], 'g', [x], [y]))\n"
            "optimize(m)\nprint(sorted({m.split('.')[0] for m in sys.modules} & {'onnxscript', 'onnx_graphsurgeon'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
