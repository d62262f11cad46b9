"""The tools scripts/bench/peers.py compares, each called the way its documentation shows a user.

A tool is a ``Tool`` whose ``target`` names a ``setup(ctx)`` function ("module:function").
``setup`` does the imports (not timed) and returns ``run(src, dst)``, which reads the model file
``src``, optimizes it and writes ``dst``; peers.py times that call, in a subprocess of its own.
``run`` may return a dict of extra facts for the JSON report (computed inside the timed region,
so keep it cheap).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path

from scripts.bench import _optimum  # optimum's environment (standard library only at load)
from scripts.bench._peerlog import PeerLog

TWO_GB = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    target: str  # "module:function"; function(ctx) -> run(src, dst) -> dict | None
    package: str  # distribution whose version BENCHMARKS.md reports
    timed: str  # what the timed region holds, for BENCHMARKS.md
    families: tuple[str, ...] | None = None  # only models of these families (None: all)
    pythonpath: str | None = None  # a folder the target's module is found in (tests' fake tools)

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


def attention_params(model_name: str) -> dict:
    """{"num_heads", "hidden_size"} of a zoo transformer (bert-*, gpt2-*, minilm-*) from the transformers
    config it is built with, as onnxruntime's transformers optimizer asks its users to give them;
    {} for a model of no known config."""
    kind = model_name.split("-")[0].lower()
    if kind not in ("bert", "gpt2", "minilm"):
        return {}
    from onnxopt.models import transformers_models

    return transformers_models.attention_dims(kind)


def transformers_config(model_name: str, config: dict | None = None) -> dict:
    """The transformers config (a config.json's entries, ``model_type`` included) a zoo transformer
    (bert-*, gpt2-*, minilm-*) or a target-benchmark one (bert-base-*, gpt2-small-*, gpt2-past-*, llama-*;
    ``config`` overriding its entries, e.g. the tiny configs) is built with: what optimum's ORTOptimizer
    reads from a model directory. {} for a model of no known config."""
    from onnxopt.models import transformers_models as tm

    name = model_name.lower()
    bench_kind = next((k for k in tm.BENCH_KINDS if name.startswith(k + "-")), None)
    kind = name.split("-")[0]
    if bench_kind:
        cfg = tm.bench_config(bench_kind, config)
        kind = bench_kind.split("-")[0]
    elif kind == "minilm":
        cfg = json.loads((tm.minilm_dir_if_present() / "config.json").read_text())
    elif kind in ("bert", "gpt2"):
        cfg = dict(tm.BERT_CONFIG if kind == "bert" else tm.GPT2_CONFIG)
    else:
        return {}
    model_type = {"bert": "bert", "minilm": "bert", "gpt2": "gpt2", "llama": "llama"}[kind]
    return {**cfg, "model_type": model_type}


# ---------------------------------------------------------------------------------------------
# What a peer logs while it runs (peers.py's optimize job captures it): a failure caused by the way
# the peer was called is a configuration failure, never a result of the peer.

# Messages a peer logs when it was called without a parameter it needs or with a wrong one
CONFIG_FAILURES = (
    # onnxruntime.transformers (fusion_attention.py, optimizer.py)
    r"Failed to detect num_heads and hidden_size",
    r"Please specify parameters of num_heads and hidden_size",
    r"--num_heads is \d+\. Detected value is",
    r"--hidden_size is \d+\. Detected value is",
    r"Input hidden size \(\d+\) is not same as weight matrix dimension",
    r"Unsupported model type: .* for (graph fusion|optimization)",
    r"Model producer not matched",
    r"There is no gpu for onnxruntime to do optimization",
    r"Please specify a positive value for opt_level",
    r"use_gpu=False might cause extra Cast nodes",
    # optimum's ORTOptimizer (optimum-onnx: optimization.py, configuration.py, utils.py) and the
    # transformers config it reads from the model directory (scripts/bench/_optimum.py writes it)
    r"Overriding for_gpu=False to for_gpu=True as half precision is available only on GPU",
    r"Tried to use ORTOptimizer for the model type .*, but it is not available yet",
    r"model type is not supported yet\. Only .* are supported",
    r"ONNX Runtime doesn't support the graph optimization of .* yet",
    r"The local directory does not contain the configuration file",
    r"Unrecognized model in .*Should have a `model_type` key",
    r"optimum-onnx's environment is absent",
    r"ONNXOPT_OPTIMUM_SITE=.* holds no optimum-onnx",
)


def config_failures(lines) -> list[str]:
    """The lines of a peer's log that say it was called wrongly (``CONFIG_FAILURES``), each once."""
    import re

    pat = re.compile("|".join(CONFIG_FAILURES))
    out: list[str] = []
    for line in lines:
        if pat.search(line) and line not in out:
            out.append(line)
    return out


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
        so.log_severity_level = 2  # its warnings reach the bench's log of the peer (bench.run_job)
        if _big(src):
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                        Path(dst).name + ".data")
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])

    return run


