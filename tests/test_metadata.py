"""Metadata kept and added: a node a rule makes keeps its sources' metadata (the exporter's stack
trace, scopes, ...), CSE's kept node too; the model records the onnxopt version that processed it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import assert_same_outputs
from helpers import bn_node, bn_params, feeds_for, init, model, tinfo
from onnx import helper

import onnxopt
from onnxopt import optimize

VERSION_KEY = "onnxopt.version"

STACK = "pkg.torch.onnx.stack_trace"


def _props(node_or_model) -> dict[str, str]:
    return {p.key: p.value for p in node_or_model.metadata_props}


def _set(node_or_model, **props) -> None:
    helper.set_metadata_props(node_or_model, {k.replace("__", "."): v for k, v in props.items()})


def _conv_bn(conv_props=None, bn_props=None):
    rng = np.random.default_rng(0)
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv")
    bn = bn_node("c", "y", "b")
    _set(conv, **(conv_props or {}))
    _set(bn, **(bn_props or {}))
    inits = [init("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)), *bn_params("b", 4, rng)]
    return model([conv, bn], [tinfo("x", [1, 3, 8, 8])], [tinfo("y", [1, 4, 6, 6])], inits)


def test_rewritten_node_keeps_what_sources_agree_on_and_the_roots_value_otherwise():
    # the root (BatchNormalization) is the first source; the Conv it matched comes after it
    m = _conv_bn(conv_props=dict(scope="block1", file="conv.py", only_conv="c"),
                 bn_props=dict(scope="block1", file="bn.py", only_bn="b", onnxopt__rule="an earlier rule",
                               onnxopt__sources='["old_bn"]'))
    out, report = optimize(m, return_report=True)
    assert report.fired.get("conv_bn_fold") == 1
    [node] = out.graph.node
    props = _props(node)
    assert props["scope"] == "block1"  # both agree
    assert props["file"] == "bn.py"  # they differ: the root's
    assert props["only_bn"] == "b" and props["only_conv"] == "c"  # carried by one source only
    # onnxopt's own keys are its provenance, not inherited
    assert props["onnxopt.rule"] == "conv_bn_fold"
    assert json.loads(props["onnxopt.replaced"]) == ["b/bn", "conv"]
    assert json.loads(props["onnxopt.sources"]) == ["old_bn", "conv"]
    assert_same_outputs(m, out, feeds_for(m))


def test_metadata_follows_a_chain_of_rewrites():
    """Three Reshapes collapse in two rewrites: the second rewrite's sources include the first's
    node, which carries what it inherited."""
    shape = init("s", np.array([2, 12], np.int64))
    nodes = [helper.make_node("Reshape", ["x", "s"], ["a"], name="r1"),
             helper.make_node("Reshape", ["a", "s"], ["b"], name="r2"),
             helper.make_node("Reshape", ["b", "s"], ["y"], name="r3")]
    _set(nodes[0], trace="first")
    _set(nodes[1], trace="second", mid="m")
    _set(nodes[2], trace="third")
    m = model(nodes, [tinfo("x", [4, 6])], [tinfo("y", [2, 12])], [shape])
    out = optimize(m)
    [node] = out.graph.node
    props = _props(node)
    assert props["trace"] == "third" and props["mid"] == "m"
    assert json.loads(props["onnxopt.sources"]) == ["r3", "r2", "r1"]
    assert_same_outputs(m, out, feeds_for(m))


def test_cse_keeps_the_first_twins_metadata_and_takes_keys_only_the_others_have():
    nodes = [helper.make_node("Relu", ["x"], ["r1"], name="relu1"),
             helper.make_node("Relu", ["x"], ["r2"], name="relu2"),
             helper.make_node("Add", ["r1", "r2"], ["y"], name="add")]
    _set(nodes[0], trace="one")
    _set(nodes[1], trace="two", only_second="s")
    m = model(nodes, [tinfo("x", [2, 3])], [tinfo("y", [2, 3])])
    out = optimize(m)
    relu = next(n for n in out.graph.node if n.op_type == "Relu")
    props = _props(relu)
    assert props == {"trace": "one", "only_second": "s", "onnxopt.merged": '["relu2"]'}
    assert_same_outputs(m, out, feeds_for(m))


def test_dynamo_export_stack_traces_survive():
    """A real torch.onnx.export(dynamo=True): every node a rule made keeps the exporter's
    metadata (stack trace, name scopes, class hierarchy, fx node), each key from the first of the
    nodes it replaced (the matched root first) that had it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.fc = torch.nn.Linear(8 * 8 * 8, 4)

        def forward(self, x):
            y = torch.relu(self.bn(self.conv(x)))
            return self.fc(y.view(y.shape[0], -1))

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    program = torch.onnx.export(net, (torch.randn(2, 3, 8, 8),), dynamo=True, optimize=False, verbose=False,
                                dynamic_shapes=({0: torch.export.Dim("batch")},))
    src = ir.to_proto(program.model)
    originals = {n.name: _props(n) for n in src.graph.node}
    assert all(STACK in p for p in originals.values())
    out, report = optimize(src, return_report=True)
    assert {"conv_bn_fold", "reshape_shape_from_input"} <= set(report.fired)
    made = [n for n in out.graph.node if "onnxopt.rule" in _props(n)]
    assert len(made) >= 2
    for node in made:
        props = _props(node)
        sources = [originals[name] for name in json.loads(props["onnxopt.replaced"])]
        keys = {k for s in sources for k in s if not k.startswith("onnxopt.")}
        assert STACK in keys and {"pkg.torch.onnx.name_scopes", "pkg.torch.onnx.fx_node"} <= keys
        for key in keys:
            assert props[key] == next(s[key] for s in sources if key in s), (node.name, key)
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float32)}
    assert_same_outputs(src, out, feeds, rtol=1e-4, atol=1e-5)


def test_version_recorded_once_producer_kept_every_form(tmp_path):
    m = _conv_bn()
    m.producer_name, m.producer_version = "pytorch", "2.13.0"
    _set(m, author="me")
    for result in (optimize(m), onnx.load_from_string(optimize(m.SerializeToString())),
                   ir.to_proto(optimize(ir.from_proto(m)))):
        assert [(p.key, p.value) for p in result.metadata_props] == [("author", "me"), (VERSION_KEY,
                                                                                        onnxopt.__version__)]
        assert (result.producer_name, result.producer_version) == ("pytorch", "2.13.0")
    assert VERSION_KEY not in _props(m)  # the caller's model is not changed


def test_cli_second_run_adds_no_entry_and_updates_an_older_version(tmp_path):
    m = _conv_bn()
    m.producer_name = "exporter"
    _set(m, onnxopt__version="0.0.1")  # an older onnxopt processed it
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    first, second = tmp_path / "once.onnx", tmp_path / "twice.onnx"
    for a, b in ((src, first), (first, second)):
        run = subprocess.run([sys.executable, "-m", "onnxopt", str(a), "-o", str(b), "-q"],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
    for path in (first, second):
        proto = onnx.load(str(path))
        assert [(p.key, p.value) for p in proto.metadata_props] == [(VERSION_KEY, onnxopt.__version__)]
        assert proto.producer_name == "exporter"
    assert first.read_bytes() == second.read_bytes()  # nothing left to do, nothing added
