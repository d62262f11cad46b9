"""The fixpoint driver: worklist, determinism, bounds, cycles, subgraphs, provenance, statistics."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import assert_same_outputs, run_ort
from helpers import bn_node, bn_params, feeds_for, init, model, op_types, tinfo
from onnx import TensorProto, helper

from onnxopt.library import passes
from onnxopt.core import pipeline
from onnxopt import Const, Op, Refuse, Rule, optimize
from onnxopt.core.driver import Driver
from onnxopt.errors import RuleError, UsageError
from onnxopt.models import synthetic


def test_synthetic_model_optimizes_and_matches():
    m = synthetic.build(200)
    out, report = optimize(m, return_report=True)
    assert report.before == {"Add": 40, "BatchNormalization": 40, "Conv": 40, "Identity": 40, "Relu": 40}
    assert report.after == {"Add": 40, "Conv": 40, "Relu": 40}
    assert report.fired == {"conv_bn_fold": 40, "identity_elimination": 40}
    a, _ = assert_same_outputs(m, out, synthetic.inputs(m), rtol=1e-4, atol=1e-3)
    assert np.abs(a[0]).max() > 1


def test_byte_identical_output():
    m = synthetic.build(300)
    first = optimize(m.SerializeToString())
    second = optimize(m.SerializeToString())
    assert first == second
    # and through an onnx_ir.Model, which is cloned, not consumed
    irm = ir.from_proto(m)
    a = ir.to_proto(optimize(irm)).SerializeToString()
    b = ir.to_proto(optimize(irm)).SerializeToString()
    assert a == b


def test_work_is_proportional_to_changes():
    """Rules are indexed by root op: nodes no rule is rooted at are never tried, and each node
    with candidate rules is visited a bounded number of times."""
    m = synthetic.build(1000)
    model_ir = ir.from_proto(m)
    from onnxopt.library.registry import builtin_rules

    driver = Driver(model_ir, builtin_rules())
    result = driver.run()
    # 200 BN + 200 Identity are the only nodes with op-specific rules rooted at them. Constant
    # folding looks at any node (its condition rejects a node with a non-constant input at the
    # first input), so each of the 1000 nodes is visited once, and each rewrite puts back a
    # bounded number of neighbours: never a whole-graph re-scan.
    assert result.rewrites == 400
    assert result.visited <= 1000 + 2 * 400
    tried = {name: st.tried for name, st in result.rules.items() if st.tried}
    assert tried["conv_bn_fold"] == 200
    assert tried["identity_elimination"] == 200
    assert tried["constant_folding"] <= 1000 + 2 * 400
    assert "dropout_elimination" not in tried


def _swap_rules():
    """Two rules that undo each other: Relu(Neg(x)) <-> Neg(Relu-ish) forms."""
    a_to_b = Rule("a_to_b", Op("Sigmoid", "x"), lambda m, b: b.op("HardSigmoid", m["x"], alpha=0.2, beta=0.5))
    b_to_a = Rule("b_to_a", Op("HardSigmoid", "x"), lambda m, b: b.op("Sigmoid", m["x"]))
    return [a_to_b, b_to_a]


def test_rules_that_undo_each_other_are_reported_not_looped():
    m = model([helper.make_node("Sigmoid", ["x"], ["y"], name="sig")], [tinfo("x", [3])], [tinfo("y", [3])])
    out, report = optimize(m, rules=_swap_rules(), return_report=True)
    assert report.cycles, "the cycle must be reported"
    assert report.cycles[0]["rule"] == "a_to_b"
    assert report.cycles[0]["created_by"] == "b_to_a"
    assert report.rewrites == 2  # a_to_b, b_to_a, then stopped before a_to_b again
    assert any("a_to_b" in w for w in report.warnings)
    assert op_types(out) == ["Sigmoid"]


def test_identical_subexpressions_are_not_mistaken_for_a_cycle():
    # Two distinct Identity nodes reading the same value: both removable, no cycle.
    nodes = [helper.make_node("Identity", ["x"], ["a"], name="i1"), helper.make_node("Identity", ["x"], ["b"], name="i2"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])])
    out, report = optimize(m, return_report=True)
    assert not report.cycles
    assert op_types(out) == ["Add"]


def test_rewrite_cap():
    m = synthetic.build(100)
    out, report = optimize(m, max_rewrites=5, return_report=True)
    assert report.rewrites == 5
    assert report.hit_limit
    assert any("limit" in w for w in report.warnings)
    assert_same_outputs(m, out, synthetic.inputs(m), rtol=1e-4, atol=1e-3)


def test_priority_decides_between_rules_at_one_root():
    m = synthetic.build(5)
    low = Rule("bn_never", Op("BatchNormalization", "x", "s", "b", "m", "v"),
               lambda m, b: b.op("Identity", m["x"]), priority=-5)
    out, report = optimize(m, extra_rules=[low], return_report=True)
    assert report.rules["conv_bn_fold"].fired == 1
    assert report.rules["bn_never"].fired == 0
    def decline(m, b):
        raise Refuse("declined on purpose")

    high = Rule("bn_first", Op("BatchNormalization", "x", "s", "b", "m", "v"), decline, priority=50)
    out, report = optimize(m, extra_rules=[high], return_report=True)
    assert report.rules["bn_first"].refused == 1
    assert report.rules["bn_first"].reasons["declined on purpose"] == 1
    assert report.rules["conv_bn_fold"].fired == 1


def test_condition_reason_is_recorded():
    m = synthetic.build(10)
    rule = Rule("never_relu", Op("Relu", "x"), lambda m, b: m["x"], condition=lambda m: "relu is precious")
    _, report = optimize(m, extra_rules=[rule], return_report=True)
    st = report.rules["never_relu"]
    # each Relu is tried when first visited and again when a neighbouring rewrite touches it
    # the pattern matched each time; the condition refused, counted as refusals (as Refuse is)
    assert st.tried >= 2 and st.fired == 0 and st.matched == st.tried == st.refused
    assert st.reasons["relu is precious"] == st.tried


@pytest.mark.parametrize("verdict", [False, np.False_, np.all(np.array([1.0]) > 5)])
def test_a_condition_returning_false_refuses_whatever_its_bool_type(verdict):
    """numpy's False (what np.all/np.any return) refuses like False: it is not a plan."""
    rule = Rule("drop_relu", Op("Relu", "x"), lambda m, b: m["x"], condition=lambda m: verdict)
    m = synthetic.build(10)
    out, report = optimize(m, rules=[rule], return_report=True)
    assert report.rules["drop_relu"].fired == 0
    assert report.rules["drop_relu"].reasons["condition refused"] == report.rules["drop_relu"].refused > 0
    assert op_types(out).count("Relu") == op_types(m).count("Relu")


