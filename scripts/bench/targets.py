"""Target benchmark (issue 15): onnxopt for onnxruntime's CPU or CUDA provider against the peers
people use there, every tool in one interleaved run on one machine.

    python -m scripts.bench.targets --target ort-cuda|ort-cpu [--models NAME ... | --set core|full]
        [--part N/M] [--batches 1,8] [--precisions fp32,fp16] [--tools T ...] [--runs N] [--warmup N]
        [--provider-option [cuda:]KEY=VALUE ...] [--cache DIR] [--work DIR] [--jobs N] [--deadline S]
        [--json OUT.json] [--markdown OUT.md] [--tiny]
    python -m scripts.bench.targets --merge a.json b.json ... -o all.json [--markdown OUT.md]
    python -m scripts.bench.targets --list [--part N/M] [--set core|full]

Models (``MODELS``): BERT-base and GPT-2 small (transformers configs, random weights, eager and sdpa
attention, legacy and dynamo exporters; ``onnxopt.models.transformers_models.export_bench``), GPT-2
one decode step with 128 past keys/values, a small Llama-style model (RMSNorm, rotary, GQA), MiniLM
(the zoo's, real weights), resnet50 and mobilenet_v2 (exported at each batch: the zoo's are batch 1),
PP-OCRv4 det. Each is built into ``<cache>/bench/`` (the time it took is reported) unless there.

Tools (``TOOLS``), each at fp32 and fp16 (``--precisions``):

- ``original``: the exported model (fp32; the reference and the baseline of every ratio);
- ``onnxopt``: ``onnxopt.optimize(src, output=dst, target=T)``; fp16 with ``precision="fp16"``;
- ``onnxopt-fixed``: the same with ``input_shapes`` fixed to the batch measured (one model per batch);
- ``ort-transformers`` (transformers): ``onnxruntime.transformers.optimizer.optimize_model(src,
  model_type=bert|gpt2, num_heads=N, hidden_size=H, use_gpu=<cuda>)`` with N and H from the model's
  transformers config (its documentation asks them of a user) at its default opt_level (1 for bert and gpt2);
  ``ort-transformers-o0``, ``-o2``, ``-o99`` the same at ``opt_level=0``, 2, 99; fp16 by
  ``.convert_float_to_float16(keep_io_types=True)``; each configuration is a peer of its own, so the best of
  them counts;
- ``optimum-o2``, ``-o3`` (fp32), ``optimum-o4`` (fp16, CUDA only: optimum offers it for GPUs only)
  (transformers): optimum-onnx's ``ORTOptimizer.from_pretrained(dir)`` (config.json: the model's
  transformers config; model.onnx) and ``.optimize(save_dir, AutoOptimizationConfig.O<n>(for_gpu=<cuda>))``,
  in optimum's own environment (its transformers pin conflicts with ours; ``scripts/bench/_optimum.py``);
- ``onnxscript-ort`` (transformers): ``onnxscript.rewriter.ort_fusions.optimize_for_ort(ir.load(src))``;
  fp16 by onnxruntime's ``float16.convert_float_to_float16(keep_io_types=True)`` afterwards (onnxscript
  has no converter of its own);
- ``ort-extended`` (vision, OCR): onnxruntime's offline optimizer (``ORT_ENABLE_EXTENDED``, the target's
  provider, ``optimized_model_filepath``); fp16: onnxruntime's float16 converter first.

Measured, per model, batch and set of provider options (``--option-sets``; the same for every tool):
kernels per run by provider and Memcpy nodes (onnxruntime's profiler, ``onnxopt.verify.count_kernels``);
latency: one session per tool, all timed in interleaved rounds (median, p10, p90); fidelity against the
fp32 original on the same provider (CUDA without TF32 for these comparisons; latency with the
provider's defaults; a float16 model on the CPU in float16 arithmetic, as onnxruntime's CPU provider
computes many float16 ops in float32): per output cosine, max abs error / the output's range, next-token top-1
agreement for logits (real tokens only), against the bounds of issue 15 (fp16: cosine >= 0.999, error
<= 1% of the range, top-1 >= 99%; fp32: cosine >= 0.9999, error <= 0.1% of the range, top-1 >= 99%).

Every tool call, evaluation and latency run is a subprocess with a timeout (``bench.run_job``): a tool
that fails on a model is a row with its one-line error, never a crash. What a peer logs while it runs
is kept (``variants[v]["log"]``); a line saying it was called wrongly (``_peers.CONFIG_FAILURES``, e.g.
"Failed to detect num_heads and hidden_size") is a ``config_failures`` entry, marked in every table, and
the run exits 3 after writing its JSON (a peer called wrongly is a bug of this benchmark; ``--merge``
then writes nothing into the ``--into`` documents). A peer that does not support a model's pattern (the transformers optimizer on these GPT-2 exports'
attention) keeps its row with a note saying so.

On the GPU machine, one part per command: ``bash scripts/gpu/targets.sh N/M`` (installs the carried
onnxruntime-gpu; ``--jobs 6``: tools and evaluations run side by side, latency alone; no model started
after ``--deadline``; the JSON is rewritten after each model). ``--list --part N/M`` shows a part's models;
``--set full`` adds the other attention/exporter combinations and minilm-dynamo.

JSON: ``runs`` (date, command, machine, GPU, versions, options) and ``models[name]``: ``build`` (seconds per
file, or cached), ``variants["tool/precision"]`` (status or one-line error, optimize seconds, nodes, op
types, the tool's fusion counts), ``measurements["batch|options"]["rows"][variant]`` (kernels,
by_provider, memcpy, latency median/p10/p90 with x_original and x_best_peer, fidelity), ``best_peer``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np

from onnxopt.verify import count_kernels
from onnxopt.verify.runtime import PROVIDERS
from scripts.bench import _peers as peers  # save_proto, model_type, load_setup
from scripts.bench import peers as bench  # the peer benchmark: subprocess jobs, node counts, machine facts

ORIGINAL = "original"
PRECISIONS = ("fp32", "fp16")
TARGET_PROVIDER = {"ort-cpu": "cpu", "ort-cuda": "cuda"}
BOUNDS = {  # fidelity against the fp32 original: min cosine, max |error| / range, min top-1 agreement
    "fp16": {"cosine": 0.999, "err_range": 0.01, "top1": 0.99},
    "fp32": {"cosine": 0.9999, "err_range": 0.001, "top1": 0.99},
}
SEQ = 128
MAX_IR_VERSION = 13


# ---------------------------------------------------------------------------------------------
# Models


@dataclasses.dataclass(frozen=True)
class BenchModel:
    name: str
    family: str  # "encoder" | "decoder" | "vision" | "ocr"
    description: str
    build: Callable[[Path, int | None, bool], None]  # (path, batch (fixed_batch models) or None, tiny)
    feeds: Callable[[int, int, bool], dict]  # (batch, seed, tiny) -> {input: array}
    batches: tuple[int, ...]
    fixed_batch: bool = False  # exported at each batch (the model has no batch axis)
    model_type: str | None = None  # onnxruntime.transformers model_type; None: not a transformer
    weight: float = 1.0  # relative cost on the GPU, for --part
    sets: tuple[str, ...] = ("full",)  # "core", "full", "zoo"; () for test-only models
    kind: str | None = None  # transformers_models.BENCH_KINDS entry (--tiny uses TINY[kind])
    attention: Callable[[bool], dict] | None = None  # (tiny) -> {"num_heads", "hidden_size"} of its config

    @property
    def transformer(self) -> bool:
        return self.family in ("encoder", "decoder")


TINY = {  # --tiny: the same architectures, small enough to build and measure in seconds on a CPU
    "bert-base": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=256),
    "gpt2-small": dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, bos_token_id=511, eos_token_id=511),
    "gpt2-past": dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, bos_token_id=511, eos_token_id=511),
    "llama": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
}
TINY_SEQ, TINY_PAST = 16, 16


def _tm():
    from onnxopt.models import transformers_models

    return transformers_models


def _transformer(kind: str, attn: str, exporter: str, weight: float, sets: tuple[str, ...]) -> BenchModel:
    tm = _tm()

    def build(path: Path, batch, tiny: bool) -> None:
        tm.export_bench(kind, path, exporter, attn=attn, config=TINY[kind] if tiny else None)

    def feeds(batch: int, seed: int, tiny: bool) -> dict:
        cfg = TINY[kind] if tiny else None
        return tm.bench_feeds(kind, batch, TINY_SEQ if tiny else SEQ, seed=seed, config=cfg,
                              past=TINY_PAST if tiny else tm.PAST_LENGTH)

    what = {"bert-base": "BertModel, bert-base-uncased config (768 wide, 12 layers, 12 heads)",
            "gpt2-small": "GPT2LMHeadModel, GPT-2 small config (768 wide, 12 layers, 12 heads), no KV cache",
            "gpt2-past": f"GPT2LMHeadModel, GPT-2 small config, one decode step: 1 new token after "
                         f"{tm.PAST_LENGTH} past keys/values (inputs), presents as outputs",
            "llama": "LlamaForCausalLM, small Llama-style config (RMSNorm, rotary, SwiGLU; 4 layers, 512 wide, "
                     "8 heads, 4 KV heads), no KV cache"}[kind]
    shape = f"past {tm.PAST_LENGTH}, 1 new token" if kind == "gpt2-past" else f"sequence {SEQ}, rows padded"
    return BenchModel(
        f"{kind}-{attn}-{exporter}", "decoder" if kind != "bert-base" else "encoder",
        f"transformers {what}, random weights, {attn} attention, {exporter} exporter; {shape}",
        build, feeds, (1, 8), model_type="bert" if kind == "bert-base" else "gpt2", weight=weight, sets=sets,
        kind=kind, attention=lambda tiny: tm.attention_dims(kind, TINY[kind] if tiny else None))


def _link(src: Path, dst: Path) -> None:
    """``dst`` the same file as the zoo's ``src`` (a hard link, else a copy)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _zoo_text(name: str, weight: float, sets) -> BenchModel:
    """A transformer of the zoo (minilm: real weights; bert, gpt2: its small configs)."""
    kind = name.rsplit("-", 1)[0]

    def build(path: Path, batch, tiny: bool) -> None:
        from onnxopt.models import zoo

        where = zoo.build([name], cache=path.parent.parent, log=lambda s: None)[name]
        if not isinstance(where, Path):
            raise RuntimeError(f"zoo {name}: {where}")
        _link(where, path)

    def feeds(batch: int, seed: int, tiny: bool) -> dict:
        from onnxopt.models.inputs import text_feeds

        tm = _tm()
        if kind == "minilm":
            return text_feeds(tm.INPUT_NAMES["minilm"], batch, SEQ, tm.MINILM_VOCAB, seed=seed, low=999, cls_id=101,
                              sep_id=102)
        pad = tm.GPT2_CONFIG["eos_token_id"] if kind == "gpt2" else 0
        return text_feeds(tm.INPUT_NAMES[kind], batch, SEQ, tm.VOCAB_SIZE[kind], seed=seed, pad_id=pad)

    from onnxopt.models import zoo

    what = ("all-MiniLM-L6-v2, real weights" if kind == "minilm" else zoo.get(name).description.split(", legacy")[0]
            .split(", dynamo")[0])
    return BenchModel(name, "decoder" if kind == "gpt2" else "encoder", f"{what} (the zoo's {name}); sequence {SEQ}",
                      build, feeds, (1, 8), model_type="gpt2" if kind == "gpt2" else "bert", weight=weight, sets=sets,
                      attention=lambda tiny: _tm().attention_dims(kind, cache=None))


