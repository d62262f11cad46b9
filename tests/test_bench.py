"""scripts/bench/peers.py: kernel counting, output comparison, error rows, markdown bold, on small models."""

from __future__ import annotations

import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("onnxruntime")

from scripts.bench import peers as bench


def _chain_model(ops=("Relu", "Neg", "Abs")) -> onnx.ModelProto:
    names = ["x"] + [f"t{i}" for i in range(len(ops) - 1)] + ["y"]
    nodes = [helper.make_node(op, [names[i]], [names[i + 1]], name=f"n{i}") for i, op in enumerate(ops)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_kernel_counter_counts_one_run_of_a_tiny_model(tmp_path):
    path = tmp_path / "chain.onnx"
    onnx.save(_chain_model(), path)
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 2}
    result, outs = bench.evaluate(str(path), feeds, profile_dir=str(tmp_path), warmup=2)
    assert result["nodes"] == 3
    assert result["runs_in_profile"] == 3  # two warm-ups and the profiled run ...
    assert result["kernels"] == 3  # ... of which only the last is counted
    assert result["by_op"] == {"Abs": 1, "Neg": 1, "Relu": 1}
    assert result["by_provider"] == {"CPUExecutionProvider": 3}
    np.testing.assert_array_equal(outs[0][1], np.abs(-np.maximum(feeds["x"], 0)))


def test_kernel_counter_on_synthetic_profile():
    def node(name, ts):
        return {"cat": "Node", "name": name, "ts": ts, "dur": 1, "args": {"op_name": "Relu", "provider": "CPUExecutionProvider"}}

    events = [node("a_kernel_time", 1), node("a_fence_before", 1), {"cat": "Session", "name": "model_run", "ts": 0, "dur": 5},
              node("a_kernel_time", 11), node("b_kernel_time", 12), node("b_fence_after", 13),
              {"cat": "Session", "name": "model_run", "ts": 10, "dur": 5}]
    assert bench.count_kernels(events)["kernels"] == 2