def test_refuse_raised_in_a_condition_is_a_refusal_not_a_bug():
    """Refuse is the refusal a condition's helper may share with the replacement: counted as one."""

    def condition(m):
        raise Refuse("not this one")

    rule = Rule("refusing", Op("Relu", "x"), lambda m, b: m["x"], condition=condition)
    _, report = optimize(synthetic.build(10), rules=[rule], strict=True, return_report=True)
    st = report.rules["refusing"]
    assert st.errors == 0 and st.fired == 0 and st.refused == st.reasons["not this one"] > 0


def _buggy_rules():
    """Rules whose condition or replacement has a bug: a name the pattern never bound, an index
    error, a replacement that returns a string."""
    return {
        "typo_in_condition": Rule("typo_in_condition", Op("Relu", "x"), lambda m, b: m["x"],
                                  condition=lambda m: m["typo"] is None or None),
        "typo_const": Rule("typo_const", Op("Relu", "x"), lambda m, b: m["x"],
                           condition=lambda m: m.const("w") is None or None),
        "typo_node": Rule("typo_node", Op("Relu", "x", name="r"), lambda m, b: m["x"],
                          condition=lambda m: m.attr("relu", "alpha") or None),
        "index_error": Rule("index_error", Op("Relu", "x"), lambda m, b: [m["x"]][3]),
        "returns_text": Rule("returns_text", Op("Relu", "x"), lambda m, b: "x"),
    }


