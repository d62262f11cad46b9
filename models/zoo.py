"""The benchmark set: every model the benchmarks and heavier tests use, built or fetched on demand.

    python -m onnxopt.models build [--cache DIR] [--only NAME ...] [--force]
    python -m onnxopt.models list

Models are written to a cache directory outside git (``$ONNXOPT_CACHE`` or
``~/.cache/onnxopt/models``), once: a model already there is not rebuilt unless ``--force``.
Each model comes with realistic inputs (``spec.inputs(path)``): image sizes the model was made
for, token ids below the vocabulary size, attention masks of zeros and ones.

A builder writes ``<cache>/<name>.onnx`` (plus any external data beside it) and may need optional
packages (``spec.needs``); a model whose packages are missing is reported and skipped, not fatal.
"""

from __future__ import annotations

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

DEFAULT_CACHE = Path(os.environ.get("ONNXOPT_CACHE", Path.home() / ".cache" / "onnxopt" / "models"))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str  # file stem in the cache, e.g. "resnet50-legacy"
    family: str  # "vision" | "transformer" | "ocr" | "synthetic"
    build: Callable[[Path], None]  # writes the model to the given .onnx path
    make_inputs: Callable[[onnx.ModelProto, int], dict[str, np.ndarray]]  # (graph-only model, seed) -> feeds
    needs: tuple[str, ...] = ()  # importable modules the builder needs
    description: str = ""

    def path(self, cache: Path | None = None) -> Path:
        return Path(cache or DEFAULT_CACHE) / f"{self.name}.onnx"

    def missing(self) -> list[str]:
        return [m for m in self.needs if importlib.util.find_spec(m) is None]

    def inputs(self, path: Path | None = None, seed: int = 0) -> dict[str, np.ndarray]:
        proto = onnx.load(str(path or self.path()), load_external_data=False)
        return self.make_inputs(proto, seed)


# ---------------------------------------------------------------------------------------------
# Inputs


def _dims(vi: onnx.ValueInfoProto, fill: dict[str, int]) -> list[int]:
    dims = []
    for i, d in enumerate(vi.type.tensor_type.shape.dim):
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(d.dim_value)
        else:
            dims.append(fill.get(d.dim_param, fill.get(i, 1)))
    return dims


def graph_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {i.name for i in proto.graph.initializer}
    return [vi for vi in proto.graph.input if vi.name not in inits]


def image_inputs(size: tuple[int, int] | None = None, batch: int = 1) -> Callable:
    """Float images, normalized like ImageNet inputs; dynamic H/W set to ``size``."""

    def make(proto: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        feeds = {}
        for vi in graph_inputs(proto):
            fill = {0: batch}
            if size is not None:
                fill.update({2: size[0], 3: size[1]})
            dims = _dims(vi, fill)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            feeds[vi.name] = rng.standard_normal(dims).astype(dtype)
        return feeds

    return make


def synthetic_inputs(proto: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    return image_inputs()(proto, seed)


# ---------------------------------------------------------------------------------------------
# Builders


def _torchvision(name: str, exporter: str) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        from . import torchvision_models

        torchvision_models.export(name, path, exporter=exporter)

    return build


def _synthetic(n: int) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        from . import synthetic

        onnx.save(synthetic.build(n), str(path))

    return build


SPECS: list[ModelSpec] = []

for _net in ("resnet50", "mobilenet_v2", "efficientnet_b0"):
    for _exp in ("legacy", "dynamo"):
        SPECS.append(ModelSpec(
            f"{_net}-{_exp}", "vision", _torchvision(_net, _exp), image_inputs(),
            needs=("torch", "torchvision") + (("onnxscript",) if _exp == "dynamo" else ()),
            description=f"torchvision {_net}, random weights and BN statistics, {_exp} exporter, BN kept",
        ))

for _n in (1000,):
    SPECS.append(ModelSpec(f"synthetic-{_n}", "synthetic", _synthetic(_n), synthetic_inputs,
                           description=f"{_n} nodes of conv/BN/relu/identity/add blocks"))


def get(name: str) -> ModelSpec:
    for spec in SPECS:
        if spec.name == name:
            return spec
    raise KeyError(f"no model named {name!r}; known: {', '.join(s.name for s in SPECS)}")


# ---------------------------------------------------------------------------------------------
# Building the set


def build(names: list[str] | None = None, *, cache: Path | None = None, force: bool = False,
          log: Callable[[str], None] = print) -> dict[str, Path | str]:
    """Build or fetch the models; returns name -> path, or name -> the reason it was skipped."""
    cache = Path(cache or DEFAULT_CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    specs = SPECS if not names else [get(n) for n in names]
    results: dict[str, Path | str] = {}
    for i, spec in enumerate(specs, 1):
        path = spec.path(cache)
        head = f"[{i}/{len(specs)}] {spec.name}"
        if path.exists() and not force:
            log(f"{head}: cached ({path})")
            results[spec.name] = path
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
    import argparse

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
