"""What onnxopt writes and what it refuses to read (issue 11: data loss, security, messages).

No file a command writes may be one it reads (the input, its external data) or another of its
outputs; every output path is checked before anything is written; a failure or an interrupt leaves
no output; every output runs from where it was written, alone; bad external data is refused on
its name and numbers alone; bad models are named for what is wrong with them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxopt
from onnxopt.ir import io as oio
from onnxopt.errors import InvalidModelError, RuleError, UsageError

from conftest import run_ort
from test_cli import assert_one_line_error, listing, run_cli, sha256

ROOT = Path(__file__).resolve().parent.parent


def _matmul_model(n: int = 64, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])
    w = numpy_helper.from_array(rng.standard_normal((n, n)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["t"], name="mm"),
                               helper.make_node("Relu", ["t"], ["y"], name="relu")], "g", [x], [y], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


FEEDS = {"x": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}


@pytest.fixture
def plain(tmp_path) -> Path:
    path = tmp_path / "m.onnx"
    onnx.save(_matmul_model(), path)
    return path


@pytest.fixture
def external(tmp_path) -> Path:
    """A model whose weight lives in ``ext.onnx.weights`` beside it."""
    folder = tmp_path / "in"
    folder.mkdir()
    onnx.save(_matmul_model(), folder / "ext.onnx", save_as_external_data=True, location="ext.onnx.weights",
              size_threshold=0)
    return folder / "ext.onnx"


def _externalize(tensor: onnx.TensorProto, folder: Path, location: str, **extra) -> None:
    """Move ``tensor``'s bytes to ``folder/location`` and point it there."""
    data = tensor.raw_data or numpy_helper.to_array(tensor).tobytes()
    (folder / location).write_bytes(data)
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    info = {"location": location, "offset": "0", "length": str(len(data)), **extra}
    for key, value in info.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _set_field(proto: onnx.ModelProto, key: str, value: str) -> None:
    """Set one external-data field of the model's (first) initializer."""
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == key:
            entry.value = value


def set_external_field(model: Path, key: str, value: str) -> None:
    proto = onnx.load(model, load_external_data=False)
    _set_field(proto, key, value)
    onnx.save(proto, model)


@pytest.fixture
def constant_external(tmp_path) -> Path:
    """The weight in a Constant node's ``value`` attribute, its data in ``c.bin`` beside the model."""
    proto = _matmul_model()
    weight = proto.graph.initializer.pop()
    proto.graph.node.insert(0, helper.make_node("Constant", [], ["w"], value=weight, name="const_w"))
    folder = tmp_path / "cin"
    folder.mkdir()
    _externalize(proto.graph.node[0].attribute[0].t, folder, "c.bin")
    onnx.save(proto, folder / "c.onnx")
    return folder / "c.onnx"


def snapshot(*folders: Path) -> dict[str, str]:
    return {str(p): sha256(p) for folder in folders for p in sorted(folder.rglob("*")) if p.is_file()}


def runs_alone(model: Path, tmp_path: Path) -> list[np.ndarray]:
    """Move the model and the files it names into a fresh folder, then run it there."""
    moved = tmp_path / f"moved-{model.stem}"
    moved.mkdir()
    for path in [model, *(model.parent / name for name in data_files(model))]:
        shutil.move(str(path), moved / path.name)
    return run_ort(str(moved / model.name), FEEDS)


def data_files(model: Path) -> list[str]:
    """The external data files ``model`` names (initializers and Constant nodes, subgraphs too)."""
    def tensors(graph):
        yield from graph.initializer
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.GRAPH:
                    yield from tensors(attr.g)

    names = []
    for tensor in tensors(onnx.load(model, load_external_data=False).graph):
        if tensor.data_location == TensorProto.EXTERNAL:
            location = next(e.value for e in tensor.external_data if e.key == "location")
            assert (model.parent / location).is_file(), f"{model.name} refers to {location}, not beside it"
            names.append(location)
    return sorted(set(names))


# --------------------------------------------------------------------------------------------
# 1. no output is an input, an input's data file, or another output


