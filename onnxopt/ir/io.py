"""Loading and saving models in every form users hold them.

Inputs may be a path, ``bytes``, an ``onnx.ModelProto``, an ``onnx_ir.Model`` or an
``onnx_graphsurgeon.Graph``; the caller gets back the same kind. Bad input raises :class:`InvalidModelError` with a one-line message. Weights
are never copied on load: a ModelProto's tensors are wrapped, not copied, and external data is
memory-mapped lazily by onnx_ir. Saving writes to a temporary file next to the target and renames
it into place, so a failure never leaves a half-written model and the input is never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.errors import InvalidModelError, UsageError
from onnxopt.ir.util import declare_domains, graphs, graphs_below, proto_graphs  # noqa: F401  (proto_graphs: also io's, for its callers)

ModelLike = Union[str, os.PathLike, bytes, onnx.ModelProto, ir.Model, "onnx_graphsurgeon.Graph"]

# Protobuf cannot serialize a message of 2 GiB or more; keep well clear of it.
PROTO_LIMIT = 2**31 - 2**26


@dataclasses.dataclass
class Loaded:
    """An IR model plus what we need to give it back in the form it came in."""

    model: ir.Model
    kind: str  # "path" | "bytes" | "proto" | "ir" | "gs"
    path: Path | None = None
    external: bool = False  # the input kept (some) weights in external data files
    data_files: frozenset = frozenset()  # those files (resolved): never to be overwritten
    exported: onnx.ModelProto | None = None  # a graphsurgeon Graph's export: the input as onnx reads it
    source: onnx.ModelProto | None = None  # a file's or bytes' ModelProto the model was read from (sparse made dense)


def first_line(exc: BaseException, limit: int = 400, *, typed: bool = False) -> str:
    """The message folded onto one line (checker messages span several), capped in length;
    ``typed``: after the exception's type name."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip() and not line.strip().startswith("==>"))
    text = text or type(exc).__name__
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if typed else text


