"""onnxruntime-genai as a peer: its model builder turns a Hugging Face folder into a genai model folder
(model.onnx + genai_config.json + tokenizer files), and its generator times prefill and decode.

The builder is run as its documentation tells users (the input folder is ``-i``; ``-m`` is a Hub name)::

    python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p fp32|fp16|bf16|int8|int4 \\
        -e cpu|cuda|dml|webgpu|NvTensorRtRtx [-c CACHE] [--extra_options KEY=VALUE ...]

in a child process (its failures, including a crash, come back as one line). One difference: the child
puts a stand-in for ``torchvision._meta_registrations`` first, as onnxopt.models.torchvision_models does,
because the builder imports transformers' Gemma-3 classes, which import torchvision, whose compiled ops on
this machine link CUDA libraries the CPU torch lacks (``operator torchvision::nms does not exist``).
The builder's own ``--help`` fails in 0.18.0 (a bare ``%`` in its help text); its options are listed in
``onnxruntime_genai/models/builder.py``.

Timing (``time_generation``) follows the generator's API: ``Generator.append_tokens(prompt)`` runs the
model on the whole prompt (the prefill; the logits are ready when it returns), the first
``generate_next_token()`` after it only picks the token from those logits (microseconds), and every later
``generate_next_token()`` runs one decode step on the token picked before. So prefill = the time of
``append_tokens``; decode tokens/s = batch x (M - 1) / the time of calls 2..M for M new tokens.
``min_length`` is set to the full length so an end-of-sequence token cannot stop a run early.

``write_tiny_llama`` writes the small Llama-style folder the tests build (random weights, a byte-level BPE
tokenizer trained on Python's own sources).

Command line: ``python -m scripts.bench._genai {build,time,tiny} --help``. Results are JSON.

Imports only the standard library at load time; onnxruntime_genai, onnx, numpy, torch, transformers and
tokenizers are imported by the functions that need them. Nothing of onnxopt is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
EXECUTION_PROVIDERS = ("cpu", "cuda", "dml", "webgpu", "NvTensorRtRtx")

# The child process that runs the builder: the torchvision stand-in (module docstring), then the builder
# as `python -m` runs it.
_BUILDER_CHILD = (
    "import runpy, sys, types\n"
    "sys.modules.setdefault('torchvision._meta_registrations', types.ModuleType('torchvision._meta_registrations'))\n"
    "sys.argv[0] = 'onnxruntime_genai.models.builder'\n"
    "runpy.run_module('onnxruntime_genai.models.builder', run_name='__main__', alter_sys=True)\n"
)


def skip_torchvision_meta_registrations() -> None:
    """Before transformers is imported in this process: the torchvision stand-in of the module docstring
    (as onnxopt.models.torchvision_models.skip_meta_registrations; this module imports nothing of onnxopt)."""
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


class GenaiError(Exception):
    """A failure of the peer (the builder, or onnxruntime_genai loading or running a model), one line."""


def versions() -> dict:
    """The versions that make a result: onnxruntime-genai, and the onnxruntime library it loaded."""
    import onnxruntime
    import onnxruntime_genai

    return {"onnxruntime_genai": onnxruntime_genai.__version__, "onnxruntime": onnxruntime.__version__,
            # onnxruntime_genai dlopens the onnxruntime package's libonnxruntime.so (it bundles none) and
            # records its path here
            "onnxruntime_library": os.environ.get("ORT_LIB_PATH", "")}


def builder_argv(hf_dir: str | Path, out_dir: str | Path, precision: str = "fp32",
                 execution_provider: str = "cpu", cache_dir: str | Path | None = None,
                 extra_options: dict | None = None) -> list[str]:
    """The builder's arguments as a user types them after ``python -m onnxruntime_genai.models.builder``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if execution_provider not in EXECUTION_PROVIDERS:
        raise ValueError(f"execution provider {execution_provider!r}: one of {', '.join(EXECUTION_PROVIDERS)}")
    argv = ["-i", str(hf_dir), "-o", str(out_dir), "-p", precision, "-e", execution_provider]
    if cache_dir is not None:
        argv += ["-c", str(cache_dir)]
    if extra_options:
        argv += ["--extra_options", *(f"{k}={_option_text(v)}" for k, v in extra_options.items())]
    return argv