@pytest.mark.parametrize("target", ["input", "data", "output"])
def test_json_never_overwrites_an_input_its_data_or_the_model(target, external, tmp_path):
    out = tmp_path / "out.onnx"
    json_path = {"input": external, "data": external.parent / "ext.onnx.weights", "output": out}[target]
    before = snapshot(external.parent)
    r = run_cli(external, "-o", out, "--json", json_path)
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r.stderr)
    assert snapshot(external.parent) == before
    assert not out.exists() and listing(tmp_path) == ["in"]


def test_verify_json_never_overwrites_either_model(plain, tmp_path):
    other = tmp_path / "b.onnx"
    shutil.copy(plain, other)
    for target in (plain, other):
        before = sha256(target)
        r = run_cli("verify", plain, other, "--runs", "0", "--json", target)
        assert r.returncode == 2, r.stderr
        assert_one_line_error(r.stderr)
        assert sha256(target) == before


def test_bisect_json_never_overwrites_the_model(plain):
    before = sha256(plain)
    r = run_cli("bisect", plain, "--json", plain)
    assert r.returncode == 2 and sha256(plain) == before
    assert_one_line_error(r.stderr)


_RULES_TEXT = ('from onnxopt.core.pattern import Op, Rule\n'
               'RULES = [Rule("abs_abs", Op("Abs", Op("Abs", "x")), lambda m, b: b.op("Abs", m["x"]))]\n')


@pytest.mark.parametrize("face", ["optimize -o", "optimize --json", "verify --json", "bisect --json",
                                  "optimize --verify -o"])
def test_no_output_overwrites_the_rules_or_inputs_file(face, plain, tmp_path):
    """Rules files and the verifier's inputs file are read by the command too."""
    rules, npz = tmp_path / "r.py", tmp_path / "in.npz"
    rules.write_text(_RULES_TEXT)
    np.savez(npz, **FEEDS)
    out = tmp_path / "o.onnx"
    args = {"optimize -o": [plain, "-o", rules, "--rules", rules],
            "optimize --json": [plain, "-o", out, "--rules", rules, "--json", rules],
            "verify --json": ["verify", plain, plain, "--runs", "0", "--inputs", npz, "--json", npz],
            "bisect --json": ["bisect", plain, "--inputs", npz, "--json", npz],
            "optimize --verify -o": [plain, "-o", npz, "--verify", "cpu", "--runs", "0", "--inputs", npz]}[face]
    before = snapshot(tmp_path)
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert "never overwrites what it reads" in assert_one_line_error(r.stderr)
    assert snapshot(tmp_path) == before


def test_optimize_never_writes_the_verifiers_inputs_file(plain, tmp_path):
    npz = tmp_path / "in.npz"
    np.savez(npz, **FEEDS)
    before = sha256(npz)
    with pytest.raises(UsageError, match="never overwrites"):
        onnxopt.optimize(plain, output=npz, verify="cpu", verify_options={"inputs": npz, "runs": 0})
    assert sha256(npz) == before


@pytest.mark.skipif(not Path("/dev/fd").is_dir(), reason="needs /dev/fd")
def test_a_model_read_from_a_pipe_is_read_once(plain, tmp_path):
    """``onnxopt <(curl ...) -o out.onnx``: the model comes through a pipe, which the check for
    outputs that are inputs must not consume before it is loaded."""
    read, write = os.pipe()
    os.write(write, plain.read_bytes())  # (a small model fits the pipe's buffer)
    os.close(write)
    try:
        r = subprocess.run([sys.executable, "-m", "onnxopt", f"/dev/fd/{read}", "-o", str(tmp_path / "o.onnx"), "-q"],
                           capture_output=True, text=True, timeout=120, pass_fds=(read,))
    finally:
        os.close(read)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o.onnx").is_file()


