"""A model over 2 GB, end to end: generate, optimize (the command line), verify on onnxruntime CPU.

    python -m scripts.oracles.big_model [--dir DIR] [--layers 4] [--hidden 4096] [--json scripts/results/big-model-cpu.json]

1. Generates a BERT-shaped encoder (token and position embeddings, ``--layers`` post-norm layers
   of self-attention and a GELU feed-forward network of 4 x ``--hidden``; fp32 weights drawn from a
   fixed seed), written the way an exporter writes it: shapes assembled from Shape/Gather/Concat,
   a Div by sqrt(head size), Dropout and Identity nodes, the GELU spelled out with Erf. The
   defaults make 3.2 GB of weights in one external data file. Weights are drawn and written one
   slice at a time into the data file, and the graph is saved by onnx_ir with external tensors
   pointing into it: the generator never holds more than one slice of them.
2. Optimizes it as a user would: ``python -m onnxopt big.onnx -o big.opt.onnx`` in a subprocess
   (the output keeps external data, as its input had). While it runs, ``/proc/<pid>/status`` is
   read every 10 ms: the peak ``RssAnon`` (anonymous memory: the heap, Python objects, arrays
   onnxopt allocated; not the weights' pages, which are memory-mapped from the data file and
   count as ``RssFile``), with ``VmHWM`` (peak resident set, mapped pages included) beside it,
   and the peak RssAnon of the same command on the same graph with small weights (the interpreter,
   onnx, onnxruntime and the graph: what does not grow with the weights). The data file is
   dropped from the page cache first, so the weights are read from disk.
3. Verifies the optimized model against the original on onnxruntime CPU (``python -m onnxopt
   verify``, a few latency runs), and checks that ``--single-file`` is refused with one line.

It skips (exit 0, with a message) when the folder has not room for the model twice over, or the
machine has not the memory for onnxruntime to hold both models.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir

from scripts import child_env
ALIGN = 1 << 16  # offsets in the data file: onnxruntime memory-maps aligned external data
SLICE = 64 << 20  # bytes drawn and written at a time
SAMPLE_SECONDS = 0.01  # how often the optimize command's memory is read
GiB = 1 << 30


def weight_bytes(layers: int, hidden: int, vocab: int, positions: int) -> int:
    per_layer = 4 * hidden * hidden + 2 * 4 * hidden * hidden + 9 * hidden + 4 * hidden
    return 4 * (layers * per_layer + (vocab + positions + 2) * hidden)


class _Weights:
    """Writes tensors into one data file as it goes (each drawn slice by slice from its own
    seed), and gives onnx_ir external tensors that point at them."""

    def __init__(self, folder: Path, name: str, seed: int):
        self.folder, self.name, self.seed = folder, name, seed
        self.file = open(folder / name, "wb")
        self.count = 0

    def tensor(self, tape: ir.tape.Tape, name: str, shape: tuple[int, ...], scale: float,
               mean: float = 0.0) -> ir.Value:
        rng = np.random.default_rng([self.seed, self.count])
        self.count += 1
        offset = -(-self.file.tell() // ALIGN) * ALIGN
        self.file.seek(offset)
        total = int(np.prod(shape))
        step = SLICE // 4
        for start in range(0, total, step):
            block = rng.standard_normal(min(step, total - start), dtype=np.float32)
            block *= np.float32(scale)
            block += np.float32(mean)
            self.file.write(block.tobytes())
        tensor = ir.ExternalTensor(self.name, offset, total * 4, ir.DataType.FLOAT, shape=ir.Shape(shape),
                                   name=name, base_dir=self.folder)
        return tape.initializer(tensor, name=name)

    def close(self) -> None:
        self.file.close()


def _const(tape: ir.tape.Tape, name: str, array) -> ir.Value:
    return tape.initializer(ir.tensor(np.asarray(array), name=name), name=name)


def generate(path: Path, *, layers: int, hidden: int, heads: int, vocab: int, positions: int,
             seed: int = 0) -> Path:
    """Write the model to ``path`` and its weights to ``<path>.data`` beside it."""
    head = hidden // heads
    tape = ir.tape.Tape()
    weights = _Weights(path.parent, path.name + ".data", seed)
    ids = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "sequence"]))
    c = {
        "zero": _const(tape, "zero", np.array(0, np.int64)),
        "one": _const(tape, "one", np.array(1, np.int64)),
        "axes0": _const(tape, "axes0", np.array([0], np.int64)),
        "heads": _const(tape, "heads_dims", np.array([heads, head], np.int64)),
        "hidden": _const(tape, "hidden_dim", np.array([hidden], np.int64)),
        "sqrt_head": _const(tape, "sqrt_head", np.array(np.sqrt(head), np.float32)),
        "sqrt2": _const(tape, "sqrt2", np.array(np.sqrt(2.0), np.float32)),
        "f1": _const(tape, "f_one", np.array(1.0, np.float32)),
        "half": _const(tape, "f_half", np.array(0.5, np.float32)),
    }

    def dim(value, index, prefix):
        """The legacy exporter's ``x.size(i)`` as a 1-element vector."""
        shape = tape.op("Shape", [value], name=f"{prefix}/shape")
        got = tape.op("Gather", [shape, c["zero"] if index == 0 else c["one"]], {"axis": 0}, name=f"{prefix}/gather")
        return tape.op("Unsqueeze", [got, c["axes0"]], name=f"{prefix}/unsqueeze")

    def linear(x, n_in, n_out, prefix):
        w = weights.tensor(tape, f"{prefix}.weight", (n_in, n_out), 0.02)
        b = weights.tensor(tape, f"{prefix}.bias", (n_out,), 0.02)
        return tape.op("Add", [tape.op("MatMul", [x, w], name=f"{prefix}/matmul"), b], name=f"{prefix}/add")

    def layer_norm(x, prefix):
        gamma = weights.tensor(tape, f"{prefix}.weight", (hidden,), 0.05, mean=1.0)
        beta = weights.tensor(tape, f"{prefix}.bias", (hidden,), 0.05)
        return tape.op("LayerNormalization", [x, gamma, beta], {"axis": -1, "epsilon": 1e-12}, name=f"{prefix}/ln")

    word = weights.tensor(tape, "embeddings.word", (vocab, hidden), 0.02)
    pos = weights.tensor(tape, "embeddings.position", (positions, hidden), 0.02)
    seq = dim(ids, 1, "embeddings/seq")
    pos_ids = tape.op("Range", [c["zero"], tape.op("Squeeze", [seq, c["axes0"]], name="embeddings/squeeze"),
                                c["one"]], name="embeddings/range")
    x = tape.op("Add", [tape.op("Gather", [word, ids], name="embeddings/word"),
                        tape.op("Gather", [pos, pos_ids], name="embeddings/position")], name="embeddings/add")
    x = layer_norm(x, "embeddings.norm")
    x = tape.op("Dropout", [x], name="embeddings/dropout")
    for i in range(layers):
        p = f"layer{i}"
        batch, length = dim(x, 0, f"{p}/batch"), dim(x, 1, f"{p}/seq")
        split = tape.op("Concat", [batch, length, c["heads"]], {"axis": 0}, name=f"{p}/split_shape")
        merge = tape.op("Concat", [batch, length, c["hidden"]], {"axis": 0}, name=f"{p}/merge_shape")

        def heads_of(value, perm, name):
            return tape.op("Transpose", [tape.op("Reshape", [value, split], name=f"{p}/{name}/reshape")],
                           {"perm": perm}, name=f"{p}/{name}/transpose")

        q = heads_of(linear(x, hidden, hidden, f"{p}.query"), [0, 2, 1, 3], "q")
        k = heads_of(linear(x, hidden, hidden, f"{p}.key"), [0, 2, 3, 1], "k")
        v = heads_of(linear(x, hidden, hidden, f"{p}.value"), [0, 2, 1, 3], "v")
        scores = tape.op("Div", [tape.op("MatMul", [q, k], name=f"{p}/scores"), c["sqrt_head"]], name=f"{p}/scale")
        probs = tape.op("Dropout", [tape.op("Softmax", [scores], {"axis": -1}, name=f"{p}/softmax")],
                        name=f"{p}/attn_dropout")
        ctx = tape.op("Transpose", [tape.op("MatMul", [probs, v], name=f"{p}/context")], {"perm": [0, 2, 1, 3]},
                      name=f"{p}/context/transpose")
        ctx = tape.op("Reshape", [ctx, merge], name=f"{p}/context/reshape")
        out = tape.op("Identity", [linear(ctx, hidden, hidden, f"{p}.attention.output")], name=f"{p}/identity")
        x = layer_norm(tape.op("Add", [out, x], name=f"{p}/residual1"), f"{p}.attention.norm")
        h = linear(x, hidden, 4 * hidden, f"{p}.ffn.in")
        gelu = tape.op("Mul", [tape.op("Mul", [h, tape.op("Add", [tape.op("Erf", [
            tape.op("Div", [h, c["sqrt2"]], name=f"{p}/gelu/div")], name=f"{p}/gelu/erf"), c["f1"]],
            name=f"{p}/gelu/add")], name=f"{p}/gelu/mul"), c["half"]], name=f"{p}/gelu/half")
        h = tape.op("Dropout", [linear(gelu, 4 * hidden, hidden, f"{p}.ffn.out")], name=f"{p}/ffn_dropout")
        x = layer_norm(tape.op("Add", [h, x], name=f"{p}/residual2"), f"{p}.ffn.norm")
    weights.close()
    x.name = "last_hidden_state"
    x.type, x.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["batch", "sequence", hidden])
    graph = ir.Graph([ids], [x], nodes=tape.nodes, initializers=tape.initializers,
                     opset_imports={"": 17}, name="big_encoder")
    model = ir.Model(graph, ir_version=8, producer_name="onnxopt scripts/oracles/big_model.py")
    ir.save(model, path)  # (the external tensors already point into the data file beside it)
    return path


