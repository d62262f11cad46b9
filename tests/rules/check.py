"""The one way tests/rules run a rule: alone (no other rule, no graph pass unless asked) on a small
model, then onnxruntime on the model before and after.

``fires(rule, model)``: the rule rewrites the model (once, unless ``times`` says otherwise) and the
outputs are the same bits (NaN where NaN, the same infinities and signs of zero), or within
``tol`` for a rule exact only up to rounding (folding constants into weights), onnxruntime's
graph optimizations off. For a rule declared exact (``Rule.exact``) it also runs the rule as
``optimize(exact=True)`` does and checks that the result gives the same bits as the model under
onnxruntime's default settings (graph optimizations on) at 1 and 2 intra-op threads: the proof
of the declaration (tests/rules/coverage.py fails a rule declared exact that no test proved).

``refuses(rule, model, reason)``: the rule's condition or replacement refuses, with a reason that
contains ``reason``; the model keeps its nodes and its outputs their bits. ``mismatches(rule, model,
reason)``: the same where the rule's pattern is what refuses (a form it says it does not take).

Both first check that the model's outputs change when its inputs do (a model whose outputs do not
depend on its inputs shows nothing), and return ``(optimized model, report)``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
from conftest import run_ort
from helpers import feeds_for, init, model, op_types, tinfo
from onnx import TensorProto, helper

from onnxopt import default_rules, optimize

from .coverage import prove_exact

RULES = {rule.name: rule for rule in default_rules()}


def _zoo_exact():
    """scripts/oracles/zoo_exact.py, whose bit-for-bit comparison under onnxruntime's defaults is the one
    exact mode is held to."""
    return importlib.import_module("scripts.oracles.zoo_exact")


zoo_exact = _zoo_exact()
THREADS = zoo_exact.THREADS
_identical = zoo_exact.identical


def run_rule(name: str, model: onnx.ModelProto, *, passes=(), **options):
    """``optimize`` with the rule ``name`` alone (and the graph passes named): (model, report); the
    rule runs whatever the measured benefit table says of its target (the rule itself is tested)."""
    from onnxopt.targets import benefit

    with benefit.using(None):
        return optimize(model, rules=[RULES[name]], graph_passes=passes, return_report=True, **options)


def _stats(report, name: str) -> str:
    st = report.rules[name]
    return f"{name}: fired {st.fired}, refused {st.refused}, reasons {dict(st.reasons)}"


def fires(name: str, model: onnx.ModelProto, *, times: int = 1, feeds: dict | None = None, tol: float | None = None,
          passes=(), depends: bool = True, **options):
    """Rule ``name`` rewrites ``model`` ``times`` times; the outputs are the same bits (or within
    ``tol``, relative and absolute) on ``feeds`` (default: random inputs)."""
    out, report = run_rule(name, model, passes=passes, **options)
    assert report.rules[name].fired == times, _stats(report, name)
    same_outputs(model, out, feeds, tol=tol, depends=depends)
    if RULES[name].exact:
        assert tol is None, f"{name} is declared exact: a tolerance has no place in its tests"
        exact_outputs(name, model, feeds, passes=passes, **options)
    return out, report



def exact_outputs(name: str, model: onnx.ModelProto, feeds: dict | None = None, *, passes=(), **options):
    """Rule ``name`` as ``optimize(exact=True)`` runs it: where it fires, the result gives the
    bits of ``model`` under onnxruntime's default session options at each of ``THREADS``
    intra-op threads; recorded as a proof of the rule's declaration (coverage.prove_exact)."""
    out, report = run_rule(name, model, passes=passes, exact=True, **options)
    feeds = feeds_for(model) if feeds is None else feeds
    for threads in THREADS:
        for x, y in zip(run_default(model, feeds, threads), run_default(out, feeds, threads), strict=True):
            assert _identical(x, y), (f"{name} under exact mode, onnxruntime's defaults, {threads} threads", x, y)
    if report.rules[name].fired:
        prove_exact(name)
    return out, report


def run_default(model: onnx.ModelProto, feeds: dict, threads: int) -> list:
    """onnxruntime CPU's outputs with its default session options (graph optimizations on), at
    ``threads`` intra-op threads."""
    return zoo_exact.outputs(model.SerializeToString(), feeds, threads)