def test_outputs_compared_through_symlinks_and_hard_links(plain, tmp_path):
    hard = tmp_path / "hard.json"
    os.link(plain, hard)
    soft = tmp_path / "soft.onnx"
    soft.symlink_to(plain)
    before = sha256(plain)
    for args in (["-o", tmp_path / "o1.onnx", "--json", hard], ["-o", soft]):
        r = run_cli(plain, *args)
        assert r.returncode == 2, r.stderr
        assert_one_line_error(r.stderr)
    assert sha256(plain) == before and not (tmp_path / "o1.onnx").exists()


def test_external_data_name_may_not_be_the_json_report(plain, tmp_path):
    r = run_cli(plain, "-o", tmp_path / "o.onnx", "--external-data", "r.json", "--json", tmp_path / "r.json")
    assert r.returncode == 2
    assert "its own file" in assert_one_line_error(r.stderr)
    assert listing(tmp_path) == ["m.onnx"]


# --------------------------------------------------------------------------------------------
# 2. every path checked before anything is written; a failure leaves nothing


@pytest.mark.parametrize("flag", ["-o", "--json"])
def test_output_naming_a_pipe_is_refused_not_replaced(flag, plain, tmp_path):
    """(as /dev/stdout would be: the rename into place replaced it with a regular file)"""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    args = ["-o", fifo] if flag == "-o" else ["-o", tmp_path / "o.onnx", "--json", fifo]
    r = run_cli(plain, *args)
    assert r.returncode == 2, r.stderr
    assert "not a regular file" in assert_one_line_error(r.stderr)
    assert fifo.is_fifo() and not (tmp_path / "o.onnx").exists()


def test_output_naming_a_directory_leaves_nothing(external, tmp_path):
    target = tmp_path / "adir"
    target.mkdir()
    r = run_cli(external, "-o", target)
    assert r.returncode == 2 and "directory" in assert_one_line_error(r.stderr)
    assert listing(tmp_path) == ["adir", "in"] and listing(target) == []


@pytest.mark.parametrize("bad", ["missing-folder", "file-as-folder"])
def test_unwritable_json_leaves_no_model(bad, external, tmp_path):
    (tmp_path / "afile").write_text("x")
    json_path = tmp_path / ("nodir" if bad == "missing-folder" else "afile") / "r.json"
    r = run_cli(external, "-o", tmp_path / "out.onnx", "--json", json_path)
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r.stderr)
    assert listing(tmp_path) == ["afile", "in"]


def test_missing_output_folder_names_the_folder_not_a_temp_file(plain, tmp_path):
    r = run_cli(plain, "-o", tmp_path / "nodir" / "x.onnx")
    line = assert_one_line_error(r.stderr)
    assert r.returncode == 2 and "nodir" in line and ".tmp" not in line


def test_failure_while_writing_leaves_no_output_at_all(external, tmp_path, monkeypatch):
    """The model and its data file are staged; a failure after the data file was staged (here:
    renaming the model into place) removes both."""
    calls = []
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).parent == tmp_path:  # (not staging moves, nor the onnxruntime probe's cache)
            calls.append(Path(dst).name)
        if Path(dst).name == "out.onnx":
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(oio.os, "replace", failing_replace)
    with pytest.raises(OSError):
        onnxopt.optimize(str(external), output=str(tmp_path / "out.onnx"))
    assert calls[0] == "out.onnx.data", "the data file goes into place before the model"
    assert listing(tmp_path) == ["in"]


