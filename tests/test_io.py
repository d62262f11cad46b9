"""The library face: ``onnxopt.optimize`` on every input form, and ``onnxopt.ir.io`` (load/save)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import onnxopt
import onnxopt.ir.io
from onnxopt.models import synthetic

from conftest import assert_same_outputs, run_ort

FOLDED_AWAY = ("BatchNormalization", "Identity")


# --------------------------------------------------------------------------------------------
# helpers


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def op_types(model) -> list[str]:
    if isinstance(model, ir.Model):
        return [n.op_type for g in model.graphs() for n in g]
    if isinstance(model, (bytes, str, Path)):
        model = onnx.load_model_from_string(model) if isinstance(model, bytes) else onnx.load(str(model))
    return [n.op_type for n in model.graph.node]


def node_count(model: ir.Model) -> int:
    return sum(len(g) for g in model.graphs())


def as_runnable(model):
    """Something run_ort accepts."""
    if isinstance(model, ir.Model):
        return ir.to_proto(model)
    if isinstance(model, Path):
        return str(model)
    return model


def save_external(model: onnx.ModelProto, path: Path, location: str = "w.data") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # onnx.save moves the tensors of the proto it saves out of line
    onnx.save(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=location, size_threshold=0)
    return path


def external_locations(path: Path) -> set[str]:
    """The external data file names the saved model at ``path`` refers to."""
    proto = onnx.load(str(path), load_external_data=False)
    locations = set()
    for t in proto.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            locations.update(e.value for e in t.external_data if e.key == "location")
    return locations


@pytest.fixture(scope="module")
def small():
    return synthetic.build(20)


@pytest.fixture(scope="module")
def feeds(small):
    return synthetic.inputs(small)


@pytest.fixture(scope="module")
def wide():
    """16 channels: conv weights of 9 KiB, above io.save's 1 KiB external-data threshold."""
    return synthetic.build(20, channels=16)


@pytest.fixture(scope="module")
def wide_feeds(wide):
    return synthetic.inputs(wide)


# --------------------------------------------------------------------------------------------
# Each input form gives back the same kind


@pytest.mark.parametrize("form", ["str", "path", "bytes", "proto", "ir"])
def test_each_form_gives_back_same_kind(form, small, feeds, tmp_path):
    src = tmp_path / "in.onnx"
    onnx.save(small, str(src))
    out = tmp_path / "out.onnx"
    if form == "str":
        result = onnxopt.optimize(str(src), output=str(out))
        assert type(result) is str and result == str(out)
        assert out.is_file()
    elif form == "path":
        result = onnxopt.optimize(src, output=out)
        assert isinstance(result, Path) and result == out
        assert out.is_file()
    elif form == "bytes":
        result = onnxopt.optimize(small.SerializeToString())
        assert type(result) is bytes
    elif form == "proto":
        result = onnxopt.optimize(small)
        assert isinstance(result, onnx.ModelProto)
    else:
        result = onnxopt.optimize(ir.from_proto(small))
        assert isinstance(result, ir.Model)
    ops = op_types(result)
    for op in FOLDED_AWAY:
        assert op not in ops
    assert ops.count("Conv") == 4 and len(ops) == 12
    assert_same_outputs(small, as_runnable(result), feeds)


def test_ir_model_not_mutated_unless_inplace(small, feeds):
    model = ir.from_proto(small)
    before = node_count(model)
    result = onnxopt.optimize(model)
    assert result is not model
    assert node_count(model) == before == 20
    assert "BatchNormalization" in op_types(model)
    assert node_count(result) == 12
    # The untouched original still computes the same thing.
    assert_same_outputs(small, ir.to_proto(model), feeds)

    result = onnxopt.optimize(model, inplace=True)
    assert result is model
    assert node_count(model) == 12
    assert_same_outputs(small, ir.to_proto(model), feeds)


def test_proto_input_not_mutated(small):
    data = small.SerializeToString()
    onnxopt.optimize(small)
    assert small.SerializeToString() == data


def test_in_memory_form_with_output_also_writes_file(small, feeds, tmp_path):
    out = tmp_path / "written.onnx"
    result = onnxopt.optimize(small.SerializeToString(), output=out)
    assert type(result) is bytes
    assert out.is_file()
    assert "BatchNormalization" not in op_types(out)
    assert_same_outputs(small, str(out), feeds)


def test_return_report(small, tmp_path):
    src = tmp_path / "in.onnx"
    onnx.save(small, str(src))
    result, report = onnxopt.optimize(src, output=tmp_path / "out.onnx", return_report=True)
    assert isinstance(result, Path)
    d = report.as_dict()
    assert d["nodes_before"] == 20 and d["nodes_after"] == 12
    assert report.fired == {"conv_bn_fold": 4, "identity_elimination": 4}
    assert report.before["BatchNormalization"] == 4 and "BatchNormalization" not in report.after