def _parse(data: bytes, what: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError (a Message.Error subclass)
        raise InvalidModelError(f"{what} {_why_unparsable(data, exc)}") from None
    if not proto.HasField("graph"):
        if data[:1] == b"\x08" and proto.ir_version > 0:
            raise InvalidModelError(f"{what} is a truncated ONNX file (it ends before its graph)")
        raise InvalidModelError(f"{what} is not an ONNX model (it has no graph)")
    if proto.ir_version <= 0:
        raise InvalidModelError(f"{what} is not a valid ONNX model: it declares no IR version")
    if not proto.opset_import:
        raise InvalidModelError(f"{what} is not a valid ONNX model: it declares no opset_import (the operator "
                                "set versions its nodes follow)")
    _check_opsets(proto, what)
    return proto


def _why_unparsable(data: bytes, exc: Exception) -> str:
    """What is wrong with bytes that do not parse as a ModelProto, as the end of a sentence."""
    text = str(exc)
    if "depth" in text.lower() or "recursion" in text.lower():
        return ("nests messages deeper than protobuf can read (100 levels: subgraphs within subgraphs); "
                "it cannot be loaded")
    for kind in (onnx.TensorProto, onnx.GraphProto, onnx.NodeProto):
        other = kind()
        try:
            other.ParseFromString(data)
        except Exception:  # noqa: BLE001 - not this kind either
            continue
        # exactly these bytes again: a serialized message of that kind (not a model cut short)
        if other.ByteSize() == len(data) and other.SerializeToString() == data and _looks_like(other):
            return f"is a serialized {kind.DESCRIPTOR.name}, not an ONNX model (a ModelProto)"
    if data[:1] == b"\x08" and len(data) > 16:
        # starts like a ModelProto (field 1 = ir_version, varint): most likely cut short
        return f"is a truncated or corrupted ONNX file ({len(data)} bytes; protobuf: {first_line(exc)})"
    return "is not an ONNX model (it does not parse as one)"


def _looks_like(message) -> bool:
    if isinstance(message, onnx.TensorProto):
        return message.data_type > 0
    if isinstance(message, onnx.GraphProto):
        return len(message.node) > 0 or len(message.output) > 0
    return bool(message.op_type)


def _check_opsets(proto: onnx.ModelProto, what: str) -> None:
    """Refuse an operator set newer than the installed onnx knows: nothing here could check,
    fold or shape such nodes by the rules their version defines."""
    known = {"": onnx.defs.onnx_opset_version(), "ai.onnx": onnx.defs.onnx_opset_version(),
             "ai.onnx.ml": onnx.defs.onnx_ml_opset_version()}
    for entry in [*proto.opset_import, *(e for f in proto.functions for e in f.opset_import)]:
        limit = known.get(entry.domain)
        if limit is not None and entry.version > limit:
            raise InvalidModelError(
                f"{what} imports opset {entry.version} of domain '{entry.domain or 'ai.onnx'}', newer than the "
                f"installed onnx {onnx.__version__} knows (up to {limit}); upgrade onnx or export with an older opset"
            )


def _check(target: onnx.ModelProto | bytes | str, what: str) -> None:
    try:
        onnx.checker.check_model(target)
    except Exception as exc:
        raise InvalidModelError(f"{what} fails the ONNX checker: {first_line(exc)}") from None


def _all_tensor_protos(proto: onnx.ModelProto):
    """Every TensorProto of the model that can hold data: initializers (sparse ones' values and
    indices too) and tensor attributes (Constant nodes), in every graph and local function."""
    def from_nodes(nodes):
        for node in nodes:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors
                elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                    yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
                elif attr.type == onnx.AttributeProto.SPARSE_TENSORS:
                    for s in attr.sparse_tensors:
                        yield from (s.values, s.indices)

    for graph in proto_graphs(proto.graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from (sparse.values, sparse.indices)
        yield from from_nodes(graph.node)
    for function in proto.functions:
        for node_graph in (g for n in function.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH
                           for g in proto_graphs(a.g)):
            yield from node_graph.initializer
            yield from from_nodes(node_graph.node)
        yield from from_nodes(function.node)


def _tensor_nbytes(tensor: onnx.TensorProto) -> int | None:
    """The bytes a tensor's data takes in raw form (sub-byte types packed), None for strings."""
    try:
        dtype = ir.DataType(tensor.data_type)
    except ValueError:
        return None
    if dtype in (ir.DataType.STRING, ir.DataType.UNDEFINED):
        return None
    count = 1
    for d in tensor.dims:
        count *= d
    return (count * dtype.bitwidth + 7) // 8


def _external_location(location: str, base_dir: Path, tensor: str, what: str) -> Path:
    """The data file a tensor names, refused on the name alone when it would leave the model's
    folder (absolute, '..', a symbolic link inside the folder): nothing outside is ever looked at."""
    if "\0" in location:
        raise InvalidModelError(
            f"{what}: external data location {location!r} of tensor '{tensor}' holds a NUL character; refused")
    parts = Path(location).parts
    if not location or Path(location).is_absolute() or "\\" in location or ".." in parts:
        raise InvalidModelError(
            f"{what}: external data location {location!r} of tensor '{tensor}' is not a relative path inside "
            "the model's folder; refused")
    path = base_dir
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise InvalidModelError(
                f"{what}: external data location {location!r} of tensor '{tensor}' goes through a symbolic "
                "link; refused")
    return path


def _external_int(info: dict, key: str, tensor: str, what: str) -> int | None:
    if key not in info:
        return None
    text = info[key].strip()
    if not (text.isascii() and text.isdigit()):  # (str.isdigit alone takes '²' and other scripts' digits)
        raise InvalidModelError(
            f"{what}: external data {key} {info[key]!r} of tensor '{tensor}' is not a non-negative integer")
    digits = text.lstrip("0")
    if len(digits) > 19 or int(digits or "0") >= 2**63:
        raise InvalidModelError(
            f"{what}: external data {key} of tensor '{tensor}' ({len(digits)} digits) does not fit 64 bits")
    return int(digits or "0")


def check_external_data(proto: onnx.ModelProto, base_dir: Path, what: str) -> bool:
    """Raise if a tensor's external data is unsafe (its location leaves the model's folder), missing,
    too short, or of a length that does not fit the tensor; return whether any tensor has some."""
    sizes: dict[Path, int] = {}
    found = False
    for tensor in _all_tensor_protos(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        found = True
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        path = _external_location(location, base_dir, tensor.name, what)
        offset = _external_int(info, "offset", tensor.name, what) or 0
        length = _external_int(info, "length", tensor.name, what)
        if any(d < 0 for d in tensor.dims):
            raise InvalidModelError(f"{what}: tensor '{tensor.name}' has a negative dimension {list(tensor.dims)}")
        need = _tensor_nbytes(tensor)
        if need is None:
            raise InvalidModelError(f"{what}: tensor '{tensor.name}' of type {tensor.data_type} cannot be stored "
                                    "as external data")
        if length is not None and length != need:
            raise InvalidModelError(
                f"{what}: external data of tensor '{tensor.name}' has length {length}, but its type and shape "
                f"take {need} bytes")
        if path not in sizes:
            try:
                sizes[path] = path.stat().st_size if path.is_file() else -1
            except OSError:
                sizes[path] = -1
            if sizes[path] < 0:
                raise InvalidModelError(
                    f"{what}: missing external data file '{location}' (tensor '{tensor.name}', looked for {path})")
        if offset + need > sizes[path]:
            raise InvalidModelError(
                f"{what}: external data file '{location}' is too short for tensor '{tensor.name}' "
                f"(needs {offset + need} bytes, has {sizes[path]})")
    return found


def files_read(path: str | os.PathLike) -> list[Path]:
    """The model file and the external data files it names (those that are safe to name: see
    :func:`check_external_data`), without reading any weights; just the path when it is not a
    readable model (loading it will say why)."""
    path = Path(path)
    files = [path]
    if not path.is_file():  # (a pipe, as from the shell's <(...), can be read only once: by load)
        return files
    try:
        proto = onnx.ModelProto()
        proto.ParseFromString(path.read_bytes())
    except Exception:  # noqa: BLE001 - not a model: load reports it
        return files
    for tensor in _all_tensor_protos(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            with contextlib.suppress(InvalidModelError):
                data = _external_location(location, path.parent, tensor.name, str(path))
                if data not in files:
                    files.append(data)
    return files


def _tensor_slots(model: ir.Model):
    """``(tensor, put, in_attribute)`` for every tensor the model holds, ``put(t)`` replacing it:
    initializers and tensor attributes, in every graph, subgraph and local function."""
    for root in (model.graph, *model.functions.values()):
        for graph in (root, *graphs_below(root)):
            if isinstance(graph, ir.Graph):
                for value in graph.initializers.values():
                    if value.const_value is not None:
                        yield value.const_value, functools.partial(setattr, value, "const_value"), False
            for node in graph:
                if not node.attributes:  # (most nodes: no attribute to look through)
                    continue
                for name, attr in list(node.attributes.items()):
                    kind = attr.type  # (compared first: most attributes hold no tensor)
                    if (kind is not _TENSOR and kind is not _TENSORS) or attr.is_ref() or attr.value is None:
                        continue
                    if kind is _TENSOR:
                        yield attr.value, functools.partial(_put_attribute, node, name, None), True
                    else:
                        for k, tensor in enumerate(attr.value):
                            yield tensor, functools.partial(_put_attribute, node, name, k), True


_TENSOR, _TENSORS = ir.AttributeType.TENSOR, ir.AttributeType.TENSORS


def _put_attribute(node: ir.Node, name: str, index: int | None, tensor) -> None:
    if index is None:
        node.attributes[name] = ir.AttrTensor(name, tensor)
    else:
        values = list(node.attributes[name].value)
        values[index] = tensor
        node.attributes[name] = ir.AttrTensors(name, values)


def external_data_files(model: ir.Model) -> set[Path]:
    """The external data files the model's tensors are read from (resolved paths)."""
    return {Path(t.path).resolve() for t, _, _ in _tensor_slots(model) if isinstance(t, ir.ExternalTensor)}


def _in_memory(tensor: ir.ExternalTensor) -> ir.Tensor:
    """The same tensor without a file behind it (its array is memory-mapped: no copy until written)."""
    return ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name, doc_string=tensor.doc_string,
                     metadata_props=dict(tensor.metadata_props))


@contextlib.contextmanager
def _without_external_references(model: ir.Model, *, attributes_only: bool):
    """For the duration, tensors read from external files are in-memory tensors (all of them, or
    those held in attributes, which onnx_ir's external-data writer leaves pointing at the input's
    files): what is written meanwhile refers to no file but its own. Restored afterwards."""
    undo = []
    for tensor, put, in_attribute in list(_tensor_slots(model)):
        if isinstance(tensor, ir.ExternalTensor) and (in_attribute or not attributes_only):
            put(_in_memory(tensor))
            undo.append((tensor, put))
    try:
        yield
    finally:
        for tensor, put in reversed(undo):
            put(tensor)


def load(source: ModelLike, *, check: bool = True, copy_ir: bool = True) -> Loaded:
    """Load any supported model form into onnx_ir.

    ``check`` runs the ONNX checker and the external-data check (not done for an onnx_ir.Model,
    which is trusted as built). ``copy_ir`` clones an onnx_ir.Model (tensors shared) so the
    caller's object is not mutated.
    """
    if isinstance(source, ir.Model):
        return Loaded(source.clone() if copy_ir else source, "ir")
    if isinstance(source, onnx.ModelProto):
        return _load_proto(source, check, "model")
    gs = _graphsurgeon(source)
    if gs is not None:
        if not copy_ir:
            raise UsageError("inplace=True rewrites an onnx_ir.Model; a graphsurgeon Graph is never modified "
                             "(use the Graph optimize() returns)")
        what = "graphsurgeon Graph"
        try:  # graphsurgeon's own export (it leaves the Graph as it is)
            proto = gs.export_onnx(source)
        except Exception as exc:  # noqa: BLE001 - what it refuses (a graph output without a dtype...): one line
            raise InvalidModelError(f"{what}: onnx_graphsurgeon cannot export it: {first_line(exc)}") from None
        return dataclasses.replace(_load_proto(proto, check, what), kind="gs", exported=proto)
    if isinstance(source, (bytes, bytearray, memoryview)):
        proto, _ = read_checked(source, check=check)
        return Loaded(to_ir(proto, copy=False), "bytes", source=proto)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        proto, external = read_checked(path, check=check)
        model = to_ir(proto, str(path), copy=False)
        for tensor, _, _ in _tensor_slots(model):
            if isinstance(tensor, ir.ExternalTensor):
                tensor.base_dir = path.parent
        files = frozenset(external_data_files(model)) if external else frozenset()
        return Loaded(model, "path", path=path, external=external, data_files=files, source=proto)
    raise UsageError(
        f"cannot load a model from {type(source).__name__}: pass a path, bytes, onnx.ModelProto, onnx_ir.Model "
        "or onnx_graphsurgeon.Graph"
    )


def _load_proto(proto: onnx.ModelProto, check: bool, what: str) -> Loaded:
    _check_opsets(proto, what)
    external = check_external_data(proto, Path("."), what) if check else False
    if check and proto.ByteSize() < PROTO_LIMIT:
        # (a larger proto cannot be serialized for the checker)
        _check(proto, what)
    return Loaded(to_ir(proto), "proto", external=external)


def _graphsurgeon(source: Any):
    """The onnx_graphsurgeon module when ``source`` is one of its Graphs, else None. It is not
    imported here: it is optional, and a Graph exists only once its user has imported it."""
    gs = sys.modules.get("onnx_graphsurgeon")
    return gs if gs is not None and isinstance(source, gs.Graph) else None


SPARSE_DENSE_LIMIT = 256 << 20  # bytes: a sparse tensor is made dense up to this size


def _dense(sparse: onnx.SparseTensorProto, what: str) -> onnx.TensorProto:
    """The dense tensor a SparseTensorProto stands for (indices linear, or coordinates per row)."""
    name = sparse.values.name
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in (sparse.values, sparse.indices)):
        raise InvalidModelError(f"{what}: sparse tensor '{name}' keeps its data in an external file, which onnxopt "
                                "cannot read; store it dense")
    dims = [int(d) for d in sparse.dims]
    values = onnx.numpy_helper.to_array(sparse.values)
    nbytes = int(np.prod(dims, dtype=np.int64)) * values.dtype.itemsize
    if nbytes > SPARSE_DENSE_LIMIT:
        raise InvalidModelError(f"{what}: sparse tensor '{name}' would take {nbytes} bytes dense; onnxopt keeps "
                                f"no sparse tensors and makes them dense only up to {SPARSE_DENSE_LIMIT} bytes")
    indices = onnx.numpy_helper.to_array(sparse.indices).astype(np.int64)
    dense = np.zeros(int(np.prod(dims, dtype=np.int64)), dtype=values.dtype)
    flat = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), dims)
    dense[flat] = values.reshape(-1)
    return onnx.numpy_helper.from_array(dense.reshape(dims), name)


