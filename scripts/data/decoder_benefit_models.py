"""Decoder exports and their inputs for measuring a decoder fusion's benefit (``scripts.data.benefit``).

    python -m scripts.data.decoder_benefit_models OUT_DIR

writes into OUT_DIR, each with its inputs as an .npz (batch 1; prefill 128 tokens, the kv step after a
real past of 128, computed by the torch model):

    trained-prefill-legacy, trained-kv-legacy, trained-kv-dynamo
        the trained decoder (``onnxopt.models.trained_decoder``: real weights, 256 wide, 8 heads, 4 key/value
        heads; trained first if the zoo cache lacks it)
    llama-mid-prefill-legacy, llama-mid-kv-legacy
        a random Llama config of a real layer's proportions: 1024 wide, 4 layers, 16 heads of 64, 4 key/value
        heads, MLP 2816, vocabulary 4096

and prints the ``scripts.data.benefit`` arguments that time them (``--model NAME=PATH --feeds NAME=NPZ``:
the kv step's mask is one longer than its past, which generated inputs do not know). The packed_projections
entry of onnxopt/data/benefit.json was measured on these.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

MID_CONFIG = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=64, initializer_range=0.02)
LENGTH = 128


def build(out: Path) -> list[str]:
    """Export the models and their feeds into ``out``; the benefit script's arguments for them."""
    from onnxopt.models import decoder_models as dm
    from onnxopt.models.trained_decoder import trained_decoder_dir

    tf = dm.import_transformers()
    out.mkdir(parents=True, exist_ok=True)
    trained = tf.AutoModelForCausalLM.from_pretrained(str(trained_decoder_dir(train_if_missing=True))).eval()
    mid = dm.build_module("llama", config=MID_CONFIG)
    args = []
    for family, model, exports in (("trained", trained, (("prefill", "legacy"), ("kv", "legacy"), ("kv", "dynamo"))),
                                   ("llama-mid", mid, (("prefill", "legacy"), ("kv", "legacy")))):
        feeds = {form: out / f"{family}-{form}.npz" for form in {f for f, _ in exports}}
        for form, path in feeds.items():
            np.savez(path, **dm.feeds(form, model, batch=1, length=LENGTH))
        for form, exporter in exports:
            name = f"{family}-{form}-{exporter}"
            dm.export_module(model, form, out / f"{name}.onnx", exporter)
            args += ["--model", f"{name}={out / f'{name}.onnx'}", "--feeds", f"{name}={feeds[form]}"]
            print(f"  {name}", flush=True)
    return args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.data.decoder_benefit_models",
                                description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder for the models and their .npz inputs")
    args = p.parse_args(argv)
    import shlex

    print("python -m scripts.data.benefit " + shlex.join(build(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
