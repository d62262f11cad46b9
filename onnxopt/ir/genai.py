"""onnxruntime-genai's folder beside an optimized decoder: ``genai_config.json`` and the tokenizer.

``optimize(..., genai=HF_FOLDER)`` (``--genai HF_FOLDER``) writes, next to the output model, what
onnxruntime-genai's ``og.Model(folder)`` reads (docs/genai-conventions.md): the config, made from the model
itself (its layers, key/value heads and head size from the past inputs, its vocabulary from the logits, its
query heads from its GroupQueryAttention nodes or the Hugging Face config) and from the Hugging Face folder
the model was exported from (the token ids, the context length, the model type), and that folder's tokenizer
files, copied. Every file is claimed before the work and committed with the model (``onnxopt.ir.io.Outputs``).

The model must be a decoder with genai's names: ``input_ids``, ``attention_mask`` (and ``position_ids``
where the model takes them), ``past_key_values.%d.key``/``.value`` in, ``logits`` and
``present.%d.key``/``.value`` out. Its past and present are separate buffers that grow by the new tokens
(``past_present_share_buffer`` false), as an exported model's are, unless the model can share them
(``shares_buffers``): every past is read by GroupQueryAttention alone, as its past input, every present is
that op's output, and the op reads the sequence lengths from the attention mask (no ``attention_bias``: the
form ``--padding right|none`` and ort-cuda make); a Shape of a past that leaves out its length axis is harmless
(torch 2.11's export reads the batch there). Then genai gives each layer one buffer of the whole length,
the op writes the new keys in place (onnxruntime-genai's own models run so), and nothing else in the model
reads the past's length, which is then the buffer's, not the tokens'.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx_ir as ir

from onnxopt.errors import UsageError

FLAG = "--genai"
CONFIG = "genai_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)")


def check_folder(folder: str | Path) -> Path:
    """The Hugging Face folder, or one clear line: it must hold config.json and a tokenizer."""
    path = Path(folder)
    if not path.is_dir():
        raise UsageError(f"{FLAG} {folder}: not a folder (give the Hugging Face folder the model was exported from)")
    if not (path / "config.json").is_file():
        raise UsageError(f"{FLAG} {folder}: no config.json (give the Hugging Face folder the model was exported from)")
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise UsageError(f"{FLAG} {folder}: no tokenizer.json or tokenizer.model (onnxruntime-genai needs the "
                         "tokenizer beside the model)")
    return path


def _hf_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
        generation = folder / "generation_config.json"
        if generation.is_file():
            config = {**config, **{k: v for k, v in json.loads(generation.read_text()).items()
                                   if k.endswith("_token_id")}}
    except (OSError, ValueError) as exc:
        raise UsageError(f"{FLAG} {folder}: config.json is not readable JSON ({exc})") from None
    return config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config


def claim(outputs, model_path: str | Path, folder: Path) -> list[tuple[Path, Path | None]]:
    """Claim the config and the tokenizer files beside ``model_path``: [(target, source file or None)]."""
    where = Path(model_path).parent
    for name in (*TOKENIZER_FILES, "config.json", "generation_config.json"):  # (read: never written over)
        if (folder / name).is_file():
            outputs.protect(folder / name, f"a file {FLAG} reads (the Hugging Face folder's)")
    files = [(outputs.claim(where / CONFIG, f"{FLAG}'s {CONFIG}"), None)]
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            files.append((outputs.claim(where / name, f"{FLAG}'s {name}"), folder / name))
    return files


def _dims(value: ir.Value) -> list:
    return [d if isinstance(d, int) else None for d in value.shape] if value.shape is not None else []


def shares_buffers(model: ir.Model) -> bool:
    """Whether onnxruntime-genai may give the model's past and present one buffer (the module docstring)."""
    past = {v for v in model.graph.inputs if _PAST.fullmatch(v.name)}
    if not past:
        return False
    for v in past:
        for node, idx in v.uses():
            if node.op_type == "Shape" and not _reads_length(node):
                continue  # (the batch, the heads, the head size: the same in one buffer of the whole length)
            if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft" or idx not in (3, 4) \
                    or len(node.inputs) > 10 and node.inputs[10] is not None:
                return False
    for v in model.graph.outputs:
        if v.name.startswith("present."):
            node = v.producer()
            if node is None or node.op_type != "GroupQueryAttention" or v not in node.outputs[1:3]:
                return False
    return True