def _without_sparse(proto: onnx.ModelProto, what: str, *, copy: bool) -> onnx.ModelProto:
    """The model with its sparse tensors made dense (sparse initializers become initializers,
    Constant ``sparse_value`` becomes ``value``): onnx_ir cannot hold them and would drop a sparse
    initializer without a word. The same values: onnxruntime makes them dense when it loads them."""
    sparse_kinds = (onnx.AttributeProto.SPARSE_TENSOR, onnx.AttributeProto.SPARSE_TENSORS)

    def parts(model: onnx.ModelProto):
        graphs = list(proto_graphs(model.graph))
        for function in model.functions:
            graphs += [g for n in function.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH
                       for g in proto_graphs(a.g)]
        return graphs, [n for g in graphs for n in g.node] + [n for f in model.functions for n in f.node]

    graphs, nodes = parts(proto)
    if not any(g.sparse_initializer for g in graphs) and not any(
            a.type in sparse_kinds for n in nodes for a in n.attribute):
        return proto
    if copy:
        proto = onnx.ModelProto.FromString(proto.SerializeToString())
        graphs, nodes = parts(proto)
    for graph in graphs:
        for sparse in graph.sparse_initializer:
            graph.initializer.append(_dense(sparse, what))
        graph.ClearField("sparse_initializer")
    for node in nodes:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.SPARSE_TENSORS:
                raise InvalidModelError(f"{what}: node '{node.name}' has a list of sparse tensors, which onnxopt "
                                        "cannot read")
            if attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                dense = _dense(attr.sparse_tensor, what)
                attr.ClearField("sparse_tensor")
                attr.t.CopyFrom(dense)
                attr.type = onnx.AttributeProto.TENSOR
                if node.op_type == "Constant" and attr.name == "sparse_value":
                    attr.name = "value"
    return proto


