"""Decoder benchmark on the CPU (issue 30): the decode step and the prefill of Llama-style decoders, onnxopt
against the tools a user would pick instead, every variant in one interleaved run per setting.

    python -m scripts.bench.decoders --json scripts/results/decoders/bench-cpu.json \\
        --markdown scripts/results/decoders/bench-cpu.md [--models trained llama-8l512] [--threads 1] \\
        [--past 128 512] [--batches 1 4] [--prefill 128] [--prefill-batches 1] [--exporters dynamo legacy] \\
        [--tools onnxopt ort-llama ort-qwen3 onnxscript genai] [--rounds 40] [--budget 20] [--keep DIR]
    python -m scripts.bench.decoders --merge part1.json part2.json --json all.json --markdown all.md

The rerun after a change to onnxopt (e.g. a GroupQueryAttention fusion) is the first command as it stands
(about 11 minutes for both models on the shared 2-core machine, of which ``trained`` about 4). Each
``--models`` entry may run as its own command and the JSON files merge (``--merge``).

Models (``MODELS``), Hugging Face folders in the zoo cache (``<cache>/_decbench/<name>``, built seeded, never
committed; the trained one is ``onnxopt.models.trained_decoder``'s):

- ``trained``: the real-weights Llama (4 layers, 256 wide, 8 heads / 4 KV heads of 32, vocabulary 4096),
  trained by ``scripts/data/train_decoder.py``;
- ``llama-8l512``: random weights (seed 0, initializer_range 0.1 as the zoo's decoders), 8 layers, 512 wide,
  8 heads / 2 KV heads of 64, SwiGLU 1408, vocabulary 4096; the trained model's tokenizer is copied into its
  folder (the genai builder needs one); ``decbench_recipe.json`` records what it was built from (a folder of
  another recipe is rebuilt);
- ``tiny``: ``scripts.bench._genai.write_tiny_llama`` (2 layers, 64 wide): for the tests.

Variants (``TOOLS``), per model and exporter (the decode step: ``onnxopt.models.decoder_models``' ``kv`` form;
the prefill: its ``prefill`` form; torch.onnx ``dynamo`` and ``legacy``):

- ``original``: the export itself;
- ``onnxopt``: ``python -m onnxopt IN -o OUT --target ort-cpu`` (the CLI, as a user runs it);
- ``ort-llama-cli``: onnxruntime's Llama recipe for a model exported elsewhere, as its README gives it:
  ``python -m onnxruntime.transformers.models.llama.convert_to_onnx -m HF_DIR -i IN -o OUT -p fp32 -e cpu
  --optimize_optimum --use_gqa``. From the onnxruntime 1.32.0 wheel it cannot start (``No module named
  'models.torch_export_patches'``: the wheel lacks a module it imports); its row keeps that reason, measured
  on every run;
- ``ort-llama``: so the same recipe's steps (its ``optimize_export``) through the public API: ``optimize_model(IN,
  model_type="gpt2", num_heads=N, hidden_size=H, opt_level=0, optimization_options=FusionOptions("gpt2"))``,
  ``replace_mha_with_gqa(model, "attention_mask", kv_heads)`` (its ``--use_gqa``), ``prune_graph``,
  ``update_graph``, then its symbolic shape inference; N, H, kv_heads from the HF config;
- ``ort-qwen3``: onnxruntime's transformers optimizer CLI with the model type it documents for
  "decoder-only with RoPE, GQA, RMSNorm": ``python -m onnxruntime.transformers.optimizer --input IN
  --output OUT --model_type qwen3 --num_heads N --hidden_size H``;
- ``onnxscript``: ``onnxscript.rewriter.ort_fusions.optimize_for_ort(onnx_ir.load(IN))``, ``onnx_ir.save``;
- ``genai``: onnxruntime-genai's model builder on the same HF folder (``scripts.bench._genai.build``:
  ``-p fp32 -e cpu``), one model per model (no exporter): its own graph with GroupQueryAttention.

Peers (the ratio's denominator): ort-llama-cli, ort-llama, ort-qwen3, onnxscript of the same exporter, and
genai; the best is the fastest whose fidelity holds. Every tool runs in a subprocess with a timeout (the ones
that import transformers after the torchvision stand-in of scripts/bench/_genai.py), and a tool that fails
keeps its row with its one-line reason (the exception line of its stderr).

Inputs, the same token state for every variant: rows of random token ids (``--seed``) of full length (no
padding: the genai model's GroupQueryAttention takes positions from the mask's count, so left padding would
mean another thing to it). Decode: the prefix of ``past`` tokens is run through the torch model for a real
cache; the step feeds ``input_ids`` [batch, 1], ``attention_mask`` ones [batch, past + 1], ``position_ids``
[batch, 1] = past (the exports; the genai model has no such input) and ``past_key_values.N.key/value``
[batch, kv_heads, past, head_size] (BNSH, the same arrays for all). The genai model gets the past as a
separate buffer of the past's length, not the generator's shared max-length buffer (``past_present_share_buffer``
false; its GroupQueryAttention runs both ways). Prefill: ``input_ids``, ``attention_mask`` ones,
``position_ids`` 0..S-1 [batch, S]; the genai model also gets empty pasts [batch, kv_heads, 0, head_size] and
writes the presents, which the prefill exports do not (their outputs differ: logits only).

Measured per setting (model, form, batch, length): nodes (all graphs); kernels of one profiled run
(``onnxopt.verify.run_profiled``); latency: one session per variant (``--threads`` intra-op threads, the
pools sleeping between runs), warmed up, timed in interleaved rounds (``onnxopt.verify.runtime.
measure_latency``), median, p10, p90; ratios to the original of the same exporter and, for onnxopt and the
original, to the best peer, with the 90% paired bootstrap interval over the rounds
(``onnxopt.verify.runtime.ratio_interval``: the same as scripts/bench/targets.py). Fidelity per row: the
logits' max abs difference from the original export (the genai row: from the first exporter's original) and
from the torch model, on the same inputs; greedy next-token agreement (argmax of the last position's
logits per row; the prefill: every position) with the original and with torch. A row's fidelity holds when
its logits differ from torch's by at most 1e-3 of their range and every greedy token agrees.

The numbers are indicative when the machine is shared (say so: ``--note``); the lead reruns on a quiet one.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from onnxopt.verify import run_profiled
from onnxopt.verify.runtime import CONFIDENCE, measure_latency, ratio_interval
from scripts import ROOT, child_env
from scripts.bench import _genai
from scripts.bench import _peers as peers_mod  # config_failures
from scripts.bench.peers import count_nodes, machine_info

EXPORTERS = ("dynamo", "legacy")
FORMS = ("decode", "prefill")
EXPORT_FORM = {"decode": "kv", "prefill": "prefill"}
ORIGINAL = "original"
GENAI = "genai"
FIDELITY_ERR_RANGE = 1e-3  # |logits - torch's| / range of torch's logits
TOOL_TIMEOUT_S = 900
DEFAULT_NOTE = ("a shared 2-core AMD EPYC while other agents work: the numbers are indicative; "
                "the lead reruns them on a quiet machine")
FUSED_OPS = ("GroupQueryAttention", "MultiHeadAttention", "Attention", "RotaryEmbedding",
             "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization")

# The child that runs a peer: the torchvision stand-in first (scripts/bench/_genai.py's docstring: the CPU
# torch lacks the ops torchvision's compiled library registers, and transformers imports torchvision).
_STANDIN = ("import sys, types\n"
            "sys.modules.setdefault('torchvision._meta_registrations', "
            "types.ModuleType('torchvision._meta_registrations'))\n")
_RUN_MODULE_CHILD = _STANDIN + (
    "import runpy\n"
    "mod = sys.argv[1]\n"
    "sys.argv = [mod] + sys.argv[2:]\n"
    "runpy.run_module(mod, run_name='__main__', alter_sys=True)\n")
_RUN_TOOL_CHILD = _STANDIN + (
    "from scripts.bench.decoders import tool_child\n"
    "tool_child(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])\n")


# ---------------------------------------------------------------------------------------------
# Models: Hugging Face folders


@dataclasses.dataclass(frozen=True)
class DecoderModel:
    name: str
    description: str
    weights: str  # "real" | "random"


MODELS = {
    "trained": DecoderModel("trained", "the trained Llama (scripts/data/train_decoder.py): 4 layers, 256 wide, "
                            "8 heads / 4 KV heads of 32, SwiGLU 704, vocabulary 4096", "real"),
    "llama-8l512": DecoderModel("llama-8l512", "LlamaForCausalLM, 8 layers, 512 wide, 8 heads / 2 KV heads of 64, "
                                "SwiGLU 1408, vocabulary 4096 (the trained model's tokenizer), seed 0", "random"),
    "tiny": DecoderModel("tiny", "scripts.bench._genai.write_tiny_llama: 2 layers, 64 wide, 4 heads / 2 KV heads, "
                         "vocabulary 512 (tests)", "random"),
}
# over decoder_models' tiny base config (so initializer_range 0.1, as the zoo's decoders: attention that is not
# near-uniform on random weights)
LLAMA_8L512 = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)
RECIPE_FILE = "decbench_recipe.json"  # what a built folder was built from: another recipe is rebuilt
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def bench_cache(cache: str | Path | None = None) -> Path:
    from onnxopt.models.cache import cache_dir

    return cache_dir(cache) / "_decbench"


def hf_folder(name: str, cache: str | Path | None = None, log=print) -> Path:
    """The model's Hugging Face folder, built (seeded) when missing; raises FileNotFoundError for an untrained
    ``trained`` (with the command that trains it)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if name == "trained":
        from onnxopt.models.trained_decoder import trained_decoder_dir

        return trained_decoder_dir(cache=cache) if cache else trained_decoder_dir()
    folder = bench_cache(cache) / name
    recipe = {"model": name, "seed": 0, "config": LLAMA_8L512 if name == "llama-8l512" else "write_tiny_llama"}
    built = folder / RECIPE_FILE
    if built.is_file() and json.loads(built.read_text()) == recipe and (folder / "model.safetensors").is_file():
        return folder
    log(f"building {name} into {folder}")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if name == "tiny":
        _genai.write_tiny_llama(tmp, seed=0)
    else:
        _write_random_llama(tmp, LLAMA_8L512, seed=0, cache=cache)
    (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def _write_random_llama(out: Path, config: dict, seed: int, cache) -> None:
    """A LlamaForCausalLM of ``config`` with random weights from ``seed``, saved with the trained model's
    tokenizer files and token ids (its vocabulary is the config's)."""
    from onnxopt.models import decoder_models as dm
    from onnxopt.models.trained_decoder import trained_decoder_dir

    trained = trained_decoder_dir(cache=cache) if cache else trained_decoder_dir()
    ids = json.loads((trained / "config.json").read_text())
    entries = {**config, **{k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in ids}}
    model = dm.build_module("llama", seed=seed, config=entries)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        shutil.copyfile(trained / f, out / f)


def hf_dims(folder: Path) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"layers": cfg["num_hidden_layers"], "hidden_size": cfg["hidden_size"], "num_heads": heads,
            "kv_heads": cfg.get("num_key_value_heads", heads),
            "head_size": cfg.get("head_dim") or cfg["hidden_size"] // heads, "vocab_size": cfg["vocab_size"],
            "intermediate_size": cfg.get("intermediate_size")}