def _vision(net: str, batches, weight: float, sets) -> BenchModel:
    def build(path: Path, batch, tiny: bool) -> None:
        from onnxopt.models import torchvision_models

        torchvision_models.export(net, path, exporter="legacy", batch=batch, cache=path.parent.parent)
        _tm().cap_ir_version(path)

    def feeds(batch: int, seed: int, tiny: bool) -> dict:
        from onnxopt.models.inputs import photo

        return {"input": np.stack([photo(seed + i) for i in range(batch)])}

    return BenchModel(f"{net}-legacy", "vision", f"torchvision {net} (the zoo's builder: random weights, BN statistics "
                      "from photographs), legacy exporter, exported at each batch; photographs",
                      build, feeds, batches, fixed_batch=True, weight=weight, sets=sets)


def _ppocr(weight: float, sets) -> BenchModel:
    def build(path: Path, batch, tiny: bool) -> None:
        from onnxopt.models import zoo

        where = zoo.build(["ppocrv4-det"], cache=path.parent.parent, log=lambda s: None)["ppocrv4-det"]
        if not isinstance(where, Path):
            raise RuntimeError(f"zoo ppocrv4-det: {where}")
        _link(where, path)

    def feeds(batch: int, seed: int, tiny: bool) -> dict:
        from onnxopt.models.inputs import ocr_feeds

        return ocr_feeds("ppocrv4-det", "x", seed, batch=batch)

    return BenchModel("ppocrv4-det", "ocr", "PP-OCRv4 text detection (rapidocr-onnxruntime 1.4.4, the zoo's), "
                      "printed pages 736x736", build, feeds, (1, 4), weight=weight, sets=sets)


def _tiny_conv() -> BenchModel:
    """A small Conv/BatchNormalization/Relu network with a batch axis (tests)."""

    def build(path: Path, batch, tiny: bool) -> None:
        import onnx
        from onnx import TensorProto, helper, numpy_helper

        rng = np.random.default_rng(0)
        inits, nodes, x = [], [], "input"
        for i, (cin, cout) in enumerate([(3, 8), (8, 8)]):
            w = numpy_helper.from_array((rng.standard_normal((cout, cin, 3, 3)) * 0.3).astype(np.float32), f"w{i}")
            bn = [numpy_helper.from_array(v.astype(np.float32), f"bn{i}_{k}") for k, v in
                  enumerate([rng.uniform(0.5, 1.5, cout), rng.standard_normal(cout) * 0.1,
                             rng.standard_normal(cout) * 0.1, rng.uniform(0.5, 1.5, cout)])]
            inits += [w] + bn
            nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                      helper.make_node("BatchNormalization", [f"c{i}"] + [t.name for t in bn], [f"b{i}"]),
                      helper.make_node("Relu", [f"b{i}"], [f"r{i}"])]
            x = f"r{i}"
        nodes.append(helper.make_node("GlobalAveragePool", [x], ["pool"]))
        nodes.append(helper.make_node("Flatten", ["pool"], ["logits"]))
        g = helper.make_graph(nodes, "tinyconv",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 16, 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 8])], inits)
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))

    def feeds(batch: int, seed: int, tiny: bool) -> dict:
        return {"input": np.random.default_rng(seed).standard_normal((batch, 3, 16, 16)).astype(np.float32)}

    return BenchModel("tinyconv", "vision", "Conv/BN/Relu x2 + pool, 16x16, random weights (tests)", build, feeds,
                      (1, 4), weight=0.1, sets=())


# Seconds a transformer took on the GPU (H200, the CUDA transformer table of 2026-11-27, 11 rows per model:
# scripts/results/targets/cuda-transformers.json), by kind and exporter: --part's weights are these / 30
# (the vision and OCR models' weights are on the same scale, from earlier runs)
GPU_SECONDS = {("bert-base", "legacy"): 81, ("bert-base", "dynamo"): 86, ("gpt2-small", "legacy"): 130,
               ("gpt2-small", "dynamo"): 162, ("gpt2-past", "legacy"): 141, ("gpt2-past", "dynamo"): 128,
               ("llama", "legacy"): 86, ("llama", "dynamo"): 80, ("minilm", "legacy"): 53}


def _models() -> list[BenchModel]:
    core, full = ("core", "full"), ("full",)
    out = []
    # (kind, attn, exporter): in the core set, eager attention with the legacy exporter (the table)
    # and sdpa with the dynamo exporter; the full set adds the other two combinations
    for kind in ("bert-base", "gpt2-small", "gpt2-past"):
        for attn, exporter in (("eager", "legacy"), ("sdpa", "dynamo"), ("sdpa", "legacy"), ("eager", "dynamo")):
            sets = core if (attn, exporter) in (("eager", "legacy"), ("sdpa", "dynamo")) else full
            out.append(_transformer(kind, attn, exporter, GPU_SECONDS[kind, exporter] / 30, sets))
    for attn, exporter in (("sdpa", "legacy"), ("sdpa", "dynamo"), ("eager", "legacy"), ("eager", "dynamo")):
        sets = core if attn == "sdpa" else full
        out.append(_transformer("llama", attn, exporter, GPU_SECONDS["llama", exporter] / 30, sets))
    zoo_set = ("zoo",)
    for name in ("bert-legacy", "bert-dynamo", "gpt2-legacy", "gpt2-dynamo"):
        out.append(_zoo_text(name, 0.5, zoo_set))
    out.append(_zoo_text("minilm-legacy", GPU_SECONDS["minilm", "legacy"] / 30, core + zoo_set))
    out.append(_zoo_text("minilm-dynamo", GPU_SECONDS["minilm", "legacy"] / 30, full + zoo_set))
    out.append(_vision("resnet50", (1, 32), 1.5, core + zoo_set))
    out.append(_vision("mobilenet_v2", (1, 32), 1.0, core + zoo_set))
    out.append(_ppocr(1.0, core + zoo_set))
    out.append(_tiny_conv())
    return out


MODELS: list[BenchModel] = _models()


def get_model(name: str) -> BenchModel:
    for m in MODELS:
        if m.name == name:
            return m
    raise KeyError(f"no benchmark model {name!r}; known: {', '.join(m.name for m in MODELS)}")


def split_parts(models: list[BenchModel], parts: int) -> list[list[BenchModel]]:
    """``models`` in ``parts`` groups of about equal weight (largest first into the lightest group);
    each group runs its lightest model first, so that ``--deadline`` (no model started after it) rarely
    leaves the heaviest one out (the reports are in ``MODELS`` order whatever the run's order)."""
    bins: list[list[BenchModel]] = [[] for _ in range(parts)]
    load = [0.0] * parts
    for m in sorted(models, key=lambda m: -m.weight):
        i = min(range(parts), key=lambda k: (load[k], k))
        bins[i].append(m)
        load[i] += m.weight
    order = {m.name: i for i, m in enumerate(models)}
    return [sorted(b, key=lambda m: (m.weight, order[m.name])) for b in bins]


# ---------------------------------------------------------------------------------------------
# Tools (setup functions run in the subprocess of bench.run_job; see _peers.py)


@dataclasses.dataclass(frozen=True)
class BTool:
    name: str
    target: str  # "module:function" for _peers.load_setup
    doc: str
    families: tuple[str, ...] | None = None
    per_batch: bool = False  # optimized once per batch, with the inputs' shapes fixed
    peer: bool = True  # competes as "best peer"
    config: tuple[tuple[str, object], ...] = ()  # entries added to the setup's ctx (e.g. opt_level)
    precisions: tuple[str, ...] | None = None  # the precisions it makes (None: all; optimum: O4 is its fp16)
    providers: tuple[str, ...] | None = None  # the providers it optimizes for (None: all; O4: CUDA only)

    def applies(self, bm: BenchModel) -> bool:
        if self.per_batch and bm.fixed_batch:  # the model's shapes are fixed already
            return False
        return self.families is None or bm.family in self.families

    def makes(self, precision: str, provider: str) -> bool:
        """Whether this configuration is one its users run for ``precision`` on ``provider``."""
        return (self.precisions is None or precision in self.precisions) and \
            (self.providers is None or provider in self.providers)


def _onnxopt_setup(ctx: dict):
    from onnxopt import optimize

    def run(src: str, dst: str) -> dict:
        kw = {"target": ctx["target"], "output": dst, "return_report": True}
        if ctx.get("input_shapes"):
            kw["input_shapes"] = ctx["input_shapes"]
        if ctx["precision"] != "fp32":
            kw["precision"] = ctx["precision"]
        try:
            _, report = optimize(src, **kw)
        except TypeError as exc:
            if "precision" in str(exc):
                raise RuntimeError("this onnxopt has no optimize(precision=...) (fp16 not there yet)") from None
            raise
        info = {"fired": report.fired}
        skipped = getattr(report, "skipped", None)
        if skipped:
            info["skipped"] = skipped
        return info

    return run


def setup_onnxopt(ctx: dict):
    return _onnxopt_setup(ctx)


