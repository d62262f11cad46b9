"""The inputs a verification runs: ``--input-shape`` and ``--int-range`` parsing, arrays from an
.npz file, and generated arrays (the same for the same seed) for the rest."""

from __future__ import annotations

import os
import re
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.ir import input_shapes
from onnxopt.ir import io
from onnxopt.errors import UsageError
from onnxopt.ir.input_shapes import check_shape, dims_text, run_dims
from onnxopt.verify.runtime import OrtModel


_INT = re.compile(r"-?[0-9]+")


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


def parse_input_shapes(items: Iterable[str]) -> dict[str, list[int]]:
    """``--input-shape`` entries for running a model (verify, bisect): the one grammar of
    ``onnxopt.ir.input_shapes`` (``NAME=1x3x224x224``, ``NAME=1,3,224,224``, ``NAME=`` for a
    scalar), every dimension a number that fits ONNX's int64 dimensions (a symbol is refused)."""
    return {name: list(dims) for name, dims in input_shapes.parse(items, numbers=True).items()}


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
    corrupted file, pickled objects) is refused in one line, as is one whose arrays inflate past 4 GiB."""
    from onnxopt.readers import check_npz

    check_npz(path, "inputs file")  # (numpy reads a member whole: a compressed one may declare gigabytes)
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


GENERATED_INPUT_LIMIT = 4 << 30  # bytes: a declared shape that needs more is refused, not allocated


def given_raw(vi: onnx.ValueInfoProto, npz, shape) -> bool:
    """An array of ``npz`` for input ``vi`` that is uint8 pixels of another rank (raw pixels for
    a model made with ``--input-preprocess``), which only ``make_inputs(pixels=...)`` reads."""
    tt = vi.type.tensor_type
    if not tt.HasField("shape") or len(shape) == len(tt.shape.dim):
        return False
    with np.load(npz, allow_pickle=False) as z:
        return z[vi.name].dtype == np.uint8


def run_shapes(model: ir.Model, shapes: Mapping[str, Sequence[int]] | None = None,
               npz: str | os.PathLike | None = None) -> dict[str, list[int]]:
    """The shape every input of ``model`` (an onnx_ir model, e.g. one whose inputs
    ``onnxopt.ir.input_shapes.fix`` fixed) is run at when generated as :func:`make_inputs` does,
    for those ``npz`` lacks; ``shapes`` and the arrays of ``npz`` are checked against its inputs.
    Given to :func:`make_inputs` for another model (the original, still dynamic), its generated
    inputs fit both."""
    shapes = input_shapes.normalize(shapes, numbers=True)
    inputs = [ir.serde.serialize_value(v) for v in model.graph.inputs if not v.is_initializer()]
    known = {vi.name for vi in inputs}
    for name in shapes:  # (as make_inputs refuses it: the shape of no input is a mistake)
        if name not in known:
            raise UsageError(f"the model has no input {name!r} (inputs: {', '.join(sorted(known)) or 'none'})")
    given = {k: list(v.shape) for k, v in (_load_npz(npz) if npz is not None else {}).items()}
    for vi in inputs:
        if vi.name in given and given_raw(vi, npz, given[vi.name]):  # (raw pixels: make_inputs checks them)
            del given[vi.name]
        elif vi.name in given:
            check_shape(vi, given[vi.name], f"input {vi.name!r} in {npz}")
    return run_dims(inputs, shapes, given, input_shapes.suggest(model))


def data_shapes(model: ir.Model, options: Mapping | None) -> dict[str, list[int]]:
    """The shapes the verifier's data runs ``model``'s inputs at, for a verification with
    ``options`` (``verify``'s keyword arguments): the arrays of ``feeds`` or of the ``inputs`` file
    (where each has the input's rank), and for the inputs neither gives, ``input_shapes`` or the
    generated shapes (:func:`run_shapes`). {} where the data cannot be read (the verifier says why)."""
    options = options or {}
    try:
        if options.get("feeds") is not None:
            arrays = {k: list(np.shape(v)) for k, v in options["feeds"].items()}
            npz = None
        else:
            npz = options.get("inputs")
            arrays = {k: list(v.shape) for k, v in (_load_npz(npz) if npz is not None else {}).items()}
        ranks = {v.name: len(v.shape) for v in model.graph.inputs if not v.is_initializer() and v.shape is not None}
        arrays = {k: d for k, d in arrays.items() if ranks.get(k) == len(d)}
        rest = run_dims([ir.serde.serialize_value(v) for v in model.graph.inputs if not v.is_initializer()],
                        input_shapes.normalize(options.get("input_shapes"), numbers=True), arrays,
                        input_shapes.suggest(model))
    except UsageError:
        return {}
    return {**rest, **arrays}


def make_inputs(model, *, shapes: Mapping[str, Sequence[int]] | None = None,
                int_ranges: Mapping[str, tuple[int, int]] | None = None, npz: str | os.PathLike | None = None,
                seed: int = 0, pixels: Mapping | None = None,
                padding: str = "any") -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """Inputs for every graph input of ``model`` (path, proto or onnx_ir model), and how each was made.

    ``padding`` "right": a 2-D integer input named like a mask is ones then zeros in each row (a random count of
    ones, at least one); "none": all ones: the inputs a model optimized with ``--padding right|none`` is promised.

    From ``npz`` where it has the input; otherwise generated, the same for the same seed:
    floats from a standard normal distribution, integers uniformly in a valid range (the user's
    ``int_ranges``; else 0..n-1 for an input that indexes a Gather table of n rows, 0..1 for a
    name containing "mask", 0..9 otherwise), bools 0/1. Dynamic dimensions: from ``shapes``
    (per input, numbers: see ``onnxopt.ir.input_shapes``), then the same named symbol elsewhere, then
    the size the model suggests (``onnxopt.ir.input_shapes.suggest``), else 1 on the first axis and 16
    on others; ``how[name]["chosen"]`` names each dimension chosen so, and why.

    ``pixels``: ``{name: onnxopt.transforms.edges.Preprocess}``, the inputs a model made from this one with
    ``--input-preprocess`` takes as raw pixels (``layout.pixel_inputs``): ``npz`` may give those as
    raw uint8 pixels in their pixel layout, returned as they are (``layout.edge_feeds`` gives the
    original their preprocessing); ``how`` records them so.
    """
    proto = model.proto if isinstance(model, OrtModel) else OrtModel(model, "model").proto
    shapes = input_shapes.normalize(shapes, numbers=True)
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
    pixels = dict(pixels or {})
    raw = {k for k, v in given.items() if k in pixels and v.dtype == np.uint8}  # raw pixels given
    if raw:
        from onnxopt.transforms.edges import model_shape
    given_shapes = {k: model_shape(v.shape, pixels[k]) if k in raw else list(v.shape) for k, v in given.items()}
    for k in raw:
        if given[k].ndim != (4 if pixels[k].batched else 3):
            raise UsageError(f"input {k!r} in {npz}: raw pixels of shape {dims_text(given[k].shape)}; the optimized "
                             f"model takes {pixels[k].layout} pixels ({4 if pixels[k].batched else 3} dimensions)")
    chosen: dict = {}  # the dimensions onnxopt chose, and why
    planned = run_dims(graph_inputs, shapes, given_shapes, input_shapes.suggest(proto), chosen)
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
        if vi.name in raw:
            arr = given[vi.name]
            check_shape(vi, given_shapes[vi.name], f"input {vi.name!r} in {npz} (raw {pixels[vi.name].layout} "
                                                   f"pixels {dims_text(arr.shape)})")
            feeds[vi.name] = arr
            how[vi.name] = {"source": "npz", "shape": list(arr.shape), "dtype": "uint8", "file": str(npz)}
            continue
        if vi.name in given:
            arr = given[vi.name]
            if dtype is not None and arr.dtype != dtype:
                raise UsageError(f"input {vi.name!r} in {npz} is {arr.dtype}, the model takes {np.dtype(dtype)}")
            check_shape(vi, list(arr.shape), f"input {vi.name!r} in {npz}")
            feeds[vi.name] = arr
            how[vi.name] = {"source": "npz", "shape": list(arr.shape), "dtype": str(arr.dtype), "file": str(npz)}
            continue
        if dtype is None:
            raise UsageError(f"input {vi.name!r} has type {onnx.TensorProto.DataType.Name(tt.elem_type)}, "
                             "which is not generated; give it in an .npz file")
        if vi.name not in planned:
            raise UsageError(f"input {vi.name!r} has no declared shape: give it with --input-shape "
                             f"{vi.name}=D1xD2... (or in an .npz file)")
        shape = planned[vi.name]
        if vi.name in int_ranges and not np.issubdtype(dtype, np.integer):
            raise UsageError(f"--int-range {vi.name}: the input is {np.dtype(dtype)}, not an integer type")
        info = {"source": "generated", "shape": shape, "dtype": str(np.dtype(dtype))}
        if chosen.get(vi.name):  # (dimensions the model does not declare: what onnxopt chose, and why)
            info["chosen"] = {str(k): why for k, why in sorted(chosen[vi.name].items())}
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
            raise UsageError(f"input {vi.name!r}: a generated array of shape {dims_text(shape)} would take "
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
            raise UsageError(f"input {vi.name!r}: cannot make an array of shape {dims_text(shape)}: "
                             f"{io.first_line(exc, 200)}") from None
        if padding != "any" and "mask" in vi.name.lower() and len(shape) == 2 and vi.name not in int_ranges \
                and np.issubdtype(dtype, np.integer) and shape[1] > 0:
            # (the optimized model was made for masks padded at the end of each row, or not at all: --padding)
            kept = rng.integers(1, shape[1], shape[0], endpoint=True) if padding == "right" else \
                np.full(shape[0], shape[1])
            arr = (np.arange(shape[1])[None, :] < kept[:, None]).astype(dtype)
            info["distribution"] = f"ones, then zeros (as the optimized model's onnxopt.padding says: {padding})"
        feeds[vi.name] = arr
        how[vi.name] = info
    return feeds, how


_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
_ORT_SOURCE = re.compile(r"\s*/\S*onnxruntime\S*:\d+ .*? (?:was false|failed)\.")


def ort_reason(exc: BaseException, limit: int = 400) -> str:
    """onnxruntime's message without its code prefix and C++ source location (a file, a line and
    the function's signature, which otherwise fill the room before the reason), on one line."""
    text = _ORT_PREFIX.sub("", io.first_line(exc, 10_000))
    text = _ORT_SOURCE.sub("", text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_failure(model: str, exc: BaseException, how: Mapping[str, dict], provider: str = "cpu",
                declared=None) -> UsageError:
    """The one line for a model that onnxruntime cannot run at the inputs of ``how``
    (:func:`make_inputs`'s record): the shapes it ran at, which of them onnxopt chose, the reason,
    and the options that give other shapes; ``declared`` (the graph inputs as onnx ValueInfoProtos):
    the model's own shapes beside them. (Data a model cannot run is the user's to change: exit 2,
    not an internal error.)"""
    shapes = ", ".join(f"{k}={dims_text(v['shape'])}" for k, v in how.items())
    chosen = {k: v["chosen"] for k, v in how.items() if v.get("chosen")}
    made = [k for k, v in how.items() if v.get("source") == "generated"]
    if chosen:
        where = ", ".join(f"{k} dimension {a} = {how[k]['shape'][int(a)]} ({why})"
                          for k, c in chosen.items() for a, why in c.items())
        at = f"at the generated shapes {shapes} (the model does not declare every size; onnxopt chose {where})"
    elif made:
        at = f"at the shapes {shapes} (generated)"
    else:
        at = f"at the shapes of the data given ({shapes})"
    if declared:
        from onnxopt.errors import feeds_text

        at += feeds_text({}, declared)

    def form(k):  # (the dimensions onnxopt chose shown as ?: the user's to fill)
        return "x".join("?" if str(i) in how[k].get("chosen", {}) else str(d) for i, d in enumerate(how[k]["shape"]))

    if chosen:
        fix = (f"give the sizes it takes with {' '.join(f'--input-shape {k}={form(k)}' for k in chosen)}, or data "
               f"with --inputs FILE.npz")
    else:
        fix = "give shapes it takes (--input-shape NAME=DIMS) or data it takes (--inputs FILE.npz)"
    return UsageError(f"onnxruntime ({provider}) cannot run {model} {at}: {ort_reason(exc, 300)}; {fix}")


def inputs_for(model: OrtModel, feeds, inputs, input_shapes, int_ranges, seed, pixels=None,
               padding: str = "any") -> tuple[dict, dict]:
    """The inputs to run and how each was made: ``feeds`` as given, else :func:`make_inputs`
    (``pixels``, ``padding``: as it takes them)."""
    if feeds is None:
        return make_inputs(model, shapes=input_shapes, int_ranges=int_ranges, npz=inputs, seed=seed, pixels=pixels,
                           padding=padding)
    inits = {i.name for i in model.proto.graph.initializer}
    takes = {i.name for i in model.proto.graph.input if i.name not in inits}
    if set(feeds) != takes:
        raise UsageError(f"feeds: the model takes {', '.join(sorted(takes)) or 'no inputs'}; given "
                         f"{', '.join(sorted(feeds)) or 'none'}")
    return dict(feeds), {k: {"source": "given", "shape": list(np.shape(v)) if isinstance(v, np.ndarray) else [],
                             "dtype": str(v.dtype) if isinstance(v, np.ndarray) else type(v).__name__}
                         for k, v in feeds.items()}
