"""The tiny decoders exported by optimum (issue 30, point 1), checked against transformers, then optimized
by onnxopt and verified: the optimum rows of the decoder export matrix.

    python -m scripts.oracles.optimum_exports [--only ARCH ...] [--forms kv prefill] [--target ort-cpu]
                                              [--decode 16] [--keep DIR] [--out DIR]

optimum-onnx 0.1.0 pins ``transformers<4.58``, so optimum never runs in this interpreter: its environment
is ``scripts.bench._optimum.environment()`` (``python -m scripts.bench._optimum setup`` makes
``<repository>/.venv-optimum``). There, ``python -m scripts.oracles.optimum_exports --run JOB`` does per
architecture of ``onnxopt.models.decoder_models`` (same tiny configs, ``config_entries`` translating
transformers 5's ``rope_parameters`` into the 4.x keys, same seed):

1. builds the model with random weights from the config (``torch.manual_seed(seed)``, optimum's
   transformers) and saves it as a Hugging Face folder (``save_pretrained``);
2. exports it as optimum's documentation tells a user, one process per export::

       optimum-cli export onnx --model DIR --task text-generation-with-past OUT   # form kv
       optimum-cli export onnx --model DIR --task text-generation OUT             # form prefill (no cache)

   (``--cli`` runs optimum-cli's own entry point, ``optimum.commands.optimum_cli.main``, with the same
   arguments, after skipping torchvision's meta registrations, which the CPU torchvision wheel here cannot
   load, as ``scripts.bench._optimum`` does); a failed export is recorded with the exporter's error (its
   last ``Type: message`` line): that row is optimum's limit, not a miss of onnxopt's;
3. checks each export against the transformers model on realistic feeds (``decoder_models.feeds``: batch 2;
   prefill 16 tokens right-padded, kv one new token after a real past of 12, left-padded; and batch 3 / 1 of
   other sizes): max |ONNX - torch| over all outputs, by onnxruntime CPU. optimum's kv export takes
   ``decoder_models``' kv names (``past_key_values.N.key/value`` in, ``present.N.key/value`` out, BNSH), so
   the same feeds and reference serve (``models`` imported from the repository root by path: its feeds and
   wrappers need only torch and transformers); an export without ``position_ids`` (optimum's Gemma 2 and 3)
   numbers the new tokens from the past's length, as transformers does when given none, so its reference
   is computed with those positions.

Back in this interpreter each export that ran is optimized (``python -m onnxopt IN -o OUT --target T --json``)
and verified (``python -m onnxopt verify IN OUT --json``, with ``--decode N`` for the kv form), both as
subprocesses; the fusions (hits, misses and their reasons) are read from the optimizer's JSON report.
Writes ``<out>/optimum.json`` and ``<out>/optimum.md`` (default scripts/results/decoders). Exit 1 when an
export disagrees with transformers or a verification fails; exporter errors and fusion misses are recorded.

This module imports only the standard library at load time (it is also the runner in optimum's environment).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "scripts" / "results" / "decoders"
TASKS = {"kv": "text-generation-with-past", "prefill": "text-generation"}
TOLERANCE = 1e-4
OTHER_SIZES = {"prefill": ((3, 11), (1, 5)), "kv": ((3, 10), (1, 5))}  # as decoder_exports
# the fusion families of the table (keys of the optimizer report's "fusions"), and the ops they write
FUSIONS = {"gqa": ("group_query_attention",), "gqa_present": ("group_query_attention_present",),
           "rotary": ("rotary_embedding",), "rms": ("rms_normalization",),
           "packed": ("packed_projections",), "mha": ("multi_head_attention", "attention_fusion")}
FUSED_OPS = ("GroupQueryAttention", "MultiHeadAttention", "RotaryEmbedding", "SimplifiedLayerNormalization",
             "SkipSimplifiedLayerNormalization", "RMSNormalization")


def config_entries(entries: dict) -> dict:
    """``decoder_models.tiny_config`` entries as transformers 4.x configs take them: transformers 5's
    ``rope_parameters`` becomes ``rope_theta`` and ``partial_rotary_factor`` (4.x reads both at the top
    level); everything else is kept."""
    out = dict(entries)
    rope = out.pop("rope_parameters", None)
    if rope:
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} has no translation here")
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope:
                out[key] = rope[key]
    return out


def export_argv(model_dir: str | Path, form: str, out_dir: str | Path) -> list[str]:
    """optimum-cli's arguments for ``form`` (``kv``: with the cache, ``prefill``: without)."""
    if form not in TASKS:
        raise ValueError(f"unknown form {form!r}; known: {', '.join(TASKS)}")
    return ["export", "onnx", "--model", str(model_dir), "--task", TASKS[form], str(out_dir)]


