"""Check exact mode on the zoo: ``optimize(exact=True)`` must give every model's outputs bit for bit
(NaN where NaN, the sign of zero included) on onnxruntime's CPU provider with its default session
options, at 1 and 2 intra-op threads; the default mode is shown beside it.

    python -m scripts.oracles.zoo_exact [--cache DIR] [--models NAME ...] [--json OUT.json]

One line per model: nodes (original, default, exact), then for each mode whether the outputs are
bit-identical at 1 and 2 threads and the largest absolute difference. Exit 1 when exact mode is
not bit-identical on some model (the JSON, if asked for, is written first).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from onnxopt import optimize
from onnxopt.models import zoo

THREADS = (1, 2)


def identical(a: np.ndarray, b: np.ndarray) -> bool:
    """The same shape, dtype and bits (NaN where NaN, signs of zero and of NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind != "f":
        return bool(np.array_equal(a, b))
    return bool(np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b)))


def outputs(model: bytes, feeds: dict, threads: int) -> list[np.ndarray]:
    """onnxruntime CPU, default session options, ``threads`` intra-op threads."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})]


def compare(original: bytes, optimized: bytes, feeds: dict) -> dict:
    """Per thread count, whether ``optimized`` gives ``original``'s bits; the largest |a - b|."""
    result: dict = {"identical": {}, "max_abs": 0.0}
    for threads in THREADS:
        a, b = outputs(original, feeds, threads), outputs(optimized, feeds, threads)
        result["identical"][threads] = len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
        with np.errstate(invalid="ignore"):
            for x, y in zip(a, b):
                if x.shape == y.shape and x.size and x.dtype.kind in "fiub":
                    d = np.abs(x.astype(np.float64) - y.astype(np.float64))
                    result["max_abs"] = max(result["max_abs"], float(np.nanmax(d)) if not np.isnan(d).all() else 0.0)
    return result


def check_model(path: Path, feeds: dict) -> dict:
    original = path.read_bytes()
    row: dict = {}
    for mode, exact in (("default", False), ("exact", True)):
        optimized, report = optimize(original, exact=exact, return_report=True)
        row["nodes"] = sum(report.before.values())
        row[mode] = {"nodes": sum(report.after.values()), "fired": report.fired,
                     **compare(original, optimized, feeds)}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.zoo_exact", description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, help="zoo cache directory (default $ONNXOPT_CACHE)")
    p.add_argument("--models", nargs="+", help="zoo models (default: every one that is built)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    results, failed = {}, []
    for name in args.models or [spec.name for spec in zoo.SPECS]:
        spec = zoo.get(name)
        path = spec.path(args.cache)
        if not path.exists():
            print(f"{name:<28} not built (python -m onnxopt.models build --only {name})")
            continue
        row = results[name] = check_model(path, spec.inputs(path))
        cells = []
        for mode in ("default", "exact"):
            r = row[mode]
            bits = "/".join("same" if r["identical"][t] else "DIFF" for t in THREADS)
            cells.append(f"{mode} {r['nodes']:>5} nodes, bits {bits}, max abs {r['max_abs']:.3g}")
        print(f"{name:<28} {row['nodes']:>5} nodes | " + " | ".join(cells))
        if not all(row["exact"]["identical"].values()):
            failed.append(name)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if failed:
        print(f"exact mode changed the outputs of {len(failed)} of {len(results)} models: {', '.join(failed)}")
        return 1
    print(f"exact mode: outputs bit-identical on all {len(results)} models at {' and '.join(map(str, THREADS))} "
          "intra-op threads (onnxruntime CPU, default session options)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
