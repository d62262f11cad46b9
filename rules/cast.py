"""Casts that change nothing, chains of casts, and CastLike with a known target type.

Exact: a Cast goes only where the value it gives is the value it was given (bit for bit), and a
chain goes through an intermediate type only when that type holds every value of the source type.
castlike_to_cast is not exact in exact mode's sense (``Rule.exact``): CastLike(constant, y) becomes
a Cast onnxruntime folds, and its weight fusions then apply where they did not (README, Exact mode).
"""

from __future__ import annotations

import onnx_ir as ir

from onnxopt.core.pattern import Match, Op, Rule, forward

from onnxopt.rules._exact import exact_removal

_D = ir.DataType
# A source type whose every value the target type holds exactly (so a round trip is the identity).
EXACT_TARGETS = {
    _D.BOOL: {_D.INT8, _D.INT16, _D.INT32, _D.INT64, _D.UINT8, _D.UINT16, _D.UINT32, _D.UINT64, _D.FLOAT16, _D.FLOAT,
              _D.DOUBLE, _D.BFLOAT16},
    _D.INT8: {_D.INT16, _D.INT32, _D.INT64, _D.FLOAT16, _D.FLOAT, _D.DOUBLE, _D.BFLOAT16},
    _D.UINT8: {_D.INT16, _D.INT32, _D.INT64, _D.UINT16, _D.UINT32, _D.UINT64, _D.FLOAT16, _D.FLOAT, _D.DOUBLE,
               _D.BFLOAT16},
    _D.INT16: {_D.INT32, _D.INT64, _D.FLOAT, _D.DOUBLE},
    _D.UINT16: {_D.INT32, _D.INT64, _D.UINT32, _D.UINT64, _D.FLOAT, _D.DOUBLE},
    _D.INT32: {_D.INT64, _D.DOUBLE},
    _D.UINT32: {_D.INT64, _D.UINT64, _D.DOUBLE},
    _D.FLOAT16: {_D.FLOAT, _D.DOUBLE},
    _D.BFLOAT16: {_D.FLOAT, _D.DOUBLE},
    _D.FLOAT: {_D.DOUBLE},
}


def cast_elimination_condition(m: Match):
    source = m.dtype("x")
    if source is None:
        return "input dtype unknown"
    if int(m.attr("cast", "to")) != source.value:
        return "changes the type"
    return None


def cast_chain_condition(m: Match):
    source = m.dtype("x")
    if source is None:
        return "input dtype unknown"
    middle = ir.DataType(int(m.attr("inner", "to")))
    if middle != source and middle not in EXACT_TARGETS.get(source, ()):
        return f"{source.name} -> {middle.name} is not exact"
    return source  # the plan: the source type


def cast_chain_replacement(m: Match, b):
    if int(m.attr("outer", "to")) == m.plan.value:
        return m["x"]
    return b.op("Cast", m["x"], attrs=m.node("outer").attributes.values())


def castlike_to_cast_condition(m: Match):
    target = m.dtype("like")
    return "the target dtype is unknown" if target is None else target  # the plan: the target type


def castlike_to_cast_replacement(m: Match, b):
    attrs = {"to": m.plan.value}
    saturate = m.node("castlike").attributes.get("saturate")
    if saturate is not None:
        attrs["saturate"] = saturate.value
    return b.op("Cast", m["x"], **attrs)


RULES = [
    Rule("cast_elimination", Op("Cast", "x", name="cast"), forward("x"), condition=cast_elimination_condition,
         exact=True, doc="Cast to the type x already has is x."),
    Rule("cast_chain", Op("Cast", Op("Cast", "x", name="inner"), name="outer"), cast_chain_replacement,
         condition=exact_removal(cast_chain_condition, "Cast chain",
                                 lambda m, source: int(m.attr("outer", "to")) == source.value),
         exact=True, doc="Cast(Cast(x, A), B) is Cast(x, B) (or x) when A holds every value of x's type exactly."),
    Rule("castlike_to_cast", Op("CastLike", "x", "like", name="castlike"), castlike_to_cast_replacement,
         condition=castlike_to_cast_condition,
         exact=False, doc="CastLike(x, y) with y's dtype known is Cast(x, to=dtype): then constant inputs fold."),
]