def exporter_error(text: str, returncode: int) -> str:
    """The exporter's error of a failed optimum-cli run: the last ``SomeError: message`` line of its output
    (a traceback's last line), else its last line, else the exit status."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    pat = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)|AssertionError)\b:?")
    for ln in reversed(lines):
        if pat.match(ln):
            return ln[:400]
    return (lines[-1][:400] if lines else f"optimum-cli exited with {returncode}")


def fusion_summary(report: dict) -> dict:
    """Per family of ``FUSIONS``: hits, missed and the reasons (count each) summed over its report keys;
    and the fused ops in the optimized model (``op_types_after``)."""
    fus = report.get("fusions", {})
    out = {}
    for family, keys in FUSIONS.items():
        hits = missed = 0
        reasons: dict[str, int] = {}
        for k in keys:
            e = fus.get(k)
            if not e:
                continue
            hits += e.get("hits", 0)
            missed += e.get("missed", 0)
            for r, n in e.get("reasons", {}).items():
                reasons[r] = reasons.get(r, 0) + n
        out[family] = {"hits": hits, "missed": missed, "reasons": reasons}
    after = report.get("op_types_after", {})  # (contrib ops named with their domain: com.microsoft.X)
    out["ops"] = {}
    for name, count in after.items():
        op = name.rsplit(".", 1)[-1]
        if op in FUSED_OPS and count:
            out["ops"][op] = out["ops"].get(op, 0) + count
    return out


def _cell(f: dict | None) -> str:
    if not f:
        return ""
    s = f"{f['hits']}/{f['hits'] + f['missed']}" if f["hits"] + f["missed"] else "-"
    if f["missed"] and f["reasons"]:
        # the reasons of the misses first (a reason counted more often than the misses is also given where
        # the rule's pattern met a node it does not start from), commonest first
        top = sorted(f["reasons"].items(), key=lambda kv: (kv[1] > f["missed"], -kv[1]))[:3]
        s += " (" + "; ".join(f"{r} x{n}" for r, n in top).replace("|", "/") + ")"
    return s


def _count(f: dict | None) -> str:
    """hits/(hits+misses) alone (the present rule misses wherever no GroupQueryAttention was fused)."""
    return "" if not f else f"{f['hits']}/{f['hits'] + f['missed']}" if f["hits"] + f["missed"] else "-"


def markdown(rows: list[dict], meta: dict) -> str:
    """The table of ``rows`` (as ``run`` returns them)."""
    lines = ["# Decoders exported by optimum: export, check, onnxopt's fusions and verification", "",
             f"{meta['machine']}; optimum's environment: {', '.join(f'{k} {v}' for k, v in meta['optimum'].items())}; "
             f"onnxopt's: onnxruntime {meta.get('onnxruntime', '?')}. Exports by `optimum-cli export onnx --model DIR "
             f"--task text-generation-with-past` (kv) and `--task text-generation` (prefill) from a Hugging Face "
             f"folder of the tiny config (`onnxopt.models.decoder_models`, seed 0, random weights). Diff: max "
             f"|ONNX - transformers| over all outputs on the realistic feeds and other sizes. Then "
             f"`python -m onnxopt IN -o OUT --target {meta['target']}` (fusions: hits/(hits+misses), the "
             f"misses' reasons, commonest first, then the pattern's; GQA present: the cache Concats the fused op's "
             f"present output would replace; -: the rule's pattern never reached its condition) and `python -m onnxopt verify IN OUT` (kv: `--decode {meta['decode']}`). "
             f"Produced by `python -m scripts.oracles.optimum_exports`.", "",
             "| arch | form | export | nodes | diff | onnxopt flags | GQA | GQA present | rotary | RMSNorm | packed "
             "| ops after | verify | generation | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fu = r.get("fusions") or {}
        diff = max(r.get("max_abs_diff", float("nan")), r.get("max_abs_diff_other_sizes", float("nan"))) \
            if "max_abs_diff" in r else None
        ops = ", ".join(f"{k} {v}" for k, v in fu.get("ops", {}).items())
        gen = r.get("decode")
        gen_s = (f"{gen['tokens_identical']}/{gen['tokens_compared']} tokens" if gen else "")
        lines.append(f"| {r['arch']} | {r['form']} | {r['status']} | {r.get('nodes', '')} | "
                     f"{'' if diff is None else f'{diff:.1e}'} | "
                     f"{'--input-shape ' + r['input_shape'] if r.get('input_shape') else ''} | {_cell(fu.get('gqa'))} | "
                     f"{_count(fu.get('gqa_present'))} | {_cell(fu.get('rotary'))} | {_cell(fu.get('rms'))} | "
                     f"{_cell(fu.get('packed'))} | {ops} | {r.get('verify', '')} | {gen_s} | "
                     f"{r.get('error', '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# In optimum's environment


def _skip_torchvision_meta() -> None:
    import types

    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


def run_cli(argv: list[str]) -> int:
    """optimum-cli with ``argv`` (its console script's entry point, in this process)."""
    _skip_torchvision_meta()
    from optimum.commands.optimum_cli import main as optimum_cli

    sys.argv = ["optimum-cli", *argv]
    optimum_cli()
    return 0


def _check(path: Path, form: str, model) -> dict:
    """max |ONNX - transformers| on the feeds and on other sizes (as decoder_exports.row)."""
    import numpy as np
    import onnxruntime as ort

    from models import decoder_models as dm

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    takes_positions = "position_ids" in {i.name for i in sess.get_inputs()}

    def diff(feed):
        if not takes_positions:  # the model numbers the new tokens from the past's length, as transformers
            past = feed["attention_mask"].shape[1] - feed["input_ids"].shape[1]  # does without position_ids
            feed = {**feed, "position_ids": np.broadcast_to(
                np.arange(past, past + feed["input_ids"].shape[1], dtype=np.int64), feed["input_ids"].shape).copy()}
        ref = dm.torch_outputs(form, model, feed)
        got = sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})
        worst = 0.0
        for out, g in zip(sess.get_outputs(), got):
            if out.name not in ref or g.shape != ref[out.name].shape:
                return float("inf")
            worst = max(worst, float(np.abs(g.astype(np.float64) - ref[out.name]).max()))
        return worst

    return {"position_ids": takes_positions, "max_abs_diff": diff(dm.feeds(form, model)),
            "max_abs_diff_other_sizes": max(diff(dm.feeds(form, model, b, n, seed=1)) for b, n in OTHER_SIZES[form]),
            "inputs": [i.name for i in sess.get_inputs()], "outputs": [o.name for o in sess.get_outputs()]}


