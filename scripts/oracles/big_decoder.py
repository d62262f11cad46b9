"""A decoder LLM over 2 GB with a key/value cache, end to end: generate, optimize (the command line,
``--target ort-cpu``), verify on onnxruntime CPU. The decoder sibling of ``big_model`` (issue 30, point 5).

    python -m scripts.oracles.big_decoder [--dir DIR] [--layers 10] [--hidden 2048] [--json FILE]

1. Generates a Llama-shaped decoder (grouped-query attention, rotary, RMSNorm, SwiGLU; transformers'
   LlamaForCausalLM) in the decode-step form of ``onnxopt.models.decoder_models`` (``kv``: input_ids,
   attention_mask, position_ids, past_key_values.N.key/value in; logits and present.N.key/value out),
   exported by torch.onnx's dynamo exporter exactly as the zoo's ``llama-kv-dynamo`` is, but with the
   torch model built on the ``meta`` device: the exporter writes the graph and holds no weight. The
   weights are then drawn (fp32, a fixed seed per tensor) and written one slice at a time into one
   external data file, and the graph saved with external tensors pointing into it (rotary's
   ``inv_freq``, a buffer computed from the config, is computed on the CPU: a few hundred bytes).
   The defaults (10 layers, 2048 wide, 32 heads of 64, 8 key/value heads, SwiGLU 5632, vocabulary
   32000, untied lm_head: TinyLlama's width) make 2.3 GB of weights.
2. Optimizes it as a user would, ``python -m onnxopt big.onnx -o big.opt.onnx --target ort-cpu`` in
   a subprocess, with ``/proc/<pid>/status`` read every 10 ms (peak ``RssAnon``: memory onnxopt
   allocated; peak ``VmHWM``: resident set with mapped weight pages), on a cold page cache; and the
   same command on the same graph with small weights (what does not grow with the weights). The
   report's figures: the weights the rewrites materialise (``rewritten_bytes``: every initializer of
   the output that is not a byte range of the input's data file) against the peak.
3. Checks that the decoder fusions fired (GroupQueryAttention, RotaryEmbedding through it or on its
   own, SimplifiedLayerNormalization, packed projections), as on the tiny export.
4. Verifies the optimized model against the original on onnxruntime CPU (``python -m onnxopt
   verify``) on decode-step feeds written to an .npz (batch 2, a past of 12, the second row left-padded
   as batched generation pads, position_ids counting the real tokens; the past drawn from a normal
   distribution), and optionally ``--decode N`` greedy steps.

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
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.models import decoder_models
from scripts import child_env
from scripts.oracles.big_model import (ALIGN, SAMPLE_SECONDS, SLICE, GiB, _evict, _files_size, _mem_available,
                                      run_sampled)

ARCH = "llama"
OPSET = 18
PAST = 12  # the verification's past length (and the export's example)
FUSIONS = ("group_query_attention", "simplified_layer_norm", "packed_projections")


def config(*, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> dict:
    """transformers LlamaConfig entries of the generated decoder (initializer_range 0.02, as released models)."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.02,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def weight_bytes(cfg: dict) -> int:
    h, i, head = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    return 4 * (cfg["num_hidden_layers"] * per_layer + 2 * cfg["vocab_size"] * h + h + head // 2)


def _export_graph(cfg: dict) -> tuple[ir.Model, dict]:
    """The dynamo export of the decode step, traced on the meta device (no weight exists), and the CPU
    values of the model's computed buffers (rotary's inv_freq), by initializer name."""
    import torch

    with torch.device("meta"):
        model = decoder_models.build_module(ARCH, config=cfg)
    layers, kv_heads, head = decoder_models.dims(model)
    names, outs = decoder_models.io_names("kv", layers)
    batch = 2
    meta = dict(device="meta")
    args = (torch.zeros((batch, 1), dtype=torch.int64, **meta),
            torch.ones((batch, PAST + 1), dtype=torch.int64, **meta),
            torch.zeros((batch, 1), dtype=torch.int64, **meta),
            *(torch.zeros((batch, kv_heads, PAST, head), **meta) for _ in names[3:]))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(decoder_models.wrap("kv", model), args, dynamo=True, optimize=False,
                                    opset_version=OPSET, verbose=False, input_names=names, output_names=outs,
                                    dynamic_shapes=decoder_models.kv_shapes(names))
    rotary = type(model.model.rotary_emb)(config=model.config)  # (built outside the meta device)
    buffers = {"inner.model.rotary_emb.inv_freq": rotary.inv_freq.numpy().astype(np.float32)}
    return program.model, buffers


def generate(path: Path, cfg: dict, *, seed: int = 0) -> Path:
    """Write the decoder to ``path`` and its weights to ``<path>.data`` beside it, slice by slice."""
    model, buffers = _export_graph(cfg)
    data_name = path.name + ".data"
    with open(path.parent / data_name, "wb") as f:
        for count, (name, value) in enumerate(list(model.graph.initializers.items())):
            shape = tuple(int(d) for d in value.const_value.shape)
            if name in buffers:
                array = buffers[name]
                if array.shape != shape:
                    raise RuntimeError(f"{name}: computed {array.shape}, the graph has {shape}")
                value.const_value = ir.tensor(array, name=name)
                continue
            if value.const_value.dtype != ir.DataType.FLOAT:
                raise RuntimeError(f"{name}: {value.const_value.dtype}, not a float32 weight")
            norm = name.endswith("norm.weight")
            scale, mean = (0.05, 1.0) if norm else (cfg["initializer_range"], 0.0)
            rng = np.random.default_rng([seed, count])
            offset = -(-f.tell() // ALIGN) * ALIGN
            f.seek(offset)
            total, step = int(np.prod(shape)), SLICE // 4
            for start in range(0, total, step):
                block = rng.standard_normal(min(step, total - start), dtype=np.float32)
                block *= np.float32(scale)
                block += np.float32(mean)
                f.write(block.tobytes())
            value.const_value = ir.ExternalTensor(data_name, offset, total * 4, ir.DataType.FLOAT,
                                                  shape=ir.Shape(shape), name=name, base_dir=path.parent)
    model.producer_name = "onnxopt scripts/oracles/big_decoder.py (torch.onnx dynamo, meta device)"
    model.ir_version = min(model.ir_version, 10)
    ir.save(model, path)  # (the external tensors already point into the data file beside it)
    return path


def decode_feeds(cfg: dict, *, batch: int = 2, past: int = PAST, seed: int = 0) -> dict[str, np.ndarray]:
    """One decode step after a past of ``past``: row 0 full, the others left-padded (as batched generation
    pads); position_ids count each row's real tokens; the past drawn from a normal distribution."""
    rng = np.random.default_rng(seed)
    head, kv_heads = cfg["head_dim"], cfg["num_key_value_heads"]
    mask = np.ones((batch, past + 1), np.int64)
    for row in range(1, batch):
        mask[row, :min(past - 1, 3 * row)] = 0
    feeds = {"input_ids": rng.integers(3, cfg["vocab_size"], (batch, 1), dtype=np.int64),
             "attention_mask": mask,
             "position_ids": (mask.sum(axis=1, keepdims=True) - 1).astype(np.int64)}
    for i in range(cfg["num_hidden_layers"]):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((batch, kv_heads, past, head), dtype=np.float32)
    return feeds


def rewritten_bytes(src: Path, out: Path) -> dict:
    """The output's initializers that are not the input's (by content: not a tensor of the input with the
    same bytes, compared through memory maps): what the rewrites materialised."""
    before = ir.load(src).graph.initializers
    by_size: dict[int, list] = {}
    for value in before.values():
        by_size.setdefault(value.const_value.nbytes, []).append(value.const_value)
    new, kept, total = [], 0, 0
    for name, value in ir.load(out).graph.initializers.items():
        tensor = value.const_value
        total += tensor.nbytes
        if tensor.nbytes < 1024:
            continue
        got = tensor.numpy().reshape(-1)
        same = by_size.get(tensor.nbytes, ())
        if any(t.dtype == tensor.dtype and np.array_equal(t.numpy().reshape(-1), got) for t in same):
            kept += tensor.nbytes
        else:
            new.append((tensor.nbytes, name))
    new.sort(reverse=True)
    return {"bytes": sum(n for n, _ in new), "tensors": len(new), "largest_bytes": new[0][0] if new else 0,
            "largest": [name for _, name in new[:4]], "kept_bytes": kept, "output_initializer_bytes": total}


def fusion_counts(ops: dict[str, int], rotary_inside: int, fired: dict[str, int]) -> dict[str, int]:
    """The decoder fusions in the optimized graph: its op counts, GroupQueryAttentions that rotate q and k
    themselves (do_rotary), and how often packed_projections fired."""
    return {"GroupQueryAttention": ops.get("GroupQueryAttention", 0), "GroupQueryAttention_do_rotary": rotary_inside,
            "RotaryEmbedding": ops.get("RotaryEmbedding", 0),
            "SimplifiedLayerNormalization": ops.get("SimplifiedLayerNormalization", 0),
            "SkipSimplifiedLayerNormalization": ops.get("SkipSimplifiedLayerNormalization", 0),
            "packed_projections": fired.get("packed_projections", 0)}


def fusions_fired(fusions: dict[str, int], layers: int) -> bool:
    """Each layer's attention is one GroupQueryAttention with its rotary (inside it, or two RotaryEmbeddings:
    q and k), its q/k/v and gate/up projections are packed, and its norms are fused (one of the model's
    2 x layers + 1 RMSNorms stays unfused, as on the tiny zoo export: the first, on the embeddings, which no
    residual Add precedes; rms_normalization gives its reason in the report)."""
    rotary = fusions["GroupQueryAttention_do_rotary"] == layers or fusions["RotaryEmbedding"] == 2 * layers
    norms = fusions["SimplifiedLayerNormalization"] + fusions["SkipSimplifiedLayerNormalization"]
    return fusions["GroupQueryAttention"] == layers and rotary and fusions["packed_projections"] == 2 * layers \
        and norms >= 2 * layers


def verify_figures(verification: dict) -> dict:
    """From ``onnxopt verify --json``'s report (CPU): the outputs' largest differences, the greedy decode's
    agreement and the latency ratio."""
    cpu = verification.get("providers", {}).get("cpu", {})
    outputs = cpu.get("outputs", [])
    decode = cpu.get("decode") or {}
    latency = cpu.get("latency") or {}
    return {"outputs_max_abs": max((o.get("max_abs") or 0.0 for o in outputs), default=None),
            "outputs_min_cosine": min((o.get("cosine") or 1.0 for o in outputs), default=None),
            "decode": {k: decode.get(k) for k in ("ok", "steps", "prompts", "tokens_compared", "tokens_identical",
                                                  "first_divergence", "logits")} if decode else None,
            "latency_median_ms": {"before": latency.get("before", {}).get("median_ms"),
                                  "after": latency.get("after", {}).get("median_ms"),
                                  "ratio": latency.get("ratio_median"), "rounds": latency.get("rounds")}
            if latency else None}


def _command(src: Path, out: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "onnxopt", str(src), "-o", str(out), "--target", "ort-cpu", "-q", *options]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.big_decoder", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, help="where to write the models (default: a temporary folder, removed)")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--decode", type=int, default=0, help="also verify N greedy steps (onnxopt verify --decode N)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the same command on the same graph with small weights (default: on)")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)

    cfg = config(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
                 kv_heads=args.kv_heads, vocab=args.vocab)
    size = weight_bytes(cfg)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="onnxopt-bigdec-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        free = shutil.disk_usage(folder).free
        need = 2 * size + GiB
        if free < need:
            print(f"skipped: the model takes {size / GiB:.1f} GiB and its optimized copy as much; {folder} has "
                  f"{free / GiB:.1f} GiB free, {need / GiB:.1f} GiB needed")
            return 0
        memory = _mem_available()
        if memory < 3 * size:
            print(f"skipped: onnxruntime holds both models to verify; {memory / GiB:.1f} GiB of memory available, "
                  f"{3 * size / GiB:.1f} GiB needed")
            return 0
        return _run(args, cfg, folder, size)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)


