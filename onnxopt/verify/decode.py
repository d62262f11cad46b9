"""Generation, compared: greedy decoding with the key/value cache on two decoder models (issue 30, point 4).

A decoder's answer is a sequence of tokens, each chosen from logits computed with the cache of the steps
before it, so comparing one forward pass is not enough: an error that grows with the cache, or a cache
written in a layout the next step misreads, shows only over many steps. :func:`compare_generation` runs
greedy generation on both models, each with its own cache (its past inputs fed from its own present
outputs), on the same prompts:

- the original generates freely (greedy: the argmax of the last position's logits);
- the optimized model is fed the original's tokens (teacher forcing), so both see the same history at every
  step; its own argmax is compared with the original's token at each step. Until the first step where they
  differ, this *is* the optimized model's free greedy generation, so that step is the first divergence; the
  share of steps that agree is the token agreement; the per-step logits are compared (max abs, cosine) while
  the histories are the same (always, by construction).

Decoders are read from their inputs and outputs (:func:`decoder_io`): ``input_ids`` (int, [batch, sequence]),
optional ``attention_mask`` ([batch, total]) and ``position_ids``, ``logits`` ([batch, sequence, vocab]), and the
cache: past inputs ``past_key_values.N.key|value`` (also ``past_key_N``/``past_value_N``, ``past.N.key``) paired
with present outputs ``present.N.key|value`` (``present_key_N``...), [batch, kv_heads, past, head_dim] (BNSH, the
layout of torch.onnx exports and onnxruntime-genai's models). A model whose ``input_ids`` take one token per run
(a decode-step export) reads its prompt one token at a time; one with a dynamic sequence reads it in one run.
Each prompt runs as a batch of one (no padding: every model sees only real tokens).

This module knows no command line: ``onnxopt.verify.verify(decode=N)`` calls it, ``onnxopt verify --decode N``
reaches it through the options.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from onnxopt.errors import UsageError

DECODE_PROMPTS = 8
"""Prompts generated when none are given."""
DECODE_PROMPT_TOKENS = 8
"""The length of each generated prompt."""
FP16_MIN_TOKEN_AGREEMENT = 0.99
"""A float16 model passes generation when at least this share of its teacher-forced argmaxes are the original's."""

_PAST = (re.compile(r"^past_key_values\.(\d+)\.(key|value)$"), re.compile(r"^past\.(\d+)\.(key|value)$"),
         re.compile(r"^past_(key|value)s?[._](\d+)$"))
_PRESENT = (re.compile(r"^present\.(\d+)\.(key|value)$"), re.compile(r"^present_key_values\.(\d+)\.(key|value)$"),
            re.compile(r"^present_(key|value)s?[._](\d+)$"))
_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
           "tensor(int64)": np.int64, "tensor(int32)": np.int32}


def _cache_key(name: str, patterns) -> tuple[int, str] | None:
    for p in patterns:
        hit = p.match(name)
        if hit:
            a, b = hit.groups()
            return (int(a), b) if a.isdigit() else (int(b), a)
    return None


@dataclass(frozen=True)
class DecoderIO:
    """The roles of a decoder's inputs and outputs (:func:`decoder_io`)."""

    input_ids: str
    id_dtype: type
    attention_mask: str | None
    mask_dtype: type | None
    position_ids: str | None
    logits: str
    cache: tuple[tuple[str, str, tuple[int, int], type], ...]  # (past input, present output, (heads, head_dim), dtype)
    one_token: bool  # input_ids take one token per run


