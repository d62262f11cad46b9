"""The verifier: run onnxruntime on a model before and after optimization and prove they agree.

For every requested execution provider (``cpu``, ``cuda``) it compares every output (shape,
dtype, max absolute and relative error, mean and 99th percentile of the absolute error, cosine
similarity, elements out of tolerance, NaN/Inf mismatches), counts the kernels onnxruntime's
profiler records per run (by op type, by provider, Memcpy nodes), and times both models
(interleaved runs after a warm-up: median, 90th percentile, after/before ratio). With CPU and
CUDA both requested it also compares each model's CPU outputs with its CUDA outputs.

When outputs differ it finds the culprit: the first value, in the optimized graph's order,
present in both graphs by name, whose values diverge; the node that produced it, and the rule
that created that node (``onnxopt.rule`` provenance). :func:`bisect` goes further: it replays the
driver's rewrites and binary-searches the first one after which verification fails.

This module knows no command line; ``onnxopt.cli`` and ``scripts/bench.py`` use it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from . import io
from .irutil import REPLACED_KEY as _REPLACED, RULE_KEY as _RULE, SOURCES_KEY as _SOURCES
from .errors import InvalidModelError, OnnxoptError, UsageError
from .shapes import PLACEHOLDER_DIMS

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}

# Default tolerances by output dtype: (rtol, atol); an element passes when
# |after - before| <= atol + rtol * |before| (numpy.isclose's rule).
TOLERANCES = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
    "int8": (0.0, 1.0),  # one quantization step
    "uint8": (0.0, 1.0),
}
EXACT = (0.0, 0.0)  # every other dtype (integers, bool, strings): exact
LOW_PRECISION = (1e-2, 1e-3)  # float32/64 outputs of a model that computes in fp16/bf16/int8
_LOW_PRECISION_TYPES = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT8,
                        onnx.TensorProto.UINT8}
_QUANT_OPS = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
              "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul", "MatMulNBits", "QAttention"}


class VerificationError(OnnxoptError):
    """The optimized model's outputs differ from the original's beyond tolerance."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


class VerifyUnavailable(OnnxoptError):
    """onnxruntime (or the requested execution provider) is not installed."""


# --- models -----------------------------------------------------------------------------------


class _Model:
    """One model for onnxruntime: its file (external data resolves beside it), or serialized bytes
    when it is in memory; a model too large to serialize, or in memory with weights in external
    files, is written to a temporary directory, removed by :meth:`close`."""

    def __init__(self, source, label: str):
        self.label = label
        self.name = str(source) if isinstance(source, (str, os.PathLike)) else label  # for reports
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.path: str | None = None
        self.external = False  # weights in files beside ``path``
        if isinstance(source, (str, os.PathLike)):
            # validated as optimize() validates its input: not ONNX, truncated, invalid, missing data
            self.proto, self.external = io.read_checked(source, what=f"{label} model {source}")
            self.path = str(source)
            return
        import onnx_ir as ir

        if isinstance(source, bytes):
            source, _ = io.read_checked(source, what=f"{label} model")
        if isinstance(source, onnx.ModelProto):
            if io.check_external_data(source, Path("."), f"{label} model"):  # (as io.load resolves them)
                source = io.to_ir(source)
            else:
                self.proto = source
        if isinstance(source, ir.Model):
            if io.external_data_files(source) or io.initializer_bytes(source) >= io.PROTO_LIMIT:
                io.clamp_ir_version(source)
                self._save(lambda path: ir.save(source, path, external_data="model.onnx.data"))
                return
            self.proto = io.to_proto(source)
        elif not isinstance(source, onnx.ModelProto):
            raise UsageError(f"{label}: expected a path, bytes, onnx.ModelProto or onnx_ir.Model")
        if self.proto.ByteSize() >= io.PROTO_LIMIT:
            proto = self.proto
            self._save(lambda path: onnx.save(proto, path, save_as_external_data=True, location="model.onnx.data"))

    def _dir(self) -> str:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="onnxopt-verify-")
        return self._tmp.name

    def _save(self, write) -> None:
        """Write the model into the temporary directory with external data, and use that file."""
        self.path = os.path.join(self._dir(), "model.onnx")
        write(self.path)
        self.proto = onnx.load(self.path, load_external_data=False)
        self.external = True

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def source(self):
        return self.path if self.path is not None else self.proto.SerializeToString()

    def with_outputs(self, names: Sequence[str], types: Mapping[str, onnx.TypeProto]) -> bytes | str:
        """The model with extra graph outputs (values of the main graph), for onnxruntime: bytes
        (weights loaded from external files when they fit), else a file in the temporary directory."""
        if self.external:
            proto = onnx.load(self.path)  # with its weights, read from beside the file
        else:
            proto = onnx.ModelProto()
            proto.CopyFrom(self.proto)
        have = {o.name for o in proto.graph.output}
        for name in names:
            if name not in have:
                vi = proto.graph.output.add()
                vi.name = name
                vi.type.CopyFrom(types[name])
        if proto.ByteSize() < io.PROTO_LIMIT:
            return proto.SerializeToString()
        path = os.path.join(self._dir(), "exposed.onnx")
        onnx.save(proto, path, save_as_external_data=True, location="exposed.onnx.data")
        return path


def _ort():
    ort = io.onnxruntime_module()
    if ort is None:
        raise VerifyUnavailable("onnxruntime is not installed (pip install 'onnxopt[ort]', or onnxruntime-gpu)")
    return ort


def parse_providers(text: str | Sequence[str] | bool | None) -> list[str]:
    if text is None or text is True:
        return ["cpu"]
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in (i.strip().lower() for i in items):
        item = {"cpuexecutionprovider": "cpu", "cudaexecutionprovider": "cuda"}.get(item, item)
        if item not in PROVIDERS:
            raise UsageError(f"unknown provider {item!r} (choose from {', '.join(PROVIDERS)})")
        if item not in out:
            out.append(item)
    if not out:
        raise UsageError("no provider given")
    return out


def check_providers(providers: Sequence[str]) -> None:
    available = _ort().get_available_providers()
    for p in providers:
        if PROVIDERS[p] not in available:
            raise VerifyUnavailable(f"{PROVIDERS[p]} is not available in this onnxruntime "
                                    f"({', '.join(available)}); for cuda install onnxruntime-gpu")


# CUDA sessions whose outputs are compared run without TF32 (onnxruntime's CUDA EP uses it by
# default for float32 MatMul/Conv): its 10-bit mantissa makes two runs of the same computation
# with regrouped weights differ by ~1e-3, which would hide what the optimizer did.
EXACT_CUDA_OPTIONS = {"use_tf32": "0"}


def session(model, provider: str = "cpu", *, profile_prefix: str | None = None, threads: int = 0,
            optimization: str | None = None, exact: bool = False):
    """An onnxruntime session on one provider (CUDA sessions fall back to CPU for what CUDA lacks);
    ``exact``: CUDA without TF32 (for comparing outputs; latency runs with the defaults)."""
    ort = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 4  # fatal only: failures come back as exceptions, reported in one line
    if threads:
        so.intra_op_num_threads = threads
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if optimization == "disable":
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    names = [PROVIDERS[provider]] + (["CPUExecutionProvider"] if provider != "cpu" else [])
    if provider == "cuda" and exact:
        names = [(names[0], dict(EXACT_CUDA_OPTIONS)), *names[1:]]
    return ort.InferenceSession(model, so, providers=names)


# --- inputs -----------------------------------------------------------------------------------


_INT = re.compile(r"-?[0-9]+")
_INT64_MAX = 2**63 - 1


def _parse_entries(items: Iterable[str], flag: str, parse: Callable[[str], object | None], form: str) -> dict:
    """``NAME=VALUE`` entries, each name once; ``parse`` gives the value or None when malformed."""
    out = {}
    for item in items:
        name, sep, text = item.rpartition("=")
        value = parse(text) if sep and name else None
        if value is None:
            raise UsageError(f"{flag} {item!r}: expected {form}")
        if name in out:
            raise UsageError(f"{flag} {name}: given twice")
        out[name] = value
    return out


def _dims_or_none(text: str) -> list[int] | None:
    parts = re.split(r"[x,]", text) if text else []
    if not all(_INT.fullmatch(p) and 0 <= int(p) <= _INT64_MAX for p in parts):
        return None
    return [int(p) for p in parts]