def _fp16_proto(proto):
    """onnxruntime's float16 converter as its documentation shows it, I/O types kept."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(proto, keep_io_types=True)


def setup_ort_transformers(ctx: dict):
    """onnxruntime's transformers optimizer with the parameters its documentation asks of a user
    (_peers.ort_transformers_kwargs: model_type, num_heads and hidden_size from the model's config,
    opt_level, use_gpu on CUDA); fp16 by its own converter with the I/O types kept."""
    from onnxruntime.transformers.optimizer import optimize_model

    kwargs = peers.ort_transformers_kwargs({**ctx, "use_gpu": ctx["provider"] == "cuda"})

    def run(src: str, dst: str) -> dict:
        model = optimize_model(src, **kwargs)
        if isinstance(model, str):  # it returns its input when it cannot run (use_gpu without a GPU)
            raise RuntimeError("optimize_model did not optimize (" + ", ".join(f"{k}={v}" for k, v in kwargs.items())
                               + ")")
        if ctx["precision"] == "fp16":
            model.convert_float_to_float16(keep_io_types=True)
        info = peers.ort_transformers_info(model, kwargs)  # the fusions before the fp16 conversion's Casts
        model.save_model_to_file(dst, use_external_data_format=peers._big(src))
        return {"model_type": kwargs["model_type"], **info}

    return run


def fix_shapes_by_onnxsim(src: str, shapes: dict[str, list[int]], dst: str) -> str:
    """``src`` with its input shapes fixed as a user chains onnxsim before a peer:
    ``onnxsim src dst --overwrite-input-shape name:d0,d1 ...``, through its Python API with the same defaults
    (the returned check flag must be true); the model goes out with external data when it is large."""
    import onnx
    import onnxsim

    model, ok = onnxsim.simplify(onnx.load(src), overwrite_input_shapes={k: list(v) for k, v in shapes.items()})
    if not ok:
        raise RuntimeError("onnxsim.simplify(overwrite_input_shapes=...): the simplified model failed its check")
    peers.save_proto(model, dst)
    return dst


def setup_fixed_peer(ctx: dict):
    """A peer given the model with its input shapes fixed by onnxsim's ``--overwrite-input-shape`` to the batch
    measured (``ctx["input_shapes"]``, as onnxopt-fixed gets them), then run as its own row does
    (``ctx["peer_setup"]``, with that row's configuration): what a user with fixed shapes chains."""
    inner = peers.load_setup(ctx["peer_setup"])(ctx)

    def run(src: str, dst: str) -> dict:
        fixed = str(Path(dst).with_name(Path(dst).stem + "-onnxsim.onnx"))
        fix_shapes_by_onnxsim(src, ctx["input_shapes"], fixed)
        info = inner(fixed, dst) or {}
        return {**info, "shapes_fixed_by": "onnxsim --overwrite-input-shape"}

    return run


def setup_optimum(ctx: dict):
    """optimum's ORTOptimizer at ``ctx["optimum_level"]`` (_peers.setup_optimum: its own environment, a model
    directory with the model's transformers config; tiny models get the tiny config), ``for_gpu`` on CUDA.
    Its fp16 is O4's own (TOOLS: O4 only makes fp16, O2/O3 only fp32)."""
    tiny = TINY.get(get_model(ctx["model"]).kind or "") if ctx.get("tiny") else None
    return peers.setup_optimum({**ctx, "use_gpu": ctx["provider"] == "cuda", "config": tiny})


def setup_onnxscript_ort(ctx: dict):
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    def run(src: str, dst: str) -> dict:
        model, counts = optimize_for_ort(ir.load(src))
        if ctx["precision"] == "fp16":
            peers.save_proto(_fp16_proto(ir.to_proto(model)), dst)
        else:
            ir.save(model, dst)
        info = {"fusions": {k: v for k, v in counts.items() if v}}
        if not any(v for k, v in counts.items() if any(w in k for w in ("attention", "sdpa", "mha", "gqa"))):
            info["note"] = "attention not fused: onnxscript's ort_fusions do not match this export's attention"
        return info

    return run


def setup_ort_extended(ctx: dict):
    import onnx
    import onnxruntime as ort

    def run(src: str, dst: str) -> None:
        if ctx["precision"] == "fp16":
            tmp = str(Path(dst).with_suffix(".fp16-in.onnx"))
            peers.save_proto(_fp16_proto(onnx.load(src)), tmp)
            src = tmp
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = dst
        so.log_severity_level = 2  # its warnings reach the bench's log of the peer (bench.run_job)
        names = [PROVIDERS[ctx["provider"]]] + (["CPUExecutionProvider"] if ctx["provider"] != "cpu" else [])
        ort.InferenceSession(src, so, providers=names)

    return run


TOOLS: list[BTool] = [
    BTool("onnxopt", "scripts.bench.targets:setup_onnxopt",
          "`onnxopt.optimize(src, output=dst, target=<target>[, precision=\"fp16\"])`", peer=False),
    BTool("onnxopt-fixed", "scripts.bench.targets:setup_onnxopt",
          "the same with `input_shapes` fixed to the batch measured (one model per batch)", per_batch=True,
          peer=False),
    BTool("ort-transformers", "scripts.bench.targets:setup_ort_transformers",
          "`onnxruntime.transformers.optimizer.optimize_model(src, model_type=bert|gpt2, num_heads=N, hidden_size=H, "
          "use_gpu=<cuda>)` with N, H from the model's transformers config, as its documentation asks (default "
          "opt_level: 1, onnxruntime's basic level then its Python fusions), fp16: "
          "`.convert_float_to_float16(keep_io_types=True)`, `.save_model_to_file(dst)`; model_type gpt2 for the "
          "decoders (it has none for Llama)", families=("encoder", "decoder")),
    BTool("ort-transformers-o0", "scripts.bench.targets:setup_ort_transformers",
          "the same at `opt_level=0` (its Python fusions only, no onnxruntime pass first)",
          families=("encoder", "decoder"), config=(("opt_level", 0),)),
    BTool("ort-transformers-o2", "scripts.bench.targets:setup_ort_transformers",
          "the same at `opt_level=2` (onnxruntime's extended level, on the target's provider with use_gpu, before "
          "its Python fusions)", families=("encoder", "decoder"), config=(("opt_level", 2),)),
    BTool("ort-transformers-o99", "scripts.bench.targets:setup_ort_transformers",
          "the same at `opt_level=99` (onnxruntime's all level on the target's provider first); each opt_level is a "
          "peer of its own, the best of them counts", families=("encoder", "decoder"), config=(("opt_level", 99),)),
    BTool("optimum-o2", "scripts.bench.targets:setup_optimum",
          "optimum-onnx's `ORTOptimizer.from_pretrained(d)` on a folder `d` holding the model's transformers config "
          "(config.json, as the zoo builds it) and model.onnx, `.optimize(save_dir=..., optimization_config="
          "AutoOptimizationConfig.O2(for_gpu=<cuda>))`, run in optimum's own environment (its pins conflict with "
          "ours: scripts/bench/_optimum.py); fp32 only", families=("encoder", "decoder"),
          config=(("optimum_level", "O2"),), precisions=("fp32",)),
    BTool("optimum-o3", "scripts.bench.targets:setup_optimum",
          "the same with `AutoOptimizationConfig.O3(for_gpu=<cuda>)` (O2 with the tanh Gelu approximation); fp32 only",
          families=("encoder", "decoder"), config=(("optimum_level", "O3"),), precisions=("fp32",)),
    BTool("optimum-o4", "scripts.bench.targets:setup_optimum",
          "the same with `AutoOptimizationConfig.O4(for_gpu=True)` (O3 with fp16, I/O kept float32): its fp16, "
          "offered for GPUs only, so a CUDA row only", families=("encoder", "decoder"),
          config=(("optimum_level", "O4"),), precisions=("fp16",), providers=("cuda",)),
    BTool("onnxscript-ort", "scripts.bench.targets:setup_onnxscript_ort",
          "`onnxscript.rewriter.ort_fusions.optimize_for_ort(onnx_ir.load(src))`, `onnx_ir.save`; fp16: onnxruntime's "
          "`float16.convert_float_to_float16(keep_io_types=True)` afterwards", families=("encoder", "decoder")),
    BTool("ort-transformers-fixed", "scripts.bench.targets:setup_fixed_peer",
          "`ort-transformers` on the model whose input shapes onnxsim fixed to the batch measured (`onnxsim src "
          "fixed --overwrite-input-shape ...`, one model per batch): the chain a user with fixed shapes runs; "
          "compared with onnxopt-fixed", families=("encoder", "decoder"), per_batch=True,
          config=(("peer_setup", "scripts.bench.targets:setup_ort_transformers"),)),
    BTool("ort-transformers-o2-fixed", "scripts.bench.targets:setup_fixed_peer",
          "`ort-transformers-o2` on the model whose input shapes onnxsim fixed", families=("encoder", "decoder"),
          per_batch=True, config=(("peer_setup", "scripts.bench.targets:setup_ort_transformers"), ("opt_level", 2))),
    BTool("onnxscript-ort-fixed", "scripts.bench.targets:setup_fixed_peer",
          "`onnxscript-ort` on the model whose input shapes onnxsim fixed", families=("encoder", "decoder"),
          per_batch=True, config=(("peer_setup", "scripts.bench.targets:setup_onnxscript_ort"),)),
    BTool("ort-extended", "scripts.bench.targets:setup_ort_extended",
          "onnxruntime's offline optimizer: a session on the target's provider with `ORT_ENABLE_EXTENDED` and "
          "`optimized_model_filepath=dst`; fp16: onnxruntime's `float16.convert_float_to_float16(keep_io_types=True)` "
          "first", families=("vision", "ocr")),
]


def get_tool(name: str) -> BTool:
    for t in TOOLS:
        if t.name == name:
            return t
    raise KeyError(f"no tool {name!r}; known: {', '.join(t.name for t in TOOLS)}")


# ---------------------------------------------------------------------------------------------
# Sessions, kernels, latency (in subprocesses)


def make_session(model: str, provider: str, options: dict | None = None, *, profile_prefix: str | None = None,
                 exact: bool = False, spin: bool = True, threads: int = 0):
    """An onnxruntime session (onnxopt.verify.runtime.session) with ``options`` for the provider
    (CUDA: also ``use_tf32=0`` when ``exact``, unless ``options`` set it)."""
    from onnxopt.verify.runtime import session

    return session(model, provider, profile_prefix=profile_prefix, exact=exact, spin=spin, threads=threads,
                   provider_options={provider: dict(options)} if options else None)


def _kernels_of_run(events: list[dict], run_index: int) -> dict:
    """count_kernels for the ``run_index``-th model_run of a profile."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    if run_index >= len(runs):
        return count_kernels(events)
    end = runs[run_index]["ts"] + runs[run_index].get("dur", 0)
    return count_kernels([e for e in events if e.get("ts", 0) <= end])


def job_evaluate(job: dict) -> dict:
    """One model: nodes; per option set and batch, kernels of one profiled run; outputs of the first
    option set saved (npz per batch) for the fidelity comparison (a float16 model's on the CPU in
    float16 arithmetic, ``onnxopt.verify.fp16.run_fp16``)."""
    import onnx

    from onnxopt.verify import is_fp16

    proto = onnx.load(job["models"][0][1], load_external_data=False)
    nodes, ops = bench.count_nodes(proto)
    # a float16 model on the CPU: outputs in float16 arithmetic (onnxruntime's CPU provider computes
    # many float16 ops in float32, so overflow would not show; onnxopt.verify.fp16)
    half = job["provider"] == "cpu" and is_fp16(proto)
    del proto
    out: dict = {"nodes": nodes, "op_types": ops, "kernels": {}, "errors": {}}
    # a folder of this job's own: onnxruntime names a profile by prefix and the millisecond, and
    # evaluations run side by side (--jobs) profile models of the same name ("model.onnx")
    prof_dir = tempfile.mkdtemp(prefix="eval-", dir=job["profile_dir"])
    for k, (label, options) in enumerate(job["option_sets"]):
        per_path: dict[str, list] = {}
        for batch, path in job["models"]:
            per_path.setdefault(path, []).append(batch)
        for path, batches in per_path.items():
            prefix = str(Path(prof_dir) / f"{Path(path).stem}-{k}")
            try:
                t0 = time.perf_counter()
                sess = make_session(path, job["provider"], options, profile_prefix=prefix, exact=True)
                init_s = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001
                for b in batches:
                    out["errors"][f"{b}|{label}"] = f"session: {bench.one_line(exc)}"
                continue
            done = []
            for b in batches:
                try:
                    feeds = bench._load_npz(job["inputs"][str(b)])
                    feeds = {i.name: feeds[i.name] for i in sess.get_inputs()}
                    outs = sess.run(None, feeds)
                    outs = sess.run(None, feeds)  # profiled (after one warm-up run)
                    done.append((b, 2 * len(done) + 1))
                    if k == 0:
                        if half:
                            from onnxopt.verify.fp16 import run_fp16

                            (got,), _ = run_fp16(path, [feeds], "cpu")
                            outs = [v for _, v in got]
                        np.savez(job["outputs"][str(b)], __names__=np.array([o.name for o in sess.get_outputs()]),
                                 **{f"out{i}": np.asarray(v) for i, v in enumerate(outs)})
                except Exception as exc:  # noqa: BLE001
                    out["errors"][f"{b}|{label}"] = f"run: {bench.one_line(exc)}"
                    break
            prof = sess.end_profiling()
            with open(prof) as f:
                events = json.load(f)
            os.unlink(prof)
            for b, idx in done:
                out["kernels"][f"{b}|{label}"] = {"session_init_s": round(init_s, 3),
                                                  **_kernels_of_run(events, idx)}
    return out


def job_latency(job: dict) -> dict:
    """Interleaved latency of every (model, option set) entry: one session each, warmed up, then rounds
    that time one run of every session, the order rotated by one per round (as onnxopt.verify's
    measure_latency, with provider options)."""
    feeds_all = bench._load_npz(job["inputs"])
    sessions, feeds, errors, per_run = {}, {}, {}, {}
    spin = False  # idle sessions' thread pools sleep: spinning, they take the cores from the one timed
    for key, path, options in job["entries"]:
        try:
            sess = make_session(path, job["provider"], options, spin=spin, threads=job.get("threads", 0))
            feeds[key] = {i.name: feeds_all[i.name] for i in sess.get_inputs()}
            for _ in range(max(1, job["warmup"])):
                t0 = time.perf_counter()
                sess.run(None, feeds[key])
                per_run[key] = time.perf_counter() - t0
            sessions[key] = sess
        except Exception as exc:  # noqa: BLE001 - one broken model must not stop the others
            errors[key] = bench.one_line(exc)
    names = list(sessions)
    gap = job.get("gap_s", 0.0)
    est = sum(per_run[n] + gap for n in names) or 1e-9
    rounds = max(min(job["runs"], job["min_rounds"]), min(job["runs"], int(job["budget_s"] / est)))
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds if names else 0):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter()
            sessions[name].run(None, feeds[name])
            times[name].append(time.perf_counter() - t0)
    results = {}
    for name, ts in times.items():
        ms = np.array(ts) * 1e3
        results[name] = {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
                         "p90_ms": float(np.percentile(ms, 90)), "min_ms": float(ms.min()),
                         "mean_ms": float(ms.mean()),
                         # round by round (the rows interleave): the ratios' paired bootstrap intervals
                         "samples_ms": [round(float(t), 5) for t in ms]}
    return {"rounds": rounds, "warmup": job["warmup"], "errors": errors, "results": results}


def job_optimize(job: dict) -> dict:
    res = bench._job(job)  # peers.load_setup(target)(ctx) -> run(src, dst), timed
    import onnx

    proto = onnx.load(job["dst"], load_external_data=False)
    if proto.ir_version > MAX_IR_VERSION:  # onnxruntime 1.31 reads IR <= 13; the same for every tool
        del proto
        _tm().cap_ir_version(Path(job["dst"]), MAX_IR_VERSION)
        res.setdefault("info", {})["ir_version_capped"] = MAX_IR_VERSION
    return res


def _job(job: dict) -> dict:
    kind = job["kind"]
    if kind == "optimize":
        return job_optimize(job)
    if kind == "t-evaluate":
        return job_evaluate(job)
    if kind == "t-latency":
        return job_latency(job)
    raise ValueError(f"unknown job kind {kind!r}")


def run_job(job: dict, work: Path, timeout: float) -> dict:
    return bench.run_job(job, work, timeout, module="scripts.bench.targets")


# ---------------------------------------------------------------------------------------------
# Fidelity (in the parent, from saved outputs)


def fidelity(ref: list[tuple[str, np.ndarray]], got: list[tuple[str, np.ndarray]], precision: str,
             mask: np.ndarray | None = None) -> dict:
    """Per output: cosine, max |error|, range of the reference, error / range; top-1 agreement for
    logits (an output named *logits*: argmax over its last axis, real tokens only when ``mask`` has the
    logits' leading shape); the summary against ``BOUNDS[precision]``."""
    bounds = BOUNDS[precision]
    names = dict(got)
    per: dict = {}
    fails = []
    for i, (name, a) in enumerate(ref):
        b = names.get(name, got[i][1] if i < len(got) else None)
        if b is None:
            return {"ok": False, "why": f"output {name} missing", "outputs": per}
        if a.shape != b.shape:
            return {"ok": False, "why": f"output {name}: shape {list(b.shape)} not {list(a.shape)}", "outputs": per}
        if not np.issubdtype(a.dtype, np.floating):
            same = bool(np.array_equal(a, b))
            per[name] = {"equal": same}
            if not same:
                fails.append(f"{name} differs")
            continue
        a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        if not np.isfinite(b64).all():
            per[name] = {"nonfinite": int((~np.isfinite(b64)).sum())}
            fails.append(f"{name} has non-finite values")
            continue
        na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
        cos = float(a64 @ b64 / (na * nb)) if na > 0 and nb > 0 else float(na == nb)
        err = float(np.abs(a64 - b64).max()) if a64.size else 0.0
        rng = float(a64.max() - a64.min()) if a64.size else 0.0
        frac = err / rng if rng > 0 else (0.0 if err == 0 else math.inf)
        entry = {"cosine": cos, "max_abs": err, "range": rng, "err_range": frac}
        if cos < bounds["cosine"]:
            fails.append(f"{name} cosine {cos:.6f}")
        if frac > bounds["err_range"]:
            fails.append(f"{name} error {frac:.2%} of range")
        if "logits" in name and a.ndim >= 2:
            ta, tb = a.argmax(-1), b.argmax(-1)
            sel = np.ones(ta.shape, bool)
            if mask is not None and mask.shape == ta.shape:
                sel = mask.astype(bool)
            top1 = float((ta == tb)[sel].mean()) if sel.any() else 1.0
            entry["top1"] = top1
            if top1 < bounds["top1"]:
                fails.append(f"{name} top-1 {top1:.1%}")
        per[name] = entry
    floats = [v for v in per.values() if "cosine" in v]
    summary = {"ok": not fails, "outputs": per,
               "cosine": min((v["cosine"] for v in floats), default=None),
               "err_range": max((v["err_range"] for v in floats), default=None),
               "top1": min((v["top1"] for v in floats if "top1" in v), default=None)}
    if fails:
        summary["why"] = "; ".join(fails[:4]) + (f" (+{len(fails) - 4})" if len(fails) > 4 else "")
    return summary


def _outputs(path: Path) -> list[tuple[str, np.ndarray]]:
    z = bench._load_npz(str(path))
    names = [str(n) for n in z.pop("__names__")]
    return [(n, z[f"out{i}"]) for i, n in enumerate(names)]


# ---------------------------------------------------------------------------------------------
# One model


@dataclasses.dataclass
class Options:
    target: str = "ort-cpu"
    precisions: tuple[str, ...] = PRECISIONS
    batches: tuple[int, ...] | None = None  # None: each model's own
    option_sets: tuple[tuple[str, dict], ...] = (("default", {}),)
    vision_option_sets: tuple[tuple[str, dict], ...] | None = None  # vision/OCR models (None: option_sets)
    runs: int = 100
    warmup: int = 20
    min_rounds: int = 10
    latency_budget: float = 60.0
    gap: float = 0.0
    threads: int = 0
    timeout: float = 600.0
    jobs: int = 1
    tiny: bool = False
    force: bool = False
    fp32_batches: tuple[int, ...] | None = None  # fp32 rows (the original aside) only at these batches (None: all)

    @property
    def provider(self) -> str:
        return TARGET_PROVIDER[self.target]


def _variant(tool: str, precision: str) -> str:
    return f"{tool}/{precision}"


def row_batches(batches: tuple[int, ...], precision: str, opts: Options) -> tuple[int, ...]:
    """The batches a tool's row of ``precision`` is measured at: all, or for fp32 only ``opts.fp32_batches``
    (the original, every precision's reference, is measured at all)."""
    if precision != "fp32" or opts.fp32_batches is None:
        return batches
    return tuple(b for b in batches if b in opts.fp32_batches)


def build_model(bm: BenchModel, cache: Path, batch: int | None, opts: Options, log) -> tuple[Path, dict]:
    """The model file (built unless in the cache) and {"build_s", "cached"}."""
    stem = bm.name + (f"-b{batch}" if batch is not None else "") + ("-tiny" if opts.tiny else "")
    path = cache / "bench" / f"{stem}.onnx"
    if path.exists() and not opts.force:
        return path, {"cached": True}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{stem}.partial.onnx")
    t0 = time.perf_counter()
    try:
        bm.build(tmp, batch, opts.tiny)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    secs = time.perf_counter() - t0
    log(f"  {bm.name}: built{'' if batch is None else f' at batch {batch}'} in {secs:.1f} s "
        f"({path.stat().st_size / 1e6:.1f} MB)")
    return path, {"cached": False, "build_s": round(secs, 2)}


def bench_one(bm: BenchModel, tools: list[BTool], opts: Options, cache: Path, work: Path, log) -> dict:
    t_start = time.perf_counter()
    work = work / bm.name
    work.mkdir(parents=True, exist_ok=True)
    batches = tuple(opts.batches or bm.batches)
    if opts.tiny:
        batches = tuple(min(b, 4) for b in batches)
        batches = tuple(dict.fromkeys(batches))
    option_sets = list(opts.vision_option_sets or opts.option_sets) if bm.family in ("vision", "ocr") \
        else list(opts.option_sets)
    desc = bm.description
    if opts.tiny and bm.kind in TINY:
        desc = f"TINY config ({', '.join(f'{k}={v}' for k, v in TINY[bm.kind].items())}) of: {desc}"
    res: dict = {"family": bm.family, "description": desc, "batches": list(batches),
                 "option_sets": [{"label": label, "options": o} for label, o in option_sets],
                 "build": {}, "variants": {}, "measurements": {}}

    # 1. the original(s)
    originals: dict[int, Path] = {}
    try:
        for b in (batches if bm.fixed_batch else (None,)):
            path, info = build_model(bm, cache, b, opts, log)
            res["build"][str(b) if b is not None else "all"] = info
            snap = bench.snapshot(path, work / "original" / (f"b{b}" if b is not None else ""))
            for bb in (batches if b is None else (b,)):
                originals[bb] = snap
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"build: {bench.one_line(exc)}"
        log(f"  {bm.name}: build FAILED: {res['error']}")
        return res
    inputs: dict[int, str] = {}
    for b in batches:
        f = work / f"inputs-b{b}.npz"
        np.savez(f, **bm.feeds(b, 0, opts.tiny))
        inputs[b] = str(f)

    # 2. optimize (in parallel with --jobs; optimize times then share the machine)
    variants: dict[str, dict] = {ORIGINAL: {"tool": ORIGINAL, "precision": "fp32", "status": "ok",
                                            "files": {str(b): str(p) for b, p in originals.items()}}}
    jobs = []
    for tool in tools:
        if not tool.applies(bm):
            continue
        for prec in opts.precisions:
            own = row_batches(batches, prec, opts)
            if not tool.makes(prec, opts.provider) or not own:
                continue
            v = _variant(tool.name, prec)
            variants[v] = {"tool": tool.name, "precision": prec, "status": "ok", "files": {}, "optimize_s": {},
                           "info": {}}
            per_batch = tool.per_batch or bm.fixed_batch
            for b in (own if per_batch else (None,)):
                src = originals[b if b is not None else batches[0]]
                dst = work / f"{tool.name}-{prec}" / (f"b{b}.onnx" if b is not None else "model.onnx")
                dst.parent.mkdir(parents=True, exist_ok=True)
                ctx = {"model": bm.name, "target": opts.target, "provider": opts.provider, "precision": prec,
                       "tiny": opts.tiny,
                       "model_type": bm.model_type or peers.model_type(bm.name), "family": bm.family,
                       **(bm.attention(opts.tiny) if bm.attention else {}), **dict(tool.config)}
                if tool.per_batch:
                    feeds = bench._load_npz(inputs[b])
                    ctx["input_shapes"] = {k: list(v.shape) for k, v in feeds.items()}
                jobs.append((v, b, {"kind": "optimize", "target": tool.target, "src": str(src), "dst": str(dst),
                                    "ctx": ctx}))

    def _opt(item):
        v, b, job = item
        return item, run_job(job, work / "jobs", opts.timeout)

    with concurrent.futures.ThreadPoolExecutor(max(1, opts.jobs)) as pool:
        for (v, b, job), r in pool.map(_opt, jobs):
            row = variants[v]
            key = str(b) if b is not None else "all"
            if not r.get("ok"):
                if row["status"] == "ok":
                    row.update(status="error", error=r["error"])
                    row["traceback"] = (r.get("traceback") or r.get("stderr_tail") or "")[-1500:]
                log(f"  {bm.name} / {v}{'' if b is None else f' b{b}'}: FAILED: {r['error']}")
                continue
            row["optimize_s"][key] = round(r["seconds"], 3)
            row["info"] = r.get("info") or {}
            for k in ("log", "config_failures"):
                if r.get(k):
                    row[k] = list(dict.fromkeys(row.get(k, []) + r[k]))
            if r.get("config_failures"):
                log(f"  {bm.name} / {v}: CONFIGURATION FAILURE logged: {r['config_failures'][0]}")
            for bb in (row_batches(batches, row["precision"], opts) if b is None else (b,)):
                row["files"][str(bb)] = job["dst"]
            log(f"  {bm.name} / {v}{'' if b is None else f' b{b}'}: optimized in {r['seconds']:.2f} s")
    for v, row in variants.items():
        if row["status"] == "ok" and len(row["files"]) < len(row_batches(batches, row["precision"], opts)) \
                and v != ORIGINAL:
            row.update(status="error", error=row.get("error") or "not optimized for every batch")

    # 3. evaluate: nodes, kernels per batch and option set, outputs (CUDA without TF32)
    (work / "profiles").mkdir(exist_ok=True)
    live = [v for v, row in variants.items() if row["status"] == "ok"]

    def _eval(v):
        row = variants[v]
        own = [b for b in batches if str(b) in row["files"]]
        job = {"kind": "t-evaluate", "provider": opts.provider, "option_sets": option_sets,
               "models": [(b, row["files"][str(b)]) for b in own],
               "inputs": {str(b): inputs[b] for b in own},
               "outputs": {str(b): str(work / f"out-{v.replace('/', '-')}-b{b}.npz") for b in own},
               "profile_dir": str(work / "profiles")}
        return v, job, run_job(job, work / "jobs", opts.timeout)

    evaluated = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, min(opts.jobs, 4))) as pool:
        for v, job, r in pool.map(_eval, live):
            row = variants[v]
            if not r.get("ok"):
                row.update(status="error", error=f"evaluation: {r['error']}")
                log(f"  {bm.name} / {v}: evaluation FAILED: {r['error']}")
                continue
            row["nodes"], row["op_types"] = r["nodes"], r["op_types"]
            if r["errors"] and not r["kernels"]:  # onnxruntime refused it everywhere
                row.update(status="error", error=next(iter(r["errors"].values())))
                log(f"  {bm.name} / {v}: {row['error']}")
                continue
            evaluated[v] = (job, r)
    meas = res["measurements"]
    for b in batches:
        for label, _ in option_sets:
            meas[f"{b}|{label}"] = {"batch": b, "options": label, "rows": {}}
    ref_ok = ORIGINAL in evaluated
    for v, (job, r) in evaluated.items():
        row = variants[v]
        for b in (b for b in batches if str(b) in job["outputs"]):
            for label, _ in option_sets:
                key = f"{b}|{label}"
                m = meas[key]["rows"].setdefault(v, {})
                if key in r["errors"]:
                    m["error"] = r["errors"][key]
                k = r["kernels"].get(key)
                if k:
                    m["kernels"] = k["kernels"]
                    m["by_provider"] = k["by_provider"]
                    m["memcpy"] = k["memcpy"]
                    m["session_init_s"] = k["session_init_s"]
            outf = Path(job["outputs"][str(b)])
            if not outf.exists():
                continue
            if ref_ok and Path(evaluated[ORIGINAL][0]["outputs"][str(b)]).exists():
                ref = _outputs(Path(evaluated[ORIGINAL][0]["outputs"][str(b)]))
                mask = bench._load_npz(inputs[b]).get("attention_mask")
                fid = fidelity(ref, _outputs(outf), row["precision"], mask)
                for label, _ in option_sets:
                    meas[f"{b}|{label}"]["rows"][v]["fidelity"] = fid
    if not ref_ok:
        log(f"  {bm.name}: the original did not run: no fidelity figures")

    # 4. latency: per batch, every tool and option set in one interleaved run
    for b in batches:
        entries = []
        for v in evaluated:
            for label, options in option_sets:
                if str(b) in variants[v]["files"] and "error" not in meas[f"{b}|{label}"]["rows"].get(v, {}):
                    entries.append((f"{v}|{label}", variants[v]["files"][str(b)], options))
        if not entries:
            continue
        job = {"kind": "t-latency", "provider": opts.provider, "entries": entries, "inputs": inputs[b],
               "runs": opts.runs, "warmup": opts.warmup, "min_rounds": opts.min_rounds,
               "budget_s": opts.latency_budget, "gap_s": opts.gap, "threads": opts.threads}
        r = run_job(job, work / "jobs", max(opts.timeout, 3 * opts.latency_budget))
        if not r.get("ok"):
            for label, _ in option_sets:
                meas[f"{b}|{label}"]["latency_error"] = r["error"]
            log(f"  {bm.name} b{b}: latency FAILED: {r['error']}")
            continue
        for key, lat in r["results"].items():
            v, label = key.rsplit("|", 1)
            lat["rounds"] = r["rounds"]
            meas[f"{b}|{label}"]["rows"][v]["latency"] = lat
        for key, err in r["errors"].items():
            v, label = key.rsplit("|", 1)
            meas[f"{b}|{label}"]["rows"][v]["latency_error"] = err
        for label, _ in option_sets:
            rank(meas[f"{b}|{label}"], variants)
            m = meas[f"{b}|{label}"]
            log(f"  {bm.name} b{b} [{label}]: " + ", ".join(
                f"{v} {x['latency']['median_ms']:.3g} ms" for v, x in m["rows"].items() if "latency" in x))
    for v, row in variants.items():
        row.pop("traceback", None) if row.get("status") == "ok" else None
    res["variants"] = variants
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    return res


