"""Calibration data sources and their validation (onnxopt.quantize.data)."""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pytest
from onnx import TensorProto, helper

from helpers import init, model, tinfo
from onnxopt.errors import UsageError
from onnxopt.quantize.data import CalibrationError, CalibrationSet, open_calibration


def one_input(shape=("N", 3), dtype=TensorProto.FLOAT):
    return model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", dtype, list(shape))],
                 [tinfo("y", len(shape), dtype)])


def two_inputs():
    """x: [2, 'S', 4] float, ids: ['S'] int64; w is an initializer also listed as a graph input."""
    nodes = [helper.make_node("Add", ["x", "w"], ["a"]), helper.make_node("Cast", ["ids"], ["c"], to=1),
             helper.make_node("Relu", ["a"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "S", 4]),
              helper.make_tensor_value_info("ids", TensorProto.INT64, ["S"]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [4])]
    return model(nodes, inputs, [tinfo("y", 3), tinfo("c", 1)], [init("w", np.ones(4, np.float32))])


def feeds(n, seed=0, rows=2):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((rows, 3)).astype(np.float32)} for _ in range(n)]


def same(a, b):
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for fa, fb in zip(a, b):
        assert fa.keys() == fb.keys()
        for k in fa:
            np.testing.assert_array_equal(fa[k], fb[k])
            assert fa[k].dtype == fb[k].dtype


def test_error_is_a_usage_error():
    assert issubclass(CalibrationError, UsageError)


# --- sources ---------------------------------------------------------------------------------------

def test_list_source_is_reiterable_and_kept_in_order():
    data = feeds(5)
    calib = open_calibration(data, one_input())
    assert isinstance(calib, CalibrationSet) and len(calib) == 5
    same(calib, data)
    same(calib, data)  # a second pass gives the same feeds


def test_generator_is_spooled_to_disk_and_removed_with_the_set():
    data = feeds(6, seed=1)
    calls = []

    def gen():
        for f in data:
            calls.append(1)
            yield f

    calib = open_calibration(gen(), one_input())
    assert len(calls) == 6 and len(calib) == 6
    folder = calib.description.rsplit("spooled to ", 1)[1]
    assert sorted(os.listdir(folder)) == [f"{i:08d}.npz" for i in range(6)]
    same(calib, data)
    same(calib, data)
    del calib
    gc.collect()
    assert not os.path.exists(folder)


def test_folder_of_npy_in_sorted_name_order(tmp_path):
    data = feeds(4, seed=2)
    for name, f in zip(["b.npy", "a.npy", "d.npy", "c.npy"], data):
        np.save(tmp_path / name, f["x"])
    (tmp_path / "notes.txt").write_text("ignored")
    calib = open_calibration(tmp_path, one_input())
    same(calib, [data[1], data[0], data[3], data[2]])


def test_folder_of_npz_keyed_by_input_name_dynamic_shapes(tmp_path):
    rng = np.random.default_rng(3)
    data = []
    for i, s in enumerate([3, 7, 1]):  # a different sequence length per feed
        f = {"x": rng.standard_normal((2, s, 4)).astype(np.float32), "ids": np.arange(s, dtype=np.int64)}
        np.savez(tmp_path / f"{i:03d}.npz", **f)
        data.append(f)
    same(open_calibration(str(tmp_path), two_inputs()), data)


def test_one_npz_samples_along_a_leading_axis(tmp_path):
    # rank + 1: one feed per index (the batch axis of a dynamic-batch input kept)
    x = np.random.default_rng(4).standard_normal((5, 2, 3)).astype(np.float32)
    np.savez(tmp_path / "a.npz", x=x)
    same(open_calibration(tmp_path / "a.npz", one_input()), [{"x": x[i]} for i in range(5)])
    # rank: batches along axis 0, of 1 for a dynamic batch...
    np.savez(tmp_path / "b.npz", x=x[0])
    same(open_calibration(tmp_path / "b.npz", one_input()), [{"x": x[0][i:i + 1]} for i in range(2)])
    # ... and of the model's static batch size (2): 6 rows are 3 feeds; compressed files work too
    rows = np.random.default_rng(5).standard_normal((6, 3)).astype(np.float32)
    np.savez_compressed(tmp_path / "c.npz", x=rows)
    same(open_calibration(tmp_path / "c.npz", one_input((2, 3))), [{"x": rows[i:i + 2]} for i in range(0, 6, 2)])


