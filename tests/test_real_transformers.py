"""Real architectures: transformers BERT and GPT-2 (small configs, random weights) from both
exporters, with dynamic batch and sequence axes.

The optimized model must give the original's outputs (max relative difference 1e-5) at two
sequence lengths and batch sizes (the dynamic axes stay dynamic), have fewer nodes, and make
onnxruntime run no more kernels than the original does.
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

pytest.importorskip("torch", reason="torch (the 'export' extra) is needed to export transformers models")
pytest.importorskip("transformers", reason="transformers (the 'export' extra) is needed to build BERT/GPT-2")
ort = pytest.importorskip("onnxruntime")

from onnxopt import optimize  # noqa: E402
from onnxopt.models import inputs, transformers_models  # noqa: E402

CASES = [("bert", "legacy"), ("bert", "dynamo"), ("gpt2", "legacy"), ("gpt2", "dynamo")]


def _kernels(path, feeds) -> tuple[int, list]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = str(path.parent / f"profile-{path.stem}")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = {i.name: feeds[i.name] for i in sess.get_inputs()}
    sess.run(None, feeds)
    outs = sess.run(None, feeds)
    profile = sess.end_profiling()
    with open(profile) as f:
        events = json.load(f)
    os.unlink(profile)
    runs = [e for e in events if e.get("name") == "model_run"]
    last = runs[-1]
    start, end = last["ts"], last["ts"] + last["dur"]
    n = sum(1 for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
            and start <= e["ts"] <= end)
    return n, outs


@pytest.mark.parametrize("kind,exporter", CASES, ids=[f"{k}-{e}" for k, e in CASES])
def test_transformer_model(tmp_path, kind, exporter):
    src = tmp_path / f"{kind}-{exporter}.onnx"
    transformers_models.export(kind, src, exporter=exporter, cache=tmp_path)
    before = src.read_bytes()
    dst = tmp_path / "opt.onnx"
    _, report = optimize(src, output=dst, return_report=True)
    assert src.read_bytes() == before
    assert sum(report.after.values()) < sum(report.before.values())
    assert report.fired.get("constant_folding", 0) + report.fired.get("shape_folding", 0) > 0
    if kind == "gpt2":  # its Conv1D layers: Gemm on flattened rows, as a MatMul on the 3-D input
        assert report.fired.get("gemm_flatten_to_matmul", 0) >= 4
    proto = onnx.load(str(src), load_external_data=False)
    vocab = 8192
    for batch, seq in ((2, 16), (1, 7)):
        feeds = inputs.text_inputs(batch, seq, vocab, pad_id=vocab - 1 if kind == "gpt2" else 0)(proto, 0)
        k0, a = _kernels(src, feeds)
        k1, b = _kernels(dst, feeds)
        assert k1 <= k0
        for x, y in zip(a, b):
            assert x.shape == y.shape
            scale = max(float(np.abs(x).max()), 1e-30)
            assert float(np.abs(x - y).max()) / scale <= 1e-5
