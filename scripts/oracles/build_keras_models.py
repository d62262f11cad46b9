"""Build the Keras benchmark models of issue 16 and convert them with tf2onnx (optimizer on and off).

    <tf-venv>/bin/python -m scripts.oracles.build_keras_models [--out DIR] [--models mobilenetv2,resnet50,efficientnetb0]
                                                       [--opset 18] [--seed 0]

Run it with the python of its own virtual environment (tensorflow-cpu, tf2onnx: the pins are in
``scripts/oracles/keras_models-requirements.txt``; ``scripts/oracles/keras_models.sh`` makes that environment and runs
this script and the onnxruntime check). It does not import onnxopt, nor onnxruntime.

For each model, ``keras.applications.<Model>(weights=None, input_shape=(224, 224, 3))``: random weights
drawn after ``keras.utils.set_random_seed(seed)``, so the same seed gives the same weights; channels-last
(NHWC) as Keras builds it; the classifier head included (1000 classes, softmax).

BatchNormalization statistics: with Keras's initial ones (mean 0, variance 1) the activations of
MobileNetV2 and EfficientNetB0 shrink layer by layer to ~1e-12 and ~1e-8 at the head, so the softmax output
is 0.001 for every class and every input: a comparison of outputs (Keras against onnxruntime, or an
optimizer's output against its input) would pass whatever the numbers inside were. So, unless
``--keras-init``, each BatchNormalization layer's moving mean and variance are set, in one forward pass in
graph order, to the per-channel mean and variance of its input over a calibration batch (8 random images,
from ``seed + 1``): the weights are still random and seeded, the activations keep their scale, and the
outputs depend on the input. This changes the graph too, toward what a trained model's export looks like:
with Keras's initial statistics every BatchNormalization's shift is zero and TensorFlow's freezing drops
its Add (MobileNetV2 with tf2onnx's optimizer: 123 nodes, 10 Adds; calibrated: 140 nodes, 27 Adds, the
shifts after the 17 depthwise convolutions, which nothing fuses into the Conv).

The inputs are uniform in each model's own input range (what its ``preprocess_input`` gives):
MobileNetV2 [-1, 1), ResNet50 [-128, 128) (caffe style, mean subtracted), EfficientNetB0 [0, 255) (it
rescales inside). Each model is converted by
``tf2onnx.convert.from_keras`` twice, with the input signature ``(None, 224, 224, 3)`` float32 named
``input`` (a dynamic batch, which tf2onnx names ``unk__<n>`` with a counter, one name for the input and
another for the output: both are renamed ``N``, so that a file does not depend on what was converted before
it in the process; tf2onnx writes no value_info, so nothing else names them; the output is ``(N, 1000)``):

- ``keras-<name>-tf2onnx-opt.onnx``: tf2onnx's optimizers on (its default, ``optimizers=None``);
- ``keras-<name>-tf2onnx-noopt.onnx``: ``optimizers={}``, which ``tf2onnx.optimizer.optimize_graph``
  takes as "no optimizer" (it loops over the dict given instead of its default list). TensorFlow's own
  graph freezing (grappler, in ``tf_loader``) runs before tf2onnx either way.

Keras's own prediction on one random input (batch 1, from ``seed``) is saved as
``keras-<name>.ref.npz`` (``input``, ``output``). ``manifest.json`` in the same folder records the tool
versions, the opset, each file's node count, Transpose count, op histogram, inputs and outputs with
their shapes, sha256 and the seconds each step took; ``scripts/oracles/keras_models.py`` (the project's
environment) adds onnxruntime's max abs difference to Keras's prediction.

The same arguments give the same graph and numbers, but not always the same bytes: the names tf2onnx
gives carry a global counter that can differ by one between runs, and its merge_duplication keeps one of
several equal constants (the Clip bounds of each ReLU6, say) in an order that varies (sets of node objects).
So the manifest has,
besides each file's sha256, a ``fingerprint``: a sha256 of the nodes in order (op, domain, attributes) with
tensors named by first use and initializers by content, which is the same for every run. Any failure is one line on stderr and exit 1; nothing is skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before tensorflow is imported
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

MODELS = {  # name in files -> keras.applications constructor, input range
    "mobilenetv2": ("MobileNetV2", (-1.0, 1.0)),
    "resnet50": ("ResNet50", (-128.0, 128.0)),
    "efficientnetb0": ("EfficientNetB0", (0.0, 255.0)),
}
CALIBRATION_BATCH = 8
DEFAULT_OUT = Path.home() / ".cache" / "onnxopt" / "models" / "keras"
# The highest opset tf2onnx 1.17 has handlers and an IR version for (constants.OPSET_TO_IR_VERSION).
DEFAULT_OPSET = 18


class BuildError(Exception):
    pass


def _dims(value_info) -> list:
    return [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
            for d in value_info.type.tensor_type.shape.dim]


def describe(model_proto) -> dict:
    """Node count, Transpose count, op histogram, I/O of an ONNX model (top graph)."""
    ops: dict[str, int] = {}
    for node in model_proto.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        ops[key] = ops.get(key, 0) + 1
    init_names = {t.name for t in model_proto.graph.initializer}
    return {
        "nodes": len(model_proto.graph.node),
        "transposes": ops.get("Transpose", 0),
        "ops": dict(sorted(ops.items())),
        "opset_import": {o.domain or "ai.onnx": o.version for o in model_proto.opset_import},
        "ir_version": model_proto.ir_version,
        "inputs": [{"name": i.name, "shape": _dims(i)} for i in model_proto.graph.input if i.name not in init_names],
        "outputs": [{"name": o.name, "shape": _dims(o)} for o in model_proto.graph.output],
    }


def fingerprint(model_proto) -> str:
    """sha256 of the top graph with tensor names replaced: by first use, initializers by their content."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model_proto.graph.initializer}
    names: dict[str, str] = {}

    def name(t: str) -> str:
        if t in names or not t:
            return names.get(t, "")
        if t in inits:
            arr = numpy_helper.to_array(inits[t])
            names[t] = "c:" + hashlib.sha256(f"{arr.dtype}{arr.shape}".encode() + arr.tobytes()).hexdigest()
        else:
            names[t] = f"t{len(names)}"
        return names[t]

    h = hashlib.sha256()
    for vi in model_proto.graph.input:
        h.update(repr((name(vi.name), vi.type.SerializeToString())).encode())
    for node in model_proto.graph.node:
        attrs = [a.SerializeToString(deterministic=True) for a in node.attribute]
        h.update(repr((node.op_type, node.domain, [name(t) for t in node.input], [name(t) for t in node.output],
                       attrs)).encode())
    for vi in model_proto.graph.output:
        h.update(repr((name(vi.name), vi.type.SerializeToString())).encode())
    return h.hexdigest()