def load_torch(folder: Path):
    _genai.skip_torchvision_meta_registrations()
    from onnxopt.models.transformers_models import import_transformers

    tf = import_transformers()
    return tf.AutoModelForCausalLM.from_pretrained(str(folder)).eval()


# ---------------------------------------------------------------------------------------------
# Tools


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    peer: bool
    command: str  # what a user types (IN, OUT, HF_DIR, N, H placeholders)


TOOLS = {
    "onnxopt": Tool("onnxopt", False, "python -m onnxopt IN -o OUT --target ort-cpu"),
    "ort-llama-cli": Tool("ort-llama-cli", True,
                          "python -m onnxruntime.transformers.models.llama.convert_to_onnx -m HF_DIR -i IN -o OUT "
                          "-p fp32 -e cpu --optimize_optimum --use_gqa (onnxruntime's Llama README, for a model "
                          "exported elsewhere; the model is OUT/<HF folder name>.onnx)"),
    "ort-llama": Tool("ort-llama", True,
                      "the steps of convert_to_onnx --optimize_optimum --use_gqa (ort-llama-cli) through the "
                      "public API: optimize_model(IN, model_type='gpt2', num_heads=N, "
                      "hidden_size=H, opt_level=0, optimization_options=FusionOptions('gpt2')), "
                      "replace_mha_with_gqa(m, 'attention_mask', KV), prune_graph, update_graph, symbolic shape "
                      "inference (its output: OUT)"),
    "ort-qwen3": Tool("ort-qwen3", True, "python -m onnxruntime.transformers.optimizer --input IN --output OUT "
                      "--model_type qwen3 --num_heads N --hidden_size H"),
    "onnxscript": Tool("onnxscript", True, "onnxscript.rewriter.ort_fusions.optimize_for_ort(onnx_ir.load(IN)); "
                       "onnx_ir.save(model, OUT)"),
    GENAI: Tool(GENAI, True, "python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p fp32 -e cpu"),
}
EXPORT_TOOLS = ("onnxopt", "ort-llama-cli", "ort-llama", "ort-qwen3", "onnxscript")
LLAMA_RECIPE_CLI = ("python -m onnxruntime.transformers.models.llama.convert_to_onnx -m HF_DIR -i IN -o OUT "
                    "-p fp32 -e cpu --optimize_optimum --use_gqa")


