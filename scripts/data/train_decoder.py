"""Train a small Llama-style decoder with real weights, reproducibly, on this CPU, on Python's own sources.

Issue 30 wants one decoder whose weights were trained (so its logits mean something and fp16/int4 fidelity can
be judged on real next-token distributions) that we control and can rebuild byte for byte. This script makes it:

- corpus: the ``.py`` files of the running interpreter's standard library (``sysconfig``'s ``stdlib`` path),
  sorted by relative path, without ``site-packages`` and without test folders (``test``, ``tests``,
  ``idle_test``); files that are not UTF-8 are skipped (counted). The split is BY FILE and fixed: a file is
  held out when the first 8 bytes of SHA-256 of its relative path, as an integer, are 0 modulo 10 (about 10 %),
  so the split does not move when a Python release adds or drops files;
- tokenizer: byte-level BPE trained with ``tokenizers`` on the training files only (GPT-2 pre-tokenizer, no
  prefix space, every byte in the alphabet, so any text round-trips exactly); special tokens
  ``<|endoftext|>`` (bos = eos, also the separator between files) and ``<|pad|>``;
- model: ``transformers.LlamaConfig``: grouped-query attention (8 query heads, 4 key/value heads), rotary
  (theta 10,000, half-split), SwiGLU MLP, RMSNorm, UNTIED input embedding and LM head (as Llama-2/3-8B and
  Mistral: the LM head is its own MatMul weight);
- training: files joined with ``<|endoftext|>`` into one token stream, random windows (a seeded
  ``torch.Generator``), AdamW, linear warm-up then cosine decay, gradient clipping; fixed seeds,
  ``torch.use_deterministic_algorithms(True)``, a fixed thread count (recorded: the float sums of a CPU matmul
  can depend on how many threads split it, so the same bytes need the same versions AND thread count);
- output (Hugging Face format, loadable offline by ``AutoTokenizer``/``AutoModelForCausalLM`` and readable by
  onnxruntime-genai's model builder): config.json, generation_config.json, model.safetensors, tokenizer.json,
  tokenizer_config.json (+ the special-tokens file where the transformers release writes one) and
  ``train_metadata.json`` (held-out perplexity with its token count, loss curve summary, steps, seconds, seeds,
  threads, the SHA-256 of the source file list and of the corpus bytes, versions, the command). Written to a
  temporary folder next to the destination and renamed into place, so a folder that exists is complete.

Default destination: ``<cache>/_trained/<name>/`` (``models.cache``: ``$ONNXOPT_CACHE``, else
``~/.cache/onnxopt/models``); never committed. ``onnxopt.models.trained_decoder`` finds it.

    python -m scripts.data.train_decoder                # the full run (~15 min on 2 uncontended cores)
    python -m scripts.data.train_decoder --tiny --out /tmp/x   # seconds: tiny slice, tiny config (tests)

Imports onnxopt.models (for the cache folder and the model's name), torch, transformers, tokenizers, safetensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from onnxopt.models.trained_decoder import METADATA_FILE, MODEL_NAME, default_trained_dir
from onnxopt.models.transformers_models import import_transformers
from scripts.bench.peers import machine_info

TEST_DIRS = frozenset({"test", "tests", "idle_test"})
EOT = "<|endoftext|>"
PAD = "<|pad|>"
HELD_OUT_MODULUS = 10
FORMAT_VERSION = 1  # bump when the recipe changes (the accessor checks it)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights (besides the corpus and the library versions)."""
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704  # ~ 8/3 * 256, rounded to a multiple of 64 (SwiGLU)
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 800  # ~1.65 CPU-seconds a step (measured, shared machine): ~12-15 min on 2 uncontended cores
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.05
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    data_seed: int = 4321
    eval_max_tokens: int = 1 << 20  # cap of the held-out tokens scored (whole windows; the stdlib has ~264k)
    max_files: int | None = None  # None: every file (the tiny recipe takes a slice)


def tiny_recipe() -> Recipe:
    """Seconds on one core: the first 40 files, a 2-layer 64-wide model (still grouped-query), 12 steps."""
    return Recipe(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, seq_len=64,
                  batch_size=4, steps=12, lr=3e-3, eval_max_tokens=4096, max_files=40)


