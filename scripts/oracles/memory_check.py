"""Peak activation memory estimates (``onnxopt.transforms.memory.peak``) against what onnxruntime's CPU provider
really allocates, for every zoo model, before and after onnxopt.

    python -m scripts.oracles.memory_check [--models NAME ...] [--out scripts/results/memory/check.json]
    python -m scripts.oracles.memory_check --timing [--models NAME ...]   # -> scripts/results/memory/timing.json

``--timing``: what the memory work costs optimize(): the two memory passes (the recomputation's
figure for the input, taken before the first pass and shown by the report as "before", and its check
of the result; the reordering, which shares that check's inference where nothing was copied and gives
the report's "after"), best of three runs per model at the zoo inputs' shapes.

Each model runs at its zoo inputs' shapes (``ModelSpec.inputs``); the estimate is taken at the same
shapes (``input_shapes``), and the optimized model is ``optimize(..., input_shapes=those shapes)``
(so the memory_reordering pass sees static sizes).

The measurement, each run in a fresh subprocess: an InferenceSession with the memory arena and the
memory pattern off (``enable_cpu_mem_arena=False``, ``enable_mem_pattern=False``: every tensor is
its own malloc, freed when the allocation plan says it dies), one intra-op and one inter-op thread,
sequential execution, and glibc's malloc told to serve every block of 64 KiB or more with its own
mmap and to give freed heap memory back (``MALLOC_MMAP_THRESHOLD_=65536``,
``MALLOC_TRIM_THRESHOLD_=0``; glibc's default raises the mmap threshold as blocks are freed, after
which freed activations stay in the process and a peak is invisible). One warm-up run first (code
pages, lazily made kernel state: not activations), then the peak RSS is reset (``echo 5 >
/proc/self/clear_refs``) and the measured run's peak is ``VmHWM`` after it less ``VmRSS`` before it:
the kernel's high-water mark of the resident set during the run, not a sample after it. The feeds
are allocated before (not measured), so the estimate compared is ``peak_bytes - inputs_bytes``; the
outputs, which onnxruntime allocates during the run and returns, are in both.

The estimate compared is ``memory.peak(order="onnxruntime")``: the order onnxruntime runs the nodes
in (its depth-first default, not the file's order) and the buffers its plan shares (views, in-place
activations); ``estimate_graph_order`` is the plain liveness figure over the file's order.

Two graph optimization levels: ``disabled`` (onnxruntime runs the graph as written: what the
estimate models) and ``all`` (its default: its own fusions change the intermediate values).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts import RESULTS, child_env

OUT = RESULTS / "memory" / "check.json"
LEVELS = ("disabled", "all")
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def status() -> dict[str, int]:
    """This process's resident set (VmRSS), its high-water mark (VmHWM) and anonymous part, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def session_options(arena: bool = False, pattern: bool = False, optimized: bool = False):
    """The measured session's options: one intra- and one inter-op thread, sequential, quiet; the memory
    arena, the memory pattern and onnxruntime's graph optimizations as given (off: what the estimate
    models). Shared by memory_planner.py and memory_trace.py."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = arena
    so.enable_mem_pattern = pattern
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return so


def zoo_feeds(name: str, folder: Path):
    """A built zoo model's path, its zoo inputs, their shapes and the .npz they were saved to in
    ``folder`` (for the measuring subprocess); None where the model is not built."""
    import numpy as np

    from onnxopt.models import zoo

    src = zoo.get(name).path()
    if not src.exists():
        return None
    feeds = zoo.get(name).inputs(src)
    feeds_path = Path(folder) / f"{name}.npz"
    np.savez(feeds_path, **feeds)
    return src, feeds, {k: list(v.shape) for k, v in feeds.items()}, feeds_path


def load_feeds(feeds_path: str | Path) -> dict:
    import numpy as np

    with np.load(feeds_path) as data:
        return {k: np.ascontiguousarray(data[k]) for k in data.files}


def child(model: str, feeds_path: str, level: str) -> dict:
    """In the subprocess: the peak resident growth over one run (after a warm-up run)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model, session_options(optimized=level != "disabled"),
                                providers=["CPUExecutionProvider"])
    feeds = load_feeds(feeds_path)
    first = status()
    Path("/proc/self/clear_refs").write_text("5")
    outs = sess.run(None, feeds)
    warm = status()
    warm_growth = warm["VmHWM"] - first["VmRSS"]
    del outs
    Path("/proc/self/clear_refs").write_text("5")
    before = status()
    outs = sess.run(None, feeds)
    after = status()
    return {"growth": after["VmHWM"] - before["VmRSS"], "first_run_growth": warm_growth,
            "outputs_bytes": int(sum(o.nbytes for o in outs if hasattr(o, "nbytes")))}