def tool_argv(tool: str, src: Path, dst: Path, hf_dir: Path) -> list[str]:
    """The subprocess that makes ``dst`` from ``src`` with ``tool``."""
    py = sys.executable
    if tool == "onnxopt":
        return [py, "-m", "onnxopt", str(src), "-o", str(dst), "--target", "ort-cpu"]
    d = hf_dims(hf_dir)
    if tool == "ort-qwen3":
        return [py, "-c", _RUN_MODULE_CHILD, "onnxruntime.transformers.optimizer", "--input", str(src), "--output",
                str(dst), "--model_type", "qwen3", "--num_heads", str(d["num_heads"]), "--hidden_size",
                str(d["hidden_size"])]
    if tool == "ort-llama-cli":
        return [py, "-c", _RUN_MODULE_CHILD, "onnxruntime.transformers.models.llama.convert_to_onnx", "-m",
                str(hf_dir), "-i", str(src), "-o", str(dst.parent / dst.stem), "-p", "fp32", "-e", "cpu",
                "--optimize_optimum", "--use_gqa"]
    if tool in ("ort-llama", "onnxscript"):
        return [py, "-c", _RUN_TOOL_CHILD, tool, str(src), str(dst), str(hf_dir)]
    raise ValueError(f"unknown tool {tool!r}; known: {', '.join(TOOLS)}")


def tool_child(tool: str, src: str, dst: str, hf_dir: str) -> None:
    """In the child process: the library-call tools (``TOOLS`` says what each calls)."""
    d = hf_dims(Path(hf_dir))
    if tool == "onnxscript":
        import onnx_ir as ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        model, counts = optimize_for_ort(ir.load(src))
        ir.save(model, dst)
        print(json.dumps({"fusions": {k: v for k, v in counts.items() if v}}))
        return
    if tool == "ort-llama":
        from onnxruntime.transformers.convert_generation import replace_mha_with_gqa
        from onnxruntime.transformers.fusion_options import FusionOptions
        from onnxruntime.transformers.optimizer import optimize_model

        model = optimize_model(src, model_type="gpt2", num_heads=d["num_heads"], hidden_size=d["hidden_size"],
                               opt_level=0, optimization_options=FusionOptions("gpt2"), only_onnxruntime=False)
        fused = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
        model = replace_mha_with_gqa(model, "attention_mask", d["kv_heads"], 1, -1)
        model.prune_graph()
        model.update_graph(allow_remove_graph_inputs=True)
        model.save_model_to_file(dst, use_external_data_format=False)
        # the recipe's symbolic shape inference, as it runs it (its failure does not stop the recipe)
        proc = subprocess.run([sys.executable, "-m", "onnxruntime.tools.symbolic_shape_infer", "--input", dst,
                               "--output", dst, "--auto_merge"], capture_output=True, text=True)
        print(json.dumps({"fusions": fused, "symbolic_shape_infer_rc": proc.returncode}))
        return
    raise ValueError(f"unknown tool {tool!r}")