# ----------------------------------------------------------------------------------------------- corpus

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_held_out(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_MODULUS == 0


@dataclasses.dataclass
class Corpus:
    root: Path
    train: list[tuple[str, str]]  # (relative path, text), sorted by path
    held_out: list[tuple[str, str]]
    skipped_not_utf8: list[str]

    def list_sha256(self) -> str:
        """SHA-256 of the file list (relative paths, with their split), the corpus's identity."""
        lines = [f"train {p}" for p, _ in self.train] + [f"held_out {p}" for p, _ in self.held_out]
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()

    def content_sha256(self) -> str:
        h = hashlib.sha256()
        for p, text in self.train + self.held_out:
            h.update(p.encode() + b"\0" + text.encode() + b"\0")
        return h.hexdigest()


def load_corpus(root: Path | None = None, max_files: int | None = None) -> Corpus:
    root = root or stdlib_root()
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] == "site-packages" or TEST_DIRS.intersection(rel.parts[:-1]):
            continue
        if path.is_file():
            paths.append(rel.as_posix())
    paths.sort()
    if max_files is not None:
        paths = paths[:max_files]
    train, held_out, skipped = [], [], []
    for rel in paths:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        (held_out if is_held_out(rel) else train).append((rel, text))
    if not train or not held_out:
        raise SystemExit(f"error: the corpus under {root} has {len(train)} training and {len(held_out)} "
                         "held-out files; both must be non-empty")
    return Corpus(root, train, held_out, skipped)


# -------------------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style) trained on ``texts`` in order; deterministic for a fixed input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_tokenizer(tok, model_max_length: int):
    from transformers import PreTrainedTokenizerFast  # import_transformers() ran first (train, tests)

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=PAD,
                                   unk_token=None, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False)


