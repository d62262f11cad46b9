"""What fixing the input shapes buys: the zoo's transformer models (BERT, GPT-2, all-MiniLM-L6-v2,
legacy and dynamo exports; dynamic batch and sequence) optimized as they are and with batch and
sequence fixed (``optimize(input_shapes=...)``), on onnxruntime CPU.

    python -m scripts.bench.input_shapes [--models NAME ...] [--batch 1] [--sequence 128]
                                         [--runs 50] [--warmup 5] [--threads 1]
                                         [--json scripts/results/input-shapes-cpu.json]

Per model, four variants run on the same inputs (the zoo's realistic token ids, the first
``--batch`` rows cut to ``--sequence`` tokens):

- original: the export as it is (dynamic);
- fixed: the export with its inputs fixed and nothing rewritten (``optimize(rules=[])``), to
  separate what onnxruntime does with static shapes from what onnxopt's rules fold;
- onnxopt: ``optimize(model)`` (dynamic axes kept);
- onnxopt-fixed: ``optimize(model, input_shapes=...)``.

Reported: nodes, optimize seconds, kernels onnxruntime's CPU provider runs per run (its
profiler, ``onnxopt.verify.count_kernels``) and by op type, latency (interleaved runs after a
warm-up: median, 10th and 90th percentiles, ratios to the original's median), and the largest
difference of every output from the original's (``onnxopt.verify.compare_all``: ok within the
float32 tolerances).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scripts import RESULTS
from scripts.bench.peers import machine_info, onnxopt_commit, versions

MODELS = [f"{kind}-{exporter}" for kind in ("bert", "gpt2", "minilm") for exporter in ("legacy", "dynamo")]
VARIANTS = ("original", "fixed", "onnxopt", "onnxopt-fixed")


def _variants(src: Path, shapes: dict[str, list[int]], work: Path) -> dict[str, dict]:
    """Write the four variants of ``src``; their paths, node counts and optimize seconds."""
    import onnx

    from onnxopt import optimize

    out = {"original": {"path": src, "optimize_s": None}}
    for name, kwargs in (("fixed", {"rules": [], "input_shapes": shapes}), ("onnxopt", {}),
                         ("onnxopt-fixed", {"input_shapes": shapes})):
        path = work / f"{src.stem}.{name}.onnx"
        t0 = time.perf_counter()
        optimize(str(src), output=str(path), **kwargs)
        out[name] = {"path": path, "optimize_s": round(time.perf_counter() - t0, 3)}
    for entry in out.values():
        entry["nodes"] = len(onnx.load(str(entry["path"]), load_external_data=False).graph.node)
    return out


def _percentiles(times_ms: list[float]) -> dict[str, float]:
    return {"median_ms": round(float(np.median(times_ms)), 4), "p10_ms": round(float(np.percentile(times_ms, 10)), 4),
            "p90_ms": round(float(np.percentile(times_ms, 90)), 4)}


def bench_model(name: str, src: Path, feeds: dict[str, np.ndarray], args, work: Path) -> dict:
    from onnxopt.verify import compare_all, measure_latency, run_profiled

    shapes = {k: list(v.shape) for k, v in feeds.items()}
    variants = _variants(src, shapes, work)
    rows: dict[str, dict] = {}
    reference = None
    for label in VARIANTS:
        v = variants[label]
        outputs, kernels, _ = run_profiled(str(v["path"]), feeds, "cpu", threads=args.threads)
        reference = outputs if reference is None else reference
        compared = compare_all(reference, outputs)
        rows[label] = {"nodes": v["nodes"], "optimize_s": v["optimize_s"], "kernels": kernels["kernels"],
                       "kernels_by_op": kernels["by_op"], "outputs_ok": all(r["ok"] for r in compared),
                       "max_abs_diff": max((r.get("max_abs", 0.0) for r in compared), default=0.0)}
    lat = measure_latency({label: str(variants[label]["path"]) for label in VARIANTS}, feeds, provider="cpu",
                          runs=args.runs, warmup=args.warmup, threads=args.threads, budget_s=args.latency_budget)
    base = lat["results"]["original"]["median_ms"]
    for label, res in lat["results"].items():
        rows[label]["latency"] = {**_percentiles(res["times_ms"]), "ratio_median": round(res["median_ms"] / base, 4)}
    return {"input_shapes": shapes, "rounds": lat["rounds"], "errors": lat["errors"], "variants": rows}


def table(report: dict) -> str:
    lines = ["model            variant        nodes  kernels  median ms  p10 ms  p90 ms  x orig  outputs",
             "---------------  -------------  -----  -------  ---------  ------  ------  ------  -------"]
    for name, res in report["models"].items():
        if "variants" not in res:
            lines.append(f"{name:<15}  {res.get('skipped') or res.get('error')}")
            continue
        for label, row in res["variants"].items():
            lat = row.get("latency", {})
            ok = "ok" if row["outputs_ok"] else "DIFFER"
            lines.append(f"{name:<15}  {label:<13}  {row['nodes']:>5}  {row['kernels']:>7}  "
                         f"{lat.get('median_ms', float('nan')):>9.3f}  {lat.get('p10_ms', float('nan')):>6.3f}  "
                         f"{lat.get('p90_ms', float('nan')):>6.3f}  {lat.get('ratio_median', float('nan')):>6.3f}  "
                         f"{ok} ({row['max_abs_diff']:.2g})")
    return "\n".join(lines)


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.input_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=MODELS, metavar="NAME", help="zoo models (default: the six "
                   "transformer exports)")
    p.add_argument("--batch", type=int, default=1, help="batch size fixed (default 1)")
    p.add_argument("--sequence", type=int, default=128, help="sequence length fixed (default 128, at most 128)")
    p.add_argument("--runs", type=int, default=50, help="timed interleaved rounds (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up runs per session (default 5)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1; 0: its choice)")
    p.add_argument("--latency-budget", type=float, default=120.0, metavar="S",
                   help="seconds of timed rounds per model, at most (fewer rounds then; default 120)")
    p.add_argument("--cache", type=Path, default=None, help="zoo cache directory (default $ONNXOPT_CACHE)")
    p.add_argument("--json", type=Path, default=RESULTS / "input-shapes-cpu.json",
                   help="where to write the report (default scripts/results/input-shapes-cpu.json)")
    args = p.parse_args(argv)
    if not (1 <= args.batch <= 2 and 1 <= args.sequence <= 128):
        p.error("the zoo's inputs hold 2 rows of 128 tokens: --batch 1..2, --sequence 1..128")
    if args.runs < 1 or args.warmup < 1:
        p.error("--runs and --warmup take at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from onnxopt.models import zoo

    try:
        specs = [zoo.get(n) for n in args.models]
    except KeyError as exc:
        print(f"scripts.bench.input_shapes: error: {exc.args[0]}", file=sys.stderr)
        return 2
    cache = args.cache or zoo.DEFAULT_CACHE
    report = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m scripts.bench.input_shapes " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info(), "versions": {**versions([]), "onnxruntime": _ort_version()},
        "onnxopt_commit": onnxopt_commit(),
        "options": {"batch": args.batch, "sequence": args.sequence, "runs": args.runs, "warmup": args.warmup,
                    "threads": args.threads, "provider": "cpu"}}, "models": {}}
    built = zoo.build([s.name for s in specs], cache=cache, log=lambda s: print("  " + s, flush=True))
    with tempfile.TemporaryDirectory(prefix="onnxopt-bench-shapes-") as work:
        for spec in specs:
            where = built.get(spec.name)
            if not isinstance(where, Path):
                report["models"][spec.name] = {"skipped": str(where)}
                continue
            print(f"{spec.name} ...", flush=True)
            feeds = {k: np.ascontiguousarray(v[:args.batch, :args.sequence]) for k, v in spec.inputs(where).items()}
            report["models"][spec.name] = bench_model(spec.name, where, feeds, args, Path(work))
            args.json.write_text(json.dumps(report, indent=1) + "\n")  # partial results survive an interruption
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