def _option_text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def build(hf_dir: str | Path, out_dir: str | Path, precision: str = "fp32", execution_provider: str = "cpu",
          cache_dir: str | Path | None = None, extra_options: dict | None = None,
          timeout: float | None = None, python: str | None = None) -> dict:
    """Run the model builder on a Hugging Face folder; returns a JSON-able dict.

    ``ok``: whether OUT holds a model and genai_config.json; ``error``: one line when not (the builder's
    exception line, or why it could not run); ``command``: what a user would type; ``seconds``: the
    builder's wall time (its imports included); ``files``: what it wrote. ``cache_dir`` defaults to a
    temporary folder removed afterwards (the builder's own default is ./cache_dir in the working directory).
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    try:
        argv = builder_argv(hf_dir, out_dir, precision, execution_provider,
                            cache_dir if cache_dir is not None else "CACHE", extra_options)
    except ValueError as exc:
        return {"ok": False, "error": str(exc)}
    result: dict = {"ok": False, "precision": precision, "execution_provider": execution_provider,
                    "extra_options": dict(extra_options or {}), "hf_dir": str(hf_dir), "out_dir": str(out_dir),
                    "command": " ".join(["python -m onnxruntime_genai.models.builder", *argv])}
    if not (hf_dir / "config.json").is_file():
        result["error"] = f"{hf_dir}: not a Hugging Face model folder (no config.json)"
        return result
    with tempfile.TemporaryDirectory(prefix="genai-builder-cache-") as tmp:
        if cache_dir is None:
            argv[argv.index("CACHE")] = tmp
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([python or sys.executable, "-c", _BUILDER_CHILD, *argv], capture_output=True,
                                  text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            result["error"] = f"the builder ran past {timeout} s"
            return result
        result["seconds"] = round(time.perf_counter() - t0, 3)
    result["returncode"] = proc.returncode
    if proc.returncode != 0:
        result["error"] = _error_line(proc.stderr) or f"the builder exited with {proc.returncode}"
        return result
    written = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    result["files"] = written
    missing = [f for f in ("genai_config.json",) if f not in written]
    if missing or not any(f.endswith(".onnx") for f in written):
        result["error"] = f"the builder exited 0 but wrote {written or 'nothing'} to {out_dir}"
        return result
    result["ok"] = True
    result["onnxruntime_genai"] = _installed_version("onnxruntime-genai")
    return result


def _installed_version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


def _error_line(stderr: str) -> str:
    """The exception line of a traceback (``ValueError: ...``), else the last line that is not a progress bar."""
    lines = [ln.strip() for ln in stderr.replace("\r", "\n").splitlines() if ln.strip()]
    after_traceback = False
    for ln in lines:
        if ln.startswith("Traceback (most recent call last)"):
            after_traceback = True
    if after_traceback:
        for ln in reversed(lines):
            if not ln.startswith(("File ", "^", "~")) and ":" in ln and not ln.startswith("During handling"):
                return ln
    return lines[-1] if lines else ""


def graph_summary(model_dir: str | Path) -> dict:
    """What a genai model folder holds: the graph's op counts, inputs and outputs (element type and shape,
    symbolic dims by name), the attributes of its attention nodes, and genai_config.json."""
    import onnx

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "genai_config.json").read_text())
    model = onnx.load(str(model_dir / config["model"]["decoder"]["filename"]), load_external_data=False)

    def value(v):
        t = v.type.tensor_type
        return {"name": v.name, "type": onnx.TensorProto.DataType.Name(t.elem_type),
                "shape": [d.dim_param or d.dim_value for d in t.shape.dim]}

    ops: dict[str, int] = {}
    attention = []
    for node in model.graph.node:
        key = f"{node.domain}:{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        ops[key] = ops.get(key, 0) + 1
        if node.op_type in ("GroupQueryAttention", "MultiHeadAttention", "Attention", "PagedAttention"):
            attention.append({"op": node.op_type, "inputs": list(node.input), "outputs": list(node.output),
                              "attributes": {a.name: _attr(onnx.helper.get_attribute_value(a))
                                             for a in node.attribute}})
    return {"opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "producer": f"{model.producer_name} {model.producer_version}",
            "ops": dict(sorted(ops.items())), "inputs": [value(v) for v in model.graph.input],
            "outputs": [value(v) for v in model.graph.output], "attention": attention, "genai_config": config}


def _attr(v):
    return v.decode() if isinstance(v, bytes) else v


def load_model(model_dir: str | Path, threads: int | None = None):
    """``onnxruntime_genai.Model`` of a folder; ``threads`` sets the decoder session's intra-op threads
    (through a Config overlay, as genai_config.json's ``session_options.intra_op_num_threads`` would)."""
    import onnxruntime_genai as og

    try:
        config = og.Config(str(model_dir))
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        return og.Model(config)
    except Exception as exc:  # onnxruntime_genai raises RuntimeError/OSError with its own message
        raise GenaiError(f"onnxruntime_genai cannot load {model_dir}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def transformers_greedy(hf_dir: str | Path, prompts, new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (token ids, batch 1, ``new_tokens`` tokens, no early
    stop): the reference a genai folder's tokens are held to."""
    skip_torchvision_meta_registrations()
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([list(p)]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            out.append(g[0, len(p):].tolist())
    return out


def greedy_tokens(model, prompt_ids, new_tokens: int) -> list[list[int]]:
    """Greedy generation of ``new_tokens`` tokens after each prompt (a list of equal-length id lists)
    with the generator; returns the new tokens of each row."""
    import numpy as np
    import onnxruntime_genai as og

    prompts = np.asarray(prompt_ids, dtype=np.int32)
    if prompts.ndim == 1:
        prompts = prompts[None]
    batch, length = prompts.shape
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, batch_size=batch, max_length=length + new_tokens,
                              min_length=length + new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens(prompts)
    out = [[] for _ in range(batch)]
    for _ in range(new_tokens):
        generator.generate_next_token()
        for row, tok in enumerate(np.asarray(generator.get_next_tokens()).reshape(-1).tolist()):
            out[row].append(int(tok))
    return out


def time_generation(model_dir: str | Path, prompt_tokens: int = 128, new_tokens: int = 128, batch: int = 1,
                    repeats: int = 5, warmup: int = 1, threads: int | None = None, seed: int = 0) -> dict:
    """Prefill latency and decode speed through the generator (module docstring: what is timed).

    The prompts are ``batch`` rows of ``prompt_tokens`` random ids (``seed``) from the model's vocabulary;
    each repeat makes a new generator (an empty cache). Returns the samples of every repeat (for an
    interval) and their medians: ``prefill_ms``, ``decode_tokens_per_s`` (all rows' tokens per second of
    the decode steps), ``decode_step_ms``.
    """
    import numpy as np
    import onnxruntime_genai as og

    if prompt_tokens < 1 or new_tokens < 2 or batch < 1 or repeats < 1:
        raise ValueError("prompt tokens >= 1, new tokens >= 2 (one decode step), batch >= 1, repeats >= 1")
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "genai_config.json").read_text())
    context = int(config["model"]["context_length"])
    total = prompt_tokens + new_tokens
    if total > context:
        raise ValueError(f"{prompt_tokens} + {new_tokens} tokens exceed the model's context length {context}")
    model = load_model(model_dir, threads)
    vocab = int(config["model"]["vocab_size"])
    prompts = np.random.default_rng(seed).integers(0, vocab, size=(batch, prompt_tokens), dtype=np.int32)
    prefill, decode = [], []
    for i in range(warmup + repeats):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, batch_size=batch, max_length=total, min_length=total)
        generator = og.Generator(model, params)
        t0 = time.perf_counter()
        generator.append_tokens(prompts)
        t1 = time.perf_counter()
        generator.generate_next_token()  # picks the first token from the prefill's logits: no model run
        t2 = time.perf_counter()
        for _ in range(new_tokens - 1):
            generator.generate_next_token()
        t3 = time.perf_counter()
        if generator.token_count() != total:
            raise GenaiError(f"the generator holds {generator.token_count()} tokens, expected {total}")
        if i >= warmup:
            prefill.append(t1 - t0)
            decode.append(t3 - t2)
    steps = new_tokens - 1
    return {"model_dir": str(model_dir), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "batch": batch, "repeats": repeats, "warmup": warmup, "threads": threads, "seed": seed,
            "device": model.device_type, **versions(),
            "prefill_ms": round(statistics.median(prefill) * 1e3, 4),
            "decode_tokens_per_s": round(statistics.median(batch * steps / d for d in decode), 3),
            "decode_step_ms": round(statistics.median(decode) * 1e3 / steps, 4),
            "samples": {"prefill_s": prefill, "decode_s": decode, "decode_steps": steps}}


