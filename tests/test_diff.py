"""onnxopt.diff: the BEFORE/AFTER mapping (provenance and alignment), its agreement on zoo models,
the Model Explorer mapping, the static page, ``python -m onnxopt diff`` and ``optimize(diff=)``."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import cli, diff, optimize
from onnxopt.ir.util import MERGED_KEY, REPLACED_KEY, RULE_KEY, SOURCES_KEY
from helpers import shared_zoo_model


def _conv_bn_model() -> onnx.ModelProto:
    """x -> Conv -> BatchNormalization -> Relu -> Identity -> Conv -> BatchNormalization -> y, and a
    second Relu twin (CSE merges it)."""
    rng = np.random.default_rng(0)
    inits = []

    def const(name, shape):
        inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
        return name

    def bn(i, x, y):
        return helper.make_node("BatchNormalization", [x, const(f"scale{i}", [4]), const(f"bias{i}", [4]),
                                                       const(f"mean{i}", [4]), f"var{i}"], [y], name=f"bn{i}")
    nodes = [helper.make_node("Conv", ["x", const("w0", [4, 3, 3, 3])], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
             bn(0, "c0", "n0"),
             helper.make_node("Relu", ["n0"], ["r0"], name="relu0"),
             helper.make_node("Relu", ["n0"], ["r0b"], name="relu0_twin"),
             helper.make_node("Add", ["r0", "r0b"], ["s0"], name="add0"),
             helper.make_node("Identity", ["s0"], ["i0"], name="ident0"),
             helper.make_node("Conv", ["i0", const("w1", [4, 4, 3, 3])], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             bn(1, "c1", "y")]
    inits += [numpy_helper.from_array(np.abs(rng.standard_normal(4)).astype(np.float32) + 1, f"var{i}")
              for i in (0, 1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    before = folder / "before.onnx"
    onnx.save(_conv_bn_model(), before)
    after = folder / "after.onnx"
    optimize(str(before), output=str(after))
    return before, after


def test_provenance_mapping(small):
    before, after = small
    m = diff.mapping(before, after)
    assert m["method"] == "provenance"
    by_after = {c["after"]: c for c in m["created"]}
    fused = {tuple(sorted(m["pairs"][a])) for a in m["fused"]}
    assert ("bn0", "conv0") in fused and ("bn1", "conv1") in fused
    assert all(by_after[a]["rule"] for a in m["fused"])
    assert "ident0" in m["removed"]  # eliminated: nothing stands for it
    assert m["pairs"]["relu0"] == ["relu0", "relu0_twin"]  # CSE kept relu0 and merged its twin into it
    assert "relu0" in m["kept"] and "add0" in m["kept"]
    # every node is accounted for once: AFTER nodes by their status, BEFORE nodes mapped or removed
    a_keys = [c["after"] for c in m["created"]] + [c["after"] for c in m["changed"]] + m["kept"]
    assert sorted(a_keys) == sorted(m["pairs"])
    mapped = {b for bs in m["pairs"].values() for b in bs}
    assert mapped.isdisjoint(m["removed"])
    assert mapped | set(m["removed"]) == {n.name for n in onnx.load(before).graph.node}


def test_provenance_on_every_node_a_rule_or_pass_made(small):
    """Netron shows a node's metadata_props in its properties (onnx.js, onnx.Node: ``this.metadata``);
    every node onnxopt made carries the rule and what it replaced, a node CSE kept what it merged."""
    before, after = small
    names = {n.name for n in onnx.load(before).graph.node}
    for node in onnx.load(after).graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        if node.name not in names:
            assert props.get(RULE_KEY) and json.loads(props[REPLACED_KEY]), node.name
        if node.name == "relu0":
            assert json.loads(props[MERGED_KEY]) == ["relu0_twin"]


def test_netron_shows_node_metadata():
    netron = pytest.importorskip("netron", reason="netron is not installed (pip install \"onnxopt[diff]\")")
    from pathlib import Path

    source = (Path(netron.__file__).parent / "onnx.js").read_text()
    body = source[source.index("onnx.Node = class"):][:3000]
    assert "metadata_props" in body and "this.metadata.push" in body


def test_alignment_without_provenance(small):
    before, after = small
    stripped = diff.strip_provenance(onnx.load(after))
    ref = diff.mapping(before, after)
    for names in (True, False):
        b = diff.Graph(onnx.load(before))
        a = diff.Graph(diff.strip_provenance(onnx.load(after), names=not names))
        al = diff.align(b, a, use_names=names)
        assert al["method"] == "alignment"
        if names:
            assert diff.agreement(ref, al, [n.key for n in b.nodes])["ratio"] == 1.0
        else:  # structure alone: the two folds are still told apart
            assert sorted(sorted(al["pairs"][k]) for k in al["fused"]) == [["bn0", "conv0"], ["bn1", "conv1"]]
    assert diff.mapping(before, stripped)["method"] == "alignment"


ZOO = ["ppocr-mobile-cls", "mobilenet_v2-dynamo"]
ZOO_FULL = ["resnet50-dynamo"]  # a model no other test builds, and the slowest: with ONNXOPT_FULL=1 only


@pytest.mark.parametrize("name", ZOO + (ZOO_FULL if os.environ.get("ONNXOPT_FULL") == "1" else []))
def test_alignment_agrees_with_provenance_on_zoo(name, tmp_path):
    """Alignment (no provenance) finds what provenance says on real exports: in CI on a PaddleOCR and a
    dynamo model (conv+BN folds, residual adds); resnet50-dynamo too with
    ``ONNXOPT_FULL=1 python -m pytest -q tests/test_diff.py -k on_zoo``."""
    path = shared_zoo_model(name)
    out = tmp_path / "opt.onnx"
    optimize(str(path), output=str(out))
    b = diff.Graph(onnx.load(path))
    after = onnx.load(out)
    named = {n.key for n in b.nodes}
    for node in after.graph.node:  # every node onnxopt made says so (Netron shows it)
        assert node.name in named or any(p.key == RULE_KEY for p in node.metadata_props), node.name
    ref = diff.from_provenance(b, diff.Graph(after))
    al = diff.align(b, diff.Graph(diff.strip_provenance(after)))
    got = diff.agreement(ref, al, [n.key for n in b.nodes])
    assert got["ratio"] >= 0.95, got


def test_model_explorer_mapping(small, tmp_path):
    """Model Explorer's reader of a node mapping is TypeScript (its UI): the JSON is checked against
    the interface its source declares (SyncNavigationData, sync_navigation.ts), and its ids against
    the ids model-explorer-onnx gives nodes (their names)."""
    before, after = small
    me = tmp_path / "me.json"
    diff.run(before, after, me_out=str(me))
    data = json.loads(me.read_text())
    assert diff.validate_model_explorer_mapping(data) == []
    assert data["mappingEntries"]
    left = {n.name for n in onnx.load(before).graph.node}
    right = {n.name for n in onnx.load(after).graph.node}
    for e in data["mappingEntries"]:
        assert set(e["leftNodeIds"]) <= left and set(e["rightNodeIds"]) <= right
    assert {"leftNodeIds": ["bn0", "conv0"], "rightNodeIds": [n for n in right if "bn0" in n]} in data["mappingEntries"]
    # the validator catches what the interface forbids
    assert diff.validate_model_explorer_mapping({"mappingEntries": [{"leftNodeIds": "a", "rightNodeIds": []}]})
    assert diff.validate_model_explorer_mapping({"mappingEntries": [{"leftNodeIds": ["a"], "rightNodeIds": []},
                                                                     {"leftNodeIds": ["a"], "rightNodeIds": []}]})
    assert diff.validate_model_explorer_mapping({"nodes": {}})


def test_static_page_is_self_contained(small, tmp_path):
    before, after = small
    page = tmp_path / "diff.html"
    report = {"providers": {"cpu": {"ok": True, "kernels": {"before": {"kernels": 9}, "after": {"kernels": 5}},
                                    "latency": {"before": {"median_ms": 2.0}, "after": {"median_ms": 1.0},
                                                "ratio_median": 0.5}}}}
    m, summ = diff.run(before, after, html_out=str(page), verify_report=report)
    text = page.read_text()
    assert "<script" not in text and not re.search(r"""(src|href)=["']?https?://(?!localhost)""", text)
    assert "<link" not in text  # (styles inline)
    for c in m["created"]:
        assert c["after"] in text and (c["rule"] or "(alignment)") in text
    assert "netron --port 8081" in text and "conv_bn_fold" in text
    assert summ["verification"]["cpu"]["kernels_after"] == 5 and ">0.5<" in text
    live = diff.live_mapping(m, summ)
    assert live["summary"]["verify"][0]["kernels_before"] == 9 and live["summary"]["ops_before"]["BatchNormalization"] == 2