@pytest.mark.parametrize("name", sorted(_buggy_rules()))
def test_a_rule_bug_is_an_error_not_a_refusal(name):
    """A rule bug is loud: strict raises it with the rule, node and exception; otherwise it is
    reported apart from refusals and the model is left as it was there."""
    rule = _buggy_rules()[name]
    m = synthetic.build(10)
    phase = "replacement" if name in ("index_error", "returns_text") else "condition"
    with pytest.raises(RuleError, match=rf"rule {name} raised \w+.* in its {phase} at node"):
        optimize(m, rules=[rule], strict=True)
    out, report = optimize(m, rules=[rule], strict=False, return_report=True)
    st = report.rules[name]
    assert st.errors == st.matched >= 1 and st.fired == 0 and st.refused == 0
    assert report.errors[0]["rule"] == name and report.errors[0]["phase"] == phase
    [warning] = [w for w in report.warnings if name in w]  # one line per rule and exception, not per node
    assert "bug" in warning and (st.errors == 1 or f"at {st.errors} nodes" in warning)
    assert [n.op_type for n in out.graph.node].count("Relu") == [n.op_type for n in m.graph.node].count("Relu")


def test_strict_is_on_in_the_test_suite_and_off_by_default(monkeypatch):
    rule = _buggy_rules()["typo_in_condition"]
    with pytest.raises(RuleError):
        optimize(synthetic.build(10), rules=[rule])  # (conftest sets ONNXOPT_STRICT=1)
    monkeypatch.delenv("ONNXOPT_STRICT")
    _, report = optimize(synthetic.build(10), rules=[rule], return_report=True)
    assert report.errors


def test_duplicate_rule_names_rejected():
    rule = Rule("identity_elimination", Op("Identity", "x"), lambda m, b: m["x"])
    with pytest.raises(RuleError):
        optimize(synthetic.build(5), extra_rules=[rule])


def test_disable_unknown_rule_rejected():
    with pytest.raises(UsageError):
        optimize(synthetic.build(5), disable=["no_such_rule"])


@pytest.mark.parametrize("target, runs", [(None, False), ("portable", False), ("ort-cpu", False), ("cpu", False),
                                          ("ort-cuda", True), ("cuda", True)])
def test_target_filters_rules(target, runs):
    """Targets: portable (the default), ort-cpu, ort-cuda; cpu and cuda are aliases, for rules and
    callers alike."""
    cuda_only = Rule("relu_to_neg_neg", Op("Relu", "x"), lambda m, b: b.op("Relu", b.op("Identity", m["x"])),
                     targets={"cuda"})
    assert cuda_only.targets == {"ort-cuda"}
    assert Rule("r", Op("Relu", "x"), lambda m, b: m["x"], targets="cuda").targets == {"ort-cuda"}
    _, report = optimize(synthetic.build(5), extra_rules=[cuda_only], target=target, return_report=True)
    assert ("relu_to_neg_neg" in report.rules) is runs
    assert "conv_bn_fold" in report.rules  # the built-in rules are valid everywhere


def test_unknown_targets_are_refused():
    with pytest.raises(ValueError, match="unknown target 'tpu'"):
        Rule("bad", Op("Relu", "x"), lambda m, b: None, targets={"tpu"})
    with pytest.raises(UsageError, match="portable, ort-cpu, ort-cuda"):
        optimize(synthetic.build(5), target="gpu")