def to_ir(proto: onnx.ModelProto, what: str = "model", *, copy: bool = True) -> ir.Model:
    """onnx_ir's model of ``proto`` (not changed, unless ``copy`` is False), sparse tensors dense."""
    return ir.from_proto(_without_sparse(proto, what, copy=copy))


def read_checked(source: str | os.PathLike | bytes | bytearray | memoryview, *, check: bool = True,
                 what: str | None = None) -> tuple[onnx.ModelProto, bool]:
    """The ModelProto of a model file or serialized bytes, validated as :func:`load` validates
    (one-line InvalidModelError for a missing file, a file that is not ONNX or is truncated, a
    missing or short external-data file, and with ``check`` the ONNX checker), and whether its
    weights live in external files (not read). ``what`` names it in messages."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        proto = _parse(data, what or "input bytes")
        external = check_external_data(proto, Path("."), what or "input bytes")  # (relative to the current folder)
        if check:
            _check(proto if external else data, what or "model")
        return proto, external
    path = Path(source)
    what = what or str(path)
    if not path.exists():
        raise InvalidModelError(f"{what}: no such file")
    if path.is_dir():
        raise InvalidModelError(f"{what}: is a directory, not an ONNX file")
    try:
        with open(path, "rb") as f:  # (a pipe or a device has no size: read at most what one model can be)
            data = f.read(PROTO_LIMIT + 1)
    except OSError as exc:
        raise InvalidModelError(f"{what}: cannot read ({exc.strerror})") from None
    if len(data) > PROTO_LIMIT:
        raise InvalidModelError(f"{what}: more than {PROTO_LIMIT} bytes, past what protobuf reads as one model "
                                "(a model this large keeps its weights in external data files)")
    proto = _parse(data, what)
    # A missing data file is reported as such, before the checker reports it less clearly.
    external = check_external_data(proto, path.parent, what)
    if check:
        # The bytes in hand spare the checker a second read of the file; with external data
        # it needs the path to find the data files.
        _check(str(path) if external else data, what)
    return proto, external


def package_dir(name: str) -> Path | None:
    """The folder of an installed package, found without importing it; None when it is absent."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _onnxruntime_build() -> str | None:
    """The installed onnxruntime build, without importing it: its distribution and version, and a
    fingerprint of its build information and native libraries (names and sizes), so that CPU,
    GPU and custom builds of one version differ while every environment with the same build
    agrees. None when onnxruntime is not installed."""
    import hashlib
    import importlib.metadata

    folder = package_dir("onnxruntime")
    if folder is None:
        return None
    capi = folder / "capi"
    for dist in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        digest = hashlib.sha256(f"{dist}=={version}".encode())
        with contextlib.suppress(OSError):
            digest.update((capi / "build_and_package_info.py").read_bytes())
            for lib in sorted(capi.iterdir()):
                if ".so" in lib.name or lib.suffix in (".pyd", ".dll", ".dylib"):
                    digest.update(f"{lib.name}:{lib.stat().st_size}".encode())
        return f"{dist}-{version}-{digest.hexdigest()[:16]}"
    return None