def test_one_npz_shapes_that_do_not_split(tmp_path):
    np.savez(tmp_path / "odd.npz", x=np.zeros((5, 3), np.float32))
    with pytest.raises(CalibrationError, match=r"odd.npz: array 'x' has shape \(5, 3\): 5 rows are not a whole "
                                               r"number of the model's batches of 2"):
        open_calibration(tmp_path / "odd.npz", one_input((2, 3)))
    np.savez(tmp_path / "rank.npz", x=np.zeros((5,), np.float32))
    with pytest.raises(CalibrationError, match=r"array 'x' has shape \(5,\); the model's input has rank 2"):
        open_calibration(tmp_path / "rank.npz", one_input())
    np.savez(tmp_path / "two.npz", x=np.zeros((4, 2, 5, 4), np.float32), ids=np.zeros((3, 5), np.int64))
    with pytest.raises(CalibrationError, match=r"give different numbers of feeds \('x': 4, 'ids': 3\)"):
        open_calibration(tmp_path / "two.npz", two_inputs())


class Rewinding:
    """A reader in onnxruntime's shape, with rewind()."""

    def __init__(self, data):
        self.data, self.i, self.calls = data, 0, 0

    def get_next(self):
        self.calls += 1
        if self.i >= len(self.data):
            return None
        self.i += 1
        return self.data[self.i - 1]

    def rewind(self):
        self.i = 0


def test_reader_with_rewind_is_read_again_per_pass():
    data = feeds(4, seed=6)
    reader = Rewinding(data)
    calib = open_calibration(reader, one_input())
    assert len(calib) == 4 and "rewound per pass" in calib.description
    same(calib, data)
    same(calib, data)
    same(calib.shard(1, 2), data[2:])
    # to another process it goes spooled (a reader stays in its process)
    with pytest.raises(TypeError):
        pickle.dumps(calib)
    spooled = calib.shard(1, 2).portable()  # (its folder lives as long as this object)
    same(pickle.loads(pickle.dumps(spooled)), data[2:])


def test_onnxruntime_reader_without_rewind_is_spooled():
    from onnxruntime.quantization import CalibrationDataReader

    data = feeds(3, seed=7)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(data)

        def get_next(self):
            return next(self.it, None)

    calib = open_calibration(Reader(), one_input())
    assert "spooled" in calib.description
    same(calib, data)
    same(calib, data)


# --- split and shard ---------------------------------------------------------------------------------

def test_split_and_shard_are_deterministic_and_cover_the_set():
    data = feeds(10, seed=8)
    calib = open_calibration(data, one_input())
    rest, held = calib.split(3)
    assert len(rest) == 7 and len(held) == 3
    same(held, [data[1], data[5], data[8]])  # evenly spaced
    same(rest, [data[i] for i in (0, 2, 3, 4, 6, 7, 9)])
    r2, h2 = calib.split(3)
    same(r2, rest)
    same(h2, held)
    assert len(calib.split(0)[1]) == 0
    shards = [calib.shard(i, 3) for i in range(3)]
    assert [len(s) for s in shards] == [3, 3, 4]
    same([f for s in shards for f in s], data)
    same([f for i in range(4) for f in rest.shard(i, 4)], rest)  # shards of a split part
    assert [len(calib.shard(i, 12)) for i in range(12)].count(0) == 2
    with pytest.raises(CalibrationError, match="would leave none to calibrate with"):
        calib.split(10)
    with pytest.raises(CalibrationError, match="shard index"):
        calib.shard(3, 3)


def test_a_portable_shard_pickles_only_its_feeds():
    data = [{"x": np.full((200, 3), i, np.float32)} for i in range(8)]
    calib = open_calibration(data, one_input())
    whole = len(pickle.dumps(calib.portable()))
    part = len(pickle.dumps(calib.shard(0, 4).portable()))
    assert part < whole / 2
    same(pickle.loads(pickle.dumps(calib.shard(3, 4).portable())), data[6:])


# --- validation ----------------------------------------------------------------------------------------

def raises_one_line(source, m, pattern):
    with pytest.raises(CalibrationError) as e:
        open_calibration(source, m)
    assert "\n" not in str(e.value)
    assert e.match(pattern), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("feed, pattern", [
    ({"x": np.zeros((2, 3))}, r"^calibration feed 0: input 'x' has dtype float64, the model takes float32$"),
    ({"x": np.zeros((2, 3, 1), np.float32)}, r"^calibration feed 0: input 'x' has shape \(2, 3, 1\), rank 3; the "
                                             r"model takes rank 2 \('N', 3\)$"),
    ({"x": np.zeros((2, 4), np.float32)}, r"^calibration feed 0: input 'x' has shape \(2, 4\), the model takes "
                                          r"\('N', 3\) \(dimension 1 is 4, not 3\)$"),
    ({"x": np.array([[1, np.nan, 2]] * 2, np.float32)}, r"input 'x' holds 2 NaN and 0 inf values"),
    ({"x": np.array([[1, np.inf, -np.inf]], np.float32)}, r"input 'x' holds 0 NaN and 2 inf values"),
    ({}, r"^calibration feed 0: input 'x' missing \(the model takes 'x'\)$"),
    ({"x": np.zeros((2, 3), np.float32), "z": 1}, r"^calibration feed 0: 'z' is not an input of the model"),
    ([np.zeros((2, 3), np.float32)], r"^calibration feed 0: expected a dict of input name -> array, got list$"),
])
def test_bad_feeds(feed, pattern):
    raises_one_line([feed], one_input(), pattern)