def _status(pid: int) -> dict[str, int]:
    """The memory lines of /proc/<pid>/status, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _optimize_command(src: Path, out: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "onnxopt", str(src), "-o", str(out), "-q", *options]


def _evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (written out first), where the system allows."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_sampled(cmd: list[str], env: dict,
                interval: float = SAMPLE_SECONDS) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``cmd``, reading its /proc status every ``interval`` seconds: the peak of each figure."""
    peaks: dict[str, int] = {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                for key, value in _status(proc.pid).items():
                    peaks[key] = max(peaks.get(key, 0), value)
            except (OSError, ValueError):
                pass
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    done.set()
    sampler.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), peaks


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _files_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.big_model", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, help="where to write the models (default: a temporary folder, removed)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--batch", type=int, default=1, help="batch of the verification inputs")
    p.add_argument("--sequence", type=int, default=16, help="sequence length of the verification inputs")
    p.add_argument("--runs", type=int, default=3, help="latency runs of the verification")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)

    size = weight_bytes(args.layers, args.hidden, args.vocab, args.positions)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="onnxopt-big-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        free = shutil.disk_usage(folder).free
        need = 2 * size + GiB  # the model, its optimized copy, and room to spare
        if free < need:
            print(f"skipped: the model takes {size / GiB:.1f} GiB and its optimized copy as much; {folder} has "
                  f"{free / GiB:.1f} GiB free, {need / GiB:.1f} GiB needed")
            return 0
        memory = _mem_available()
        if memory < 3 * size:
            print(f"skipped: onnxruntime holds both models (and packed copies of their weights) to verify; "
                  f"{memory / GiB:.1f} GiB of memory available, {3 * size / GiB:.1f} GiB needed")
            return 0
        return _run(args, folder, size)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)