def test_cli_diff(small, tmp_path, capsys):
    before, after = small
    page, mapping, me = tmp_path / "p.html", tmp_path / "m.json", tmp_path / "me.json"
    rc = cli.main(["diff", str(before), str(after), "--html", str(page), "--json", str(mapping),
                   "--model-explorer", str(me)])
    out = capsys.readouterr().out
    assert rc == 0 and page.exists() and me.exists()
    assert "created" in out and "static page" in out
    data = json.loads(mapping.read_text())
    assert data["mapping"]["method"] == "provenance" and data["summary"]["rules"]
    assert cli.main(["diff", str(before), str(tmp_path / "missing.onnx")]) == 2
    assert "no such model file" in capsys.readouterr().err


def test_cli_diff_without_the_live_view(small, tmp_path, capsys, monkeypatch):
    """Without onnxopt.diff.live (or Netron) the static page is written and the way to the live view said."""
    before, after = small
    import onnxopt

    monkeypatch.setitem(sys.modules, "onnxopt.diff.live", None)  # import fails
    import onnxopt.diff

    monkeypatch.delattr(onnxopt.diff, "live", raising=False)  # (even after another test imported it)
    rc = cli.main(["diff", str(before), str(after), "--no-browser"])
    out = capsys.readouterr().out
    assert rc == 0
    assert (after.parent / "after.diff.html").exists()
    assert 'pip install "onnxopt[diff]"' in out