def run_tool(tool: str, src: Path, dst: Path, hf_dir: Path, timeout: float = TOOL_TIMEOUT_S) -> dict:
    """Run one tool in a subprocess; the result says ok, or the error in one line."""
    argv = tool_argv(tool, src, dst, hf_dir)
    info: dict = {"tool": tool, "command": _user_command(tool, src, dst, hf_dir), "ok": False}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
                              env={**child_env(), "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        info["error"] = f"ran past {timeout:.0f} s"
        return info
    info["seconds"] = round(time.perf_counter() - t0, 2)
    log = (proc.stdout + "\n" + proc.stderr).splitlines()
    failures = peers_mod.config_failures(log)
    if failures:
        info["config_failures"] = failures
    if proc.returncode != 0:
        info["error"] = _genai._error_line(proc.stderr) or f"exited with {proc.returncode}"
        return info
    if tool == "ort-llama-cli":  # it writes OUT/<model name>.onnx (+ .data) into the folder OUT
        made = dst.parent / dst.stem / f"{hf_dir.name}.onnx"
        if made.is_file():
            dst = made
    if not dst.is_file():
        info["error"] = f"exited 0 but wrote no {dst.name}"
        return info
    info["model"] = str(dst)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                info.update(json.loads(line))
            except ValueError:
                pass
            break
    info["ok"] = True
    return info


def _user_command(tool: str, src: Path, dst: Path, hf_dir: Path) -> str:
    """``TOOLS[tool].command`` with its placeholders (HF_DIR, IN, OUT, N, H, KV) filled in."""
    import re

    d = hf_dims(hf_dir)
    values = {"HF_DIR": str(hf_dir), "IN": src.name, "OUT": dst.stem if tool == "ort-llama-cli" else dst.name,
              "N": str(d["num_heads"]), "H": str(d["hidden_size"]), "KV": str(d["kv_heads"])}
    return re.sub(r"\b(HF_DIR|IN|OUT|KV|N|H)\b", lambda m: values[m.group(1)], TOOLS[tool].command)


def graph_facts(path: Path) -> dict:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    nodes, ops = count_nodes(proto)
    fused = {op: n for op, n in ops.items() if op.rsplit(".", 1)[-1] in FUSED_OPS}
    return {"nodes": nodes, "fused_ops": fused, "inputs": [i.name for i in proto.graph.input]}


# ---------------------------------------------------------------------------------------------
# Inputs


def decode_feeds(model, dims: dict, batch: int, past: int, seed: int) -> tuple[dict, np.ndarray]:
    """One decode step after ``past`` real tokens (module docstring), and the torch model's logits of it."""
    import torch

    from onnxopt.models.transformers_models import import_transformers

    tf = import_transformers()
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, dims["vocab_size"], size=(batch, past), dtype=np.int64)
    new = rng.integers(3, dims["vocab_size"], size=(batch, 1), dtype=np.int64)
    with torch.no_grad():
        cache = tf.DynamicCache()
        model(input_ids=torch.from_numpy(prefix), attention_mask=torch.ones(batch, past, dtype=torch.int64),
              position_ids=torch.arange(past).expand(batch, past), past_key_values=cache, use_cache=True)
        feeds = {"input_ids": new, "attention_mask": np.ones((batch, past + 1), np.int64),
                 "position_ids": np.full((batch, 1), past, np.int64)}
        for i, layer in enumerate(cache.layers):
            feeds[f"past_key_values.{i}.key"] = np.ascontiguousarray(layer.keys.numpy().astype(np.float32))
            feeds[f"past_key_values.{i}.value"] = np.ascontiguousarray(layer.values.numpy().astype(np.float32))
        out = model(input_ids=torch.from_numpy(new), attention_mask=torch.ones(batch, past + 1, dtype=torch.int64),
                    position_ids=torch.full((batch, 1), past, dtype=torch.int64), past_key_values=cache,
                    use_cache=True)
    return feeds, out.logits.numpy().astype(np.float32)


def prefill_feeds(model, dims: dict, batch: int, seq: int, seed: int) -> tuple[dict, np.ndarray]:
    """The prompt of ``seq`` tokens per row (the genai model's empty pasts added), and torch's logits."""
    import torch

    ids = np.random.default_rng(seed).integers(3, dims["vocab_size"], size=(batch, seq), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones((batch, seq), np.int64),
             "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()}
    empty = np.zeros((batch, dims["kv_heads"], 0, dims["head_size"]), np.float32)
    for i in range(dims["layers"]):
        feeds[f"past_key_values.{i}.key"] = empty
        feeds[f"past_key_values.{i}.value"] = empty
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(feeds["attention_mask"]),
                    position_ids=torch.from_numpy(feeds["position_ids"]), use_cache=False)
    return feeds, out.logits.numpy().astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Fidelity and ranking


def logits_fidelity(got: np.ndarray, ref: np.ndarray, form: str) -> dict:
    """Max abs difference, its fraction of the reference's range, and greedy-token agreement (decode: the last
    position of each row; prefill: every position)."""
    if got.shape != ref.shape:
        return {"error": f"logits shape {list(got.shape)}, expected {list(ref.shape)}"}
    if form == "decode":
        a, b = got[:, -1].argmax(-1), ref[:, -1].argmax(-1)
    else:
        a, b = got.argmax(-1).reshape(-1), ref.argmax(-1).reshape(-1)
    diff = float(np.abs(got.astype(np.float64) - ref).max())
    rng = float(ref.max() - ref.min()) or 1.0
    return {"max_abs": diff, "err_range": diff / rng, "greedy_agree": int((a == b).sum()), "greedy_total": int(a.size)}


def _fidelity_ok(f: dict) -> bool:
    t = f.get("vs_torch") or {}
    return "max_abs" in t and t["err_range"] <= FIDELITY_ERR_RANGE and t["greedy_agree"] == t["greedy_total"]


