"""onnxopt.inspect.analysis's FLOPs against published figures (FLOPs = 2 x multiply-accumulates).

    python -m scripts.oracles.flops [--cache DIR] [--json OUT.json]

Models (built into the zoo cache when absent; random weights: FLOPs do not depend on them):

    resnet50-legacy, resnet50-dynamo   the zoo's torchvision ResNet-50, 1x3x224x224
    bert-base                          BertModel with bert-base-uncased's config (12 layers, 768 wide, 12 heads,
                                       3072 intermediate), exported by onnxopt.models.transformers_models
                                       (legacy exporter, eager attention), batch 1, sequence 128
    gpt2-small                         GPT2LMHeadModel with GPT-2 small's config (124M), same export, 1x128

Published figures, and what they count:

    ResNet-50   torchvision's ResNet50_Weights.IMAGENET1K_V1 table lists "GFLOPS 4.09"
                (https://pytorch.org/vision/stable/models/generated/torchvision.models.resnet50.html):
                multiply-accumulates of its convolutions and linear layer at 224x224, so 2 x 4.09 = 8.18 GFLOPs
                in our convention (element-wise ops, pooling and batch norm are not in it).
    BERT-base,  Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1: a forward pass
    GPT-2 small costs C_forward = 2N + 2 n_layer n_ctx d_attn FLOPs per token, N the non-embedding
                parameters, N = 2 n_layer d_model (2 d_attn + d_ff) (weights of the attention projections
                and the feed-forward layers: no biases, layer norms, embeddings or LM head); times n_ctx =
                128 tokens. Its one n_ctx term counts the attention scores Q x K' (the attention-weighted
                sum P x V costs as much again and is not in it); our count has both, and the element-wise
                work (softmax, GELU, layer norms, biases), so it is expected a little higher.
                GPT-2 small: the formula leaves out the LM head (2 d_model n_vocab per token, 9.9 GFLOPs
                at 128 tokens): it is compared with our count minus the LM head's MatMul; the table shows
                the full count too. BERT-base: our count includes the pooler (one 768x768 layer, 1.2 MFLOPs).

Prints a table (model, shape, our FLOPs, published figure, its source, ratio) and writes the JSON
(default scripts/results/analysis/flops.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from onnxopt.inspect import analysis
from onnxopt.models import zoo
from onnxopt.models.cache import DEFAULT_CACHE
from scripts import RESULTS

OUT = RESULTS / "analysis" / "flops.json"
SEQ = 128
TORCHVISION_RESNET50_GMACS = 4.09
TORCHVISION_SOURCE = ("torchvision ResNet50_Weights.IMAGENET1K_V1: GFLOPS 4.09 (multiply-accumulates), "
                      "x2 (https://pytorch.org/vision/stable/models/generated/torchvision.models.resnet50.html)")
KAPLAN_SOURCE = ("Kaplan et al. 2020, Scaling Laws for Neural Language Models, sec. 2.1: C_forward = 2N + "
                 "2 n_layer n_ctx d_attn per token, N non-embedding parameters; x {n} tokens")


def kaplan(n_layer: int, d_model: int, d_ff: int, n_ctx: int, d_attn: int | None = None) -> int:
    """Kaplan et al.'s forward FLOPs for ``n_ctx`` tokens."""
    d_attn = d_attn or d_model
    n = 2 * n_layer * d_model * (2 * d_attn + d_ff)
    return n_ctx * (2 * n + 2 * n_layer * n_ctx * d_attn)


def transformer(kind: str, cache: Path) -> Path:
    """The benchmark export of ``kind`` (bert-base, gpt2-small), built once into ``cache/bench``
    (the name scripts/bench/targets.py gives it)."""
    from onnxopt.models import transformers_models as tm

    path = cache / "bench" / f"{kind}-eager-legacy.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.partial.onnx")
        tm.export_bench(kind, tmp, "legacy", attn="eager")
        os.replace(tmp, path)
    return path


