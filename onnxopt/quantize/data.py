"""Calibration data: where the feeds come from, and their validation against the model.

:func:`open_calibration` takes any of these sources and gives a :class:`CalibrationSet`, a
validated, re-iterable, indexable sequence of feeds (``{input name: array}``), which calibration
walks twice (ranges, then histograms) and :meth:`CalibrationSet.shard` splits across processes:

- **a folder** of ``.npy`` / ``.npz`` files, one feed per file, taken in sorted file-name order
  (plain string order: name them ``0007.npz``, not ``7.npz``, if the order matters to you; other
  files and hidden files are ignored). A ``.npy`` file holds the one array of a model with a
  single input; an ``.npz`` file holds one array per input, keyed by input name.
- **one .npz file**, one array per model input keyed by input name, samples along a leading axis.
  For an input of rank ``r``:

  * an array of rank ``r + 1`` holds one feed per index of its first axis: ``feed[i] = arr[i]``
    (``np.savez("calib.npz", x=np.stack(samples))``);
  * an array of rank ``r`` holds batches along axis 0: ``feed[i] = arr[i*b:(i+1)*b]``, with ``b``
    the model's static size of that axis, or 1 when the axis is dynamic (so a dynamic-batch
    model is calibrated one sample at a time); the length must be a multiple of ``b``.

  Every array must give the same number of feeds. Arrays stored uncompressed (``np.savez``) are
  memory-mapped, so a large file is not read into memory; compressed ones (``np.savez_compressed``)
  are read once per pass.
- **an iterable of feed dicts**: a list or tuple is used as it is (kept by reference); any other
  iterable (a generator, an iterator, a DataLoader-like object) is read once at open time and
  spooled to a temporary folder on disk (one uncompressed ``.npz`` per feed, removed with the
  set), so memory stays flat however many feeds it yields.
- **an onnxruntime** ``CalibrationDataReader`` (anything with ``get_next()``), passed unchanged:
  ``get_next()`` is called until it returns None. A reader with ``rewind()`` is read once at open
  time (validated and counted) and rewound before every later pass; one without ``rewind()`` is
  spooled to disk like a generator.

Validation (one-line :class:`CalibrationError`, naming the feed, its file where it has one, and the
input): an unsupported source or a missing path; an empty set; missing or unknown input names; a
dtype other than the model's; a rank or a static dimension other than the model's (symbolic and
unknown dimensions accept any size); NaN or inf in a floating-point input; an unreadable ``.npy``
or ``.npz``. The model's inputs are its graph inputs that are not initializers. Every feed is
checked as it is read; the first one is also checked at open time (spooled sources and rewindable
readers: all of them), so the common mistakes surface before any work.
"""

from __future__ import annotations

import os
import tempfile
import weakref
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from onnxopt.ir import io
from onnxopt.errors import UsageError

__all__ = ["CalibrationError", "CalibrationSet", "InputSpec", "model_inputs", "open_calibration"]


class CalibrationError(UsageError):
    """Calibration data that cannot be used: the message is one line naming the feed and input."""


# --- the model's inputs -----------------------------------------------------------------------

@dataclass(frozen=True)
class InputSpec:
    """One model input as calibration feeds must match it: ``dims`` holds an int for a static
    dimension and None for a symbolic or unknown one; ``dtype`` is None when the model leaves
    the element type unknown (or numpy has no such type); ``shape_known`` is False when the
    model declares no shape at all (then any shape is accepted)."""

    name: str
    dtype: np.dtype | None
    dims: tuple
    shape_known: bool
    shown: tuple  # the dims as written in messages: ints and symbol names

    def describe_shape(self) -> str:
        return "(" + ", ".join(str(d) if isinstance(d, int) else repr(d) for d in self.shown) + \
            ("," if len(self.shown) == 1 else "") + ")"


def _np_dtype(elem_type: int) -> np.dtype | None:
    if not elem_type:
        return None
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception:  # noqa: BLE001 - bfloat16/float8 without ml_dtypes: no dtype check
        return None


