"""AMD Quark's ONNX quantizer as a peer for the issue 14 quantization benchmark (a worker script).

Runs in Quark's OWN virtual environment (amd-quark pins onnx <= 1.22 and onnxruntime <= 1.28, the project's
venv has newer ones), so it imports nothing from onnxopt::

    /work/quark-venv/bin/python scripts/bench/_quant_quark.py --model IN.onnx --calib CALIB_DIR --out OUT.onnx \
        --variant a8w8|cle|adaround [--per-channel] [--adaround-iterations N] [--log PATH]

CALIB_DIR is a folder of .npz files, one feed each (keys = the model's input names), read in file-name
order. Variants, all starting from Quark's documented CPU/GPU INT8 preset ``A8W8_QCONFIG`` (int8 symmetric
activations and int8 symmetric weights, percentile calibration, per-tensor weights, standard
QuantizeLinear/DequantizeLinear (QDQ) that onnxruntime's CPU provider runs):

- ``a8w8``: the preset as Quark ships it;
- ``cle``: the preset plus Quark's cross-layer equalization (``CLEConfig()`` defaults);
- ``adaround``: Quark's ``A8W8_ADAROUND_QCONFIG`` (the preset plus AdaRound, learning rate 0.1), with its
  iteration count capped (Quark's default is 1000 per layer; see ``ADAROUND_ITERATIONS``) so it finishes in
  minutes on a 2-core CPU.

``--per-channel`` switches the weights to per-output-channel (``QuantGranularity.Channel``); the preset is
per-tensor.

Output contract: exit 0 with OUT.onnx written and ONE JSON line on stdout::

    {"variant": ..., "seconds": <quantize time>, "quark_version": ..., "config": {...}, "fixups": [...]}

or a non-zero exit (2: bad arguments or calibration data, 1: Quark failed) with ONE line on stderr, e.g.
``adaround: <reason> (Quark log: /tmp/...)``. Everything Quark itself prints (it logs to stdout and stderr,
and compiles its custom ops on import) goes to a log file, so stdout and stderr stay machine-readable: the log
is ``--log PATH`` if given, else a temporary file removed on success and kept (named in the error) on failure.

Fix-ups (listed in the JSON's "fixups"; none changes what the model computes): the IR version is lowered to
``MAX_IR_VERSION`` when higher (onnx 1.22 may stamp one an older onnxruntime refuses; nothing in an int8 QDQ
model at opset <= 21 needs more; Quark 0.13 keeps the input model's IR version, so this has not fired), and
dims stamped 0 in value_info and graph outputs become unknown dims (Quark's AdaRound writes them for MiniLM's
dynamic tensors and onnxruntime then refuses the model). The result must then load in this venv's onnxruntime,
else exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import json
import os
import shutil
import signal
import sys
import tempfile
import time

VARIANTS = ("a8w8", "cle", "adaround")
# AdaRound iterations per layer: Quark's default is 1000; 100 keeps resnet50 (54 layers) within minutes on two
# cores. Overridable with --adaround-iterations.
ADAROUND_ITERATIONS = 100
# The highest IR version written (onnxruntime 1.20+ loads IR 10; opset <= 21 QDQ models need no more).
MAX_IR_VERSION = 10


class Failure(Exception):
    """A one-line reason; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _one_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    line = lines[0] if lines else "no message"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _calibration_files(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        raise Failure(f"calibration folder {folder!r} does not exist", 2)
    files = sorted(glob.glob(os.path.join(folder, "*.npz")))
    if not files:
        raise Failure(f"calibration folder {folder!r} has no .npz files", 2)
    return files


def _check_feeds(files: list[str], input_names: list[str]) -> None:
    """Refuse feeds whose keys are not the model's inputs (Quark's own error would be far from the cause)."""
    import numpy as np

    for index, path in enumerate(files):
        with np.load(path) as data:
            keys = sorted(data.files)
        if keys != sorted(input_names):
            raise Failure(
                f"calibration feed {os.path.basename(path)}: keys {keys} are not the model's inputs "
                f"{sorted(input_names)}",
                2,
            )


def _reader(files: list[str]):
    """An onnxruntime CalibrationDataReader over the .npz files, re-iterable through rewind()."""
    import numpy as np
    from onnxruntime.quantization.calibrate import CalibrationDataReader

    class NpzReader(CalibrationDataReader):
        def __init__(self) -> None:
            self.position = 0

        def get_next(self):
            if self.position >= len(files):
                return None
            with np.load(files[self.position]) as data:
                feed = {key: data[key] for key in data.files}
            self.position += 1
            return feed

        def rewind(self) -> None:
            self.position = 0

        def __len__(self) -> int:
            return len(files)

    return NpzReader()


def _qconfig(variant: str, per_channel: bool, iterations: int):
    import quark.onnx as qo
    from quark.onnx.quantization.config.spec import QuantGranularity

    if variant == "adaround":
        config = copy.deepcopy(qo.A8W8_ADAROUND_QCONFIG)
        for algo in config.algo_config:
            if getattr(algo, "name", "") == "adaround":
                algo.num_iterations = iterations
    else:
        config = copy.deepcopy(qo.A8W8_QCONFIG)
        if variant == "cle":
            config.algo_config = [qo.CLEConfig()]
    if per_channel:
        config.global_config.weight.set_quant_granularity(QuantGranularity.Channel)
    return config


def _describe(config) -> dict:
    """The config as JSON-safe data (Quark's own to_dict, enums as strings), with the nested extra_options
    flattened the way Quark flattens them when quantizing."""
    data = json.loads(json.dumps(config.to_dict(), default=str, sort_keys=True))
    extra = data.get("extra_options", {})
    if isinstance(extra.get("extra_options"), dict):
        extra.update(extra.pop("extra_options"))
    return data


def _clear_zero_dims(value_infos) -> int:
    """Turn dims stamped 0 into unknown dims; returns how many."""
    count = 0
    for value_info in value_infos:
        for dim in value_info.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value == 0:
                dim.Clear()
                count += 1
    return count


def _fix_up(path: str) -> list[str]:
    """Make Quark's output loadable by onnxruntime, changing nothing that affects the computation, and
    refuse (Failure) what still does not load in this environment's onnxruntime."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(path, load_external_data=False)
    fixups = []
    if model.ir_version > MAX_IR_VERSION:
        fixups.append(f"ir_version {model.ir_version} -> {MAX_IR_VERSION}")
        model.ir_version = MAX_IR_VERSION
    # AdaRound (seen on MiniLM) stamps dynamic dims as 0 in value_info and in the graph outputs, which
    # onnxruntime's shape inference then rejects ("Incompatible dimensions for matrix multiplication"); they
    # become unknown dims again (shape annotations only: the computation is unchanged).
    cleared = _clear_zero_dims(list(model.graph.value_info) + list(model.graph.output))
    if cleared:
        fixups.append(f"cleared {cleared} zero-sized dims in value_info/graph outputs")
    if fixups:
        onnx.save(model, path)
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001
        raise Failure(f"Quark wrote a model onnxruntime {ort.__version__} cannot load: {_one_line(error)}", 1) from None
    return fixups


@contextlib.contextmanager
def _quiet(log_path: str):
    """Send everything written to fds 1 and 2 (Python, C++ and child processes) to log_path; yield writers
    for the real stdout/stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    log = open(log_path, "ab")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    real_out = os.fdopen(os.dup(saved_out), "w")
    real_err = os.fdopen(os.dup(saved_err), "w")
    try:
        yield real_out, real_err
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        log.close()
        real_out.close()
        real_err.close()


def quantize(args, real_out) -> None:
    files = _calibration_files(args.calib)
    import onnx

    try:
        model = onnx.load(args.model, load_external_data=False)
    except Exception as error:  # noqa: BLE001 - any load failure is one line
        raise Failure(f"cannot load {args.model!r}: {_one_line(error)}", 2) from None
    initializers = {init.name for init in model.graph.initializer}
    _check_feeds(files, [i.name for i in model.graph.input if i.name not in initializers])
    del model

    try:
        import quark
        import quark.onnx  # noqa: F401 - compiles Quark's custom ops on first import
        from quark.onnx import ModelQuantizer
    except Exception as error:  # noqa: BLE001
        raise Failure(f"cannot import amd-quark: {_one_line(error)}", 1) from None
    version = getattr(quark, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("amd-quark")

    config = _qconfig(args.variant, args.per_channel, args.adaround_iterations)
    described = _describe(config)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    partial = os.path.join(out_dir, f".{os.path.basename(args.out)}.partial.onnx")
    start = time.perf_counter()
    try:
        ModelQuantizer(config).quantize_model(args.model, partial, calibration_data_reader=_reader(files))
    except BaseException as error:  # noqa: BLE001 - Quark's failure (or SIGTERM), reported in one line
        with contextlib.suppress(OSError):
            os.remove(partial)
        if isinstance(error, Failure):
            raise
        raise Failure(f"{type(error).__name__}: {_one_line(error)}", 1) from None
    seconds = time.perf_counter() - start
    if not os.path.exists(partial):
        raise Failure("Quark returned without writing a model", 1)
    try:
        fixups = _fix_up(partial)
    except Failure:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
    os.replace(partial, args.out)
    record = {
        "variant": args.variant,
        "seconds": round(seconds, 3),
        "quark_version": version,
        "config": described,
        "per_channel": bool(args.per_channel),
        "calibration_feeds": len(files),
        "fixups": fixups,
    }
    if args.variant == "adaround":
        record["adaround_iterations"] = args.adaround_iterations
    real_out.write(json.dumps(record, sort_keys=True) + "\n")
    real_out.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--calib", required=True, help="folder of .npz feeds")
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    parser.add_argument("--per-channel", action="store_true", help="per-output-channel weights")
    parser.add_argument("--adaround-iterations", type=int, default=ADAROUND_ITERATIONS)
    parser.add_argument("--log", help="where Quark's own output goes (default: a temporary file)")
    args = parser.parse_args(argv)
    for name in ("model", "calib", "out", "log"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))

    if args.log:
        log_path, keep = args.log, True
    else:
        handle, log_path = tempfile.mkstemp(prefix=f"quark-{args.variant}-", suffix=".log")
        os.close(handle)
        keep = False
    code, message = 0, None

    def terminated(signum, frame):  # a caller's timeout: still clean up and say why in one line
        raise Failure(f"terminated by signal {signum} after {time.perf_counter() - started:.0f} s", 1)

    started = time.perf_counter()
    signal.signal(signal.SIGTERM, terminated)
    # Quark writes files into the working directory (quantized_info.csv): it runs in a scratch one.
    cwd, scratch = os.getcwd(), tempfile.mkdtemp(prefix="quark-work-")
    with _quiet(log_path) as (real_out, real_err):
        try:
            os.chdir(scratch)
            quantize(args, real_out)
        except Failure as failure:
            code, message = failure.code, str(failure)
        except BaseException as error:  # noqa: BLE001 - even SystemExit from inside Quark is one line
            code, message = 1, f"{type(error).__name__}: {_one_line(error)}"
        if message is not None:
            if code == 1:
                keep = True
                message += f" (Quark log: {log_path})"
            real_err.write(f"{args.variant}: {message}\n")
            real_err.flush()
    os.chdir(cwd)
    shutil.rmtree(scratch, ignore_errors=True)
    if not keep:
        with contextlib.suppress(OSError):
            os.remove(log_path)
    return code


if __name__ == "__main__":
    sys.exit(main())