@pytest.mark.parametrize("when", ["after the data file", "after the model"])
def test_interrupt_right_after_a_rename_leaves_no_output(when, external, tmp_path, monkeypatch):
    """Ctrl-C lands just after a rename into place (before the commit notes it): what was put in
    place is removed all the same, and a file that was there before and never replaced stays."""
    (tmp_path / "out.onnx").write_text("the user's old file")
    real_replace = os.replace
    last = {"after the data file": "out.onnx.data", "after the model": "out.onnx"}[when]

    def interrupted_replace(src, dst):
        real_replace(src, dst)
        if Path(dst) == tmp_path / last:
            raise KeyboardInterrupt

    monkeypatch.setattr(oio.os, "replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        onnxopt.optimize(str(external), output=str(tmp_path / "out.onnx"))
    expected = ["in", "out.onnx"] if when == "after the data file" else ["in"]
    assert listing(tmp_path) == expected
    if when == "after the data file":
        assert (tmp_path / "out.onnx").read_text() == "the user's old file"


def test_interrupt_leaves_nothing_and_exits_130(tmp_path):
    """Ctrl-C while optimizing: one line, exit 130, no output and no staging left."""
    from onnxopt.models import synthetic

    src = tmp_path / "big.onnx"
    onnx.save(synthetic.build(20000), src)
    proc = subprocess.Popen([sys.executable, "-m", "onnxopt", str(src), "-o", str(tmp_path / "out.onnx"),
                             "--json", str(tmp_path / "r.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".out.onnx.") for p in tmp_path.iterdir()):  # claimed: working now
        assert proc.poll() is None and time.monotonic() < deadline, "the command ended before it was interrupted"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0], err
    assert listing(tmp_path) == ["big.onnx"]


# --------------------------------------------------------------------------------------------
# 3-4. every output runs from where it was written, alone


@pytest.mark.parametrize("mode", ["single-file", "default", "external-name"])
def test_output_of_external_data_model_runs_alone(mode, external, tmp_path):
    expected = run_ort(str(external), FEEDS)
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    kwargs = {"single-file": {"external_data": False}, "default": {}, "external-name": {"external_data": "w.bin"}}
    onnxopt.optimize(str(external), output=str(out), **kwargs[mode])
    assert data_files(out) == {"single-file": [], "default": ["o.onnx.data"], "external-name": ["w.bin"]}[mode]
    np.testing.assert_array_equal(runs_alone(out, tmp_path)[0], expected[0])


@pytest.mark.parametrize("where", ["model-folder", "elsewhere"])
def test_constant_with_external_data(where, constant_external, tmp_path, monkeypatch):
    """A Constant node's tensor with external data: checked against the model's folder whatever the
    current folder, and written into the output's own files."""
    expected = run_ort(str(constant_external), FEEDS)
    monkeypatch.chdir(constant_external.parent if where == "model-folder" else tmp_path)
    out = tmp_path / "out" / "c.onnx"
    out.parent.mkdir()
    onnxopt.optimize(str(constant_external), output=str(out))
    np.testing.assert_array_equal(runs_alone(out, tmp_path)[0], expected[0])


def test_constant_with_external_data_in_a_subgraph_is_written_with_the_output(constant_external, tmp_path):
    proto = onnx.load(constant_external, load_external_data=False)
    const = proto.graph.node[0]
    del proto.graph.node[0]
    branch = helper.make_graph([const], "then", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [64, 64])])
    cond = numpy_helper.from_array(np.array(True), "cond")
    proto.graph.initializer.append(cond)
    proto.graph.node.insert(0, helper.make_node("If", ["cond"], ["w"], then_branch=branch, else_branch=branch))
    src = constant_external.parent / "if.onnx"
    onnx.save(proto, src)
    expected = run_ort(str(src), FEEDS)
    out = tmp_path / "if-out.onnx"
    onnxopt.optimize(str(src), output=str(out), disable=["if_constant_condition"])
    np.testing.assert_array_equal(runs_alone(out, tmp_path)[0], expected[0])


# --------------------------------------------------------------------------------------------
# 5. external data lengths; no empty data file


def test_external_length_must_match_the_tensor(external, tmp_path):
    set_external_field(external, "length", "8")
    with pytest.raises(InvalidModelError, match="length 8.*16384 bytes"):
        onnxopt.optimize(str(external), output=str(tmp_path / "o.onnx"))
    assert not (tmp_path / "o.onnx").exists()


def test_no_empty_data_file_when_every_weight_is_small(tmp_path):
    proto = _matmul_model(n=4)
    folder = tmp_path / "small"
    folder.mkdir()
    onnx.save(proto, folder / "s.onnx", save_as_external_data=True, location="s.data", size_threshold=0)
    out = tmp_path / "o.onnx"
    onnxopt.optimize(str(folder / "s.onnx"), output=str(out))
    assert listing(tmp_path) == ["o.onnx", "small"]


# --------------------------------------------------------------------------------------------
# 13. external-data locations refused on the name alone; 16. offsets


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/shadow", "sub/../../x.bin", "link.bin"])
def test_external_location_outside_the_folder_is_refused_without_looking(location, tmp_path, monkeypatch):
    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\0" * 16384)
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    proto = _matmul_model()
    _externalize(proto.graph.initializer[0], folder, "data.bin")
    _set_field(proto, "location", location)
    onnx.save(proto, folder / "m.onnx")
    looked = []
    real_stat = Path.stat

    def spy(self, *a, **k):
        looked.append(str(self))
        return real_stat(self, *a, **k)

    monkeypatch.setattr(Path, "stat", spy)
    with pytest.raises(InvalidModelError, match="refused") as info:
        oio.load(folder / "m.onnx")
    assert "bytes" not in str(info.value)  # nothing about a file outside (its existence or size)
    assert not [p for p in looked if not p.startswith(str(folder))]


@pytest.mark.parametrize("offset", ["-8", "abc", "1e3", "\u00b2", "\u0661", "0" * 5000 + "1", "9" * 19])
def test_bad_external_offset_is_exit_2(offset, external):
    set_external_field(external, "offset", offset)
    r = run_cli(external, "-o", external.parent / "o.onnx")
    assert r.returncode == 2, r.stderr
    assert "offset" in assert_one_line_error(r.stderr)


def test_external_location_with_a_nul_is_exit_2(external, tmp_path):
    set_external_field(external, "location", "ext.onnx.weights\0x")
    r = run_cli(external, "-o", tmp_path / "o.onnx")
    assert r.returncode == 2, r.stderr
    assert "NUL" in assert_one_line_error(r.stderr)


def test_external_tensor_with_a_negative_dimension_is_refused(external, tmp_path):
    """(its byte count would be negative, and the whole data file was read as the tensor)"""
    proto = onnx.load(external, load_external_data=False)
    proto.graph.initializer[0].dims[0] = -64
    onnx.save(proto, external)
    r = run_cli(external, "-o", tmp_path / "o.onnx")
    assert r.returncode == 2, r.stderr
    assert "negative dimension" in assert_one_line_error(r.stderr)
    assert not (tmp_path / "o.onnx").exists()


# --------------------------------------------------------------------------------------------
# 17. bad models named for what is wrong


def _serialized(proto) -> bytes:
    return proto.SerializeToString()


def _deep_model(levels: int) -> bytes:
    """If inside If, ``levels`` deep, assembled as bytes (protobuf refuses to build it)."""
    def field(number: int, payload: bytes) -> bytes:
        return oio._varint(number << 3 | 2) + oio._varint(len(payload)) + payload

    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [], [out]).SerializeToString()
    for _ in range(levels):
        attr = field(1, b"then_branch") + field(6, graph) + oio._varint(20 << 3) + oio._varint(5)
        node = field(1, b"c") + field(2, b"y") + field(4, b"If") + field(5, attr)
        graph = field(1, node) + field(2, b"g") + field(12, out.SerializeToString())
    model = helper.make_model(helper.make_graph([], "x", [], []), opset_imports=[helper.make_opsetid("", 17)])
    model.ClearField("graph")
    return model.SerializeToString() + field(7, graph)