def parse_input_shapes(items: Iterable[str]) -> dict[str, list[int]]:
    """``NAME=1x3x224x224`` (or ``NAME=1,3,224,224``; ``NAME=`` for a scalar) entries: whole
    numbers that fit ONNX's int64 dimensions, separated by single x or commas."""
    return _parse_entries(items, "--input-shape", _dims_or_none,
                          "NAME=D1xD2x... with each D a whole number up to 2**63-1 (e.g. input=1x3x224x224)")


def _range_or_none(text: str) -> tuple[int, int] | None:
    lo, colon, hi = text.partition(":")
    if not (colon and _INT.fullmatch(lo) and _INT.fullmatch(hi)) or int(lo) > int(hi):
        return None
    return int(lo), int(hi)


def parse_int_ranges(items: Iterable[str]) -> dict[str, tuple[int, int]]:
    """``NAME=LOW:HIGH`` entries (inclusive, LOW <= HIGH): the values generated for an integer input."""
    return _parse_entries(items, "--int-range", _range_or_none,
                          "NAME=LOW:HIGH with whole numbers, LOW <= HIGH (inclusive), e.g. input_ids=0:30521")


def _gather_bounds(proto: onnx.ModelProto) -> dict[str, int]:
    """Graph inputs used directly as Gather indices into a constant table: the table's size
    along that axis (token ids into an embedding matrix)."""
    shapes = {i.name: list(i.dims) for i in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            shapes[node.output[0]] = list(node.attribute[0].t.dims)
    inputs = {i.name for i in proto.graph.input}
    bounds: dict[str, int] = {}
    for node in proto.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[1] not in inputs:
            continue
        table = shapes.get(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if table is None or not table:
            continue
        n = table[axis % len(table)]
        bounds[node.input[1]] = min(n, bounds.get(node.input[1], n))
    return bounds


def _generated_dtype(elem_type: int) -> type | None:
    """The numpy type of an input that can be generated (numpy's own floats, integers, bool), else None."""
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError):
        return None
    return dtype.type if dtype.kind in "fiub" else None


def _load_npz(path) -> dict[str, np.ndarray]:
    """The arrays of an .npz file by name; anything else (an .npy file, an empty, truncated or
    corrupted file, pickled objects) is refused in one line."""
    try:
        with open(path, "rb") as f:
            is_zip = f.read(2) == b"PK"
        if is_zip:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            # (numpy gives a member that is not an .npy array as its raw bytes)
            raw = next((k for k, v in arrays.items() if not isinstance(v, np.ndarray)), None)
            if raw is None:
                return arrays
            raise UsageError(f"inputs file {path}: member {raw!r} is not a numpy array (.npy)")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise UsageError(f"inputs file {path}: {io.first_line(exc, 200)}") from None
    raise UsageError(f"inputs file {path}: not an .npz archive (write one with numpy.savez(path, input_name=array, "
                     "...); a single .npy array names no input)")


def _check_shape(vi: onnx.ValueInfoProto, shape: list[int], what: str) -> None:
    """``shape`` has the rank of input ``vi`` and the dimensions it fixes."""
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return
    if len(shape) != len(tt.shape.dim):
        raise UsageError(f"{what}: shape {_dims(shape)} has rank {len(shape)}, the model's input has rank "
                         f"{len(tt.shape.dim)}")
    for d, v in zip(tt.shape.dim, shape):
        if d.HasField("dim_value") and d.dim_value >= 0 and d.dim_value != v:
            raise UsageError(f"{what}: dimension {v} where the model fixes {d.dim_value}")


GENERATED_INPUT_LIMIT = 4 << 30  # bytes: a declared shape that needs more is refused, not allocated


def make_inputs(model, *, shapes: Mapping[str, Sequence[int]] | None = None,
                int_ranges: Mapping[str, tuple[int, int]] | None = None, npz: str | os.PathLike | None = None,
                seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """Inputs for every graph input of ``model`` (path, proto or onnx_ir model), and how each was made.

    From ``npz`` where it has the input; otherwise generated, the same for the same seed:
    floats from a standard normal distribution, integers uniformly in a valid range (the user's
    ``int_ranges``; else 0..n-1 for an input that indexes a Gather table of n rows, 0..1 for a
    name containing "mask", 0..9 otherwise), bools 0/1. Dynamic dimensions: from ``shapes``
    (per input), then the same named symbol elsewhere, else 1 on the first axis and 16 on others.
    """
    proto = model.proto if isinstance(model, _Model) else _Model(model, "model").proto
    shapes = dict(shapes or {})
    int_ranges = dict(int_ranges or {})
    inits = {i.name for i in proto.graph.initializer}
    graph_inputs = [i for i in proto.graph.input if i.name not in inits]
    known = {i.name for i in graph_inputs}
    for name in [*shapes, *int_ranges]:
        if name not in known:
            raise UsageError(f"the model has no input {name!r} (inputs: {', '.join(sorted(known)) or 'none'})")
    given = _load_npz(npz) if npz is not None else {}
    if npz is not None:
        extra = sorted(set(given) - known)
        if extra:
            raise UsageError(f"inputs file {npz} has {', '.join(extra)}, which the model does not take")
    symbols: dict[str, int] = {}
    for vi in graph_inputs:  # symbols fixed by the shapes the user gave (or the npz arrays)
        dims = vi.type.tensor_type.shape.dim
        fixed = shapes.get(vi.name) or (list(given[vi.name].shape) if vi.name in given else None)
        if fixed is not None and len(fixed) == len(dims):
            for d, v in zip(dims, fixed):
                if d.dim_param and d.dim_param not in PLACEHOLDER_DIMS:
                    symbols.setdefault(d.dim_param, v)
    bounds = _gather_bounds(proto)
    if seed < 0:
        raise UsageError(f"seed {seed}: must not be negative")
    rng = np.random.default_rng(seed)
    feeds, how = {}, {}
    for vi in graph_inputs:
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise UsageError(f"input {vi.name!r} is not a tensor: the verifier makes and reads tensor inputs only "
                             "(from Python, give it in verify(feeds=...))")
        dtype = _generated_dtype(tt.elem_type)
        if vi.name in given:
            arr = given[vi.name]
            if dtype is not None and arr.dtype != dtype:
                raise UsageError(f"input {vi.name!r} in {npz} is {arr.dtype}, the model takes {np.dtype(dtype)}")
            _check_shape(vi, list(arr.shape), f"input {vi.name!r} in {npz}")
            feeds[vi.name] = arr
            how[vi.name] = {"source": "npz", "shape": list(arr.shape), "dtype": str(arr.dtype)}
            continue
        if dtype is None:
            raise UsageError(f"input {vi.name!r} has type {onnx.TensorProto.DataType.Name(tt.elem_type)}, "
                             "which is not generated; give it in an .npz file")
        if not tt.HasField("shape") and vi.name not in shapes:
            raise UsageError(f"input {vi.name!r} has no declared shape: give it with --input-shape "
                             f"{vi.name}=D1xD2... (or in an .npz file)")
        if vi.name in shapes:
            shape = list(shapes[vi.name])
            _check_shape(vi, shape, f"--input-shape {vi.name}")
        else:
            shape = []
            for k, d in enumerate(tt.shape.dim):
                if d.HasField("dim_value") and d.dim_value >= 0:  # (some exporters write -1 for "unknown")
                    shape.append(d.dim_value)
                elif d.dim_param and d.dim_param in symbols:
                    shape.append(symbols[d.dim_param])
                else:
                    v = 1 if k == 0 else 16
                    if d.dim_param and d.dim_param not in PLACEHOLDER_DIMS:
                        symbols[d.dim_param] = v
                    shape.append(v)
        if vi.name in int_ranges and not np.issubdtype(dtype, np.integer):
            raise UsageError(f"--int-range {vi.name}: the input is {np.dtype(dtype)}, not an integer type")
        info = {"source": "generated", "shape": shape, "dtype": str(np.dtype(dtype))}
        if np.issubdtype(dtype, np.integer):
            if vi.name in int_ranges:
                lo, hi = int_ranges[vi.name]
            elif vi.name in bounds:
                lo, hi = 0, bounds[vi.name] - 1
            elif "mask" in vi.name.lower():
                lo, hi = 0, 1
            else:
                lo, hi = 0, 9
            limits = np.iinfo(dtype)
            if lo < limits.min or hi > limits.max or lo > hi:
                raise UsageError(f"integer range {lo}..{hi} of input {vi.name!r} does not fit its type {np.dtype(dtype)}")
            info["range"] = [lo, hi]
        count = int(np.prod(shape, dtype=object))  # (exact: no int64 wrap-around)
        if count * 8 > GENERATED_INPUT_LIMIT:  # (drawn as float64/int64 first)
            raise UsageError(f"input {vi.name!r}: a generated array of shape {_dims(shape)} would take "
                             f"{count * 8} bytes, over {GENERATED_INPUT_LIMIT}; give --input-shape or --inputs")
        try:
            if np.issubdtype(dtype, np.floating):
                arr = rng.standard_normal(shape).astype(dtype)
                info["distribution"] = "normal(0, 1)"
            elif dtype == np.bool_:
                arr = rng.integers(0, 2, shape).astype(np.bool_)
            else:
                arr = rng.integers(lo, hi, shape, endpoint=True, dtype=dtype)
        except (ValueError, MemoryError) as exc:  # a shape too large for numpy or for memory
            raise UsageError(f"input {vi.name!r}: cannot make an array of shape {_dims(shape)}: "
                             f"{io.first_line(exc, 200)}") from None
        feeds[vi.name] = arr
        how[vi.name] = info
    return feeds, how


# --- comparing outputs ------------------------------------------------------------------------


def is_low_precision(proto: onnx.ModelProto) -> bool:
    """The model computes in fp16/bf16 or int8: weights of those types (initializers or Constant
    nodes), Casts to them (mixed-precision exports) or quantization ops."""
    if any(i.data_type in _LOW_PRECISION_TYPES for i in proto.graph.initializer):
        return True
    for n in proto.graph.node:
        if n.op_type in _QUANT_OPS:
            return True
        for a in n.attribute:
            if (n.op_type == "Constant" and a.name == "value" and a.t.data_type in _LOW_PRECISION_TYPES) or (
                    n.op_type == "Cast" and a.name == "to" and a.i in _LOW_PRECISION_TYPES):
                return True
    return False


def check_tolerances(rtol: float | None, atol: float | None) -> None:
    for name, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and not (np.isfinite(v) and v >= 0):
            raise UsageError(f"--{name} {v}: must be a finite number, not negative")


def tolerance(dtype: str, low_precision: bool = False, rtol: float | None = None,
              atol: float | None = None) -> tuple[float, float, str]:
    """(rtol, atol, where they come from) for an output of ``dtype``."""
    if low_precision and dtype in ("float32", "float64"):
        base, why = LOW_PRECISION, f"{dtype} output of a fp16/bf16/int8 model"
    elif dtype in TOLERANCES:
        base, why = TOLERANCES[dtype], f"default for {dtype}"
    else:
        base, why = EXACT, f"exact for {dtype}"
    if rtol is not None or atol is not None:
        why = "given"
    return (base[0] if rtol is None else rtol), (base[1] if atol is None else atol), why


def _kind(dtype: np.dtype) -> str:
    """"float" (numpy's floats and ml_dtypes' bfloat16/float8/float4), "int" (integers, bool,
    int4/uint4) or "other" (strings, objects): how values of ``dtype`` are compared."""
    if dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("float", "bfloat"))):
        return "float"
    if dtype.kind in "iub" or (dtype.kind == "V" and dtype.name.startswith(("int", "uint"))):
        return "int"
    return "other"