def test_provenance_on_new_nodes():
    m = synthetic.build(10)
    out = optimize(m)
    convs = [n for n in out.graph.node if n.op_type == "Conv"]
    props = {p.key: p.value for p in convs[0].metadata_props}
    assert props["onnxopt.rule"] == "conv_bn_fold"
    assert set(json.loads(props["onnxopt.replaced"])) == {"b0/bn", "b0/conv"}
    assert set(json.loads(props["onnxopt.sources"])) == {"b0/bn", "b0/conv"}


def test_provenance_sources_follow_chains_of_rewrites():
    """A node made from a node that was itself made by a rule names the original nodes."""
    relu_to_max = Rule("relu_to_max", Op("Relu", "x"), lambda m, b: b.op("Max", m["x"], b.const(np.float32(0), "zero")))
    max_to_clip = Rule("max_to_clip", Op("Max", "x", Const("z", value=0.0)),
                       lambda m, b: b.op("Clip", m["x"], m["z"]))
    m = model([helper.make_node("Relu", ["x"], ["y"], name="orig_relu")], [tinfo("x", [4])], [tinfo("y", [4])])
    out = optimize(m, rules=[relu_to_max, max_to_clip])
    assert op_types(out) == ["Clip"]
    props = {p.key: p.value for p in out.graph.node[0].metadata_props}
    assert props["onnxopt.rule"] == "max_to_clip"
    assert json.loads(props["onnxopt.sources"]) == ["orig_relu"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert_same_outputs(m, out, feeds_for(m))


def test_commutative_pattern_and_constant_value():
    add_zero = Rule("add_zero", Op("Add", "x", Const("z", value=0.0), commutative=True), lambda m, b: m["x"])
    nodes = [helper.make_node("Add", ["zero", "x"], ["a"], name="add1"),  # constant first
             helper.make_node("Add", ["a", "zero"], ["b"], name="add2"),
             helper.make_node("Add", ["b", "one"], ["y"], name="add3")]  # not zero: stays
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])],
              [init("zero", np.zeros(3, np.float32)), init("one", np.ones(3, np.float32))])
    out, report = optimize(m, rules=[add_zero], return_report=True)
    assert report.fired == {"add_zero": 2}
    assert op_types(out) == ["Add"]
    assert_same_outputs(m, out, feeds_for(m))


def _branch(name, nodes, out_name, inits=()):
    return helper.make_graph(nodes, name, [], [tinfo(out_name, 4)], list(inits))


def test_if_and_loop_bodies_are_rewritten_with_outer_values():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 4, 3, 3)).astype(np.float32)
    # then: Conv(x_outer, w_outer) + BN (params in the body) + Identity
    then_g = _branch("then", [
        helper.make_node("Conv", ["x", "w"], ["tc"], name="then/conv", pads=[1, 1, 1, 1]),
        bn_node("tc", "tb", "then"),
        helper.make_node("Identity", ["tb"], ["then_out"], name="then/id"),
    ], "then_out", bn_params("then", 4, rng))
    # else: BN directly on the outer input (-> Mul+Add), params from the outer graph
    else_g = _branch("else", [bn_node("x", "else_out", "outer")], "else_out")
    # loop body: adds an outer value each iteration, through an Identity
    loop_body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="loop/cond"),
         helper.make_node("Identity", ["bias"], ["b_id"], name="loop/id"),
         helper.make_node("Add", ["acc_in", "b_id"], ["acc_out"], name="loop/add")],
        "body",
        [tinfo("i", [], TensorProto.INT64), tinfo("cond_in", [], TensorProto.BOOL), tinfo("acc_in", 4)],
        [tinfo("cond_out", [], TensorProto.BOOL), tinfo("acc_out", 4)],
    )
    nodes = [
        helper.make_node("If", ["flag"], ["branch"], name="if", then_branch=then_g, else_branch=else_g),
        helper.make_node("Loop", ["trip", "", "branch"], ["y"], name="loop", body=loop_body),
    ]
    inits = [init("w", w), init("bias", np.full((1, 4, 1, 1), 0.5, np.float32)), init("trip", np.array(3, np.int64)),
             *bn_params("outer", 4, rng)]
    m = model(nodes, [tinfo("x", [1, 4, 5, 5]), tinfo("flag", [], TensorProto.BOOL)], [tinfo("y", 4)], inits)
    onnx.checker.check_model(m)
    out, report = optimize(m, return_report=True)
    onnx.checker.check_model(out)
    fired = report.fired
    assert fired["conv_bn_fold"] == 1
    assert fired["bn_to_mul_add"] == 1
    # then/id and loop/id go; loop/cond stays: its input is the body's own input, its output the body's output
    assert fired["identity_elimination"] == 2
    assert report.rules["identity_elimination"].refused == 1
    then_out = out.graph.node[0].attribute[0].g if out.graph.node[0].attribute[0].name == "then_branch" else \
        out.graph.node[0].attribute[1].g
    assert [n.op_type for n in then_out.node] == ["Conv"]
    x = rng.standard_normal((1, 4, 5, 5)).astype(np.float32)
    for flag in (True, False):
        feeds = {"x": x, "flag": np.array(flag)}
        np.testing.assert_allclose(run_ort(out, feeds)[0], run_ort(m, feeds)[0], rtol=1e-5, atol=1e-5)