def refuses(name: str, model: onnx.ModelProto, reason: str, *, feeds: dict | None = None, passes=(),
            depends: bool = True, **options):
    """Rule ``name`` matches ``model`` and refuses, giving a reason that contains ``reason``; the
    model keeps its nodes, and its outputs their bits."""
    out, report = run_rule(name, model, passes=passes, **options)
    st = report.rules[name]
    assert st.fired == 0 and st.refused >= 1, _stats(report, name)
    assert any(reason in r for r in st.reasons), f"no reason contains {reason!r}; {_stats(report, name)}"
    assert op_types(out) == op_types(model)
    same_outputs(model, out, feeds, depends=depends)
    return out, report


def mismatches(name: str, model: onnx.ModelProto, reason: str, *, feeds: dict | None = None, passes=(),
               depends: bool = True, **options):
    """Rule ``name``'s pattern does not match ``model`` (a form it says it does not take), giving a
    reason that contains ``reason``; the model keeps its nodes, and its outputs their bits."""
    out, report = run_rule(name, model, passes=passes, **options)
    st = report.rules[name]
    assert st.fired == 0 and st.matched == 0 and st.tried >= 1, _stats(report, name)
    assert any(reason in r for r in st.reasons), f"no reason contains {reason!r}; {_stats(report, name)}"
    assert op_types(out) == op_types(model)
    same_outputs(model, out, feeds, depends=depends)
    return out, report


def same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict | None = None, *,
                 tol: float | None = None, depends: bool = True):
    """onnxruntime gives ``after`` the outputs of ``before`` on ``feeds`` (default: random inputs):
    the same shapes and dtypes and the same bits (NaN where NaN, signs of zero and of NaN), or
    within ``tol``. ``depends``: first check that the outputs change when the inputs do."""
    feeds = feeds_for(before) if feeds is None else feeds
    a = run_ort(before, feeds)
    if depends and feeds:
        moved = run_ort(before, {k: _perturbed(v) for k, v in feeds.items()})
        assert any(not _identical(x, y) for x, y in zip(a, moved)), \
            "the outputs do not depend on the inputs: the test would show nothing"
    b = run_ort(after, feeds)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, x.dtype, y.shape, y.dtype)
        if tol is None:
            assert _identical(x, y), (x, y)
        else:
            np.testing.assert_allclose(y, x, rtol=tol, atol=tol)
    return a, b


def _perturbed(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        moved = np.logical_not(x) if x.dtype == np.bool_ else x * 2 + 1 if x.dtype.kind == "f" else x + 1
    return np.asarray(moved, dtype=x.dtype)  # (an array, also for 0-d inputs)


# --- small models ----------------------------------------------------------------------------------


def i64(name: str, values) -> onnx.TensorProto:
    """An int64 initializer (shapes, axes, indices)."""
    return init(name, np.array(values, dtype=np.int64))


def x_model(nodes, x_shape, y_shape, inits=(), *, dtype=TensorProto.FLOAT, opset=17) -> onnx.ModelProto:
    """Input x -> ``nodes`` -> output y (shapes as for ``helpers.tinfo``: a list, or a rank);
    ``inits``: initializers, or a dict of name -> array."""
    if isinstance(inits, dict):
        inits = [init(k, v) for k, v in inits.items()]
    m = model(nodes, [tinfo("x", x_shape, dtype)], [tinfo("y", y_shape, dtype)], inits, opset=opset)
    return with_opaque(m) if any(n.domain == OPAQUE_DOMAIN for n in nodes) else m


# --- a value whose type and shape onnxopt cannot see ------------------------------------------------

OPAQUE_DOMAIN = "opaque"


def opaque(x: str, y: str) -> onnx.NodeProto:
    """y = x through a model-local function: onnxruntime runs it, onnxopt's local inference knows
    neither y's type nor its shape (for conditions that refuse what they cannot see)."""
    return helper.make_node("Opaque", [x], [y], domain=OPAQUE_DOMAIN)


def with_opaque(m: onnx.ModelProto) -> onnx.ModelProto:
    """``m`` with the function ``opaque`` calls."""
    opsets = [o for o in m.opset_import if o.domain in ("", "ai.onnx")]
    m.opset_import.append(helper.make_opsetid(OPAQUE_DOMAIN, 1))
    m.functions.append(helper.make_function(OPAQUE_DOMAIN, "Opaque", ["x"], ["y"],
                                            [helper.make_node("Identity", ["x"], ["y"])], opsets))
    return m