def _item(v):
    """A JSON-ready Python value of one element."""
    v = v.item() if hasattr(v, "item") else v
    return v if isinstance(v, (bool, int, float, str)) else float(v) if np.isreal(v) else str(v)


@np.errstate(all="ignore")  # overflowing differences and non-finite values are handled explicitly
def compare(before: np.ndarray, after: np.ndarray, rtol: float, atol: float) -> dict:
    """Statistics of ``after`` against ``before``; ``ok`` when shapes and dtypes match and every
    element is within tolerance (|after - before| <= atol + rtol * |before|).

    Equal values pass (-0 equals 0, as IEEE has it); NaN must meet NaN and an infinity the same
    infinity. Any other pair with a NaN or an infinity is a non-finite mismatch: counted
    (``nan_mismatch``, ``inf_mismatch``), and it makes ``max_abs``/``max_rel`` NaN (a NaN on one
    side only) or inf, never hidden. ``mean_abs``, ``p99_abs`` and ``cosine`` are over the pairs
    where both are finite (``cosine`` is None when there are non-finite mismatches). ``example``
    is the first non-finite mismatch, else the largest difference out of tolerance."""
    out: dict = {"shape_before": list(before.shape), "shape_after": list(after.shape),
                 "dtype_before": before.dtype.name, "dtype_after": after.dtype.name, "rtol": rtol, "atol": atol}
    if before.shape != after.shape:
        out.update(ok=False, problem=f"shape {_dims(before.shape)} in the original, {_dims(after.shape)} now")
        return out
    if before.dtype != after.dtype:
        out.update(ok=False, problem=f"dtype {before.dtype.name} in the original, {after.dtype.name} now")
        return out
    n = int(before.size)
    out["elements"] = n
    kind = _kind(before.dtype)
    nonfinite = np.zeros(before.shape, bool)
    if kind == "other":  # strings, objects: equal or not
        bad = np.asarray(before != after, bool)
        d = rel = np.zeros(before.shape)
    elif kind == "int":  # exact arithmetic (int64 does not fit float64)
        wide = object if before.dtype.itemsize == 8 else np.int64
        a, b = before.astype(wide), after.astype(wide)
        d = np.abs(a - b).astype(np.float64)
        ref = np.abs(before.astype(np.float64))
        bad = (a != b) & (d > atol + rtol * ref)
        rel = d / np.maximum(np.maximum(ref, np.abs(after.astype(np.float64))), 1)
        d_finite = d
    else:
        a, b = before.astype(np.float64), after.astype(np.float64)
        nan_a, nan_b, inf_a, inf_b = np.isnan(a), np.isnan(b), np.isinf(a), np.isinf(b)
        finite = ~(nan_a | nan_b | inf_a | inf_b)
        nonfinite = ~finite & ~((a == b) | (nan_a & nan_b))
        nan_mismatch = int(np.count_nonzero(nan_a != nan_b))
        out.update(nan_before=int(nan_a.sum()), nan_after=int(nan_b.sum()), inf_before=int(inf_a.sum()),
                   inf_after=int(inf_b.sum()), nan_mismatch=nan_mismatch,
                   inf_mismatch=int(np.count_nonzero(nonfinite)) - nan_mismatch)
        d = np.where(finite, np.abs(a - b), 0.0)  # inf where two finite values are too far apart for float64
        ref = np.abs(a)
        bad = nonfinite | (finite & (d > atol + rtol * ref))
        # relative to the larger magnitude of the two: 2 at most (a sign flip), never 1e307 at a zero
        rel = np.where(d == 0, 0.0, d / np.maximum(np.maximum(ref, np.abs(b)), np.finfo(np.float64).tiny))
        av, bv = a[finite], b[finite]
        if nonfinite.any():
            out["cosine"] = None
        elif av.size:
            scale = max(float(np.abs(av).max()), float(np.abs(bv).max()))
            if scale > 0:  # scaled first: no overflow for values near the float64 limit
                av, bv = av / scale, bv / scale
            na, nb = float(np.linalg.norm(av)), float(np.linalg.norm(bv))
            cosine = 1.0 if na == nb == 0 else (float(av @ bv) / (na * nb) if na and nb else 0.0)
            out["cosine"] = min(1.0, max(-1.0, cosine))
        else:
            out["cosine"] = 1.0
        d_finite = d[finite]
    if kind != "other":
        out.update(max_abs=float(d.max()) if n else 0.0, max_rel=float(rel.max()) if n else 0.0,
                   mean_abs=float(d_finite.mean()) if d_finite.size else 0.0,
                   p99_abs=float(np.percentile(d_finite, 99)) if d_finite.size else 0.0)
        if out["p99_abs"] != out["p99_abs"]:  # interpolating between differences beyond float64
            out["p99_abs"] = float("inf")
        if out.get("nan_mismatch"):
            out.update(max_abs=float("nan"), max_rel=float("nan"))
        elif out.get("inf_mismatch"):
            out.update(max_abs=float("inf"), max_rel=float("inf"))
    out_tol = int(np.count_nonzero(bad))
    if out_tol:
        flat_nonfinite = nonfinite.ravel()
        first = bool(flat_nonfinite.any()) or kind == "other"
        k = int(np.argmax(flat_nonfinite if flat_nonfinite.any() else np.where(bad.ravel(), d.ravel(), -1.0)))
        out["example"] = {"index": [int(i) for i in np.unravel_index(k, before.shape)],
                          "before": _item(before.ravel()[k]), "after": _item(after.ravel()[k]),
                          "which": ("first non-finite mismatch" if flat_nonfinite.any() else
                                    "first difference" if first else "largest difference")}
    out["out_of_tolerance"] = out_tol
    out["ok"] = out_tol == 0
    return out


