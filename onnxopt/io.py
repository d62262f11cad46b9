"""Loading and saving models in every form users hold them.

Inputs may be a path, ``bytes``, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; the caller gets
back the same kind. Bad input raises :class:`InvalidModelError` with a one-line message. Weights
are never copied on load: a ModelProto's tensors are wrapped, not copied, and external data is
memory-mapped lazily by onnx_ir. Saving writes to a temporary file next to the target and renames
it into place, so a failure never leaves a half-written model and the input is never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Union

import numpy as np
import onnx
import onnx_ir as ir

from .errors import InvalidModelError, UsageError

ModelLike = Union[str, os.PathLike, bytes, onnx.ModelProto, ir.Model]

# Protobuf cannot serialize a message of 2 GiB or more; keep well clear of it.
_PROTO_LIMIT = 2**31 - 2**26


@dataclasses.dataclass
class Loaded:
    """An IR model plus what we need to give it back in the form it came in."""

    model: ir.Model
    kind: str  # "path" | "bytes" | "proto" | "ir"
    path: Path | None = None
    external: bool = False  # the input kept (some) weights in external data files
    data_files: frozenset = frozenset()  # those files (resolved): never to be overwritten


def _first_line(exc: BaseException, limit: int = 400) -> str:
    """The message folded onto one line (checker messages span several), capped in length."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip() and not line.strip().startswith("==>"))
    text = text or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse(data: bytes, what: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError (a Message.Error subclass)
        # A protobuf that starts like a ModelProto (field 1 = ir_version, varint) but fails
        # to parse was most likely cut short.
        if data[:1] == b"\x08" and len(data) > 16:
            raise InvalidModelError(
                f"{what} is a truncated or corrupted ONNX file ({len(data)} bytes; protobuf: {_first_line(exc)})"
            ) from None
        raise InvalidModelError(f"{what} is not an ONNX model (it does not parse as one)") from None
    if not proto.HasField("graph") or proto.ir_version <= 0 or not proto.opset_import:
        if data[:1] == b"\x08" and proto.ir_version > 0:
            raise InvalidModelError(f"{what} is a truncated ONNX file (no complete graph)")
        raise InvalidModelError(f"{what} is not an ONNX model (no graph, IR version or opset import)")
    return proto


def _check(target: onnx.ModelProto | bytes | str, what: str) -> None:
    try:
        onnx.checker.check_model(target)
    except Exception as exc:
        raise InvalidModelError(f"{what} fails the ONNX checker: {_first_line(exc)}") from None


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def _check_external_data(proto: onnx.ModelProto, base_dir: Path, what: str) -> bool:
    """Raise if an external-data file is missing or too short; return whether any is used."""
    sizes: dict[Path, int] = {}
    found = False
    for graph in _graphs(proto.graph):
        for tensor in graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            found = True
            info = {e.key: e.value for e in tensor.external_data}
            location = info.get("location", "")
            path = base_dir / location
            if path not in sizes:
                try:
                    sizes[path] = path.stat().st_size if path.is_file() else -1
                except OSError:
                    sizes[path] = -1
                if sizes[path] < 0:
                    raise InvalidModelError(
                        f"{what}: missing external data file '{location}' (tensor '{tensor.name}', "
                        f"looked for {path})"
                    )
            if "length" in info:
                need = int(info["length"])
            else:
                count = 1
                for d in tensor.dims:
                    count *= d
                need = count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
            end = int(info.get("offset", 0)) + need
            if end > sizes[path]:
                raise InvalidModelError(
                    f"{what}: external data file '{location}' is too short for tensor '{tensor.name}' "
                    f"(needs {end} bytes, has {sizes[path]})"
                )
    return found


def external_data_files(model: ir.Model) -> set[Path]:
    """The external data files the model's tensors are read from (resolved paths)."""
    files = set()
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                files.add(Path(tensor.path).resolve())
    return files


def load(source: ModelLike, *, check: bool = True, copy_ir: bool = True) -> Loaded:
    """Load any supported model form into onnx_ir.

    ``check`` runs the ONNX checker and the external-data check (not done for an onnx_ir.Model,
    which is trusted as built). ``copy_ir`` clones an onnx_ir.Model (tensors shared) so the
    caller's object is not mutated.
    """
    if isinstance(source, ir.Model):
        return Loaded(source.clone() if copy_ir else source, "ir")
    if isinstance(source, onnx.ModelProto):
        external = _check_external_data(source, Path("."), "model") if check else False
        if check and source.ByteSize() < _PROTO_LIMIT:
            # (a larger proto cannot be serialized for the checker)
            _check(source, "model")
        return Loaded(ir.from_proto(source), "proto", external=external)
    if isinstance(source, (bytes, bytearray, memoryview)):
        proto, _ = read_checked(source, check=check)
        return Loaded(ir.from_proto(proto), "bytes")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        proto, external = read_checked(path, check=check)
        model = ir.from_proto(proto)
        ir.external_data.set_base_dir(model.graph, path.parent)
        files = frozenset(external_data_files(model)) if external else frozenset()
        return Loaded(model, "path", path=path, external=external, data_files=files)
    raise UsageError(
        f"cannot load a model from {type(source).__name__}: pass a path, bytes, onnx.ModelProto or onnx_ir.Model"
    )


def read_checked(source: str | os.PathLike | bytes | bytearray | memoryview, *, check: bool = True,
                 what: str | None = None) -> tuple[onnx.ModelProto, bool]:
    """The ModelProto of a model file or serialized bytes, validated as :func:`load` validates
    (one-line InvalidModelError for a missing file, a file that is not ONNX or is truncated, a
    missing or short external-data file, and with ``check`` the ONNX checker), and whether its
    weights live in external files (not read). ``what`` names it in messages."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        proto = _parse(data, what or "input bytes")
        if check:
            _check(data, what or "model")
        return proto, False
    path = Path(source)
    what = what or str(path)
    if not path.exists():
        raise InvalidModelError(f"{what}: no such file")
    if path.is_dir():
        raise InvalidModelError(f"{what}: is a directory, not an ONNX file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidModelError(f"{what}: cannot read ({exc.strerror})") from None
    proto = _parse(data, what)
    # A missing data file is reported as such, before the checker reports it less clearly.
    external = _check_external_data(proto, path.parent, what)
    if check:
        # The bytes in hand spare the checker a second read of the file; with external data
        # it needs the path to find the data files.
        _check(str(path) if external else data, what)
    return proto, external


def _onnxruntime_identity() -> str | None:
    """Which onnxruntime is installed (distribution, version, location), without importing it."""
    import importlib.metadata
    import importlib.util

    try:
        spec = importlib.util.find_spec("onnxruntime")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    where = os.path.dirname(spec.origin or "") or str(list(spec.submodule_search_locations or [""])[0])
    for dist in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        try:
            mtime = os.stat(os.path.join(where, "capi")).st_mtime_ns
        except OSError:
            mtime = 0
        return f"{dist}=={version}@{where}#{mtime}"
    return None


def _ir_cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "onnxopt" / "onnxruntime-ir-version.json"


@functools.cache
def onnxruntime_max_ir_version() -> int | None:
    """The highest model IR version the installed onnxruntime accepts (None if not installed).

    Found by asking onnxruntime to load a one-node model at descending IR versions, so it is
    exact for whatever build is installed (CPU or GPU). Importing onnxruntime and probing costs
    about half a second, so the answer is kept in ``~/.cache/onnxopt/onnxruntime-ir-version.json``
    keyed by the installed distribution, version and location (read without importing it).
    """
    import json

    identity = _onnxruntime_identity()
    if identity is None:
        return None
    cache = _ir_cache_file()
    try:
        known = json.loads(cache.read_text())
        if isinstance(known.get(identity), int):
            return known[identity]
    except (OSError, ValueError, AttributeError):
        known = {}
    version = _probe_onnxruntime_ir_version()
    if version is not None:
        try:
            known = known if isinstance(known, dict) else {}
            known[identity] = version
            cache.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".ir-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(known, f)
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home: probe again next time
    return version


def _probe_onnxruntime_ir_version() -> int | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    options = ort.SessionOptions()
    options.log_severity_level = 4
    for version in range(onnx.IR_VERSION, 6, -1):
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=version)
        try:
            ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception:
            continue
        return version
    return None


def clamp_ir_version(model: ir.Model) -> None:
    """Lower the model's IR version to one the installed onnxruntime accepts."""
    limit = onnxruntime_max_ir_version()
    if limit is not None and model.ir_version > limit:
        model.ir_version = limit


def _initializer_bytes(model: ir.Model) -> int:
    total = 0
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                total += value.const_value.nbytes
    return total


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()


def save(
    model: ir.Model,
    path: str | os.PathLike,
    *,
    external_data: str | bool | None = None,
    size_threshold: int = 1024,
    protect: frozenset = frozenset(),
) -> Path:
    """Write ``model`` to ``path`` atomically.

    ``external_data``: a file name (relative to the model's directory) to put weights in, True for
    ``<model file name>.data``, False to force one file, None to decide: external when the weights
    would push the file past protobuf's 2 GiB limit.

    Everything is first written into a temporary directory beside ``path``, then renamed into
    place (the data file first, the model last), so a failure leaves neither a partial model nor
    a model paired with the wrong weights. A data file that the model reads its weights from, or
    that is in ``protect`` (the input's data files), is never overwritten.
    """
    path = Path(path)
    if external_data is None:
        external_data = _initializer_bytes(model) >= _PROTO_LIMIT
    if external_data is True:
        external_data = path.name + ".data"
    parent = path.parent if str(path.parent) else Path(".")
    if external_data:
        data_path = parent / str(external_data)
        if Path(str(external_data)).is_absolute() or ".." in Path(str(external_data)).parts:
            raise UsageError(f"external data name {external_data!r} must be a plain name beside the model")
        if data_path.resolve() in external_data_files(model) | protect:
            raise UsageError(
                f"external data file {data_path} holds the input's weights; choose another name or directory"
            )
    clamp_ir_version(model)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    try:
        staged = staging / path.name
        if external_data:
            ir.save(model, staged, external_data=str(external_data), size_threshold_bytes=size_threshold)
            staged_data = staging / str(external_data)
            if staged_data.exists():
                os.chmod(staged_data, FILE_MODE)
                os.replace(staged_data, parent / str(external_data))
        elif not write_streamed(model, staged):
            ir.save(model, staged)
        os.chmod(staged, FILE_MODE)
        os.replace(staged, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


_STREAM_MIN_BYTES = 1024


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _tensor_buffer(tensor) -> memoryview | bytes:
    """The tensor's little-endian bytes, without a copy where its numpy array already is them."""
    if isinstance(tensor, ir.Tensor) and tensor.dtype.itemsize * 8 >= 8 and tensor.dtype != ir.DataType.STRING:
        try:
            array = tensor.numpy()
            if (array.flags.c_contiguous and array.dtype.byteorder in ("<", "=", "|")
                    and array.dtype.itemsize == tensor.dtype.itemsize):
                # (a uint8 view: ml_dtypes arrays, bfloat16 and float8, export no buffer of their own)
                return memoryview(array.reshape(-1).view(np.uint8))
        except Exception:  # noqa: BLE001
            pass
    return tensor.tobytes()


@contextlib.contextmanager
def detached_initializers(graph: ir.Graph, values: list[ir.Value]):
    """Take ``values`` out of ``graph``'s initializers for the duration; afterwards the
    initializers are what they were, in the same order, whatever happened meanwhile."""
    order = list(graph.initializers.values())
    try:
        for value in values:
            graph.initializers.pop(value.name)
        yield
    finally:
        for value in order:
            graph.initializers.pop(value.name, None)
        for value in order:
            graph.initializers.add(value)


def write_streamed(model: ir.Model, path: Path) -> bool:
    """Write ``model`` as one file, streaming large initializers' bytes from their buffers.

    protobuf would copy every weight twice (into the ModelProto, then into the serialized
    string); here the graph is serialized without its large initializers and each large tensor
    is written after it as a GraphProto ``initializer`` field (protobuf allows a message's fields
    in any order and concatenates repeated ones), so weights are copied at most once. The result
    parses to the same ModelProto as onnx's own serialization, except that large initializers
    come after the small ones. Returns False (nothing written) where this does not apply:
    external or string tensors, or a model that would pass protobuf's 2 GiB limit.
    """
    graph = model.graph
    big: list[ir.Value] = []
    total = 0
    for value in graph.initializers.values():
        tensor = value.const_value
        if tensor is None or isinstance(tensor, (ir.ExternalTensor, ir.StringTensor)):
            if isinstance(tensor, ir.ExternalTensor):
                return False
            continue
        if tensor.nbytes < _STREAM_MIN_BYTES:
            continue
        if value.meta.get("quant_parameter_tensor_names") or value.metadata_props or value.doc_string:
            continue  # annotations onnx_ir writes beside the initializer: left to its serializer
        big.append(value)
        total += tensor.nbytes
    if not big or total >= _PROTO_LIMIT:
        return False
    with detached_initializers(graph, big):
        proto = ir.serde.serialize_model(model)
    inputs = {v.name for v in graph.inputs}
    for value in big:  # the value_info onnx_ir writes for an initializer that is not an input
        if value.name not in inputs and (value.type is not None or value.shape is not None):
            ir.serde.serialize_value_into(proto.graph.value_info.add(), value)
    graph_bytes = proto.graph.SerializeToString()
    proto.ClearField("graph")
    entries: list = []
    graph_len = len(graph_bytes)
    for value in big:
        tensor = value.const_value
        header = onnx.TensorProto(name=value.name, data_type=tensor.dtype.value, dims=list(tensor.shape.numpy()))
        if tensor.doc_string:
            header.doc_string = tensor.doc_string
        for key, val in tensor.metadata_props.items():
            entry = header.metadata_props.add()
            entry.key, entry.value = key, val
        data = _tensor_buffer(tensor)
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        head = header.SerializeToString() + b"\x4a" + _varint(n)  # raw_data = field 9, bytes
        prefix = b"\x2a" + _varint(len(head) + n) + head  # GraphProto.initializer = field 5
        entries.append((prefix, data))
        graph_len += len(prefix) + n
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
        f.write(b"\x3a" + _varint(graph_len))  # ModelProto.graph = field 7
        f.write(graph_bytes)
        for prefix, data in entries:
            f.write(prefix)
            f.write(data)
    return True


def to_proto(model: ir.Model) -> onnx.ModelProto:
    clamp_ir_version(model)
    return ir.to_proto(model)


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    a, b = Path(a), Path(b)
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def give_back(loaded: Loaded, output: str | os.PathLike | None, *, external_data: str | bool | None = None):
    """Return the optimized model in the form it came in (writing it when it came as a path)."""
    model = loaded.model
    if loaded.kind == "path":
        if output is None:
            raise UsageError("a model given as a path needs output= (the input file is never overwritten)")
        if loaded.path is not None and same_file(loaded.path, output):
            raise UsageError(f"output {output} is the input file; onnxopt never modifies its input")
        if Path(output).resolve() in loaded.data_files:
            raise UsageError(f"output {output} is the input's external data file; onnxopt never modifies its input")
        if external_data is None and loaded.external:
            external_data = True
        written = save(model, output, external_data=external_data, protect=loaded.data_files)
        return type(output)(written) if isinstance(output, (str, Path)) else written
    if output is not None:
        save(model, output, external_data=external_data)
    if loaded.kind == "ir":
        clamp_ir_version(model)
        return model
    if loaded.kind == "proto":
        return to_proto(model)
    return to_proto(model).SerializeToString()
