"""Where a decoder's nodes run: per model, one decode step (and one prefill) on an onnxruntime session of the
provider, profiled; the nodes counted by the provider that ran them, the Memcpy nodes onnxruntime inserted
between providers, and the op types left on the CPU (issue 30: "zero CPU kernels and no Memcpy on CUDA").

    python -m scripts.bench.decoder_kernels MODEL.onnx [MODEL.onnx ...] --provider cuda [--past 128]
        [--prompt 128] [--batch 1] --json OUT.json

The feeds follow onnxruntime-genai's names (input_ids, attention_mask, position_ids, past_key_values.N.key/value):
a batch of ``--batch`` rows, one new token after ``--past`` cached ones (the decode step), and a prompt of
``--prompt`` tokens after an empty cache (the prefill); the cache's element type is the model's own.
Counting comes from onnxruntime's profiler ('Node' events carry the provider; the pip GPU build records no
'Kernel' events, see ../shared/gpu/README.md), so a node's count is the number of times it ran per step.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)")
_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32}


def _feeds(session, batch: int, past: int, new: int, heads: tuple[int, int] | None) -> dict:
    """``heads``: (key/value heads, head size) where the model's past shape does not say them (genai_config.json)."""
    out = {}
    for i in session.get_inputs():
        dtype = _NUMPY.get(i.type, np.float32)
        if i.name == "input_ids":
            out[i.name] = np.full((batch, new), 5, dtype)
        elif i.name == "attention_mask":
            out[i.name] = np.ones((batch, past + new), dtype)
        elif i.name == "position_ids":
            out[i.name] = np.broadcast_to(past + np.arange(new), (batch, new)).astype(dtype)
        elif _PAST.fullmatch(i.name):
            g, d = (i.shape[1], i.shape[3]) if isinstance(i.shape[1], int) and isinstance(i.shape[3], int) else heads
            out[i.name] = np.zeros((batch, g, past, d), dtype)
        else:
            raise SystemExit(f"{i.name}: not an onnxruntime-genai decoder input")
    return out


def count(model: str, provider: str, batch: int, past: int, prompt: int) -> dict:
    import onnxruntime as ort

    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    res = {"model": model}
    config = Path(model).parent / "genai_config.json"
    heads = None
    if config.is_file():
        dec = json.loads(config.read_text())["model"]["decoder"]
        heads = (dec["num_key_value_heads"], dec["head_size"])
    for step, (p, n) in {"decode": (past, 1), "prefill": (0, prompt)}.items():
        with tempfile.TemporaryDirectory() as tmp:
            so = ort.SessionOptions()
            so.enable_profiling = True
            so.profile_file_prefix = os.path.join(tmp, "p")
            so.log_severity_level = 3
            sess = ort.InferenceSession(model, so, providers=providers)
            feeds = _feeds(sess, batch, p, n, heads)
            sess.run(None, feeds)  # (the first run: allocations)
            sess.run(None, feeds)
            events = json.loads(Path(sess.end_profiling()).read_text())
        nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        last = nodes[len(nodes) // 2:]  # the second run's
        by_provider = collections.Counter(e["args"].get("provider", "?") for e in last)
        cpu = collections.Counter(e["args"].get("op_name", "?") for e in last
                                  if e["args"].get("provider") == "CPUExecutionProvider")
        memcpy = sum(1 for e in last if e["args"].get("op_name", "").startswith("Memcpy"))
        res[step] = {"nodes": len(last), "by_provider": dict(by_provider), "cpu_ops": dict(cpu), "memcpy": memcpy}
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.decoder_kernels", description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--provider", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--past", type=int, default=128)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = [count(m, args.provider, args.batch, args.past, args.prompt) for m in args.models]
    text = json.dumps({"provider": args.provider, "batch": args.batch, "past": args.past, "prompt": args.prompt,
                       "rows": rows}, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