def ir_cache_dir() -> Path | None:
    """Where onnxopt keeps what it learned about the installed onnxruntime:
    ``$XDG_CACHE_HOME/onnxopt`` (default ``~/.cache/onnxopt``); None without a home folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):  # no home folder (expanduser left "~") or a relative setting: no cache
        return None
    return Path(base) / "onnxopt"


@functools.cache
def onnxruntime_max_ir_version() -> int | None:
    """The highest model IR version the installed onnxruntime accepts (None if not installed).

    Found by asking onnxruntime to load a one-node model at descending IR versions, so it is
    exact for whatever build is installed (CPU or GPU). Importing onnxruntime and probing costs
    about half a second, so the answer is kept in ``ir_cache_dir()/onnxruntime-<version>-<build
    fingerprint>.json``, one small file per onnxruntime build (shared by the environments that
    have that build). Set ``XDG_CACHE_HOME`` to move it; deleting it costs one probe. A cache that
    cannot be read or written is passed over: the probe's answer is used all the same.
    """
    build = _onnxruntime_build()
    if build is None:
        return None
    folder = ir_cache_dir()
    cache = folder / f"onnxruntime-ir-{build}.json" if folder is not None else None
    if cache is not None:
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError, KeyError):
            known = json.loads(cache.read_text())["max_ir_version"]
            if isinstance(known, int) and 3 <= known <= onnx.IR_VERSION:
                return known
    version = _probe_onnxruntime_ir_version()
    if version is not None and cache is not None:
        tmp = None
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".ir-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"onnxruntime": build, "max_ir_version": version}, f)
            os.replace(tmp, cache)
        except BaseException as exc:  # a read-only or full home: probe again next time (Ctrl-C: no tmp left)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if not isinstance(exc, OSError):
                raise
    return version


def onnxruntime_module():
    """The onnxruntime module, or None when it is not installed. An installed onnxruntime that fails
    to import (a broken or mixed install) is an error, not "not installed": folding and the IR
    version would silently differ from what the user's onnxruntime does."""
    try:
        import onnxruntime
    except ImportError as exc:
        if getattr(exc, "name", None) == "onnxruntime":
            return None
        raise UsageError(f"onnxruntime is installed but fails to import ({first_line(exc, 200)}); repair it "
                         "(pip install --force-reinstall onnxruntime, or onnxruntime-gpu) or uninstall it") from None
    except Exception as exc:  # noqa: BLE001 - a broken native library raises anything
        raise UsageError(f"onnxruntime is installed but fails to import ({first_line(exc, 200, typed=True)}); "
                         "repair it (pip install --force-reinstall onnxruntime, or onnxruntime-gpu) or "
                         "uninstall it") from None
    return onnxruntime