def _ratio_interval(before: dict, after: dict) -> list[float] | None:
    """The 90% paired bootstrap interval of median(after) / median(before) over the interleaved rounds
    (``onnxopt.verify.runtime.ratio_interval``), where both rows kept their rounds; else None."""
    from onnxopt.verify.runtime import ratio_interval

    a, b = after.get("samples_ms"), before.get("samples_ms")
    if not a or not b:
        return None
    return ratio_interval(b, a, confidence=0.90).get("interval")


def rank(m: dict, variants: dict) -> None:
    """Ratios of one (batch, options) table: each row against the original (fp32) and each onnxopt
    row against the best peer of its precision (peers that ran, within the fidelity bounds)."""
    rows = m["rows"]
    base = rows.get(ORIGINAL, {}).get("latency", {}).get("median_ms")
    peer_tools = {t.name for t in TOOLS if t.peer}
    for v, x in rows.items():
        lat = x.get("latency")
        if not lat:
            continue
        if base:
            lat["x_original"] = lat["median_ms"] / base
    fixed_tools = {t.name for t in TOOLS if t.per_batch}
    for prec in PRECISIONS:
        cands = [(x["latency"]["median_ms"], v) for v, x in rows.items()
                 if variants[v]["tool"] in peer_tools and variants[v]["precision"] == prec and "latency" in x
                 and x.get("fidelity", {}).get("ok")]
        # dynamic shapes are judged against the peers' dynamic models only (a fixed model cannot serve them);
        # fixed shapes against every peer row, the fixed ones (onnxsim --overwrite-input-shape first) included
        for key, pool, ours in (("best_peer", [c for c in cands if variants[c[1]]["tool"] not in fixed_tools],
                                 lambda t: t not in fixed_tools),
                                ("best_peer_fixed", cands, lambda t: t in fixed_tools)):
            if not pool:
                continue
            best_ms, best = min(pool)
            m.setdefault(key, {})[prec] = {"variant": best, "median_ms": best_ms}
            if variants[best].get("config_failures"):  # it ran, but not as its users run it: say so
                m[key][prec]["config_failure"] = variants[best]["config_failures"][0]
            for v, x in rows.items():
                tool = variants[v]["tool"]
                if variants[v]["precision"] == prec and "latency" in x and tool not in peer_tools \
                        and v != ORIGINAL and ours(tool):
                    x["latency"]["x_best_peer"] = x["latency"]["median_ms"] / best_ms
                    interval = _ratio_interval(rows[best]["latency"], x["latency"])
                    if interval:
                        x["latency"]["x_best_peer_interval"] = interval


