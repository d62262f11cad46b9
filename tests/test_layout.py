"""Input/output layouts and uint8 image preprocessing (onnxopt.transforms.edges): the grammar, one-line
errors, the edges on small onnx-helper models (every folding case), and the zoo's resnet50 and
mobilenet_v2 taking raw NHWC/HWC uint8 images and giving the NCHW model's outputs on the same
images preprocessed in numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_ort
from helpers import init, model, tinfo
from onnx import TensorProto, helper

from onnxopt.transforms import edges as layout
from onnxopt import cli, optimize
from onnxopt.errors import UsageError
from onnxopt.models import zoo

IMAGENET = "scale=1/255,mean=0.485,0.456,0.406,std=0.229,0.224,0.225"
RNG = np.random.default_rng(0)


def _ops(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]


def _close(got, ref, rel=1e-4):
    """Within ``rel`` of the reference's largest magnitude (logits cross zero: elementwise relative
    error is meaningless there)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    scale = max(float(np.abs(ref).max()), 1e-6)
    err = float(np.abs(got.astype(np.float64) - ref).max())
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel:g} x {scale:.3g}"


# ---------------------------------------------------------------------------------------------
# Grammar


def test_parse_layouts():
    assert layout.parse_layouts(["x=NHWC", "y=nchw"]) == {"x": "NHWC", "y": "NCHW"}
    assert layout.parse_layouts("NHWC") == {layout.ALL: "NHWC"}
    assert layout.parse_layouts({"x": "NDHWC"}) == {"x": "NDHWC"}
    assert layout.parse_layouts(None) == {}
    assert layout.parse_layouts(["a=b=NHWC"]) == {"a=b": "NHWC"}  # (a name may hold '=': the last one splits)


def test_parse_preprocess():
    got = layout.parse_preprocess([f"x=uint8,HWC,{IMAGENET},bgr"])["x"]
    assert got.layout == "HWC" and got.dtype == "uint8" and got.bgr
    assert got.scale == pytest.approx(1 / 255)
    assert got.mean == (0.485, 0.456, 0.406) and got.std == (0.229, 0.224, 0.225)
    assert not got.batched and got.channels_last
    plain = layout.parse_preprocess({"x": "uint8,nchw"})["x"]
    assert (plain.layout, plain.scale, plain.mean, plain.std, plain.bgr) == ("NCHW", 1.0, (0.0,), (1.0,), False)
    api = layout.parse_preprocess({"x": {"layout": "NHWC", "scale": 0.5, "mean": [1, 2, 3], "bgr": True}})["x"]
    assert (api.layout, api.scale, api.mean, api.bgr) == ("NHWC", 0.5, (1.0, 2.0, 3.0), True)
    again = layout.parse_preprocess({"x": api})["x"]
    assert again == api


@pytest.mark.parametrize("kwargs, words", [
    ({"input_layout": ["x=NHCW"]}, "unknown layout 'NHCW'"),
    ({"input_layout": ["=NHWC"]}, "name is empty"),
    ({"input_layout": ["x=NHWC", "x=NCHW"]}, "given twice"),
    ({"input_preprocess": ["x=float32,HWC"]}, "not a setting"),
    ({"input_preprocess": ["x=HWC"]}, "no pixel type"),
    ({"input_preprocess": ["x=uint8"]}, "no pixel layout"),
    ({"input_preprocess": ["x=uint8,HWC,scale=abc"]}, "'abc' is not a number"),
    ({"input_preprocess": ["x=uint8,HWC,scale=1/0"]}, "not a number"),
    ({"input_preprocess": ["x=uint8,HWC,std=0"]}, "must not be 0"),
    ({"input_preprocess": ["x=uint8,HWC,gamma=2"]}, "unknown setting 'gamma'"),
    ({"input_preprocess": ["x=uint8,HWC,HWC"]}, "given twice"),
    ({"input_preprocess": ["x=uint8,HWC,,bgr"]}, "empty setting"),
    ({"input_preprocess": ["uint8,HWC"]}, "expected NAME=uint8"),
    ({"input_preprocess": {"x": {"layout": "HWC", "colour": 1}}}, "unknown setting(s) colour"),
    ({"input_layout": ["x=NCHW"], "input_preprocess": ["x=uint8,HWC"]}, "disagree"),
    ({"input_layout": "NHWC", "input_preprocess": ["x=uint8,NCHW"]}, "--input-layout NHWC and --input-preprocess x"),
])
def test_bad_specs_are_usage_errors(kwargs, words):
    with pytest.raises(UsageError) as exc:
        layout.spec(**kwargs)
    assert words in str(exc.value) and "\n" not in str(exc.value)