def _dims(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _value_kind(v) -> str:
    return ("sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else
            "empty optional" if v is None else "tensor")


def _host(v):
    """An onnxruntime output as compared: an array, a list (a sequence), a dict (a map) or None."""
    if isinstance(v, (list, tuple)):
        return [_host(x) for x in v]
    if isinstance(v, dict):
        return v
    return None if v is None else np.asarray(v)


def _worst(values: list) -> float:
    return float("nan") if any(v != v for v in values) else max(values, default=0.0)


def compare_value(before, after, *, low_precision: bool = False, rtol: float | None = None,
                  atol: float | None = None) -> dict:
    """One output of any kind onnxruntime returns: a tensor (:func:`compare`, with the dtype's
    tolerance), a sequence (same length, each element compared), a map (same keys, values
    compared; float values as float32, the type of ZipMap's) or an empty optional (None)."""
    kb, ka = _value_kind(before), _value_kind(after)
    if kb != ka:
        return {"ok": False, "problem": f"a {kb} in the original, a {ka} now"}
    if kb == "tensor":
        r, t, why = tolerance(before.dtype.name, low_precision, rtol, atol)
        return {**compare(before, after, r, t), "tolerance": why}
    if kb == "empty optional":
        return {"ok": True, "elements": 0}
    if kb == "map":
        if sorted(before, key=repr) != sorted(after, key=repr):
            return {"ok": False, "problem": "the map's keys differ"}
        keys = sorted(before, key=repr)
        as_array = lambda m: np.asarray([m[k] for k in keys], np.float32 if all(  # noqa: E731
            isinstance(m[k], float) for k in keys) else None)
        return {"kind": "map", **compare_value(as_array(before), as_array(after), low_precision=low_precision,
                                               rtol=rtol, atol=atol)}
    if len(before) != len(after):
        return {"ok": False, "kind": "sequence",
                "problem": f"a sequence of {len(before)} in the original, of {len(after)} now"}
    parts = [compare_value(b, a, low_precision=low_precision, rtol=rtol, atol=atol) for b, a in zip(before, after)]
    row = {"kind": "sequence", "length": len(parts), "elements": sum(p.get("elements", 0) for p in parts),
           "out_of_tolerance": sum(p.get("out_of_tolerance", 0) for p in parts),
           "max_abs": _worst([p["max_abs"] for p in parts if "max_abs" in p]),
           "max_rel": _worst([p["max_rel"] for p in parts if "max_rel" in p]),
           "ok": all(p["ok"] for p in parts)}
    bad = next((k for k, p in enumerate(parts) if not p["ok"]), None)
    if bad is not None:
        row["problem"] = f"element {bad}: {problem_text(parts[bad])}"
    return row


def compare_all(before: Sequence[tuple[str, object]], after: Sequence[tuple[str, object]], *,
                low_precision: bool = False, rtol: float | None = None, atol: float | None = None) -> list[dict]:
    """One row per output, matched by name and position (a caller may fetch outputs either way):
    an output missing, at another position or added fails."""
    names_before = [name for name, _ in before]
    names_after = [name for name, _ in after]
    rows = []
    for i, (name, value) in enumerate(before):
        j = names_after.index(name) if name in names_after else None
        if j is None:
            now = f" (output {i} is now {names_after[i]!r})" if i < len(after) else ""
            rows.append({"name": name, "ok": False, "problem": f"missing in the optimized model{now}"})
        elif j != i:
            rows.append({"name": name, "ok": False, "problem": f"output {i} in the original, output {j} now"})
        else:
            rows.append({"name": name, **compare_value(value, after[j][1], low_precision=low_precision, rtol=rtol,
                                                       atol=atol)})
    rows += [{"name": name, "ok": False, "problem": f"output {j} of the optimized model, not in the original"}
             for j, name in enumerate(names_after) if name not in names_before]
    return rows


def _number(x) -> str:
    return f"{x:.7g}" if isinstance(x, float) else repr(x)


def problem_text(row: dict) -> str:
    """What is wrong with one compared output, in words."""
    if row.get("problem"):
        return row["problem"]
    text = f"{row.get('out_of_tolerance')}/{row.get('elements')} elements out of tolerance"
    nonfinite = row.get("nan_mismatch", 0) + row.get("inf_mismatch", 0)
    if nonfinite:
        text += f" ({nonfinite} non-finite: {row.get('nan_mismatch', 0)} NaN, {row.get('inf_mismatch', 0)} inf)"
    ex = row.get("example")
    if ex:
        text += (f", {ex['which']}: {_number(ex['before'])} vs {_number(ex['after'])} "
                 f"at [{', '.join(map(str, ex['index']))}]")
    if "max_abs" in row:
        text += f"; max abs {_fmt(row['max_abs'])}, max rel {_fmt(row['max_rel'])}"
    return text


# --- kernels and latency ----------------------------------------------------------------------


def count_kernels(events: list[dict]) -> dict:
    """Kernels of the last run in an onnxruntime profile: Node events ending in "_kernel_time"
    that start inside the last "model_run" event (if none, all kernel events)."""
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    kernels = [e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]
    if runs:
        last = max(runs, key=lambda e: e["ts"])
        lo, hi = last["ts"], last["ts"] + last.get("dur", 0)
        kernels = [e for e in kernels if lo <= e["ts"] <= hi]
    by_op: Counter = Counter()
    by_provider: Counter = Counter()
    for e in kernels:
        args = e.get("args", {})
        by_op[args.get("op_name", "?")] += 1
        by_provider[args.get("provider", "?")] += 1
    return {
        "kernels": len(kernels),
        "by_op": dict(sorted(by_op.items())),
        "by_provider": dict(sorted(by_provider.items())),
        "memcpy": sum(n for op, n in by_op.items() if op.startswith("Memcpy")),
        "runs_in_profile": len(runs),
    }


def run_profiled(model, feeds: Mapping[str, np.ndarray], provider: str = "cpu", warmup: int = 1,
                 threads: int = 0) -> tuple[list[tuple[str, np.ndarray]], dict, float]:
    """Outputs, kernel counts of one profiled run (after ``warmup`` runs) and session-creation seconds."""
    with tempfile.TemporaryDirectory(prefix="onnxopt-prof-") as tmp:
        t0 = time.perf_counter()
        sess = session(model, provider, profile_prefix=os.path.join(tmp, "p"), threads=threads, exact=True)
        init_s = time.perf_counter() - t0
        feeds = {i.name: feeds[i.name] for i in sess.get_inputs()}
        for _ in range(max(0, warmup)):
            sess.run(None, feeds)
        outs = sess.run(None, feeds)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    names = [o.name for o in sess.get_outputs()]
    return [(n, _host(v)) for n, v in zip(names, outs)], count_kernels(events), init_s


def measure_latency(models: dict[str, object], inputs: Mapping[str, np.ndarray], *, provider: str = "cpu",
                    runs: int = 50, warmup: int = 5, budget_s: float = 120.0, min_rounds: int = 5,
                    gap_s: float = 0.002, threads: int = 0,
                    progress: Callable[[int, int], None] | None = None) -> dict:
    """One session per entry, warmed up, then ``runs`` interleaved rounds (fewer when the rounds
    would pass ``budget_s``, but at least ``min_rounds``); each round times one run of every
    session, the order rotated by one per round."""
    sessions, feeds, errors = {}, {}, {}
    for name, model in models.items():
        try:
            sess = session(model, provider, threads=threads)
            feeds[name] = {i.name: inputs[i.name] for i in sess.get_inputs()}
            sessions[name] = sess
        except Exception as exc:  # noqa: BLE001 - one broken model must not stop the others
            errors[name] = io.first_line(exc, 300)
    per_run = {}
    for name, sess in list(sessions.items()):
        try:
            for _ in range(max(1, warmup)):
                t0 = time.perf_counter()
                sess.run(None, feeds[name])
                per_run[name] = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001
            errors[name] = io.first_line(exc, 300)
            del sessions[name]
    names = list(sessions)
    est = sum(per_run[n] + gap_s for n in names) or 1e-9
    rounds = max(min(runs, min_rounds), min(runs, int(budget_s / est)))
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            sessions[name].run(None, feeds[name])
            times[name].append(time.perf_counter() - t0)
        if progress is not None:
            progress(r + 1, rounds)
    out: dict = {"rounds": rounds, "warmup": warmup, "errors": errors, "results": {}}
    for name, ts in times.items():
        ms = [t * 1e3 for t in ts]
        out["results"][name] = {"median_ms": statistics.median(ms), "p90_ms": float(np.percentile(ms, 90)),
                                "min_ms": min(ms), "mean_ms": statistics.fmean(ms),
                                "times_ms": [round(x, 4) for x in ms]}
    return out


# --- the culprit ------------------------------------------------------------------------------


def _value_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Tensor types of the main graph's values and weights (declared, else from onnx's shape
    inference), for exposing them as outputs."""
    types: dict[str, onnx.TypeProto] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False)
        infos = list(inferred.graph.value_info) + list(inferred.graph.output)
    except Exception:  # noqa: BLE001 - inference is best effort here
        infos = []
    elem_types = [(vi.name, vi.type.tensor_type.elem_type) for vi in [*proto.graph.value_info, *proto.graph.output,
                                                                      *infos] if vi.type.HasField("tensor_type")]
    elem_types += [(i.name, i.data_type) for i in proto.graph.initializer]
    for name, elem_type in elem_types:
        if elem_type and name not in types:
            t = onnx.TypeProto()
            t.tensor_type.elem_type = elem_type  # shape left out: any shape
            types[name] = t
    return types


def _fetch(model: _Model, names: Iterable[str], types: Mapping[str, onnx.TypeProto],
           feeds: Mapping[str, np.ndarray], provider: str) -> dict:
    """The values ``names`` take in ``model``: graph inputs from ``feeds``, the others (those with
    a known type) exposed as outputs of one run with onnxruntime's graph optimizations off, so
    each value is the graph's own."""
    names = list(dict.fromkeys(names))
    values = {n: feeds[n] for n in names if n in feeds}
    wanted = [n for n in names if n not in feeds and n in types]
    if wanted:
        sess = session(model.with_outputs(wanted, types), provider, optimization="disable", exact=True)
        outs = sess.run(wanted, {i.name: feeds[i.name] for i in sess.get_inputs()})
        values.update(zip(wanted, map(_host, outs)))
    return values