def ort_transformers_kwargs(ctx: dict) -> dict:
    """The arguments of ``onnxruntime.transformers.optimizer.optimize_model`` its documentation asks of a
    user: model_type, num_heads and hidden_size from the model's config (ctx, else the zoo's config of
    ``ctx["model"]``), opt_level (ctx; None: the optimizer's default for the model type), use_gpu."""
    params = {k: ctx[k] for k in ("num_heads", "hidden_size") if ctx.get(k)}
    if len(params) < 2:
        params = attention_params(ctx.get("model", ""))
    return {"model_type": ctx.get("model_type") or model_type(ctx.get("model", "")),
            "num_heads": int(params.get("num_heads", 0)), "hidden_size": int(params.get("hidden_size", 0)),
            "opt_level": ctx.get("opt_level"), "use_gpu": bool(ctx.get("use_gpu", ctx.get("provider") == "cuda"))}


def ort_transformers_info(model, kwargs: dict) -> dict:
    """The fusion counts of an optimize_model result and, for a transformer whose attention it left
    unfused, a note saying so (the pattern is not one it supports; its row stays)."""
    stats = getattr(model, "get_fused_operator_statistics", lambda: {})()
    fused = {k: v for k, v in stats.items() if v}
    info = {"config": {k: v for k, v in kwargs.items()}, "fused": fused}
    if kwargs.get("opt_level") is None:  # the optimizer's default for the model type, named in the report
        from onnxruntime.transformers.optimizer import MODEL_TYPES

        info["default_opt_level"] = MODEL_TYPES.get(kwargs["model_type"], (None, None, None))[2]
    attn = sum(v for k, v in fused.items() if "Attention" in k)
    if not attn:
        info["note"] = (f"attention not fused: onnxruntime's transformers optimizer (model_type {kwargs['model_type']}, "
                        f"num_heads {kwargs['num_heads']}, hidden_size {kwargs['hidden_size']}) does not match this "
                        "export's attention")
    return info


def setup_ort_transformers(ctx: dict):
    from onnxruntime.transformers.optimizer import optimize_model

    kwargs = ort_transformers_kwargs(ctx)

    def run(src: str, dst: str) -> dict:
        model = optimize_model(src, **kwargs)
        if isinstance(model, str):  # it returns its input when it cannot run (use_gpu without a GPU)
            raise RuntimeError(f"optimize_model did not optimize ({', '.join(f'{k}={v}' for k, v in kwargs.items())})")
        model.save_model_to_file(dst, use_external_data_format=_big(src))
        return {"model_type": kwargs["model_type"], **ort_transformers_info(model, kwargs)}

    return run


def optimum_info(info: dict, ctx: dict) -> dict:
    """An ORTOptimizer result's facts, with a note when it fused no attention (as ort_transformers_info)."""
    fused = info.get("fused") or {}
    if not sum(v for k, v in fused.items() if "Attention" in k):
        info["note"] = (f"attention not fused: optimum's ORTOptimizer {info.get('level')} (model_type "
                        f"{ctx.get('config_model_type', '?')}, via onnxruntime's transformers optimizer) does not "
                        "match this export's attention")
    return info


def setup_optimum(ctx: dict):
    """optimum's ORTOptimizer, in its own environment (scripts/bench/_optimum.py): a model directory with
    the model's transformers config, ``ORTOptimizer.from_pretrained(dir)``, ``.optimize(save_dir=...,
    optimization_config=AutoOptimizationConfig.<level>(for_gpu=<cuda>))``; ctx: model, optimum_level
    (O1-O4), use_gpu or provider, config (entries overriding the model's transformers config)."""
    level = ctx.get("optimum_level", "O2")
    for_gpu = bool(ctx.get("use_gpu", ctx.get("provider") == "cuda"))
    config = transformers_config(ctx.get("model", ""), ctx.get("config"))
    if not config:
        raise ValueError(f"no transformers config known for model {ctx.get('model')!r}")
    _optimum.environment()  # absent: OptimumUnavailable with the reason, before anything is timed

    def run(src: str, dst: str) -> dict:
        info = _optimum.optimize(src, dst, config, level=level, for_gpu=for_gpu)
        return optimum_info(info, {"config_model_type": config["model_type"]})

    return run


def setup_ort_transformers_level(ctx: dict, opt_level: int):
    return setup_ort_transformers({**ctx, "opt_level": opt_level})


def setup_ort_transformers_o0(ctx: dict):
    return setup_ort_transformers_level(ctx, 0)


def setup_ort_transformers_o2(ctx: dict):
    return setup_ort_transformers_level(ctx, 2)


def setup_ort_transformers_o99(ctx: dict):
    return setup_ort_transformers_level(ctx, 99)


def setup_optimum_o2(ctx: dict):
    return setup_optimum({**ctx, "optimum_level": "O2"})


def setup_optimum_o3(ctx: dict):
    return setup_optimum({**ctx, "optimum_level": "O3"})