@pytest.mark.parametrize("case, message", [
    ("no-opset", "declares no opset_import"),
    ("tensor", "serialized TensorProto"),
    ("deep", "deeper than protobuf"),
    ("opset-99", "opset 99"),
])
def test_bad_model_named_for_what_is_wrong(case, message, tmp_path):
    if case == "no-opset":
        proto = _matmul_model()
        del proto.opset_import[:]
        data = _serialized(proto)
    elif case == "tensor":
        data = numpy_helper.from_array(np.arange(10, dtype=np.float32), "t").SerializeToString()
    elif case == "deep":
        data = _deep_model(40)
    else:
        proto = _matmul_model()
        proto.opset_import[0].version = 99
        data = _serialized(proto)
    path = tmp_path / "bad.onnx"
    path.write_bytes(data)
    r = run_cli(path, "-o", tmp_path / "o.onnx")
    assert r.returncode == 2, r.stderr
    line = assert_one_line_error(r.stderr)
    assert message in line and "truncated" not in line
    with pytest.raises(InvalidModelError, match=message):
        onnxopt.optimize(data)


def test_opset_newer_than_onnx_refused_for_a_proto_too():
    proto = _matmul_model()
    proto.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    with pytest.raises(InvalidModelError, match="newer than the installed onnx"):
        onnxopt.optimize(proto)


