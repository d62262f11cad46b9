"""Optimize time against its bounds (issue 28, point 8): the default optimize at most 1.5x a bare
onnx_ir load+save on the synthetic conv/BN chain (whole process, best of N), and no slower than onnxsim
on the zoo models (in process, median of N; within 10% counts as even under 100 ms).

    python -m scripts.bench.optimize_time [--sizes 1000 10000 100000] [--repeat 3]
        [--zoo ppocrv4-det resnet50-dynamo ...] [--zoo-repeat 11] [--without PASS ...] [--tree NAME=PATH ...]
        [--out FILE.json]

``--tree NAME=PATH`` times another checkout too (``PYTHONPATH=PATH``: a tree exported with ``git archive``
whose ``onnxopt/rules`` and ``onnxopt/models`` link to its ``rules/`` and ``models/``), interleaved run by
run with this one, so that a shared machine's load falls on both alike; each tree's optimize is checked
to write the same bytes as the first tree's (``same_output``). The JSON keeps every run's seconds, the
machine (CPU, cores, load before and after) and the figures: ``ratio`` (best optimize / best bare) per
size and tree, and ``vs_onnxsim`` (median optimize / median onnxsim) per zoo model and tree, with its 90%
paired bootstrap interval (``onnxopt.verify.runtime.ratio_interval``; the two alternate run by run);
``not_slower`` when the median ratio meets the bound and the interval's top is within 0.03 of it. Each
tree's bytecode is compiled before the timing, as an installed package has it (pip compiles it), so no
run pays for compiling sources.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from onnxopt.verify.runtime import ratio_interval
from scripts import ROOT  # the repository root

COMPILED = ("onnxopt", "rules", "models")  # a tree's Python sources
BARE = "import onnx_ir as ir, sys; ir.save(ir.load(sys.argv[1]), sys.argv[2])"
# in process: one warm-up each, then optimize and onnxsim alternately, `repeat` times each
ZOO = r"""
import json, statistics, sys, time
import onnx, onnxsim
from onnxopt import optimize
src, dst, repeat, without = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]

def ours():  # the default optimize, as a user calls it (no report asked for: its figures are not computed)
    optimize(src, output=dst)

def ours_without():  # (--without PASS...: what those passes cost; the bytes are compared too)
    optimize(src, output=dst + ".without.onnx", disable=without)

def theirs():
    simplified, ok = onnxsim.simplify(onnx.load(src))
    onnx.save(simplified, dst + ".sim.onnx")

tools = [("onnxopt", ours), ("onnxsim", theirs)] + ([("onnxopt_without", ours_without)] if without else [])
for name, f in tools:
    f()
runs = {name: [] for name, _ in tools}
for _ in range(repeat):
    for name, f in tools:
        t = time.perf_counter(); f(); runs[name].append(time.perf_counter() - t)
