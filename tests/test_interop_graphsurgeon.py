"""onnx-graphsurgeon: optimize() takes an onnx_graphsurgeon.Graph and gives a new Graph back.

Real exports (torchvision mobilenet_v2 with BatchNormalization kept, GPT-2 from the dynamo
exporter with dynamic batch and sequence axes) are imported with graphsurgeon's own
``import_onnx``, optimized, and the Graph returned is exported with ``export_onnx`` and run on
onnxruntime against the original; the Graph given is left exactly as it was.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_ort

from onnxopt import optimize
from onnxopt.errors import InvalidModelError, UsageError

gs = pytest.importorskip("onnx_graphsurgeon", reason="onnx-graphsurgeon (the 'gs' extra) is needed")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> path of a real export, made once for the module."""
    pytest.importorskip("torch", reason="torch (the 'export' extra) exports the models")
    root, made = tmp_path_factory.mktemp("gs-models"), {}

    def get(name):
        if name not in made:
            if name == "mobilenet_v2":
                from onnxopt.models import torchvision_models

                try:
                    torchvision_models.import_torchvision()
                except ImportError:
                    pytest.skip("torchvision (the 'export' extra) builds mobilenet_v2")

                made[name] = torchvision_models.export("mobilenet_v2", root / "mobilenet_v2.onnx", exporter="legacy")
            else:
                pytest.importorskip("transformers")
                from onnxopt.models import transformers_models

                made[name] = transformers_models.export("gpt2", root / "gpt2.onnx", exporter="dynamo", cache=root)
        return made[name]

    return get


def _signature(tensors) -> list:
    return [(t.name, np.dtype(t.dtype), list(t.shape) if t.shape is not None else None) for t in tensors]


def _snapshot(graph) -> tuple:
    """Everything that would show a change to ``graph``: its export, and its node and tensor objects."""
    return (gs.export_onnx(graph).SerializeToString(), [id(n) for n in graph.nodes],
            {name: id(t) for name, t in graph.tensors().items()})


def test_a_graph_in_a_new_graph_out_same_outputs(exported):
    src = exported("mobilenet_v2")
    graph = gs.import_onnx(onnx.load(src))
    before = _snapshot(graph)
    out, report = optimize(graph, return_report=True)
    assert isinstance(out, gs.Graph) and out is not graph
    assert _snapshot(graph) == before  # the Graph given is untouched
    # what a graphsurgeon user looks at: the opset, the name, inputs and outputs with dtypes and shapes
    assert (out.opset, out.name) == (graph.opset, graph.name)
    assert _signature(out.inputs) == _signature(graph.inputs) and _signature(out.outputs) == _signature(graph.outputs)
    ops = [n.op for n in out.nodes]
    assert "BatchNormalization" not in ops and report.fired["conv_bn_fold"] == report.before["BatchNormalization"]
    assert len(out.nodes) == sum(report.after.values()) < len(graph.nodes)
    # weights are graphsurgeon Constants, the folded ones with their new values
    conv_weights = [n.inputs[1] for n in out.nodes if n.op == "Conv"]
    assert conv_weights and all(isinstance(w, gs.Constant) for w in conv_weights)
    originals = {t.name: t for t in graph.tensors().values() if isinstance(t, gs.Constant)}
    assert any(w.name not in originals or not np.array_equal(w.values, originals[w.name].values) for w in conv_weights)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    (want,), (got,) = run_ort(gs.export_onnx(graph), {"input": x}), run_ort(gs.export_onnx(out), {"input": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_dynamic_axes_survive_and_outputs_agree_at_two_shapes(exported):
    from onnxopt.models import inputs

    graph = gs.import_onnx(onnx.load(exported("gpt2")))
    before = _snapshot(graph)
    out = optimize(graph)
    assert _snapshot(graph) == before
    assert _signature(out.inputs) == _signature(graph.inputs)
    assert [d for t in out.inputs for d in t.shape if isinstance(d, str)] == ["batch", "sequence"] * len(out.inputs)
    assert _signature(out.outputs) == _signature(graph.outputs)
    assert len(out.nodes) < len(graph.nodes)
    for batch, seq in ((1, 5), (3, 17)):
        feeds = inputs.text_feeds([t.name for t in graph.inputs], batch, seq, 1000, seed=batch)
        for want, got in zip(run_ort(gs.export_onnx(graph), feeds), run_ort(gs.export_onnx(out), feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_verify_output_and_report_with_a_graph(exported, tmp_path):
    graph = gs.import_onnx(onnx.load(exported("mobilenet_v2")))
    dst = tmp_path / "out.onnx"
    out, report = optimize(graph, output=dst, verify="cpu", verify_options={"runs": 2, "warmup": 1},
                           return_report=True)
    assert report.verification["ok"] and report.verification["providers"]["cpu"]["outputs"]
    written = onnx.load(dst)  # the file holds the same model as the Graph returned
    assert [n.op_type for n in written.graph.node] == [n.op for n in out.nodes]
    assert len(written.graph.node) == sum(report.after.values())


def test_inplace_is_refused_and_the_graph_kept():
    x = gs.Variable("x", dtype=np.float32, shape=[2])
    y = gs.Variable("y", dtype=np.float32, shape=[2])
    graph = gs.Graph(nodes=[gs.Node("Identity", inputs=[x], outputs=[y])], inputs=[x], outputs=[y], opset=17)
    before = _snapshot(graph)
    with pytest.raises(UsageError, match="graphsurgeon Graph is never modified"):
        optimize(graph, inplace=True)
    assert _snapshot(graph) == before


def test_a_graph_graphsurgeon_cannot_export_or_onnx_rejects_is_one_line():
    x = gs.Variable("x", dtype=np.float32, shape=[2])
    untyped = gs.Variable("y")  # a graph output without a dtype: graphsurgeon's export refuses it
    graph = gs.Graph(nodes=[gs.Node("Relu", inputs=[x], outputs=[untyped])], inputs=[x], outputs=[untyped], opset=17)
    with pytest.raises(InvalidModelError, match=r"^graphsurgeon Graph: onnx_graphsurgeon cannot export it: .*dtype") as err:
        optimize(graph)
    assert "\n" not in str(err.value)
    # nodes out of order (graphsurgeon leaves sorting to toposort()): the checker's reason, on one line
    a, b = gs.Variable("a", dtype=np.float32), gs.Variable("b", dtype=np.float32, shape=[2])
    graph = gs.Graph(nodes=[gs.Node("Relu", inputs=[a], outputs=[b]), gs.Node("Relu", inputs=[x], outputs=[a])],
                     inputs=[x], outputs=[b], opset=17)
    with pytest.raises(InvalidModelError, match="^graphsurgeon Graph fails the ONNX checker: .*topologically sorted") as err:
        optimize(graph)
    assert "\n" not in str(err.value)