def test_unused_nodes_and_initializers_removed_at_end():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"),
             helper.make_node("Neg", ["x"], ["dead"], name="dead")]
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])], [init("unused", np.ones(3, np.float32))])
    out = optimize(m)
    assert op_types(out) == ["Relu"]
    assert not out.graph.initializer


def test_replacement_arity_checked():
    bad = Rule("bad", Op("Relu", "x"), lambda m, b: [m["x"], m["x"]])
    m = model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [tinfo("x", [3])], [tinfo("y", [3])])
    out, report = optimize(m, rules=[bad], return_report=True)
    assert op_types(out) == ["Relu"]
    assert report.rules["bad"].refused == 1


def test_one_value_for_two_outputs_is_refused():
    rule = Rule("split_of_self_concat",
                Op("Split", Op("Concat", "a", "a", attrs={"axis": 0}), attrs={"axis": 0}),
                lambda m, b: (lambda v: (v, v))(b.op("Identity", m["a"])))
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Concat", ["a", "a"], ["c"], name="concat", axis=0),
             helper.make_node("Split", ["c"], ["y0", "y1"], name="split", axis=0, num_outputs=2)]
    m = model(nodes, [tinfo("x", [2])], [tinfo("y0", [2]), tinfo("y1", [2])], opset=18)
    out, report = optimize(m, rules=[rule], return_report=True)
    assert [o.name for o in out.graph.output] == ["y0", "y1"]
    assert report.rules["split_of_self_concat"].refused == 1
    assert_same_outputs(m, out, feeds_for(m))


def test_cycle_through_new_constants_is_detected_and_names_do_not_grow():
    mul_to_div = Rule("mul_to_div", Op("Mul", "x", Const("c")),
                      lambda m, b: b.op("Div", m["x"], b.const((1 / m.const("c")).astype(np.float32), "inv")))
    div_to_mul = Rule("div_to_mul", Op("Div", "x", Const("c")),
                      lambda m, b: b.op("Mul", m["x"], b.const((1 / m.const("c")).astype(np.float32), "inv")))
    m = model([helper.make_node("Mul", ["x", "two"], ["y"], name="mul")], [tinfo("x", [3])], [tinfo("y", [3])],
              [init("two", np.full(3, 2.0, np.float32))])
    out, report = optimize(m, rules=[mul_to_div, div_to_mul], return_report=True)
    assert report.cycles and not report.hit_limit
    assert report.rewrites <= 4
    assert all(len(n.name) < 40 for n in out.graph.node)
    assert_same_outputs(m, out, feeds_for(m))