def test_unsupported_input_type_is_usage_error():
    with pytest.raises(onnxopt.UsageError):
        onnxopt.optimize(12345)


# --------------------------------------------------------------------------------------------
# The input file is never modified


def test_input_file_unchanged(small, tmp_path):
    src = tmp_path / "in.onnx"
    onnx.save(small, str(src))
    digest, mtime = sha256(src), src.stat().st_mtime_ns
    onnxopt.optimize(src, output=tmp_path / "out.onnx")
    assert sha256(src) == digest
    assert src.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("spelling", ["same", "str", "dotdot"])
def test_output_same_as_input_refused(spelling, small, tmp_path):
    (tmp_path / "sub").mkdir()
    src = tmp_path / "in.onnx"
    onnx.save(small, str(src))
    digest = sha256(src)
    output = {"same": src, "str": str(src), "dotdot": tmp_path / "sub" / ".." / "in.onnx"}[spelling]
    with pytest.raises(onnxopt.UsageError):
        onnxopt.optimize(src, output=output)
    assert sha256(src) == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx", "sub"]


def test_path_input_without_output_is_usage_error(small, tmp_path):
    src = tmp_path / "in.onnx"
    onnx.save(small, str(src))
    with pytest.raises(onnxopt.UsageError):
        onnxopt.optimize(src)
    with pytest.raises(onnxopt.UsageError):
        onnxopt.optimize(str(src))
    assert [p.name for p in tmp_path.iterdir()] == ["in.onnx"]


# --------------------------------------------------------------------------------------------
# External data


@pytest.fixture
def external_model(wide, tmp_path):
    """``src/m.onnx`` with every weight in ``src/w.data`` (loaded from another working directory)."""
    path = save_external(wide, tmp_path / "src" / "m.onnx")
    assert (tmp_path / "src" / "w.data").stat().st_size > 0
    return path


def test_external_data_default_name(external_model, wide, wide_feeds, tmp_path):
    digest = sha256(external_model.parent / "w.data")
    out = tmp_path / "dst" / "opt.onnx"
    out.parent.mkdir()
    assert onnxopt.optimize(external_model, output=out) == out
    data = out.parent / "opt.onnx.data"
    assert data.is_file() and data.stat().st_size > 0
    assert external_locations(out) == {"opt.onnx.data"}
    assert sorted(p.name for p in out.parent.iterdir()) == ["opt.onnx", "opt.onnx.data"]
    assert "BatchNormalization" not in op_types(out)
    # Run from another cwd: the data file must be found next to the model.
    os.chdir(tmp_path)
    assert_same_outputs(wide, str(out), wide_feeds, rtol=1e-4, atol=1e-4)
    assert sha256(external_model.parent / "w.data") == digest


def test_external_data_false_gives_single_file(external_model, wide, wide_feeds, tmp_path):
    out = tmp_path / "dst" / "single.onnx"
    out.parent.mkdir()
    onnxopt.optimize(external_model, output=out, external_data=False)
    assert [p.name for p in out.parent.iterdir()] == ["single.onnx"]
    assert external_locations(out) == set()
    os.chdir(tmp_path)
    assert_same_outputs(wide, str(out), wide_feeds, rtol=1e-4, atol=1e-4)


def test_external_data_custom_name(external_model, wide, wide_feeds, tmp_path):
    out = tmp_path / "dst" / "custom.onnx"
    out.parent.mkdir()
    onnxopt.optimize(external_model, output=out, external_data="custom.bin")
    assert sorted(p.name for p in out.parent.iterdir()) == ["custom.bin", "custom.onnx"]
    assert (out.parent / "custom.bin").stat().st_size > 0
    assert external_locations(out) == {"custom.bin"}
    os.chdir(tmp_path)
    assert_same_outputs(wide, str(out), wide_feeds, rtol=1e-4, atol=1e-4)


def test_external_data_true_for_in_memory_model(wide, wide_feeds, tmp_path):
    out = tmp_path / "mem.onnx"
    result = onnxopt.optimize(wide, output=out, external_data=True)
    assert isinstance(result, onnx.ModelProto)
    assert external_locations(out) == {"mem.onnx.data"}
    assert_same_outputs(wide, str(out), wide_feeds, rtol=1e-4, atol=1e-4)