def _graph_of(model) -> onnx.GraphProto:
    if isinstance(model, onnx.GraphProto):
        return model
    if isinstance(model, onnx.ModelProto):
        return model.graph
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise CalibrationError(f"model {path}: no such file")
        try:
            return onnx.load(str(path), load_external_data=False).graph
        except Exception as exc:  # noqa: BLE001
            raise CalibrationError(f"model {path}: cannot be read ({io.first_line(exc, 200)})") from None
    try:
        import onnx_ir as ir
    except ImportError:  # pragma: no cover
        ir = None
    if ir is not None and isinstance(model, ir.Model):
        return ir.to_proto(model).graph
    raise CalibrationError(f"expected an onnx.ModelProto, onnx_ir.Model or a path for the model, "
                           f"got {type(model).__name__}")


def model_inputs(model) -> list[InputSpec]:
    """The inputs calibration feeds must give: graph inputs that are not initializers."""
    graph = _graph_of(model)
    inits = {t.name for t in graph.initializer}
    specs = []
    for vi in graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if vi.type.WhichOneof("value") not in (None, "tensor_type"):
            raise CalibrationError(f"the model's input {vi.name!r} is not a tensor "
                                   f"({vi.type.WhichOneof('value')}): calibration feeds tensors only")
        dims, shown = [], []
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value >= 0:  # (some exporters write -1 for "any")
                dims.append(int(d.dim_value))
                shown.append(int(d.dim_value))
            else:
                dims.append(None)
                shown.append(d.dim_param or f"?{i}")
        specs.append(InputSpec(vi.name, _np_dtype(tt.elem_type), tuple(dims), tt.HasField("shape"), tuple(shown)))
    return specs


def _names(items) -> str:
    return ", ".join(repr(n) for n in items)