def save_tokenizer(tok, folder: Path, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (and what else this transformers release writes), with
    ``tokenizer_class`` set to GPT2Tokenizer: the tokenizer IS GPT-2's kind (byte-level BPE, GPT-2
    pre-tokenizer), and onnxruntime-extensions, which onnxruntime-genai tokenizes with, knows that class by
    name and not transformers 5's generic ``TokenizersBackend``."""
    wrap_tokenizer(tok, model_max_length).save_pretrained(folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    cfg["add_bos_token"] = False
    cfg["add_prefix_space"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def token_stream(tok, texts: list[str]) -> list[int]:
    """The files' tokens joined, each file preceded by <|endoftext|> (as a document start)."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.append(eot)
        ids.extend(enc.ids)
    return ids


# -------------------------------------------------------------------------------------------- training

def make_config(recipe: Recipe, tok):
    from transformers import LlamaConfig

    eot = tok.token_to_id(EOT)
    return LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads, num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.hidden_size // recipe.num_attention_heads,
        max_position_embeddings=recipe.max_position_embeddings, rope_theta=recipe.rope_theta,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, bos_token_id=eot, eos_token_id=eot, pad_token_id=tok.token_to_id(PAD),
        initializer_range=0.02, use_cache=True, torch_dtype="float32")


def lr_at(step: int, recipe: Recipe) -> float:
    warm = max(1, int(recipe.steps * recipe.warmup_fraction))
    if step < warm:
        return recipe.lr * (step + 1) / warm
    progress = (step - warm) / max(1, recipe.steps - warm)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def held_out_loss(model, ids, seq_len: int, max_tokens: int) -> tuple[float, int]:
    """Mean next-token NLL over non-overlapping windows of ``seq_len + 1`` tokens of ``ids`` (each window
    scores seq_len predictions), up to ``max_tokens`` predictions; returns (mean NLL, tokens scored)."""
    import torch

    n_windows = min((len(ids) - 1) // seq_len, max(1, max_tokens // seq_len))
    if n_windows < 1:
        raise SystemExit(f"error: the held-out stream has {len(ids)} tokens, fewer than one window of {seq_len}")
    data = torch.tensor(ids[: n_windows * seq_len + 1], dtype=torch.long)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, n_windows, 8):
            rows = range(start, min(n_windows, start + 8))
            x = torch.stack([data[r * seq_len: r * seq_len + seq_len] for r in rows])
            y = torch.stack([data[r * seq_len + 1: r * seq_len + seq_len + 1] for r in rows])
            logits = model(input_ids=x).logits
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                    reduction="sum")
            total += float(nll)
            count += y.numel()
    model.train()
    return total / count, count


def loss_summary(losses: list[float], parts: int = 10) -> list[dict]:
    """Mean training loss over each tenth of the run (first step, last step included)."""
    out = []
    n = len(losses)
    for i in range(parts):
        lo, hi = n * i // parts, n * (i + 1) // parts
        if hi > lo:
            out.append({"steps": [lo + 1, hi], "mean_loss": round(sum(losses[lo:hi]) / (hi - lo), 4)})
    return out


def train(recipe: Recipe, out: Path, threads: int, log=print) -> dict:
    import safetensors
    import tokenizers
    import torch

    transformers = import_transformers()  # offline, without torchvision's meta registrations
    from transformers import GenerationConfig, LlamaForCausalLM

    t_start = time.perf_counter()
    torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    torch.use_deterministic_algorithms(True)

    corpus = load_corpus(max_files=recipe.max_files)
    train_texts = [t for _, t in corpus.train]
    held_texts = [t for _, t in corpus.held_out]
    log(f"corpus: {len(corpus.train)} training files, {len(corpus.held_out)} held-out files, "
        f"{len(corpus.skipped_not_utf8)} skipped (not UTF-8), under {corpus.root}")

    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts, recipe.vocab_size)
    train_ids = token_stream(tok, train_texts)
    held_ids = token_stream(tok, held_texts)
    t_tok = time.perf_counter() - t0
    train_bytes = sum(len(t.encode()) for t in train_texts)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, {len(train_ids)} training tokens "
        f"({train_bytes / len(train_ids):.2f} bytes/token), {len(held_ids)} held-out tokens, {t_tok:.1f} s")

    config = make_config(recipe, tok)
    model = LlamaForCausalLM(config)  # initialised from the torch seed set above
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)
    data = torch.tensor(train_ids, dtype=torch.long)
    if len(data) <= recipe.seq_len + 1:
        raise SystemExit(f"error: {len(data)} training tokens, fewer than one window of {recipe.seq_len}")
    gen = torch.Generator().manual_seed(recipe.data_seed)
    offsets = torch.arange(recipe.seq_len + 1)
    losses: list[float] = []
    log(f"model: {n_params} parameters; {recipe.steps} steps of {recipe.batch_size} x {recipe.seq_len} tokens, "
        f"{threads} thread(s)")
    t_train0 = time.perf_counter()
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        starts = torch.randint(0, len(data) - recipe.seq_len - 1, (recipe.batch_size,), generator=gen)
        window = data[starts[:, None] + offsets]
        logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        losses.append(loss.detach().item())
        if (step + 1) % max(1, recipe.steps // 20) == 0 or step + 1 == recipe.steps:
            el = time.perf_counter() - t_train0
            log(f"  step {step + 1}/{recipe.steps}  loss {losses[-1]:.4f}  {el:.0f} s  "
                f"({(step + 1) / el:.2f} steps/s)")
    train_seconds = time.perf_counter() - t_train0

    t0 = time.perf_counter()
    nll, scored = held_out_loss(model, held_ids, recipe.seq_len, recipe.eval_max_tokens)
    eval_seconds = time.perf_counter() - t0
    ppl = math.exp(nll)
    log(f"held-out: mean NLL {nll:.4f}, perplexity {ppl:.3f} over {scored} tokens ({eval_seconds:.0f} s)")

    # write everything into a temporary sibling, then rename into place
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.eval()
        model.save_pretrained(tmp, safe_serialization=True)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id, do_sample=False).save_pretrained(tmp)
        save_tokenizer(tok, tmp, recipe.max_position_embeddings)
        weights_sha = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
        meta = {
            "format_version": FORMAT_VERSION,
            "name": out.name,
            "description": "Llama-style decoder (GQA 8q/4kv, rotary, SwiGLU, RMSNorm, untied LM head) trained "
                           "on the .py files of Python's standard library (no tests), byte-level BPE",
            "recipe": dataclasses.asdict(recipe),
            "parameters": n_params,
            "tie_word_embeddings": False,
            "held_out": {"mean_nll": round(nll, 6), "perplexity": round(ppl, 4), "tokens_scored": scored,
                         "tokens_available": len(held_ids), "files": len(corpus.held_out),
                         "bytes": sum(len(t.encode()) for t in held_texts),
                         "note": "token-level perplexity over non-overlapping windows of seq_len, "
                                 "files joined with <|endoftext|>, up to eval_max_tokens"},
            "training": {"steps": recipe.steps, "tokens_seen": recipe.steps * recipe.batch_size * recipe.seq_len,
                         "corpus_tokens": len(train_ids), "corpus_bytes": train_bytes, "files": len(corpus.train),
                         "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4),
                         "loss_by_tenth": loss_summary(losses)},
            "seconds": {"tokenizer_and_encoding": round(t_tok, 1), "training": round(train_seconds, 1),
                        "steps_per_second": round(recipe.steps / train_seconds, 3),
                        "held_out_eval": round(eval_seconds, 1),
                        "total": round(time.perf_counter() - t_start, 1)},
            "seeds": {"torch": recipe.seed, "data": recipe.data_seed}, "threads": threads,
            "deterministic_algorithms": True,
            "corpus": {"root": str(corpus.root), "python": platform.python_version(),
                       "file_list_sha256": corpus.list_sha256(), "content_sha256": corpus.content_sha256(),
                       "held_out_rule": f"sha256(relative path)[:8] as big-endian int % {HELD_OUT_MODULUS} == 0",
                       "excluded": ["site-packages", *sorted(TEST_DIRS)],
                       "skipped_not_utf8": corpus.skipped_not_utf8,
                       "held_out_files": [p for p, _ in corpus.held_out]},
            "model_safetensors_sha256": weights_sha,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
                         "python": platform.python_version()},
            "machine": {"processor": machine_info()["cpu"], "logical_cpus": os.cpu_count(),
                        "load_average_at_end": list(os.getloadavg())},
            "command": " ".join(["python -m scripts.data.train_decoder", *sys.argv[1:]]),
            "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0700 and save_pretrained's 0600 would hide a shared cache's files
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out}")
    return meta


def greedy_sample(folder: Path, prompt: str, new_tokens: int = 64) -> str:
    """The greedy continuation (``new_tokens`` tokens, KV cache on) of ``prompt`` by the model in ``folder``."""
    import torch

    transformers = import_transformers()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:])





def main(argv: list[str] | None = None) -> int:
    # threads that wait sleep instead of spinning: on a shared machine a spinning OpenMP thread burned ~3x the
    # CPU time per step here (no effect on the numbers; read when torch loads, which happens later)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ap = argparse.ArgumentParser(
        prog="python -m scripts.data.train_decoder",
        description="Train the small Llama-style decoder (real weights) on Python's standard-library sources, "
                    "reproducibly on CPU, and save it in Hugging Face format with a tokenizer and "
                    f"{METADATA_FILE} (held-out perplexity, seeds, versions).")
    ap.add_argument("--steps", type=int, help="training steps (default: the recipe's, 800; --tiny: 12)")
    ap.add_argument("--tiny", action="store_true",
                    help="seconds, for tests: the first 40 files, a 2-layer 64-wide model, 12 steps")
    ap.add_argument("--out", type=Path, help=f"destination folder (default: <cache>/_trained/{MODEL_NAME}, or "
                                             "<cache>/_trained/tiny with --tiny)")
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (default 2; the same bytes need the same thread count)")
    ap.add_argument("--force", action="store_true", help="retrain even if the destination holds a model")
    ap.add_argument("--sample", metavar="PROMPT",
                    help="train nothing: print the greedy continuation (64 tokens) of PROMPT ('\\n' for newlines) "
                         "by the model already in the destination")
    args = ap.parse_args(argv)
    recipe = tiny_recipe() if args.tiny else Recipe()
    if args.steps is not None:
        if args.steps < 1:
            print("error: --steps must be at least 1", file=sys.stderr)
            return 2
        recipe = dataclasses.replace(recipe, steps=args.steps)
    if args.threads < 1:
        print("error: --threads must be at least 1", file=sys.stderr)
        return 2
    out = args.out or default_trained_dir("tiny" if args.tiny else MODEL_NAME)
    if args.sample is not None:
        if not (out / METADATA_FILE).exists():
            print(f"error: {out} holds no trained model; train it first", file=sys.stderr)
            return 2
        prompt = args.sample.replace("\\n", "\n")
        print(prompt + greedy_sample(out, prompt))
        return 0
    if (out / METADATA_FILE).exists() and not args.force:
        print(f"{out} already holds a trained model ({METADATA_FILE}); --force retrains", file=sys.stderr)
        return 0
    train(recipe, out, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