# --- work grows with the graph, not with its square (issue 11, item 15) ----------------------


def _chain_model(nodes, inits, last):
    nodes = nodes + [helper.make_node("Add", ["x", last], ["y"], name="out")]
    return model(nodes, [tinfo("x", [4])], [tinfo("y", [4])], inits)


def _fan_out(n):
    """n Adds read one MatMul output (the nested MatMul of matmul_add_to_gemm sees a value with n
    uses at each of them); nothing is rewritten."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm")]
    nodes += [helper.make_node("Add", ["m", f"t{i}" if i else "x"], [f"t{i + 1}"], name=f"add{i}") for i in range(n)]
    return _chain_model(nodes, [init("w", np.eye(4, dtype=np.float32))], f"t{n}")


def _reshape_chain(n):
    """n Reshapes that collapse pair by pair: a chain of n rewrites, each from the last one's node."""
    nodes = [helper.make_node("Reshape", [f"t{i}" if i else "x", f"s{i % 2}"], [f"t{i + 1}"], name=f"r{i}")
             for i in range(n)]
    nodes.append(helper.make_node("Reshape", [f"t{n}", "s2"], ["r"], name="last"))
    return _chain_model(nodes, [init("s0", np.array([2, 2], np.int64)), init("s1", np.array([1, 4], np.int64)),
                                init("s2", np.array([4], np.int64))], "r")


def _duplicates(n):
    """n Muls by n equal initializers: deduplication merges them into one read by all."""
    nodes = [helper.make_node("Mul", [f"t{i}" if i else "x", f"w{i}"], [f"t{i + 1}"], name=f"mul{i}") for i in range(n)]
    return _chain_model(nodes, [init(f"w{i}", np.full(4, 2.0, np.float32)) for i in range(n)], f"t{n}")


def _twins(n):
    """n equal Relu(x) added up: common-subexpression elimination merges them into one."""
    nodes = [helper.make_node("Relu", ["x"], [f"r{i}"], name=f"relu{i}") for i in range(n)]
    nodes += [helper.make_node("Add", [f"t{i}" if i else "x", f"r{i}"], [f"t{i + 1}"], name=f"add{i}") for i in range(n)]
    return _chain_model(nodes, [], f"t{n}")


_SHAPES = {"shared_zero_chain": synthetic.shared_zero_chain, "fold_chain": synthetic.fold_chain,
           "fan_out": _fan_out, "reshape_chain": _reshape_chain, "duplicates": _duplicates, "twins": _twins}


def _work_per_node(build, n, monkeypatch) -> dict[str, float]:
    """What optimizing ``build(n)`` costs per node, counted: worklist pushes, rule match attempts,
    use entries copied by ``Value.uses()`` (onnx_ir copies them all on each call), origin-set
    elements in cycle keys, and characters of provenance JSON written or read."""
    from onnxopt.core import driver as driver_module
    from onnxopt.library.registry import builtin_rules

    counts = collections.Counter()
    real_uses, real_key = ir.Value.uses, Driver._cycle_key

    def uses(value):
        result = real_uses(value)
        counts["uses copied"] += len(result)
        return result

    def cycle_key(self, m):
        key, external = real_key(self, m)
        counts["origins"] += len(key[3])
        return key, external

    class CountingJson:
        @staticmethod
        def dumps(obj):
            text = json.dumps(obj)
            counts["provenance chars"] += len(text)
            return text

        @staticmethod
        def loads(text):
            counts["provenance chars"] += len(text)
            return json.loads(text)

    with monkeypatch.context() as patch:
        patch.setattr(ir.Value, "uses", uses)
        patch.setattr(Driver, "_cycle_key", cycle_key)
        patch.setattr(driver_module, "json", CountingJson)
        patch.setattr(passes, "json", CountingJson)
        proto = build(n)
        result = pipeline.run(ir.from_proto(proto), builtin_rules())
    counts["pushes"] = result.pushes
    counts["tries"] = sum(st.tried for name, st in result.rules.items() if name not in passes.BY_NAME)
    assert result.rewrites > 0 or build is _fan_out
    return {k: v / len(proto.graph.node) for k, v in counts.items()}