def rank(rows: list[dict]) -> None:
    """For one setting's rows: x_original (against the original of the same exporter) on every row; for
    onnxopt and original rows, x_best_peer with its 90% interval (the peers of the same exporter and genai
    whose fidelity holds)."""
    by_variant = {r["variant_key"]: r for r in rows if r.get("latency")}
    for r in rows:
        lat = r.get("latency")
        base = by_variant.get(f"{r['exporter']}/{ORIGINAL}")
        if lat and base and r["exporter"] != "-":
            lat["x_original"] = lat["median_ms"] / base["latency"]["median_ms"]
    for exporter in sorted({r["exporter"] for r in rows if r["exporter"] != "-"}):
        pool = [r for r in rows if r.get("latency") and TOOLS.get(r["variant"]) and TOOLS[r["variant"]].peer
                and r["exporter"] in (exporter, "-") and r.get("fidelity_ok")]
        if not pool:
            continue
        best = min(pool, key=lambda r: r["latency"]["median_ms"])
        for r in rows:
            if r["exporter"] == exporter and r["variant"] in (ORIGINAL, "onnxopt") and r.get("latency"):
                lat = r["latency"]
                ci = ratio_interval(best["latency"]["times_ms"], lat["times_ms"], confidence=CONFIDENCE)
                lat["best_peer"] = best["variant_key"]
                lat["x_best_peer"] = lat["median_ms"] / best["latency"]["median_ms"]
                lat["x_best_peer_interval"] = ci.get("interval")
                lat["x_best_peer_verdict"] = ci.get("verdict")
    genai = by_variant.get(f"-/{GENAI}")
    for r in rows:  # onnxopt against the original and the builder's model: issue 30's targets (TARGETS)
        lat = r.get("latency")
        if r["variant"] != "onnxopt" or not lat:
            continue
        base = by_variant.get(f"{r['exporter']}/{ORIGINAL}")
        for key, against in (("original", base), ("genai", genai)):
            if against:
                ci = ratio_interval(against["latency"]["times_ms"], lat["times_ms"], confidence=CONFIDENCE)
                lat[f"x_{key}_interval"] = ci.get("interval")
                if key == "genai":
                    lat["x_genai"] = ci.get("ratio")


# issue 30's CPU targets for onnxopt's latency ratios: (against, at most); "at most X" holds when the ratio meets
# X and the upper end of its 90% interval is at most X + MARGIN
TARGETS = {"decode": (("genai", 1.0), ("original", 1 / 1.2)), "prefill": (("genai", 1.02),)}
MARGIN = 0.03


def target_verdict(lat: dict, against: str, bound: float) -> str:
    """"met", "missed" or "not measured" for onnxopt's ratio to ``against`` (x_original / x_genai)."""
    x, ci = lat.get(f"x_{against}"), lat.get(f"x_{against}_interval")
    if x is None:
        return "not measured"
    if ci is None:
        return "met (no interval)" if x <= bound else "missed"
    return "met" if x <= bound and ci[1] <= bound + MARGIN else "missed"


# ---------------------------------------------------------------------------------------------
# One model


def prepare_model(name: str, args, work: Path, log) -> tuple[dict, dict, object, dict]:
    """Build the HF folder, the exports, the tools' models and the genai model; returns (the model's report
    entry, {form: {variant_key: path}}, the torch model, its dims)."""
    from onnxopt.models import decoder_models as dm

    hf = hf_folder(name, args.cache, log)
    dims = hf_dims(hf)
    entry: dict = {"hf_dir": str(hf), "description": MODELS[name].description, "weights": MODELS[name].weights,
                   "dims": dims, "variants": {}}
    if name == "trained":
        entry["trained"] = trained_facts(hf)
    model = load_torch(hf)
    paths: dict[str, dict[str, Path]] = {f: {} for f in args.forms}
    work.mkdir(parents=True, exist_ok=True)
    for form in args.forms:
        for exporter in args.exporters:
            key = f"{form}/{exporter}/{ORIGINAL}"
            dst = work / f"{name}-{form}-{exporter}.onnx"
            t0 = time.perf_counter()
            try:
                dm.export_module(model, EXPORT_FORM[form], dst, exporter)
                entry["variants"][key] = {"ok": True, "command": f"onnxopt.models.decoder_models.export_module(model, "
                                          f"{EXPORT_FORM[form]!r}, path, {exporter!r})",
                                          "seconds": round(time.perf_counter() - t0, 2), **graph_facts(dst)}
                paths[form][f"{exporter}/{ORIGINAL}"] = dst
            except Exception as exc:  # noqa: BLE001 - an exporter that cannot export keeps its row
                entry["variants"][key] = {"ok": False, "error": _one_line(exc)}
                log(f"  {key}: {entry['variants'][key]['error']}")
                continue
            for tool in [t for t in args.tools if t in EXPORT_TOOLS]:
                out = work / f"{name}-{form}-{exporter}-{tool}.onnx"
                if out.exists():
                    out.unlink()
                shutil.rmtree(out.parent / out.stem, ignore_errors=True)
                res = run_tool(tool, dst, out, hf)
                if res["ok"]:
                    res.update(graph_facts(Path(res["model"])))
                    paths[form][f"{exporter}/{tool}"] = Path(res["model"])
                entry["variants"][f"{form}/{exporter}/{tool}"] = res
                log(f"  {form}/{exporter}/{tool}: " + (f"{res['nodes']} nodes, {res['seconds']} s" if res["ok"]
                                                        else res["error"]))
    if GENAI in args.tools:
        out = work / f"{name}-genai"
        shutil.rmtree(out, ignore_errors=True)
        res = _genai.build(hf, out, precision="fp32", execution_provider="cpu", timeout=TOOL_TIMEOUT_S)
        res["tool"] = GENAI
        if res.get("ok"):
            mp = out / json.loads((out / "genai_config.json").read_text())["model"]["decoder"]["filename"]
            res.update(graph_facts(mp))
            for form in args.forms:
                paths[form][f"-/{GENAI}"] = mp
        entry["variants"][GENAI] = res
        log("  genai: " + (f"{res['nodes']} nodes, {res['seconds']} s" if res.get("ok") else res.get("error", "?")))
    return entry, paths, model, dims


