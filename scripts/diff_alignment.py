"""How far onnxopt.diff's alignment (no provenance) agrees with the provenance mapping, on every zoo
model in the cache.

    python scripts/diff_alignment.py [--models NAME ...] [--json OUT.json]

Each model is optimized with the default rules; the mapping from the output's provenance is the
reference; the output is then stripped of provenance (``diff.strip_provenance``) and aligned with the
original twice: with node names, and without them (the names stay the nodes' identities for
scoring, but the alignment does not match by them: structure, constants and op types alone). A
node agrees when it stands for the same nodes on the other side in both mappings (``diff.agreement``: AFTER nodes by the BEFORE nodes they stand for, BEFORE nodes by
the AFTER nodes standing for them); the figure is agreeing nodes over all nodes of both models.

Measured on the 19 zoo models of this project's cache (onnxopt 0.x, Nov 2026): 98.15% with names,
97.98% without; 100% on every vision model and the synthetic one; the lowest gpt2-dynamo (85.7%):
rewrites of shape arithmetic (reshape_shape_from_input, gemm_flatten_to_matmul) whose replaced
nodes the alignment counts as folded, or joins to a neighbouring region.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402

from onnxopt import diff, optimize  # noqa: E402
from onnxopt.models import zoo  # noqa: E402


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