@pytest.mark.parametrize("shape", sorted(_SHAPES))
def test_work_per_node_does_not_grow_with_the_graph(shape, monkeypatch):
    """A chain of 50k nodes sharing one initializer took 710 s: after each rewrite the driver put
    every reader of that initializer back on the worklist. Each shape here once cost work
    proportional to the graph per rewrite; now the work per node is bounded, at 2k as at 8k."""
    small = _work_per_node(_SHAPES[shape], 2000, monkeypatch)
    large = _work_per_node(_SHAPES[shape], 8000, monkeypatch)
    for measure, bound in (("pushes", 12), ("tries", 8), ("uses copied", 12), ("origins", 70),
                           ("provenance chars", 200)):
        assert large.get(measure, 0) <= bound, (measure, small, large)
        assert large.get(measure, 0) <= 1.2 * small.get(measure, 0) + 0.5, (measure, small, large)


def test_the_shapes_still_optimize_fully():
    """Fewer re-queued nodes, the same result: each shape is optimized as far as before."""
    done = {"shared_zero_chain": lambda out: op_types(out) == ["Add"],
            "fold_chain": lambda out: op_types(out) == ["Add"] and len(out.graph.initializer) == 1,
            "reshape_chain": lambda out: op_types(out) == ["Add"],
            "duplicates": lambda out: len(out.graph.initializer) == 1,
            "twins": lambda out: op_types(out).count("Relu") == 1,
            "fan_out": lambda out: len(out.graph.node) == 52}
    assert set(done) == set(_SHAPES)
    for shape, build in _SHAPES.items():
        m = build(50)
        out = optimize(m)
        assert done[shape](out), (shape, op_types(out))
        assert_same_outputs(m, out, feeds_for(m))


def test_a_value_left_with_one_reader_puts_that_reader_back():
    """Readers of a value that loses a use are re-queued only when one is left. Relu(Neg(x)) is
    tried while the Neg has two readers and refused; then the other reader is rewritten away from
    the Neg, and the Relu must be tried again."""
    relu_of_neg = Rule("relu_of_neg", Op("Relu", Op("Neg", "v")),
                       lambda m, b: b.op("Neg", b.op("Min", m["v"], b.const(np.float32(0), "zero"))))
    sigmoid_of_neg = Rule("sigmoid_of_neg", Op("Sigmoid", Op("Neg", "v", shared=True)),
                          lambda m, b: b.op("Sub", b.const(np.float32(1), "one"), b.op("Sigmoid", m["v"])))
    nodes = [helper.make_node("Neg", ["x"], ["n"], name="neg"),
             helper.make_node("Relu", ["n"], ["r"], name="relu"),
             helper.make_node("Sigmoid", ["n"], ["s"], name="sigmoid"),
             helper.make_node("Add", ["r", "s"], ["y"], name="add")]
    m = model(nodes, [tinfo("x", [4])], [tinfo("y", [4])])
    out, report = optimize(m, rules=[relu_of_neg, sigmoid_of_neg], return_report=True)
    assert report.rules["relu_of_neg"].reasons == {"'n' (Neg) has 2 uses": 1}
    assert report.fired == {"sigmoid_of_neg": 1, "relu_of_neg": 1}
    assert "Neg" in op_types(out) and "Relu" not in op_types(out)
    assert_same_outputs(m, out, feeds_for(m))