# ---------------------------------------------------------------------------------------------
# Report


def _meta(opts: Options, argv: list[str], tools: list[BTool]) -> dict:
    packages = [types.SimpleNamespace(package=p) for p in ("onnxruntime", "onnxscript")]
    vers = bench.versions(packages)
    if any(t.target.endswith(":setup_optimum") for t in tools):  # its own environment's versions
        from scripts.bench import _optimum

        vers.update({f"{k} (optimum's environment)": v for k, v in _optimum.versions().items()})
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m scripts.bench.targets " + shlex.join(argv),
        "target": opts.target, "provider": opts.provider,
        "machine": bench.machine_info(),
        "gpu": bench.gpu_info() if opts.provider == "cuda" else None,
        "versions": vers,
        "options": {k: v for k, v in dataclasses.asdict(opts).items()},
        "tool_docs": [{"name": t.name, "doc": t.doc, "families": t.families} for t in tools],
        "onnxopt_commit": bench.onnxopt_commit(),
    }


def merge(reports: list[dict]) -> dict:
    """One report of several runs (parts): models from all, each keeping the run it came from."""
    if not reports:
        raise ValueError("nothing to merge")
    runs, models = [], {}
    for r in reports:
        index = []
        for run in r.get("runs") or [r["meta"]]:
            if run not in runs:
                runs.append(run)
            index.append(runs.index(run))
        for name, res in r["models"].items():
            if name not in models or ("error" in models[name] and "error" not in res):
                res = dict(res)
                res["run"] = index[res.get("run", 0)] if res.get("run", 0) < len(index) else None
                models[name] = res
    order = {m.name: i for i, m in enumerate(MODELS)}
    models = dict(sorted(models.items(), key=lambda kv: order.get(kv[0], 1 << 30)))
    targets = sorted({run["target"] for run in runs})
    return {"runs": runs, "targets": targets, "models": models}


