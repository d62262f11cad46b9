"""Engine benchmark: optimize-time scaling on synthetic models, and resnet50 against a bare load+save.

    python -m scripts.bench.engine [--sizes 1000 10000 100000] [--repeat 5] [--shapes ...] [--resnet PATH]
                                   [--no-resnet] [--json OUT]

1. Synthetic conv/BN/relu/identity/add models of N nodes (onnxopt.models.synthetic): the median
   wall time of ``optimize(path, output=...)`` (load, rewrite, save) at each N, and the ratio of
   each size's time to the previous one. Linear growth means a 10x larger graph takes about 10x.
   The same for two chains whose nodes all read one initializer (``synthetic.shared_zero_chain``:
   ``Add(t, z)`` with z zero, every node removed; ``synthetic.fold_chain``: ``Add(c, one)``, every
   node folded), the shapes that made the driver quadratic (issue 11, item 15).
2. torchvision resnet50 exported with BatchNormalization kept (built if --resnet is not given and
   torch is installed): ``optimize`` against a bare ``onnx_ir.load`` + ``onnx_ir.save`` of the
   same file, runs interleaved so machine noise hits both alike; the ratio of medians.
Each measurement runs in a fresh subprocess so that one run's memory does not tax the next.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import ROOT

_CHILD = r"""
import sys, time, gc
kind, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "onnxopt":
    from onnxopt import optimize
    import onnxopt.ir.io, onnxruntime  # imports are not what we measure
    t = time.perf_counter()
    optimize(src, output=dst)
    print(time.perf_counter() - t)
else:
    import onnx_ir as ir
    t = time.perf_counter()
    ir.save(ir.load(src), dst)
    print(time.perf_counter() - t)
"""


def run_child(kind: str, src: Path, dst: Path) -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD, kind, str(src), str(dst)], check=True,
                         capture_output=True, text=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


SHAPES = ("synthetic", "shared_zero_chain", "fold_chain")


def bench_scaling(sizes: list[int], repeat: int, work: Path, shape: str = "synthetic") -> list[dict]:
    import onnx

    from onnxopt.models import synthetic

    build = synthetic.build if shape == "synthetic" else getattr(synthetic, shape)
    rows = []
    prev = None
    for n in sizes:
        src = work / f"{shape}_{n}.onnx"
        model = build(n)
        onnx.save(model, src)
        nodes = len(model.graph.node)
        del model
        times = [run_child("onnxopt", src, work / f"{shape}_{n}.opt.onnx") for _ in range(repeat)]
        med = statistics.median(times)
        row = {"nodes": nodes, "median_s": round(med, 4), "min_s": round(min(times), 4),
               "us_per_node": round(med / nodes * 1e6, 2)}
        if prev is not None:
            row["ratio_to_previous"] = round(med / prev["median_s"], 2)
            row["size_ratio"] = round(nodes / prev["nodes"], 2)
        rows.append(row)
        prev = row
        print(f"  {shape} {nodes:>7} nodes: median {med:.3f} s ({row['us_per_node']} us/node)"
              + (f", {row['ratio_to_previous']}x the previous size" if "ratio_to_previous" in row else ""),
              flush=True)
    return rows


def bench_resnet(path: Path, repeat: int, work: Path) -> dict:
    bare, opt = [], []
    for _ in range(repeat):  # interleaved
        bare.append(run_child("bare", path, work / "resnet_bare.onnx"))
        opt.append(run_child("onnxopt", path, work / "resnet_opt.onnx"))
    row = {"model": path.name, "bare_median_s": round(statistics.median(bare), 4),
           "onnxopt_median_s": round(statistics.median(opt), 4)}
    row["ratio"] = round(row["onnxopt_median_s"] / row["bare_median_s"], 2)
    print(f"  {path.name}: bare onnx_ir load+save {row['bare_median_s']:.3f} s, onnxopt optimize "
          f"{row['onnxopt_median_s']:.3f} s, ratio {row['ratio']}x", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.engine", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES),
                   help="which models to scale (default: all)")
    p.add_argument("--resnet", type=Path, help="a resnet50 ONNX file with BatchNormalization kept")
    p.add_argument("--no-resnet", action="store_true")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
               "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("optimize time vs graph size:")
        for shape in args.shapes:
            results["scaling" if shape == "synthetic" else f"scaling_{shape}"] = bench_scaling(
                args.sizes, args.repeat, work, shape)
        if not args.no_resnet:
            path = args.resnet
            if path is None:
                from onnxopt.models import torchvision_models

                path = torchvision_models.export("resnet50", work / "resnet50_legacy.onnx")
            print("resnet50, optimize vs bare onnx_ir load+save:")
            results["resnet50"] = bench_resnet(path, args.repeat, work)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
