"""Where the time goes, per op type, in a float model and its int8 version on onnxruntime CPU.

    python -m scripts.oracles.quant_profile FLOAT.onnx INT8.onnx [--runs 200] [--json OUT.json]

Both models run with onnxruntime's profiler on (default session options otherwise), on the zoo's
realistic input when the model is in the zoo (else generated inputs), after a warm-up; the kernel
events are summed per op type (the kernel onnxruntime runs: QLinearConv, Conv, QuantizeLinear...),
divided by the runs, and printed side by side with each one's share of the total. The sum of kernel
times is below the wall time (the session's own overhead is not a kernel).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np



def _feeds(path: str) -> dict:
    from onnxopt.models import zoo
    from onnxopt.verify.inputs import make_inputs

    stem = Path(path).stem
    for spec in zoo.SPECS:
        if spec.name == stem:
            return spec.inputs(Path(path))
    import onnx

    return make_inputs(onnx.load(path, load_external_data=False))


def profile(path: str, feeds: dict, runs: int) -> dict:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "p")
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        feed = {k: v for k, v in feeds.items() if k in names}
        for _ in range(10):
            sess.run(None, feed)
        for _ in range(runs):
            sess.run(None, feed)
        events = json.load(open(sess.end_profiling()))
    per_op: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.Counter()
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        op = e.get("args", {}).get("op_name", "?")
        per_op[op] += e["dur"] / 1000.0
        count[op] += 1
    total_runs = runs + 10
    return {op: {"ms_per_run": per_op[op] / total_runs, "kernels_per_run": count[op] / total_runs} for op in per_op}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.quant_profile", description=__doc__.splitlines()[0])
    p.add_argument("float_model")
    p.add_argument("int8_model")
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--json")
    a = p.parse_args(argv)
    feeds = _feeds(a.float_model)
    res = {"float": profile(a.float_model, feeds, a.runs), "int8": profile(a.int8_model, feeds, a.runs)}
    tot = {k: sum(v["ms_per_run"] for v in r.values()) for k, r in res.items()}
    ops = sorted(set(res["float"]) | set(res["int8"]),
                 key=lambda o: -max(res["float"].get(o, {}).get("ms_per_run", 0), res["int8"].get(o, {}).get("ms_per_run", 0)))
    print(f"| op (kernel) | float ms/run | share | int8 ms/run | share | kernels/run float, int8 |")
    print("|---|---|---|---|---|---|")
    for op in ops:
        f, q = res["float"].get(op, {}), res["int8"].get(op, {})
        fm, qm = f.get("ms_per_run", 0.0), q.get("ms_per_run", 0.0)
        print(f"| {op} | {fm:.3f} | {100 * fm / tot['float']:.0f}% | {qm:.3f} | {100 * qm / tot['int8']:.0f}% | "
              f"{f.get('kernels_per_run', 0):.0f}, {q.get('kernels_per_run', 0):.0f} |")
    print(f"| total (kernels) | {tot['float']:.3f} | | {tot['int8']:.3f} | | |")
    if a.json:
        Path(a.json).write_text(json.dumps({"totals_ms": tot, **res}, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
