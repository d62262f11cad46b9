"""Exact mode on every broadcast shape: each rule declared exact whose condition reads a broadcast
shape (a neutral constant, a Pow exponent, a bias, an Expand target) is run as
``optimize(exact=True)`` runs it on a model for each shape -- scalar, [1], [N], [1, N], [M, 1],
[M, N], [1, 1] -- and the result must give the original's bits under onnxruntime's default
session options at 1 and 2 threads (check.exact_outputs).

The shapes sit between a MatMul of long products (K = 1024) and a bias Add, where a difference in
what onnxruntime fuses shows as a difference in the bits: its MatMulAddFusion makes MatMul + Add
one Gemm (one rounding) only when the MatMul's one reader is the Add and the bias is [N], [1, N],
[M, 1] or [M, N]; otherwise MatMul then Add round twice. A rewrite that removes a node
onnxruntime keeps, or makes a Gemm it would not make, changes the bits (issue 27: a MatMul + a
scalar bias made a Gemm, 282.82736 -> 282.82733). Each case also states whether the rule fires in
exact mode, so a condition that refuses everything fails too.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from .check import exact_outputs, run_rule, x_model

M, K, N = 16, 1024, 8
SHAPES = {"scalar": (), "[1]": (1,), "[N]": (N,), "[1,N]": (1, N), "[M,1]": (M, 1), "[M,N]": (M, N), "[1,1]": (1, 1)}
RNG = np.random.default_rng(27)


def _feeds(shape, dtype=np.float32):
    return {"x": RNG.standard_normal(shape).astype(dtype)}


def _between_matmul_and_bias(then, inits, dtype=np.float32):
    """x [M, K] -> MatMul(W [K, N]) -> ``then`` (reads "mm", writes "o") -> Add(bias [N]) -> y."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), *then, helper.make_node("Add", ["o", "bias"], ["y"])]
    inits = {"w": RNG.standard_normal((K, N)).astype(dtype), "bias": (RNG.standard_normal(N) * 100).astype(dtype),
             **inits}
    return x_model(nodes, [M, K], [M, N], inits, dtype=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


def _fired(name, m) -> int:
    return run_rule(name, m, exact=True)[1].rules[name].fired


NEUTRAL = {"mul_by_one": ("Mul", 1), "div_by_one": ("Div", 1), "add_zero": ("Add", 0), "sub_zero": ("Sub", 0)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rule", list(NEUTRAL))
def test_neutral_constants_on_every_broadcast_shape(rule, shape):
    """onnxruntime removes x op (0 or 1) itself only for a one-element constant; a larger one it
    keeps, and then it cannot fuse the MatMul with the bias Add: removing it would."""
    op, value = NEUTRAL[rule]
    c = np.full(SHAPES[shape], value, np.float32)
    m = _between_matmul_and_bias([helper.make_node(op, ["mm", "c"], ["o"])], {"c": c})
    assert run_rule(rule, m)[1].rules[rule].fired == 1  # the default mode takes every shape
    exact_outputs(rule, m, _feeds([M, K]))
    assert _fired(rule, m) == (c.size == 1)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_pow_two_on_every_broadcast_shape(shape):
    p = np.full(SHAPES[shape], 2, np.float32)
    m = _between_matmul_and_bias([helper.make_node("Pow", ["mm", "p"], ["o"])], {"p": p})
    exact_outputs("pow_two_to_mul", m, _feeds([M, K]))
    assert _fired("pow_two_to_mul", m) == (p.size == 1)


GEMM_BIAS = {"[N]", "[1,N]", "[M,1]", "[M,N]"}  # the bias shapes onnxruntime's MatMulAddFusion takes


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=["float", "float16", "double"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matmul_add_to_gemm_on_every_broadcast_shape(shape, dtype):
    """A Gemm where onnxruntime makes the same one (float or float16, bias [N], [1, N], [M, 1],
    [M, N]); a scalar, [1] or [1, 1] bias, or a double, it leaves as MatMul + Add."""
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("MatMul", ["n", "w"], ["mm"]),
             helper.make_node("Add", ["mm", "c"], ["y"])]
    inits = {"w": RNG.standard_normal((K, N)).astype(dtype), "c": (RNG.standard_normal(SHAPES[shape]) * 100).astype(dtype)}
    m = x_model(nodes, [M, K], [M, N], inits, dtype=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    assert run_rule("matmul_add_to_gemm", m)[1].rules["matmul_add_to_gemm"].fired == 1
    exact_outputs("matmul_add_to_gemm", m, _feeds([M, K], dtype))
    assert _fired("matmul_add_to_gemm", m) == (shape in GEMM_BIAS and dtype != np.float64)


@pytest.mark.parametrize("m_,n", [(1, N), (M, 1)], ids=["M=1", "N=1"])
def test_matmul_add_to_gemm_with_a_one_element_bias_where_it_is_a_row_or_a_column(m_, n):
    """[1, 1] is [M, 1] when M = 1 and [1, N] when N = 1: onnxruntime fuses those."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "c"], ["y"])]
    m = x_model(nodes, [m_, K], [m_, n], {"w": RNG.standard_normal((K, n)).astype(np.float32),
                                         "c": np.array([[123.456]], np.float32)})
    exact_outputs("matmul_add_to_gemm", m, _feeds([m_, K]))
    assert _fired("matmul_add_to_gemm", m) == 1


FLAT_BIAS = {"none": None, **{k: v for k, v in SHAPES.items() if k in ("scalar", "[1]", "[N]", "[1,1]", "[1,N]")}}


@pytest.mark.parametrize("shape", list(FLAT_BIAS))
def test_gemm_flatten_to_matmul_on_every_bias_shape(shape):
    """Gemm on rows flattened from x [2, 64, K] becomes MatMul + Add, which onnxruntime turns back
    into the same Gemm only for a bias of [N] (or none): a scalar, [1] or [1, N] bias it leaves
    as MatMul + Add."""
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["r"]),
             helper.make_node("Gemm", ["r", "w"] + (["c"] if FLAT_BIAS[shape] is not None else []), ["g"]),
             helper.make_node("Reshape", ["g", "back"], ["y"])]
    inits = {"w": RNG.standard_normal((K, N)).astype(np.float32), "flat": np.array([-1, K], np.int64),
             "back": np.array([2, 64, N], np.int64)}
    if FLAT_BIAS[shape] is not None:
        inits["c"] = (RNG.standard_normal(FLAT_BIAS[shape]) * 100).astype(np.float32)
    m = x_model(nodes, [2, 64, K], [2, 64, N], inits)
    assert run_rule("gemm_flatten_to_matmul", m)[1].rules["gemm_flatten_to_matmul"].fired == 1
    exact_outputs("gemm_flatten_to_matmul", m, _feeds([2, 64, K]))
    assert _fired("gemm_flatten_to_matmul", m) == (shape in ("none", "[N]"))


def test_gemm_flatten_to_matmul_on_a_dynamic_batch():
    """onnxruntime reshapes a MatMul + Add into a Gemm only on an input of static shape."""
    i64 = lambda v: np.array(v, np.int64)  # noqa: E731
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "ax"], ["ub"]),
             helper.make_node("Concat", ["ub", "t", "n"], ["back"], axis=0),
             helper.make_node("Reshape", ["x", "flat"], ["r"]), helper.make_node("Gemm", ["r", "w", "c"], ["g"]),
             helper.make_node("Reshape", ["g", "back"], ["y"])]
    inits = {"w": RNG.standard_normal((K, N)).astype(np.float32), "c": (RNG.standard_normal(N) * 100).astype(np.float32),
             "i0": i64(0), "ax": i64([0]), "t": i64([64]), "n": i64([N]), "flat": i64([-1, K])}
    m = x_model(nodes, ["batch", 64, K], ["batch", 64, N], inits)
    assert run_rule("gemm_flatten_to_matmul", m)[1].rules["gemm_flatten_to_matmul"].fired == 1
    exact_outputs("gemm_flatten_to_matmul", m, _feeds([2, 64, K]))
    assert _fired("gemm_flatten_to_matmul", m) == 0


EXPAND = {"empty": (0,), **{k: v for k, v in SHAPES.items() if k not in ("scalar",)}}


@pytest.mark.parametrize("shape", list(EXPAND))
def test_expand_elimination_on_every_target_shape(shape):
    """Expand to a shape x covers: onnxruntime removes it itself unless the target is empty."""
    target = np.array(EXPAND[shape] if shape != "empty" else [], np.int64)
    m = _between_matmul_and_bias([helper.make_node("Expand", ["mm", "shape"], ["o"])], {"shape": target})
    assert run_rule("expand_elimination", m)[1].rules["expand_elimination"].fired == 1
    exact_outputs("expand_elimination", m, _feeds([M, K]))
    assert _fired("expand_elimination", m) == (shape != "empty")


# --- rules that take a node out: onnxruntime must not fuse across the gap where it did not ----------

_I = lambda v: np.array(v, np.int64)  # noqa: E731
REMOVALS = {  # rule: (nodes between the MatMul ("mm") and the bias Add ("o"), initializers, fires in exact mode)
    "identity_elimination": ([helper.make_node("Identity", ["mm"], ["o"])], {}, True),
    "dropout_elimination": ([helper.make_node("Dropout", ["mm"], ["o"])], {}, True),
    "cast_elimination": ([helper.make_node("Cast", ["mm"], ["o"], to=TensorProto.FLOAT)], {}, True),
    "transpose_pair": ([helper.make_node("Transpose", ["mm"], ["t"], perm=[1, 0]),
                        helper.make_node("Transpose", ["t"], ["o"], perm=[1, 0])], {}, True),
    "slice_elimination": ([helper.make_node("Slice", ["mm", "st", "en"], ["o"])],
                          {"st": _I([0]), "en": _I([(1 << 63) - 1])}, True),  # (onnxruntime's own)
    "transpose_elimination": ([helper.make_node("Transpose", ["mm"], ["o"], perm=[0, 1])], {}, False),
    "cast_chain": ([helper.make_node("Cast", ["mm"], ["t"], to=TensorProto.DOUBLE),
                    helper.make_node("Cast", ["t"], ["o"], to=TensorProto.FLOAT)], {}, False),
    "reshape_elimination": ([helper.make_node("Reshape", ["mm", "s"], ["o"])], {"s": _I([M, N])}, False),
    "flatten_elimination": ([helper.make_node("Flatten", ["mm"], ["o"], axis=1)], {}, False),
    "squeeze_unsqueeze": ([helper.make_node("Unsqueeze", ["mm", "a"], ["t"]),
                           helper.make_node("Squeeze", ["t", "a"], ["o"])], {"a": _I([0])}, False),
    "slice_elimination-1e12": ([helper.make_node("Slice", ["mm", "st", "en"], ["o"])],
                               {"st": _I([0]), "en": _I([10 ** 12])}, False),
    "pad_elimination": ([helper.make_node("Pad", ["mm", "p"], ["o"])], {"p": _I([0, 0, 0, 0])}, False),
    "concat_elimination": ([helper.make_node("Concat", ["mm"], ["o"], axis=0)], {}, False),
    "split_elimination": ([helper.make_node("Split", ["mm"], ["o"], axis=0, num_outputs=1)], {}, False),
}


@pytest.mark.parametrize("case", list(REMOVALS))
def test_removals_between_a_matmul_and_its_bias(case):
    """Taking out a node onnxruntime keeps itself lets it fuse MatMul + Add into a Gemm it did not
    make for the original (one rounding instead of two): exact mode refuses those (rules/_exact.py);
    the nodes onnxruntime removes itself still go."""
    nodes, inits, fires_exact = REMOVALS[case]
    rule = case.split("-")[0]
    m = _between_matmul_and_bias(nodes, inits)
    m.opset_import[0].version = 18  # (Split's num_outputs)
    assert run_rule(rule, m)[1].rules[rule].fired == 1
    exact_outputs(rule, m, _feeds([M, K]))
    assert _fired(rule, m) == int(fires_exact)