def test_count_nodes_includes_subgraphs():
    then_g = helper.make_graph([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Abs", ["a"], ["o"])], "then",
                               [], [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2, 3])])
    else_g = helper.make_graph([helper.make_node("Relu", ["x"], ["o2"])], "else", [],
                               [helper.make_tensor_value_info("o2", TensorProto.FLOAT, [2, 3])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    total, ops = bench.count_nodes(helper.make_model(graph))
    assert total == 4 and ops == {"Abs": 1, "If": 1, "Neg": 1, "Relu": 1}


def test_compare_outputs_by_name_then_position():
    a = np.array([1.0, -4.0, 0.001], np.float32)
    b = a + np.array([0.0, 0.4, 0.001], np.float32)
    r = bench.compare_outputs([("y", a)], [("y", b)])
    assert r["matched_by"] == "name"
    assert r["max_abs"] == pytest.approx(0.4, rel=1e-5)
    assert r["max_rel"] == pytest.approx(0.1, rel=1e-5)  # 0.4 / max|a| = 0.4 / 4
    assert r["max_elem_rel"] == pytest.approx(0.25, rel=1e-3)  # 0.001 / max(0.001, 1e-3 * 4)
    r = bench.compare_outputs([("y", a)], [("renamed", a)])
    assert r["matched_by"] == "position" and r["max_abs"] == 0 and r["max_rel"] == 0
    assert "shape" in bench.compare_outputs([("y", a)], [("y", a[:2])])["error"]


FAKE_TOOLS = '''
import os

def setup_broken(ctx):
    def run(src, dst):
        raise RuntimeError("boom\\nsecond line")
    return run

def setup_crash(ctx):
    def run(src, dst):
        os.abort()
    return run
'''


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """bench_model on a 100-node synthetic model: onnxopt, a tool that raises, a tool that crashes."""
    from onnxopt.models import synthetic

    tmp = tmp_path_factory.mktemp("bench")
    path = tmp / "synthetic-100.onnx"
    onnx.save(synthetic.build(100), path)
    (tmp / "fake_tools.py").write_text(textwrap.dedent(FAKE_TOOLS))
    tools = [bench.peers.get_tool("onnxopt"),
             bench.Tool("broken", "fake_tools:setup_broken", "onnx", "raises", pythonpath=str(tmp)),
             bench.Tool("crashes", "fake_tools:setup_crash", "onnx", "aborts", pythonpath=str(tmp)),
             bench.Tool("transformers-only", "fake_tools:setup_broken", "onnx", "never run", families=("transformer",),
                        pythonpath=str(tmp))]
    feeds = synthetic.inputs(onnx.load(path), 0)
    opts = bench.Options(repeat=2, runs=3, warmup=1, timeout=120, latency_budget=5, min_rounds=2)
    log = []
    result = bench.bench_model("synthetic-100", path, "synthetic", feeds, tools, opts, tmp / "work", log.append)
    return result, log


def test_failing_tools_are_error_rows_and_the_rest_goes_on(synthetic_run):
    result, log = synthetic_run
    rows = result["rows"]
    assert result["tools"] == ["onnxopt", "broken", "crashes"]  # the transformer-only tool does not apply
    assert rows["broken"]["status"] == "error"
    assert rows["broken"]["error"] == "RuntimeError: boom"
    assert rows["crashes"]["status"] == "error" and "crashed" in rows["crashes"]["error"]
    assert rows["onnxopt"]["status"] == "ok"
    assert len(rows["onnxopt"]["optimize_s"]) == 2
    assert rows["onnxopt"]["cpu_latency"]["rounds"] >= 2
    assert "cpu_latency" not in rows["broken"]
    assert any("broken: FAILED" in line for line in log)


def test_onnxopt_row_folds_batchnorm(synthetic_run):
    rows = synthetic_run[0]["rows"]
    assert rows["original"]["op_types"]["BatchNormalization"] == 20
    assert rows["onnxopt"]["op_types"].get("BatchNormalization", 0) == 0
    assert rows["onnxopt"]["nodes"] < rows["original"]["nodes"]
    assert rows["onnxopt"]["cpu"]["kernels"] > 0
    assert rows["onnxopt"]["max_rel"] < 1e-4
    assert rows["original"]["cpu_latency"]["ratio"] == 1.0


def test_markdown_bolds_the_minimum(synthetic_run):
    result = synthetic_run[0]
    report = {"meta": {"date": "d", "command": "c", "machine": bench.machine_info(), "versions": {"onnx": "1"},
                       "providers": ["cpu"], "options": vars(bench.Options()), "tool_docs": []},
              "models": {"synthetic-100": result}}
    md = bench.render_markdown(report)
    assert "**CPU kernels per run**" in md  # the summary tables
    table = md[md.index("## synthetic-100"):]
    onnxopt_row = next(ln for ln in table.splitlines() if ln.startswith("| onnxopt |"))
    original_row = next(ln for ln in table.splitlines() if ln.startswith("| original |"))
    nodes = result["rows"]["onnxopt"]["nodes"]
    assert f"**{nodes}**" in onnxopt_row.split("|")[4]
    assert "**" not in original_row.split("|")[4]
    assert "error: RuntimeError: boom" in table


def test_markdown_bold_on_handmade_rows():
    def row(nodes, ms, status="ok"):
        return {"status": status, "nodes": nodes, "cpu": {"kernels": nodes}, "optimize_median_s": nodes / 100,
                "cpu_latency": {"median_ms": ms, "p90_ms": ms, "ratio": ms / 10}, "max_abs": 0.0, "max_rel": 0.0}

    result = {"tools": ["a", "b", "c"], "rows": {
        "original": {**row(50, 10), "status": "baseline", "optimize_median_s": None}, "a": row(30, 9), "b": row(40, 8), "c": row(10, 1, "differs")}}
    table = bench.model_table(result, cuda=False)
    cells = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in table.splitlines()[2:]}
    assert cells["a"][2] == "**30**" and cells["b"][2] == "40" and cells["c"][2] == "10"  # nodes: "differs" not ranked
    assert cells["b"][4] == "**8**" and cells["a"][4] == "9"  # latency
    assert cells["original"][1] == "—"


def test_cli_rejects_unknown_model_and_tool(capsys):
    assert bench.main(["--models", "no-such-model"]) == 2
    assert bench.main(["--tools", "no-such-tool"]) == 2
    assert "no tool named" in capsys.readouterr().err


def _report(models: dict, providers=("cpu",), date="2026-01-01 00:00 UTC", command="cmd") -> dict:
    meta = {"date": date, "command": command, "machine": {"platform": "p", "python": "3"}, "gpu": "GPU X, 1",
            "versions": {"onnx": "1"}, "providers": list(providers), "tool_docs": [],
            "options": {"repeat": 1, "runs": 1, "warmup": 1, "latency_budget": 1.0, "tolerance": 1e-3, "gap": 0.002}}
    return {"meta": meta, "models": models}


def test_render_merges_cuda_reports_into_a_section(tmp_path):
    def row(k, cuda_k=None, status="ok", **extra):
        r = {"status": status, "nodes": k, "cpu": {"kernels": k}, "max_abs": 0.0, "max_rel": 0.0, **extra}
        if cuda_k is not None:
            r["cuda"] = {"kernels": cuda_k, "by_provider": {"CUDAExecutionProvider": cuda_k}, "memcpy": 0}
        return r

    def model(fam, a_cuda, b_cuda, b_extra=None):
        return {"family": fam, "tools": ["a", "b"], "rows": {"original": row(9, 9, "baseline"), "a": row(5, a_cuda),
                                                            "b": row(7, b_cuda, **(b_extra or {}))}}

    import json

    cpu = _report({"m1": model("vision", None, None)})
    g1 = _report({"m1": model("vision", 3, None, {"cuda_error": "boom"})}, ("cpu", "cuda"), command="run1")
    g2 = _report({"m2": model("ocr", 4, 2), "m3": {"family": "x", "skipped": "not fetched"}}, ("cpu", "cuda"),
                 date="2026-01-02 00:00 UTC", command="run2")
    paths = []
    for i, r in enumerate([cpu, g1, g2]):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(r))
    out = tmp_path / "B.md"
    assert bench.main(["--render", str(paths[0]), "--cuda-report", str(paths[1]), str(paths[2]),
                       "--markdown", str(out)]) == 0
    text = out.read_text()
    main, cuda = text.split("## CUDA (GPU X)")
    assert "CUDA kernels per run" not in main and "CUDA kernels per run" in cuda
    assert "### m1" in cuda and "### m2" in cuda and "not fetched" in cuda
    assert "run1" in cuda and "run2" in cuda and "2026-01-01 00:00 UTC to 2026-01-02 00:00 UTC" in cuda
    kern = cuda.split("**CUDA kernels per run**")[1].split("\n\n")[1]
    cells = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in kern.splitlines()[2:]}
    assert cells["b"] == ["CUDA error", "**2**"] and cells["a"] == ["**3**", "4"]
    # a report without CUDA measurements is refused, with a one-line error
    assert bench.main(["--render", str(paths[0]), "--cuda-report", str(paths[0]), "--markdown", str(out)]) == 2
    assert bench.main(["--render", str(paths[0])]) == 2