def _peer_cell(best: dict | None, describe) -> str:
    """A table's best-peer cell: "—" without one, else ``describe(best)``, flagged where that peer ran with
    a configuration failure."""
    if not best:
        return "—"
    return describe(best) + (" (**configuration failure**)" if best.get("config_failure") else "")


def _ms(x) -> str:
    return "" if x is None else bench._sig(x)


def _pct(x) -> str:
    return "" if x is None else (f"{x:.2%}" if x >= 1e-4 else f"{x:.1e}")


def _fid_cell(f: dict | None) -> str:
    if not f:
        return ""
    parts = []
    if f.get("cosine") is not None:
        parts.append(f"{f['cosine']:.6f}")
    if f.get("err_range") is not None:
        parts.append(_pct(f["err_range"]))
    if f.get("top1") is not None:
        parts.append(f"top-1 {f['top1']:.1%}")
    text = " / ".join(parts)
    return text if f.get("ok") else f"**out of bounds** ({bench._cell_text(f.get('why', ''), 60)}) {text}"


def summary_rows(models: dict) -> list[dict]:
    """One row per model, batch, options and precision: the best peer, the original, and each onnxopt
    tool (``onnxopt``, ``onnxopt-fixed``) with its ratios."""
    out = []
    for name, res in models.items():
        variants = res.get("variants", {})
        for key, m in res.get("measurements", {}).items():
            rows = m["rows"]
            orig = rows.get(ORIGINAL, {}).get("latency", {}).get("median_ms")
            for prec in PRECISIONS:
                best = m.get("best_peer", {}).get(prec)
                ours = {}
                for v, x in rows.items():
                    tool = variants.get(v, {}).get("tool", "")
                    if not tool.startswith("onnxopt") or variants[v]["precision"] != prec:
                        continue
                    lat = x.get("latency", {}).get("median_ms")
                    entry = {"variant": v, "median_ms": lat, "fidelity_ok": x.get("fidelity", {}).get("ok"),
                             "kernels": x.get("kernels"),
                             "cpu_kernels": x.get("by_provider", {}).get("CPUExecutionProvider", 0)
                             if "kernels" in x else None}
                    against = (m.get("best_peer_fixed", {}).get(prec) or best) if tool == "onnxopt-fixed" else best
                    if lat and against:
                        entry["x_best_peer"] = lat / against["median_ms"]
                        interval = _ratio_interval(rows[against["variant"]].get("latency") or {}, x.get("latency") or {})
                        if interval:
                            entry["x_best_peer_interval"] = interval
                    if lat and orig:
                        entry["x_original"] = lat / orig
                    ours[tool] = entry
                for v, row in variants.items():
                    if row.get("tool", "").startswith("onnxopt") and row["precision"] == prec \
                            and row.get("status") != "ok":
                        ours.setdefault(row["tool"], {"variant": v, "error": row.get("error", "?")})
                if not ours and not best:
                    continue
                out.append({"model": name, "batch": m["batch"], "options": m["options"], "precision": prec,
                            "original_ms": orig, "best_peer": best,
                            "best_peer_fixed": m.get("best_peer_fixed", {}).get(prec), "onnxopt": ours})
    return out


def advised_rows(models: dict) -> list[dict]:
    """Vision/OCR models measured under several option sets: per batch, the fp32 original with the
    provider's defaults against each fp16 row under each option set (all in one latency run)."""
    out = []
    for name, res in models.items():
        if res.get("family") not in ("vision", "ocr") or len(res.get("option_sets", [])) < 2:
            continue
        for b in res.get("batches", []):
            base = res["measurements"].get(f"{b}|default", {}).get("rows", {}).get(ORIGINAL, {})
            base_ms = base.get("latency", {}).get("median_ms")
            for os_ in res["option_sets"]:
                m = res["measurements"].get(f"{b}|{os_['label']}", {})
                for v, x in m.get("rows", {}).items():
                    if res["variants"].get(v, {}).get("precision") != "fp16" or "latency" not in x:
                        continue
                    ms = x["latency"]["median_ms"]
                    out.append({"model": name, "batch": b, "options": os_["label"], "variant": v,
                                "original_fp32_ms": base_ms, "median_ms": ms,
                                "speedup": base_ms / ms if base_ms else None,
                                "fidelity_ok": x.get("fidelity", {}).get("ok")})
    return out


def _ratio(x, bound) -> str:
    return "" if x is None else (f"{x:.2f}" if x <= bound else f"**{x:.2f}**")


def render_markdown(report: dict) -> str:
    runs = report.get("runs") or [report["meta"]]
    L = ["# Target benchmark: onnxopt against onnxruntime's transformers optimizer and onnxscript's ort_fusions", ""]
    targets = ", ".join(sorted({r["target"] for r in runs}))
    L.append(f"Generated by `python -m scripts.bench.targets`; target(s): {targets}.")
    L.append("")
    L.append("Runs (each model's table names the run it came from):")
    L.append("")
    for i, r in enumerate(runs, 1):
        mach = r["machine"]
        where = r.get("gpu") or mach.get("cpu", "?")
        vers = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
        commit = f", onnxopt at {r['onnxopt_commit']}" if r.get("onnxopt_commit") else ""
        L.append(f"{i}. {r['date']}, {r['target']} on {where} ({mach.get('logical_cores', '?')} CPU threads)"
                 f"{commit}: `{r['command']}`; {vers}")
    L.append("")
    L.append("## Summary")
    L.append("")
    L.append("Median latency of onnxopt (dynamic shapes, as exported) and onnxopt-fixed (the input shapes fixed "
             "to the batch measured) against the best peer of the same precision (peers within the fidelity "
             "bounds) and against the fp32 original, all in one interleaved run with the same provider options. "
             "Targets: × best peer <= 1.02, × original <= 1; bold: missed. Kernels: per run (on the CPU provider).")
    L.append("")
    L.append("| model | batch | options | precision | original ms | best peer ms (tool) | onnxopt ms | × peer | "
             "× orig | kernels | best peer, shapes fixed, ms (tool) | onnxopt-fixed ms | × peer | × orig | kernels |")
    L.append("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    def peer_cell(best):
        return _peer_cell(best, lambda b: f"{_ms(b['median_ms'])} ({b['variant'].split('/')[0]})")

    for row in summary_rows(report["models"]):
        peer = peer_cell(row.get("best_peer"))
        cells = []
        for tool in ("onnxopt", "onnxopt-fixed"):
            if tool == "onnxopt-fixed":
                cells.append(peer_cell(row.get("best_peer_fixed") or row.get("best_peer"))
                             if row["onnxopt"].get(tool) else "")
            e = row["onnxopt"].get(tool)
            if not e:
                cells += ["", "", "", ""]
            elif "error" in e:
                cells += [f"error: {bench._cell_text(e['error'], 50)}", "", "", ""]
            else:
                ms = _ms(e.get("median_ms")) + ("" if e.get("fidelity_ok") in (True, None) else " (**out of bounds**)")
                kern = "" if e.get("kernels") is None else f"{e['kernels']} ({e['cpu_kernels']})"
                ci = e.get("x_best_peer_interval")
                cells += [ms, _ratio(e.get("x_best_peer"), 1.02) + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else ""),
                          _ratio(e.get("x_original"), 1.0), kern]
        L.append(f"| {row['model']} | {row['batch']} | {row['options']} | {row['precision']} | "
                 f"{_ms(row['original_ms'])} | {peer} | " + " | ".join(cells) + " |")
    L.append("")
    adv = advised_rows(report["models"])
    if adv:
        L.append("**fp16 under each set of provider options against the fp32 original with the provider's defaults** "
                 "(same interleaved run; the issue's target for resnet50 at a large batch: >= 1.35x)")
        L.append("")
        L.append("| model | batch | options | tool | fp32 original ms (default) | fp16 ms | speedup | fidelity |")
        L.append("|---|---:|---|---|---:|---:|---:|---|")
        for r in adv:
            fid = {True: "ok", False: "**out of bounds**", None: ""}[r["fidelity_ok"]]
            sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            L.append(f"| {r['model']} | {r['batch']} | {r['options']} | {r['variant']} | "
                     f"{_ms(r['original_fp32_ms'])} | {_ms(r['median_ms'])} | {sp} | {fid} |")
        L.append("")
    for name, res in report["models"].items():
        L.append(f"## {name}")
        L.append("")
        L.append(res.get("description", ""))
        L.append("")
        if "error" in res:
            L.append(f"Not measured: {res['error']}")
            L.append("")
            continue
        if res.get("run") is not None and len(runs) > 1:
            L.append(f"Run {res['run'] + 1}.")
            L.append("")
        builds = res.get("build", {})
        bt = [f"{'batch ' + k if k != 'all' else 'model'}: "
              + ("cached" if v.get("cached") else f"built in {v['build_s']:.1f} s") for k, v in builds.items()]
        L.append(f"Build: {'; '.join(bt)}. Whole model (build, optimize, evaluate, latency): "
                 f"{res.get('seconds', '?')} s.")
        L.append("")
        variants = res["variants"]
        errs = [(v, row) for v, row in variants.items() if row.get("status") != "ok"]
        for v, row in errs:
            L.append(f"- `{v}`: {bench._cell_text(row.get('error', '?'), 200)}")
        notes = [(v, row) for v, row in variants.items() if row.get("status") == "ok"
                 and (row.get("config_failures") or (row.get("info") or {}).get("note"))]
        for v, row in notes:
            if row.get("config_failures"):
                L.append(f"- `{v}`: **configuration failure** logged: "
                         f"{bench._cell_text(row['config_failures'][0], 200)}")
            if (row.get("info") or {}).get("note"):
                L.append(f"- `{v}`: {bench._cell_text(row['info']['note'], 200)}")
        if errs or notes:
            L.append("")
        L.append("| tool | optimize s | nodes | com.microsoft ops | the tool's fusion counts (onnxopt: rules fired) |")
        L.append("|---|---:|---:|---|---|")
        for v, row in variants.items():
            if row.get("status") != "ok":
                continue
            info = row.get("info") or {}
            fused = info.get("fused") or info.get("fusions") or info.get("fired") or {}
            fused_s = ", ".join(f"{k} {n}" for k, n in sorted(fused.items(), key=lambda kv: -kv[1])[:8])
            secs = row.get("optimize_s") or {}
            contrib = ", ".join(f"{k.split('.', 2)[-1]} {n}" for k, n in sorted((row.get("op_types") or {}).items())
                                if k.startswith("com.microsoft."))
            L.append(f"| {v} | {_ms(max(secs.values())) if secs else '—'} | {row.get('nodes', '')} | "
                     f"{bench._cell_text(contrib, 120)} | {bench._cell_text(fused_s, 160)} |")
        L.append("")
        for key, m in res["measurements"].items():
            L.append(f"**batch {m['batch']}, provider options: {m['options']}**"
                     + (f" (latency failed: {m['latency_error']})" if m.get("latency_error") else ""))
            L.append("")
            L.append("| tool | kernels | on CPU | Memcpy | median ms | p10 | p90 | × original | × best peer | "
                     "fidelity (cosine / err÷range / top-1) |")
            L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
            rounds = None
            for v, x in m["rows"].items():
                lat = x.get("latency", {})
                rounds = lat.get("rounds", rounds)
                err = x.get("error") or x.get("latency_error")
                L.append(f"| {v} | {x.get('kernels', '')} | "
                         f"{x.get('by_provider', {}).get('CPUExecutionProvider', '') if 'kernels' in x else ''} | "
                         f"{x.get('memcpy', '')} | {_ms(lat.get('median_ms'))} | {_ms(lat.get('p10_ms'))} | "
                         f"{_ms(lat.get('p90_ms'))} | "
                         f"{'' if lat.get('x_original') is None else format(lat['x_original'], '.2f')} | "
                         f"{'' if lat.get('x_best_peer') is None else format(lat['x_best_peer'], '.2f')} | "
                         + (f"error: {bench._cell_text(err, 80)}" if err else _fid_cell(x.get("fidelity")))
                         + " |")
            L.append("")
            if rounds:
                L.append(f"Latency: {rounds} interleaved rounds.")
                L.append("")
    L.append("## Method")
    L.append("")
    for r in runs[:1]:
        for t in r.get("tool_docs", []):
            L.append(f"- **{t['name']}**: {t['doc']}")
    L.append(f"- Fidelity bounds: fp16 {BOUNDS['fp16']}, fp32 {BOUNDS['fp32']}; reference: the fp32 original on the "
             "same provider (CUDA with `use_tf32=0` for these runs; latency sessions keep the provider's defaults "
             "plus the options of the table).")
    L.append("- Kernels: onnxruntime's profiler, one run after a warm-up; \"on CPU\": kernels the CPU provider ran "
             "in a CUDA session.")
    L.append("")
    return "\n".join(L)


