"""Generation through onnxruntime-genai: onnxopt's ``--genai`` folder against onnxruntime-genai's own model builder.

For each Hugging Face folder (a decoder with its tokenizer), three genai folders run the same prompts in one
interleaved run on this machine at a stated thread count:

- ``builder``: onnxruntime-genai's model builder, as its documentation tells a user to run it
  (``python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu``; scripts/bench/_genai.py);
- ``export``: the decoder exported from the same folder (models/decoder_models.py, form ``chunk``: the prompt
  with an empty past, then one token at a time), written with onnxopt's genai_config.json but not optimized
  (what a user runs without an optimizer);
- ``onnxopt``: that export optimized as a user runs it: ``python -m onnxopt chunk.onnx -o OUT/model.onnx
  --target ort-cpu --input-shape input_ids=1,sequence --genai HF`` (batch 1: onnxruntime's
  GroupQueryAttention takes several new tokens after a past only at batch 1).

Each round runs one generation per folder (the order rotated by one per round): a prompt of ``--prompt``
tokens (``append_tokens``: the prefill) and ``--new`` greedy tokens (the decode steps; the first token is
picked from the prefill's logits, so decode time = the ``--new - 1`` later steps). Reported per folder: the
median prefill ms and decode ms per token with p10/p90; per pair the ratio of medians with its 90% bootstrap
interval over the rounds (onnxopt.verify.runtime.ratio_interval). Fidelity: the greedy tokens of each folder
against transformers' greedy generation on the same prompts (text of the trained model's held-out files,
else random ids), with the count of equal tokens.

    python -m scripts.bench.genai_generation --hf DIR [--hf DIR ...] [--random-llama] --work WORK \\
        --json scripts/results/decoders/genai-cpu.json --markdown scripts/results/decoders/genai-cpu.md \\
        [--prompt 128] [--new 64] [--rounds 20] [--threads 1]

``--random-llama`` adds a larger Llama-style folder (8 layers, 512 wide, 8 heads / 2 key-value heads,
intermediate 1408, the trained decoder's tokenizer and vocabulary, seeded random weights), written into
WORK. Needs onnxruntime-genai, torch and transformers (setup.cfg's genai and export extras).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from scripts.bench import _genai

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("builder", "export", "onnxopt")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def random_llama(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A Llama-style folder, 8 layers x 512, GQA 8/2, the tokenizer (and vocabulary) of ``tokenizer_dir``."""
    _genai.skip_torchvision_meta_registrations()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    base = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(vocab_size=base["vocab_size"], hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=base.get("bos_token_id", 0), eos_token_id=base.get("eos_token_id", 0),
                         pad_token_id=base.get("pad_token_id", 1), tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    return out


# the GPU run's configurations (issue 30: "a ~1B Llama-style and a 0.5B Qwen2-style config"): TinyLlama-1.1B's
# and Qwen2-0.5B's shapes, seeded random weights, the trained tokenizer of write_tiny_llama
RANDOM_CONFIGS = {
    "llama-tiny": ("LlamaConfig", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,  # (a quick check)
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                       max_position_embeddings=512, tie_word_embeddings=False)),
    "llama-1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                     num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                     max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False)),
    "qwen2-0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                       max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=True,
                                       use_sliding_window=False)),
}


def random_config(name: str, out: Path, seed: int = 0) -> Path:
    """A Hugging Face folder of ``RANDOM_CONFIGS[name]`` (float16 weights, seeded; made on the GPU when there is
    one) with write_tiny_llama's tokenizer (its ids are a prefix of the vocabulary)."""
    _genai.skip_torchvision_meta_registrations()
    import torch
    import transformers

    if (out / "config.json").is_file():
        return out
    _genai.write_tiny_llama(out / "_tokenizer", seed=seed)
    kind, kw = RANDOM_CONFIGS[name]
    config = getattr(transformers, kind)(bos_token_id=0, eos_token_id=1, pad_token_id=2, **kw)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model.eval().save_pretrained(out)
    for f in (out / "_tokenizer").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copyfile(f, out / f.name)
    return out


def _export(hf: Path, path: Path, exporter: str, precision: str = "fp32") -> Path:
    _genai.skip_torchvision_meta_registrations()
    import torch
    from transformers import AutoModelForCausalLM

    from onnxopt.models import decoder_models

    dtype = torch.float16 if precision == "fp16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).eval()
    return decoder_models.export_module(model, "chunk", path, exporter)


