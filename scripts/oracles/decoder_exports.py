"""Decoder export matrix: every tiny decoder of ``onnxopt.models.decoder_models`` (architecture x form x
exporter) exported, and the export checked against torch on realistic feeds with onnxruntime CPU.

    python -m scripts.oracles.decoder_exports [--out DIR] [--keep DIR] [--only ARCH ...] [--forms ...]
                                              [--exporters ...] [--attn default|eager|sdpa ...]

Each architecture runs with transformers' default attention implementation (sdpa; eager for Gemma 2,
which has no sdpa path) and with eager attention (explicit repeat_kv, MatMul, Softmax).

Per row: ``ok`` or the exporter's error (one line: exception type and message; such a row is the
exporter's limit, not a miss of onnxopt's), the node count and the op types of the exported graph,
the largest absolute difference of any output to torch on the feeds (batch 2; prefill 16 tokens, kv a
past of 12) and on feeds of other dynamic sizes (batch 3 of 11 tokens / a past of 10, and batch 1 of 5:
a size baked into the graph shows here), whether the logits move when one token changes (and, kv, when the
past is the cache of another prefix), and the export seconds. Writes
``<out>/export-matrix.json`` and ``<out>/export-matrix.md`` (default out:
scripts/results/decoders). Exit status 1 when an exported model disagrees with torch by more than
``TOLERANCE`` or its outputs do not follow its inputs; exporter errors are recorded, not failures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx

from onnxopt.models import decoder_models as dm
from scripts.bench.peers import machine_info

TOLERANCE = 1e-4
OUT = Path(__file__).resolve().parents[1] / "results" / "decoders"
# (batch, sequence or past) of the other feeds: longer than the sliding window (8) and shorter, batch 1 unpadded
OTHER_SIZES = {"prefill": ((3, 11), (1, 5)), "kv": ((3, 10), (1, 5))}
# ops that tell how attention, rotary and the cache were exported (counted per row)
WATCHED = ("MatMul", "Softmax", "Sin", "Cos", "Concat", "Expand", "Trilu", "Where", "Tile", "Slice",
           "Split", "Neg", "Range", "CumSum", "Pow", "ReduceMean", "Tanh")





def session(path: Path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def max_diff(sess, form: str, model, feed: dict) -> float:
    ref = dm.torch_outputs(form, model, feed)
    got = sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})
    diffs = []
    for out, g in zip(sess.get_outputs(), got):
        r = ref[out.name]
        if g.shape != r.shape:
            return float("inf")
        diffs.append(float(np.abs(g.astype(np.float64) - r).max()))
    return max(diffs)


def logits_move(sess, feed: dict, changed: dict) -> float:
    """max |logits(feed) - logits(changed)| by the exported model."""
    names = [i.name for i in sess.get_inputs()]
    a = sess.run(["logits"], {n: feed[n] for n in names})[0]
    b = sess.run(["logits"], {n: changed[n] for n in names})[0]
    return float(np.abs(a - b).max())


def one_token_changed(form: str, feed: dict, vocab: int) -> dict:
    """``feed`` with the last real token of row 0 replaced (prefill: a token before the last position, so
    only attention carries the change to the last position's logits)."""
    ids = feed["input_ids"].copy()
    col = ids.shape[1] - 1 if form == "kv" else ids.shape[1] // 2
    ids[0, col] = 3 + (ids[0, col] - 3 + 1) % (vocab - 3)
    return {**feed, "input_ids": ids}


def row(arch: str, form: str, exporter: str, work: Path, attn: str | None = None) -> dict:
    rec = {"arch": arch, "form": form, "exporter": exporter, "attn": attn or "default"}
    try:
        model = dm.build_module(arch, attn=attn)
    except Exception as exc:  # noqa: BLE001 - transformers refuses the configuration (e.g. sdpa for Gemma 2)
        return {**rec, "status": "error", "export_s": 0.0,
                "error": f"transformers: {type(exc).__name__}: {exc}".splitlines()[0][:400]}
    rec["attn"] = model.config._attn_implementation
    path = work / f"{arch}-{form}-{exporter}-{rec['attn']}.onnx"
    t0 = time.perf_counter()
    try:
        dm.export_module(model, form, path, exporter)
    except Exception as exc:  # noqa: BLE001 - the exporter's limit, recorded
        rec.update(status="error", error=f"{type(exc).__name__}: {exc}".splitlines()[0][:400],
                   export_s=round(time.perf_counter() - t0, 1))
        return rec
    rec["export_s"] = round(time.perf_counter() - t0, 1)
    proto = onnx.load(str(path))
    ops = collections.Counter(n.op_type for n in proto.graph.node)
    rec.update(nodes=len(proto.graph.node), opset=next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
               ops={k: ops[k] for k in WATCHED if ops[k]}, size_kb=round(path.stat().st_size / 1024))
    try:
        sess = session(path)
        feed = dm.feeds(form, model)
        rec["max_abs_diff"] = max_diff(sess, form, model, feed)
        rec["max_abs_diff_other_sizes"] = max(max_diff(sess, form, model, dm.feeds(form, model, b, n, seed=1))
                                              for b, n in OTHER_SIZES[form])
        rec["token_moves_logits"] = logits_move(sess, feed, one_token_changed(form, feed, model.config.vocab_size))
        if form == "kv":
            other = dm.feeds(form, model, seed=2)  # the cache of another prefix, the same new token and mask
            changed = {**feed, **{k: v for k, v in other.items() if k.startswith("past_key_values.")}}
            rec["past_moves_logits"] = logits_move(sess, feed, changed)
    except Exception as exc:  # noqa: BLE001 - exported but not runnable: a failure of the row
        rec.update(status="run-error", error=f"{type(exc).__name__}: {exc}".splitlines()[0][:400])
        return rec
    moved = rec["token_moves_logits"] > 1e-3 and rec.get("past_moves_logits", 1.0) > 1e-3
    agree = max(rec["max_abs_diff"], rec["max_abs_diff_other_sizes"]) <= TOLERANCE
    rec["status"] = "ok" if agree and moved else "mismatch" if not agree else "static-outputs"
    return rec


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Decoder export matrix (tiny configs)", "",
             f"{meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}, onnxscript "
             f"{meta['onnxscript']}, onnxruntime {meta['onnxruntime']} (CPU). Max |ONNX - torch| over all outputs "
             f"on the feeds (batch 2; prefill 16 tokens right-padded, kv one token after a real past of 12, "
             f"left-padded) and on other sizes (batch 3 of 11 tokens / past 10, batch 1 of 5). Moves: max |logits change| when one "
             f"token (and, kv, the past) changes. Errors are the exporter's, recorded as raised. Export seconds "
             f"are one run each, on a machine shared with other jobs: indicative only.", "",
             "| arch | form | exporter | attn | status | nodes | max diff | other sizes | token moves | past moves "
             "| export s | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda k: f"{r[k]:.1e}" if isinstance(r.get(k), float) else ""  # noqa: E731
        lines.append(f"| {r['arch']} | {r['form']} | {r['exporter']} | {r['attn']} | {r['status']} | "
                     f"{r.get('nodes', '')} | {f('max_abs_diff')} | {f('max_abs_diff_other_sizes')} | "
                     f"{f('token_moves_logits')} | {f('past_moves_logits')} | {r['export_s']} | "
                     f"{r.get('error', '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.decoder_exports", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help=f"results folder (default {OUT})")
    p.add_argument("--keep", type=Path, default=None, help="keep the exported models in this folder")
    p.add_argument("--only", nargs="+", choices=dm.ARCHS, default=list(dm.ARCHS))
    p.add_argument("--forms", nargs="+", choices=dm.FORMS, default=list(dm.FORMS))
    p.add_argument("--exporters", nargs="+", choices=dm.EXPORTERS, default=list(dm.EXPORTERS))
    p.add_argument("--attn", nargs="+", choices=("default", "eager", "sdpa"), default=["default", "eager"],
                   help="attention implementations (default: transformers' own choice, then eager where that "
                        "differs; a row already run under another name is not repeated)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.simplefilter("ignore")
    import onnxruntime
    import onnxscript
    import torch

    tf = dm.import_transformers()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    meta = {"machine": f"{machine_info()['cpu']}, {os.cpu_count()} cores "
                       f"(OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})",
            "torch": torch.__version__, "transformers": tf.__version__, "onnxscript": onnxscript.__version__,
            "onnxruntime": onnxruntime.__version__, "tolerance": TOLERANCE,
            "tiny_configs": {a: dm.tiny_config(a) for a in args.only}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for arch in args.only:
            default = dm.build_module(arch).config._attn_implementation
            attns = list(dict.fromkeys(default if a == "default" else a for a in args.attn))
            for attn in attns:
                for form in args.forms:
                    for exporter in args.exporters:
                        rec = row(arch, form, exporter, work, attn)
                        rows.append(rec)
                        print(f"{arch:<10} {form:<8} {exporter:<7} {rec['attn']:<6} {rec['status']:<8} "
                              f"{rec.get('nodes', ''):>5} diff {rec.get('max_abs_diff', float('nan')):.1e} "
                              f"other {rec.get('max_abs_diff_other_sizes', float('nan')):.1e} "
                              f"{rec['export_s']:>5.1f} s {rec.get('error', '')}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "export-matrix.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out / "export-matrix.md").write_text(markdown(rows, meta))
    bad = [r for r in rows if r["status"] not in ("ok", "error")]
    print(f"{sum(r['status'] == 'ok' for r in rows)} ok, {sum(r['status'] == 'error' for r in rows)} exporter errors, "
          f"{len(bad)} failures; written to {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
