"""Optimize every zoo model and print the sha256 of each output, or compare with a recorded set.

    python -m scripts.oracles.zoo_hashes [--cache DIR] [--models NAME ...] [--configs CONFIG ...]
                                         [--record HASHES.json] [--check HASHES.json]

A refactoring that must not change what onnxopt writes is checked by recording the hashes before
it (``--record``) and checking them after (``--check``: exit 1 and the models that changed when
any output differs). Each model is optimized into a temporary folder once per config: ``portable``
(the default optimize), ``ort-cpu`` and ``ort-cuda`` (the targets, whose fusions emit onnxruntime's
contrib ops) and ``ort-cuda-fp16`` (``precision="fp16"``, no data); the hash covers the model file
and, when there is one, its data file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

from onnxopt import optimize
from onnxopt.models import zoo


CONFIGS = {
    "portable": {},
    "ort-cpu": {"target": "ort-cpu"},
    "ort-cuda": {"target": "ort-cuda"},
    "ort-cuda-fp16": {"target": "ort-cuda", "precision": "fp16"},
}


def output_hash(src: Path, work: Path, config: str = "portable") -> str:
    out = work / f"{src.stem}.opt.onnx"
    optimize(str(src), output=str(out), **CONFIGS[config])
    digest = hashlib.sha256()
    for path in sorted(work.glob(f"{out.name}*")):  # the model and its data file, in name order
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.zoo_hashes", description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, help="zoo cache directory (default $ONNXOPT_CACHE)")
    p.add_argument("--models", nargs="+", help="zoo models (default: every one that is built)")
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS),
                   help="how each model is optimized (default: all of them)")
    p.add_argument("--record", type=Path, help="write the hashes here (JSON)")
    p.add_argument("--check", type=Path, help="compare with hashes recorded earlier; exit 1 on a difference")
    args = p.parse_args(argv)
    names = args.models or [spec.name for spec in zoo.SPECS]
    recorded = json.loads(args.check.read_text()) if args.check else {}
    hashes, changed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            src = zoo.get(name).path(args.cache)
            if not src.exists():
                print(f"{name:<28} not built (python -m onnxopt.models build --only {name})")
                continue
            for config in args.configs:
                key = name if config == "portable" else f"{name}@{config}"
                work = Path(tmp) / key
                work.mkdir()
                hashes[key] = output_hash(src, work, config)
                verdict = ""
                if args.check:
                    verdict = "same" if recorded.get(key) == hashes[key] else "CHANGED" if key in recorded else "new"
                    if verdict == "CHANGED":
                        changed.append(key)
                print(f"{key:<42} {hashes[key]}  {verdict}".rstrip())
    if args.record:
        args.record.write_text(json.dumps(hashes, indent=2) + "\n")
    if changed:
        print(f"{len(changed)} of {len(hashes)} outputs changed: {', '.join(changed)}")
        return 1
    if args.check:
        print(f"all {len(hashes)} outputs byte-identical to {args.check}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