def _lat_cell(lat: dict | None) -> str:
    """``median (p10-p90)`` in ms."""
    if not lat or lat.get("median_ms") is None:
        return ""
    return f"{_ms(lat['median_ms'])} ({_ms(lat.get('p10_ms'))}-{_ms(lat.get('p90_ms'))})"


def compact_rows(models: dict, options: str = "default") -> list[dict]:
    """The CUDA transformer table's rows: per model, batch and precision (provider options ``options``),
    the original, the best peer (the best of every peer's configurations) and onnxopt / onnxopt-fixed,
    each with median, p10, p90 and the ratios; the peer's attention fusion count and its notes."""
    out = []
    for name, res in models.items():
        variants = res.get("variants", {})
        for key, m in res.get("measurements", {}).items():
            if m.get("options") != options:
                continue
            rows = m["rows"]
            orig = rows.get(ORIGINAL, {}).get("latency")
            for prec in PRECISIONS:
                best = m.get("best_peer", {}).get(prec)
                ours = {v: x for v, x in rows.items()
                        if variants.get(v, {}).get("tool", "").startswith("onnxopt")
                        and variants[v]["precision"] == prec}
                if not ours and not best:
                    continue
                entry = {"model": name, "batch": m["batch"], "precision": prec, "original": orig, "onnxopt": {}}
                best_fixed = m.get("best_peer_fixed", {}).get(prec) or best  # older runs: no fixed peers
                for key, b in (("best_peer", best), ("best_peer_fixed", best_fixed)):
                    if not b:
                        continue
                    bv = variants.get(b["variant"], {})
                    info = bv.get("info") or {}
                    entry[key] = {"tool": b["variant"].split("/")[0],
                                  "latency": rows[b["variant"]].get("latency"),
                                  "attention": sum(n for k, n in (info.get("fused") or info.get("fusions")
                                                                  or {}).items() if "ttention" in k),
                                  "note": info.get("note"), "config_failure": b.get("config_failure")}
                for v, x in ours.items():
                    lat = x.get("latency")
                    e = {"latency": lat, "fidelity_ok": x.get("fidelity", {}).get("ok"),
                         "error": variants[v].get("error") if variants[v].get("status") != "ok" else None}
                    against = best_fixed if variants[v]["tool"] == "onnxopt-fixed" else best
                    if lat and against:
                        e["x_best_peer"] = lat["median_ms"] / against["median_ms"]
                        interval = _ratio_interval(rows[against["variant"]].get("latency") or {}, lat)
                        if interval:
                            e["x_best_peer_interval"] = interval
                    if lat and orig:
                        e["x_original"] = lat["median_ms"] / orig["median_ms"]
                    entry["onnxopt"][variants[v]["tool"]] = e
                out.append(entry)
    return out


def _peer_names(runs: list[dict]) -> str:
    """The peer configurations the runs measured (their tool_docs), in TOOLS order."""
    names = {t["name"] for r in runs for t in r.get("tool_docs", []) if not t["name"].startswith("onnxopt")}
    names &= {t.name for t in TOOLS if t.peer and t.families != ("vision", "ocr")}
    order = [t.name for t in TOOLS if t.name in names]
    return ", ".join(f"`{n}`" for n in order) if order else "the peers of scripts/bench/targets.py"


def config_failure_lines(models: dict) -> list[str]:
    """``model variant: line`` for every peer row that logged or raised a configuration failure
    (_peers.CONFIG_FAILURES): the benchmark called that peer wrongly, so the run fails."""
    out = []
    for name, res in models.items():
        for v, row in (res.get("variants") or {}).items():
            lines = list(row.get("config_failures") or [])
            if row.get("status") != "ok":
                lines += peers.config_failures([row.get("error") or ""])
            out += [f"{name} {v}: {ln}" for ln in dict.fromkeys(lines)]
    return out


def compact_markdown(report: dict, options: str = "default") -> str:
    """The CUDA transformer table for BENCHMARKS.md (and its one-paragraph summary for the README):
    machine, onnxruntime-gpu version, date and the command, then one row per model, batch and precision
    with medians (p10-p90) in ms and the ratios to the best peer."""
    runs = report.get("runs") or [report["meta"]]
    gpus = sorted({(r.get("gpu") or "?").split(",")[0] for r in runs})
    vers = sorted({r["versions"].get("onnxruntime-gpu") or r["versions"].get("onnxruntime", "?") for r in runs})
    dates = sorted(r["date"] for r in runs)
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1][11:] if dates[-1][:10] == dates[0][:10] else dates[-1]}"
    L = [f"**CUDA, {' / '.join(gpus)}**, onnxruntime-gpu {', '.join(vers)}, {when} ({len(runs)} part(s)). "
         "Median ms (p10-p90) of interleaved "
         "rounds after 20 warm-up runs, sequence 128 with padded rows (the decode step: 1 token after 128 past); "
         "provider defaults. Best peer: the fastest of every peer configuration within the fidelity bounds, "
         f"each a row of its own ({_peer_names(runs)}; docs/benchmarks-peers.md gives each call). "
         "× peer above 1.02 is in bold: there onnxopt is behind.", ""]
    L.append("| model | batch | prec | original | best peer (tool; its Attention nodes) | onnxopt | × peer | "
             "best peer, shapes fixed | onnxopt-fixed | × peer |")
    L.append("|---|---:|---|---:|---|---:|---:|---|---:|---:|")
    notes = []
    def peer_cell(bp):
        return _peer_cell(bp, lambda b: f"{_lat_cell(b['latency'])} ({b['tool']}; {b['attention']})")

    for r in compact_rows(report["models"], options):
        peer = peer_cell(r.get("best_peer"))
        cells = []
        for tool in ("onnxopt", "onnxopt-fixed"):
            if tool == "onnxopt-fixed":
                cells.append(peer_cell(r.get("best_peer_fixed")) if r["onnxopt"].get(tool) else "")
            e = r["onnxopt"].get(tool)
            if not e:
                cells += ["", ""]
            elif e.get("error"):
                cells += [f"error: {bench._cell_text(e['error'], 40)}", ""]
            else:
                x, ci = e.get("x_best_peer"), e.get("x_best_peer_interval")
                ratio = "" if x is None else (f"**{x:.2f}**" if x > 1.02 else f"{x:.2f}")
                if ci:
                    ratio += f" ({ci[0]:.2f}-{ci[1]:.2f})"
                oob = "" if e.get("fidelity_ok") in (True, None) else " (out of bounds)"
                cells += [_lat_cell(e["latency"]) + oob, ratio]
        L.append(f"| {r['model']} | {r['batch']} | {r['precision']} | {_ms((r['original'] or {}).get('median_ms'))} | "
                 f"{peer} | " + " | ".join(cells) + " |")
    behind = [r for r in compact_rows(report["models"], options)
              if (r["onnxopt"].get("onnxopt") or {}).get("x_best_peer", 0) > 1.02]
    total = [r for r in compact_rows(report["models"], options) if "x_best_peer" in (r["onnxopt"].get("onnxopt") or {})]
    for name, res in report["models"].items():
        for v, row in (res.get("variants") or {}).items():
            if row.get("config_failures"):
                notes.append(f"- {name} `{v}`: **configuration failure** logged: "
                             f"{bench._cell_text(row['config_failures'][0], 160)}")
        if "error" in res:
            notes.append(f"- {name}: not measured: {bench._cell_text(res['error'], 160)}")
    L.append("")
    worst = max(behind, key=lambda r: r["onnxopt"]["onnxopt"]["x_best_peer"], default=None)
    summary = (f"onnxopt (dynamic shapes) is behind the best peer (above 1.02x) on {len(behind)} of {len(total)} rows"
               + (f", worst {worst['model']} batch {worst['batch']} {worst['precision']}: "
                  f"{_ms(worst['onnxopt']['onnxopt']['latency']['median_ms'])} against "
                  f"{_ms(worst['best_peer']['latency']['median_ms'])} ms ({worst['best_peer']['tool']}), "
                  f"{worst['onnxopt']['onnxopt']['x_best_peer']:.2f}x" if worst else "")
               + ".")
    cpu_rows = [(name, key, v, row.get("by_provider", {}).get("CPUExecutionProvider", 0), row.get("memcpy", 0))
                for name, res in report["models"].items() for key, m in res.get("measurements", {}).items()
                if m.get("options") == options for v, row in m["rows"].items()
                if (res.get("variants", {}).get(v, {}).get("tool") == "onnxopt" and "kernels" in row)]
    if cpu_rows:
        on_cpu = [r for r in cpu_rows if r[3] or r[4]]
        if on_cpu:
            summary += (f" At dynamic shapes onnxopt's model runs kernels on the CPU or a Memcpy on {len(on_cpu)} of "
                        f"{len(cpu_rows)} rows ({', '.join(sorted({r[0] for r in on_cpu}))}).")
        else:
            summary += f" At dynamic shapes onnxopt's model runs no kernel on the CPU and no Memcpy on all {len(cpu_rows)} rows."
    L.append(f"- {summary}")
    L += notes
    L.append("")
    return "\n".join(L)


