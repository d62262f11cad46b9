"""The pieces of the normalizations as patterns, for rules/normalization.py.

    LayerNorm: (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) [* gamma [+ beta]]
    RMSNorm:    x / sqrt(mean(x^2) + eps) [* weight]

Each piece is a function that returns a pattern (onnxopt.core.pattern); the names it binds are
listed with it. Both normalizations are ``root_mean_square`` (the one piece they share: the
square root of a mean of squares, which is the variance of a centred value) under a division,
optionally scaled (and shifted); their patterns are rooted at the output and tried at the Sqrt
(``Around("sqrt", ...)``), the one node every form has. What the pieces leave to a condition:
the means' axes (the last one) and keepdims, the epsilon's and the scale's values, the types.

- ``square(v)``: ``Pow(v, 2)`` or ``v * v`` (``square``).
- ``mean_of_squares(v)``: ``ReduceMean(square(v))`` (``mean_square``; its axes, an attribute or
  from opset 18 an input, are the condition's).
- ``root_mean_square(v)``: ``Sqrt(mean_of_squares(v) [+ eps])`` (``sqrt``; ``eps_add`` and the
  constant ``eps``, either operand order, absent where nothing is added).
- ``centred(x, bind)``: ``x - ReduceMean(x)`` (``centre``, ``mean``), its output bound as
  ``bind``; read by any number of nodes (a rule says which readers it takes).
- ``not_centred(x)``: the value ``x``, where it is not ``centred`` (RMS normalization of a centred
  value is the layer normalization, that rule's form).
- ``divided(num, denom)``: ``num / denom`` as ``Div(num, denom)``, ``num * Reciprocal(denom)`` or
  ``num * Div(1, denom)``, the Mul's operands in either order (``divide``; ``reciprocal``).
- ``scaled(p)``: ``p * gamma`` (``scale``, the constant ``gamma``; either order).
- ``affine(p)``: ``p * gamma + beta`` (``shift``, the constant ``beta``; either order).
- ``read_by_a_division(p)``: ``p``, a normalization's whole pattern tried at its Sqrt; where no
  node reading the Sqrt begins it, the reason says the Sqrt is not divided by (a failure further
  in, once the way back to the Sqrt matched, keeps its own reason).

Every value between the nodes is read by the next node alone (a nested Op's default), except
the centred value (read by the square and the division) and the input.
"""

from __future__ import annotations

from onnxopt.core.pattern import ANY, All, Const, Explain, Not, Op, Opt, Or, Pattern, Var

from onnxopt.rules._semantic import scalar

NOT_A_SQUARE = "the mean under the Sqrt is not of a square"
NO_MEAN = "Sqrt does not take a mean (+ epsilon)"


def is_two(value) -> bool:
    return scalar(value) == 2.0


def is_one(value) -> bool:
    return scalar(value) == 1.0


def is_number(value) -> bool:
    """A one-element constant (an epsilon)."""
    return scalar(value) is not None


def square(v: str) -> Pattern:
    return Or(Op("Pow", Var(v), Const(check=is_two), name="square"), Op("Mul", Var(v), Var(v), name="square"))


def mean_of_squares(v: str) -> Pattern:
    return Explain(Op("ReduceMean", Explain(square(v), NOT_A_SQUARE), Opt(ANY), name="mean_square"), NO_MEAN,
                   deep=False)


def root_mean_square(v: str) -> Op:
    ms = mean_of_squares(v)
    # (the Add second: where the Sqrt reads neither, the reason is the mean's)
    eps = Explain(Const("eps", check=is_number), "what is added under the Sqrt is not a constant number")
    return Op("Sqrt", Or(ms, Op("Add", ms, eps, commutative=True, name="eps_add")), name="sqrt")


def centred(x: str, bind: str | None = None) -> Op:
    return Op("Sub", Var(x), Op("ReduceMean", Var(x), Opt(ANY), name="mean"), name="centre", bind=bind, shared=True)


def not_centred(x: str) -> Pattern:
    return All(Var(x), Not(centred("_centred_input"), "a mean is subtracted (layer_normalization's form)"))


def divided(num: Pattern, denom: Pattern) -> Pattern:
    return Or(Op("Div", num, denom, name="divide"),
              Op("Mul", num, Op("Reciprocal", denom, name="reciprocal"), commutative=True, name="divide"),
              Op("Mul", num, Op("Div", Const(check=is_one), denom, name="reciprocal"), commutative=True,
                 name="divide"))


def scaled(p: Pattern) -> Op:
    return Op("Mul", p, Const("gamma"), commutative=True, name="scale")


def affine(p: Pattern) -> Op:
    return Op("Add", scaled(p), Const("beta"), commutative=True, name="shift")


def read_by_a_division(p: Pattern) -> Pattern:
    return Explain(p, "the Sqrt is not read by a division of the input (Div, or Mul by its reciprocal)", deep=False)