_LOAD_SAVE = "`onnx.load(src)` + {call} + `onnx.save(dst)`"
_OPTIMUM = ("optimum-onnx's `ORTOptimizer.from_pretrained(d)` on a folder `d` with the model's transformers config "
            "(config.json) and model.onnx, then `.optimize(save_dir=..., optimization_config=AutoOptimizationConfig"
            ".{level}(for_gpu=<cuda>))`, in optimum's own environment (scripts/bench/_optimum.py; its process "
            "start and imports are in the timed region)")

TOOLS: list[Tool] = [
    Tool("onnxopt", "scripts.bench._peers:setup_onnxopt", "onnxopt",
         "`onnxopt.optimize(src, output=dst, return_report=True)` (load, checker, rewrite, save)"),
    Tool("onnxopt-exact", "scripts.bench._peers:setup_onnxopt_exact", "onnxopt",
         "`onnxopt.optimize(src, output=dst, exact=True, return_report=True)`: only rewrites that keep every output "
         "bit-identical on onnxruntime's CPU provider with its default settings"),
    Tool("onnxsim", "scripts.bench._peers:setup_onnxsim", "onnxsim",
         _LOAD_SAVE.format(call="`onnxsim.simplify(model)` (defaults; the returned check flag must be true)")),
    Tool("onnxslim", "scripts.bench._peers:setup_onnxslim", "onnxslim",
         _LOAD_SAVE.format(call="`onnxslim.slim(model)`")),
    Tool("onnxoptimizer", "scripts.bench._peers:setup_onnxoptimizer", "onnxoptimizer",
         _LOAD_SAVE.format(call="`onnxoptimizer.optimize(model)` (its default fuse-and-elimination passes)")),
    Tool("onnxscript", "scripts.bench._peers:setup_onnxscript", "onnxscript",
         _LOAD_SAVE.format(call="`onnxscript.optimizer.optimize(model)` (defaults)")),
    Tool("ort-extended", "scripts.bench._peers:setup_ort_extended", "onnxruntime",
         "`onnxruntime.InferenceSession(src, so, providers=['CPUExecutionProvider'])` with "
         "`so.graph_optimization_level = ORT_ENABLE_EXTENDED` and `so.optimized_model_filepath = dst` "
         "(load, optimize, save, and the session's own initialization)"),
    Tool("ort-transformers", "scripts.bench._peers:setup_ort_transformers", "onnxruntime",
         "`onnxruntime.transformers.optimizer.optimize_model(src, model_type=..., num_heads=N, hidden_size=H)` "
         "with N and H from the model's transformers config, as its documentation asks (default opt_level: 1 for "
         "bert/gpt2, i.e. onnxruntime basic level then its Python fusions) + `.save_model_to_file(dst)`; "
         "model_type `gpt2` for GPT-2 models, `bert` otherwise (MiniLM is BERT)",
         families=("transformer",)),
    Tool("ort-transformers-o0", "scripts.bench._peers:setup_ort_transformers_o0", "onnxruntime",
         "the same with `opt_level=0` (its Python fusions only)", families=("transformer",)),
    Tool("ort-transformers-o2", "scripts.bench._peers:setup_ort_transformers_o2", "onnxruntime",
         "the same with `opt_level=2` (onnxruntime's extended level first)", families=("transformer",)),
    Tool("ort-transformers-o99", "scripts.bench._peers:setup_ort_transformers_o99", "onnxruntime",
         "the same with `opt_level=99` (onnxruntime's all level first: layout transforms for this machine)",
         families=("transformer",)),
    Tool("optimum-o2", "scripts.bench._peers:setup_optimum_o2", "optimum-onnx", _OPTIMUM.format(level="O2"),
         families=("transformer",)),
    Tool("optimum-o3", "scripts.bench._peers:setup_optimum_o3", "optimum-onnx",
         _OPTIMUM.format(level="O3") + " (O2 with the tanh Gelu approximation)", families=("transformer",)),
]


def get_tool(name: str) -> Tool:
    for tool in TOOLS:
        if tool.name == name:
            return tool
    raise KeyError(f"no tool named {name!r}; known: {', '.join(t.name for t in TOOLS)}")


def load_setup(tool_target: str, pythonpath: str | None = None):
    """The function a "module:function" target names; the module is looked up in the folder
    ``pythonpath`` first when given (tests' fake tools), else imported (``scripts.bench._peers``, ...)."""
    module, _, func = tool_target.partition(":")
    spec = importlib.machinery.PathFinder.find_spec(module, [pythonpath]) if pythonpath else None
    if spec is None:
        return getattr(importlib.import_module(module), func)
    if module not in sys.modules:
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    return getattr(sys.modules[module], func)


__all__ = ["CONFIG_FAILURES", "PeerLog", "TOOLS", "Tool", "attention_params", "config_failures", "get_tool",
           "load_setup", "model_type", "ort_transformers_kwargs", "save_proto", "setup_optimum", "transformers_config"]

