"""Which nodes may be merged with an equal twin, and which may be removed when nothing reads them.

Common-subexpression elimination merges two nodes with the same op, attributes and inputs; that is
right only when a node's outputs are a function of its inputs. Dead-code removal deletes a node
whose outputs nobody reads; that is right only when the node does nothing else. Both ask here, and
the answer is an allow-list, one of three levels per node:

- ``PURE`` (merged, removed when unused): every op of the standard domains (``""``/``ai.onnx`` and
  ``ai.onnx.ml``) except the random ones below; the ``com.microsoft`` ops named in
  :data:`MICROSOFT_PURE`; a call of a model-local function whose body is pure.
- ``RANDOM`` (never merged, removed when unused): RandomNormal, RandomUniform and their ``Like``
  forms, Multinomial, Bernoulli, and Dropout in training mode. Two of them draw different values, so
  they are not one; but an unused one changes no result: ONNX gives them no state that another
  node or a later run sees, and an unseeded draw has no defined value to keep.
- ``OPAQUE`` (neither): every other op, whose meaning onnxopt does not know (custom domains, the
  ``ai.onnx.preview`` domains, ``com.microsoft`` ops not listed, which include kernels that update
  a key/value cache in place), and a call of a local function whose body holds such an op.

A node with subgraphs (If, Loop, Scan) is at the level of the least pure node it holds.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from onnxopt.ir.util import RANDOM_OPS, constant_tensor

PURE, RANDOM, OPAQUE = 0, 1, 2

STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})

# onnxruntime contrib ops that compute a function of their inputs and nothing else: the fused ops
# onnxruntime's graph optimizer and its transformers optimizer write into the models they save, and
# the quantized kernels of its quantization tool. Left out on purpose: the random ones (BiasDropout,
# BitmaskDropout, BitmaskBiasDropout, Sampling), those that may write a key/value cache in place
# (GroupQueryAttention, DecoderMaskedMultiHeadAttention, DecoderMaskedSelfAttention,
# PagedAttention; Attention with past_present_share_buffer, see _MICROSOFT_IN_PLACE), and those
# with subgraphs or search state (BeamSearch, GreedySearch, WhisperBeamSearch).
MICROSOFT_PURE = frozenset({
    # activations and element-wise fusions
    "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BiasAdd", "BiasSoftmax", "BiasSplitGelu",
    # matrix products and convolutions
    "FusedMatMul", "TransposeMatMul", "FusedGemm", "FusedConv", "NhwcConv", "GemmFastGelu",
    "MatMulNBits", "MatMulBnb4", "MatMulInteger16", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
    # normalizations
    "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization",
    "GroupNorm", "SkipGroupNorm",
    # attention
    "Attention", "MultiHeadAttention", "RotaryEmbedding", "RelativePositionBias",
    # quantized kernels
    "QuantizeLinear", "DequantizeLinear", "QLinearAdd", "QLinearMul", "QLinearConv", "QLinearSigmoid",
    "QLinearLeakyRelu", "QLinearConcat", "QLinearAveragePool", "QLinearGlobalAveragePool",
    "QLinearSoftmax", "QLinearWhere", "QLinearReduceMean", "QGemm", "QAttention", "QEmbedLayerNormalization",
})
# attributes that, when set to a nonzero value, make a listed op write one of its inputs in place
_MICROSOFT_IN_PLACE = {"Attention": "past_present_share_buffer"}


def dropout_training(node: ir.Node, opset: int) -> str | None:
    """Why a Dropout node draws a random mask (it is in training mode), or None at inference."""
    if opset < 7:
        attr = node.attributes.get("is_test")
        if attr is None or attr.is_ref() or attr.value != 1:
            return "Dropout before opset 7 without is_test=1 is in training mode"
        return None
    mode = node.inputs[2] if len(node.inputs) > 2 else None
    if mode is None:
        return None
    tensor = constant_tensor(mode)
    if tensor is None:
        return "training_mode is not a constant"
    if tensor.size != 1 or bool(tensor.numpy().reshape(-1)[0]):
        return "training_mode is true"
    return None


def random_reason(node: ir.Node, opset: int) -> str | None:
    """Why a standard-domain node's result is drawn at random, or None when it is a function of its
    inputs (``opset``: the node's default-domain opset)."""
    if node.op_type in RANDOM_OPS:
        return f"{node.op_type} draws random numbers"
    if node.op_type == "Dropout":
        return dropout_training(node, opset)
    return None


class Purity:
    """The level of each node of one model (see the module docstring). Function bodies are judged
    once; a node's subgraphs each time it is asked about (rewrites change them)."""

    def __init__(self, model: ir.Model):
        self._functions = model.functions
        self._opsets = model.opset_imports
        self._function_levels: dict[tuple, int] = {}

    def mergeable(self, node: ir.Node, opsets: Mapping[str, int] | None = None) -> bool:
        """Two such nodes with equal ops, attributes and inputs compute equal outputs."""
        return self.level(node, opsets) == PURE

    def removable(self, node: ir.Node, opsets: Mapping[str, int] | None = None) -> bool:
        """Such a node, when nothing reads its outputs, may go without changing what the model does."""
        return self.level(node, opsets) != OPAQUE

    def level(self, node: ir.Node, opsets: Mapping[str, int] | None = None) -> int:
        """``opsets``: the imports the node is read with (the model's by default; a function's
        own for the nodes of its body)."""
        opsets = self._opsets if opsets is None else opsets
        level = self._own_level(node, opsets)
        for attr in node.attributes.values():
            if level == OPAQUE:
                break
            if attr.is_ref() or attr.type not in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                continue
            for graph in [attr.as_graph()] if attr.type == ir.AttributeType.GRAPH else attr.as_graphs():
                for inner in graph.all_nodes():
                    level = max(level, self._own_level(inner, opsets))
        return level

    def _own_level(self, node: ir.Node, opsets: Mapping[str, int]) -> int:
        key = node.op_identifier()
        if key in self._functions:
            return self._function_level(key)
        domain = node.domain
        if domain in STANDARD_DOMAINS:
            opset = opsets.get("", opsets.get("ai.onnx", 1))
            return RANDOM if random_reason(node, opset) else PURE
        if domain != "com.microsoft" or node.op_type not in MICROSOFT_PURE:
            return OPAQUE
        in_place = _MICROSOFT_IN_PLACE.get(node.op_type)
        attr = node.attributes.get(in_place) if in_place else None
        return OPAQUE if attr is not None and (attr.is_ref() or attr.value) else PURE

    def _function_level(self, key: tuple) -> int:
        level = self._function_levels.get(key)
        if level is None:
            self._function_levels[key] = OPAQUE  # while its body is judged: a recursive call is opaque
            function = self._functions[key]
            opsets = function.opset_imports
            level = max((self.level(node, opsets) for node in function), default=PURE)
            self._function_levels[key] = level
        return level
