"""BERT-base's embedding layer alone, the model the benefit of ``embed_layer_normalization`` is measured on
(the zoo's BERT has 4 layers of width 256; in a whole model the embedding is ~1% of the time, below the
noise of this machine):

    python -m scripts.data.bert_embeddings DIR
    python -m scripts.data.benefit --keys embed_layer_normalization --models \\
        --model bert-base-embeddings-legacy=DIR/bert-base-embeddings-legacy.onnx \\
        --model bert-base-embeddings-dynamo=DIR/bert-base-embeddings-dynamo.onnx --runs 500 --warmup 20

transformers' ``BertEmbeddings`` with the bert-base config (vocabulary 30522, width 768, 512 positions,
2 token types; random weights, seed 0), inputs ``input_ids`` and ``token_type_ids`` (dynamic batch and
sequence), exported by the legacy and the dynamo exporter as the zoo's builders export
(``onnxopt.models.transformers_models``). Writes DIR/bert-base-embeddings-{legacy,dynamo}.onnx.
"""

from __future__ import annotations

import sys
from pathlib import Path


def export(folder: Path) -> list[Path]:
    import warnings

    import torch

    from onnxopt.models import transformers_models as tm

    tm.import_transformers()
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertEmbeddings

    class Embeddings(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, token_type_ids):
            return self.inner(input_ids=input_ids, token_type_ids=token_type_ids)

    torch.manual_seed(0)
    module = Embeddings(BertEmbeddings(BertConfig(**tm.BERT_BASE_CONFIG))).eval()
    args = (torch.randint(0, tm.BERT_BASE_CONFIG["vocab_size"], (2, 16)), torch.zeros(2, 16, dtype=torch.long))
    names, outs = ["input_ids", "token_type_ids"], ["embeddings"]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for exporter in ("legacy", "dynamo"):  # (the zoo builders' settings: onnxopt.models.transformers_models)
            path = folder / f"bert-base-embeddings-{exporter}.onnx"
            if exporter == "legacy":
                torch.onnx.export(module, args, str(path), dynamo=False, opset_version=tm.OPSET[exporter],
                                  do_constant_folding=True, input_names=names, output_names=outs,
                                  dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names + outs})
            else:
                batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("sequence", min=1, max=512)
                program = torch.onnx.export(module, args, dynamo=True, optimize=False,
                                            opset_version=tm.OPSET[exporter], input_names=names, output_names=outs,
                                            dynamic_shapes={n: {0: batch, 1: seq} for n in names})
                program.save(str(path), external_data=False)
            tm.cap_ir_version(path)
            paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m scripts.data.bert_embeddings",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("dir", type=Path, help="where bert-base-embeddings-{legacy,dynamo}.onnx are written")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for path in export(args.dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