def _probe_onnxruntime_ir_version() -> int | None:
    ort = onnxruntime_module()
    if ort is None:
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


def initializer_bytes(model: ir.Model) -> int:
    total = 0
    for graph in graphs(model):
        for value in graph.initializers.values():
            if value.const_value is not None:
                total += value.const_value.nbytes
    return total


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()


class Outputs:
    """The files one command writes, checked before anything is written and put in place together.

    Every target is *claimed* first (:meth:`claim`): it may not be a file the command reads (an
    input model or its external data, :meth:`protect`; compared after resolving symbolic links
    and by inode, so a hard link counts), nor another output of the same command, nor a directory;
    its folder must exist and take a new file (a staging directory is made there at once). Files
    are then written into those staging directories (:meth:`stage`), and :meth:`commit` renames
    them into place in claim order (a model's data file before the model that refers to it). Any
    failure, an interrupt included, before or during the commit removes what was staged and what
    was already renamed: no output is left. As a context manager it commits on success and
    cleans up on an exception.
    """

    def __init__(self, protect: Iterable[str | os.PathLike] = ()):
        self._protected: list[tuple[Path, tuple[int, int] | None, str]] = []
        self._claims: list[tuple[Path, str, Path]] = []  # (target, what, staging directory)
        self._staged: dict[Path, Path] = {}
        for path in protect:
            self.protect(path)

    @staticmethod
    def _identity(path: Path) -> tuple[Path, tuple[int, int] | None]:
        try:
            st = os.stat(path)
            inode = (st.st_dev, st.st_ino)
        except OSError:
            inode = None
        return path.resolve(), inode

    def _clash(self, path: Path, others) -> str | None:
        resolved, inode = self._identity(path)
        for other, other_inode, what in others:
            if resolved == other or (inode is not None and inode == other_inode):
                return what
        return None

    def protect(self, path: str | os.PathLike, what: str | None = None) -> None:
        """``path`` is read by the command: no output may be it (checked for claims made already too)."""
        path = Path(path)
        what = what or f"the input {path}"
        self._protected.append((*self._identity(path), what))
        for target, claimed_as, _ in self._claims:
            if self._clash(target, self._protected[-1:]):
                raise UsageError(f"{claimed_as} {target} is {what}; onnxopt never overwrites what it reads")

    def claim(self, path: str | os.PathLike, what: str) -> Path:
        """Reserve ``path`` as an output (``what`` names it in messages: "-o", "--json", ...)."""
        path = Path(path)
        if not path.name or path.name in (".", "..") or "\0" in str(path):
            raise UsageError(f"{what} {str(path)!r}: not a file name")
        clash = self._clash(path, self._protected)
        if clash:
            raise UsageError(f"{what} {path} is {clash}; onnxopt never overwrites what it reads")
        clash = self._clash(path, [(*self._identity(t), f"also the {w} output") for t, w, _ in self._claims])
        if clash:
            raise UsageError(f"{what} {path} is {clash}; give each output its own file")
        if path.is_dir():
            raise UsageError(f"{what} {path} is a directory; name a file")
        if path.exists() and not path.is_file():  # (/dev/stdout, a pipe: the rename would replace it)
            raise UsageError(f"{what} {path} is not a regular file (a device, pipe or socket); onnxopt writes "
                             "files, renaming them into place")
        parent = path.parent
        if not parent.is_dir():
            raise UsageError(f"{what} {path}: folder {parent} does not exist")
        try:
            staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
        except OSError as exc:
            raise UsageError(f"{what} {path}: cannot write in folder {parent} ({exc.strerror})") from None
        self._claims.append((path, what, staging))
        return path

    def stage(self, path: str | os.PathLike) -> Path:
        """Where to write the claimed ``path`` now; it is moved into place by :meth:`commit`."""
        path = Path(path)
        for target, _, staging in self._claims:
            if target == path:
                self._staged[target] = staging / path.name
                return self._staged[target]
        raise ValueError(f"{path} was not claimed")

    def unstage(self, path: str | os.PathLike) -> None:
        """Nothing is to be written at ``path`` after all (e.g. an empty data file)."""
        staged = self._staged.pop(Path(path), None)
        if staged is not None and staged.exists():
            staged.unlink()

    def commit(self) -> None:
        done: list[tuple[Path, tuple[int, int]]] = []  # (target, the identity of the file put there)
        try:
            for target, _, _ in self._claims:
                staged = self._staged.get(target)
                if staged is None:
                    continue
                os.chmod(staged, FILE_MODE)
                st = os.stat(staged)
                # noted before the rename: an interrupt may arrive right after it
                done.append((target, (st.st_dev, st.st_ino)))
                os.replace(staged, target)
        except BaseException:
            for target, identity in done:
                with contextlib.suppress(OSError):
                    st = os.lstat(target)
                    if (st.st_dev, st.st_ino) == identity:  # (what was there before is not ours to remove)
                        target.unlink()
            raise
        finally:
            self.abort()

    def abort(self) -> None:
        """Remove what was staged; claims end."""
        for _, _, staging in self._claims:
            shutil.rmtree(staging, ignore_errors=True)
        self._claims.clear()
        self._staged.clear()

    def __enter__(self) -> "Outputs":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


