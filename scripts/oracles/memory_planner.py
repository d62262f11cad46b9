"""What fixing the input shapes does to onnxruntime's memory, apart from what onnxopt's rewrites do.

    python -m scripts.oracles.memory_planner [--models NAME ...] [--out scripts/results/memory/planner.json]

With every shape known when the session is made, onnxruntime's allocation planner gives a new value a
released buffer of the same shape and holds that buffer from its release to the new value's end (with
the memory arena off, plain liveness would have freed it); with the arena on, the arena keeps what the
first run took. So ``optimize(..., input_shapes=...)`` can show more memory than the dynamic input
did, and the question is which part the rewrites made. Each zoo model, fed its zoo inputs, four ways:

- ``input``: the model as given (dynamic);
- ``shapes fixed``: ``optimize(rules=[], graph_passes=[], input_shapes=...)``: the same graph with its
  inputs fixed to the feeds' shapes, no rewrite;
- ``optimized, fixed``: ``optimize(input_shapes=...)``;
- ``optimized, dynamic``: ``optimize()``, shapes left as they are.

under three session settings: onnxruntime's defaults (arena and memory pattern on, all graph
optimizations), the arena and pattern off with graph optimizations on, and everything off (what
``scripts/oracles/memory_check.py`` compares with the estimate). Measured as memory_check.py measures (a fresh
subprocess, one thread, glibc's mmap threshold at 64 KiB and trim at 0, the kernel's resident
high-water mark reset before each run): the growth of the peak resident set over the first run
(what the arena takes) and over the third (steady state).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts import RESULTS, child_env
from scripts.oracles.memory_check import MALLOC, load_feeds, session_options, status, zoo_feeds  # the measurement's own pieces

OUT = RESULTS / "memory" / "planner.json"
MODELS = ["bert-legacy", "bert-dynamo", "minilm-legacy", "minilm-dynamo", "gpt2-legacy", "resnet50-legacy"]
SETTINGS = {"defaults": (True, True, True), "arena and pattern off": (False, False, True),
            "all off": (False, False, False)}


def child(model: str, feeds_path: str, setting: str) -> list[int]:
    """In the subprocess: the peak resident growth over each of three runs."""
    import onnxruntime as ort

    arena, pattern, optimized = SETTINGS[setting]
    sess = ort.InferenceSession(model, session_options(arena, pattern, optimized), providers=["CPUExecutionProvider"])
    feeds = load_feeds(feeds_path)
    growth = []
    for _ in range(3):
        Path("/proc/self/clear_refs").write_text("5")
        before = status()
        outs = sess.run(None, feeds)
        growth.append(status()["VmHWM"] - before["VmRSS"])
        del outs
    return growth


def measure(model: Path, feeds_path: Path, setting: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "scripts.oracles.memory_planner", "--child", str(model),
                           str(feeds_path), setting],
                          capture_output=True, text=True, env={**child_env(), **MALLOC}, timeout=600)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    first, _, third = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"first_run": first, "steady": third}


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:5])))
        return 0
    from onnxopt import optimize

    p = argparse.ArgumentParser(prog="python -m scripts.oracles.memory_planner", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            got = zoo_feeds(name, Path(tmp))
            if got is None:
                print(f"{name:<18} not built", flush=True)
                continue
            src, _, shapes, feeds_path = got
            variants = {"input": src}
            for label, kwargs in (("shapes fixed", {"input_shapes": shapes, "rules": [], "graph_passes": []}),
                                  ("optimized, fixed", {"input_shapes": shapes}), ("optimized, dynamic", {})):
                path = Path(tmp) / f"{name}.{len(variants)}.onnx"
                optimize(str(src), output=str(path), **kwargs)
                variants[label] = path
            row = {"shapes": shapes}
            for setting in SETTINGS:
                row[setting] = {label: measure(path, feeds_path, setting) for label, path in variants.items()}
                print(f"{name:<18} {setting:<22} " + "  ".join(
                    f"{label}: {m.get('first_run', 0) / 2**20:6.2f}/{m.get('steady', 0) / 2**20:6.2f}"
                    for label, m in row[setting].items()), flush=True)
            rows[name] = row
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"method": __doc__.split("\n\n", 2)[2].strip(), "unit": "bytes",
                                    "models": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
