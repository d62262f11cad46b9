"""Decoder-only causal LMs (Llama, Qwen2/3, Phi-3, Gemma 2/3, Mistral) from transformers configs with
random weights (fixed seed), exported to ONNX with and without a key/value cache.

The inputs that onnxopt's decoder fusions (GroupQueryAttention, RotaryEmbedding, RMSNorm; issue 30)
are tested and benchmarked on. Never reaches a model hub (``HF_HUB_OFFLINE``); needs torch,
transformers and, for ``dynamo``, onnxscript.

Architectures (``ARCHS``), each a TINY config for tests (2 layers, 64 wide, 4 heads of 16, 2 key/value
heads: grouped-query attention; vocabulary 512):

    llama      LlamaForCausalLM: RMSNorm, full rotary (half-split), SwiGLU
    llama-mha  the same with 4 key/value heads: multi-head attention (no repeat_kv)
    qwen2      Qwen2ForCausalLM: q/k/v projections with bias
    qwen3      Qwen3ForCausalLM: QK-norm (RMSNorm per head on q and k before rotary)
    phi3       Phi3ForCausalLM: fused qkv_proj and gate_up_proj, partial rotary (factor 0.75, as Phi-4-mini)
    gemma2     Gemma2ForCausalLM: (1 + w) RMSNorm, attention and final logit soft-capping, sliding window 8 on
               layer 0 (layer_types sliding/full), query_pre_attn_scalar
    gemma3     Gemma3ForCausalLM (Gemma3TextConfig): QK-norm, sliding window 8 on layer 0, rope theta per
               layer type
    mistral    MistralForCausalLM: sliding window 8 on every layer

Three forms (``FORMS``):

    prefill  input_ids, attention_mask, position_ids [batch, sequence] -> logits [batch, sequence, vocab];
             no cache
    kv       one decode step: input_ids, position_ids [batch, 1], attention_mask [batch, past + 1],
             past_key_values.N.key/value [batch, kv_heads, past, head_dim] -> logits [batch, 1, vocab],
             present.N.key/value [batch, kv_heads, past + 1, head_dim] (onnxruntime-genai's names, BNSH)
    chunk    any number of new tokens after a past (empty for a prompt): input_ids, position_ids
             [batch, sequence], attention_mask [batch, past + sequence], past as kv -> logits [batch, sequence,
             vocab], present [batch, kv_heads, past + sequence, head_dim]: what onnxruntime-genai's generator
             runs (the prompt with an empty past, then one token at a time)

The kv form's wrapper (``CacheStep``) takes the flat past tensors, builds a ``DynamicCache`` of plain
(full) layers inside forward, and returns the flat presents: presents are always past + 1 long; the
sliding window is applied by the mask, not by truncating the cache (onnxruntime-genai keeps the full
buffer too). Exporters (``EXPORTERS``): ``legacy`` (TorchScript, ``dynamic_axes``, constant folding on)
and ``dynamo`` (``torch.export`` with ``dynamic_shapes``, not optimized), both through
``transformers_models._export_torch``: weights inline, IR version <= 13. Attention is transformers'
default implementation (sdpa) unless ``attn`` says otherwise.

Feeds (``feeds``) are realistic: token ids from the vocabulary; prefill rows right-padded (row 0 full,
the others shorter, ``attention_mask`` zeros at the end, position_ids 0..sequence-1: consistent with
the mask for every real token); kv rows left-padded as batched generation pads (row 0 full), the past
computed by running the torch model on the prefix (a real cache, not noise), position_ids = the
count of real tokens before the new one.

``bench_configs()`` gives the real-size benchmark configs (~1B Llama-style, 0.5B Qwen2-style): config
dicts only, built on the GPU machine, never in tests.

    python -m onnxopt.models.decoder_models llama kv out.onnx [--exporter legacy|dynamo] [--attn eager|sdpa]
        [--opset 23] [--config '{"hidden_size": 512}'] [--feeds feeds.npz --batch 1 --length 128]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .transformers_models import OPSET, _export_torch, import_transformers

ARCHS = ("llama", "llama-mha", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mistral")
FORMS = ("prefill", "kv", "chunk")
ZOO_FORMS = ("prefill", "kv")  # the zoo's decoders (chunk: exported where a test or benchmark needs it)
EXPORTERS = ("legacy", "dynamo")

# transformers class names: (config class, model class)
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "llama-mha": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

SLIDING_WINDOW = 8  # tiny configs: shorter than the feeds' sequences and pasts, so the window matters
# initializer_range 0.1 (not transformers' 0.02): with 0.02 a 64-wide random model attends almost uniformly,
# and its logits hardly depend on the past or the positions: a check on such a model proves little
TINY_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                 rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                 tie_word_embeddings=False)
TINY_EXTRA = {
    "llama": {},
    "llama-mha": {"num_key_value_heads": 4},
    "qwen2": {},
    "qwen3": {},
    "phi3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
    "gemma2": {"sliding_window": SLIDING_WINDOW, "layer_types": ["sliding_attention", "full_attention"],
               "query_pre_attn_scalar": 16, "tie_word_embeddings": True},
    "gemma3": {"sliding_window": SLIDING_WINDOW, "layer_types": ["sliding_attention", "full_attention"],
               "query_pre_attn_scalar": 16, "tie_word_embeddings": True},
    "mistral": {"sliding_window": SLIDING_WINDOW},
}

# Feeds: prefill batch 2 of 16 tokens; kv: one new token after a past of 12 (both longer than the window)
PREFILL_SEQ = 16
KV_PAST = 12
CHUNK_NEW = 3  # chunk feeds: three new tokens after the kv past


def tiny_config(arch: str) -> dict:
    """The transformers config entries of ``arch``'s tiny test model."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    return {**TINY_BASE, **TINY_EXTRA[arch]}