def data_file_name(path: str | os.PathLike, external_data: str | bool) -> str:
    """The external data file name for a model written to ``path``: True means ``<name>.data``;
    a given name must be a plain file name (it is written beside the model)."""
    name = Path(path).name + ".data" if external_data is True else str(external_data)
    if len(Path(name).parts) != 1 or name in (".", "..") or "\\" in name:
        raise UsageError(f"external data name {name!r} must be a plain file name (it is written beside the model)")
    return name


@dataclasses.dataclass
class SavePlan:
    """Where :func:`write` puts a model: claimed in ``outputs`` before anything is computed."""

    path: Path
    data_name: str | None  # the external data file beside it, or None for one file
    outputs: Outputs
    own: bool  # the plan made ``outputs`` and commits it


def plan_save(model: ir.Model, path: str | os.PathLike, *, external_data: str | bool | None = None,
              protect: Iterable[str | os.PathLike] = (), outputs: Outputs | None = None) -> SavePlan:
    """Check and claim ``path`` (and its data file) for :func:`write`; see :func:`save`."""
    path = Path(path)
    own = outputs is None
    outputs = outputs if outputs is not None else Outputs()
    try:
        for protected in (*protect, *external_data_files(model)):
            outputs.protect(protected, f"a file the model is read from ({protected})")
        if external_data == "":
            raise UsageError("the external data file name is empty (to keep the weights in the model file: "
                             "--single-file, external_data=False)")
        if external_data is None:
            external_data = initializer_bytes(model) >= PROTO_LIMIT
        elif external_data is False:
            _check_fits_one_file(model, path)  # (before the work, not after it)
        data_name = data_file_name(path, external_data) if external_data else None
        if data_name:
            outputs.claim(path.parent / data_name, "the external data file")
        outputs.claim(path, "the output")
    except BaseException:
        if own:
            outputs.abort()
        raise
    return SavePlan(path, data_name, outputs, own)


def _check_fits_one_file(model: ir.Model, path: Path) -> None:
    size = initializer_bytes(model)
    if size >= PROTO_LIMIT:
        raise UsageError(f"{path}: the weights ({size / 2**30:.1f} GiB) pass protobuf's 2 GiB limit for one file; "
                         "save them as external data (--external-data, external_data=True)")


def write(model: ir.Model, plan: SavePlan, *, size_threshold: int = 1024) -> Path:
    """Write ``model`` as planned: staged beside the targets, committed when the plan owns its
    :class:`Outputs` (else the caller commits). Tensors the model reads from other files (the
    input's external data) are written into the output's own files, never referred to."""
    outputs, path = plan.outputs, plan.path
    try:
        clamp_ir_version(model)
        staged = outputs.stage(path)
        if plan.data_name:
            data_path = path.parent / plan.data_name
            staged_data = outputs.stage(data_path)
            with _without_external_references(model, attributes_only=True):
                ir.save(model, staged, external_data=plan.data_name, size_threshold_bytes=size_threshold)
            written = staged.parent / plan.data_name  # (onnx_ir writes it beside the staged model)
            if written.exists() and written.stat().st_size > 0:
                os.replace(written, staged_data)
            else:
                outputs.unstage(data_path)  # no weight reached the threshold: no empty data file
        else:
            with _without_external_references(model, attributes_only=False):
                _check_fits_one_file(model, path)
                if not write_streamed(model, staged):
                    ir.save(model, staged)
        if plan.own:
            outputs.commit()
    except BaseException:
        if plan.own:
            outputs.abort()
        raise
    return path


