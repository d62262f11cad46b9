"""Generation after optimization, every decoder (issue 30, point 4): each of the zoo's decode-step decoders
(and the trained real-weights Llama, where it was trained: ``python -m scripts.data.train_decoder``) is
optimized by onnxopt (``--target``, float32 and float16) and compared with its original over greedy generation
with the key/value cache (``onnxopt.verify.decode``): 8 prompts x 64 steps; the trained model's prompts are the
first 24 tokens after the first ``def`` of 8 of its held-out files. Where onnxruntime-genai is installed, its
model builder's model of the trained folder is checked the same way against the export (the peer's fidelity,
and the comparison across two cache layouts). CI runs a subset (tests/test_verify_decode.py); this runs the whole.

    python -m scripts.oracles.decoder_generation [--target ort-cpu] [--steps 64] [--models NAME ...]
        [--json scripts/results/decoders/generation-cpu.json] [--markdown ...md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.peers import machine_info

HERE = Path(__file__).resolve().parents[2]


def _session(path: str):
    from onnxopt.verify.runtime import session

    return session(path, "cpu", threads=1)


def _trained(work: Path) -> tuple[str, list] | None:
    """The trained decoder's decode-step export (legacy) and its held-out prompts, or None when not trained."""
    try:
        from onnxopt.models.trained_decoder import trained_decoder_dir
        d = trained_decoder_dir()
    except (ImportError, FileNotFoundError):
        return None
    from tokenizers import Tokenizer

    from onnxopt.models import decoder_models as dm
    from onnxopt.models.transformers_models import import_transformers

    tf = import_transformers()
    path = work / "trained-kv-legacy.onnx"
    dm.export_module(tf.AutoModelForCausalLM.from_pretrained(str(d)).eval(), "kv", path, "legacy")
    meta = json.loads((d / "train_metadata.json").read_text())
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    prompts = []
    for rel in meta["corpus"]["held_out_files"]:
        text = Path(meta["corpus"]["root"], rel).read_text(encoding="utf-8")
        i = text.find("\ndef ")
        ids = tok.encode(text[i + 1:i + 400]).ids[:24] if i >= 0 else []
        if len(ids) == 24:
            prompts.append(ids)
        if len(prompts) == 8:
            break
    return str(path), prompts


def _genai_row(work: Path, steps: int, export: str, prompts: list) -> dict:
    """The peer checked the same way: onnxruntime-genai's model builder (fp32, cpu) on the trained decoder's
    folder, against the torch.onnx decode step of the same weights (each with its own cache: GroupQueryAttention's
    and the export's Concat; the prompt read in one run against token by token)."""
    row = {"model": "trained: onnxruntime-genai builder vs torch.onnx export", "precision": "fp32"}
    try:
        from onnxopt.models.trained_decoder import trained_decoder_dir
        from scripts.bench._genai import build
    except ImportError as exc:
        return {**row, "skipped": f"not available: {exc}"}
    out = work / "genai-trained"
    built = build(trained_decoder_dir(), out, precision="fp32", execution_provider="cpu")
    if not built.get("ok"):
        return {**row, "skipped": f"the builder failed: {built.get('error')}"}
    from onnxopt.verify.decode import compare_generation

    res = compare_generation(_session(export), _session(str(out / "model.onnx")),
                             steps=steps, prompts=prompts, folders=(None, str(out)))
    return {**row, "ok": res["ok"], "tokens_identical": res["tokens_identical"],
            "tokens_compared": res["tokens_compared"], "first_divergence": res["first_divergence"],
            "logits_max_abs": res["logits"]["max_abs"], "rotary_embedding": "-", "group_query_attention": "-",
            "prompts": "held-out files",
            "builder": built.get("command")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="ort-cpu", choices=("ort-cpu", "ort-cuda"))
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--models", nargs="*", help="zoo decoders (default: every decode-step one) and/or 'trained'")
    ap.add_argument("--json", default=str(HERE / "scripts/results/decoders/generation-cpu.json"))
    ap.add_argument("--markdown", default=str(HERE / "scripts/results/decoders/generation-cpu.md"))
    args = ap.parse_args(argv)
    from onnxopt import optimize
    from onnxopt.models import zoo
    from onnxopt.verify.decode import compare_generation

    names = args.models or [s.name for s in zoo.SPECS if s.family == "decoder" and "-kv-" in s.name] + ["trained"]
    rows, trained = [], None
    with tempfile.TemporaryDirectory(prefix="onnxopt-gen-") as tmp:
        work = Path(tmp)
        for name in names:
            prompts = None
            if name == "trained":
                trained = _trained(work)
                if trained is None:
                    rows.append({"model": name, "skipped": "not trained (python -m scripts.data.train_decoder)"})
                    continue
                src, prompts = trained
            else:
                spec = zoo.get(name)
                src = str(spec.path()) if spec.path().exists() else str(work / f"{name}.onnx")
                if not os.path.exists(src):
                    spec.build(Path(src))
            for precision in ("fp32", "fp16"):
                out = str(work / f"{name}-{precision}.onnx")
                t0 = time.perf_counter()
                kw = {"precision": precision} if precision != "fp32" else {}
                _, report = optimize(src, target=args.target, output=out, return_report=True, **kw)
                res = compare_generation(_session(src), _session(out), steps=args.steps, prompts=prompts,
                                         fp16=precision == "fp16")
                rows.append({"model": name, "precision": precision, "ok": res["ok"],
                             "tokens_identical": res["tokens_identical"], "tokens_compared": res["tokens_compared"],
                             "first_divergence": res["first_divergence"], "logits_max_abs": res["logits"]["max_abs"],
                             "rotary_embedding": (report.fusions.get("rotary_embedding") or {}).get("hits"),
                             "group_query_attention": (report.fusions.get("group_query_attention") or {}).get("hits"),
                             "prompts": "held-out files" if prompts else "generated",
                             "seconds": round(time.perf_counter() - t0, 2)})
                print(json.dumps(rows[-1]), flush=True)
        if trained is not None:  # (the trained decoder's export and prompts, made once above)
            rows.append(_genai_row(work, args.steps, *trained))
            print(json.dumps(rows[-1]), flush=True)
    doc = {"target": args.target, "steps": args.steps, "machine": f"{machine_info()['cpu']}, 1 thread",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1))
    lines = [f"# Greedy generation after `--target {args.target}`: {args.steps} steps x 8 prompts, each model with "
             f"its own cache ({doc['date']})", "",
             "| model | precision | tokens identical | first divergence | logits max abs | rotary fused | GQA fused |",
             "|---|---|---:|---|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} | - | {r['skipped']} | | | | |")
            continue
        fd = r["first_divergence"]
        where = "-" if fd is None else f"prompt {fd['prompt']} step {fd['step']}"
        lines.append(f"| {r['model']} | {r['precision']} | {r['tokens_identical']} / {r['tokens_compared']} | "
                     f"{where} | {r['logits_max_abs']:.2g} | {r['rotary_embedding']} | "
                     f"{r.get('group_query_attention', '-')} |")
    Path(args.markdown).write_text("\n".join(lines) + "\n")
    failed = [r for r in rows if r.get("ok") is False]
    print(f"{len(rows) - len(failed)} of {len(rows)} rows pass", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