def test_optimize_diff(tmp_path):
    before = tmp_path / "m.onnx"
    onnx.save(_conv_bn_model(), before)
    page = tmp_path / "diff.html"
    out = optimize(str(before), output=str(tmp_path / "o.onnx"), diff=str(page))
    assert out == str(tmp_path / "o.onnx") and "conv_bn_fold" in page.read_text()
    proto, report = optimize(_conv_bn_model(), diff=str(tmp_path / "p.html"), return_report=True)
    assert isinstance(proto, onnx.ModelProto) and report.rewrites and (tmp_path / "p.html").exists()


def test_diff_pages_are_written_atomically_and_never_over_an_input(small, tmp_path, capsys):
    """diff's --html/--json/--model-explorer, the main command's --diff and optimize(diff=) are claimed
    before any work: an input (or the optimized model) named as the page is refused in one line (exit 2),
    the file untouched; nothing half-written is left."""
    before, after = small
    kept = before.read_bytes(), after.read_bytes()
    for flag in ("--html", "--json", "--model-explorer"):
        for target in (before, after):
            assert cli.main(["diff", str(before), str(after), flag, str(target)]) == 2
            assert "never overwrites what it reads" in capsys.readouterr().err
    assert (before.read_bytes(), after.read_bytes()) == kept
    out, page = tmp_path / "o.onnx", tmp_path / "d.html"
    assert cli.main([str(before), "-o", str(out), "--diff", str(before), "-q"]) == 2
    assert not out.exists() and before.read_bytes() == kept[0]
    assert cli.main([str(before), "-o", str(out), "--diff", str(out), "-q"]) == 2
    assert not out.exists()
    capsys.readouterr()
    assert cli.main([str(before), "-o", str(out), "--diff", str(page), "-q"]) == 0
    text = page.read_text()
    assert "conv_bn_fold" in text and str(before) in text and str(out) in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.html", "o.onnx"]  # no staging left
    with pytest.raises(Exception, match="never overwrites what it reads"):
        optimize(str(before), output=str(tmp_path / "o2.onnx"), diff=str(before))
    assert before.read_bytes() == kept[0] and not (tmp_path / "o2.onnx").exists()


