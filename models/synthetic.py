"""Synthetic models: residual blocks of Conv, BatchNormalization, Relu, Identity and Add.

``build(n_nodes)`` makes a model of about ``n_nodes`` nodes (5 per block) with random weights and
randomized BatchNormalization statistics, so that folding changes numbers measurably. Used by the
tests and by scripts/bench/engine.py to show that optimize time grows linearly with graph size.
``inputs(model, seed)``: standard normal feeds for any of them.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .inputs import synthetic_inputs as inputs  # noqa: F401  (synthetic.inputs: the tests' feeds)

NODES_PER_BLOCK = 5


def build(n_nodes: int, *, channels: int = 4, size: int = 8, seed: int = 0, opset: int = 17,
          ir_version: int = 10) -> onnx.ModelProto:
    """Blocks of x -> Conv -> BatchNormalization -> Relu -> Identity -> Add(x).

    Every fourth block uses a depthwise conv (group = channels) and every third a conv without bias.
    """
    rng = np.random.default_rng(seed)
    blocks = max(1, n_nodes // NODES_PER_BLOCK)
    nodes, inits = [], []
    x = "input"
    c = channels

    def init(name, array):
        inits.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    for i in range(blocks):
        depthwise = i % 4 == 3
        group = c if depthwise else 1
        fan_in = (c // group) * 9
        w = init(f"b{i}.w", rng.standard_normal((c, c // group, 3, 3)) / np.sqrt(fan_in))
        conv_inputs = [x, w]
        if i % 3 != 2:
            conv_inputs.append(init(f"b{i}.b", rng.standard_normal(c) * 0.1))
        nodes.append(helper.make_node("Conv", conv_inputs, [f"b{i}.conv"], name=f"b{i}/conv",
                                      pads=[1, 1, 1, 1], group=group))
        nodes.append(helper.make_node(
            "BatchNormalization",
            # small BN scales keep the residual sum bounded over thousands of blocks
            [f"b{i}.conv", init(f"b{i}.scale", rng.uniform(0.02, 0.1, c)), init(f"b{i}.beta", rng.standard_normal(c) * 0.01),
             init(f"b{i}.mean", rng.standard_normal(c) * 0.1), init(f"b{i}.var", rng.uniform(0.5, 2.0, c))],
            [f"b{i}.bn"], name=f"b{i}/bn", epsilon=1e-5))
        nodes.append(helper.make_node("Relu", [f"b{i}.bn"], [f"b{i}.relu"], name=f"b{i}/relu"))
        nodes.append(helper.make_node("Identity", [f"b{i}.relu"], [f"b{i}.id"], name=f"b{i}/identity"))
        nodes.append(helper.make_node("Add", [f"b{i}.id", x], [f"b{i}.out"], name=f"b{i}/add"))
        x = f"b{i}.out"
    graph = helper.make_graph(
        nodes, f"synthetic_{blocks * NODES_PER_BLOCK}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, c, size, size])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, c, size, size])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version,
                             producer_name="onnxopt.models.synthetic")


def _chain(n_nodes: int, op: str, first: str, other: str, inits: list, name: str) -> onnx.ModelProto:
    """``t{i+1} = op(t{i}, other)`` for i < n_nodes, from ``first``; one input ``x`` of 4 floats,
    the output ``y = Add(x, t{n})`` (so that the graph computes something whatever is folded)."""
    nodes = [helper.make_node(op, [first if i == 0 else f"t{i}", other], [f"t{i + 1}"], name=f"{op.lower()}{i}")
             for i in range(n_nodes)]
    nodes.append(helper.make_node("Add", ["x", f"t{n_nodes}"], ["y"], name="out"))
    graph = helper.make_graph(nodes, f"{name}_{n_nodes}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10,
                             producer_name="onnxopt.models.synthetic")


def shared_zero_chain(n_nodes: int) -> onnx.ModelProto:
    """A chain of ``Add(t, z)`` on the input, every node reading one zero initializer ``z``: each
    Add is the identity (z is -0.0: t + -0.0 is t, sign of zero included), and each removal
    leaves ``z`` with one reader fewer."""
    return _chain(n_nodes, "Add", "x", "z", [numpy_helper.from_array(np.full(4, -0.0, np.float32), "z")],
                  "shared_zero_chain")


def fold_chain(n_nodes: int) -> onnx.ModelProto:
    """A chain of ``Add(c, one)`` from a constant, every node reading one initializer ``one``: the
    whole chain folds, one node at a time."""
    return _chain(n_nodes, "Add", "c0", "one", [numpy_helper.from_array(np.zeros(4, np.float32), "c0"),
                                                numpy_helper.from_array(np.ones(4, np.float32), "one")], "fold_chain")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxopt.models.synthetic",
                                description="Write a synthetic conv/BN/relu/identity/add model.")
    p.add_argument("--nodes", type=int, default=100, metavar="N",
                   help="about this many nodes (5 per block; default 100)")
    p.add_argument("--out", default="synthetic.onnx", metavar="FILE", help="where to write it (default synthetic.onnx)")
    args = p.parse_args(argv)
    onnx.save(build(args.nodes), args.out)
    print(f"wrote {args.out} ({max(1, args.nodes // NODES_PER_BLOCK) * NODES_PER_BLOCK} nodes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