def find_culprit(original: _Model, optimized: _Model, feeds: Mapping[str, np.ndarray], provider: str = "cpu", *,
                 low_precision: bool = False, rtol: float | None = None, atol: float | None = None) -> dict:
    """The first value of the optimized graph (in its node order) that the original graph also
    has by name and whose values differ beyond tolerance, the node that produced it, and, where
    the divergence can be tied to one, the rule to blame (see :func:`_tie`)."""
    opt_proto, orig_proto = optimized.proto, original.proto
    inits = {i.name for i in opt_proto.graph.initializer} | {i.name for i in orig_proto.graph.initializer}
    produced_orig = {o for n in orig_proto.graph.node for o in n.output if o}
    order, producer = [], {}
    for node in opt_proto.graph.node:
        for o in node.output:
            if o and o in produced_orig and o not in inits:
                order.append(o)
                producer[o] = node
    t_orig, t_opt = _value_types(orig_proto), _value_types(opt_proto)
    names = [n for n in order if n in t_orig and n in t_opt
             and t_orig[n].tensor_type.elem_type == t_opt[n].tensor_type.elem_type]
    result: dict = {"compared_values": len(names)}
    if not names:
        result["message"] = "the two graphs share no intermediate value names"
        return result
    before, after = _fetch(original, names, t_orig, feeds, provider), _fetch(optimized, names, t_opt, feeds, provider)

    def agree(a, b) -> bool:
        return compare_value(a, b, low_precision=low_precision, rtol=rtol, atol=atol)["ok"]

    for name in names:
        stats = compare_value(before[name], after[name], low_precision=low_precision, rtol=rtol, atol=atol)
        if not stats["ok"]:
            node = producer[name]
            result.update(value=name, stats=stats, node=_describe(node))
            result.update(_tie(original, optimized, node, (t_orig, t_opt), feeds, provider, agree))
            return result
    result["message"] = ("every shared intermediate value agrees; the difference arises in values the "
                         "optimized graph renamed or removed, or in onnxruntime's own graph optimizations")
    return result


def _tie(original: _Model, optimized: _Model, node: onnx.NodeProto, types: tuple[dict, dict],
         feeds: Mapping[str, np.ndarray], provider: str, agree: Callable[[object, object], bool]) -> dict:
    """Whether the rule behind ``node`` (the producer of the first diverging value) is to blame.

    It is when ``node`` was made by one rewrite of original nodes (its provenance: ``replaced``
    are original nodes) and every value that rewrite's nodes read agrees with a value the
    replaced nodes read in the original: the rewrite then computes a different value from the
    same inputs. Otherwise the result says what is known, without a rule: an input that now
    comes from elsewhere and differs (a rewrite upstream rerouted it and left no node: a rule
    that forwards a value, or a graph pass), a node made through several rewrites, an original
    node. :func:`bisect` then names the rewrite."""
    orig, opt = original.proto, optimized.proto
    meta = _meta(node)
    rule = meta.get(_RULE)
    replaced = _json_list(meta.get(_REPLACED)) if rule else [node.name]
    by_name: dict[str, list] = {}
    for n in orig.graph.node:
        by_name.setdefault(n.name, []).append(n)
    if rule and set(replaced) != set(_json_list(meta.get(_SOURCES))):
        return {"reason": "it was made through several rewrites (of " + ", ".join(_json_list(meta.get(_SOURCES)))
                          + "): which one went wrong is for bisect to find"}
    if not all(name and len(by_name.get(name, [])) == 1 for name in replaced):
        return {"reason": "the original nodes it stands for cannot be told apart by name"}
    region = _same_rewrite(opt, node) if rule else [node]
    read_before = _external_inputs([by_name[name][0] for name in replaced])
    constants_orig = _constants(orig)
    names_orig = {i.name for i in orig.graph.input} | constants_orig | {o for n in orig.graph.node for o in n.output}
    # the rewrite's own new weights have no counterpart; every other value it reads must have one
    read_now = [u for u in _external_inputs(region) if u in names_orig or u not in _constants(opt)]
    computed_before = [w for w in read_before if w not in constants_orig]
    t_orig, t_opt = types
    v_now = _fetch(optimized, read_now, t_opt, feeds, provider)
    v_before = _fetch(original, [*computed_before, *(u for u in read_now if u in names_orig)], t_orig, feeds,
                      provider)
    inputs = []
    for u in read_now:
        candidates = [u] if u in names_orig and u in read_before else []
        candidates += [w for w in computed_before if w != u]
        match = next((w for w in candidates if u in v_now and w in v_before and agree(v_before[w], v_now[u])), None)
        inputs.append({"now": u, "producer_now": _producer(opt, u), "before": match, "agrees": match is not None})
    out: dict = {"inputs": inputs,
                 "read_before": [{"name": w, "producer": _producer(orig, w)} for w in computed_before]}
    if any(not i["agrees"] for i in inputs):
        out["reason"] = ("a rewrite upstream rerouted what it reads and left no node (a rule that forwards a value, "
                         "or a graph pass)")
    elif rule:
        out.update(rule=rule, replaced=replaced)
    else:
        out["reason"] = "an original node whose inputs agree with the original's, yet computes a different value"
    return out


def _json_list(text: str | None) -> list[str]:
    try:
        value = json.loads(text or "[]")
    except ValueError:
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def _same_rewrite(proto: onnx.ModelProto, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``node`` and the nodes upstream of it that the same rewrite created (same provenance)."""
    key = [_meta(node).get(k) for k in (_RULE, _REPLACED, _SOURCES)]
    by_output = {o: n for n in proto.graph.node for o in n.output if o}
    region, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if id(n) in seen or [_meta(n).get(k) for k in (_RULE, _REPLACED, _SOURCES)] != key:
            continue
        seen.add(id(n))
        region.append(n)
        stack.extend(by_output[i] for i in n.input if i in by_output)
    return region


def _external_inputs(nodes: list[onnx.NodeProto]) -> list[str]:
    produced = {o for n in nodes for o in n.output}
    return list(dict.fromkeys(i for n in nodes for i in n.input if i and i not in produced))


def _constants(proto: onnx.ModelProto) -> set[str]:
    return {i.name for i in proto.graph.initializer} | {
        n.output[0] for n in proto.graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output}


def _producer(proto: onnx.ModelProto, name: str) -> dict | None:
    node = next((n for n in proto.graph.node if name in n.output), None)
    return _describe(node) if node is not None else None


def _meta(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def _describe(node: onnx.NodeProto) -> dict:
    """A node by name, op type, inputs and outputs, with the provenance a rewrite gave it (data
    about the node: the culprit's ``rule`` is what blames a rule)."""
    meta = _meta(node)
    d = {"name": node.name, "op_type": node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}",
         "inputs": list(node.input), "outputs": list(node.output)}
    if _RULE in meta:
        d["provenance"] = {"rule": meta[_RULE], "replaced": _json_list(meta.get(_REPLACED)),
                           "sources": _json_list(meta.get(_SOURCES))}
    return d


# --- the whole verification -------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr when it is a terminal (silent otherwise)."""

    def __init__(self, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._last = ""

    def __call__(self, step: str, done: int = 0, total: int = 0) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * done / total) if total else 0
        bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} " if total else ""
        line = f"\r{bar}{step}"[:120]
        self.stream.write(line + " " * max(0, len(self._last) - len(line)))
        self.stream.flush()
        self._last = line

    def close(self) -> None:
        if self.enabled and self._last:
            self.stream.write("\r" + " " * len(self._last) + "\r")
            self.stream.flush()
            self._last = ""