def test_alignment_of_a_peers_output(small):
    """A model another tool optimized (no provenance): onnxslim folds the BatchNormalizations into the
    Convs under its own names; the alignment finds both folds, the CSE merge and the Identity removed."""
    onnxslim = pytest.importorskip("onnxslim", reason="onnxslim is not installed (the bench extra)")
    before, _ = small
    slim = onnxslim.slim(onnx.load(before))
    m = diff.mapping(before, slim)
    assert m["method"] == "alignment"
    assert sorted(sorted(m["pairs"][k]) for k in m["fused"]) == [["bn0", "conv0"], ["bn1", "conv1"]]
    assert m["pairs"]["relu0"] == ["relu0", "relu0_twin"] and m["removed"] == ["ident0"]


def test_unnamed_nodes(tmp_path):
    """Nodes without a name are keyed by position (``#<index>``) and matched by structure."""
    model = _conv_bn_model()
    for node in model.graph.node:
        if node.name in ("add0", "ident0"):
            node.name = ""
    before = tmp_path / "b.onnx"
    onnx.save(model, before)
    after = tmp_path / "a.onnx"
    optimize(str(before), output=str(after))
    m = diff.mapping(before, after)
    assert m["method"] == "provenance"
    assert "relu0" in m["kept"] and m["pairs"]["relu0"] == ["relu0", "relu0_twin"]
    add = [n for n in onnx.load(after).graph.node if n.op_type == "Add"][0]
    key = add.name or next(k for k in m["pairs"] if k.startswith("#"))
    assert m["pairs"][key] == ["#4"] and "#5" in m["removed"]  # (the Add was node 4, the Identity 5)
    assert diff.validate_model_explorer_mapping(diff.model_explorer_mapping(m)) == []