def _export_folder(hf: Path, chunk: Path, out: Path, provider: str = "cpu") -> None:
    """The export as it is, with onnxopt's genai_config.json and the tokenizer (no rewriting)."""
    import onnx_ir as ir

    from onnxopt.ir import genai, io

    out.mkdir(parents=True, exist_ok=True)
    model = ir.load(chunk)
    folder = genai.check_folder(hf)
    with io.Outputs() as outputs:  # (onnxopt's own writer: claimed, staged, committed)
        ir.save(model, out / "model.onnx", external_data="model.onnx.data")
        genai.stage(outputs, genai.claim(outputs, out / "model.onnx", folder),
                    genai.config(model, folder, "model.onnx", provider=None if provider == "cpu" else provider))


def _onnxopt_args(provider: str, batch: int = 1) -> list[str]:
    """How a user optimizes the export for the provider and the largest batch: on CPU at batch 1 the model's own
    mask (any padding); on CUDA, or on CPU at a larger batch, onnxruntime-genai's right padding (lengths read from
    the mask: CUDA's GroupQueryAttention takes no mask, and the CPU's takes a prompt at batch > 1 so)."""
    if provider == "cuda":
        return ["--target", "ort-cuda", "--padding", "right"]
    if batch > 1:
        return ["--target", "ort-cpu", "--padding", "right"]
    return ["--target", "ort-cpu", "--input-shape", "input_ids=1,sequence"]