def test_load_does_not_read_weights_eagerly(external_model):
    loaded = onnxopt.ir.io.load(external_model)
    assert loaded.kind == "path" and loaded.external
    inits = list(loaded.model.graph.initializers.values())
    assert len(inits) == 4 * 2 + 4 * 4 - 1  # weights + biases (one block has none) + BN params
    for value in inits:
        assert isinstance(value.const_value, ir.ExternalTensor), value.name


def test_load_external_data_model_from_another_directory(wide, wide_feeds, tmp_path, monkeypatch):
    src = save_external(wide, tmp_path / "src" / "m.onnx")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    loaded = onnxopt.ir.io.load(src)
    assert loaded.external
    out = onnxopt.optimize(src, output=tmp_path / "out.onnx")
    assert_same_outputs(wide, str(out), wide_feeds, rtol=1e-4, atol=1e-4)


def test_output_data_file_never_overwrites_input_data(external_model, wide, wide_feeds):
    data = external_model.parent / "w.data"
    digest = sha256(data)
    try:
        onnxopt.optimize(external_model, output=external_model.parent / "o.onnx", external_data="w.data")
    except onnxopt.UsageError:
        pass  # refusing is fine too
    assert sha256(data) == digest
    run_ort(str(external_model), wide_feeds)


def test_missing_external_data_file(wide, tmp_path):
    src = save_external(wide, tmp_path / "m.onnx", location="weights.bin")
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(onnxopt.InvalidModelError, match=r"weights\.bin"):
        onnxopt.ir.io.load(src)
    with pytest.raises(onnxopt.InvalidModelError, match=r"weights\.bin"):
        onnxopt.optimize(src, output=tmp_path / "out.onnx")
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_truncated_external_data_file(wide, tmp_path):
    src = save_external(wide, tmp_path / "m.onnx", location="weights.bin")
    data = tmp_path / "weights.bin"
    full = data.read_bytes()
    data.write_bytes(full[: len(full) // 2])
    with pytest.raises(onnxopt.InvalidModelError, match=r"weights\.bin.*too short"):
        onnxopt.optimize(src, output=tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


# --------------------------------------------------------------------------------------------
# IR version


def test_ir_version_clamped_for_onnxruntime(tmp_path):
    limit = onnxopt.ir.io.onnxruntime_max_ir_version()
    assert limit is not None and limit >= 7
    model = synthetic.build(10, ir_version=14)
    feeds = synthetic.inputs(model)
    src = tmp_path / "ir14.onnx"
    onnx.save(model, str(src))
    assert onnx.load(str(src)).ir_version == 14

    out = onnxopt.optimize(src, output=tmp_path / "out.onnx")
    assert onnx.load(str(out)).ir_version <= limit
    proto = onnxopt.optimize(model)
    assert proto.ir_version <= limit
    expected = run_ort(synthetic.build(10), feeds)  # same weights at IR 10
    for got in (run_ort(str(out), feeds), run_ort(proto, feeds)):
        np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)


def test_onnxruntime_max_ir_version_is_exact():
    import onnxruntime as ort

    limit = onnxopt.ir.io.onnxruntime_max_ir_version()
    model = synthetic.build(5, ir_version=limit)
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    if limit < onnx.IR_VERSION:
        too_new = synthetic.build(5, ir_version=limit + 1)
        with pytest.raises(Exception):
            ort.InferenceSession(too_new.SerializeToString(), providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------------------------
# Atomic write


def _failing_save(written: list):
    def fake_save(model, path, *args, **kwargs):
        written.append(Path(path))
        Path(path).write_bytes(b"\x08\x0a partial model")
        raise OSError(28, "No space left on device")

    return fake_save


def test_atomic_write_leaves_no_target(small, tmp_path, monkeypatch):
    src = tmp_path / "in.onnx"
    onnx.save(small, str(src))
    written: list[Path] = []
    monkeypatch.setattr(ir, "save", _failing_save(written))
    out = tmp_path / "out.onnx"
    with pytest.raises(OSError):
        onnxopt.optimize(src, output=out)
    assert written and written[0] != out  # it wrote to a temporary file, not the target
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in.onnx"]


def test_atomic_write_keeps_existing_target(small, tmp_path, monkeypatch):
    src = tmp_path / "in.onnx"
    onnx.save(small, str(src))
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous contents")
    monkeypatch.setattr(ir, "save", _failing_save([]))
    with pytest.raises(OSError):
        onnxopt.optimize(src, output=out)
    assert out.read_bytes() == b"previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx", "out.onnx"]


def test_atomic_write_with_external_data_keeps_existing_output(tmp_path, monkeypatch):
    old_model = synthetic.build(20, channels=16, seed=1)
    new_model = synthetic.build(20, channels=16, seed=2)
    feeds = synthetic.inputs(old_model)
    out = tmp_path / "out.onnx"
    onnxopt.optimize(old_model, output=out, external_data=True)
    old_outputs = run_ort(str(out), feeds)
    snapshot = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(snapshot) == {"out.onnx", "out.onnx.data"}

    real_save = ir.save

    def save_then_fail(*args, **kwargs):
        real_save(*args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ir, "save", save_then_fail)
    with pytest.raises(OSError):
        onnxopt.optimize(new_model, output=out, external_data=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == snapshot
    np.testing.assert_array_equal(run_ort(str(out), feeds)[0], old_outputs[0])


def test_output_file_permissions_follow_umask(small, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "out.onnx"
        onnxopt.optimize(small, output=out)
        reference = tmp_path / "ref.onnx"
        onnx.save(small, str(reference))
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == reference.stat().st_mode & 0o777 == 0o644


# --------------------------------------------------------------------------------------------
# Determinism


def test_deterministic_output(tmp_path):
    model = synthetic.build(50)
    src = tmp_path / "in.onnx"
    onnx.save(model, str(src))
    a = onnxopt.optimize(src, output=tmp_path / "a.onnx")
    b = onnxopt.optimize(src, output=tmp_path / "b.onnx")
    assert a.read_bytes() == b.read_bytes()
    assert onnxopt.optimize(model).SerializeToString() == onnxopt.optimize(model).SerializeToString()


# --------------------------------------------------------------------------------------------
# Bad inputs


def _dangling_input_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "nowhere"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _conv_missing_weight_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])
    graph = helper.make_graph([helper.make_node("Conv", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def bad_contents(kind: str) -> bytes:
    if kind == "random":
        return np.random.default_rng(123).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    if kind == "text":
        return b"this is not an ONNX model\njust some text\n"
    if kind == "empty":
        return b""
    if kind == "truncated":
        data = synthetic.build(20).SerializeToString()
        return data[: int(len(data) * 0.6)]
    if kind == "dangling_input":
        return _dangling_input_model().SerializeToString()
    if kind == "conv_missing_input":
        return _conv_missing_weight_model().SerializeToString()
    raise AssertionError(kind)


BAD_KINDS = ["random", "text", "empty", "truncated", "dangling_input", "conv_missing_input"]
MESSAGES = {
    "random": "not an ONNX model|truncated or corrupted",
    "text": "not an ONNX model",
    "empty": "not an ONNX model",
    "truncated": "truncated",
    "dangling_input": "fails the ONNX checker",
    "conv_missing_input": "fails the ONNX checker",
}


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_file_is_invalid_model(kind, tmp_path):
    src = tmp_path / "bad.onnx"
    src.write_bytes(bad_contents(kind))
    out = tmp_path / "out.onnx"
    with pytest.raises(onnxopt.InvalidModelError, match=MESSAGES[kind]) as info:
        onnxopt.optimize(src, output=out)
    message = str(info.value)
    assert message and "\n" not in message.strip()
    assert "bad.onnx" in message
    assert not out.exists()


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_bytes_is_invalid_model(kind):
    with pytest.raises(onnxopt.InvalidModelError, match=MESSAGES[kind]):
        onnxopt.optimize(bad_contents(kind))


@pytest.mark.parametrize("build", [_dangling_input_model, _conv_missing_weight_model])
def test_bad_proto_is_invalid_model(build):
    with pytest.raises(onnxopt.InvalidModelError, match="checker"):
        onnxopt.optimize(build())


def test_nonexistent_path_is_invalid_model(tmp_path):
    with pytest.raises(onnxopt.InvalidModelError, match="no such file"):
        onnxopt.optimize(tmp_path / "missing.onnx", output=tmp_path / "out.onnx")
    assert list(tmp_path.iterdir()) == []


def test_directory_is_invalid_model(tmp_path):
    (tmp_path / "model.onnx").mkdir()
    with pytest.raises(onnxopt.InvalidModelError, match="directory"):
        onnxopt.optimize(tmp_path / "model.onnx", output=tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_invalid_model_error_is_value_error():
    # Callers that catch ValueError keep working.
    with pytest.raises(ValueError):
        onnxopt.optimize(b"garbage bytes that are not a model")


def test_streamed_save_is_the_same_model(tmp_path):
    """Single-file saves stream large weights from their buffers; the file must parse to the
    model onnx_ir's own save writes (up to the order of initializers and their value_info)."""
    import ml_dtypes
    from onnx import TensorProto, helper, numpy_helper

    from onnxopt.ir import io as oio

    rng = np.random.default_rng(0)
    big32 = rng.standard_normal((64, 64)).astype(np.float32)
    big16 = rng.standard_normal((16, 64)).astype(np.float16)
    bigbf = rng.standard_normal(1024).astype(ml_dtypes.bfloat16)
    big8 = rng.integers(-128, 127, 4096).astype(np.int8)
    small = np.arange(3, dtype=np.int64)
    inits = [numpy_helper.from_array(big32, "w32"), numpy_helper.from_array(big16, "w16"),
             numpy_helper.from_array(big8, "w8"), numpy_helper.from_array(small, "s"),
             helper.make_tensor("wbf", TensorProto.BFLOAT16, [1024], bigbf.view(np.uint16).tobytes(), raw=True)]
    inits[0].doc_string = "weights"
    nodes = [helper.make_node("MatMul", ["x", "w32"], ["a"]), helper.make_node("Cast", ["w16"], ["c"], to=1),
             helper.make_node("Add", ["a", "c"], ["y"]), helper.make_node("Cast", ["w8"], ["z8"], to=1),
             helper.make_node("Cast", ["wbf"], ["zb"], to=1), helper.make_node("Identity", ["s"], ["si"])]
    vi = helper.make_tensor_value_info
    m = helper.make_model(helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [16, 64])],
                                            [vi("y", TensorProto.FLOAT, [16, 64]), vi("z8", TensorProto.FLOAT, [4096]),
                                             vi("zb", TensorProto.FLOAT, [1024]), vi("si", TensorProto.INT64, [3])],
                                            inits), opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    model = ir.from_proto(m)
    a, b = tmp_path / "streamed.onnx", tmp_path / "reference.onnx"
    assert oio.write_streamed(model, a)
    ir.save(model, b)
    pa, pb = onnx.load(str(a)), onnx.load(str(b))
    for q in (pa, pb):
        for field in (q.graph.initializer, q.graph.value_info):
            items = sorted(field, key=lambda t: t.name)
            del field[:]
            field.extend(items)
    assert pa == pb
    assert [t.name for t in onnx.load(str(a)).graph.initializer] == list(model.graph.initializers)[3:4] + [
        "w32", "w16", "w8", "wbf"]
    assert list(model.graph.initializers) == ["w32", "w16", "w8", "s", "wbf"]  # the model is left as it was
    ort = pytest.importorskip("onnxruntime")
    feeds = {"x": rng.standard_normal((16, 64)).astype(np.float32)}
    got = ort.InferenceSession(str(a), providers=["CPUExecutionProvider"]).run(None, feeds)
    want = ort.InferenceSession(str(b), providers=["CPUExecutionProvider"]).run(None, feeds)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def test_streamed_save_of_ml_dtypes_and_annotated_weights(tmp_path):
    """bfloat16/float8 weights stream through a byte view; weights carrying value metadata or a
    quantization annotation are left to onnx_ir's serializer, which writes those beside them."""
    import ml_dtypes

    from onnxopt.ir import io as oio

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([600]))
    bf = ir.Value(name="bf", const_value=ir.Tensor(np.arange(600).astype(ml_dtypes.bfloat16)))
    f8 = ir.Value(name="f8", const_value=ir.Tensor(np.ones(2000).astype(ml_dtypes.float8_e4m3fn)))
    c = ir.Node("", "Cast", [bf], attributes=[ir.AttrInt64("to", 1)], outputs=[ir.Value(name="c")])
    y = ir.Value(name="y", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([600]))
    add = ir.Node("", "Add", [x, c.outputs[0]], outputs=[y])
    graph = ir.Graph([x], [y], nodes=[c, add], initializers=[bf, f8], opset_imports={"": 21})
    model = ir.Model(graph, ir_version=10)
    path = tmp_path / "m.onnx"
    assert oio.write_streamed(model, path)
    loaded = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    np.testing.assert_array_equal(loaded["bf"].astype(np.float32), np.arange(600).astype(ml_dtypes.bfloat16).astype(np.float32))
    assert loaded["f8"].view(np.uint8).tolist() == np.ones(2000).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).tolist()
    # annotated: not streamed here, so io.save keeps the annotation through onnx_ir
    bf.metadata_props["origin"] = "layer1"
    f8.meta["quant_parameter_tensor_names"] = {"SCALE_TENSOR": "x"}
    assert not oio.write_streamed(model, tmp_path / "n.onnx")
    oio.save(model, tmp_path / "n.onnx")
    proto = onnx.load(str(tmp_path / "n.onnx"))
    assert [q.tensor_name for q in proto.graph.quantization_annotation] == ["f8"]
    assert any(v.name == "bf" and v.metadata_props for v in proto.graph.value_info)