def test_model_explorer_web_app_reads_these_fields():
    """Where ai-edge-model-explorer is installed, the web app it ships reads the fields we write
    (checked on 0.1.34: no Python reader of a node mapping exists, the reader is the bundled app)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("model_explorer")  # (found, not imported: it pulls a web server)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ai-edge-model-explorer is not installed")
    folder = Path(next(iter(spec.submodule_search_locations))) / "web_app"
    bundle = "".join(p.read_text(errors="replace") for p in folder.glob("main-*.js"))
    data = diff.model_explorer_mapping({"pairs": {"b": ["a"]}})
    for field in [*data, "leftNodeIds", "rightNodeIds"]:
        assert field in bundle, field


@pytest.mark.parametrize("unnamed", [False, True], ids=["named", "unnamed"])
def test_model_explorer_ids_are_the_adapters(unnamed, tmp_path):
    """Every id in the Model Explorer mapping is a node id model-explorer-onnx's own ONNX adapter gives that
    model (named nodes by name, unnamed ones by position), and every mapped node with an id is there."""
    me_onnx = pytest.importorskip("model_explorer_onnx.main",
                                  reason="model-explorer-onnx is not installed (pip install model-explorer-onnx)")
    model = _conv_bn_model()
    if unnamed:
        for node in model.graph.node:
            if node.name in ("add0", "ident0", "relu0_twin", "conv1"):
                node.name = ""
    before, after = tmp_path / "b.onnx", tmp_path / "a.onnx"
    onnx.save(model, before)
    optimize(str(before), output=str(after))
    if unnamed:  # the optimized model's unnamed nodes too
        proto = onnx.load(after)
        for node in proto.graph.node:
            if node.op_type == "Add":
                node.name = ""
        onnx.save(proto, after)
    me = tmp_path / "me.json"
    m, _ = diff.run(before, after, me_out=str(me))
    data = json.loads(me.read_text())
    assert diff.validate_model_explorer_mapping(data) == []

    def adapter_ids(path):
        graphs = me_onnx.ONNXAdapter().convert(str(path), {})["graphs"]
        return {n.id for n in graphs[0].nodes}

    left, right = adapter_ids(before), adapter_ids(after)
    got_left = {x for e in data["mappingEntries"] for x in e["leftNodeIds"]}
    got_right = {x for e in data["mappingEntries"] for x in e["rightNodeIds"]}
    assert got_left <= left and got_right <= right, (got_left - left, got_right - right)
    mapped_after = [a for a, bs in m["pairs"].items() if bs]
    assert len(got_right) == len(mapped_after)  # none left out: unnamed nodes have their adapter ids
    if unnamed:  # (names the adapter made: not in the models)
        assert got_left - {n.name for n in onnx.load(before).graph.node}
        assert got_right - {n.name for n in onnx.load(after).graph.node}


def test_subgraphs_and_live_mapping(tmp_path):
    """Nodes inside an If's branches are mapped too; the live view's "replaced" are BEFORE names."""
    then = helper.make_graph([helper.make_node("Identity", ["a"], ["t"], name="inner"),
                              helper.make_node("Relu", ["t"], ["r"], name="relu")], "then", [],
                             [helper.make_tensor_value_info("r", TensorProto.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["a"], ["n"], name="neg")], "else", [],
                              [helper.make_tensor_value_info("n", TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["a"], name="outer"),
         helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before, after = tmp_path / "b.onnx", tmp_path / "a.onnx"
    onnx.save(model, before)
    optimize(str(before), output=str(after))
    m, summ = diff.run(before, after)
    assert {"outer", "inner"} <= set(m["removed"]) and {"relu", "neg", "if"} <= set(m["kept"])
    live = diff.live_mapping(m, summ)
    for c in live["created"]:
        assert set(c["replaced"]) <= {n.key for n in diff.Graph(onnx.load(before)).nodes}


@pytest.mark.parametrize("options", [
    {"target": "ort-cuda", "precision": "fp16"},
    {"input_layout": {"x": "NHWC"}, "input_preprocess": {"x": "uint8,NHWC,scale=1/255"}},
    {"output_layout": {"y": "NHWC"}},
], ids=["fp16", "uint8-input", "nhwc-output"])
def test_provenance_of_inserted_and_folded_nodes(options, tmp_path):
    """Nodes the fp16 pass and the layout edges insert carry the rule and an empty ``replaced``; a Conv the
    input preprocessing is folded into stands for its original (not removed, not a stranger)."""
    before = tmp_path / "before.onnx"
    onnx.save(_conv_bn_model(), before)
    after = tmp_path / "after.onnx"
    optimize(str(before), output=str(after), **options)
    names = {n.name for n in onnx.load(before).graph.node}
    inserted = 0
    for node in onnx.load(after).graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        if node.name not in names or props.get(RULE_KEY) in ("fp16", "layout"):
            assert props.get(RULE_KEY) and REPLACED_KEY in props, (node.name, props)
            inserted += json.loads(props[REPLACED_KEY]) == []
    assert inserted >= 1
    m = diff.mapping(before, after)
    assert m["method"] == "provenance"
    # both Convs (each folded with its BatchNormalization) are accounted for, whatever else happened
    mapped = {b for bs in m["pairs"].values() for b in bs}
    assert {"conv0", "conv1", "bn0", "bn1"} <= mapped, m["removed"]
    assert set(m["removed"]) <= {"ident0", "relu0_twin"}


def test_a_conv_the_preprocessing_folds_into_is_its_original(tmp_path):
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])], [w])
    before, after = tmp_path / "before.onnx", tmp_path / "after.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), before)
    optimize(str(before), output=str(after), input_layout={"x": "NHWC"},
             input_preprocess={"x": "uint8,NHWC,scale=1/255"})
    conv = next(n for n in onnx.load(after).graph.node if n.op_type == "Conv")
    props = {p.key: p.value for p in conv.metadata_props}
    assert props[RULE_KEY] == "layout" and json.loads(props[REPLACED_KEY]) == ["conv"]
    m = diff.mapping(before, after)
    assert m["pairs"][conv.name] == ["conv"] and m["removed"] == []


def test_provenance_records_what_died_with_a_rewrite():
    """A fusion matches its ends; the nodes between them die with it: the fused node's onnxopt.sources
    names them all (the attention block of a transformer, shape arithmetic included), not only the two
    nodes the rule matched (onnxopt.replaced)."""
    from test_diff_alignment import _transformer

    out = optimize(_transformer(), target="ort-cpu")
    att = next(n for n in out.graph.node if n.op_type == "Attention")
    props = {p.key: p.value for p in att.metadata_props}
    replaced, sources = json.loads(props[REPLACED_KEY]), json.loads(props[SOURCES_KEY])
    assert len(replaced) < 4
    assert {"att/qk", "att/softmax", "att/pv", "q/matmul", "k/transpose", "v/reshape", "concat_heads"} <= set(sources)
    assert not {"ln/mean", "o/matmul", "residual"} & set(sources)
    m = diff.mapping(_transformer(), out)
    assert set(m["pairs"][att.name]) >= {"att/softmax", "q/matmul"} and "att/softmax" not in m["removed"]


def test_cse_keeps_what_merged_rule_made_twins_stood_for(tmp_path):
    """Two Conv+BatchNormalization pairs computing the same thing: each folds into a Conv, then CSE
    merges the two Convs; the kept one stands for both pairs."""
    model = _conv_bn_model()
    g = model.graph
    g.node.insert(2, helper.make_node("Conv", ["x", "w0"], ["c0b"], name="conv0b", pads=[1, 1, 1, 1]))
    bn = next(n for n in g.node if n.name == "bn0")
    g.node.insert(3, helper.make_node("BatchNormalization", ["c0b", *bn.input[1:]], ["n0b"], name="bn0b"))
    next(n for n in g.node if n.name == "relu0_twin").input[0] = "n0b"
    before = tmp_path / "b.onnx"
    onnx.save(model, before)
    out = optimize(model)
    convs = [n for n in out.graph.node if n.op_type == "Conv"]
    assert len(convs) == 2  # (conv0b's fold merged into conv0's)
    first = next(n for n in convs if "bn0" in n.name)
    props = {p.key: p.value for p in first.metadata_props}
    assert {"conv0", "bn0", "conv0b", "bn0b"} <= set(json.loads(props[SOURCES_KEY])), props
    m = diff.mapping(before, out)
    assert {"conv0", "bn0", "conv0b", "bn0b"} <= set(m["pairs"][first.name])
    assert not {"conv0b", "bn0b"} & set(m["removed"])


def test_a_rewrites_helper_nodes_merged_by_cse_do_not_take_other_layers(tmp_path):
    """Each layer's attention fusion makes the same mask helpers (Max, Shape, Cast, ...); CSE keeps the
    first layer's. Their twins' rewrites leave their own nodes (the layer's Attention) standing for the
    layer, so the kept helpers stand for the first layer only, not for every layer's attention."""
    import re

    path = shared_zoo_model("bert-legacy")
    out = optimize(onnx.load(path), target="ort-cpu")
    fused = [n for n in out.graph.node if any(p.key == RULE_KEY and p.value == "attention_fusion" for p in n.metadata_props)]
    assert sum(n.op_type == "Attention" for n in fused) >= 2
    for node in fused:
        sources = json.loads(next(p.value for p in node.metadata_props if p.key == SOURCES_KEY))
        layers = {m.group(1) for s in sources for m in [re.search(r"layer\.(\d+)/", s)] if m}
        assert len(layers) <= 1, (node.name, node.op_type, sorted(layers))


# --- found in review -------------------------------------------------------------------------------


def test_an_optimized_model_against_itself_or_its_reoptimization(small, tmp_path):
    """BEFORE already optimized by onnxopt: its nodes carry provenance too; a node BEFORE holds with the
    same record is itself (kept), not created again."""
    _, after = small
    again = tmp_path / "again.onnx"
    optimize(str(after), output=str(again))
    n = len(onnx.load(after).graph.node)
    for other in (after, again):
        m = diff.mapping(after, other)
        assert len(m["kept"]) == n and not m["created"] and not m["removed"], m


@pytest.mark.parametrize("content", [b"hello", b"", "truncated"])
def test_a_model_that_is_not_onnx_is_a_one_line_error(content, small, tmp_path, capsys):
    _, after = small
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(after.read_bytes()[:200] if content == "truncated" else content)
    for args in ([str(bad), str(after)], [str(after), str(bad)]):
        assert cli.main(["diff", *args, "--html", str(tmp_path / "p.html")]) == 2
        err = capsys.readouterr().err
        assert "bad.onnx" in err and "internal error" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p.html").exists()


@pytest.mark.parametrize("report", ['{"verification": null}', '{"providers": [1, 2]}', '{"providers": {"cpu": 5}}',
                                    '{"providers": {"cpu": {"kernels": [1]}}}',
                                    '{"providers": {"cpu": {"latency": {"before": 3}}}}'])
def test_an_odd_verify_report_is_a_one_line_error(report, small, tmp_path, capsys):
    before, after = small
    rep = tmp_path / "rep.json"
    rep.write_text(report)
    assert cli.main(["diff", str(before), str(after), "--html", str(tmp_path / "p.html"), "--verify-report", str(rep)]) == 2
    err = capsys.readouterr().err
    assert "--verify-report" in err and "internal error" not in err


def test_the_static_page_escapes_what_a_report_holds_and_names_models_in_memory(small, tmp_path):
    before, after = small
    report = {"providers": {"<b>cpu</b>": {"kernels": {"before": {"kernels": "<script>alert(1)</script>"}}}}}
    page = tmp_path / "p.html"
    diff.run(before, after, html_out=str(page), verify_report=report)
    text = page.read_text()
    assert "<script" not in text and "<b>cpu" not in text
    optimize(_conv_bn_model(), diff=str(page))
    text = page.read_text()
    assert "(in memory)" in text and "netron --port" not in text and str(tmp_path) not in text


def test_alignment_is_the_same_whatever_the_hash_seed(small, tmp_path):
    """Same input, byte-identical outputs: the alignment's sets are walked in node order."""
    import os
    import subprocess

    before, after = small
    stripped = tmp_path / "stripped.onnx"
    onnx.save(diff.strip_provenance(onnx.load(after), names=True), stripped)
    outs = []
    for seed in ("1", "2", "3"):
        js, page = tmp_path / f"m{seed}.json", tmp_path / f"p{seed}.html"
        subprocess.run([sys.executable, "-m", "onnxopt", "diff", str(before), str(stripped), "-q", "--json", str(js),
                        "--html", str(page)], check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        outs.append((js.read_bytes(), page.read_bytes()))
    assert outs[0] == outs[1] == outs[2]
    assert json.loads(outs[0][0])["mapping"]["method"] == "alignment"


def test_a_node_named_like_a_position_key(tmp_path):
    """A node named "#1" beside an unnamed node at position 1: two keys, each node once."""
    nodes = [helper.make_node("Identity", ["x"], ["t"], name="#1"), helper.make_node("Relu", ["t"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    before = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    b = diff.Graph(before)
    assert len({n.key for n in b.nodes}) == 2 and "#1" in b.by_key and b.by_key["#1"].op == ("", "Identity")
    after = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", list(graph.input),
                                                list(graph.output)), opset_imports=[helper.make_opsetid("", 17)])
    m = diff.mapping(before, after)
    assert m["removed"] == ["#1"] and not m["created"] and len(m["kept"]) == 1


def test_model_explorer_keeps_named_nodes_with_a_hash_in_their_name(tmp_path):
    model = _conv_bn_model()
    for node in model.graph.node:
        if node.name == "add0":
            node.name = "add#k"
    before, after = tmp_path / "b.onnx", tmp_path / "a.onnx"
    onnx.save(model, before)
    optimize(str(before), output=str(after))
    me = tmp_path / "me.json"
    diff.run(before, after, me_out=str(me))
    entries = json.loads(me.read_text())["mappingEntries"]
    assert {"leftNodeIds": ["add#k"], "rightNodeIds": ["add#k"]} in entries


def test_an_identity_removed_inside_a_branch(tmp_path):
    """The alignment inside an If's branch: an Identity dropped there is removed, the rest kept (as in
    the main graph)."""
    def model(with_identity: bool):
        first = "X" if not with_identity else "i"
        body = ([helper.make_node("Identity", ["X"], ["i"])] if with_identity else []) + [
            helper.make_node("Transpose", [first], ["t"], perm=[1, 0]),
            helper.make_node("Transpose", ["t"], ["o"], perm=[1, 0])]
        then = helper.make_graph(body, "then", [], [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2, 3])])
        other = helper.make_graph([helper.make_node("Neg", ["X"], ["n"])], "else", [],
                                  [helper.make_tensor_value_info("n", TensorProto.FLOAT, [2, 3])])
        graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                                  [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                   helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    m = diff.mapping(model(True), model(False))
    assert m["method"] == "alignment" and not m["created"], m
    assert len(m["removed"]) == 1 and m["removed"][0].endswith("#0") and len(m["kept"]) == 4


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": ' * 70 + "1" + "}" * 70, None],
                         ids=["deep-array", "deep-object", "dev-zero"])
