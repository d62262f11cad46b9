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


def _export(hf: Path, path: Path, exporter: str) -> Path:
    _genai.skip_torchvision_meta_registrations()
    from transformers import AutoModelForCausalLM

    from onnxopt.models import decoder_models

    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    return decoder_models.export_module(model, "chunk", path, exporter)


def _export_folder(hf: Path, chunk: Path, out: Path) -> None:
    """The export as it is, with onnxopt's genai_config.json and the tokenizer (no rewriting)."""
    import onnx_ir as ir

    from onnxopt.ir import genai, io

    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(chunk, out / "model.onnx")
    folder = genai.check_folder(hf)
    with io.Outputs() as outputs:  # (onnxopt's own writer: claimed, staged, committed)
        genai.stage(outputs, genai.claim(outputs, out / "model.onnx", folder),
                    genai.config(ir.load(chunk), folder, "model.onnx"))


def _onnxopt_folder(hf: Path, chunk: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "onnxopt", str(chunk), "-o", str(out / "model.onnx"), "--target", "ort-cpu",
           "--input-shape", "input_ids=1,sequence", "--genai", str(hf), "--json", str(out / "report.json")]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    if r.returncode:
        raise RuntimeError(f"onnxopt failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    report = json.loads((out / "report.json").read_text())
    return {"command": "python -m onnxopt chunk.onnx -o OUT/model.onnx --target ort-cpu --input-shape "
                       "input_ids=1,sequence --genai HF", "seconds": round(time.perf_counter() - t0, 2),
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
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, batch_size=1, max_length=total, min_length=total)
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
    b = _genai.build(hf, folders["builder"], precision="fp32", execution_provider="cpu", timeout=1800,
                     cache_dir=work / "builder-cache")
    res["variants"]["builder"] = {"command": b.get("command"), "ok": b.get("ok", "error" not in b),
                                  **({"error": b["error"]} if b.get("error") else {})}
    _log(f"{name}: export (chunk, {args.exporter})")
    chunk = _export(hf, work / name / f"chunk-{args.exporter}.onnx", args.exporter)
    _export_folder(hf, chunk, folders["export"])
    res["variants"]["export"] = {"command": f"models/decoder_models.py export_module(model, 'chunk', ..., "
                                            f"'{args.exporter}') + genai_config.json", "ok": True}
    _log(f"{name}: onnxopt")
    try:
        res["variants"]["onnxopt"] = {**_onnxopt_folder(hf, chunk, folders["onnxopt"]), "ok": True}
    except Exception as exc:  # noqa: BLE001 - a row, not a crash
        res["variants"]["onnxopt"] = {"ok": False, "error": str(exc)}
    live = [v for v in VARIANTS if res["variants"][v].get("ok")]
    models = {v: _genai.load_model(folders[v], threads=args.threads) for v in live}
    cfg = json.loads((folders[live[0]] / "genai_config.json").read_text())
    vocab = int(cfg["model"]["vocab_size"])
    prompts = _prompts(hf, args.prompts, args.prompt, vocab)
    _log(f"{name}: transformers' greedy tokens ({len(prompts)} prompts x {args.new})")
    expected = _genai.transformers_greedy(hf, prompts, args.new)
    total = args.prompt + args.new
    for v in live:
        got = [_one_run(og, models[v], np.asarray([p], np.int32), total)[2] for p in prompts]
        equal = sum(int(x == y) for g, e in zip(got, expected) for x, y in zip(g, e))
        res["variants"][v]["tokens_equal"] = f"{equal}/{len(prompts) * args.new}"
        res["variants"][v]["tokens_equal_n"] = equal
    times = {v: {"prefill": [], "decode": []} for v in live}
    _log(f"{name}: {args.rounds} interleaved rounds ({args.warmup} warm-up), threads {args.threads}")
    for r in range(args.warmup + args.rounds):
        order = live[r % len(live):] + live[:r % len(live)]
        prompt = np.asarray([prompts[r % len(prompts)]], np.int32)
        for v in order:
            pf, dc, _ = _one_run(og, models[v], prompt, total)
            if r >= args.warmup:
                times[v]["prefill"].append(pf)
                times[v]["decode"].append(dc / (args.new - 1))
    for v in live:
        res["variants"][v]["prefill"] = _stats(times[v]["prefill"])
        res["variants"][v]["decode_per_token"] = _stats(times[v]["decode"])
    res["ratios"] = {}
    for a, b_ in (("onnxopt", "builder"), ("onnxopt", "export"), ("export", "builder")):
        if a in times and b_ in times:
            res["ratios"][f"{a}/{b_}"] = {
                k: ratio_interval([x * 1e3 for x in times[b_][k]], [x * 1e3 for x in times[a][k]])
                for k in ("prefill", "decode")}
    return res


def render(data: dict) -> str:
    m = data["meta"]
    lines = [f"# Generation through onnxruntime-genai ({m['date']})", "",
             f"Machine: {m['machine']}; onnxruntime {m['onnxruntime']}, onnxruntime-genai {m['onnxruntime_genai']}; "
             f"{m['threads']} intra-op thread(s); prompt {m['prompt']} tokens, {m['new']} new tokens, batch 1, "
             f"{m['rounds']} interleaved rounds after {m['warmup']} warm-up. Command: `{m['command']}`", ""]
    for name, res in data["models"].items():
        lines += [f"## {name}", "", "| folder | prefill ms (p10-p90) | decode ms/token (p10-p90) | tokens equal to "
                  "transformers | how |", "|---|---|---|---|---|"]
        for v, row in res["variants"].items():
            if not row.get("ok"):
                lines.append(f"| {v} | - | - | - | failed: {row.get('error')} |")
                continue
            pf, dc = row["prefill"], row["decode_per_token"]
            lines.append(f"| {v} | {pf['median_ms']:.2f} ({pf['p10_ms']:.2f}-{pf['p90_ms']:.2f}) | "
                         f"{dc['median_ms']:.3f} ({dc['p10_ms']:.3f}-{dc['p90_ms']:.3f}) | {row['tokens_equal']} | "
                         f"`{row.get('command', '')}` |")
        lines += ["", "| ratio of medians | prefill (90% interval) | decode per token (90% interval) |", "|---|---|---|"]
        for pair, r in res.get("ratios", {}).items():
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
    if not folders:
        p.error("give --hf, --trained or --random-llama")
    import onnxruntime
    import onnxruntime_genai

    data = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores",
                     "onnxruntime": onnxruntime.__version__, "onnxruntime_genai": onnxruntime_genai.__version__,
                     "threads": args.threads, "prompt": args.prompt, "new": args.new, "rounds": args.rounds,
                     "warmup": args.warmup, "exporter": args.exporter,
                     "command": "python -m scripts.bench.genai_generation " + " ".join(argv or sys.argv[1:])},
            "models": {}}
    for hf in folders:
        data["models"][hf.name] = bench_folder(hf, work, args)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(render(data) + "\n")
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