# --------------------------------------------------------------------------------------------
# 18. rules files that exit; warnings under -q


def test_rules_file_raising_system_exit_is_an_error(plain, tmp_path):
    rules = tmp_path / "r.py"
    rules.write_text("raise SystemExit(0)\n")
    with pytest.raises(RuleError, match="SystemExit"):
        onnxopt.library.registry.load_rules_file(rules)
    r = run_cli(plain, "-o", tmp_path / "o.onnx", "--rules", rules)
    assert r.returncode == 2 and "SystemExit" in assert_one_line_error(r.stderr)
    assert not (tmp_path / "o.onnx").exists()


def test_quiet_means_nothing_on_stderr_for_non_finite_values(tmp_path):
    """Folding 1/0 and 0/0 and verifying outputs with infinities and NaN must not leak numpy's
    RuntimeWarnings under -q."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    a = numpy_helper.from_array(np.array([1.0, 0.0], np.float32), "a")
    b = numpy_helper.from_array(np.array([0.0, 0.0], np.float32), "b")
    graph = helper.make_graph([helper.make_node("Div", ["a", "b"], ["c"]), helper.make_node("Add", ["x", "c"], ["y"])],
                              "g", [x], [y], [a, b])
    src = tmp_path / "div0.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), src)
    for extra in ([], ["--verify", "cpu"]):
        r = run_cli(src, "-o", tmp_path / "o.onnx", "-q", *extra)
        assert r.returncode == 0 and r.stderr == "", r.stderr


# --------------------------------------------------------------------------------------------
# 19. the onnxruntime probe's cache


def test_ir_cache_is_keyed_by_build_and_honours_xdg(tmp_path):
    code = "from onnxopt.ir import io; print(io.onnxruntime_max_ir_version())"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    files = list((tmp_path / "xdg" / "onnxopt").iterdir())
    assert len(files) == 1 and oio._onnxruntime_build() in files[0].name
    assert json.loads(files[0].read_text())["max_ir_version"] == int(out.stdout)


@pytest.mark.parametrize("cache", ["a-file-in-the-way", "garbage", "poisoned"])
def test_ir_cache_that_cannot_be_used_is_passed_over(cache, tmp_path):
    xdg = tmp_path / "xdg"
    if cache == "a-file-in-the-way":
        xdg.mkdir()
        (xdg / "onnxopt").write_text("not a folder")
    else:
        (xdg / "onnxopt").mkdir(parents=True)
        name = f"onnxruntime-ir-{oio._onnxruntime_build()}.json"
        (xdg / "onnxopt" / name).write_text("{[" if cache == "garbage" else '{"max_ir_version": 99}')
    code = "from onnxopt.ir import io; print(io.onnxruntime_max_ir_version())"
    env = {**os.environ, "XDG_CACHE_HOME": str(xdg), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert 7 <= int(out.stdout) <= onnx.IR_VERSION


def test_outputs_claims_are_checked_before_writing(tmp_path):
    outputs = oio.Outputs(protect=[tmp_path / "in.onnx"])
    outputs.claim(tmp_path / "a.json", "--json")
    with pytest.raises(UsageError, match="its own file"):
        outputs.claim(tmp_path / "a.json", "-o")
    with pytest.raises(UsageError, match="never overwrites"):
        outputs.protect(tmp_path / "a.json")
    outputs.abort()
    assert listing(tmp_path) == []


# --------------------------------------------------------------------------------------------
# sparse tensors: onnx_ir cannot hold them (it dropped a sparse initializer without a word)


@pytest.mark.parametrize("where", ["sparse_initializer", "constant_sparse_value"])
def test_sparse_tensors_are_made_dense_not_dropped(where, tmp_path):
    values = numpy_helper.from_array(np.array([1.5, -2.0], np.float32), "c")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([0, 3], np.int64), "ci"), [4])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    nodes = [helper.make_node("Add", ["x", "c"], ["y"])]
    if where == "constant_sparse_value":
        nodes.insert(0, helper.make_node("Constant", [], ["c"], sparse_value=sparse))
    graph = helper.make_graph(nodes, "g", [x], [y])
    if where == "sparse_initializer":
        graph.sparse_initializer.append(sparse)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    src = tmp_path / "sparse.onnx"
    onnx.save(proto, src)
    r = run_cli(src, "-o", tmp_path / "o.onnx", "--verify", "cpu", "-q")
    assert r.returncode == 0, r.stderr
    feeds = {"x": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}
    np.testing.assert_array_equal(run_ort(str(tmp_path / "o.onnx"), feeds)[0], [2.5, 2.0, 3.0, 2.0])
    assert onnxopt.optimize(proto).graph.sparse_initializer == proto.graph.sparse_initializer[:0]
    assert len(proto.graph.sparse_initializer) == (where == "sparse_initializer")  # the caller's proto untouched


# --------------------------------------------------------------------------------------------
# smaller edges from review: a broken onnxruntime, empty names, NUL, endless inputs


def test_a_broken_onnxruntime_is_one_line_not_an_internal_error(plain, tmp_path):
    """An onnxruntime that fails to import (a broken native library) is named, exit 2: neither an
    internal error nor a silent fall-back to folding without it."""
    fake = tmp_path / "fake"
    (fake / "onnxruntime").mkdir(parents=True)
    (fake / "onnxruntime" / "__init__.py").write_text("raise OSError('libonnxruntime.so: cannot open shared object')\n")
    r = run_cli(plain, "-o", tmp_path / "o.onnx", env={"PYTHONPATH": f"{fake}{os.pathsep}{ROOT}",
                                                       "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert r.returncode == 2, r.stderr
    assert "onnxruntime is installed but fails to import" in assert_one_line_error(r.stderr)
    assert not (tmp_path / "o.onnx").exists()


def test_empty_external_data_name_is_refused(plain, tmp_path):
    with pytest.raises(UsageError, match="empty"):
        onnxopt.optimize(str(plain), output=str(tmp_path / "o.onnx"), external_data="")
    r = run_cli(plain, "-o", tmp_path / "o.onnx", "--external-data", "")
    assert r.returncode == 2 and "empty" in assert_one_line_error(r.stderr)
    assert listing(tmp_path) == ["m.onnx"]


def test_output_name_with_a_nul_is_a_usage_error(plain):
    with pytest.raises(UsageError, match="not a file name"):
        onnxopt.optimize(str(plain), output="a\0b.onnx")


def test_an_endless_input_is_read_no_further_than_one_model_can_be(tmp_path, monkeypatch):
    monkeypatch.setattr(oio, "PROTO_LIMIT", 1 << 20)
    with pytest.raises(InvalidModelError, match="past what protobuf reads"):
        oio.load("/dev/zero")


def test_interrupt_while_caching_the_ir_version_leaves_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(oio.json, "dump", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    oio.onnxruntime_max_ir_version.cache_clear()
    try:
        with pytest.raises(KeyboardInterrupt):
            oio.onnxruntime_max_ir_version()
    finally:
        oio.onnxruntime_max_ir_version.cache_clear()
    assert [p.name for p in (tmp_path / "onnxopt").iterdir()] == []


def test_output_cut_short_by_the_reader_ends_quietly():
    """`onnxopt --list-rules | true`: the reader is gone before onnxopt writes; no error line, no
    traceback."""
    r = subprocess.run(f"{sys.executable} -m onnxopt --list-rules | true", shell=True, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