def test_a_deep_or_endless_verify_report_is_a_one_line_error(text, small, tmp_path, capsys):
    """issue 27 item 8's class: a JSON file read back is bounded in nesting (json recursed: a 100,000-deep
    array was a RecursionError, exit 3) and in size (/dev/zero was read without end)."""
    before, after = small
    rep = "/dev/zero" if text is None else tmp_path / "rep.json"
    if text is not None:
        rep.write_text(text)
    assert cli.main(["diff", str(before), str(after), "--html", str(tmp_path / "p.html"), "--verify-report",
                     str(rep)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "internal error" not in err, err[-300:]
    assert f"--verify-report {rep}: " in err and ("nested" in err or "larger than 64 MiB" in err), err
    assert not (tmp_path / "p.html").exists()


def _fired_rules(report_json) -> dict[str, int]:
    """The report's own count of each rule's rewrites (graph passes leave no provenance: left out)."""
    from onnxopt.library import passes

    return {r: s["fired"] for r, s in report_json["rules"].items() if s["fired"] and r not in passes.NAMES}


def test_summary_counts_rewrites_not_nodes(tmp_path):
    """Issue 27, item 18: bn_to_mul_add makes two nodes in one rewrite (counted twice), and
    conv_mul_fold's Conv is replaced by conv_add_fold's (its rule was left out): the summary counts
    each rule's rewrites, as optimize's report does."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype(np.float32), "w")
    k = numpy_helper.from_array(rng.standard_normal((1, 4, 1, 1)).astype(np.float32) + 2, "k")
    b = numpy_helper.from_array(rng.standard_normal((1, 4, 1, 1)).astype(np.float32), "b")
    bn = [numpy_helper.from_array(np.abs(rng.standard_normal(4)).astype(np.float32) + 1, f"bn_{n}")
          for n in ("scale", "bias", "mean", "var")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Mul", ["c", "k"], ["m"], name="mul"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("BatchNormalization", ["r", *(t.name for t in bn)], ["y"], name="bn")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])], [w, k, b, *bn])
    src, out, rep = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    assert cli.main([str(src), "-o", str(out), "--json", str(rep), "-q"]) == 0
    fired = _fired_rules(json.loads(rep.read_text()))
    assert fired == {"conv_mul_fold": 1, "conv_add_fold": 1, "bn_to_mul_add": 1}, fired  # (the case itself)
    m = diff.mapping(str(src), str(out))
    assert diff.summary(str(src), str(out), m)["rules"] == fired


def test_summary_rule_counts_match_the_report_on_a_zoo_model(tmp_path):
    """PP-OCRv4 det: conv_mul_fold fired 28 times, bn_to_mul_add once; the summary says so."""
    src = shared_zoo_model("ppocrv4-det")
    out, rep = tmp_path / "o.onnx", tmp_path / "r.json"
    assert cli.main([str(src), "-o", str(out), "--json", str(rep), "-q"]) == 0
    fired = _fired_rules(json.loads(rep.read_text()))
    assert fired.get("conv_mul_fold", 0) > 0 and fired.get("bn_to_mul_add") == 1, fired
    m = diff.mapping(str(src), str(out))
    assert diff.summary(str(src), str(out), m)["rules"] == fired
