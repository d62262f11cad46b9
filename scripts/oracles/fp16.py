"""fp16 conversion on the zoo, verified on onnxruntime: fidelity, Casts, kernels by provider, latency.

    python -m scripts.oracles.fp16 [--models NAME ...] [--target ort-cuda] [--provider cuda] [--runs N]
                                   [--cache DIR] [--json OUT.json]

For each model (built into the zoo cache when absent): ``optimize(precision="fp16", target=...,
verify=provider)`` on the zoo's realistic inputs (with the fidelity fallback those inputs drive),
then the verifier's report against the float32 original: per output cosine, max abs error over the
range, top-1 agreement for logits (on the provider, and in float16 arithmetic: ``fp16_arithmetic``),
the kernels per run by provider (nodes onnxruntime left on the CPU, Memcpy), and the interleaved
latency of the original and the fp16 model. A model that fails is a row with its one-line error.
On the GPU machine: ``--provider cuda`` (see scripts/gpu/bench.sh for the setup lines).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import onnx

from onnxopt import optimize
from onnxopt.models import zoo

DEFAULT_MODELS = ["bert-legacy", "bert-dynamo", "gpt2-legacy", "gpt2-dynamo", "minilm-legacy", "minilm-dynamo",
                  "resnet50-legacy", "mobilenet_v2-legacy", "ppocrv4-det", "ppocrv4-rec"]


def check(name: str, target: str, provider: str, runs: int, cache) -> dict:
    spec = zoo.get(name)
    path = spec.path(cache)
    if not path.exists():
        zoo.build([name], cache=cache)
    feeds = spec.inputs(path)
    t0 = time.perf_counter()
    _, rep = optimize(onnx.load(str(path)), precision="fp16", target=target, return_report=True, verify=provider,
                      verify_options={"feeds": feeds, "runs": runs, "warmup": 5})
    v = rep.verification
    entry = v["providers"][provider]
    row = {"model": name, "target": target, "provider": provider, "ok": v["ok"],
           "seconds": round(time.perf_counter() - t0, 2),
           "casts": rep.precision["casts"], "nodes_fp16": rep.precision["nodes_fp16"],
           "nodes_fp32": rep.precision["nodes_fp32"], "kept_fp32": rep.precision["kept_fp32"],
           "fallback": rep.precision.get("fallback"), "warnings": rep.warnings,
           "outputs": [{k: r.get(k) for k in ("name", "ok", "cosine", "error_of_range", "top1_agreement", "problem")}
                       for r in entry["outputs"]],
           # onnxruntime's CPU provider computes many float16 ops in float32: the verdict in float16
           # arithmetic (every op's output rounded to float16; onnxopt.verify.fp16) is the one that counts
           "fp16_arithmetic": {"arithmetic": v.get("fp16", {}).get("arithmetic"), "ok": v.get("fp16", {}).get("ok"),
                               "outputs": [{k: r.get(k) for k in ("name", "ok", "cosine", "error_of_range",
                                                                  "top1_agreement", "problem")}
                                           for r in v.get("fp16", {}).get("outputs") or ()]},
           "ranges": rep.precision.get("ranges"),
           "kernels": entry.get("kernels"), "latency": entry.get("latency")}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.oracles.fp16", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--target", default="ort-cuda")
    ap.add_argument("--provider", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--runs", type=int, default=20, help="timed interleaved runs (0: no latency)")
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for name in args.models:
        try:
            row = check(name, args.target, args.provider, args.runs, args.cache)
        except Exception as exc:  # noqa: BLE001 - one model's failure is its row
            row = {"model": name, "ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        rows.append(row)
        if "error" in row:
            print(f"{name:22s} ERROR {row['error']}", flush=True)
            continue
        worst = min((o["cosine"] for o in row["outputs"] if o.get("cosine") is not None), default=None)
        err = max((o["error_of_range"] for o in row["outputs"] if o.get("error_of_range") is not None), default=None)
        top1 = [o["top1_agreement"] for o in row["outputs"] if o.get("top1_agreement") is not None]
        lat = row.get("latency") or {}
        kern = (row.get("kernels") or {}).get("after", {})
        print(f"{name:22s} {'ok ' if row['ok'] else 'BAD'} cos {worst if worst is None else round(worst, 6)} "
              f"err/range {err if err is None else round(err, 5)} top1 {min(top1) if top1 else '-'} "
              f"casts {row['casts']} kept {len((row['fallback'] or {}).get('kept', []))} "
              f"lat {lat.get('before', {}).get('median_ms', '-')} -> {lat.get('after', {}).get('median_ms', '-')} ms "
              f"kernels {kern.get('kernels')} {json.dumps(kern.get('by_provider'))} memcpy {kern.get('memcpy')}",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