def run_job(job_file: str) -> int:
    """Build, save, export and check every (arch, form) of the job; write its result JSON."""
    job = json.loads(Path(job_file).read_text())
    work = Path(job["work"])
    _skip_torchvision_meta()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import onnx
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.set_num_threads(1)
    rows = []
    for arch, spec in job["archs"].items():
        hf = work / f"{arch}-hf"
        try:
            cfg = getattr(tf, spec["config_class"])(**spec["config"])
            torch.manual_seed(job["seed"])
            model = getattr(tf, spec["model_class"])(cfg).eval()
            model.save_pretrained(str(hf))
        except Exception as exc:  # noqa: BLE001 - transformers 4.x refuses the config: recorded
            msg = f"transformers {tf.__version__}: {type(exc).__name__}: {exc}".splitlines()[0][:400]
            rows += [{"arch": arch, "form": f, "status": "error", "error": msg, "export_s": 0.0} for f in job["forms"]]
            continue
        for form in job["forms"]:
            rec = {"arch": arch, "form": form, "hf_dir": str(hf)}
            out = work / f"{arch}-{form}"
            argv = export_argv(hf, form, out)
            rec["command"] = "optimum-cli " + " ".join(argv)
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "scripts.oracles.optimum_exports", "--cli", *argv],
                                  capture_output=True, text=True, env=os.environ.copy(), timeout=job["timeout"])
            rec["export_s"] = round(time.perf_counter() - t0, 1)
            onnx_path = out / "model.onnx"
            if proc.returncode != 0 or not onnx_path.is_file():
                rec.update(status="error", error=exporter_error(proc.stderr + "\n" + proc.stdout, proc.returncode))
                rows.append(rec)
                continue
            proto = onnx.load(str(onnx_path))
            rec.update(path=str(onnx_path), nodes=len(proto.graph.node),
                       opset=next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")))
            try:
                with torch.no_grad():
                    rec.update(_check(onnx_path, form, model))
            except Exception as exc:  # noqa: BLE001 - exported but not runnable or not comparable
                rec.update(status="run-error", error=f"{type(exc).__name__}: {exc}".splitlines()[0][:400])
                rows.append(rec)
                continue
            ok = max(rec["max_abs_diff"], rec["max_abs_diff_other_sizes"]) <= TOLERANCE
            rec["status"] = "ok" if ok else "mismatch"
            rows.append(rec)
    import importlib.metadata as md

    versions = {d: md.version(d) for d in ("optimum-onnx", "optimum", "transformers", "torch")}
    Path(job["result"]).write_text(json.dumps({"rows": rows, "versions": versions}, indent=1))
    return 0


# ---------------------------------------------------------------------------------------------
# In onnxopt's environment


def job_archs(archs: list[str]) -> dict:
    """Per architecture: the transformers 4.x config class, model class and config entries."""
    from onnxopt.models import decoder_models as dm

    return {a: {"config_class": dm.CLASSES[a][0], "model_class": dm.CLASSES[a][1],
                "config": config_entries(dm.tiny_config(a))} for a in archs}


def export_all(archs: list[str], forms: list[str], work: Path, *, seed: int = 0, timeout: float = 600.0) -> dict:
    """Run the job in optimum's environment (``OptimumUnavailable`` when it is absent); its result."""
    from scripts.bench._optimum import environment

    command, env = environment()
    env.setdefault("OMP_NUM_THREADS", "1")
    job = {"archs": job_archs(archs), "forms": forms, "seed": seed, "work": str(work),
           "result": str(work / "result.json"), "timeout": timeout}
    (work / "job.json").write_text(json.dumps(job, indent=1))
    proc = subprocess.run(command + ["-m", "scripts.oracles.optimum_exports", "--run", str(work / "job.json")],
                          capture_output=True, text=True, env=env, cwd=str(ROOT),
                          timeout=timeout * (len(archs) * len(forms) + 1))
    try:
        return json.loads((work / "result.json").read_text())
    except (OSError, ValueError):
        raise RuntimeError(f"optimum's process exited with {proc.returncode}: "
                           f"{exporter_error(proc.stderr, proc.returncode)}") from None


def batch_one(path: str | Path) -> str | None:
    """``--input-shape`` fixing the batch of a kv export to 1 (``input_ids=1,<its sequence symbol>``: the symbol
    takes 1 in every input), as docs/decoders.md tells for exports taking several new tokens after a past
    (onnxruntime's GroupQueryAttention refuses those at batch > 1); None when input_ids has no symbolic batch."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    ids = next((i for i in proto.graph.input if i.name == "input_ids"), None)
    dims = list(ids.type.tensor_type.shape.dim) if ids is not None else []
    if len(dims) != 2 or not dims[0].dim_param:
        return None
    return f"input_ids=1,{dims[1].dim_param or dims[1].dim_value}"


def optimize_and_verify(rec: dict, work: Path, target: str, decode: int) -> dict:
    """``python -m onnxopt`` (with the row's ``input_shape``, if any) and ``python -m onnxopt verify`` on the
    row's export: fusions and verdicts."""
    src = rec["path"]
    tag = f"{rec['arch']}-{rec['form']}" + ("-batch1" if rec.get("input_shape") else "")
    dst = work / f"{tag}.opt.onnx"
    rep = work / f"{tag}.opt.json"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    shape = ["--input-shape", rec["input_shape"]] if rec.get("input_shape") else []
    proc = subprocess.run([sys.executable, "-m", "onnxopt", src, "-o", str(dst), "--target", target, "-q",
                           "--json", str(rep), *shape], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        rec["optimize_error"] = exporter_error(proc.stderr, proc.returncode)
        rec["verify"] = f"not optimized (exit {proc.returncode})"
        return rec
    report = json.loads(rep.read_text())
    rec["fusions"] = fusion_summary(report)
    rec["nodes_after"] = report.get("nodes_after")
    vrep = work / f"{tag}.verify.json"
    # (verify's --input-shape takes numbers only; the batch-1 model is verified at the batch verify generates
    # for it: decode runs each prompt as a batch of one)
    cmd = [sys.executable, "-m", "onnxopt", "verify", src, str(dst), "--json", str(vrep), "--runs", "20"]
    if rec["form"] == "kv" and decode:
        cmd += ["--decode", str(decode)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    try:
        v = json.loads(vrep.read_text())
    except (OSError, ValueError):
        rec["verify"] = f"verify exited with {proc.returncode}: {exporter_error(proc.stderr, proc.returncode)}"
        rec["verify_ok"] = False  # (a model verify cannot run is a failure, not a pass)
        return rec
    verdict = re.search(r"^verdict: (.*)$", proc.stdout, re.M)
    rec["verify"] = verdict.group(1) if verdict else ("outputs agree" if v.get("ok") else "outputs differ")
    rec["verify_ok"] = bool(v.get("ok"))
    dec = (v.get("providers", {}).get("cpu") or {}).get("decode")
    if dec:
        rec["decode"] = {k: dec[k] for k in ("steps", "tokens_compared", "tokens_identical", "first_divergence",
                                             "logits") if k in dec}
    return rec


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run"]:
        return run_job(argv[1])
    if argv[:1] == ["--cli"]:
        return run_cli(argv[1:])
    archs = ("llama", "llama-mha", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mistral")  # decoder_models.ARCHS
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.optimum_exports", description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=archs, default=list(archs))
    p.add_argument("--forms", nargs="+", choices=tuple(TASKS), default=list(TASKS))
    p.add_argument("--target", default="ort-cpu")
    p.add_argument("--decode", type=int, default=16, help="verify's --decode N on the kv form (0: none)")
    p.add_argument("--keep", type=Path, default=None, help="keep the Hugging Face folders and models here")
    p.add_argument("--out", type=Path, default=OUT, help=f"results folder (default {OUT})")
    p.add_argument("--reuse", action="store_true",
                   help="with --keep: take the exports of an earlier run kept there (its result.json) instead of "
                        "exporting again (optimum's environment is then not needed)")
    args = p.parse_args(argv)
    if args.reuse and not (args.keep and (args.keep / "result.json").is_file()):
        p.error("--reuse needs --keep DIR holding an earlier run's result.json")
    from scripts.bench._optimum import OptimumUnavailable
    from scripts.bench.peers import machine_info

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="onnxopt-optimum-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            if args.reuse:
                res = json.loads((work / "result.json").read_text())
                res["rows"] = [r for r in res["rows"] if r["arch"] in args.only and r["form"] in args.forms]
            else:
                res = export_all(args.only, args.forms, work.resolve())
        except OptimumUnavailable as exc:
            print(f"scripts.oracles.optimum_exports: error: {exc}", file=sys.stderr)
            return 2
        rows = []
        for rec in res["rows"]:
            rows.append(rec)
            shape = batch_one(rec["path"]) if rec["form"] == "kv" and rec["status"] in ("ok", "mismatch") else None
            if shape:
                rows.append({**rec, "input_shape": shape})
        for rec in rows:
            if rec["status"] in ("ok", "mismatch"):
                optimize_and_verify(rec, work, args.target, args.decode)
            print(f"{rec['arch']:<10} {rec['form']:<8} {rec.get('input_shape', ''):<32} {rec['status']:<8} "
                  f"{rec.get('nodes', ''):>5} "
                  f"diff {rec.get('max_abs_diff', float('nan')):.1e} "
                  f"gqa {_cell((rec.get('fusions') or {}).get('gqa'))} {rec.get('verify', '')} {rec.get('error', '')}",
                  flush=True)
            for k in ("path", "hf_dir"):
                rec.pop(k, None)
            rec["command"] = rec.get("command", "").replace(f"{work.resolve()}/", "")  # (the kept folder's names)
    import onnxruntime

    meta = {"machine": f"{machine_info()['cpu']}, {os.cpu_count()} cores (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})",
            "optimum": res["versions"], "onnxruntime": onnxruntime.__version__, "target": args.target,
            "decode": args.decode, "tolerance": TOLERANCE}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimum.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out / "optimum.md").write_text(markdown(rows, meta))
    bad = [r for r in rows if r["status"] in ("mismatch", "run-error") or r.get("verify_ok") is False]
    print(f"{sum(r['status'] == 'ok' for r in rows)} exported and checked, "
          f"{sum(r['status'] == 'error' for r in rows)} exporter errors, {len(bad)} failures; written to {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