def trained_facts(folder: Path) -> dict:
    """What the trained model's train_metadata.json says of it: parameters, held-out perplexity, weights' hash."""
    from onnxopt.models.trained_decoder import metadata

    meta = metadata(folder)
    held = meta.get("held_out") or {}
    return {"parameters": meta.get("parameters"), "held_out_perplexity": held.get("perplexity"),
            "held_out_tokens": held.get("tokens_scored"), "command": meta.get("command"),
            "model_safetensors_sha256": meta.get("model_safetensors_sha256")}


def _one_line(exc: BaseException, limit: int = 300) -> str:
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}".strip().rstrip(":")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def measure_setting(name: str, form: str, batch: int, length: int, paths: dict[str, Path], entry: dict, model,
                    dims: dict, args, log) -> list[dict]:
    """Rows of one setting: every variant profiled once (outputs, kernels), then timed together."""
    maker = decode_feeds if form == "decode" else prefill_feeds
    feeds, torch_logits = maker(model, dims, batch, length, args.seed)
    rows: list[dict] = []
    base = {"model": name, "form": form, "batch": batch, ("past" if form == "decode" else "sequence"): length}
    # every variant that was asked for keeps a row, failed or not
    keys = [f"{e}/{t}" for e in args.exporters for t in (ORIGINAL, *[t for t in args.tools if t in EXPORT_TOOLS])] \
        + ([f"-/{GENAI}"] if GENAI in args.tools else [])
    outputs: dict[str, np.ndarray] = {}
    timed: dict[str, str] = {}
    for key in keys:
        exporter, variant = key.split("/", 1)
        info = entry["variants"].get(GENAI if variant == GENAI else f"{form}/{key}", {})
        row = {**base, "exporter": exporter, "variant": variant, "variant_key": key}
        if key not in paths:
            export = entry["variants"].get(f"{form}/{exporter}/{ORIGINAL}", {})
            row["error"] = info.get("error") or (f"no {exporter} export: {export['error']}" if export.get("error")
                                                 else "not built")
            if info.get("config_failures"):
                row["config_failures"] = info["config_failures"]
            rows.append(row)
            continue
        row["nodes"] = info.get("nodes")
        row["fused_ops"] = info.get("fused_ops")
        try:
            outs, kernels, _ = run_profiled(str(paths[key]), feeds, "cpu", warmup=1, threads=args.threads)
            row["kernels"] = kernels["kernels"]
            logits = dict(outs).get("logits")
            if logits is None:
                raise RuntimeError(f"no output named logits (outputs: {', '.join(n for n, _ in outs)})")
            outputs[key] = logits
            timed[key] = str(paths[key])
        except Exception as exc:  # noqa: BLE001 - a model onnxruntime cannot run keeps its row
            row["error"] = _one_line(exc)
        rows.append(row)
    first_original = next((f"{e}/{ORIGINAL}" for e in args.exporters if f"{e}/{ORIGINAL}" in outputs), None)
    for row in rows:
        key = row["variant_key"]
        if key not in outputs:
            continue
        ref_key = f"{row['exporter']}/{ORIGINAL}" if row["exporter"] != "-" else first_original
        fid = {"vs_torch": logits_fidelity(outputs[key], torch_logits, form)}
        if ref_key in outputs:
            fid["vs_original"] = {**logits_fidelity(outputs[key], outputs[ref_key], form), "original": ref_key}
        row["fidelity"] = fid
        row["fidelity_ok"] = _fidelity_ok(fid)
    log(f"  timing {name} {form} batch {batch} {'past' if form == 'decode' else 'sequence'} {length}: "
        f"{len(timed)} sessions")
    lat = measure_latency(timed, feeds, provider="cpu", runs=args.rounds, warmup=args.warmup, budget_s=args.budget,
                          min_rounds=min(args.rounds, 10), threads=args.threads, spin=False)
    for row in rows:
        key = row["variant_key"]
        if key in lat["errors"]:
            row["error"] = lat["errors"][key]
        res = lat["results"].get(key)
        if res:
            ts = res["times_ms"]
            row["latency"] = {"median_ms": res["median_ms"], "p10_ms": float(np.percentile(ts, 10)),
                              "p90_ms": res["p90_ms"], "rounds": len(ts), "times_ms": ts}
    rank(rows)
    return rows