def bench_configs() -> dict[str, tuple[str, dict]]:
    """Real-size benchmark configs, name -> (arch, transformers config entries); random weights, built on the
    GPU machine (fp16), never in tests.

    llama-1b    Llama-3.2-1B's shape: 2048 wide, 16 layers, 32 heads of 64, 8 key/value heads, SwiGLU 8192,
                vocabulary 128256, rope theta 500000 (plain rotary: its llama3 frequency scaling left out)
    qwen2-0.5b  Qwen2.5-0.5B's shape: 896 wide, 24 layers, 14 heads of 64, 2 key/value heads, 4864,
                vocabulary 151936, q/k/v bias, rope theta 1000000, tied embeddings
    """
    return {
        "llama-1b": ("llama", dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
            rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            bos_token_id=128000, eos_token_id=128001, pad_token_id=128004, tie_word_embeddings=True)),
        "qwen2-0.5b": ("qwen2", dict(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=151643, eos_token_id=151643, pad_token_id=151643, tie_word_embeddings=True)),
    }


def _config(arch: str, config: dict | None):
    tf = import_transformers()
    entries = {**tiny_config(arch), **(config or {})}
    return getattr(tf, CLASSES[arch][0])(**entries)


def build_module(arch: str, *, seed: int = 0, config: dict | None = None, attn: str | None = None):
    """The eager model (eval mode, fp32), random weights from ``seed``; ``config`` overrides entries of the
    tiny config; ``attn``: the attention implementation (None: transformers' default)."""
    import torch

    tf = import_transformers()
    cfg = _config(arch, config)
    if attn:
        cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(tf, CLASSES[arch][1])(cfg)
    if attn and model.config._attn_implementation != attn:
        raise RuntimeError(f"{arch}: transformers chose attention {model.config._attn_implementation!r}, not {attn!r}")
    return model.eval()


def dims(model) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) of a built model."""
    cfg = model.config
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head


def io_names(form: str, layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of ``form`` for a model of ``layers`` layers (onnxruntime-genai's names)."""
    names = ["input_ids", "attention_mask", "position_ids"]
    if form == "prefill":
        return names, ["logits"]
    if form not in ("kv", "chunk"):
        raise ValueError(f"unknown form {form!r}; known: {', '.join(FORMS)}")
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return names + past, ["logits"] + present


def wrap(form: str, model):
    """A module taking ``io_names(form)`` positionally and returning a tuple of tensors."""
    import torch

    tf = import_transformers()

    class Prefill(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids):
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False, return_dict=False)
            return out[0]

    class CacheStep(torch.nn.Module):
        """Flat past in, flat presents out; the DynamicCache (full layers) lives inside forward."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = tf.DynamicCache(list(zip(past[0::2], past[1::2])))
            logits, cache = self.inner(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids, past_key_values=cache, use_cache=True,
                                       return_dict=False)[:2]
            return (logits,) + tuple(t for layer in cache.layers for t in (layer.keys, layer.values))

    if form == "prefill":
        return Prefill(model).eval()
    if form in ("kv", "chunk"):
        return CacheStep(model).eval()
    raise ValueError(f"unknown form {form!r}; known: {', '.join(FORMS)}")


# ---------------------------------------------------------------------------------------------
# Feeds


def prefill_feeds(vocab_size: int, batch: int = 2, seq: int = PREFILL_SEQ, *, seed: int = 0,
                  pad_id: int = 0) -> dict[str, np.ndarray]:
    """Right-padded rows (row 0 full, the others between seq/2 and seq tokens), ids in [3, vocab) (above
    pad/bos/eos), ``pad_id`` in the padding, position_ids 0..seq-1."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, seq // 2), seq, size=batch) if seq > 1 else np.ones(batch, np.int64)
    lengths[0] = seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, rng.integers(3, vocab_size, size=(batch, seq), dtype=np.int64), pad_id)
    pos = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