def name_batch(model_proto, name: str = "N") -> list[str]:
    """Rename the symbolic batch dimension (tf2onnx's ``unk__<n>``) of the graph's inputs and outputs."""
    renamed = []
    for vi in list(model_proto.graph.input) + list(model_proto.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_param") and dims[0].dim_param.startswith("unk__"):
            renamed.append(dims[0].dim_param)
            dims[0].dim_param = name
    return renamed


def calibrate_batchnorm(model, x) -> int:
    """Set every BatchNormalization layer's moving statistics to those of its input on ``x`` (one pass)."""
    import keras
    import numpy as np

    layers = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    done = []

    def wrap(layer, call):
        def calibrating_call(inputs, training=None, mask=None):
            a = np.asarray(inputs, dtype=np.float64)
            axes = tuple(i for i in range(a.ndim) if i != layer.axis % a.ndim)
            layer.moving_mean.assign(a.mean(axis=axes).astype(np.float32))
            layer.moving_variance.assign(a.var(axis=axes).astype(np.float32))
            done.append(layer.name)
            return call(inputs, training=False)
        return calibrating_call

    for layer in layers:
        layer.call = wrap(layer, layer.call)
    try:
        model(x, training=False)
    finally:
        for layer in layers:
            del layer.call
    if len(done) != len(layers):
        raise BuildError(f"BatchNormalization calibration reached {len(done)} of {len(layers)} layers")
    return len(done)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_one(name: str, out: Path, opset: int, seed: int, keras_init: bool) -> dict:
    import keras
    import numpy as np
    import onnx
    import tensorflow as tf
    import tf2onnx

    cls, (lo, hi) = MODELS[name]
    record: dict = {"keras_class": f"keras.applications.{cls}", "input_range": [lo, hi]}
    t0 = time.perf_counter()
    keras.utils.set_random_seed(seed)
    keras.backend.clear_session()
    model = getattr(keras.applications, cls)(weights=None, input_shape=(224, 224, 3))
    record["params"] = int(model.count_params())
    if keras_init:
        record["batchnorm_statistics"] = "Keras's initial (mean 0, variance 1)"
    else:
        xc = np.random.default_rng(seed + 1).uniform(lo, hi, size=(CALIBRATION_BATCH, 224, 224, 3))
        n = calibrate_batchnorm(model, xc.astype(np.float32))
        record["batchnorm_statistics"] = (f"calibrated: {n} BatchNormalization layers' moving mean and variance "
                                          f"set from a batch of {CALIBRATION_BATCH} random inputs (seed + 1)")
    record["build_s"] = round(time.perf_counter() - t0, 2)

    x = np.random.default_rng(seed).uniform(lo, hi, size=(1, 224, 224, 3)).astype(np.float32)
    y = np.asarray(model(x, training=False))
    if not np.all(np.isfinite(y)):
        raise BuildError(f"{name}: Keras's prediction is not finite")
    record["ref_output_range"] = [float(y.min()), float(y.max())]
    ref = out / f"keras-{name}.ref.npz"
    np.savez(ref, input=x, output=y)
    record["ref"] = {"file": ref.name, "input_shape": list(x.shape), "output_shape": list(y.shape)}

    spec = (tf.TensorSpec((None, 224, 224, 3), tf.float32, name="input"),)
    record["files"] = {}
    for variant, optimizers in (("opt", None), ("noopt", {})):
        path = out / f"keras-{name}-tf2onnx-{variant}.onnx"
        t1 = time.perf_counter()
        model_proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=opset, optimizers=optimizers)
        seconds = time.perf_counter() - t1
        # from_keras converts with continue_on_error: an op it could not convert stays a TensorFlow op.
        foreign = sorted({n.op_type for n in model_proto.graph.node if n.domain not in ("", "ai.onnx")})
        if foreign:
            raise BuildError(f"{name} ({variant}): tf2onnx left ops it could not convert: {', '.join(foreign)}")
        renamed = name_batch(model_proto)
        if model_proto.graph.value_info or len(renamed) != 2:
            raise BuildError(f"{name} ({variant}): expected tf2onnx's dynamic batch unk__<n> on the one input and "
                             f"output and no value_info; found {renamed}, {len(model_proto.graph.value_info)} value_info")
        onnx.checker.check_model(model_proto, full_check=True)
        onnx.save(model_proto, str(path))
        record["files"][variant] = {
            "file": path.name,
            "tf2onnx_optimizers": "default (all)" if optimizers is None else "none (optimizers={})",
            "convert_s": round(seconds, 2),
            "bytes": path.stat().st_size,
            "sha256": sha256(path),
            "fingerprint": fingerprint(model_proto),
            **describe(model_proto),
        }
    opt, noopt = record["files"]["opt"], record["files"]["noopt"]
    if noopt["transposes"] <= opt["transposes"]:
        raise BuildError(f"{name}: tf2onnx's optimizer off left {noopt['transposes']} Transposes, on "
                         f"{opt['transposes']}: the off switch did not take")
    record["total_s"] = round(time.perf_counter() - t0, 2)
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keras-init", action="store_true",
                    help="keep Keras's initial BatchNormalization statistics (the outputs are then constant for "
                         "MobileNetV2 and EfficientNetB0; see the module's doc)")
    args = ap.parse_args(argv)

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        print(f"build_keras_models: unknown model(s) {unknown or names}; known: {', '.join(MODELS)}", file=sys.stderr)
        return 1
    try:
        import google.protobuf
        import keras
        import numpy
        import onnx
        import tensorflow as tf
        import tf2onnx
    except ImportError as e:
        print(f"build_keras_models: {e} (run it with the python of the environment scripts/oracles/keras_models.sh makes)",
              file=sys.stderr)
        return 1

    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.update({
        "tools": {"python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras.__version__,
                  "tf2onnx": tf2onnx.__version__, "onnx": onnx.__version__, "numpy": numpy.__version__,
                  "protobuf": google.protobuf.__version__},
        "opset": args.opset,
        "seed": args.seed,
        "input": "NHWC float32 (N, 224, 224, 3), batch dynamic ('N'); reference input batch 1, uniform in the "
                 "model's input_range",
    })
    models = manifest.setdefault("models", {})
    for name in names:
        t0 = time.perf_counter()
        try:
            record = build_one(name, args.out, args.opset, args.seed, args.keras_init)
        except BuildError as e:
            print(f"build_keras_models: {e}", file=sys.stderr)
            return 1
        except Exception as e:  # one line, whatever TensorFlow or tf2onnx raised
            msg = " ".join(str(e).split())[:300]
            print(f"build_keras_models: {name}: {type(e).__name__}: {msg}", file=sys.stderr)
            return 1
        models[name] = record
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        o, n = record["files"]["opt"], record["files"]["noopt"]
        print(f"{name}: {time.perf_counter() - t0:.1f} s; nodes opt {o['nodes']} / noopt {n['nodes']}, "
              f"Transpose opt {o['transposes']} / noopt {n['transposes']}", flush=True)
    print(f"wrote {args.out} ({manifest_path.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