def _inputs(model: _Model, feeds, inputs, input_shapes, int_ranges, seed) -> tuple[dict, dict]:
    """The inputs to run and how each was made: ``feeds`` as given, else :func:`make_inputs`."""
    if feeds is None:
        return make_inputs(model, shapes=input_shapes, int_ranges=int_ranges, npz=inputs, seed=seed)
    inits = {i.name for i in model.proto.graph.initializer}
    takes = {i.name for i in model.proto.graph.input if i.name not in inits}
    if set(feeds) != takes:
        raise UsageError(f"feeds: the model takes {', '.join(sorted(takes)) or 'no inputs'}; given "
                         f"{', '.join(sorted(feeds)) or 'none'}")
    return dict(feeds), {k: {"source": "given", "shape": list(np.shape(v)) if isinstance(v, np.ndarray) else [],
                             "dtype": str(v.dtype) if isinstance(v, np.ndarray) else type(v).__name__}
                         for k, v in feeds.items()}


def check_settings(providers: str | Sequence[str] = "cpu", *, runs: int = 20, warmup: int = 5, threads: int = 0,
                   rtol: float | None = None, atol: float | None = None, **_) -> list[str]:
    """Refuse bad verification settings (UsageError, one line) before any work; the providers parsed."""
    providers = parse_providers(providers)
    check_providers(providers)
    if runs < 0:
        raise UsageError(f"--runs {runs}: must not be negative (0: no latency)")
    if warmup < 1:
        raise UsageError(f"--warmup {warmup}: at least 1 warm-up run")
    if not 0 <= threads <= 2**31 - 1:
        raise UsageError(f"--threads {threads}: must be 0 (onnxruntime's choice) or a positive 32-bit number")
    check_tolerances(rtol, atol)
    return providers


def verify(original, optimized, *, providers: str | Sequence[str] = "cpu", inputs: str | os.PathLike | None = None,
           feeds: Mapping[str, np.ndarray] | None = None, input_shapes: Mapping[str, Sequence[int]] | None = None,
           int_ranges: Mapping[str, tuple[int, int]] | None = None, seed: int = 0, rtol: float | None = None,
           atol: float | None = None, runs: int = 20, warmup: int = 5, latency: bool = True, culprit: bool = True,
           threads: int = 0, progress: Progress | None = None, bisect_options: Sequence[str] | None = None) -> dict:
    """Verify ``optimized`` against ``original`` on each provider; returns the report (a dict
    that :func:`format_report` prints); ``report["ok"]`` is False when an output differs.

    ``original``/``optimized``: paths, bytes, onnx.ModelProto or onnx_ir.Model. Inputs come from
    ``feeds``, else from ``inputs`` (.npz) and generation (see :func:`make_inputs`). ``runs``: timed
    rounds per provider after ``warmup`` runs (0 skips latency, as does ``latency=False``).
    When outputs differ, ``report["bisect_command"]`` is the ``python -m onnxopt bisect`` command
    with these settings; ``bisect_options``: the command-line options that made ``optimized``
    (--rules, --disable, ...), None when unknown (the command then says to add them)."""
    providers = check_settings(providers, runs=runs, warmup=warmup, threads=threads, rtol=rtol, atol=atol)
    progress = progress or Progress(enabled=False)
    before = after = None
    try:
        before = _Model(original, "original")
        after = _Model(optimized, "optimized")
        report = _verify(before, after, providers, feeds, inputs, input_shapes, int_ranges, seed, rtol, atol, runs,
                         warmup, latency, culprit, threads, progress)
        if not report["ok"]:
            report["bisect_command"] = bisect_command(
                original, next(p for p, e in report["providers"].items() if not e["ok"]), inputs=inputs,
                input_shapes=input_shapes, int_ranges=int_ranges, seed=seed, rtol=rtol, atol=atol,
                options=bisect_options)
        return report
    finally:
        progress.close()
        for m in (before, after):
            if m is not None:
                m.close()


def _verify(before: _Model, after: _Model, providers, feeds, inputs, input_shapes, int_ranges, seed, rtol, atol,
            runs, warmup, latency, culprit, threads, progress) -> dict:
    feeds, how = _inputs(before, feeds, inputs, input_shapes, int_ranges, seed)
    low = is_low_precision(before.proto)
    report: dict = {"original": before.name, "optimized": after.name,
                    "seed": seed, "inputs": how, "low_precision": low, "providers": {}}
    outputs: dict[str, dict[str, list]] = {}
    steps = len(providers) * (2 + (1 if latency and runs else 0))
    step = 0
    for p in providers:
        entry: dict = {}
        got = {}
        for label, model in (("before", before), ("after", after)):
            progress(f"{p}: running the {'original' if label == 'before' else 'optimized'} model", step, steps)
            try:
                got[label], kernels, init_s = run_profiled(model.source(), feeds, p, threads=threads)
            except Exception as exc:  # noqa: BLE001 - onnxruntime refusing a model is a result
                if label == "before":  # the reference itself does not run: bad input
                    raise InvalidModelError(f"onnxruntime ({p}) cannot run the original model: {io.first_line(exc, 300)}") \
                        from None
                entry["error"] = f"onnxruntime ({p}) cannot run the optimized model: {io.first_line(exc, 300)}"
                break
            entry.setdefault("kernels", {})[label] = {**kernels, "session_init_s": round(init_s, 4)}
            step += 1
        if "error" in entry:  # the optimized model does not run where the original does: it fails
            entry.update(ok=False, outputs=[{"name": name, "ok": False, "problem": "the optimized model does not run"}
                                            for name, _ in got["before"]])
            report["providers"][p] = entry
            continue
        outputs[p] = got
        entry["outputs"] = compare_all(got["before"], got["after"], low_precision=low, rtol=rtol, atol=atol)
        entry["ok"] = all(r["ok"] for r in entry["outputs"])
        if latency and runs:
            progress(f"{p}: latency", step, steps)
            t0 = time.perf_counter()
            lat = measure_latency({"before": before.source(), "after": after.source()}, feeds, provider=p,
                                  runs=runs, warmup=warmup, threads=threads, min_rounds=min(runs, 5),
                                  progress=lambda d, t, p=p, s=step: progress(f"{p}: latency {d}/{t}", s, steps))
            res = lat["results"]
            entry["latency"] = {"rounds": lat["rounds"], "warmup": warmup,
                                **{k: {"median_ms": round(v["median_ms"], 4), "p90_ms": round(v["p90_ms"], 4)}
                                   for k, v in res.items()}}
            if "before" in res and "after" in res and res["before"]["median_ms"] > 0:
                entry["latency"]["ratio_median"] = round(res["after"]["median_ms"] / res["before"]["median_ms"], 4)
                entry["latency"]["ratio_p90"] = round(res["after"]["p90_ms"] / res["before"]["p90_ms"], 4)
            entry["latency"]["seconds"] = round(time.perf_counter() - t0, 3)
            step += 1
        if not entry["ok"] and culprit:
            progress(f"{p}: looking for the first diverging value", step, steps)
            try:
                entry["culprit"] = find_culprit(before, after, feeds, p, low_precision=low, rtol=rtol, atol=atol)
            except Exception as exc:  # noqa: BLE001 - the verdict stands without it
                entry["culprit"] = {"message": f"could not run the models with their intermediate values exposed: "
                                               f"{io.first_line(exc, 300)}"}
        report["providers"][p] = entry
    if "cpu" in outputs and len(outputs) > 1:
        report["cross_provider"] = {}
        for p in outputs:
            if p == "cpu":
                continue
            report["cross_provider"][f"cpu-vs-{p}"] = {
                label: compare_all(outputs["cpu"][label], outputs[p][label], low_precision=low, rtol=rtol, atol=atol)
                for label in ("before", "after")}
    report["ok"] = all(e["ok"] for e in report["providers"].values())
    return report


