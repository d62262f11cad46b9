"""Where one onnxruntime CPU run's memory goes, node by node: the run ``memory_check.py`` measures
(arena and memory pattern off, one thread, glibc serving blocks of 64 KiB and more by their own
mmap), under ``strace``, with the session's profile saying which node was running when each mapping
came and went.

    python -m scripts.oracles.memory_trace ZOO_NAME [--optimized] [--level disabled|all]
    python -m scripts.oracles.memory_trace --model PATH --feeds FEEDS.npz [--level ...]

One line per mapping of the measured (second) run: ``+`` or ``-``, its size and the total mapped
then (MiB), and the node running (a tensor a kernel allocates, its output or its own working
memory) or ``after NODE`` (a release, between nodes). Last, the peak of the total and
``memory.peak(order="onnxruntime")``'s estimate of it. Needs strace (Linux, ptrace allowed); this is
how the estimate's model of onnxruntime was checked where it parted from the measurement
(BENCHMARKS.md, "Analysis: peak activation memory against onnxruntime").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts import child_env
from scripts.oracles.memory_check import MALLOC, load_feeds, session_options, zoo_feeds  # the run it traces

_BEGIN, _END = b"onnxopt-trace-begin\n", b"onnxopt-trace-end\n"
_CALL = re.compile(r"^\d+\s+(\d+\.\d+) (mmap|munmap)\((.*)\) += (\S+)")  # (strace pads a short pid)


def child(model: str, feeds_path: str, level: str, prefix: str) -> dict:
    """In the traced process: memory_check's session, profiled; markers around the measured run."""
    import onnxruntime as ort

    so = session_options(optimized=level != "disabled")
    so.enable_profiling = True
    so.profile_file_prefix = prefix
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    feeds = load_feeds(feeds_path)
    outs = sess.run(None, feeds)
    del outs
    os.write(2, _BEGIN)
    outs = sess.run(None, feeds)
    os.write(2, _END)
    del outs  # (held through the end marker: onnxruntime's outputs are the caller's)
    return {"start_ns": sess.get_profiling_start_time_ns(), "profile": sess.end_profiling()}


def _nodes(profile: str, start_ns: int) -> list[tuple[float, float, str]]:
    """The last run's kernels: (start, end) in seconds since the epoch, and name [op]."""
    with open(profile) as f:
        events = json.load(f)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    first = runs[-1]["ts"] if runs else 0
    out = []
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first:
            t = start_ns / 1e9 + e["ts"] / 1e6
            out.append((t, t + e["dur"] / 1e6, f"{e['name'][:-len('_kernel_time')]} [{e['args'].get('op_name', '?')}]"))
    return out


def parse(strace_text: str, nodes: list[tuple[float, float, str]]) -> tuple[list[dict], int]:
    """The measured run's anonymous mappings from strace's output (-f -ttt), each with the node it
    falls in; and the peak of the total mapped."""
    lines = strace_text.splitlines()
    begin = next((i for i, line in enumerate(lines) if "onnxopt-trace-begin" in line), None)
    if begin is None:
        return [], 0
    live: dict[str, int] = {}
    total = peak = 0
    events = []
    for line in lines[begin + 1:]:
        if "onnxopt-trace-end" in line:
            break
        m = _CALL.match(line)
        if not m:
            continue
        t, call, args, result = float(m.group(1)), m.group(2), m.group(3).split(", "), m.group(4)
        if call == "mmap":
            if "MAP_ANONYMOUS" not in m.group(3) or not result.startswith("0x"):
                continue
            live[result] = size = int(args[1])
            total += size
            sign = "+"
        else:
            size = live.pop(args[0], None)
            if size is None:
                continue
            total -= size
            sign = "-"
        peak = max(peak, total)
        inside = next((name for a, b, name in nodes if a <= t <= b), None)
        before = [name for a, _, name in nodes if a < t]
        events.append({"sign": sign, "bytes": size, "total": total,
                       "node": inside or f"after {before[-1] if before else '(start)'}"})
    return events, peak


def trace(model: Path, feeds: Path, level: str) -> tuple[list[dict], int]:
    if shutil.which("strace") is None:
        raise SystemExit("memory_trace: needs strace")
    with tempfile.TemporaryDirectory() as tmp:
        out, meta = Path(tmp) / "strace.txt", Path(tmp) / "meta.json"
        cmd = ["strace", "-f", "-ttt", "-e", "trace=mmap,munmap,write", "-e", "signal=none", "-o", str(out),
               sys.executable, "-m", "scripts.oracles.memory_trace", "--child", str(model), str(feeds), level, str(Path(tmp) / "profile"),
               str(meta)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**child_env(), **MALLOC}, timeout=600)
        if proc.returncode or not meta.exists():
            raise SystemExit(f"memory_trace: the traced run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        info = json.loads(meta.read_text())
        return parse(out.read_text(), _nodes(info["profile"], info["start_ns"]))


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        Path(sys.argv[6]).write_text(json.dumps(child(*sys.argv[2:6])))
        return 0
    import numpy as np

    from onnxopt.transforms import memory

    p = argparse.ArgumentParser(prog="python -m scripts.oracles.memory_trace", description=__doc__.splitlines()[0])
    p.add_argument("zoo", nargs="?", help="a zoo model, run at its zoo inputs")
    p.add_argument("--optimized", action="store_true", help="trace optimize()'s output at those shapes")
    p.add_argument("--model", type=Path, help="a model file (with --feeds)")
    p.add_argument("--feeds", type=Path, help="its inputs (.npz)")
    p.add_argument("--level", choices=("disabled", "all"), default="disabled",
                   help="onnxruntime's graph optimizations (default: disabled, what the estimate models)")
    args = p.parse_args(argv)
    if (args.zoo is None) == (args.model is None) or (args.model is not None) != (args.feeds is not None):
        p.error("give a zoo model name, or --model and --feeds")
    with tempfile.TemporaryDirectory() as tmp:
        shapes = None
        if args.zoo:
            from onnxopt import optimize

            got = zoo_feeds(args.zoo, Path(tmp))
            if got is None:
                p.error(f"{args.zoo} is not built (python -m onnxopt.models build --only {args.zoo})")
            path, _, shapes, args.feeds = got
            if args.optimized:
                opt = Path(tmp) / "optimized.onnx"
                optimize(str(path), output=str(opt), input_shapes=shapes)
                path, shapes = opt, None
            args.model = path
        else:
            with np.load(args.feeds) as data:
                shapes = {k: list(data[k].shape) for k in data.files}
        events, peak = trace(args.model, args.feeds, args.level)
        for e in events:
            print(f"{e['sign']}{e['bytes'] / 2**20:8.3f} MiB  total {e['total'] / 2**20:8.3f}  {e['node']}")
        est = memory.peak(str(args.model), shapes, curve=False, order="onnxruntime")
        print(f"peak mapped {peak / 2**20:.3f} MiB; estimate (memory.peak, onnxruntime's order, less the inputs) "
              f"{(est['peak_bytes'] - est['inputs_bytes']) / 2**20:.3f} MiB at {est['peak_at']['name']!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