def replace_section(path: Path, name: str, text: str) -> bool:
    """Replace what lies between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in ``path`` by
    ``text`` (written atomically); False when the markers are not there."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = path.read_text()
    i, j = doc.find(begin), doc.find(end)
    if i < 0 or j < i:
        return False
    new = doc[: i + len(begin)] + "\n" + text.rstrip("\n") + "\n" + doc[j:]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new)
    os.replace(tmp, path)
    return True


# ---------------------------------------------------------------------------------------------
# CLI


def parse_option(text: str, provider: str) -> tuple[str, str]:
    """``[cuda:]key=value`` -> (key, value); the provider prefix, when given, must be the target's."""
    head, _, kv = text.partition(":") if ":" in text.split("=", 1)[0] else ("", "", text)
    if head and head != provider:
        raise ValueError(f"--provider-option {text!r}: for provider {head!r}, the target's is {provider!r}")
    key, sep, value = kv.partition("=")
    if not sep or not key:
        raise ValueError(f"--provider-option {text!r}: expected [{provider}:]KEY=VALUE")
    return key, value


def _option_sets(texts: list[str] | None, provider: str) -> tuple[tuple[str, dict], ...] | None:
    """``--option-sets "default" "prefer_nhwc=1"``: each a comma-separated list of KEY=VALUE (or
    ``default``: none)."""
    if not texts:
        return None
    out = []
    for t in texts:
        if t.strip() in ("", "default"):
            out.append(("default", {}))
            continue
        d = dict(parse_option(p.strip(), provider) for p in t.split(",") if p.strip())
        out.append((",".join(f"{k}={v}" for k, v in d.items()), d))
    return tuple(out)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.targets", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=sorted(TARGET_PROVIDER), default="ort-cpu")
    p.add_argument("--models", nargs="+", metavar="NAME")
    p.add_argument("--set", choices=("core", "full", "zoo", "transformers"), default="core",
                   help="models when --models is not given: core (the issue's list), full (all attention/exporter "
                        "combinations), zoo (the zoo's small transformers, MiniLM, the vision and OCR models: for "
                        "a small CPU), transformers (the core set's transformers: the CUDA transformer table)")
    p.add_argument("--part", default=None, metavar="N/M", help="the N-th of M parts of about equal cost (1-based)")
    p.add_argument("--tools", nargs="+", metavar="T", help=f"default all: {', '.join(t.name for t in TOOLS)}")
    p.add_argument("--batches", default=None, help="comma-separated (default: each model's, e.g. 1,8; vision 1,32)")
    p.add_argument("--precisions", default="fp32,fp16")
    p.add_argument("--fp32-batches", default=None, metavar="B,...",
                   help="measure the tools' fp32 rows only at these batches (the original: at all), e.g. 1 for the "
                        "issue's table (fp16 at batches 1 and 8, fp32 at 1); default: every batch")
    p.add_argument("--provider-option", action="append", default=[], metavar="[PROVIDER:]KEY=VALUE",
                   help="for every session of every tool (repeatable)")
    p.add_argument("--option-sets", nargs="+", default=None, metavar="SET",
                   help="measure every tool under each set, in the same run: 'default' or KEY=VALUE[,KEY=VALUE]")
    p.add_argument("--vision-option-sets", nargs="+", default=None, metavar="SET",
                   help="the same for vision/OCR models (default on ort-cuda: default prefer_nhwc=1)")
    p.add_argument("--runs", type=int, default=None, help="interleaved latency rounds (default: cuda 100, cpu 30)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per session (default: cuda 20, cpu 3)")
    p.add_argument("--min-rounds", type=int, default=None,
                   help="latency rounds at least, whatever the budget (default: cuda 10, cpu 5)")
    p.add_argument("--latency-budget", type=float, default=60.0, help="seconds of timed runs per batch, at most")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads of CPU sessions (0: onnxruntime's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess (tool run, evaluation)")
    p.add_argument("--jobs", type=int, default=1, help="optimize/evaluate subprocesses at a time")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds: start no further model after this (the rest are reported as not measured)")
    p.add_argument("--cache", type=Path, default=None)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny configs of the transformers (tests, smoke runs)")
    p.add_argument("--force", action="store_true", help="rebuild models already in the cache")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON")
    p.add_argument("-o", "--output", type=Path, default=None, help="with --merge: the merged JSON")
    p.add_argument("--compact", type=Path, default=None, metavar="MD",
                   help="with --merge: the compact table (medians with p10-p90, ratios to the best peer) to this file")
    p.add_argument("--into", nargs="+", type=Path, default=None, metavar="DOC",
                   help="with --merge: put the compact table between <!-- cuda-transformers:begin/end --> in these "
                        "documents (BENCHMARKS.md), and its summary line between <!-- cuda-transformers-summary:"
                        "begin/end --> (README.md)")
    p.add_argument("--list", action="store_true", help="list the models (of --part) and exit")
    return p.parse_args(argv)


def _default(value, provider: str, cuda, cpu):
    return value if value is not None else (cuda if provider == "cuda" else cpu)


def select_models(args) -> list[BenchModel]:
    if args.models:
        models = [get_model(n) for n in args.models]
    elif args.set == "transformers":
        models = [m for m in MODELS if "core" in m.sets and m.transformer]
    else:
        models = [m for m in MODELS if args.set in m.sets]
    if args.part:
        n, _, k = args.part.partition("/")
        n, k = int(n), int(k)
        if not (1 <= n <= k):
            raise ValueError(f"--part {args.part}: expected N/M with 1 <= N <= M")
        models = split_parts(models, k)[n - 1]
    return models


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return bench._child_main(argv[1], _job)
    args = parse_args(argv)
    if args.merge:
        try:
            report = merge([json.loads(p.read_text()) for p in args.merge])
        except (OSError, ValueError, KeyError) as exc:
            print(f"scripts.bench.targets: error: {bench.one_line(exc)}", file=sys.stderr)
            return 2
        if args.output:
            args.output.write_text(json.dumps(report, indent=1, default=bench._json_default) + "\n")
            print(f"wrote {args.output}")
        if args.markdown:
            args.markdown.write_text(render_markdown(report))
            print(f"wrote {args.markdown}")
        failed = config_failure_lines(report["models"])
        if failed:
            _report_config_failures(failed)
            if args.into:
                print(f"not put into {', '.join(map(str, args.into))}: a peer was called wrongly", file=sys.stderr)
                args.into = None
        if args.compact or args.into:
            table = compact_markdown(report)
            if args.compact:
                args.compact.write_text(table)
                print(f"wrote {args.compact}")
            summary = [ln[2:] for ln in table.splitlines() if ln.startswith("- onnxopt (dynamic shapes) is behind")]
            for doc in args.into or []:
                done = [replace_section(doc, "cuda-transformers", table)]
                if summary:
                    first = table.splitlines()[0]
                    where = first.split(". Median")[0].replace("**", "").removeprefix("CUDA, ")
                    done.append(replace_section(doc, "cuda-transformers-summary",
                                                f"The CUDA transformer table ({where}): {summary[0]}"))
                print(f"{doc}: {'replaced' if any(done) else 'no markers, unchanged'}")
        return 3 if failed else 0
    try:
        models = select_models(args)
        tools = [get_tool(t) for t in args.tools] if args.tools else list(TOOLS)
        provider = TARGET_PROVIDER[args.target]
        common = dict(parse_option(t, provider) for t in args.provider_option)
        sets = _option_sets(args.option_sets, provider) or (("default", {}),)
        vsets = _option_sets(args.vision_option_sets, provider)
        if vsets is None and provider == "cuda" and not args.option_sets:
            vsets = (("default", {}), ("prefer_nhwc=1", {"prefer_nhwc": "1"}))
        if common:
            sets = tuple((label, {**common, **o}) for label, o in sets)
            vsets = tuple((label, {**common, **o}) for label, o in vsets) if vsets else None
        precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
        bad = [p for p in precisions if p not in PRECISIONS]
        if bad:
            raise ValueError(f"--precisions: unknown {', '.join(bad)} (choose from {', '.join(PRECISIONS)})")
        batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else None
        fp32_batches = tuple(int(b) for b in args.fp32_batches.split(",")) if args.fp32_batches else None
    except (KeyError, ValueError) as exc:
        print(f"scripts.bench.targets: error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2
    if args.list:
        for m in models:
            print(f"{m.name:<26} {m.family:<8} weight {m.weight:<4.2g} batches {','.join(map(str, m.batches))}  "
                  f"{m.description}")
        return 0
    if not models:
        print("scripts.bench.targets: error: no model selected", file=sys.stderr)
        return 2
    if provider == "cuda":
        import onnxruntime

        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            print("scripts.bench.targets: error: --target ort-cuda needs onnxruntime-gpu (CUDAExecutionProvider is not "
                  "available)", file=sys.stderr)
            return 2
    opts = Options(target=args.target, precisions=precisions, batches=batches, option_sets=sets,
                   vision_option_sets=vsets, runs=max(1, _default(args.runs, provider, 100, 30)),
                   warmup=max(1, _default(args.warmup, provider, 20, 3)),
                   min_rounds=max(1, _default(args.min_rounds, provider, 10, 5)),
                   latency_budget=args.latency_budget, threads=max(0, args.threads), timeout=args.timeout,
                   jobs=max(1, args.jobs), tiny=args.tiny, force=args.force, fp32_batches=fp32_batches,
                   gap=0.002 if provider == "cpu" else 0.0)
    from onnxopt.models.cache import cache_dir

    cache = cache_dir(args.cache)
    work = args.work or Path(tempfile.mkdtemp(prefix="onnxopt-bench-targets-"))
    meta = _meta(opts, argv, tools)
    report = {"meta": meta, "runs": [meta], "targets": [opts.target], "models": {}}
    t0 = time.perf_counter()

    def log(s: str) -> None:
        print(s, flush=True)

    log(f"{len(models)} model(s), target {opts.target}: {', '.join(m.name for m in models)}")
    for i, bm in enumerate(models, 1):
        if args.deadline is not None and time.perf_counter() - t0 > args.deadline:
            report["models"][bm.name] = {"family": bm.family, "description": bm.description,
                                         "error": f"not measured: the run's deadline ({args.deadline:g} s) passed"}
            log(f"[{i}/{len(models)}] {bm.name}: skipped (deadline)")
            continue
        log(f"[{i}/{len(models)}] {bm.name} ...")
        try:
            res = bench_one(bm, tools, opts, cache, work, log)
        except Exception as exc:  # noqa: BLE001 - the next model still runs
            res = {"family": bm.family, "description": bm.description, "error": bench.one_line(exc)}
        res["run"] = 0
        report["models"][bm.name] = res
        log(f"[{i}/{len(models)}] {bm.name}: done in {time.perf_counter() - t0:.0f} s (elapsed)")
        _write(report, args)
    _write(report, args)
    if not args.json and not args.markdown:
        print(render_markdown(report))
    failed = config_failure_lines(report["models"])
    if failed:
        _report_config_failures(failed)
        return 3
    return 0


def _report_config_failures(lines: list[str]) -> None:
    """A peer called wrongly is a bug of this benchmark (exit 3): its figures are not the peer's."""
    print(f"scripts.bench.targets: error: {len(lines)} peer configuration failure(s), the benchmark called a peer "
          "wrongly (its figures are not the peer's; fix the call in scripts/bench/_peers.py):", file=sys.stderr)
    for ln in lines[:20]:
        print(f"  {ln}", file=sys.stderr)


def _write(report: dict, args) -> None:
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=bench._json_default) + "\n")
    if args.markdown:
        args.markdown.write_text(render_markdown(report))


if __name__ == "__main__":
    sys.exit(main())