def _genai_head_size(folder) -> int | None:
    """``model.decoder.head_size`` of the genai_config.json beside a model (onnxruntime-genai's models name
    the cache's last dimension symbolically)."""
    if folder is None:
        return None
    import json
    import os

    try:
        with open(os.path.join(folder, "genai_config.json"), encoding="utf-8") as f:
            size = json.load(f)["model"]["decoder"]["head_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return size if isinstance(size, int) and size > 0 else None


def decoder_io(sess, what: str = "model", folder=None) -> DecoderIO:
    """The decoder roles of an onnxruntime session's inputs and outputs, or UsageError (one line) saying why
    the model is not a decoder with a key/value cache. ``folder``: the model's folder, where a cache whose
    head size is symbolic takes it from onnxruntime-genai's genai_config.json."""
    ins = {i.name: i for i in sess.get_inputs()}
    outs = [o.name for o in sess.get_outputs()]
    if "input_ids" not in ins:
        raise UsageError(f"--decode: the {what} has no input_ids input (inputs: {', '.join(ins)})")
    logits = "logits" if "logits" in outs else None
    if logits is None:
        raise UsageError(f"--decode: the {what} has no logits output (outputs: {', '.join(outs)})")
    pasts = {k: n for n in ins if (k := _cache_key(n, _PAST))}
    presents = {k: n for n in outs if (k := _cache_key(n, _PRESENT))}
    if not pasts:
        raise UsageError(f"--decode: the {what} has no key/value cache inputs (past_key_values.N.key/value)")
    missing = sorted(set(pasts) ^ set(presents))
    if missing:
        layer, kind = missing[0]
        raise UsageError(f"--decode: the {what}'s cache inputs and outputs do not pair up (layer {layer} {kind} is "
                         "in one only)")
    cache = []
    head_size = _genai_head_size(folder)
    for key in sorted(pasts):
        shape = list(ins[pasts[key]].shape)
        if len(shape) == 4 and not isinstance(shape[3], int) and head_size is not None:
            shape[3] = head_size
        if len(shape) != 4 or not all(isinstance(d, int) for d in (shape[1], shape[3])):
            raise UsageError(f"--decode: the {what}'s cache input {pasts[key]} is not [batch, heads, past, head_dim] "
                             f"with static heads and head_dim (its shape: {shape})")
        dtype = _DTYPES.get(ins[pasts[key]].type)
        if dtype is None:
            raise UsageError(f"--decode: the {what}'s cache input {pasts[key]} is of type {ins[pasts[key]].type}")
        cache.append((pasts[key], presents[key], (int(shape[1]), int(shape[3])), dtype))
    ids = ins["input_ids"]
    mask = ins.get("attention_mask")
    return DecoderIO("input_ids", _DTYPES.get(ids.type, np.int64), "attention_mask" if mask is not None else None,
                     _DTYPES.get(mask.type, np.int64) if mask is not None else None,
                     "position_ids" if "position_ids" in ins else None, logits, tuple(cache),
                     len(ids.shape) == 2 and ids.shape[1] == 1)


class _Generator:
    """One model's generation state for one prompt (a batch of one)."""

    def __init__(self, sess, io: DecoderIO):
        self.sess, self.io = sess, io
        self.outputs = [o.name for o in sess.get_outputs()]
        self.past = {p: np.zeros((1, h, 0, d), dt) for p, _, (h, d), dt in io.cache}
        self.length = 0  # tokens in the cache

    def feeds(self, chunk: Sequence[int]) -> dict[str, np.ndarray]:
        """The inputs of one run on the tokens ``chunk`` after what is cached."""
        io, n = self.io, len(chunk)
        feeds = {io.input_ids: np.asarray([chunk], dtype=io.id_dtype), **self.past}
        if io.attention_mask:
            feeds[io.attention_mask] = np.ones((1, self.length + n), dtype=io.mask_dtype)
        if io.position_ids:
            feeds[io.position_ids] = np.arange(self.length, self.length + n, dtype=np.int64)[None, :]
        return feeds

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Run the model on ``tokens`` (after what is cached); the last position's logits (float64)."""
        io = self.io
        chunks = [[t] for t in tokens] if io.one_token else [list(tokens)]
        logits = None
        for chunk in chunks:
            n = len(chunk)
            out = dict(zip(self.outputs, self.sess.run(None, self.feeds(chunk))))
            self.past = {p: out[q] for p, q, _, _ in io.cache}
            self.length += n
            logits = np.asarray(out[io.logits], dtype=np.float64)[0, -1]
        return logits


def _vocab(sess, io: DecoderIO) -> int:
    """The vocabulary size: the logits' last dimension where the model states it, else one run's."""
    last = next(o.shape for o in sess.get_outputs() if o.name == io.logits)[-1]
    return last if isinstance(last, int) else int(_Generator(sess, io).feed([0]).shape[-1])


def generated_prompts(vocab: int, count: int = DECODE_PROMPTS, length: int = DECODE_PROMPT_TOKENS,
                      seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids drawn uniformly from the vocabulary (a fixed seed)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(count)]


def looks_like_a_decoder(proto) -> bool:
    """Whether a model's graph inputs name a decoder with a key/value cache (cheap: no session)."""
    names = {i.name for i in proto.graph.input}
    return "input_ids" in names and any(_cache_key(n, _PAST) for n in names)


def decoder_step_feeds(sess, seed: int = 0, prompt_tokens: int = DECODE_PROMPT_TOKENS) -> tuple[dict, dict] | None:
    """A decoder's inputs for one comparison run, made the way it runs: a generated prompt of ``prompt_tokens``
    tokens read by the model itself, then its greedy next token with the cache it wrote (a past of real keys
    and values, a mask and positions that agree with it; generated sizes would not). Returns (feeds, how each
    input was made), or None for a model that is not a decoder with a key/value cache."""
    try:
        io = decoder_io(sess)
    except UsageError:
        return None
    vocab = _vocab(sess, io)
    prompt = generated_prompts(vocab, 1, prompt_tokens, seed)[0]
    gen = _Generator(sess, io)
    nxt = int(np.argmax(gen.feed(prompt)))
    feeds = gen.feeds([nxt])
    source = (f"one decode step after a generated prompt of {prompt_tokens} tokens (seed {seed}), the cache "
              "written by the original model")
    return feeds, {k: {"source": source, "shape": list(v.shape), "dtype": str(v.dtype)} for k, v in feeds.items()}


def check_prompts(prompts, vocab: int) -> list[list[int]]:
    """Prompts as lists of token ids in [0, vocab), or UsageError (one line)."""
    out = []
    for k, p in enumerate(prompts):
        ids = np.asarray(p)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise UsageError(f"--decode: prompt {k} is not a non-empty list of token ids")
        if ids.min() < 0 or ids.max() >= vocab:
            raise UsageError(f"--decode: prompt {k} has a token id outside the vocabulary [0, {vocab})")
        out.append([int(t) for t in ids])
    return out


def compare_generation(before, after, *, steps: int, prompts: Sequence[Sequence[int]] | None = None,
                       seed: int = 0, fp16: bool = False, folders: tuple = (None, None)) -> dict:
    """Greedy generation of ``steps`` tokens per prompt on two onnxruntime sessions (``before``: the
    original, ``after``: the optimized model), compared as the module says. ``prompts``: token id lists;
    None: :data:`DECODE_PROMPTS` generated ones. ``fp16``: judged by token agreement (at least
    :data:`FP16_MIN_TOKEN_AGREEMENT`), else every token must be the original's. ``folders``: the two
    models' folders (:func:`decoder_io`), where known.

    Returns ``{"ok", "steps", "prompts", "criterion", "tokens_compared", "tokens_identical", "agreement",
    "first_divergence": {"prompt", "step", "original", "optimized"} or None, "logits": {"max_abs",
    "min_cosine"}, "per_prompt": [...]}``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"--decode {steps}: a number of tokens to generate, at least 1")
    io_b, io_a = decoder_io(before, "original", folders[0]), decoder_io(after, "optimized model", folders[1])
    vocab = _vocab(before, io_b)
    given = prompts is not None
    prompts = check_prompts(prompts, vocab) if given else generated_prompts(vocab, seed=seed)
    per_prompt, first = [], None
    compared = identical = 0
    max_abs, min_cos = 0.0, 1.0
    for k, prompt in enumerate(prompts):
        gb, ga = _Generator(before, io_b), _Generator(after, io_a)
        lb, la = gb.feed(prompt), ga.feed(prompt)
        tokens, agree, diverged = [], 0, None
        p_abs, p_cos = 0.0, 1.0
        for step in range(steps):
            if la.shape != lb.shape:
                raise UsageError(f"--decode: the models' vocabularies differ ({lb.shape[-1]} and {la.shape[-1]} logits)")
            tb, ta = int(np.argmax(lb)), int(np.argmax(la))
            p_abs = max(p_abs, float(np.abs(la - lb).max()))
            denom = float(np.linalg.norm(la) * np.linalg.norm(lb))
            p_cos = min(p_cos, float(la @ lb / denom) if denom > 0 else 1.0)
            agree += ta == tb
            if ta != tb and diverged is None:
                diverged = {"prompt": k, "step": step, "original": tb, "optimized": ta}
            tokens.append(tb)
            if step + 1 < steps:
                lb, la = gb.feed([tb]), ga.feed([tb])  # teacher forcing: the original's token to both
        compared += steps
        identical += agree
        max_abs, min_cos = max(max_abs, p_abs), min(min_cos, p_cos)
        if diverged is not None and first is None:
            first = diverged
        per_prompt.append({"prompt_tokens": len(prompt), "tokens": tokens, "identical": agree,
                           "first_divergence": None if diverged is None else diverged["step"],
                           "logits_max_abs": p_abs, "logits_min_cosine": p_cos})
    agreement = identical / compared if compared else 1.0
    ok = agreement >= FP16_MIN_TOKEN_AGREEMENT if fp16 else identical == compared
    criterion = (f"at least {FP16_MIN_TOKEN_AGREEMENT:.0%} of the tokens identical (float16)" if fp16
                 else "every token identical")
    return {"ok": bool(ok), "steps": steps, "prompts": len(prompts), "prompts_given": given,
            "criterion": criterion, "tokens_compared": compared, "tokens_identical": identical,
            "agreement": agreement, "first_divergence": first,
            "logits": {"max_abs": max_abs, "min_cosine": min_cos}, "per_prompt": per_prompt,
            "cache": {"original": len(io_b.cache), "optimized": len(io_a.cache)}}


def decode_text(entry: Mapping) -> str:
    """One line for a report: "generation: 512 of 512 tokens identical over 8 prompts x 64 steps ..."."""
    first = entry.get("first_divergence")
    text = (f"generation: {entry['tokens_identical']} of {entry['tokens_compared']} tokens identical "
            f"({entry['agreement']:.1%}) over {entry['prompts']} prompts x {entry['steps']} steps, greedy with the "
            f"cache; logits max abs {entry['logits']['max_abs']:.3g}, min cosine {entry['logits']['min_cosine']:.6f}")
    if first:
        text += (f"; first divergence: prompt {first['prompt']} step {first['step']} (original token "
                 f"{first['original']}, optimized {first['optimized']})")
    return text + ("" if entry["ok"] else f" -- FAILS: {entry['criterion']}")