def summary_line(report: dict) -> str:
    """One line naming the worst output, the culprit and the rewrite bisect found, for errors."""
    p, entry = next(((p, e) for p, e in report["providers"].items() if not e["ok"]), (None, None))
    if entry is None:
        return "outputs agree"
    if entry.get("error"):
        text = entry["error"]
    else:
        r = next(r for r in entry["outputs"] if not r["ok"])
        text = f"outputs differ on {p}: {r['name']}: {problem_text(r)}"
    c = entry.get("culprit") or {}
    if c.get("value"):
        text += f"; first diverging value {c['value']!r} from {c['node']['op_type']} {c['node']['name']!r}"
        if c.get("rule"):
            text += f" (rule {c['rule']})"
    b = report.get("bisect") or {}
    if b.get("culprit_rule"):
        text += f"; bisect: rewrite {b['first_failing_rewrite']} of {b['rewrites']}, {b['culprit_rule']}"
    elif report.get("bisect_command"):
        text += f"; to find the rewrite: {report['bisect_command']}"
    return text


# --- the report on the terminal ---------------------------------------------------------------


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x == 0:
            return "0"
        return f"{x:.{digits}g}"
    return str(x)


def table(rows: list[tuple], header: tuple) -> str:
    """Rows under a header, columns aligned (the first left, the others right)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def _output_rows(rows: list[dict]) -> list[tuple]:
    out = []
    for r in rows:
        status = "ok" if r["ok"] else f"DIFFERS ({r['problem']})" if r.get("problem") else "DIFFERS"
        shape = (_dims(r["shape_after"]) if "shape_after" in r else
                 f"seq[{r['length']}]" if "length" in r else r.get("kind", "-"))
        out.append((r["name"], shape, r.get("dtype_after", "-"),
                    _fmt(r.get("max_abs")), _fmt(r.get("max_rel")), _fmt(r.get("p99_abs")),
                    _fmt(r.get("cosine"), 7), f"{r.get('out_of_tolerance', '-')}/{r.get('elements', '-')}",
                    f"{_fmt(r.get('rtol'))}/{_fmt(r.get('atol'))}", status))
    return out


_OUT_HEADER = ("output", "shape", "dtype", "max abs", "max rel", "p99 abs", "cosine", "out of tol", "rtol/atol",
               "status")


def _named(value: str, producer: dict | None) -> str:
    return f"{value!r}" + (f" ({producer['op_type']} {producer['name']!r})" if producer else "")


def _culprit_lines(c: dict, label: str = "culprit") -> list[str]:
    """The first diverging value, its producer, and a rule only where :func:`_tie` tied one."""
    if not c.get("value"):
        return [f"{label}: {c.get('message')}"] if c.get("message") else []
    n = c["node"]
    if c.get("rule"):
        how = (f", created by rule {c['rule']} from {', '.join(c['replaced'])}: from the values those nodes read, "
               "it computes a different one")
    elif n.get("provenance"):
        how = f", a node a rewrite made in place of {', '.join(n['provenance']['sources'])}"
    else:
        how = ", an original node"
    lines = [f"{label}: first diverging value {c['value']!r} (of {c['compared_values']} shared), produced by "
             f"{n['op_type']} {n['name']!r}{how}", f"  {problem_text(c['stats'])}"]
    read_before = ", ".join(_named(r["name"], r["producer"]) for r in c.get("read_before", [])) or "only weights"
    lines += [f"  it reads {_named(i['now'], i['producer_now'])}, which agrees with no value the original read "
              f"there ({read_before})" for i in c.get("inputs", []) if not i["agrees"]]
    if c.get("reason"):
        lines.append(f"  no rule is named: {c['reason']}")
    return lines


def _bisect_lines(report: dict) -> list[str]:
    b = report.get("bisect")
    if b is None:
        return [f"to find the rewrite: {report['bisect_command']}"] if report.get("bisect_command") else []
    if "skipped" in b:
        return [f"bisect {b['skipped']}; to find the rewrite: {report.get('bisect_command', 'onnxopt bisect')}"]
    return ["", format_bisect(b)]


def format_report(report: dict) -> str:
    lines = [f"verify {report['original']} -> {report['optimized']}"]
    ins = ", ".join(f"{k} {_dims(v['shape'])} {v['dtype']} ({v['source']}"
                    + (f", {v['range'][0]}..{v['range'][1]}" if "range" in v else "") + ")"
                    for k, v in report["inputs"].items())
    lines.append(f"inputs (seed {report['seed']}): {ins or 'none'}")
    if report.get("low_precision"):
        lines.append(f"fp16/bf16/int8 model: float32 outputs compared at rtol {LOW_PRECISION[0]}, atol "
                     f"{LOW_PRECISION[1]}")
    for p, e in report["providers"].items():
        lines += ["", f"== {p.upper()} ({PROVIDERS[p]}): {'outputs agree' if e['ok'] else 'OUTPUTS DIFFER'}",
                  table(_output_rows(e["outputs"]), _OUT_HEADER)]
        if e.get("error"):
            lines.append(e["error"])
            continue
        if p == "cuda":
            lines.append("(CUDA outputs are compared with TF32 off, use_tf32=0; latency runs with the defaults)")
        kb, ka = e["kernels"]["before"], e["kernels"]["after"]
        prov = lambda k: ", ".join(f"{n.replace('ExecutionProvider', '')} {c}" for n, c in k["by_provider"].items())  # noqa: E731
        lines.append(f"kernels per run: {kb['kernels']} -> {ka['kernels']} ({ka['kernels'] - kb['kernels']:+d}); "
                     f"by provider: before {prov(kb) or '-'}; after {prov(ka) or '-'}; "
                     f"Memcpy {kb['memcpy']} -> {ka['memcpy']}")
        ops = sorted(set(kb["by_op"]) | set(ka["by_op"]))
        changed = [(op, kb["by_op"].get(op, 0), ka["by_op"].get(op, 0)) for op in ops
                   if kb["by_op"].get(op, 0) != ka["by_op"].get(op, 0)]
        if changed:
            lines.append(table([(op, b, a, f"{a - b:+d}") for op, b, a in changed],
                                ("kernels by op type", "before", "after", "change")))
        lat = e.get("latency")
        if lat and "before" in lat and "after" in lat:
            lines.append(f"latency ({lat['rounds']} interleaved runs after {lat['warmup']} warm-up): "
                         f"median {lat['before']['median_ms']:.3f} -> {lat['after']['median_ms']:.3f} ms "
                         f"(x{lat.get('ratio_median', float('nan')):.3f}), p90 {lat['before']['p90_ms']:.3f} -> "
                         f"{lat['after']['p90_ms']:.3f} ms (x{lat.get('ratio_p90', float('nan')):.3f})")
        lines += _culprit_lines(e.get("culprit") or {})
    for key, by_label in report.get("cross_provider", {}).items():
        for label, rows in by_label.items():
            model = "original" if label == "before" else "optimized"
            lines += ["", f"== {key}, {model} model (informational)",
                      table(_output_rows(rows), _OUT_HEADER)]
    lines += _bisect_lines(report)
    lines += ["", "verdict: " + ("outputs agree on " + ", ".join(report["providers"]) if report["ok"]
                                 else summary_line(report))]
    return "\n".join(lines)


# --- bisecting the driver's rewrites -------------------------------------------------------------


def bisect(model, *, rules=None, extra_rules=(), disable: Iterable[str] = (), target: str | None = None,
           provider: str = "cpu", inputs: str | os.PathLike | None = None,
           feeds: Mapping[str, np.ndarray] | None = None, input_shapes: Mapping[str, Sequence[int]] | None = None,
           int_ranges: Mapping[str, tuple[int, int]] | None = None, seed: int = 0, rtol: float | None = None,
           atol: float | None = None, optimize_options: dict | None = None,
           progress: Progress | None = None) -> dict:
    """Binary search over the driver's sequence of rewrites for the first one after which the
    optimized model's outputs differ from ``model``'s on ``provider``.

    The driver is deterministic, so optimizing with ``stop_after=n`` makes the same first rewrites
    as the full run and stops after ``n`` (constant lifting runs first, and a graph pass runs
    whole, counting its merges as rewrites: each is one step).
    The result names the step: the rule and the nodes it replaced and created (or the pass),
    and the first diverging value in the model right after it. Inputs as for :func:`verify`."""
    provider = parse_providers(provider)[0]
    check_providers([provider])
    check_tolerances(rtol, atol)
    progress = progress or Progress(enabled=False)
    original = _Model(model, "original")
    try:
        return _bisect(original, rules, extra_rules, disable, target, provider, inputs, feeds, input_shapes,
                       int_ranges, seed, rtol, atol, optimize_options, progress)
    finally:
        progress.close()
        original.close()


def _bisect(original: _Model, rules, extra_rules, disable, target, provider, inputs, feeds, input_shapes,
            int_ranges, seed, rtol, atol, optimize_options, progress) -> dict:
    from .api import optimize

    source = io.load(original.path, check=False).model if original.path is not None else io.to_ir(original.proto)
    feeds, how = _inputs(original, feeds, inputs, input_shapes, int_ranges, seed)
    low = is_low_precision(original.proto)
    try:
        reference = _run(original.source(), feeds, provider)
    except Exception as exc:  # noqa: BLE001
        raise InvalidModelError(f"onnxruntime ({provider}) cannot run the original model: {io.first_line(exc, 300)}") from None
    options = dict(optimize_options or {})
    runs: dict = {}

    def attempt(n: int | None):
        key = -1 if n is None else n
        if key not in runs:
            out, rep = optimize(source, rules=rules, extra_rules=extra_rules, disable=disable, target=target,
                                stop_after=n if n is not None else 10**12, return_report=True, **options)
            built = _Model(out, "optimized")
            try:
                rows = compare_all(reference, _run(built.source(), feeds, provider), low_precision=low, rtol=rtol,
                                   atol=atol)
                ok, error = all(r["ok"] for r in rows), None
            except Exception as exc:  # noqa: BLE001 - a model onnxruntime rejects fails verification
                rows, ok, error = [], False, f"onnxruntime cannot run it: {io.first_line(exc, 300)}"
            runs[key] = {"ok": ok, "rows": rows, "error": error, "log": rep.log, "rewrites": rep.rewrites,
                         "model": built}
        return runs[key]

    try:
        progress("full optimization", 0, 1)
        full = attempt(None)
        total = full["rewrites"]
        report: dict = {"model": original.name, "provider": provider, "inputs": how, "seed": seed,
                        "rewrites": total}
        if full["ok"]:
            report.update(ok=True, message=f"the fully optimized model ({total} rewrites) verifies on {provider}: "
                                           "nothing to bisect")
            return report
        lo, hi = 0, total
        steps_total = max(1, int(np.ceil(np.log2(total + 1))) + 1)
        done = 0
        progress(f"bisecting {total} rewrites", done, steps_total)
        if not attempt(0)["ok"]:
            hi = 0
        else:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                done += 1
                progress(f"bisecting: rewrites {lo}..{hi}", done, steps_total)
                if attempt(mid)["ok"]:
                    lo = mid
                else:
                    hi = mid
        bad = attempt(hi) if hi < total else full
        good_log = attempt(lo)["log"] if hi > 0 else []
        steps = bad["log"][len(good_log):] if hi > 0 else bad["log"]
        report.update(ok=False, first_failing_rewrite=hi, steps=steps, outputs=bad["rows"], error=bad["error"])
        named = [s.get("rule") or s.get("pass") for s in steps]
        report["culprit_rule"] = named[0] if named else None
        if hi == 0:
            report["message"] = ("outputs already differ before any rule fires: the graph passes that run first "
                                 f"({', '.join(named) or 'none'}) or the model itself")
        progress("locating the first diverging value", steps_total, steps_total)
        try:
            report["culprit"] = find_culprit(original, bad["model"], feeds, provider, low_precision=low, rtol=rtol,
                                             atol=atol)
        except Exception as exc:  # noqa: BLE001
            report["culprit"] = {"message": f"could not expose intermediate values: {io.first_line(exc, 300)}"}
        return report
    finally:
        for r in runs.values():
            r["model"].close()
        for r in runs.values():
            r.pop("model", None)


def _run(model, feeds: Mapping[str, np.ndarray], provider: str) -> list[tuple[str, np.ndarray]]:
    sess = session(model, provider, exact=True)
    outs = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
    return [(o.name, _host(v)) for o, v in zip(sess.get_outputs(), outs)]


def format_bisect(report: dict) -> str:
    lines = [f"bisect {report['model']} on {report['provider']} ({report['rewrites']} rewrites in the full run)"]
    if report["ok"]:
        return "\n".join(lines + [report["message"]])
    n = report["first_failing_rewrite"]
    lines.append(f"outputs differ after rewrite {n}" + (f" (the model is fine after {n - 1})" if n > 0 else ""))
    if report.get("message"):
        lines.append(report["message"])
    for s in report["steps"]:
        if "rule" in s:
            lines.append(f"  rule {s['rule']}: replaced {', '.join(s['replaced'])} with "
                         f"{', '.join(s['created']) or 'nothing (forwarded a value)'}")
        else:
            lines.append(f"  pass {s['pass']}: {s['rewrites']} merges")
    if report.get("error"):
        lines.append(f"  {report['error']}")
    if report.get("outputs"):
        lines.append(table(_output_rows(report["outputs"]), _OUT_HEADER))
    lines += _culprit_lines(report.get("culprit") or {}, "right after it")
    lines.append(f"culprit: {report.get('culprit_rule') or 'unknown'}")
    return "\n".join(lines)


def bisect_command(model, provider: str = "cpu", *, inputs: str | os.PathLike | None = None,
                   input_shapes: Mapping[str, Sequence[int]] | None = None,
                   int_ranges: Mapping[str, tuple[int, int]] | None = None, seed: int = 0, rtol: float | None = None,
                   atol: float | None = None, options: Sequence[str] | None = None) -> str:
    """The ``python -m onnxopt bisect`` command that replays a verification's settings on
    ``model`` (a path; ORIGINAL for a model in memory). ``options``: the command-line options that
    made the optimized model (--rules, --disable, ...); None when unknown, and the command says so."""
    words = ["python", "-m", "onnxopt", "bisect", str(model) if isinstance(model, (str, os.PathLike)) else "ORIGINAL"]
    if provider != "cpu":
        words += ["--provider", provider]
    if inputs is not None:
        words += ["--inputs", str(inputs)]
    words += [w for name, dims in (input_shapes or {}).items()
              for w in ("--input-shape", f"{name}={'x'.join(map(str, dims))}")]
    words += [w for name, (lo, hi) in (int_ranges or {}).items() for w in ("--int-range", f"{name}={lo}:{hi}")]
    words += ["--seed", str(seed)] if seed else []
    words += [w for flag, v in (("--rtol", rtol), ("--atol", atol)) if v is not None for w in (flag, repr(v))]
    text = shlex.join([*words, *(options or [])])
    if options is None:
        text += " (plus the --rules/--disable/--target options that made the optimized model)"
    return text


BISECT_BUDGET_S = 60.0


def bisect_failure(model, report: dict, *, seconds: float, rewrites: int, verify_options: Mapping | None = None,
                   budget_s: float | None = None, **optimize_settings) -> dict:
    """After ``optimize(..., verify=...)`` found outputs that differ (``report``): :func:`bisect`
    the rewrites on the first provider that failed, with the same inputs, when the estimate,
    (log2(rewrites) + 1) x ``seconds`` (the measured optimize + verify time, less the latency
    measurement, which bisect does not repeat), is under ``budget_s`` (default
    :data:`BISECT_BUDGET_S`); else ``{"skipped": why}``. ``optimize_settings``: rules,
    extra_rules, disable, target and optimize_options, as the optimization ran."""
    budget_s = BISECT_BUDGET_S if budget_s is None else budget_s
    seconds -= sum(e.get("latency", {}).get("seconds", 0) for e in report["providers"].values())
    estimate = (math.log2(max(1, rewrites)) + 1) * seconds
    if estimate >= budget_s:
        return {"skipped": f"not run: about {estimate:.0f} s for {rewrites} rewrites, over {budget_s:.0f} s",
                "estimate_s": round(estimate, 1)}
    provider = next(p for p, e in report["providers"].items() if not e["ok"])
    keys = ("inputs", "feeds", "input_shapes", "int_ranges", "seed", "rtol", "atol", "progress")
    try:
        return bisect(model, provider=provider, **{k: v for k, v in (verify_options or {}).items() if k in keys},
                      **optimize_settings)
    except Exception as exc:  # noqa: BLE001 - the verification's verdict stands; say why there is no bisect
        return {"skipped": f"failed: {io.first_line(exc, 300)}"}