def _run(args, cfg: dict, folder: Path, size: int) -> int:
    env = child_env()
    src, out = folder / "big.onnx", folder / "big.opt.onnx"
    t0 = time.perf_counter()
    generate(src, cfg)
    generated = time.perf_counter() - t0
    model_bytes = _files_size(src)
    print(f"generated {src} ({model_bytes / 1e9:.2f} GB with its data file, {size / 1e9:.2f} GB of weights) "
          f"in {generated:.1f} s")

    baseline = {}
    if args.baseline:  # the same graph with small weights: what the command takes without them
        small = folder / "small" / "small.onnx"
        small.parent.mkdir(exist_ok=True)
        generate(small, config(layers=args.layers, hidden=args.heads * 4, intermediate=args.heads * 8,
                               heads=args.heads, kv_heads=args.kv_heads, vocab=256))
        _, baseline = run_sampled(_command(small, small.parent / "small.opt.onnx"), env)

    _evict(folder / (src.name + ".data"))  # the weights are read from disk, as after a download
    report_path = folder / "report.json"
    t0 = time.perf_counter()
    run, peaks = run_sampled(_command(src, out, "--json", str(report_path)), env)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        print(f"optimize failed (exit {run.returncode}): {run.stderr.strip()}")
        return 1
    report = json.loads(report_path.read_text())
    fired = {k: v["fired"] for k, v in report["rules"].items() if v["fired"]}
    rewritten = rewritten_bytes(src, out)
    ops: dict[str, int] = {}
    rotary_inside = 0
    for node in onnx.load(str(out), load_external_data=False).graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
        if node.op_type == "GroupQueryAttention":
            rotary_inside += any(a.name == "do_rotary" and a.i for a in node.attribute)
    print(f"optimized in {wall:.1f} s: {report['nodes_before']} -> {report['nodes_after']} nodes "
          f"({report['rewrites']} rewrites); rewritten weights {rewritten['bytes'] / 2**20:.0f} MiB in "
          f"{rewritten['tensors']} tensors (largest {rewritten['largest_bytes'] / 2**20:.0f} MiB); peak RssAnon "
          f"{peaks['RssAnon'] / 2**20:.0f} MiB (small weights: {baseline.get('RssAnon', 0) / 2**20:.0f} MiB), "
          f"peak VmHWM {peaks['VmHWM'] / 2**20:.0f} MiB; weights {size / 2**20:.0f} MiB")
    fusions = fusion_counts(ops, rotary_inside, fired)
    fused = fusions_fired(fusions, args.layers)
    print(f"fusions: {fusions} ({'all fired' if fused else 'MISSING'})")

    feeds = folder / "feeds.npz"
    np.savez(feeds, **decode_feeds(cfg))
    cmd = [sys.executable, "-m", "onnxopt", "verify", str(src), str(out), "--inputs", str(feeds), "--runs", "3",
           "--warmup", "1", "--json", str(folder / "verify.json"), "-q"]
    if args.decode:
        cmd += ["--decode", str(args.decode)]
    t0 = time.perf_counter()
    check, verify_peaks = run_sampled(cmd, env)
    verify_wall = time.perf_counter() - t0
    summary = (check.stdout + check.stderr).strip()
    print(f"verify (onnxruntime CPU) exit {check.returncode} in {verify_wall:.1f} s: {summary}")
    verification = json.loads((folder / "verify.json").read_text()) if (folder / "verify.json").exists() else {}

    figures = {
        "model": {"arch": "LlamaForCausalLM, decode step with KV cache (onnxopt.models.decoder_models kv form)",
                  "exporter": "torch.onnx dynamo (optimize=False), traced on the meta device", "config": cfg,
                  "weight_bytes": size, "bytes_on_disk": model_bytes, "generate_seconds": round(generated, 1)},
        "optimize": {"command": "python -m onnxopt big.onnx -o big.opt.onnx --target ort-cpu",
                     "wall_seconds": round(wall, 1), "seconds": report["seconds"],
                     "nodes_before": report["nodes_before"], "nodes_after": report["nodes_after"],
                     "rewrites": report["rewrites"], "fired": fired, "ops_after": fusions,
                     "fusions_fired": fused, "rewritten": rewritten,
                     "output_bytes_on_disk": _files_size(out), "sampled_every_seconds": SAMPLE_SECONDS,
                     "cold_page_cache": True, "peak_rss_anon_bytes": peaks["RssAnon"],
                     "peak_rss_file_bytes": peaks["RssFile"], "peak_vm_hwm_bytes": peaks["VmHWM"],
                     "peak_rss_anon_fraction_of_weights": round(peaks["RssAnon"] / size, 4),
                     "small_weights_peak_rss_anon_bytes": baseline.get("RssAnon")},
        "verify": {"exit": check.returncode, "wall_seconds": round(verify_wall, 1), "decode_steps": args.decode,
                   "inputs": "decode step: batch 2, past 12, row 1 left-padded by 3", "ok": verification.get("ok"),
                   "summary": summary, "peak_vm_hwm_bytes": verify_peaks.get("VmHWM"),
                   **verify_figures(verification)},
        "machine": {"cpus": os.cpu_count(), "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
    }
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0 if check.returncode == 0 and fused else 1


if __name__ == "__main__":
    raise SystemExit(main())