def test_an_initializer_fed_is_named_as_such():
    f = {"x": np.zeros((2, 1, 4), np.float32), "ids": np.zeros(1, np.int64), "w": np.zeros(4, np.float32)}
    raises_one_line([f], two_inputs(), r"'w' is an initializer \(a constant\) of the model, not an input")


def test_later_bad_feeds_fail_lazily_naming_the_feed():
    data = feeds(4) + [{"x": np.zeros((2, 3), np.float16)}]
    calib = open_calibration(data, one_input())  # only the first feed is checked at open
    with pytest.raises(CalibrationError, match=r"^calibration feed 4: input 'x' has dtype float16"):
        list(calib)
    with pytest.raises(CalibrationError, match=r"^calibration feed 2: input 'x' holds 1 NaN"):
        bad = feeds(4)
        bad[2]["x"][0, 0] = np.nan
        list(open_calibration((f for f in bad), one_input()))  # a generator: checked while spooled


def test_sources_that_are_not_usable(tmp_path):
    m = one_input()
    raises_one_line(42, m, r"^calibration data: int is not a supported source")
    raises_one_line(tmp_path / "nope", m, r"nope: no such file or folder$")
    raises_one_line({"x": np.zeros((2, 3), np.float32)}, m, r"got one feed dict; give a list")
    raises_one_line([], m, r"gives no feeds \(an empty set\)$")
    raises_one_line(iter(()), m, r"gives no feeds \(an empty set\)$")
    raises_one_line(tmp_path, m, r"the folder holds no \.npy or \.npz files$")
    (tmp_path / "x.txt").write_text("x")
    raises_one_line(tmp_path / "x.txt", m, r"not a folder of \.npy/\.npz files nor a \.npz file$")


def test_unreadable_files(tmp_path):
    m = one_input()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "0.npy").write_bytes(b"\x93NUMPY garbage")
    raises_one_line(tmp_path / "bad", m, r"^calibration feed 0 \(0.npy\): cannot read it as \.npy \(")
    (tmp_path / "badz").mkdir()
    (tmp_path / "badz" / "0.npz").write_bytes(b"PK\x03\x04 not a zip at all")
    raises_one_line(tmp_path / "badz", m, r"^calibration feed 0 \(0.npz\): cannot read it as \.npz \(")
    (tmp_path / "one.npz").write_bytes(b"nonsense")
    raises_one_line(tmp_path / "one.npz", m, r"one.npz: cannot read it as \.npz \(")
    # .npy files for a model with two inputs
    (tmp_path / "npy2").mkdir()
    np.save(tmp_path / "npy2" / "0.npy", np.zeros((2, 1, 4), np.float32))
    raises_one_line(tmp_path / "npy2", two_inputs(), r"0.npy is a \.npy file \(one array\) but the model takes 2 "
                                                     r"inputs \('x', 'ids'\): use \.npz files keyed by input name$")


def test_a_bad_file_later_in_a_folder_names_the_file(tmp_path):
    for i, f in enumerate(feeds(3)):
        np.save(tmp_path / f"{i}.npy", f["x"])
    np.save(tmp_path / "3.npy", np.zeros((2, 3), np.int32))
    calib = open_calibration(tmp_path, one_input())
    with pytest.raises(CalibrationError, match=r"^calibration feed 3 \(3.npy\): input 'x' has dtype int32"):
        list(calib)


def test_dynamic_and_unknown_dims_accept_any_size():
    m = two_inputs()
    data = [{"x": np.zeros((2, s, 4), np.float32), "ids": np.zeros(s, np.int64)} for s in (1, 9, 4)]
    same(open_calibration(data, m), data)
    with pytest.raises(CalibrationError, match=r"input 'x' has shape \(3, 2, 4\), the model takes \(2, 'S', 4\) "
                                               r"\(dimension 0 is 3, not 2\)"):
        open_calibration([{"x": np.zeros((3, 2, 4), np.float32), "ids": np.zeros(2, np.int64)}], m)