def zoo_path(name: str, cache: Path) -> Path:
    spec = zoo.get(name)
    path = spec.path(cache) if cache != DEFAULT_CACHE else spec.path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        spec.build(path)
    return path


def lm_head_flops(report: dict, d_model: int, vocab: int) -> int:
    """The FLOPs of the MatMul (or Gemm) whose weight is the [d_model, vocab] LM head."""
    heads = [n for n in report["nodes"] if n["op"] in ("MatMul", "Gemm") and n["weight_bytes"] == 4 * d_model * vocab]
    if len(heads) != 1:
        raise SystemExit(f"expected one LM head MatMul, found {len(heads)}")
    return heads[0]["flops"]


def rows(cache: Path) -> list[dict]:
    from onnxopt.models import transformers_models as tm

    out = []
    for name in ("resnet50-legacy", "resnet50-dynamo"):
        r = analysis.analyze(zoo_path(name, cache), input_shapes=None, device="h100-sxm")
        shape = "x".join(map(str, r["inputs"][0]["shape"]))
        published = round(2 * TORCHVISION_RESNET50_GMACS * 1e9)
        out.append({"model": name, "shape": shape, "ours": r["flops"], "published": published,
                    "compared": r["flops"], "source": TORCHVISION_SOURCE})
    bert = tm.BERT_BASE_CONFIG
    path = transformer("bert-base", cache)
    shapes = {n: [1, SEQ] for n in ("input_ids", "attention_mask", "token_type_ids")}
    r = analysis.analyze(path, input_shapes=shapes, device="h100-sxm")
    published = kaplan(bert["num_hidden_layers"], bert["hidden_size"], bert["intermediate_size"], SEQ)
    out.append({"model": "bert-base", "shape": f"1x{SEQ}", "ours": r["flops"], "published": published,
                "compared": r["flops"], "source": KAPLAN_SOURCE.format(n=SEQ) + " (our count: the whole model, "
                                                                         "pooler included)"})
    gpt = tm.GPT2_SMALL_CONFIG
    path = transformer("gpt2-small", cache)
    r = analysis.analyze(path, input_shapes={"input_ids": [1, SEQ], "attention_mask": [1, SEQ]}, device="h100-sxm")
    head = lm_head_flops(r, gpt["n_embd"], gpt["vocab_size"])
    published = kaplan(gpt["n_layer"], gpt["n_embd"], 4 * gpt["n_embd"], SEQ)
    out.append({"model": "gpt2-small", "shape": f"1x{SEQ}", "ours": r["flops"], "published": published,
                "compared": r["flops"] - head, "lm_head": head,
                "source": KAPLAN_SOURCE.format(n=SEQ) + "; compared with our count minus the LM head "
                                                        f"({head / 1e9:.2f} GFLOPs), which the formula leaves out"})
    for row in out:
        row["ratio"] = round(row["compared"] / row["published"], 4)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.flops", description=__doc__.split("\n")[0])
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="the model cache (default: the zoo's)")
    p.add_argument("--json", type=Path, default=OUT, help=f"where the results go (default {OUT})")
    args = p.parse_args(argv)
    results = rows(args.cache)
    print(f"{'model':17} {'shape':12} {'ours GFLOPs':>12} {'compared':>9} {'published':>10} {'ratio':>7}  source")
    for r in results:
        print(f"{r['model']:17} {r['shape']:12} {r['ours'] / 1e9:12.3f} {r['compared'] / 1e9:9.3f} "
              f"{r['published'] / 1e9:10.3f} {r['ratio']:7.4f}  {r['source']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_name(f".{args.json.name}.tmp")
    tmp.write_text(json.dumps({"flops_convention": analysis.FLOPS_CONVENTION, "models": results}, indent=2) + "\n")
    os.replace(tmp, args.json)
    bad = [r["model"] for r in results if abs(r["ratio"] - 1) > 0.05]
    if bad:
        print(f"more than 5% off: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