def test_a_cycle_after_a_long_chain_of_rewrites_is_still_detected():
    """A node made by 200 rewrites in a row derives from 201 original nodes; its origins are kept
    as one token (not a set that grows with each rewrite), and rules undoing each other on it are
    still reported as a cycle, not run to the rewrite limit."""
    def at_output(m):
        return m.root.outputs[0].is_graph_output()

    rules = [Rule("abs_chain", Op("Abs", Op("Abs", "x")), lambda m, b: b.op("Abs", m["x"]), priority=10),
             Rule("abs_to_sigmoid", Op("Abs", "x"), lambda m, b: b.op("Sigmoid", m["x"]), condition=at_output),
             Rule("sigmoid_to_abs", Op("Sigmoid", "x"), lambda m, b: b.op("Abs", m["x"]))]
    n = 201
    nodes = [helper.make_node("Abs", [f"t{i}" if i else "x"], [f"t{i + 1}" if i < n - 1 else "y"], name=f"abs{i}")
             for i in range(n)]
    m = model(nodes, [tinfo("x", [4])], [tinfo("y", [4])])
    out, report = optimize(m, rules=rules, return_report=True)
    assert report.fired["abs_chain"] == n - 1
    assert len(report.cycles) == 1 and report.cycles[0]["rule"] == "abs_to_sigmoid"
    assert not report.hit_limit and report.rewrites == n + 1
    assert op_types(out) == ["Abs"]


def test_a_value_that_gains_a_reader_puts_its_other_readers_back():
    """bn_to_mul_add leaves a BatchNormalization whose input is a Conv's only output (the Conv may
    absorb it). When CSE merges a twin Conv into that one, the first BatchNormalization's input
    gains a reader without changing: it must be tried again (the driver re-queued every reader of
    a merged value before it became linear, and converted both)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1"), bn_node("c1", "y1", "a"),
             # x and w keep other readers when conv2 goes (else conv1 goes back on the list)
             helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Relu", ["w"], ["rw"], name="relu_w"),
             helper.make_node("Conv", ["x", "w"], ["c2"], name="conv2"), bn_node("c2", "y2", "b")]
    m = model(nodes, [tinfo("x", [1, 2, 4, 4]), tinfo("w", [2, 2, 1, 1])],
              [tinfo("y1", [1, 2, 4, 4]), tinfo("y2", [1, 2, 4, 4]), tinfo("r", [1, 2, 4, 4]),
               tinfo("rw", [2, 2, 1, 1])],
              bn_params("a", 2, rng) + bn_params("b", 2, rng))
    out, report = optimize(m, return_report=True)
    assert report.fired.get("common_subexpression_elimination") == 1
    assert "BatchNormalization" not in op_types(out), op_types(out)
    assert_same_outputs(m, out, feeds_for(m))


def test_a_built_in_rule_bug_is_an_internal_error_a_users_is_bad_input(monkeypatch, tmp_path, capsys):
    """Under --strict, a bug in a built-in rule is onnxopt's (exit 3), one in a rules file the user's (exit 2)."""
    from onnxopt.library import registry
    from onnxopt import cli

    src = tmp_path / "m.onnx"
    onnx.save(synthetic.build(5), src)
    library = registry.builtin_rules()
    broken = [Rule(r.name, r.pattern, r.replacement, condition=lambda m: m["typo"], priority=r.priority)
              if r.name == "identity_elimination" else r for r in library]
    monkeypatch.setattr(registry, "builtin_rules", lambda: list(broken))
    assert cli.main([str(src), "-o", str(tmp_path / "o.onnx"), "--strict", "-q"]) == 3
    assert "internal error" in capsys.readouterr().err
    rules_file = tmp_path / "r.py"
    rules_file.write_text("from onnxopt import Op, Rule\nRULES = [Rule('mine', Op('Relu', 'x'), lambda m, b: m['x'], "
                          "condition=lambda m: m['typo'])]\n")
    assert cli.main([str(src), "-o", str(tmp_path / "o.onnx"), "--strict", "-q", "--rules", str(rules_file)]) == 2