def measure(model: Path, feeds_path: Path, level: str) -> dict:
    env = {**child_env(), **MALLOC}
    proc = subprocess.run([sys.executable, "-m", "scripts.oracles.memory_check", "--child", str(model), str(feeds_path), level],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _side(model, shapes, feeds_path: Path, path: Path) -> dict:
    from onnxopt.transforms import memory

    est = memory.peak(model, shapes, curve=False, order="onnxruntime")
    expected = est["peak_bytes"] - est["inputs_bytes"]
    row = {"estimate": est["peak_bytes"], "estimate_graph_order": memory.peak(model, shapes, curve=False)["peak_bytes"],
           "inputs_bytes": est["inputs_bytes"], "estimate_run": expected, "unknown": len(est["unknown"]),
           "peak_at": est["peak_at"]["name"], "alive_at_peak": est["alive_at_peak"][:4]}
    for level in LEVELS:
        m = measure(path, feeds_path, level)
        if "growth" in m:
            m["ratio"] = round(m["growth"] / expected, 3) if expected else None
        row[level] = m
    return row


TIMING_MODELS = ["resnet50-legacy", "minilm-legacy", "gpt2-legacy", "bert-dynamo", "ppocrv4-det", "synthetic-1000"]


def timing(names: list[str], out: Path) -> None:
    """The memory work inside optimize(): the two memory passes' seconds (their statistics; the
    recomputation's include the input's figure, taken before the first pass, which the report shows
    as "before"), against optimize()'s total."""
    import time

    from onnxopt import optimize
    from onnxopt.models import zoo

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            spec = zoo.get(name)
            if not spec.path().exists():
                continue
            shapes = {k: list(v.shape) for k, v in spec.inputs(spec.path()).items()}
            best = None
            for _ in range(3):
                t = time.perf_counter()
                _, rep = optimize(str(spec.path()), output=str(Path(tmp) / f"{name}.onnx"), input_shapes=shapes,
                                  return_report=True)
                total = time.perf_counter() - t
                row = (total, rep.rules["memory_recomputation"].seconds, rep.rules["memory_reordering"].seconds)
                best = row if best is None or row[0] < best[0] else best
            total, recompute_s, reorder_s = best
            rows[name] = {"optimize_s": round(total, 3), "recomputation_s": round(recompute_s, 4),
                          "reordering_s": round(reorder_s, 4), "share": round((recompute_s + reorder_s) / total, 4)}
            print(name, rows[name], flush=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:5])))
        return 0
    from onnxopt import optimize
    from onnxopt.models import zoo

    p = argparse.ArgumentParser(prog="python -m scripts.oracles.memory_check", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", help="zoo models (default: every one that is built)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--timing", action="store_true", help="measure what the memory work costs optimize()")
    args = p.parse_args(argv)
    if args.timing:
        timing(args.models or TIMING_MODELS, args.out or OUT.with_name("timing.json"))
        return 0
    args.out = args.out or OUT
    names = args.models or [spec.name for spec in zoo.SPECS]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            got = zoo_feeds(name, Path(tmp))
            if got is None:
                print(f"{name:<26} not built", flush=True)
                continue
            src, _, shapes, feeds_path = got
            opt = Path(tmp) / f"{name}.opt.onnx"
            _, report = optimize(str(src), output=str(opt), input_shapes=shapes, return_report=True)
            row = {"shapes": shapes, "before": _side(str(src), shapes, feeds_path, src),
                   "after": _side(str(opt), None, feeds_path, opt), "reordered": report.memory["reordered"]}
            rows[name] = row
            b, a = row["before"], row["after"]
            print(f"{name:<26} " + "  ".join(
                f"{side}: est {s['estimate_run'] / 2**20:7.2f} MiB meas {s['disabled'].get('growth', 0) / 2**20:7.2f} "
                f"({s['disabled'].get('ratio')}) all {s['all'].get('growth', 0) / 2**20:7.2f}"
                for side, s in (("before", b), ("after", a))) + (" reordered" if row["reordered"] else ""), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"method": __doc__.split("\n\n", 2)[2].strip(), "models": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