# ---------------------------------------------------------------------------------------------
# Small models


def _conv_model(*, pads=(0, 0, 0, 0), bias=True, group=1, c=3, k=3, auto_pad=None, extra_reader=False,
                batch: int | str = 1, hw=8):
    w = RNG.standard_normal((4, c // group, k, k)).astype(np.float32)
    attrs = {"kernel_shape": [k, k], "group": group}
    if auto_pad:
        attrs["auto_pad"] = auto_pad
    else:
        attrs["pads"] = list(pads)
    inputs = ["x", "W", *(["B"] if bias else [])]
    nodes = [helper.make_node("Conv", inputs, ["c"], name="conv", **attrs), helper.make_node("Relu", ["c"], ["y"])]
    outs = [tinfo("y", 4)]
    if extra_reader:  # a reader that is not a Conv: nothing folds
        nodes.append(helper.make_node("Sigmoid", ["x"], ["s"]))
        outs.append(tinfo("s", 4))
    inits = [init("W", w), *([init("B", RNG.standard_normal(4).astype(np.float32))] if bias else [])]
    return model(nodes, [tinfo("x", [batch, c, hw, hw])], outs, inits)


def _apply(proto, **kw):
    out = optimize(proto, **kw)
    onnx.checker.check_model(out, full_check=True)
    return out


def _pixels(pre: layout.Preprocess, c=3, hw=8, n=1):
    shape = {"HWC": (hw, hw, c), "NHWC": (n, hw, hw, c), "CHW": (c, hw, hw), "NCHW": (n, c, hw, hw)}[pre.layout]
    return RNG.integers(0, 256, shape, dtype=np.uint8)


def _check_preprocessed(proto, text, *, present=(), absent=(), name="x", c=3, hw=8, n=1, **kw):
    out = _apply(proto, input_preprocess={name: text}, **kw)
    pre = layout.parse_preprocess({name: text})[name]
    pix = _pixels(pre, c, hw, n)
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.UINT8
    got = run_ort(out, {name: pix})
    ref = run_ort(proto, {name: layout.reference_input(pix, pre)})
    for g, r in zip(got, ref):
        _close(g, r)
    ops = _ops(out)
    for op in present:
        assert op in ops, ops
    for op in absent:
        assert op not in ops, ops
    return out


@pytest.mark.parametrize("bias", [True, False])
def test_unpadded_conv_takes_everything(bias):
    # scale, mean, std and the channel swap all go into the weights and bias: Transpose, Cast left
    out = _check_preprocessed(_conv_model(bias=bias), f"uint8,NHWC,{IMAGENET},bgr", present=("Transpose", "Cast"),
                              absent=("Gather", "Mul", "Add", "Sub", "Div"))
    assert _ops(out)[:3] == ["Transpose", "Cast", "Conv"]
    perm = [a for a in out.graph.node[0].attribute if a.name == "perm"][0].ints
    assert list(perm) == [0, 3, 1, 2]


@pytest.mark.parametrize("conv", [{"pads": (1, 1, 1, 1)}, {"auto_pad": "SAME_UPPER"}])
def test_padded_conv_keeps_an_add(conv):
    # a zero pad of the normalized input is not a zero pad of the raw one: the offset stays
    out = _check_preprocessed(_conv_model(**conv), f"uint8,HWC,{IMAGENET},bgr", present=("Add",),
                              absent=("Gather", "Mul", "Sub", "Div"))
    assert _ops(out)[:5] == ["Transpose", "Unsqueeze", "Cast", "Add", "Conv"]


def test_padded_conv_without_mean_takes_the_scale():
    _check_preprocessed(_conv_model(pads=(1, 1, 1, 1)), "uint8,NHWC,scale=1/255,std=0.5,0.25,2,bgr",
                        absent=("Gather", "Mul", "Add"))


@pytest.mark.parametrize("case", ["group", "other reader", "no weights"])
def test_not_foldable_stays_elementwise(case):
    if case == "group":
        proto = _conv_model(group=3, c=3)
        proto.graph.initializer[0].CopyFrom(init("W", RNG.standard_normal((3, 1, 3, 3)).astype(np.float32)))
        proto.graph.initializer[1].CopyFrom(init("B", RNG.standard_normal(3).astype(np.float32)))
    elif case == "other reader":
        proto = _conv_model(extra_reader=True)
    else:  # weights as a graph input
        proto = _conv_model(bias=False)
        proto.graph.input.append(tinfo("W", [4, 3, 3, 3]))
        proto.graph.ClearField("initializer")
        out = optimize(proto, input_preprocess={"x": f"uint8,NHWC,{IMAGENET},bgr"})
        assert {"Gather", "Mul", "Add"} <= set(_ops(out))
        return
    _check_preprocessed(proto, f"uint8,NHWC,{IMAGENET},bgr", present=("Gather", "Mul", "Add"))


def test_pad_before_conv_keeps_an_add_before_the_pad():
    w = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"], mode="constant"),
             helper.make_node("Conv", ["p", "W"], ["y"], kernel_shape=[3, 3])]
    proto = model(nodes, [tinfo("x", [1, 3, 8, 8])], [tinfo("y", 4)],
                  [init("W", w), init("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], dtype=np.int64))])
    out = _check_preprocessed(proto, f"uint8,NHWC,{IMAGENET},bgr", absent=("Gather", "Mul"),
                              disable=["pad_into_conv"])
    assert _ops(out) == ["Transpose", "Cast", "Add", "Pad", "Conv"]
    # a reflect pad is not a zero pad: nothing folds
    proto.graph.node[0].attribute[0].s = b"reflect"
    _check_preprocessed(proto, f"uint8,NHWC,{IMAGENET},bgr", present=("Gather", "Mul", "Add"),
                        disable=["pad_into_conv"])


def test_fold_waits_for_the_rules_and_drops_the_old_weights():
    # the bias is computed (Expand) and a BatchNormalization follows: constant only after the rules
    c = 4
    w = RNG.standard_normal((c, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Expand", ["b0", "bshape"], ["b"]),
             helper.make_node("Conv", ["x", "W", "b"], ["c"], kernel_shape=[3, 3]),
             helper.make_node("BatchNormalization", ["c", "s", "beta", "m", "v"], ["y"])]
    inits = [init("W", w), init("b0", np.float32([0.5])), init("bshape", np.int64([c])),
             *(init(n, RNG.uniform(0.5, 1.5, c).astype(np.float32)) for n in ("s", "beta", "m", "v"))]
    proto = model(nodes, [tinfo("x", [1, 3, 8, 8])], [tinfo("y", 4)], inits)
    out = _check_preprocessed(proto, f"uint8,NHWC,{IMAGENET},bgr", absent=("Gather", "Mul", "Add", "Expand"))
    assert _ops(out) == ["Transpose", "Cast", "Conv"]
    sizes = sorted(tuple(t.dims) for t in out.graph.initializer)
    assert sizes == [(c,), (c, 3, 3, 3)]  # one weight tensor and one bias: the replaced ones are gone
    # exact: folding changes the rounding, so the element-wise ops stay
    out = _check_preprocessed(proto, f"uint8,NHWC,{IMAGENET},bgr", present=("Gather", "Mul", "Add"), exact=True)


def test_two_convs_share_the_input_and_weights_elsewhere_unchanged():
    w = RNG.standard_normal((3, 3, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W"], ["a"], kernel_shape=[1, 1]),
             helper.make_node("Conv", ["x", "W"], ["b"], kernel_shape=[1, 1]),
             helper.make_node("Conv", ["a", "W"], ["c"], kernel_shape=[1, 1]),  # reads W too: W must stay
             helper.make_node("Add", ["b", "c"], ["y"])]
    proto = model(nodes, [tinfo("x", [1, 3, 5, 5])], [tinfo("y", 4)], [init("W", w)])
    _check_preprocessed(proto, f"uint8,NHWC,{IMAGENET},bgr", hw=5, absent=("Gather", "Mul"))


def test_plain_preprocessing_without_conv():
    proto = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", [1, 3, 4, 4])], [tinfo("y", [1, 3, 4, 4])])
    out = _check_preprocessed(proto, "uint8,HWC,scale=1/255,mean=0.5,std=0.25,bgr", hw=4)
    assert _ops(out) == ["Transpose", "Unsqueeze", "Cast", "Gather", "Mul", "Add", "Relu"]
    assert [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim] == [4, 4, 3]
    # NCHW pixels: no Transpose at all, only the Cast and the arithmetic
    out = _check_preprocessed(proto, "uint8,NCHW,scale=2", hw=4)
    assert _ops(out) == ["Cast", "Mul", "Relu"]


@pytest.mark.parametrize("opset", [11, 13])
def test_hwc_unsqueeze_by_opset(opset):
    proto = _conv_model(pads=(1, 1, 1, 1))
    proto.opset_import[0].version = opset
    out = _check_preprocessed(proto, f"uint8,HWC,{IMAGENET}")
    unsqueeze = out.graph.node[1]
    assert unsqueeze.op_type == "Unsqueeze" and len(unsqueeze.input) == (1 if opset < 13 else 2)


def test_same_result_twice():
    proto = _conv_model(pads=(1, 1, 1, 1))
    runs = [optimize(proto, input_preprocess={"x": f"uint8,HWC,{IMAGENET},bgr"}, output_layout="NHWC")
            for _ in range(2)]
    assert runs[0].SerializeToString() == runs[1].SerializeToString()


def test_input_also_an_output_is_refused():
    proto = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", [1, 3, 4, 4])],
                  [tinfo("y", [1, 3, 4, 4]), tinfo("x", [1, 3, 4, 4])])
    with pytest.raises(UsageError, match="also an output"):
        optimize(proto, input_layout="NHWC")


def test_hwc_fixes_a_symbolic_batch_and_refuses_a_larger_one():
    proto = _conv_model(batch="N")
    out = _check_preprocessed(proto, "uint8,HWC,scale=1/255")
    assert [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim] == [8, 8, 3]
    with pytest.raises(UsageError, match="a batch of 2"):
        optimize(_conv_model(batch=2), input_preprocess={"x": "uint8,HWC"})
    # a batch of images in NHWC keeps the symbol
    out = _check_preprocessed(proto, "uint8,NHWC,scale=1/255", n=2)
    assert out.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_input_and_output_layouts(rank):
    first, last = layout.CHANNELS_FIRST[rank], layout.CHANNELS_LAST[rank]
    shape = ["batch", 3, *([5, 6, 7][: rank - 2])]
    proto = model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"]),
                   helper.make_node("Abs", ["r"], ["z"])],
                  [tinfo("x", shape)], [tinfo("y", shape), tinfo("z", shape)])
    out = _apply(proto, input_layout={"x": last}, output_layout=[f"y={last}", f"z={first}"])
    x = RNG.standard_normal([2, *shape[1:]]).astype(np.float32)
    to_last = [0, *range(2, rank), 1]
    y, z = run_ort(out, {"x": np.ascontiguousarray(np.transpose(x, to_last))})
    ry, rz = run_ort(proto, {"x": x})
    np.testing.assert_array_equal(y, np.transpose(ry, to_last))
    np.testing.assert_array_equal(z, rz)  # channels-first asked: unchanged
    assert [o.name for o in out.graph.output] == ["y", "z"] and out.graph.input[0].name == "x"
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
    assert dims(out.graph.input[0]) == [shape[0], *shape[2:], 3]
    assert dims(out.graph.output[0]) == [shape[0], *shape[2:], 3]
    # y is channels-last as x is: the input's Transpose is pushed through Relu into z's branch
    # (a fork: Neg then needs none, and the output's one cancels), which keeps the only one
    assert _ops(out).count("Transpose") == 1


def test_layout_for_every_input_of_the_rank():
    proto = model([helper.make_node("Add", ["a", "b"], ["y"])], [tinfo("a", [1, 3, 4, 4]), tinfo("b", [1, 3, 4, 4])],
                  [tinfo("y", [1, 3, 4, 4])])
    out = _apply(proto, input_layout="NHWC", output_layout="NHWC")
    a, b = (RNG.standard_normal((1, 4, 4, 3)).astype(np.float32) for _ in range(2))
    (y,) = run_ort(out, {"a": a, "b": b})
    np.testing.assert_array_equal(y, a + b)


@pytest.mark.parametrize("kwargs, words", [
    ({"input_layout": {"nope": "NHWC"}}, "the model has no input 'nope' (its inputs: x)"),
    ({"output_layout": {"nope": "NHWC"}}, "the model has no output 'nope'"),
    ({"input_layout": {"x": "NDHWC"}}, "x has rank 4, NDHWC is for rank 5"),
    ({"input_preprocess": {"x": "uint8,HWC,mean=1,2"}}, "mean has 2 values but the input has 3 channels"),
    ({"output_layout": "NWC"}, "--output-layout NWC: the model has no output of rank 3 (its outputs: y rank 4)"),
    ({"input_preprocess": {"x": "uint8,HWC"}, "quantize": {"calibration": "x"}}, "quantize"),
])
def test_model_mismatches_are_usage_errors(kwargs, words):
    with pytest.raises(UsageError) as exc:
        optimize(_conv_model(), **kwargs)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_bgr_needs_three_channels():
    with pytest.raises(UsageError, match="bgr needs 3 channels"):
        optimize(_conv_model(c=4), input_preprocess={"x": "uint8,HWC,bgr"})


def test_a_refusal_leaves_the_model_as_it_was():
    import onnx_ir as ir

    proto = model([helper.make_node("Add", ["a", "b"], ["y"])], [tinfo("a", [1, 3, 4, 4]), tinfo("b", [1, 4, 4, 4])],
                  [tinfo("y", [1, 4, 4, 4])])
    m = ir.from_proto(proto)
    with pytest.raises(UsageError, match="mean has 3 values but the input has 4 channels"):
        layout.apply(m, layout.spec(input_preprocess={"a": "uint8,HWC,mean=1,2,3", "b": "uint8,HWC,mean=1,2,3"}))
    assert ir.to_proto(m).SerializeToString() == ir.to_proto(ir.from_proto(proto)).SerializeToString()
    with pytest.raises(UsageError, match="y has rank 4, NWC is for rank 3"):
        layout.apply(m, layout.spec(input_layout="NHWC", output_layout={"y": "NWC"}))
    assert ir.to_proto(m).SerializeToString() == ir.to_proto(ir.from_proto(proto)).SerializeToString()
    with pytest.raises(UsageError, match="is INT64, preprocessing makes float32"):
        proto.graph.input[0].type.tensor_type.elem_type = TensorProto.INT64
        optimize(proto, input_preprocess={"a": "uint8,NHWC"})


def test_verify_compares_with_the_same_edges():
    proto = _conv_model(pads=(1, 1, 1, 1))
    out, report = optimize(proto, input_preprocess={"x": f"uint8,HWC,{IMAGENET},bgr"}, output_layout={"y": "NHWC"},
                           verify=True, verify_options={"runs": 0}, return_report=True)
    assert report.verification["ok"]
    assert report.layout["inputs"]["x"]["folded"].startswith("weights")
    assert report.layout["outputs"]["y"]["transpose"] == [0, 2, 3, 1]
    assert report.settings["input_preprocess"]["x"]["bgr"] is True
    assert "layout" in report.as_dict()


def test_the_model_records_its_edges_and_verify_reads_them():
    """verify(original, optimized) with no options: the original gets the optimized model's uint8 pixels
    preprocessed in numpy, the NHWC output is transposed back; outputs compared."""
    from onnxopt.verify import verify

    proto = _conv_model(pads=(1, 1, 1, 1))
    out = optimize(proto, input_preprocess={"x": f"uint8,HWC,{IMAGENET},bgr"}, output_layout={"y": "NHWC"})
    edges = layout.edges_of({p.key: p.value for p in out.metadata_props})
    assert edges["inputs"]["x"]["preprocess"].bgr and edges["outputs"]["y"] == {"layout": "NHWC"}
    report = verify(proto, out, runs=2, warmup=1)
    assert report["ok"], report
    assert any("uint8 HWC pixels (BGR)" in line for line in report["edges"])
    assert any("compared transposed back" in line for line in report["edges"])
    assert report["providers"]["cpu"]["outputs"][0]["shape_after"] == [1, 4, 8, 8]  # (compared as NCHW)
    assert report["providers"]["cpu"]["latency"]["rounds"] == 2


@pytest.mark.parametrize("tamper", ["bgr", "output"])
def test_verify_catches_edges_that_do_not_match(tamper):
    """The comparison is real: a model whose recorded edges say other than what it does fails."""
    import json

    from onnxopt.verify import verify

    proto = _conv_model(pads=(1, 1, 1, 1))
    out = optimize(proto, input_preprocess={"x": f"uint8,HWC,{IMAGENET},bgr"}, output_layout={"y": "NHWC"})
    prop = next(p for p in out.metadata_props if p.key == layout.EDGES_KEY)
    record = json.loads(prop.value)
    if tamper == "bgr":
        record["inputs"]["x"]["preprocess"]["bgr"] = False
    else:
        del record["outputs"]["y"]
    prop.value = json.dumps(record)
    report = verify(proto, out, runs=0)
    assert not report["ok"]


def test_verify_input_layout_only_and_given_shapes():
    from onnxopt.verify import verify

    proto = _conv_model(batch="N", pads=(1, 1, 1, 1))
    out = optimize(proto, input_layout={"x": "NHWC"})
    report = verify(proto, out, runs=0, input_shapes={"x": [3, 3, 8, 8]})  # (the original's layout)
    assert report["ok"] and report["edges"][0].startswith("input x: the optimized model takes it NHWC")


def test_verify_cli_on_an_edited_model(tmp_path, capsys):
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(_conv_model(), src)
    assert cli.main([str(src), "-o", str(out), "--input-preprocess", f"x=uint8,NHWC,{IMAGENET}"]) == 0
    capsys.readouterr()
    code = cli.main(["verify", str(src), str(out), "--runs", "0"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "input x: the optimized model takes random uint8 NHWC pixels" in text


def test_verify_with_input_shapes_and_edges():
    """input_shapes are in the model's own layout; the verifier runs the original at them (they were
    taken after the edges changed the input: 'dimension 8 where the model fixes 3')."""
    proto = _conv_model(batch="N", pads=(1, 1, 1, 1))
    out, report = optimize(proto, input_preprocess={"x": f"uint8,NHWC,{IMAGENET}"}, output_layout={"y": "NHWC"},
                           input_shapes={"x": [2, 3, 8, 8]}, verify=True, verify_options={"runs": 0},
                           return_report=True)
    assert report.verification["ok"]
    dims = [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [2, 8, 8, 3]
    assert report.verification["providers"]["cpu"]["outputs"][0]["shape_before"] == [2, 4, 8, 8]


def test_fp16_with_raw_image_input():
    """precision fp16 measures its fallback on the edited model's own inputs (uint8 pixels)."""
    proto = _conv_model(pads=(1, 1, 1, 1))
    out, report = optimize(proto, input_preprocess={"x": f"uint8,HWC,{IMAGENET}"}, precision="fp16",
                           target="ort-cuda", verify=True, verify_options={"runs": 0}, return_report=True)
    assert report.verification["ok"] and report.verification.get("fp16")
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.UINT8


def test_report_counts_transposes_and_bytes_moved(tmp_path, capsys):
    from onnxopt.models.nhwc import keras_like

    _, report = optimize(keras_like(4, 1, 56, 32), return_report=True)
    t = report.as_dict()["transposes"]
    assert (t["before"]["count"], t["after"]["count"]) == (18, 1)
    assert t["after"]["bytes"] == 1 * 56 * 56 * 3 * 4 < t["before"]["bytes"]  # the input's Transpose only
    _, report = optimize(keras_like(1, "N", 56, 32), return_report=True)
    assert report.transposes["after"]["bytes"] is None and report.transposes["after"]["elements"] == "9408*s"
    _, report = optimize(_conv_model(), return_report=True)
    assert report.transposes is None and "transposes" not in report.as_dict()
    src, out = tmp_path / "k.onnx", tmp_path / "o.onnx"
    onnx.save(keras_like(4, 1, 56, 32), src)
    assert cli.main([str(src), "-o", str(out)]) == 0
    assert "transposes: 18 -> 1, moving 6.5 MiB -> 36.8 KiB per inference" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli(tmp_path, capsys):
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(_conv_model(), src)
    code = cli.main([str(src), "-o", str(out), "--input-preprocess", f"x=uint8,HWC,{IMAGENET},bgr",
                     "--output-layout", "y=NHWC"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "layout: input x: uint8 8x8x3 BGR -> Transpose -> Cast; normalization: weights and bias" in captured.out
    assert "layout: output y: NHWC" in captured.out
    m = onnx.load(out)
    assert m.graph.input[0].type.tensor_type.elem_type == TensorProto.UINT8
    assert _ops(m)[-1] == "Transpose"


@pytest.mark.parametrize("args, words", [
    (["--input-layout", "x=NHCW"], "unknown layout 'NHCW'"),
    (["--input-layout", "q=NHWC"], "the model has no input 'q'"),
    (["--output-layout", "y=NWC"], "y has rank 4, NWC is for rank 3"),
    (["--input-preprocess", "x=uint8,HWC,scale=x"], "'x' is not a number"),
    (["--input-preprocess", "x=uint8"], "no pixel layout"),
])
def test_cli_bad_specs_exit_2_with_one_line(tmp_path, capsys, args, words):
    src = tmp_path / "m.onnx"
    onnx.save(_conv_model(), src)
    code = cli.main([str(src), "-o", str(tmp_path / "o.onnx"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o.onnx").exists()


# ---------------------------------------------------------------------------------------------
# Zoo models


def _zoo(name):
    spec = zoo.get(name)
    path = spec.path()
    if not path.exists():
        pytest.skip(f"{name} is not built ({path})")
    return onnx.load(str(path))


@pytest.mark.parametrize("name", ["resnet50-legacy", "mobilenet_v2-legacy", "mobilenet_v2-dynamo"])
@pytest.mark.parametrize("pixels", ["NHWC", "HWC,bgr"])
def test_zoo_raw_images_match_the_nchw_model(name, pixels):
    proto = _zoo(name)
    text = f"uint8,{pixels},{IMAGENET}"
    out = _apply(proto, input_layout={"input": "NHWC"}, input_preprocess={"input": text})
    pre = layout.parse_preprocess({"input": text})["input"]
    assert _ops(out).count("Transpose") == 1 and _ops(out)[0] == "Transpose"
    assert not {"Gather", "Mul", "Sub", "Div"} & set(_ops(out)[:6])  # scale and swap went into the first Conv
    for seed in range(2):
        pix = np.random.default_rng(seed).integers(0, 256, (1, 224, 224, 3) if pre.batched else (224, 224, 3),
                                                   dtype=np.uint8)
        (got,) = run_ort(out, {"input": pix})
        (ref,) = run_ort(proto, {"input": layout.reference_input(pix, pre)})
        _close(got, ref)


def test_zoo_nhwc_input_only():
    proto = _zoo("mobilenet_v2-legacy")
    out = _apply(proto, input_layout="NHWC")
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    (got,) = run_ort(out, {"input": layout.input_feed(x, "NHWC")})
    (ref,) = run_ort(proto, {"input": x})
    _close(got, ref)
    assert _ops(out).count("Transpose") == 1


def test_zoo_ppocrv4_det_on_a_bgr_page():
    # the text detector as rapidocr feeds it (BGR from OpenCV, (x/255 - 0.5)/0.5), at 320x320
    from onnxopt.models.printed_text import page_image

    proto = _zoo("ppocrv4-det")
    name = proto.graph.input[0].name
    text = "uint8,HWC,scale=1/255,mean=0.5,std=0.5,bgr"
    out = _apply(proto, input_preprocess={name: text})
    assert _ops(out).count("Transpose") == 1 and _ops(out)[0] == "Transpose"
    pre = layout.parse_preprocess({name: text})[name]
    rgb = (page_image(320, 320, np.random.default_rng(0)) * 255).round().astype(np.uint8)
    pix = np.ascontiguousarray(rgb[..., ::-1])
    (got,) = run_ort(out, {name: pix})
    (ref,) = run_ort(proto, {name: layout.reference_input(pix, pre)})
    assert (ref > 0.3).mean() > 0.01  # the page has text the detector sees
    _close(got, ref)