def bench_model(name: str, args, log) -> tuple[dict, list[dict]]:
    work_root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="onnxopt-decbench-"))
    try:
        t0 = time.perf_counter()
        entry, paths, model, dims = prepare_model(name, args, work_root / name, log)
        entry["prepare_seconds"] = round(time.perf_counter() - t0, 1)
        rows = []
        for form in args.forms:
            settings = [(b, p) for b in args.batches for p in args.past] if form == "decode" else \
                [(b, s) for b in args.prefill_batches for s in args.prefill]
            for batch, length in settings:
                rows += measure_setting(name, form, batch, length, paths[form], entry, model, dims, args, log)
        return entry, rows
    finally:
        if not args.keep:
            shutil.rmtree(work_root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Report


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("onnxopt", "onnx", "onnxruntime", "onnxruntime-genai", "onnxscript", "onnx-ir", "torch",
                 "transformers", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_meta(args, argv: list[str]) -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m scripts.bench.decoders " + shlex.join(argv), "onnxopt_commit": _commit(),
            "machine": machine_info(), "threads": args.threads, "rounds": args.rounds, "budget_s": args.budget,
            "warmup": args.warmup, "seed": args.seed, "note": args.note, "versions": _versions(),
            "tools": {t.name: t.command for t in TOOLS.values() if t.name in args.tools},
            "ort_llama_cli": LLAMA_RECIPE_CLI}


def merge(reports: list[dict]) -> dict:
    out: dict = {"runs": [], "models": {}, "rows": []}
    for rep in reports:
        out["runs"] += rep.get("runs", [])
        out["models"].update(rep.get("models", {}))
        names = set(rep.get("models", {}))
        out["rows"] = [r for r in out["rows"] if r["model"] not in names] + rep.get("rows", [])
    rerank(out["rows"])
    return out


def rerank(rows: list[dict]) -> None:
    """``rank`` again on every setting of a report's rows (from their round times: the ratios and intervals of
    this version of the script)."""
    settings: dict[tuple, list[dict]] = {}
    for r in rows:
        settings.setdefault((r["model"], r["form"], r["batch"], r.get("past"), r.get("sequence")), []).append(r)
    for group in settings.values():
        rank(group)


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _ratio_cell(lat: dict) -> str:
    x = lat.get("x_best_peer")
    if x is None:
        return "-"
    ci = lat.get("x_best_peer_interval")
    peer = lat.get("best_peer", "?").replace("-/", "")
    return (f"{x:.2f} ({ci[0]:.2f}-{ci[1]:.2f})" if ci else f"{x:.2f} (no interval)") + f" vs {peer}"


def _fid_cell(row: dict) -> str:
    f = row.get("fidelity")
    if not f:
        return "-"
    t = f.get("vs_torch", {})
    o = f.get("vs_original", {})
    if "max_abs" not in t:
        return t.get("error", "-")
    orig = f"{o['max_abs']:.1e}, {o['greedy_agree']}/{o['greedy_total']}" if "max_abs" in o else "-"
    mark = "" if row.get("fidelity_ok") else " **off**"
    return f"{orig} \\| {t['max_abs']:.1e}, {t['greedy_agree']}/{t['greedy_total']}{mark}"


def _fused_cell(row: dict) -> str:
    f = row.get("fused_ops") or {}
    short = {"GroupQueryAttention": "GQA", "MultiHeadAttention": "MHA", "RotaryEmbedding": "Rot",
             "SkipSimplifiedLayerNormalization": "SkipSLN", "SimplifiedLayerNormalization": "SLN",
             "RMSNormalization": "RMSN", "Attention": "Attn"}
    return " ".join(f"{short.get(k.rsplit('.', 1)[-1], k)} {v}" for k, v in sorted(f.items())) or "-"


def render_markdown(report: dict) -> str:
    runs = report.get("runs", [])
    lines = ["# Decoder benchmark on the CPU (issue 30): decode step and prefill, onnxopt against its peers", ""]
    for run in runs:
        m = run.get("machine", {})
        lines.append(f"- {run['date']}: `{run['command']}` at onnxopt {run.get('onnxopt_commit')}; {m.get('cpu')} "
                     f"({m.get('logical_cores')} logical cores), **{run['threads']} intra-op thread(s)**, up to "
                     f"{run['rounds']} interleaved rounds ({run['budget_s']} s budget per setting); "
                     + ", ".join(f"{k} {v}" for k, v in run.get("versions", {}).items()) + ".")
        if run.get("note"):
            lines.append(f"- Machine: {run['note']}.")
    lines += ["", "Columns: **nodes** of the graph (all graphs); **kernels** onnxruntime ran in one profiled run; "
              "**median / p10 / p90** latency of one run (ms), all variants of a table timed in one interleaved run; "
              "**x orig**: median against the original export of the same exporter; **x best peer (90% CI)**: "
              "onnxopt's (and the original's) median against the fastest peer of the same exporter or genai whose "
              "fidelity holds, with the 90% paired bootstrap interval (\"at most X\" holds when the ratio meets X "
              "and the interval's upper end is at most X + 0.03); **fidelity**: logits max abs difference and "
              "greedy next-token agreement against the original export (genai: the first exporter's original) "
              "\\| against the torch model (**off**: more than 1e-3 of the logits' range, or a token differs). "
              "Variants and the peers' commands: docs/benchmarks-decoders.md.", ""]
    for name, entry in report.get("models", {}).items():
        d = entry.get("dims", {})
        lines += [f"## {name}: {entry.get('description')}", "",
                  f"{entry.get('weights')} weights; {d.get('layers')} layers, hidden {d.get('hidden_size')}, "
                  f"{d.get('num_heads')} heads / {d.get('kv_heads')} KV heads of {d.get('head_size')}; "
                  f"HF folder `{entry.get('hf_dir')}`"
                  + (f"; {t['parameters']:,} parameters, held-out perplexity {t['held_out_perplexity']} "
                     f"(train_metadata.json)" if (t := entry.get("trained")) and t.get("parameters") else "")
                  + ".", ""]
        wrong = config_failure_lines({"models": {name: entry}})
        if wrong:
            lines += ["**Configuration failure** (a peer says it was called wrongly: a bug of this benchmark, its "
                      "figures are not the peer's):", ""] + [f"- {w}" for w in wrong] + [""]
        failed = [(k, v) for k, v in entry.get("variants", {}).items() if not v.get("ok")]
        if failed:
            lines += ["Tools that failed (their rows stay, with this reason):", ""]
            lines += [f"- `{k}`: {v.get('error')}" for k, v in failed] + [""]
        lines += _targets_table(name, report.get("rows", []))
        for form in FORMS:
            rows = [r for r in report.get("rows", []) if r["model"] == name and r["form"] == form]
            if not rows:
                continue
            length = "past" if form == "decode" else "sequence"
            title = ("Decode step (1 new token after `past` cached tokens)" if form == "decode" else
                     "Prefill (the prompt of `sequence` tokens; the exports output logits only, the genai model "
                     "also writes the presents: their outputs differ)")
            lines += [f"### {title}", "",
                      f"| batch | {length} | exporter | variant | nodes | fused | kernels | median ms | p10 | p90 | "
                      "x orig | x best peer (90% CI) | fidelity: vs original \\| vs torch |",
                      "|---:|---:|---|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
            for r in rows:
                lat = r.get("latency") or {}
                if r.get("error") and not lat:
                    lines.append(f"| {r['batch']} | {r[length]} | {r['exporter']} | {r['variant']} | "
                                 f"{r.get('nodes') or '-'} | - | - | failed: {_cell(r['error'])} | | | | | |")
                    continue
                xo = lat.get("x_original")
                lines.append(
                    f"| {r['batch']} | {r[length]} | {r['exporter']} | {r['variant']} | {r.get('nodes', '-')} | "
                    f"{_fused_cell(r)} | {r.get('kernels', '-')} | {_ms(lat.get('median_ms'))} | "
                    f"{_ms(lat.get('p10_ms'))} | {_ms(lat.get('p90_ms'))} | {'-' if xo is None else f'{xo:.2f}'} | "
                    f"{_ratio_cell(lat)} | {_fid_cell(r)} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def _targets_table(name: str, rows: list[dict]) -> list[str]:
    """onnxopt's rows against issue 30's CPU targets (``TARGETS``)."""
    ours = [r for r in rows if r["model"] == name and r["variant"] == "onnxopt" and r.get("latency")]
    if not ours:
        return []
    out = ["### onnxopt against issue 30's targets (decode: latency at most the genai model's, at most 1/1.2 of the "
           f"original's; prefill: at most 1.02x the genai model's; met when the ratio meets the bound and its 90% "
           f"interval's upper end is at most the bound + {MARGIN})", "",
           "| form | batch | length | exporter | x genai (90% CI) | target | x original (90% CI) | target |",
           "|---|---:|---:|---|---|---|---|---|"]
    for r in ours:
        lat = r["latency"]
        cells = []
        for against in ("genai", "original"):
            bound = dict(TARGETS[r["form"]]).get(against)
            x, ci = lat.get(f"x_{against}"), lat.get(f"x_{against}_interval")
            cells.append("-" if x is None else f"{x:.2f}" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else ""))
            cells.append("-" if bound is None else f"<= {bound:.2f}: {target_verdict(lat, against, bound)}")
        out.append(f"| {r['form']} | {r['batch']} | {r.get('past', r.get('sequence'))} | {r['exporter']} | "
                   + " | ".join(cells) + " |")
    return out + [""]


def _cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.decoders", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["trained", "llama-8l512"], choices=list(MODELS))
    p.add_argument("--exporters", nargs="+", default=list(EXPORTERS), choices=EXPORTERS)
    p.add_argument("--tools", nargs="+", default=list(TOOLS), choices=list(TOOLS),
                   help="the variants besides the original (default: all)")
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    p.add_argument("--past", nargs="+", type=int, default=[128, 512], help="decode: cached tokens before the step")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4], help="decode batches")
    p.add_argument("--prefill", nargs="+", type=int, default=[128], help="prefill: prompt lengths")
    p.add_argument("--prefill-batches", nargs="+", type=int, default=[1])
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every session (default 1)")
    p.add_argument("--rounds", type=int, default=40, help="the most interleaved rounds per setting")
    p.add_argument("--budget", type=float, default=20.0, help="seconds of timed rounds per setting (at least "
                   "min(rounds, 10) rounds run)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="of the token ids")
    p.add_argument("--cache", help="the zoo cache (default: $ONNXOPT_CACHE or ~/.cache/onnxopt/models)")
    p.add_argument("--keep", help="keep the exports and the tools' models in this folder (default: a temporary "
                   "one, removed); every run makes them again")
    p.add_argument("--note", default=DEFAULT_NOTE, help="what the markdown says of the machine")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge these reports (later models replace earlier)")
    args = p.parse_args(argv)
    for what in ("past", "batches", "prefill", "prefill_batches"):
        if any(v < 1 for v in getattr(args, what)):
            p.error(f"--{what.replace('_', '-')}: positive integers")
    if args.threads < 0 or args.rounds < 1 or args.warmup < 0 or args.budget <= 0:
        p.error("--threads >= 0, --rounds >= 1, --warmup >= 0, --budget > 0")
    if not args.json and not args.markdown:
        p.error("nothing to write: give --json and/or --markdown")
    return args


def _write(report: dict, args) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(render_markdown(report))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    if args.merge:
        try:
            reports = [json.loads(Path(f).read_text()) for f in args.merge]
        except (OSError, ValueError) as exc:
            print(f"error: --merge: {_one_line(exc)}", file=sys.stderr)
            return 2
        _write(merge(reports), args)
        return 0
    report: dict = {"runs": [run_meta(args, argv)], "models": {}, "rows": []}
    for name in args.models:
        log(f"{name}:")
        try:
            entry, rows = bench_model(name, args, log)
        except FileNotFoundError as exc:  # the trained model not trained here: say how
            print(f"error: {_one_line(exc)}", file=sys.stderr)
            return 2
        report["models"][name] = entry
        report["rows"] += rows
        _write(report, args)  # after each model: a later failure keeps what was measured
    _write(report, args)
    wrong = config_failure_lines(report)
    if wrong:  # a peer called wrongly: its figures are not the peer's (the other benchmarks' convention)
        for line in wrong:
            print(f"error: a peer was called wrongly: {line}", file=sys.stderr)
        return 3
    return 0


def config_failure_lines(report: dict) -> list[str]:
    """``model variant: line`` for each log line of a peer that says it was called wrongly
    (``scripts.bench._peers.CONFIG_FAILURES``)."""
    return [f"{name} {key}: {line}" for name, entry in report.get("models", {}).items()
            for key, v in entry.get("variants", {}).items() for line in v.get("config_failures", [])]


if __name__ == "__main__":
    sys.exit(main())