def _reads_length(shape: ir.Node) -> bool:
    """A Shape of a past [batch, kv_heads, length, head_size] whose [start, end) takes axis 2 (the length)."""
    start, end = shape.attributes.get("start"), shape.attributes.get("end")
    lo = start.value if start is not None else 0
    hi = end.value if end is not None else 4
    lo, hi = (lo + 4 if lo < 0 else lo), (hi + 4 if hi < 0 else hi)
    return lo <= 2 < hi


def config(model: ir.Model, folder: Path, filename: str, provider: str | None = None) -> dict[str, Any]:
    """genai_config.json for ``model`` saved as ``filename``, from the model and the Hugging Face folder;
    ``provider`` "cuda" (the target ort-cuda) makes onnxruntime-genai run it on its CUDA provider (else its CPU)."""
    hf = _hf_config(folder)
    inputs = {v.name: v for v in model.graph.inputs}
    outputs = {v.name: v for v in model.graph.outputs}
    past = {}
    for name, value in inputs.items():
        found = _PAST.fullmatch(name)
        if found:
            past[(int(found.group(1)), found.group(2))] = value
    layers = len({i for i, _ in past})
    missing = [n for n in ("input_ids", "attention_mask") if n not in inputs]
    if not past or missing or "logits" not in outputs or any((i, kv) not in past for i in range(layers)
                                                              for kv in ("key", "value")) \
            or any(f"present.{i}.{kv}" not in outputs for i in range(layers) for kv in ("key", "value")):
        raise UsageError(f"{FLAG}: the model is not a decoder with onnxruntime-genai's names (input_ids, "
                         "attention_mask, past_key_values.N.key/value in; logits, present.N.key/value out)")
    kv_dims = _dims(past[(0, "key")])
    if len(kv_dims) != 4 or kv_dims[1] is None or kv_dims[3] is None:
        raise UsageError(f"{FLAG}: past_key_values.0.key is not [batch, kv_heads, past, head_size] with kv_heads "
                         "and head_size known")
    kv_heads, head = kv_dims[1], kv_dims[3]
    heads = {n.attributes["num_heads"].value for n in model.graph
             if n.op_type == "GroupQueryAttention" and "num_heads" in n.attributes}
    num_heads = heads.pop() if len(heads) == 1 else hf.get("num_attention_heads")
    logits = _dims(outputs["logits"])
    vocab = logits[-1] if logits and logits[-1] is not None else hf.get("vocab_size")
    context = hf.get("max_position_embeddings") or hf.get("n_positions") or hf.get("max_sequence_length")
    if not all(isinstance(x, int) for x in (num_heads, vocab, context)):
        raise UsageError(f"{FLAG} {folder}: the query heads, vocabulary or context length is in neither the model "
                         "nor config.json")
    names = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if "position_ids" in inputs:
        names["position_ids"] = "position_ids"
    names.update(past_key_names="past_key_values.%d.key", past_value_names="past_key_values.%d.value")

    def token(key: str, default: int):
        value = hf.get(key)
        value = value[0] if isinstance(value, list) and value else value
        return value if isinstance(value, int) else default

    eos = hf.get("eos_token_id")
    return {
        "model": {
            "bos_token_id": token("bos_token_id", 0),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai",
                                    "provider_options": [{provider: {}}] if provider else []},
                "filename": filename, "head_size": head,
                "hidden_size": hf.get("hidden_size", num_heads * head),
                "inputs": names,
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": num_heads, "num_hidden_layers": layers, "num_key_value_heads": kv_heads},
            "eos_token_id": eos if isinstance(eos, (int, list)) else 0,
            "pad_token_id": token("pad_token_id", token("eos_token_id", 0)),
            "type": hf.get("model_type", "decoder"),
            "vocab_size": vocab},
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": shares_buffers(model), "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def stage(outputs, files: list[tuple[Path, Path | None]], made: Mapping[str, Any]) -> None:
    """Write the config and copy the tokenizer files into their staging places (``outputs`` commits them)."""
    for target, source in files:
        staged = outputs.stage(target)
        if source is None:
            staged.write_text(json.dumps(made, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(source, staged)
