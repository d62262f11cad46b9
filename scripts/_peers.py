"""The tools scripts/bench.py compares, each called the way its documentation shows a user.

A tool is a ``Tool`` whose ``target`` names a ``setup(ctx)`` function ("module:function").
``setup`` does the imports (not timed) and returns ``run(src, dst)``, which reads the model file
``src``, optimizes it and writes ``dst``; bench.py times that call, in a subprocess of its own.
``run`` may return a dict of extra facts for the JSON report (computed inside the timed region,
so keep it cheap).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

TWO_GB = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    target: str  # "module:function"; function(ctx) -> run(src, dst) -> dict | None
    package: str  # distribution whose version BENCHMARKS.md reports
    timed: str  # what the timed region holds, for BENCHMARKS.md
    families: tuple[str, ...] | None = None  # only models of these families (None: all)
    pythonpath: str | None = None  # a directory the subprocess adds to sys.path (tests' fake tools)

    def applies(self, family: str) -> bool:
        return self.families is None or family in self.families


def save_proto(model, dst: str) -> None:
    """onnx.save as a user would: one file, external data only past protobuf's 2 GiB limit."""
    import onnx

    try:
        onnx.save(model, dst)
    except ValueError:  # "exceeds maximum protobuf size of 2GB"
        onnx.save(model, dst, save_as_external_data=True, location=Path(dst).name + ".data")


def _big(path: str) -> bool:
    p = Path(path)
    size = p.stat().st_size + sum(f.stat().st_size for f in p.parent.glob(p.stem + "*.data"))
    return size > TWO_GB * 0.9


def model_type(model_name: str) -> str:
    """onnxruntime.transformers model_type for a zoo model name (MiniLM and BERT are 'bert')."""
    return "gpt2" if "gpt" in model_name.lower() else "bert"


# ---------------------------------------------------------------------------------------------
# Adapters


def setup_onnxopt(ctx: dict, **options):
    from onnxopt import optimize

    def run(src: str, dst: str) -> dict:
        _, report = optimize(src, output=dst, return_report=True, **options)
        return {"fired": report.fired, "phases_s": {k: round(v, 6) for k, v in report.seconds.items()}}

    return run


def setup_onnxopt_exact(ctx: dict):
    return setup_onnxopt(ctx, exact=True)


def setup_onnxsim(ctx: dict):
    import onnx
    import onnxsim

    def run(src: str, dst: str) -> None:
        model = onnx.load(src)
        simplified, ok = onnxsim.simplify(model)
        if not ok:
            raise RuntimeError("onnxsim.simplify: the simplified model failed its check")
        save_proto(simplified, dst)

    return run


def setup_onnxslim(ctx: dict):
    import onnx
    import onnxslim

    def run(src: str, dst: str) -> None:
        save_proto(onnxslim.slim(onnx.load(src)), dst)

    return run


def setup_onnxoptimizer(ctx: dict):
    import onnx
    import onnxoptimizer

    def run(src: str, dst: str) -> None:
        save_proto(onnxoptimizer.optimize(onnx.load(src)), dst)

    return run


def setup_onnxscript(ctx: dict):
    import onnx
    import onnxscript.optimizer

    def run(src: str, dst: str) -> None:
        save_proto(onnxscript.optimizer.optimize(onnx.load(src)), dst)

    return run


def setup_ort_basic(ctx: dict):
    """onnxruntime's offline optimizer at the basic level (its transpose optimizer, constant folding)."""
    return setup_ort_extended(ctx, level="ORT_ENABLE_BASIC")


def setup_ort_extended(ctx: dict, level: str = "ORT_ENABLE_EXTENDED"):
    import onnxruntime as ort

    def run(src: str, dst: str) -> None:
        so = ort.SessionOptions()
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        so.optimized_model_filepath = dst
        so.log_severity_level = 3
        if _big(src):
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                        Path(dst).name + ".data")
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])

    return run


def setup_ort_transformers(ctx: dict):
    import logging

    from onnxruntime.transformers.optimizer import optimize_model

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    mtype = ctx.get("model_type") or model_type(ctx.get("model", ""))

    def run(src: str, dst: str) -> dict:
        model = optimize_model(src, model_type=mtype, num_heads=0, hidden_size=0)
        model.save_model_to_file(dst, use_external_data_format=_big(src))
        return {"model_type": mtype}

    return run


_LOAD_SAVE = "`onnx.load(src)` + {call} + `onnx.save(dst)`"

TOOLS: list[Tool] = [
    Tool("onnxopt", "_peers:setup_onnxopt", "onnxopt",
         "`onnxopt.optimize(src, output=dst, return_report=True)` (load, checker, rewrite, save)"),
    Tool("onnxopt-exact", "_peers:setup_onnxopt_exact", "onnxopt",
         "`onnxopt.optimize(src, output=dst, exact=True, return_report=True)`: only rewrites that keep every output "
         "bit-identical on onnxruntime's CPU provider with its default settings"),
    Tool("onnxsim", "_peers:setup_onnxsim", "onnxsim",
         _LOAD_SAVE.format(call="`onnxsim.simplify(model)` (defaults; the returned check flag must be true)")),
    Tool("onnxslim", "_peers:setup_onnxslim", "onnxslim", _LOAD_SAVE.format(call="`onnxslim.slim(model)`")),
    Tool("onnxoptimizer", "_peers:setup_onnxoptimizer", "onnxoptimizer",
         _LOAD_SAVE.format(call="`onnxoptimizer.optimize(model)` (its default fuse-and-elimination passes)")),
    Tool("onnxscript", "_peers:setup_onnxscript", "onnxscript",
         _LOAD_SAVE.format(call="`onnxscript.optimizer.optimize(model)` (defaults)")),
    Tool("ort-extended", "_peers:setup_ort_extended", "onnxruntime",
         "`onnxruntime.InferenceSession(src, so, providers=['CPUExecutionProvider'])` with "
         "`so.graph_optimization_level = ORT_ENABLE_EXTENDED` and `so.optimized_model_filepath = dst` "
         "(load, optimize, save, and the session's own initialization)"),
    Tool("ort-transformers", "_peers:setup_ort_transformers", "onnxruntime",
         "`onnxruntime.transformers.optimizer.optimize_model(src, model_type=..., num_heads=0, hidden_size=0)` "
         "(default opt_level: 1 for bert/gpt2, i.e. onnxruntime basic level then its Python fusions) + "
         "`.save_model_to_file(dst)`; model_type `gpt2` for GPT-2 models, `bert` otherwise (MiniLM is BERT)",
         families=("transformer",)),
]


def get_tool(name: str) -> Tool:
    for tool in TOOLS:
        if tool.name == name:
            return tool
    raise KeyError(f"no tool named {name!r}; known: {', '.join(t.name for t in TOOLS)}")


def load_setup(tool_target: str, pythonpath: str | None = None):
    if pythonpath and pythonpath not in sys.path:
        sys.path.insert(0, pythonpath)
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    module, _, func = tool_target.partition(":")
    return getattr(importlib.import_module(module), func)


__all__ = ["TOOLS", "Tool", "get_tool", "load_setup", "model_type", "save_proto"]

