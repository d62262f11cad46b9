"""The pieces of a transformer's embedding layer as patterns, for rules/embedding.py.

    LayerNorm(word[input_ids] + position[0..S-1] (+ segment[segment_ids]))

Each piece is a function that returns a pattern (onnxopt.core.pattern); the names it binds are
listed with it. What the pieces leave to the condition (rules/embedding.py): that the tables are
2-D and agree in width, that the position ids' Slice/Range bounds are 0..S (S the ids' own
sequence length, read back through the shape arithmetic), the types.

- ``arange_positions()``: position ids built as 0..S-1 (broadcast over the batch), looked
  through (``Absorbed``: they go when nothing else reads them):
  ``Slice(Const position_buffer, Const position_starts, position_end[, Const position_axes[,
  Const position_steps]])`` (``position_slice``: HF's ``position_ids`` buffer, both exporters), or
  ``Range(Const range_start, position_end, Const range_delta)`` (``position_range``), or the form
  rules/shape_ops.py's range_of_dim computes on the device, ``CumSum(ConstantOfShape(position_end),
  Const position_cumsum_axis)`` (``position_ones``, ``position_cumsum``: ones, summed exclusively), optionally
  under ``Unsqueeze`` (``position_unsqueeze``, axes ``Const position_unsqueeze_axes`` or the
  attribute) and ``Expand(.., position_expand_shape)`` (``position_expand``).
- ``position_ids()``: ``arange_positions()``, or a graph input ``position_input`` (the model
  takes its position ids: EmbedLayerNormalization's input 8).
- ``position_embedding()``: ``Gather(Const position_table, position_ids())``
  (``position_gather``), or that Gather folded at fixed shapes: a constant ``position_values``
  (the table's first S rows, [1, S, H] or [S, H]: the condition checks S); fails with
  ``NOT_ARANGE`` where the ids are neither, ``NO_POSITION`` where there is no such Gather.
- ``token_embedding(k)``: ``Gather(Const table<k>, ids<k>)`` (``gather<k>``; every Gather here
  on axis 0, the rows), where ids<k> are not
  ``arange_positions()`` (the word embedding, k = 0, and the segment/token-type embedding, k = 1:
  which is which is the condition's choice; EmbedLayerNormalization sums word[ids] and
  segment[segment_ids] alike).
- ``embedding_sum()``: the sum of two or three embeddings, Adds in any association and operand
  order, as the operand pairs of its last Add (``inner_add`` for the Add inside):
  ``[(tok0 + tok1, pos), (tok0 + pos, tok1), (tok0, pos)]``; the rule takes each pair in either
  order (an Add's operands, or a SkipLayerNormalization's input and skip).

Every value between the nodes is read by the next node alone (a nested Op's default), except the
position ids' nodes (looked through) and the sum itself.
"""

from __future__ import annotations

from onnxopt.core.pattern import Absorbed, All, Const, Explain, Not, Op, Opt, Or, Pattern, Var

NOT_ARANGE = ("position ids are not 0..S-1 (neither a Slice of a constant buffer nor a Range, nor a graph "
              "input)")
ROWS = {"axis": 0}  # a Gather of a table's rows (onnx's default axis)
NO_POSITION = "no position embedding (a Gather of a constant table) in the sum"
NOT_A_TABLE = "an embedding table is not a constant"


def is_graph_input(value) -> bool:
    """``value`` is a graph input (no producer, no constant value)."""
    return value.is_graph_input() and not value.is_initializer() and value.const_value is None


def arange_positions() -> Pattern:
    sliced = Op("Slice", Const("position_buffer"), Const("position_starts"), Var("position_end"),
                Opt(Const("position_axes")), Opt(Const("position_steps")), name="position_slice", shared=True)
    ranged = Or(Op("Range", Const("range_start"), Var("position_end"), Const("range_delta"), name="position_range",
                   shared=True),
                Op("CumSum", Op("ConstantOfShape", Var("position_end"), name="position_ones", shared=True),
                   Const("position_cumsum_axis"), name="position_cumsum", shared=True))
    unsqueezed = Op("Unsqueeze", ranged, Opt(Const("position_unsqueeze_axes")), name="position_unsqueeze",
                    shared=True)
    expanded = Op("Expand", Or(unsqueezed, ranged), Var("position_expand_shape"), name="position_expand",
                  shared=True)
    return Absorbed(Or(sliced, expanded, unsqueezed, ranged))


def position_ids() -> Pattern:
    return Or(arange_positions(), Var("position_input", check=is_graph_input))


def position_embedding() -> Pattern:
    gathered = Op("Gather", Explain(Const("position_table"), NOT_A_TABLE), Explain(position_ids(), NOT_ARANGE),
                  attrs=ROWS, name="position_gather")
    return Explain(Or(gathered, Const("position_values")), NO_POSITION, deep=False)


def token_embedding(k: int) -> Op:
    ids = All(Var(f"ids{k}"), Not(arange_positions(), "ids 0..S-1 are the position embedding's"))
    return Op("Gather", Explain(Const(f"table{k}"), NOT_A_TABLE), ids, attrs=ROWS, name=f"gather{k}")


def embedding_sum() -> list[tuple[Pattern, Pattern]]:
    """The operands of the sum's last Add, as three (a, b) pairs (either order is the rule's to try)."""
    word_and_segment = Op("Add", token_embedding(0), token_embedding(1), commutative=True, name="inner_add")
    word_and_position = Op("Add", token_embedding(0), position_embedding(), commutative=True, name="inner_add")
    return [(word_and_segment, position_embedding()), (word_and_position, token_embedding(1)),
            (token_embedding(0), position_embedding())]