def save(model: ir.Model, path: str | os.PathLike, *, external_data: str | bool | None = None,
         size_threshold: int = 1024, protect: Iterable[str | os.PathLike] = (),
         outputs: Outputs | None = None) -> Path:
    """Write ``model`` to ``path`` atomically, to be run from there alone.

    ``external_data``: a file name (beside the model) to put weights in, True for
    ``<model file name>.data``, False to force one file, None to decide: external when the weights
    would push the file past protobuf's 2 GiB limit. Weights the model reads from other files
    (the input's external data) are written into the output's own files, never referred to.
    No data file is written when no tensor reaches ``size_threshold``.

    The files are claimed in ``outputs`` (a new :class:`Outputs`, committed here, when not given;
    a caller that passes its own commits it with its other files) and written to staging files
    beside their targets; the data file is renamed into place before the model. A file in
    ``protect`` (the input and its data files) or one the model reads its weights from is never
    written.
    """
    plan = plan_save(model, path, external_data=external_data, protect=protect, outputs=outputs)
    return write(model, plan, size_threshold=size_threshold)


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
    initializers are what they were, in the same order, whatever happened meanwhile (none to take
    out: the initializers are left alone, as the block itself must leave them)."""
    if not values:
        yield
        return
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
    if not big or total >= PROTO_LIMIT:
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
        n = tensor.nbytes  # (the buffer is taken when written: a tensor computed when read is held one at a time)
        head = header.SerializeToString() + b"\x4a" + _varint(n)  # raw_data = field 9, bytes
        prefix = b"\x2a" + _varint(len(head) + n) + head  # GraphProto.initializer = field 5
        entries.append((prefix, tensor, n))
        graph_len += len(prefix) + n
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
        f.write(b"\x3a" + _varint(graph_len))  # ModelProto.graph = field 7
        f.write(graph_bytes)
        for prefix, tensor, n in entries:
            data = _tensor_buffer(tensor)
            if (data.nbytes if isinstance(data, memoryview) else len(data)) != n:
                raise AssertionError(f"tensor {tensor.name!r} gave {len(data)} bytes, its type and shape {n}")
            f.write(prefix)
            f.write(data)
            del data
    return True


def to_proto(model: ir.Model) -> onnx.ModelProto:
    clamp_ir_version(model)
    return ir.to_proto(model)


def plan_give_back(loaded: Loaded, output: str | os.PathLike | None, *, external_data: str | bool | None = None,
                   outputs: Outputs | None = None, also_read: Iterable[str | os.PathLike] = ()) -> SavePlan | None:
    """Check and claim where :func:`give_back` will write (None: nothing to write), before any
    work is done. The input file, its data files and the files in ``also_read`` are never
    written (see :class:`Outputs`)."""
    if output is None:
        if loaded.kind == "path":
            raise UsageError("a model given as a path needs output= (the input file is never overwritten)")
        return None
    if external_data is None and loaded.external and loaded.kind == "path":
        external_data = True
    protect = [p for p in (loaded.path, *loaded.data_files, *also_read) if p is not None]
    return plan_save(loaded.model, output, external_data=external_data, protect=protect, outputs=outputs)


VERSION_KEY = "onnxopt.version"  # the model's metadata_props: the onnxopt that processed it
# the model's metadata_props: "right" ("none") where it was optimized for attention masks padded at the end of
# each row (not padded: --padding right/none): the verifier feeds such masks
PADDING_KEY = "onnxopt.padding"


def record_version(model: ir.Model) -> None:
    """Note in the model's ``metadata_props`` that onnxopt processed it: ``onnxopt.version``, the
    package version alone (no date or commit: the same input still gives the same bytes). A model
    optimized again keeps one entry, holding the version that ran last; ``producer_name`` (the
    exporter) is left alone."""
    from onnxopt._version import __version__

    model.metadata_props[VERSION_KEY] = __version__


def give_back(loaded: Loaded, output: str | os.PathLike | None, plan: SavePlan | None):
    """Return the optimized model in the form it came in, writing it as planned; it records the
    onnxopt version that made it (:func:`record_version`), and imports every domain its nodes use
    (:func:`irutil.declare_domains`: a contrib op made by a rule or a pass)."""
    model = loaded.model
    record_version(model)
    declare_domains(model)
    if plan is not None:
        write(model, plan)
    if loaded.kind == "path":
        return type(output)(plan.path) if isinstance(output, (str, Path)) else plan.path
    if loaded.kind == "ir":
        clamp_ir_version(model)
        return model
    if loaded.kind == "proto":
        return to_proto(model)
    if loaded.kind == "gs":  # a new Graph, by graphsurgeon's own import
        return sys.modules["onnx_graphsurgeon"].import_onnx(to_proto(model))
    return to_proto(model).SerializeToString()