def _onnxopt_folder(hf: Path, chunk: Path, out: Path, provider: str = "cpu", batch: int = 1) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "onnxopt", str(chunk), "-o", str(out / "model.onnx"), *_onnxopt_args(provider, batch),
           "--genai", str(hf), "--json", str(out / "report.json")]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    if r.returncode:
        raise RuntimeError(f"onnxopt failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    report = json.loads((out / "report.json").read_text())
    return {"command": f"python -m onnxopt chunk.onnx -o OUT/model.onnx {' '.join(_onnxopt_args(provider, batch))} "
                       "--genai HF", "seconds": round(time.perf_counter() - t0, 2),
            "fusions": {k: v.get("hits") for k, v in report.get("fusions", {}).items() if v.get("hits")}}


def _prompts(hf: Path, count: int, tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of ``tokens`` ids: the trained decoder's held-out text where its metadata names it, else
    random ids (seeded)."""
    meta = hf / "train_metadata.json"
    if meta.is_file():
        from tokenizers import Tokenizer

        info = json.loads(meta.read_text())
        corpus = info.get("corpus", {})
        root, files = Path(corpus.get("root", "")), corpus.get("held_out_files", [])
        tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
        ids: list[int] = []
        for f in files:
            p = root / f
            if p.is_file():
                ids += tok.encode(p.read_text(errors="replace")).ids
            if len(ids) >= count * tokens * 4:
                break
        if len(ids) >= count * tokens:
            step = len(ids) // count
            return [ids[i * step:i * step + tokens] for i in range(count)]
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=tokens).tolist() for _ in range(count)]


def _one_run(og, model, prompt: np.ndarray, total: int) -> tuple[float, float, list[int]]:
    """(prefill s, decode s of the later steps, row 0's tokens) of one generation of ``prompt`` [batch, length]."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, batch_size=prompt.shape[0], max_length=total, min_length=total)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(prompt)
    t1 = time.perf_counter()
    gen.generate_next_token()
    tokens = [int(gen.get_next_tokens()[0])]
    t2 = time.perf_counter()
    while not gen.is_done():
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, tokens


def _stats(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {"median_ms": round(float(np.median(a)), 4), "p10_ms": round(float(np.percentile(a, 10)), 4),
            "p90_ms": round(float(np.percentile(a, 90)), 4)}


def bench_folder(hf: Path, work: Path, args) -> dict:
    import onnxruntime_genai as og

    from onnxopt.verify.runtime import ratio_interval

    name = hf.name
    res: dict = {"hf": str(hf), "variants": {}}
    folders = {v: work / name / v for v in VARIANTS}
    _log(f"{name}: the builder")
    made = work / name / "made.json"  # (what --prepare-only made: a later run times it without building again)
    kept = json.loads(made.read_text()) if made.is_file() else {}
    if "builder" in kept:
        res["variants"]["builder"] = kept["builder"]
    else:
        b = _genai.build(hf, folders["builder"], precision=args.precision, execution_provider=args.provider,
                         timeout=1800, cache_dir=work / "builder-cache")
        res["variants"]["builder"] = {"command": b.get("command"), "ok": b.get("ok", "error" not in b),
                                      "seconds": b.get("seconds"), **({"error": b["error"]} if b.get("error") else {})}
    _log(f"{name}: export (chunk, {args.exporter}, {args.precision})")
    chunk = work / name / f"chunk-{args.exporter}-{args.precision}.onnx"
    if not chunk.is_file():
        chunk = _export(hf, chunk, args.exporter, args.precision)
    if not (folders["export"] / "genai_config.json").is_file():
        _export_folder(hf, chunk, folders["export"], args.provider)
    res["variants"]["export"] = {"command": f"models/decoder_models.py export_module(model, 'chunk', ..., "
                                            f"'{args.exporter}') ({args.precision}) + genai_config.json", "ok": True}
    _log(f"{name}: onnxopt")
    if "onnxopt" in kept:
        res["variants"]["onnxopt"] = kept["onnxopt"]
    else:
        try:
            res["variants"]["onnxopt"] = {**_onnxopt_folder(hf, chunk, folders["onnxopt"], args.provider,
                                                            max(args.batch)), "ok": True}
        except Exception as exc:  # noqa: BLE001 - a row, not a crash
            res["variants"]["onnxopt"] = {"ok": False, "error": str(exc)}
    made.write_text(json.dumps(res["variants"], indent=1) + "\n")
    if args.prepare_only:
        return res
    live = [v for v in VARIANTS if res["variants"][v].get("ok")]
    threads = args.threads if args.provider == "cpu" else None
    models = {}
    for v in list(live):
        try:
            models[v] = _genai.load_model(folders[v], threads=threads)
        except _genai.GenaiError as exc:
            res["variants"][v].update(ok=False, error=str(exc))
            live.remove(v)
    cfg = json.loads((folders[live[0]] / "genai_config.json").read_text())
    vocab = int(cfg["model"]["vocab_size"])
    prompts = _prompts(hf, max(args.prompts, 1), args.prompt, vocab)
    total = args.prompt + args.new
    if args.prompts:
        _log(f"{name}: transformers' greedy tokens ({len(prompts)} prompts x {args.new})")
        expected = _genai.transformers_greedy(hf, prompts, args.new)
        for v in live:
            got = [_one_run(og, models[v], np.asarray([p], np.int32), total)[2] for p in prompts]
            equal = sum(int(x == y) for g, e in zip(got, expected) for x, y in zip(g, e))
            res["variants"][v]["tokens_equal"] = f"{equal}/{len(prompts) * args.new}"
            res["variants"][v]["tokens_equal_n"] = equal
    res["batches"] = {}
    for batch in args.batch:
        times = {v: {"prefill": [], "decode": []} for v in live}
        _log(f"{name}: batch {batch}, {args.rounds} interleaved rounds ({args.warmup} warm-up)")
        for r in range(args.warmup + args.rounds):
            order = live[r % len(live):] + live[:r % len(live)]
            prompt = np.asarray([prompts[(r + i) % len(prompts)] for i in range(batch)], np.int32)
            for v in order:
                pf, dc, _ = _one_run(og, models[v], prompt, total)
                if r >= args.warmup:
                    times[v]["prefill"].append(pf)
                    times[v]["decode"].append(dc / (args.new - 1))
        row = {"variants": {v: {"prefill": _stats(times[v]["prefill"]), "decode_per_token": _stats(times[v]["decode"]),
                                "decode_tokens_per_s": round(batch / float(np.median(times[v]["decode"])), 1)}
                            for v in live}, "ratios": {}}
        for a, b_ in (("onnxopt", "builder"), ("onnxopt", "export"), ("export", "builder")):
            if a in times and b_ in times:
                row["ratios"][f"{a}/{b_}"] = {
                    k: ratio_interval([x * 1e3 for x in times[b_][k]], [x * 1e3 for x in times[a][k]])
                    for k in ("prefill", "decode")}
        res["batches"][str(batch)] = row
    if not res["batches"]:
        return res
    first = res["batches"][str(args.batch[0])]  # (the earlier layout: batch 1's figures at the top level)
    for v in live:
        res["variants"][v].update(first["variants"][v])
    res["ratios"] = first["ratios"]
    return res


def render(data: dict) -> str:
    m = data["meta"]
    lines = [f"# Generation through onnxruntime-genai ({m['date']})", "",
             f"Machine: {m['machine']}; onnxruntime {m['onnxruntime']}, onnxruntime-genai {m['onnxruntime_genai']}; "
             f"provider {m.get('provider', 'cpu')}, {m.get('precision', 'fp32')}, "
             f"{m['threads']} intra-op thread(s) (CPU); prompt {m['prompt']} tokens, {m['new']} new tokens, "
             f"{m['rounds']} interleaved rounds after {m['warmup']} warm-up. Command: `{m['command']}`", ""]
    for name, res in data["models"].items():
        for batch, brow in (res.get("batches") or {"1": res}).items():
            lines += [f"## {name}, batch {batch}", "", "| folder | prefill ms (p10-p90) | decode ms/step (p10-p90) | "
                      "decode tokens/s | tokens equal to transformers | how |", "|---|---|---|---|---|---|"]
            for v, row in res["variants"].items():
                if not row.get("ok"):
                    lines.append(f"| {v} | - | - | - | - | failed: {row.get('error')} |")
                    continue
                t = brow["variants"][v]
                pf, dc = t["prefill"], t["decode_per_token"]
                lines.append(f"| {v} | {pf['median_ms']:.2f} ({pf['p10_ms']:.2f}-{pf['p90_ms']:.2f}) | "
                             f"{dc['median_ms']:.3f} ({dc['p10_ms']:.3f}-{dc['p90_ms']:.3f}) | "
                             f"{t.get('decode_tokens_per_s', '-')} | {row.get('tokens_equal', '-')} | "
                             f"`{row.get('command', '')}` |")
            lines += ["", "| ratio of medians | prefill (90% interval) | decode per token (90% interval) |",
                      "|---|---|---|"]
            for pair, r in brow.get("ratios", {}).items():
                cells = []
                for k in ("prefill", "decode"):
                    x = r[k]
                    iv = x.get("interval")
                    cells.append(f"{x['ratio']:.3f}" + (f" ({iv[0]:.3f}-{iv[1]:.3f}) {x['verdict']}" if iv else ""))
                lines.append(f"| {pair} | {cells[0]} | {cells[1]} |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.genai_generation", description=__doc__.splitlines()[0])
    p.add_argument("--hf", action="append", default=[], help="a Hugging Face decoder folder with its tokenizer")
    p.add_argument("--trained", action="store_true", help="the trained decoder (onnxopt.models.trained_decoder)")
    p.add_argument("--random-llama", action="store_true", help="also an 8-layer 512-wide Llama (see the docstring)")
    p.add_argument("--work", required=True, help="folder for the exports and genai folders")
    p.add_argument("--json", required=True)
    p.add_argument("--markdown")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4, help="prompts for the fidelity check (timing cycles them)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--exporter", choices=("legacy", "dynamo"), default="legacy")
    p.add_argument("--provider", choices=("cpu", "cuda"), default="cpu",
                   help="where the three folders run (the builder's -e, onnxopt's target, genai_config's provider)")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="the builder's -p and the export's weights (fp16: the model exported in float16)")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes timed (default 1)")
    p.add_argument("--prepare-only", action="store_true",
                   help="build the three folders (kept in WORK: a later run times them without building again)")
    p.add_argument("--random-config", action="append", default=[], choices=sorted(RANDOM_CONFIGS),
                   help="a Hugging Face folder of this configuration (random float16 weights) made in WORK")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folders = [Path(h) for h in args.hf]
    if args.trained or args.random_llama:
        from onnxopt.models.trained_decoder import trained_decoder_dir

        trained = Path(trained_decoder_dir())
        if args.trained:
            folders.append(trained)
        if args.random_llama:
            folders.append(random_llama(work / "llama-8l512-random", trained))
    folders += [random_config(name, work / f"{name}-random") for name in args.random_config]
    if not folders:
        p.error("give --hf, --trained, --random-llama or --random-config")
    import onnxruntime
    import onnxruntime_genai

    data = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores",
                     "onnxruntime": onnxruntime.__version__, "onnxruntime_genai": onnxruntime_genai.__version__,
                     "threads": args.threads, "prompt": args.prompt, "new": args.new, "rounds": args.rounds,
                     "warmup": args.warmup, "exporter": args.exporter, "provider": args.provider,
                     "precision": args.precision, "batch": args.batch,
                     "command": "python -m scripts.bench.genai_generation " + " ".join(argv or sys.argv[1:])},
            "models": {}}
    for hf in folders:
        data["models"][hf.name] = bench_folder(hf, work, args)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    if args.prepare_only:
        return 0
    if args.markdown:
        Path(args.markdown).write_text(render(data) + "\n")
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
