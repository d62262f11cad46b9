"""Does optimize leave the peak activation memory above the input's? Every zoo model, and random graphs.

    python -m scripts.oracles.memory_rises [--models NAME ...] [--random N] [--sizes 30 60] [--no-zoo]
                                           [--out scripts/results/memory/rises.json]

Each zoo model through ``optimize(..., return_report=True)`` for the targets portable, ort-cpu and
ort-cuda, with its inputs left dynamic (sized at the verifier's run shapes) and fixed to the zoo
inputs' shapes: the report's two figures before and after (liveness over the nodes' order, and over
the order onnxruntime runs them in), how many copies the ``memory_recomputation`` pass made, and
whether either figure ended above the input's (not counted where the input's figure is a lower
bound: sizes shape inference leaves unknown). Then ``N`` random graphs full of twins
(``tests/test_memory.py``'s ``_random_twins``, seed k with ``sizes[k % len(sizes)]`` nodes; 60 and 30
by default): how many end above the input with the pass and without it, in each order. Exit 1 when anything ends above its input.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from scripts import RESULTS

OUT = RESULTS / "memory" / "rises.json"
TARGETS = ("portable", "ort-cpu", "ort-cuda")


def _rose(before: dict, after: dict) -> bool:
    return not before["lower_bound"] and (after["peak_bytes"] > before["peak_bytes"] or
                                          after["onnxruntime_peak_bytes"] > before["onnxruntime_peak_bytes"])


def main(argv: list[str] | None = None) -> int:
    from onnxopt import optimize
    from onnxopt.models import zoo

    p = argparse.ArgumentParser(prog="python -m scripts.oracles.memory_rises", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", help="zoo models (default: every one that is built)")
    p.add_argument("--random", type=int, default=600, help="random graphs (default 600)")
    p.add_argument("--sizes", type=int, nargs="+", default=[60, 30], help="their node counts, in turn (default 60 30)")
    p.add_argument("--no-zoo", action="store_true", help="the random graphs only")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    rows, rose = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in [] if args.no_zoo else args.models or [spec.name for spec in zoo.SPECS]:
            spec = zoo.get(name)
            if not spec.path().exists():
                print(f"{name:<26} not built", flush=True)
                continue
            fixed = {k: list(v.shape) for k, v in spec.inputs(spec.path()).items()}
            for shapes in (None, fixed):
                for target in TARGETS:
                    _, report = optimize(str(spec.path()), output=str(Path(tmp) / "out.onnx"), target=target,
                                         input_shapes=shapes, return_report=True)
                    b, a = report.memory["before"], report.memory["after"]
                    row = {"model": name, "target": target, "shapes": "fixed" if shapes else "dynamic",
                           "before": [b["peak_bytes"], b["onnxruntime_peak_bytes"]],
                           "after": [a["peak_bytes"], a["onnxruntime_peak_bytes"]],
                           "lower_bound": b["lower_bound"], "copies": report.rules["memory_recomputation"].fired,
                           "rose": _rose(b, a)}
                    rose += row["rose"]
                    rows.append(row)
                    copies = f"  {row['copies']} copies" if row["copies"] else ""
                    print(f"{name:<26} {target:<9} {row['shapes']:<8} nodes' order {b['peak_bytes']:>10} -> "
                          f"{a['peak_bytes']:>10}  onnxruntime's {b['onnxruntime_peak_bytes']:>10} -> "
                          f"{a['onnxruntime_peak_bytes']:>10}{'  (input: at least)' if b['lower_bound'] else ''}"
                          f"{copies}"
                          f"{'  ROSE' if row['rose'] else ''}", flush=True)
    from tests.helpers import random_twins

    random = {"graphs": args.random, "sizes": args.sizes, "rose_with_pass": 0, "rose_without_pass": 0,
              "rose_with_pass_nodes_order": 0, "rose_with_pass_onnxruntime_order": 0, "largest_rise_bytes": 0}
    for seed in range(args.random):
        m = random_twins(seed, args.sizes[seed % len(args.sizes)])
        for key, disable in (("rose_with_pass", []), ("rose_without_pass", ["memory_recomputation"])):
            report = optimize(m, return_report=True, disable=disable)[1]
            b, a = report.memory["before"], report.memory["after"]
            rose_here = _rose(b, a)
            random[key] += rose_here
            if rose_here and not disable:
                random["rose_with_pass_nodes_order"] += a["peak_bytes"] > b["peak_bytes"]
                random["rose_with_pass_onnxruntime_order"] += a["onnxruntime_peak_bytes"] > b["onnxruntime_peak_bytes"]
                random["largest_rise_bytes"] = max(random["largest_rise_bytes"], a["peak_bytes"] - b["peak_bytes"],
                                                   a["onnxruntime_peak_bytes"] - b["onnxruntime_peak_bytes"])
    rose += random["rose_with_pass"]
    print(f"random graphs with twins ({'/'.join(map(str, args.sizes))} nodes): {random['rose_without_pass']} of "
          f"{args.random} end above the input without the pass, {random['rose_with_pass']} with it (nodes' order "
          f"{random['rose_with_pass_nodes_order']}, onnxruntime's {random['rose_with_pass_onnxruntime_order']}, "
          f"at most {random['largest_rise_bytes']} bytes)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"zoo": rows, "random": random}, indent=1) + "\n")
    return 1 if rose else 0


if __name__ == "__main__":
    raise SystemExit(main())
