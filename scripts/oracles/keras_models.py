"""Check the Keras benchmark models that ``scripts/oracles/build_keras_models.py`` wrote, on onnxruntime CPU.

    python -m scripts.oracles.keras_models [--dir DIR]

Run it in the project's environment (onnxruntime; no TensorFlow). For each model in ``DIR/manifest.json``
and each of its files (tf2onnx optimizer on and off): the sha256 is the one the build recorded; onnxruntime
(CPU, default graph optimizations) runs the reference input of ``keras-<name>.ref.npz`` and its output is
compared with Keras's (``max_abs_diff``, and ``max_rel_diff``: that over the largest Keras output); the same
input twice as a batch of 2 gives the batch-1 output twice (the batch dimension is dynamic). The results are
added to the manifest under ``ort``. A difference over ``--tol`` (default 1e-4), or any failure, is one line
on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

DEFAULT_DIR = Path.home() / ".cache" / "onnxopt" / "models" / "keras"


class VerifyError(Exception):
    pass


def check_file(path: Path, record: dict, x: np.ndarray, y: np.ndarray, tol: float) -> dict:
    import onnxruntime as ort

    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != record["sha256"]:
        raise VerifyError(f"{path.name}: sha256 differs from the manifest's (rebuilt without the manifest?)")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    (inp,), (out,) = sess.get_inputs(), sess.get_outputs()
    got = sess.run([out.name], {inp.name: x})[0]
    if got.shape != y.shape:
        raise VerifyError(f"{path.name}: onnxruntime's output has shape {got.shape}, Keras's {y.shape}")
    diff = float(np.max(np.abs(got.astype(np.float64) - y)))
    rel = diff / float(np.max(np.abs(y)))
    if not diff <= tol:
        raise VerifyError(f"{path.name}: max abs diff to Keras {diff:.3g} > {tol:g}")
    got2 = sess.run([out.name], {inp.name: np.concatenate([x, x])})[0]
    if got2.shape != (2,) + y.shape[1:]:
        raise VerifyError(f"{path.name}: batch 2 gave shape {got2.shape}")
    batch_diff = float(np.max(np.abs(got2 - np.concatenate([got, got]))))
    if not batch_diff <= tol:
        raise VerifyError(f"{path.name}: batch 2 differs from batch 1 by {batch_diff:.3g}")
    return {
        "onnxruntime": ort.__version__,
        "provider": "CPUExecutionProvider",
        "max_abs_diff": diff,
        "max_rel_diff": rel,
        "argmax_equal": bool(np.argmax(got) == np.argmax(y)),
        "batch2_max_abs_diff": batch_diff,
        "session_inputs": [{"name": i.name, "shape": i.shape, "type": i.type} for i in sess.get_inputs()],
        "session_outputs": [{"name": o.name, "shape": o.shape, "type": o.type} for o in sess.get_outputs()],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.oracles.keras_models", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"the build's output folder (default {DEFAULT_DIR})")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest max abs difference to Keras taken (default 1e-4)")
    args = ap.parse_args(argv)

    manifest_path = args.dir / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        models = manifest["models"]
        if not models:
            raise VerifyError(f"{manifest_path}: no models")
        for name, record in models.items():
            ref = np.load(args.dir / record["ref"]["file"])
            x, y = ref["input"], ref["output"]
            for variant, frec in record["files"].items():
                frec["ort"] = check_file(args.dir / frec["file"], frec, x, y, args.tol)
                r = frec["ort"]
                print(f"{frec['file']}: max abs diff {r['max_abs_diff']:.3g} (rel {r['max_rel_diff']:.3g}), "
                      f"argmax {'equal' if r['argmax_equal'] else 'DIFFERS'}, batch 2 ok", flush=True)
    except Exception as e:  # ours, a missing file, onnxruntime's: one line
        print(f"scripts.oracles.keras_models: {type(e).__name__}: {' '.join(str(e).split())[:300]}", file=sys.stderr)
        return 1
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"verified {len(models)} model(s) in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