def test_render_says_when_the_cuda_section_is_older(tmp_path):
    import json

    row = {"status": "ok", "nodes": 3, "cpu": {"kernels": 3}, "cuda": {"kernels": 2, "by_provider": {}, "memcpy": 0}}
    models = {"m": {"family": "vision", "tools": ["a"], "rows": {"original": dict(row, status="baseline"), "a": row}}}
    cpu = _report(models, date="2026-02-01 00:00 UTC")
    cpu["meta"]["onnxopt_commit"] = "new1234"
    gpu = _report(models, ("cpu", "cuda"), date="2026-01-01 00:00 UTC")
    gpu["meta"]["onnxopt_commit"] = "old5678"
    paths = []
    for i, r in enumerate([cpu, gpu, cpu]):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(r))
    out = tmp_path / "B.md"
    assert bench.main(["--render", str(paths[0]), "--cuda-report", str(paths[1]), "--markdown", str(out)]) == 0
    text = out.read_text()
    assert "(onnxopt at commit new1234)" in text.split("## CUDA")[0]
    assert "measured on 2026-01-01 00:00 UTC with onnxopt at old5678" in text.split("## CUDA")[1]
    # the same commit and date: no such note
    gpu["meta"].update(onnxopt_commit="new1234", date="2026-02-01 00:00 UTC")
    paths[1].write_text(json.dumps(dict(gpu, meta=dict(gpu["meta"], providers=["cpu", "cuda"]))))
    assert bench.main(["--render", str(paths[0]), "--cuda-report", str(paths[1]), "--markdown", str(out)]) == 0
    assert "so its onnxopt rows show that version" not in out.read_text()


def test_latency_sessions_take_a_thread_count(tmp_path, monkeypatch):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])]),
                          opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    seen = []
    real = ort.InferenceSession

    def spy(p, so=None, **kw):
        seen.append(so.intra_op_num_threads)
        return real(p, so, **kw)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    res = bench.measure_latency({"a": str(path)}, {"x": np.ones(4, np.float32)}, runs=3, warmup=1, threads=1)
    assert seen == [1] and res["rounds"] == 3 and len(res["results"]["a"]["times_ms"]) == 3
    assert bench.parse_args(["--threads", "1"]).threads == 1