def write_tiny_llama(out_dir: str | Path, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, vocab: int = 512, context: int = 256) -> Path:
    """A small Llama-style Hugging Face folder: config.json + model.safetensors (random weights from
    ``seed``), tokenizer.json + tokenizer_config.json (a byte-level BPE of ``vocab`` ids trained on the
    first 20 of Python's own sources, sorted by name; AutoTokenizer and onnxruntime_genai's Tokenizer
    load it offline), generation_config.json."""
    skip_torchvision_meta_registrations()
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = sorted(Path(argparse.__file__).parent.glob("*.py"))[:20]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(p) for p in texts], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out_dir)
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=context, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(out_dir)
    return out_dir


def _parse_extra(pairs: list[str]) -> dict:
    extra = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--extra_options {pair!r}: KEY=VALUE")
        extra[key] = value
    return extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench._genai",
        description="onnxruntime-genai as a peer: build a genai model folder from a Hugging Face folder with its "
                    "model builder, time prefill and decode through its generator, or write the tiny test folder. "
                    "Prints JSON.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="run onnxruntime-genai's model builder on a Hugging Face folder")
    b.add_argument("hf_dir", help="Hugging Face folder (config.json, weights, tokenizer files)")
    b.add_argument("out_dir", help="the genai model folder to write")
    b.add_argument("-p", "--precision", choices=PRECISIONS, default="fp32")
    b.add_argument("-e", "--execution-provider", choices=EXECUTION_PROVIDERS, default="cpu")
    b.add_argument("-c", "--cache-dir", help="the builder's cache (default: a temporary folder, removed)")
    b.add_argument("--extra_options", nargs="+", default=[], metavar="KEY=VALUE",
                   help="passed to the builder as they are (e.g. int4_accuracy_level=4 fuse_mlp_gate_up=true)")
    b.add_argument("--timeout", type=float, help="seconds before the builder is stopped")
    b.add_argument("--summary", action="store_true", help="add the built graph's op counts, inputs and outputs")
    t = sub.add_parser("time", help="prefill latency and decode tokens/s through onnxruntime_genai's generator")
    t.add_argument("model_dir", help="a genai model folder (genai_config.json)")
    t.add_argument("--prompt-tokens", type=int, default=128)
    t.add_argument("--new-tokens", type=int, default=128)
    t.add_argument("--batch", type=int, default=1)
    t.add_argument("--repeats", type=int, default=5)
    t.add_argument("--warmup", type=int, default=1)
    t.add_argument("--threads", type=int, help="intra-op threads of the decoder session (default: onnxruntime's)")
    t.add_argument("--seed", type=int, default=0, help="of the random prompt ids")
    y = sub.add_parser("tiny", help="write the tiny Llama-style Hugging Face folder the tests use")
    y.add_argument("out_dir")
    y.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    try:
        if args.command == "build":
            if not Path(args.hf_dir, "config.json").is_file():
                raise ValueError(f"{args.hf_dir}: not a Hugging Face model folder (no config.json)")
            res = build(args.hf_dir, args.out_dir, args.precision, args.execution_provider, args.cache_dir,
                        _parse_extra(args.extra_options), timeout=args.timeout)
            if res["ok"] and args.summary:
                res["summary"] = graph_summary(args.out_dir)
            print(json.dumps(res, indent=1))
            if not res["ok"]:
                print(f"error: onnxruntime-genai's builder: {res['error']}", file=sys.stderr)
                return 1
            return 0
        if args.command == "time":
            if not Path(args.model_dir, "genai_config.json").is_file():
                raise ValueError(f"{args.model_dir}: not a genai model folder (no genai_config.json)")
            res = time_generation(args.model_dir, args.prompt_tokens, args.new_tokens, args.batch, args.repeats,
                                  args.warmup, args.threads, args.seed)
            print(json.dumps(res, indent=1))
            return 0
        print(json.dumps({"hf_dir": str(write_tiny_llama(args.out_dir, seed=args.seed))}))
        return 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"error: {_first_line(exc)}", file=sys.stderr)
        return 2
    except GenaiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
