"""The zoo's transformer exports for the fusion tests (tests/rules/test_activation.py,
test_normalization.py): the model (skipped when the zoo cache lacks it) and padded text feeds at a
batch and sequence length of the test's choice (the dynamic axes)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_ort

# The options the fusion tests optimize with: the onnxruntime CPU target, where every one of these
# rules is valid. (Should the measured benefit table leave a fusion out on ort-cpu, this is the one
# place to ask for it anyway, so that the rule itself is still tested.)
ORT_CPU = {"target": "ort-cpu"}


@pytest.fixture
def every_fusion():
    """The whole library on the target, whatever the shipped benefit table says (it leaves out on
    ort-cpu what measured slower there, tests/test_benefit.py checks that): these tests check the
    rules themselves."""
    from onnxopt.targets import benefit

    with benefit.using(None):
        yield

TRANSFORMERS = ["bert-legacy", "bert-dynamo", "gpt2-legacy", "gpt2-dynamo", "minilm-legacy", "minilm-dynamo"]
LAYERS = {"bert": 4, "gpt2": 4, "minilm": 6}


def load(name: str) -> onnx.ModelProto:
    from onnxopt.models import zoo

    path = zoo.get(name).path()
    if not path.exists():
        pytest.skip(f"{name} is not in the zoo cache ({path}): python -m onnxopt.models build --only {name}")
    return onnx.load(str(path))


def feeds(name: str, proto: onnx.ModelProto, batch: int, seq: int) -> dict:
    from onnxopt.models import inputs, transformers_models

    kind = name.split("-")[0]
    vocab = transformers_models.VOCAB_SIZE[kind]
    kw = {"bert": {}, "gpt2": {"pad_id": transformers_models.GPT2_CONFIG["eos_token_id"]},
          "minilm": {"low": 999, "cls_id": 101, "sep_id": 102}}[kind]
    return inputs.text_inputs(batch, seq, vocab, **kw)(proto, 0)


def assert_close(name: str, before: onnx.ModelProto, after: onnx.ModelProto, rtol: float = 1e-4, *,
                 ort_optimize: bool = False) -> None:
    """onnxruntime CPU gives ``after`` the outputs of ``before`` within ``rtol`` of each output's
    largest magnitude, at two batch sizes and sequence lengths (padded rows included); graph
    optimizations off (``ort_optimize``: on, for ``after``)."""
    for batch, seq in ((2, 16), (1, 7)):
        f = feeds(name, before, batch, seq)
        for a, b in zip(run_ort(before, f), run_ort(after, f, optimize=ort_optimize), strict=True):
            assert a.shape == b.shape
            scale = max(float(np.abs(a).max()), 1e-30)
            np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * scale)