def kv_prefix(vocab_size: int, batch: int = 2, past: int = KV_PAST, *, seed: int = 0, pad_id: int = 0,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(prefix ids, prefix mask, prefix position_ids, new token ids) of the kv feeds: ``past`` tokens, row 0
    full, the others left-padded to between past/2 and past-1 real tokens; position_ids count real tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, past // 2), past, size=batch) if past > 1 else np.ones(batch, np.int64)
    lengths[0] = past
    mask = (np.arange(past)[None, :] >= (past - lengths)[:, None]).astype(np.int64)
    ids = np.where(mask == 1, rng.integers(3, vocab_size, size=(batch, past), dtype=np.int64), pad_id)
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return ids, mask, pos, rng.integers(3, vocab_size, size=(batch, 1), dtype=np.int64)


def kv_feeds(model, batch: int = 2, past: int = KV_PAST, *, seed: int = 0, pad_id: int = 0,
             new: int = 1) -> dict[str, np.ndarray]:
    """One decode step after a real past: the prefix of ``kv_prefix`` run through the torch ``model`` for its
    cache (a DynamicCache of full layers); then ``new`` new tokens per row, attention_mask [batch, past + new],
    position_ids [batch, new] = the real tokens before each."""
    import torch

    tf = import_transformers()
    prefix_ids, prefix_mask, prefix_pos, new_ids = kv_prefix(model.config.vocab_size, batch, past, seed=seed,
                                                             pad_id=pad_id)
    with torch.no_grad():  # a cache of full layers, as the kv form keeps (one with the config would cut sliding ones)
        out = model(input_ids=torch.from_numpy(prefix_ids), attention_mask=torch.from_numpy(prefix_mask),
                    position_ids=torch.from_numpy(prefix_pos), past_key_values=tf.DynamicCache(), use_cache=True,
                    return_dict=True)
    if new > 1:
        new_ids = np.concatenate([new_ids, np.random.default_rng(seed + 1).integers(
            3, model.config.vocab_size, size=(batch, new - 1), dtype=np.int64)], axis=1)
    feeds = {"input_ids": new_ids,
             "attention_mask": np.concatenate([prefix_mask, np.ones((batch, new), np.int64)], axis=1),
             "position_ids": (prefix_mask.sum(axis=1, keepdims=True) + np.arange(new)).astype(np.int64)}
    for i, layer in enumerate(out.past_key_values.layers):
        for kv, t in (("key", layer.keys), ("value", layer.values)):
            a = t.detach().float().numpy().astype(np.float16 if t.dtype == torch.float16 else np.float32)
            if not np.isfinite(a).all():
                raise RuntimeError(f"the torch model's cache of layer {i} has non-finite {kv}s")
            feeds[f"past_key_values.{i}.{kv}"] = np.ascontiguousarray(a)
    return feeds


def feeds(form: str, model, batch: int = 2, length: int | None = None, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Realistic feeds of ``form`` for the torch ``model``: ``length`` is the prefill sequence or the kv past."""
    pad = model.config.pad_token_id
    pad = pad if pad is not None and 0 <= pad < model.config.vocab_size else 0
    if form == "prefill":
        return prefill_feeds(model.config.vocab_size, batch, length or PREFILL_SEQ, seed=seed, pad_id=pad)
    if form == "kv":
        return kv_feeds(model, batch, length or KV_PAST, seed=seed, pad_id=pad)
    if form == "chunk":
        return kv_feeds(model, batch, length or KV_PAST, seed=seed, pad_id=pad, new=CHUNK_NEW)
    raise ValueError(f"unknown form {form!r}; known: {', '.join(FORMS)}")


ZOO_LENGTH = 64  # zoo feeds: prefill 64 tokens, kv one token after a past of 64 (batch 2, padded)


def zoo_inputs(arch: str, form: str, length: int = ZOO_LENGTH):
    """The zoo's input maker of ``arch``/``form``: (graph-only model, seed) -> ``feeds`` of the tiny torch model
    (built once, seed 0 as the zoo's export; kv feeds need it for the past), in the declared input order."""
    model = None

    def make(proto, seed: int) -> dict[str, np.ndarray]:
        nonlocal model
        if model is None:
            model = build_module(arch)
        feed = feeds(form, model, 2, length, seed=seed)
        init = {t.name for t in proto.graph.initializer}
        return {i.name: feed[i.name] for i in proto.graph.input if i.name not in init}

    return make


def torch_outputs(form: str, model, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the torch ``model`` (wrapped for ``form``) gives on ``feed``, by output name."""
    import torch

    names, outs = io_names(form, dims(model)[0])
    with torch.no_grad():
        got = wrap(form, model)(*(torch.from_numpy(np.ascontiguousarray(feed[n])) for n in names))
    got = (got,) if isinstance(got, torch.Tensor) else got
    return {n: t.detach().numpy() for n, t in zip(outs, got)}


# ---------------------------------------------------------------------------------------------
# Export


def _prefill_axes(names, outs) -> dict:
    return {**{n: {0: "batch", 1: "sequence"} for n in names}, "logits": {0: "batch", 1: "sequence"}}


def _prefill_shapes(names):
    import torch

    batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("sequence", min=1, max=4096)
    return {n: {0: batch, 1: seq} for n in names}


def _kv_axes(names, outs) -> dict:
    axes = {"input_ids": {0: "batch"}, "position_ids": {0: "batch"}, "logits": {0: "batch"},
            "attention_mask": {0: "batch", 1: "total_sequence"}}
    axes.update({n: {0: "batch", 2: "past_sequence"} for n in names[3:]})
    axes.update({n: {0: "batch", 2: "total_sequence"} for n in outs[1:]})
    return axes


def kv_shapes(names):
    import torch

    batch, past = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("past_sequence", min=2, max=4096)
    return ({0: batch}, {0: batch, 1: past + 1}, {0: batch}, tuple({0: batch, 2: past} for _ in names[3:]))


def _chunk_axes(names, outs) -> dict:
    axes = _kv_axes(names, outs)
    axes.update({n: {0: "batch", 1: "sequence"} for n in ("input_ids", "position_ids", "logits")})
    return axes


def _chunk_shapes(names):
    import torch

    batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("sequence", min=1, max=4096)
    past = torch.export.Dim("past_sequence", min=2, max=4096)
    total = torch.export.Dim("total_sequence", min=3, max=8192)  # (torch.export adds no Dim to a Dim: past + seq)
    return ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
            tuple({0: batch, 2: past} for _ in names[3:]))


_AXES = {"prefill": (_prefill_axes, _prefill_shapes), "kv": (_kv_axes, kv_shapes), "chunk": (_chunk_axes, _chunk_shapes)}


def export_module(model, form: str, path: str | Path, exporter: str = "legacy", *, opset: int | None = None,
                  seed: int = 0) -> Path:
    """Export the built torch ``model`` in ``form`` to the single file ``path`` (traced on the feeds of ``seed``)."""
    import torch

    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; known: {', '.join(EXPORTERS)}")
    names, outs = io_names(form, dims(model)[0])
    feed = feeds(form, model, seed=seed)
    args = tuple(torch.from_numpy(np.ascontiguousarray(feed[n])) for n in names)
    axes, shapes = _AXES[form]
    return _export_torch(wrap(form, model), args, path, exporter, opset or OPSET[exporter], names, outs, axes, shapes)


def export(arch: str, form: str, path: str | Path, exporter: str = "legacy", *, seed: int = 0,
           config: dict | None = None, attn: str | None = None, opset: int | None = None) -> Path:
    """Build ``arch`` (tiny config, ``config`` overriding entries) and export its ``form`` to ``path``."""
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; known: {', '.join(FORMS)}")
    model = build_module(arch, seed=seed, config=config, attn=attn)
    return export_module(model, form, path, exporter, opset=opset, seed=seed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxopt.models.decoder_models", description=__doc__.splitlines()[0])
    p.add_argument("arch", choices=ARCHS)
    p.add_argument("form", choices=FORMS)
    p.add_argument("output")
    p.add_argument("--exporter", choices=EXPORTERS, default="legacy")
    p.add_argument("--attn", choices=("eager", "sdpa"), default=None)
    p.add_argument("--opset", type=int, default=None,
                   help="the default domain's opset (default: the exporter's, " + ", ".join(
                       f"{k} {v}" for k, v in OPSET.items()) + "; 23 or more for the standard Attention, "
                   "RotaryEmbedding and RMSNormalization that portable fuses into)")
    p.add_argument("--config", type=_config_entries, default=None, metavar="JSON",
                   help='config entries over the tiny config, e.g. \'{"hidden_size": 512, "num_hidden_layers": 8}\'')
    p.add_argument("--feeds", default=None, metavar="NPZ",
                   help="also write the model's feeds (--batch rows, --length tokens: the prompt, or the past) here")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=None)
    args = p.parse_args(argv)
    model = build_module(args.arch, config=args.config, attn=args.attn)
    print(export_module(model, args.form, args.output, args.exporter, opset=args.opset))
    if args.feeds:
        np.savez(args.feeds, **feeds(args.form, model, args.batch, args.length))
        print(args.feeds)
    return 0


def _config_entries(text: str) -> dict:
    import json

    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--config is not JSON: {exc}") from None
    if not isinstance(entries, dict):
        raise argparse.ArgumentTypeError("--config is not a JSON object of config entries")
    return entries


if __name__ == "__main__":
    raise SystemExit(main())