print(json.dumps(runs))
"""


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _env(tree: Path | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    return env


def timed(cmd: list[str], env: dict, cwd: str) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return seconds


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def scaling(sizes, repeat, trees, work: Path) -> dict:
    out = {}
    first = next(iter(trees))
    for n in sizes:
        src = work / f"synthetic-{n}.onnx"
        if not src.exists():
            subprocess.run([sys.executable, "-m", "onnxopt.models.synthetic", "--nodes", str(n), "--out", str(src)],
                           env=_env(trees[first]), cwd=str(work), check=True, capture_output=True)
        runs = {"bare": [], **{name: [] for name in trees}}
        hashes = {}
        for _ in range(repeat):  # interleaved: bare, then each tree, per round
            runs["bare"].append(timed([sys.executable, "-c", BARE, str(src), str(work / "bare.onnx")],
                                      _env(None), str(work)))
            for name, tree in trees.items():
                dst = work / f"{name}-{n}.onnx"
                runs[name].append(timed([sys.executable, "-m", "onnxopt", str(src), "-o", str(dst)], _env(tree),
                                        str(work)))
                hashes[name] = digest(dst)
        best = {k: min(v) for k, v in runs.items()}
        out[str(n)] = {"runs_s": runs, "best_s": best,
                       "ratio": {name: round(best[name] / best["bare"], 3) for name in trees},
                       "same_output": {name: hashes[name] == hashes[first] for name in trees}}
        print(f"{n:>7} nodes: bare {best['bare']:.2f} s; " +
              "; ".join(f"{name} {best[name]:.2f} s ({best[name] / best['bare']:.2f}x)" for name in trees),
              flush=True)
    return out


def zoo(models, repeat, trees, work: Path, without: list[str]) -> dict:
    out = {}
    cache = Path(os.environ.get("ONNXOPT_CACHE", Path.home() / ".cache" / "onnxopt" / "models"))
    for model in models:
        src = cache / f"{model}.onnx"
        if not src.exists():
            print(f"{model}: not built (python -m onnxopt.models build --only {model})", flush=True)
            continue
        rows = {}
        for name, tree in trees.items():
            dst = work / f"{name}-{model}.onnx"
            proc = subprocess.run([sys.executable, "-c", ZOO, str(src), str(dst), str(repeat), *without],
                                  env=_env(tree), cwd=str(work), capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{model} ({name}): {proc.stderr.strip()[-2000:]}")
            runs = json.loads(proc.stdout.strip().splitlines()[-1])
            med = {k: statistics.median(v) for k, v in runs.items()}
            # the ratio of medians with its 90% paired bootstrap interval (the runs alternate, round by round)
            ci = ratio_interval(runs["onnxsim"], runs["onnxopt"])
            ratio = ci["ratio"]
            high = ci["interval"][1] if ci["interval"] else ratio
            bound = 1.1 if med["onnxopt"] < 0.1 else 1.0  # (within 10% is even for models under 100 ms)
            even = ratio <= bound and high <= bound + 0.03  # "at most X": the median, and the interval's top within 0.03
            rows[name] = {"runs_s": runs, "median_s": med, "vs_onnxsim": round(ratio, 3),
                          "interval": [round(x, 3) for x in ci["interval"]] if ci["interval"] else None,
                          "bound": bound, "not_slower": even, "sha256": digest(dst)}
            span = f", 90% interval {ci['interval'][0]:.2f}-{ci['interval'][1]:.2f}" if ci["interval"] else ""
            extra = ""
            if without:
                off = ratio_interval(runs["onnxsim"], runs["onnxopt_without"])
                same = digest(Path(str(dst) + ".without.onnx")) == rows[name]["sha256"]
                rows[name]["without"] = {"passes": without, "vs_onnxsim": round(off["ratio"], 3), "same_output": same,
                                         "interval": [round(x, 3) for x in off["interval"]] if off["interval"] else None}
                extra = f"; without {'/'.join(without)}: {off['ratio']:.2f}x ({'same bytes' if same else 'other bytes'})"
            print(f"{model} ({name}): onnxopt {med['onnxopt'] * 1000:.0f} ms, onnxsim {med['onnxsim'] * 1000:.0f} ms "
                  f"({ratio:.2f}x{span}{'' if even else ', SLOWER'}){extra}", flush=True)
        first = next(iter(rows.values()))["sha256"] if rows else None
        for row in rows.values():
            row["same_output"] = row["sha256"] == first
        out[model] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="*", type=int, default=[1000, 10000, 100000])
    p.add_argument("--repeat", type=int, default=3, help="whole-process runs per size and tree (best taken)")
    p.add_argument("--zoo", nargs="*", default=[], help="zoo models to time against onnxsim, in process")
    p.add_argument("--zoo-repeat", type=int, default=11,
                   help="in-process runs per zoo model (median taken; 10 or more give the interval)")
    p.add_argument("--without", nargs="*", default=[], metavar="PASS",
                   help="zoo: also time optimize with these passes disabled (what they cost; same bytes checked)")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="another checkout to time too (PYTHONPATH=PATH), interleaved with this one")
    p.add_argument("--name", default="this", help="the name of this checkout in the results")
    p.add_argument("--work", type=Path, help="where the synthetic models and outputs go (default: a temporary folder)")
    p.add_argument("--out", type=Path, help="write the results here (JSON)")
    args = p.parse_args(argv)
    trees: dict[str, Path | None] = {}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        if not path:
            p.error(f"--tree {spec}: NAME=PATH")
        trees[name] = Path(path).resolve()
    trees[args.name] = ROOT
    for tree in trees.values():  # bytecode compiled first, as an installed package has it (pip compiles it)
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *(str(tree / d) for d in COMPILED)],
                       check=True, capture_output=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""})
    result = {"machine": machine(), "load_before": load(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "trees": {k: str(v) for k, v in trees.items()}}
    with tempfile.TemporaryDirectory(prefix="bench-optimize-time-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result["scaling"] = scaling(args.sizes, args.repeat, trees, work)
        result["zoo"] = zoo(args.zoo, args.zoo_repeat, trees, work, args.without)
    result["load_after"] = load()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