def _run(args, folder: Path, size: int) -> int:
    env = child_env()
    src, out = folder / "big.onnx", folder / "big.opt.onnx"
    t0 = time.perf_counter()
    generate(src, layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
             positions=args.positions)
    generated = time.perf_counter() - t0
    model_bytes = _files_size(src)
    print(f"generated {src} ({model_bytes / 1e9:.2f} GB with its data file) in {generated:.1f} s")

    # The same architecture with small weights: what the optimize command takes without them.
    small = folder / "small" / "small.onnx"
    small.parent.mkdir(exist_ok=True)
    generate(small, layers=args.layers, hidden=64, heads=2, vocab=args.vocab, positions=args.positions)
    _, baseline = run_sampled(_optimize_command(small, small.parent / "small.opt.onnx"), env)

    _evict(src.parent / (src.name + ".data"))  # the weights are read from disk, as after a download
    cmd = _optimize_command(src, out, "--json", str(folder / "report.json"))
    t0 = time.perf_counter()
    run, peaks = run_sampled(cmd, env)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        print(f"optimize failed (exit {run.returncode}): {run.stderr.strip()}")
        return 1
    report = json.loads((folder / "report.json").read_text())
    out_bytes = _files_size(out)
    print(f"optimized in {wall:.1f} s: {report['nodes_before']} -> {report['nodes_after']} nodes "
          f"({report['rewrites']} rewrites), output {out_bytes / 1e9:.2f} GB; peak RssAnon "
          f"{peaks['RssAnon'] / 2**20:.0f} MiB ({peaks['RssAnon'] / model_bytes:.1%} of the model; the same "
          f"command on the same graph with {_files_size(small) / 2**20:.1f} MiB of weights: "
          f"{baseline['RssAnon'] / 2**20:.0f} MiB), peak VmHWM {peaks['VmHWM'] / 2**20:.0f} MiB")

    single = subprocess.run(_optimize_command(src, folder / "one.onnx", "--single-file"), capture_output=True,
                            text=True, env=env)
    refusal = single.stderr.strip()
    print(f"--single-file: exit {single.returncode}: {refusal}")
    if size >= 2 * GiB:  # refused in one line, nothing written
        single_ok = single.returncode == 2 and len(refusal.splitlines()) == 1 and not (folder / "one.onnx").exists()
    else:
        single_ok = single.returncode == 0

    cmd = [sys.executable, "-m", "onnxopt", "verify", str(src), str(out), "--runs", str(args.runs), "--warmup", "1",
           "--input-shape", f"input_ids={args.batch}x{args.sequence}", "--json", str(folder / "verify.json"), "-q"]
    t0 = time.perf_counter()
    check = subprocess.run(cmd, capture_output=True, text=True, env=env)
    verify_wall = time.perf_counter() - t0
    print(f"verify (onnxruntime CPU) exit {check.returncode} in {verify_wall:.1f} s: "
          f"{(check.stdout + check.stderr).strip()}")
    verification = json.loads((folder / "verify.json").read_text()) if (folder / "verify.json").exists() else {}

    figures = {
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
                  "positions": args.positions, "weight_bytes": size, "bytes_on_disk": model_bytes,
                  "generate_seconds": round(generated, 1)},
        "optimize": {"command": "python -m onnxopt big.onnx -o big.opt.onnx", "wall_seconds": round(wall, 1),
                     "seconds": report["seconds"], "nodes_before": report["nodes_before"],
                     "nodes_after": report["nodes_after"], "rewrites": report["rewrites"],
                     "fired": {k: v["fired"] for k, v in report["rules"].items() if v["fired"]},
                     "output_bytes_on_disk": out_bytes,
                     "sampled_every_seconds": SAMPLE_SECONDS, "cold_page_cache": True,
                     "peak_rss_anon_bytes": peaks["RssAnon"], "peak_rss_file_bytes": peaks["RssFile"],
                     "peak_vm_hwm_bytes": peaks["VmHWM"],
                     "peak_rss_anon_fraction_of_model": round(peaks["RssAnon"] / model_bytes, 4),
                     "small_weights_peak_rss_anon_bytes": baseline["RssAnon"]},
        "single_file": {"exit": single.returncode, "message": refusal, "refused_in_one_line": single_ok},
        "verify": {"exit": check.returncode, "wall_seconds": round(verify_wall, 1),
                   "inputs": f"input_ids={args.batch}x{args.sequence}", "ok": verification.get("ok"),
                   "summary": (check.stdout + check.stderr).strip(),
                   "providers": {name: {k: r.get(k) for k in ("kernels", "latency") if k in r}
                                 for name, r in verification.get("providers", {}).items()}},
        "machine": {"cpus": os.cpu_count(), "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
    }
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0 if check.returncode == 0 and single_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