def check_feed(feed, where: str, inputs: Sequence[InputSpec], *, extra: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The feed as arrays keyed in the model's input order, or a one-line CalibrationError
    starting with ``where`` (e.g. "calibration feed 3 (b.npz)"). ``extra``: names of initializers
    the model lists as inputs (named as such when fed)."""
    if not isinstance(feed, Mapping):
        raise CalibrationError(f"{where}: expected a dict of input name -> array, got {type(feed).__name__}")
    known = {s.name for s in inputs}
    unknown = [k for k in feed if k not in known]
    if unknown:
        k = unknown[0]
        what = "an initializer (a constant) of the model, not an input" if k in extra else "not an input of the model"
        raise CalibrationError(f"{where}: {k!r} is {what} (its inputs: {_names(known)})")
    missing = [s.name for s in inputs if s.name not in feed]
    if missing:
        raise CalibrationError(f"{where}: input {_names(missing)} missing (the model takes {_names(known)})")
    out = {}
    for spec in inputs:
        value = feed[spec.name]
        try:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        except Exception as exc:  # noqa: BLE001
            raise CalibrationError(f"{where}: input {spec.name!r} is not an array "
                                   f"({io.first_line(exc, 150)})") from None
        if arr.dtype == object:
            raise CalibrationError(f"{where}: input {spec.name!r} is not a numeric array ({type(value).__name__})")
        if spec.dtype is not None and arr.dtype != spec.dtype:
            raise CalibrationError(f"{where}: input {spec.name!r} has dtype {arr.dtype}, the model takes {spec.dtype}")
        if spec.shape_known:
            if arr.ndim != len(spec.dims):
                raise CalibrationError(f"{where}: input {spec.name!r} has shape {tuple(arr.shape)}, rank {arr.ndim}; "
                                       f"the model takes rank {len(spec.dims)} {spec.describe_shape()}")
            for axis, (have, want) in enumerate(zip(arr.shape, spec.dims)):
                if want is not None and have != want:
                    raise CalibrationError(f"{where}: input {spec.name!r} has shape {tuple(arr.shape)}, the model "
                                           f"takes {spec.describe_shape()} (dimension {axis} is {have}, not {want})")
        if arr.dtype.kind in "fc":
            finite = np.isfinite(arr)
            if not finite.all():
                nan = int(np.isnan(arr).sum())
                inf = int(arr.size - finite.sum()) - nan
                raise CalibrationError(f"{where}: input {spec.name!r} holds {nan} NaN and {inf} inf values "
                                       f"(calibration needs finite inputs)")
        out[spec.name] = arr
    return out


# --- sources ------------------------------------------------------------------------------------
# A source knows how many raw feeds it has and gives them, with a label for messages, for a
# sorted list of positions. Validation happens in CalibrationSet.

class _Source:
    description = ""

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def items(self, positions: Sequence[int]) -> Iterator[tuple[int, str, object]]:  # pragma: no cover
        raise NotImplementedError

    def subset(self, positions: Sequence[int]) -> tuple[_Source, Sequence[int]]:
        """A source to pickle for the given positions (with their new positions in it)."""
        return self, positions

    portable = True  # may be pickled to another process


def _npy_header(f) -> tuple[tuple, bool, np.dtype]:
    """(shape, fortran order, dtype) of the .npy stream ``f``, left at the start of its data."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    return np.lib.format._read_array_header(f, version)  # (3.0: no public reader)


_MAGIC = {".npy": (b"\x93NUMPY",), ".npz": (b"PK\x03\x04", b"PK\x05\x06")}  # .npz: a zip archive


def _not_numpy(path: Path, suffix: str) -> str | None:
    """"cannot read it as .npz (not a .npz file: not a zip archive)" (or .npy: no NumPy magic) when
    the first bytes of ``path`` say so (np.load would call such a file pickled data), else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as exc:
        return f"cannot read it ({io.first_line(exc, 160)})"
    if not any(head.startswith(m) for m in _MAGIC[suffix]):
        why = "empty" if not head else "not a zip archive" if suffix == ".npz" else "no NumPy header"
        return f"cannot read it as {suffix} (not a {suffix} file: {why})"
    return None


def _read_npy_file(path: Path, label: str, spec_names: Sequence[str]) -> dict:
    where = f"calibration feed {label}"
    if (why := _not_numpy(path, ".npy" if path.suffix == ".npy" else ".npz")) is not None:
        raise CalibrationError(f"{where}: {why}")
    try:
        if path.suffix == ".npy":
            arr = np.load(path, allow_pickle=False)
            if len(spec_names) != 1:
                raise CalibrationError(f"{where}: a .npy file holds one array, the model takes "
                                       f"{len(spec_names)} inputs ({_names(spec_names)}): use .npz files keyed "
                                       "by input name")
            return {spec_names[0]: arr}
        from onnxopt.readers import check_npz

        check_npz(path, f"{where}:")  # (numpy reads each member whole: a compressed one may declare gigabytes)
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (CalibrationError, UsageError):
        raise
    except Exception as exc:  # noqa: BLE001 - anything np.load raises on a damaged file
        raise CalibrationError(f"{where}: cannot read it as {path.suffix} ({io.first_line(exc, 160)})") from None


class _FilesSource(_Source):
    """One feed per .npy/.npz file; ``labels`` name each feed in messages (its position in the
    set as the user gave it, and the file name where the user named the files)."""

    def __init__(self, files: Sequence[Path], names: Sequence[str], description: str, labels: Sequence[str]):
        self.files = list(files)
        self.names = list(names)
        self.description = description
        self.labels = list(labels)
        self._keep = None  # the temporary folder of a spool (not pickled: the parent process owns it)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_keep"] = None
        return state

    def __len__(self) -> int:
        return len(self.files)

    def items(self, positions):
        for pos in positions:
            yield pos, self.labels[pos], _read_npy_file(self.files[pos], self.labels[pos], self.names)

    def subset(self, positions):
        sub = _FilesSource([self.files[p] for p in positions], self.names, self.description,
                           [self.labels[p] for p in positions])
        sub._keep = self._keep  # (in this process the spool lives as long as any of its subsets)
        return sub, range(len(positions))


class _ListSource(_Source):
    def __init__(self, feeds: Sequence, positions: Sequence[int] | None = None):
        self.feeds = feeds
        self.positions = list(range(len(feeds))) if positions is None else list(positions)  # original numbers
        self.description = f"a list of {len(self.positions)} feeds"

    def __len__(self) -> int:
        return len(self.positions)

    def items(self, positions):
        for pos in positions:
            yield pos, str(self.positions[pos]), self.feeds[pos]

    def subset(self, positions):
        return _ListSource([self.feeds[p] for p in positions], [self.positions[p] for p in positions]), \
            range(len(positions))


class _NpzSource(_Source):
    """One .npz file, samples along a leading axis (see the module docstring)."""

    def __init__(self, path: Path, inputs: Sequence[InputSpec], extra: Sequence[str]):
        self.path = path
        self.description = f"{path} (one .npz)"
        if (why := _not_numpy(path, ".npz")) is not None:
            raise CalibrationError(f"calibration file {path}: {why}")
        try:
            with np.load(path, allow_pickle=False) as z:
                keys = list(z.files)
        except Exception as exc:  # noqa: BLE001
            raise CalibrationError(f"calibration file {path}: cannot read it as .npz ({io.first_line(exc, 160)})") \
                from None
        names = [s.name for s in inputs]
        unknown = [k for k in keys if k not in names]
        if unknown:
            what = "an initializer (a constant) of the model, not an input" if unknown[0] in extra \
                else "not an input of the model"
            raise CalibrationError(f"calibration file {path}: array {unknown[0]!r} is {what} "
                                   f"(its inputs: {_names(names)})")
        missing = [n for n in names if n not in keys]
        if missing:
            raise CalibrationError(f"calibration file {path}: input {_names(missing)} missing "
                                   f"(the model takes {_names(names)})")
        self.plan = {}  # name -> (per_sample: bool, batch)
        counts = {}
        for spec in inputs:
            shape = self._shape(spec.name)
            rank = len(spec.dims) if spec.shape_known else len(shape) - 1
            if len(shape) == rank + 1:
                self.plan[spec.name] = (True, 1)
                counts[spec.name] = shape[0]
            elif len(shape) == rank and rank >= 1:
                b = spec.dims[0] if spec.dims[0] is not None else 1
                if b == 0 or shape[0] % b:
                    raise CalibrationError(f"calibration file {path}: array {spec.name!r} has shape {shape}: "
                                           f"{shape[0]} rows are not a whole number of the model's batches of {b}")
                self.plan[spec.name] = (False, b)
                counts[spec.name] = shape[0] // b
            else:
                raise CalibrationError(f"calibration file {path}: array {spec.name!r} has shape {shape}; the model's "
                                       f"input has rank {rank} {spec.describe_shape()}: give rank {rank + 1} "
                                       f"(one sample per index of axis 0) or rank {rank} (batches along axis 0)")
        if len(set(counts.values())) > 1:
            raise CalibrationError(f"calibration file {path}: its arrays give different numbers of feeds "
                                   f"({', '.join(f'{k!r}: {v}' for k, v in counts.items())})")
        self.count = next(iter(counts.values())) if counts else 0

    def _shape(self, name: str) -> tuple:
        try:
            with zipfile.ZipFile(self.path) as zf, zf.open(f"{name}.npy") as f:
                shape, _, _ = _npy_header(f)
        except Exception as exc:  # noqa: BLE001
            raise CalibrationError(f"calibration file {self.path}: cannot read its array {name!r} "
                                   f"({io.first_line(exc, 160)})") from None
        return tuple(shape)

    def __len__(self) -> int:
        return self.count

    def _arrays(self) -> dict[str, np.ndarray]:
        """Each array, memory-mapped where stored uncompressed, else read (bounded: readers.check_npz)."""
        from onnxopt.readers import check_npz

        check_npz(self.path, "calibration file", compressed_only=True)
        out = {}
        with zipfile.ZipFile(self.path) as zf:
            for name in self.plan:
                info = zf.getinfo(f"{name}.npy")
                arr = None
                if info.compress_type == zipfile.ZIP_STORED:
                    with open(self.path, "rb") as raw:
                        raw.seek(info.header_offset)
                        head = raw.read(30)
                        start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + \
                            int.from_bytes(head[28:30], "little")
                        raw.seek(start)
                        shape, fortran, dtype = _npy_header(raw)
                        offset = raw.tell()
                    if not dtype.hasobject:
                        arr = np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape,
                                        order="F" if fortran else "C")
                if arr is None:
                    with zf.open(info) as f:
                        arr = np.lib.format.read_array(f, allow_pickle=False)
                out[name] = arr
        return out

    def items(self, positions):
        try:
            arrays = self._arrays()
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CalibrationError(f"calibration file {self.path}: cannot read it as .npz "
                                   f"({io.first_line(exc, 160)})") from None
        for pos in positions:
            feed = {}
            for name, arr in arrays.items():
                per_sample, b = self.plan[name]
                part = arr[pos] if per_sample else arr[pos * b:(pos + 1) * b]
                feed[name] = np.array(part)  # a copy in memory: the map stays read-only and closable
            yield pos, f"{pos} ({self.path.name}[{pos}])", feed


class _ReaderSource(_Source):
    """An onnxruntime CalibrationDataReader with rewind(): read afresh on every pass."""

    portable = False

    def __init__(self, reader, count: int):
        self.reader = reader
        self.count = count
        self.description = f"{type(reader).__name__} (a calibration data reader, rewound per pass)"

    def __len__(self) -> int:
        return self.count

    def items(self, positions):
        wanted = set(positions)
        last = max(positions) if positions else -1
        self.reader.rewind()
        pos = 0
        while pos <= last:
            feed = self.reader.get_next()
            if feed is None:
                raise CalibrationError(f"calibration data reader {type(self.reader).__name__}: gave {pos} feeds "
                                       f"after rewind(), {self.count} the first time")
            if pos in wanted:
                yield pos, str(pos), feed
            pos += 1

    def __getstate__(self):
        raise TypeError("a calibration data reader stays in its process: spool it first")


# --- the set ------------------------------------------------------------------------------------

class CalibrationSet:
    """Validated calibration feeds: re-iterable (each iteration reads the source again, one feed
    at a time), indexable by position through :meth:`split` and :meth:`shard`, picklable for
    another process once :meth:`portable` (spooled when its source is a reader)."""

    def __init__(self, source: _Source, positions: Sequence[int], inputs: Sequence[InputSpec],
                 extra: Sequence[str] = ()):
        self._source = source
        self._positions = list(positions)
        self.inputs = list(inputs)
        self._extra = list(extra)

    @property
    def description(self) -> str:
        """Where the feeds come from, for reports."""
        return self._source.description

    def __len__(self) -> int:
        return len(self._positions)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for _pos, label, raw in self._source.items(self._positions):
            yield check_feed(raw, f"calibration feed {label}", self.inputs, extra=self._extra)

    def __repr__(self) -> str:
        return f"CalibrationSet({len(self)} feeds from {self.description})"

    def _with(self, positions: Sequence[int]) -> CalibrationSet:
        return CalibrationSet(self._source, positions, self.inputs, self._extra)

    def split(self, held_out: int) -> tuple[CalibrationSet, CalibrationSet]:
        """(calibration part, held-out part): the ``held_out`` feeds at evenly spaced positions
        (position ``(2*i + 1) * n // (2 * held_out)`` for i in range(held_out), so an ordered set,
        sorted by class or source, gives a held-out part from all over it), the rest for
        calibration; both keep the set's order. The calibration part must not be empty."""
        n = len(self)
        if not isinstance(held_out, (int, np.integer)) or isinstance(held_out, bool) or held_out < 0:
            raise CalibrationError(f"held-out feeds: expected a count >= 0, got {held_out!r}")
        if held_out >= n:
            raise CalibrationError(f"held-out feeds: {held_out} of {n} would leave none to calibrate with")
        picks = {(2 * i + 1) * n // (2 * held_out) for i in range(held_out)} if held_out else set()
        rest = [p for i, p in enumerate(self._positions) if i not in picks]
        held = [p for i, p in enumerate(self._positions) if i in picks]
        return self._with(rest), self._with(held)

    def shard(self, index: int, count: int) -> CalibrationSet:
        """Shard ``index`` of ``count``: a contiguous block of positions, ``[index*n//count,
        (index+1)*n//count)``, so the shards cover the set exactly once, in order, with sizes
        differing by at most one (a shard is empty when ``count`` exceeds the set's size)."""
        if not isinstance(count, (int, np.integer)) or count < 1:
            raise CalibrationError(f"shard count: expected an integer >= 1, got {count!r}")
        if not isinstance(index, (int, np.integer)) or not 0 <= index < count:
            raise CalibrationError(f"shard index: expected 0 <= index < {count}, got {index!r}")
        n = len(self)
        return self._with(self._positions[index * n // count:(index + 1) * n // count])

    def portable(self) -> CalibrationSet:
        """This set as one that pickles to another process with only its own feeds: a reader's
        feeds are spooled to disk (once), a list is cut to the set's feeds."""
        source = self._source
        if not source.portable:
            raw = ((f"calibration feed {label}", feed) for _, label, feed in source.items(self._positions))
            spool = _spool(raw, self.inputs, self._extra, source.description)
            return CalibrationSet(spool, range(len(spool)), self.inputs, self._extra)
        sub, positions = source.subset(self._positions)
        return CalibrationSet(sub, positions, self.inputs, self._extra)


def _spool(feeds: Iterable[tuple[str, object]], inputs, extra, description: str) -> _FilesSource:
    """Validate and write each feed to a temporary folder (one uncompressed .npz each); the folder
    goes when the returned source is garbage-collected (or at exit)."""
    tmp = tempfile.TemporaryDirectory(prefix="onnxopt-calib-")
    files = []
    try:
        for where, raw in feeds:
            feed = check_feed(raw, where, inputs, extra=extra)
            path = Path(tmp.name) / f"{len(files):08d}.npz"
            with open(path, "wb") as f:
                np.savez(f, **feed)
            files.append(path)
    except BaseException:
        tmp.cleanup()
        raise
    source = _FilesSource(files, [s.name for s in inputs], f"{description}, spooled to {tmp.name}",
                          [str(i) for i in range(len(files))])
    source._keep = tmp
    weakref.finalize(source, tmp.cleanup)
    return source


def _iterate_reader(reader) -> Iterator[object]:
    while True:
        feed = reader.get_next()
        if feed is None:
            return
        yield feed


def open_calibration(source, model) -> CalibrationSet:
    """A :class:`CalibrationSet` of ``source`` (a folder of .npy/.npz files, one .npz file, an
    iterable of feed dicts, or an onnxruntime ``CalibrationDataReader``; see the module docstring
    for how each is read) validated against ``model`` (an onnx.ModelProto, onnx_ir.Model or a
    path; only its graph inputs are read). Raises a one-line :class:`CalibrationError`."""
    graph = _graph_of(model)
    inputs = model_inputs(graph)
    extra = sorted({vi.name for vi in graph.input} - {s.name for s in inputs})
    names = [s.name for s in inputs]

    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise CalibrationError(f"calibration data {path}: no such file or folder")
        if path.is_dir():
            files = sorted((p for p in path.iterdir() if p.suffix in (".npy", ".npz") and not p.name.startswith(".")
                            and p.is_file()), key=lambda p: p.name)
            if not files:
                raise CalibrationError(f"calibration data {path}: the folder holds no .npy or .npz files")
            if len(names) != 1 and any(p.suffix == ".npy" for p in files):
                first = next(p for p in files if p.suffix == ".npy")
                raise CalibrationError(f"calibration data {path}: {first.name} is a .npy file (one array) but the "
                                       f"model takes {len(names)} inputs ({_names(names)}): use .npz files keyed "
                                       "by input name")
            src: _Source = _FilesSource(files, names, f"{path} ({len(files)} files)",
                                        [f"{i} ({p.name})" for i, p in enumerate(files)])
        elif path.suffix == ".npz":
            src = _NpzSource(path, inputs, extra)
        elif path.suffix == ".npy":
            raise CalibrationError(f"calibration data {path}: one .npy file is one feed; give a folder of "
                                   ".npy/.npz files, or one .npz keyed by input name with samples along axis 0")
        else:
            raise CalibrationError(f"calibration data {path}: not a folder of .npy/.npz files nor a .npz file")
    elif callable(getattr(source, "get_next", None)) and not isinstance(source, Mapping):
        if callable(getattr(source, "rewind", None)):
            source.rewind()
            count = 0
            for count, raw in enumerate(_iterate_reader(source), 1):
                check_feed(raw, f"calibration feed {count - 1}", inputs, extra=extra)
            src = _ReaderSource(source, count)
        else:
            src = _spool(((f"calibration feed {i}", f) for i, f in enumerate(_iterate_reader(source))),
                         inputs, extra, f"{type(source).__name__} (a calibration data reader)")
    elif isinstance(source, (list, tuple)):
        src = _ListSource(source)
    elif isinstance(source, Mapping):
        raise CalibrationError("calibration data: got one feed dict; give a list (or another iterable) of them")
    elif isinstance(source, Iterable) and not isinstance(source, (str, bytes, np.ndarray)):
        src = _spool(((f"calibration feed {i}", f) for i, f in enumerate(source)), inputs, extra,
                     f"{type(source).__name__} (an iterable)")
    else:
        raise CalibrationError(f"calibration data: {type(source).__name__} is not a supported source (a folder of "
                               ".npy/.npz files, one .npz file, an iterable of feed dicts, or an onnxruntime "
                               "CalibrationDataReader)")
    if len(src) == 0:
        raise CalibrationError(f"calibration data: {src.description} gives no feeds (an empty set)")
    calib = CalibrationSet(src, range(len(src)), inputs, extra)
    if not isinstance(src, _ReaderSource):  # (a reader was checked whole above)
        next(iter(calib._with(calib._positions[:1])))  # the first feed, checked before any work
    return calib
