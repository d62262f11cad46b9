"""Calibration: the float range of each tensor to quantize, from statistics that stream and merge.

Two passes over the calibration feeds, one feed at a time, nothing kept across feeds:

1. :func:`collect_ranges` -> :class:`RangeStats`: per tensor the minimum and maximum of its finite
   values (float64, exact: they are values of the tensor), how many finite values were seen and
   how many were NaN or inf (an attention mask's -inf is left out of the range, then saturates).
2. :func:`collect_histograms` -> :class:`HistStats`: per tensor a histogram of ``bins`` (2048)
   equal bins on FIXED edges spanning ``[min(lo, 0), max(hi, 0)]`` of the merged pass-1 range, as
   int64 counts, plus the count of exact zeros.

Both merge exactly: min/max of min/max and sums of integers do not depend on how the feeds were
grouped or ordered, so shards computed anywhere and merged equal one pass over all the data bit for
bit, and the ranges chosen from them (hence scales and zero points) are identical for any number of
workers. ``to_dict()`` / ``from_dict()`` make them JSON-safe (floats round-trip exactly through
``json``).

:func:`choose_ranges` turns the statistics into ``{tensor: (lo, hi)}``; every range contains 0 (a
zero point must exist), is finite and has a positive width. Activations are quantized affinely
onto ``qmin..qmax`` (0..255: asymmetric uint8 by default; pass qmin/qmax for int8 or reduce_range):

- ``minmax``: the observed range (no histogram pass).
- ``percentile``: per side, the ``percentile`` (99.999) and ``100 - percentile`` quantiles of all
  the values, interpolated within the histogram bin.
- ``entropy``: the window of bins minimizing the KL divergence between the reference distribution
  (the window, with the mass outside it folded into its end bins) and its quantization onto
  ``qmax - qmin + 1`` levels (each level's mass spread evenly over the window's non-empty bins it
  covers). Windows shrink both sides of zero by one common factor ``c = n / bins`` for n from
  ``levels`` to ``bins`` bins (``candidates`` of them, 256 by default; with 2048 bins and 256
  levels a window goes down to 1/8 of the observed range): a one-sided tensor (after Relu,
  ``lo >= 0``) thus searches its upper end only. onnxruntime's entropy calibration, with 128
  bins and 128 levels, has a single candidate and equals minmax.
- ``mse``: the range minimizing the expected squared quantization error over the histogram
  (values outside clipped to the range, values inside rounding with variance ``step**2 / 12``,
  exact zeros exactly representable), with the two ends searched independently on a grid of bin
  edges (``candidates`` per side, 512 by default), vectorized over all pairs.

:func:`calibrate` runs both passes (one for minmax) in this process (``workers=1``) or across
``workers`` processes (spawn; each its own onnxruntime session with one intra-op thread), each
taking :meth:`CalibrationSet.shard`\\ s and returning statistics that are merged here.

Ray, Spark or any other job runner calls the same shard/merge API: the statistics are plain data::

    from onnxopt.quantize.calibrate import (collect_ranges, collect_histograms, RangeStats,
                                            HistStats, choose_ranges)
    # calib = open_calibration(source, model); exposed tensors: tensors
    def ranges_task(i, n):        # runs on a worker
        return collect_ranges(model_path, tensors, calib.shard(i, n)).to_dict()
    def hist_task(i, n, ranges):  # runs on a worker
        return collect_histograms(model_path, tensors, calib.shard(i, n),
                                  RangeStats.from_dict(ranges)).to_dict()

    parts = ray.get([ray.remote(ranges_task).remote(i, n) for i in range(n)])   # or rdd.map(...)
    ranges = RangeStats.merge_all([RangeStats.from_dict(p) for p in parts])      # pass 1, merged
    parts = ray.get([ray.remote(hist_task).remote(i, n, ranges.to_dict()) for i in range(n)])
    hists = HistStats.merge_all([HistStats.from_dict(p) for p in parts])         # pass 2, merged
    chosen = choose_ranges(ranges, hists, "entropy")                            # {tensor: (lo, hi)}

The histogram edges are a function of the merged ranges only (:meth:`RangeStats.spans`), so every
worker of pass 2 bins onto the same edges. (Give the workers a folder or .npz source, or
``calib.shard(i, n).portable()``, which pickles only its own feeds.) With ``spawn``, a script that
calls :func:`calibrate` with ``workers > 1`` needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import onnx

from onnxopt.errors import OnnxoptError, UsageError, feeds_text
from onnxopt.options import QUANTIZE_METHODS
from onnxopt.quantize.data import CalibrationSet, open_calibration

__all__ = ["METHODS", "DEFAULT_BINS", "RangeStats", "HistStats", "collect_ranges", "collect_histograms",
           "choose_ranges", "calibrate", "tensor_types"]

METHODS = QUANTIZE_METHODS  # (declared with the options: onnxopt.options)
DEFAULT_BINS = 2048
_OPTIONS = {
    "minmax": {"qmin", "qmax"},
    "percentile": {"percentile", "qmin", "qmax"},
    "entropy": {"qmin", "qmax", "candidates"},
    "mse": {"qmin", "qmax", "candidates"},
}
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                onnx.TensorProto.BFLOAT16}
_CHUNK = 1 << 16  # elements binned at a time: transient memory stays small (cache-sized) whatever a tensor's size

Progress = Callable[[str, int, int], None]


# --- statistics -----------------------------------------------------------------------------------

class RangeStats:
    """Pass 1: per tensor ``[min, max, count, nonfinite]`` over its finite values (min/max None
    while no finite value was seen), and how many feeds were seen."""

    def __init__(self, tensors: Sequence[str], feeds: int = 0, stats: Mapping[str, Sequence] | None = None):
        self.tensors = list(tensors)
        self.feeds = int(feeds)
        self.stats: dict[str, list] = {t: list(stats[t]) if stats else [None, None, 0, 0] for t in self.tensors}

    def update(self, name: str, value: np.ndarray) -> None:
        s = self.stats[name]
        if value.size == 0:
            return
        lo, hi = value.min(), value.max()
        n, bad = value.size, 0
        if not (np.isfinite(lo) and np.isfinite(hi)):  # (NaN propagates through min/max)
            finite = value[np.isfinite(value)]
            n, bad = finite.size, value.size - finite.size
            lo, hi = (finite.min(), finite.max()) if n else (None, None)
        if lo is not None:
            lo, hi = float(lo), float(hi)
            s[0] = lo if s[0] is None else min(s[0], lo)
            s[1] = hi if s[1] is None else max(s[1], hi)
        s[2] += int(n)
        s[3] += int(bad)

    def range(self, name: str) -> tuple[float, float] | None:
        """(min, max) of the tensor's finite values, None if none was seen."""
        lo, hi = self.stats[name][:2]
        return None if lo is None else (lo, hi)

    def spans(self) -> dict[str, tuple[float, float]]:
        """The histogram span of each tensor: ``[min(lo, 0), max(hi, 0)]`` of its range (0..1 for
        a tensor seen only as zeros, or never seen). A function of the merged ranges only."""
        out = {}
        for t in self.tensors:
            r = self.range(t)
            lo, hi = (0.0, 0.0) if r is None else (min(r[0], 0.0), max(r[1], 0.0))
            out[t] = (lo, hi) if hi > lo else (0.0, 1.0)
        return out

    def merge(self, *others: RangeStats) -> RangeStats:
        """The statistics of all the feeds of ``self`` and ``others`` (exact)."""
        out = RangeStats(self.tensors, self.feeds, self.stats)
        for o in others:
            _same_tensors(out.tensors, o.tensors, "range statistics")
            out.feeds += o.feeds
            for t in out.tensors:
                s, x = out.stats[t], o.stats[t]
                if x[0] is not None:
                    s[0] = x[0] if s[0] is None else min(s[0], x[0])
                    s[1] = x[1] if s[1] is None else max(s[1], x[1])
                s[2] += x[2]
                s[3] += x[3]
        return out

    @staticmethod
    def merge_all(parts: Sequence[RangeStats]) -> RangeStats:
        if not parts:
            raise UsageError("range statistics: nothing to merge")
        return parts[0].merge(*parts[1:])

    def to_dict(self) -> dict:
        return {"kind": "ranges", "feeds": self.feeds,
                "tensors": {t: {"min": s[0], "max": s[1], "count": s[2], "nonfinite": s[3]}
                            for t, s in self.stats.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> RangeStats:
        if not isinstance(d, Mapping) or d.get("kind") != "ranges":
            raise UsageError("range statistics: expected the dict RangeStats.to_dict() gives")
        tensors = d["tensors"]
        return cls(list(tensors), d["feeds"], {t: [None if v["min"] is None else float(v["min"]),
                                                   None if v["max"] is None else float(v["max"]),
                                                   int(v["count"]), int(v["nonfinite"])]
                                               for t, v in tensors.items()})

    def __eq__(self, other) -> bool:
        return isinstance(other, RangeStats) and self.to_dict() == other.to_dict()


class HistStats:
    """Pass 2: per tensor its span ``(lo, hi)`` (``bins`` equal bins), int64 counts of its finite
    values (values outside the span, which a source that changed between passes could give, go to
    the end bins) and the count of exact zeros among them."""

    def __init__(self, spans: Mapping[str, tuple[float, float]], bins: int = DEFAULT_BINS, feeds: int = 0,
                 counts: Mapping[str, np.ndarray] | None = None, zeros: Mapping[str, int] | None = None):
        if not isinstance(bins, (int, np.integer)) or bins < 2:
            raise UsageError(f"histogram bins: expected an integer >= 2, got {bins!r}")
        self.tensors = list(spans)
        self.spans = {t: (float(spans[t][0]), float(spans[t][1])) for t in self.tensors}
        self.bins = int(bins)
        self.feeds = int(feeds)
        self.counts = {t: np.array(counts[t], dtype=np.int64) if counts else np.zeros(self.bins, np.int64)
                       for t in self.tensors}
        self.zeros = {t: int(zeros[t]) if zeros else 0 for t in self.tensors}

    def update(self, name: str, value: np.ndarray) -> None:
        lo, hi = self.spans[name]
        scale = self.bins / (hi - lo)
        flat = value.reshape(-1)
        counts = self.counts[name]
        for start in range(0, flat.size, _CHUNK):
            part = flat[start:start + _CHUNK]
            if part.dtype.kind != "f" or not np.isfinite(part).all():
                part = part[np.isfinite(part)]
            self.zeros[name] += int(part.size - np.count_nonzero(part))
            v = np.subtract(part, lo, dtype=np.float64)
            v *= scale
            np.clip(v, 0, self.bins - 1, out=v)
            counts += np.bincount(v.astype(np.intp), minlength=self.bins)

    def edges(self, name: str) -> np.ndarray:
        lo, hi = self.spans[name]
        return lo + (hi - lo) / self.bins * np.arange(self.bins + 1, dtype=np.float64)

    def merge(self, *others: HistStats) -> HistStats:
        """The histograms of all the feeds of ``self`` and ``others`` (exact); the edges must agree."""
        out = HistStats(self.spans, self.bins, self.feeds, self.counts, self.zeros)
        for o in others:
            _same_tensors(out.tensors, o.tensors, "histograms")
            if o.bins != out.bins or o.spans != out.spans:
                raise UsageError("histograms with different bin edges cannot merge: compute every shard's "
                                 "histograms from the same merged RangeStats")
            out.feeds += o.feeds
            for t in out.tensors:
                out.counts[t] += o.counts[t]
                out.zeros[t] += o.zeros[t]
        return out

    @staticmethod
    def merge_all(parts: Sequence[HistStats]) -> HistStats:
        if not parts:
            raise UsageError("histograms: nothing to merge")
        return parts[0].merge(*parts[1:])

    def to_dict(self) -> dict:
        return {"kind": "histograms", "bins": self.bins, "feeds": self.feeds,
                "tensors": {t: {"lo": self.spans[t][0], "hi": self.spans[t][1], "zeros": self.zeros[t],
                                "counts": [int(c) for c in self.counts[t]]} for t in self.tensors}}

    @classmethod
    def from_dict(cls, d: Mapping) -> HistStats:
        if not isinstance(d, Mapping) or d.get("kind") != "histograms":
            raise UsageError("histograms: expected the dict HistStats.to_dict() gives")
        ts = d["tensors"]
        return cls({t: (v["lo"], v["hi"]) for t, v in ts.items()}, d["bins"], d["feeds"],
                   {t: v["counts"] for t, v in ts.items()}, {t: v["zeros"] for t, v in ts.items()})

    def __eq__(self, other) -> bool:
        return isinstance(other, HistStats) and self.to_dict() == other.to_dict()


def _same_tensors(a: Sequence[str], b: Sequence[str], what: str) -> None:
    if set(a) != set(b):
        raise UsageError(f"{what} of different tensors cannot merge ({len(set(a) ^ set(b))} differ, e.g. "
                         f"{sorted(set(a) ^ set(b))[0]!r})")


# --- running the model ----------------------------------------------------------------------------

def _proto(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (str, os.PathLike)):
        from onnxopt.verify.runtime import OrtModel
        m = OrtModel(model, "calibration")
        return m.proto
    from onnxopt.ir import io
    return io.to_proto(model) if not isinstance(model, (bytes, bytearray)) else io.read_checked(bytes(model))[0]


def tensor_types(model, tensors: Sequence[str]) -> dict[str, onnx.TypeProto]:
    """The type of each tensor, from the model and onnx shape inference; a one-line UsageError
    names the tensors that are not values of the main graph or have no known float type."""
    proto = _proto(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto) if proto.ByteSize() < (1 << 31) - (1 << 26) else proto
    except Exception:  # noqa: BLE001 - a model shape inference fails on: use what it declares
        inferred = proto
    g = inferred.graph
    types: dict[str, onnx.TypeProto] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.type.WhichOneof("value") == "tensor_type":
            types.setdefault(vi.name, vi.type)
    for t in g.initializer:
        types.setdefault(t.name, onnx.helper.make_tensor_type_proto(t.data_type, None))
    produced = {o for n in g.node for o in n.output if o} | {vi.name for vi in g.input} | \
        {t.name for t in g.initializer}
    missing = [t for t in tensors if t not in produced]
    if missing:
        raise UsageError(f"calibration tensors: {', '.join(repr(t) for t in missing[:5])} "
                         f"{'is' if len(missing) == 1 else 'are'} not values of the model's main graph")
    bad = []
    for t in tensors:
        tp = types.get(t)
        et = tp.tensor_type.elem_type if tp is not None else 0
        if et not in _FLOAT_TYPES:
            bad.append(f"{t!r} ({onnx.TensorProto.DataType.Name(et).lower() if et else 'unknown type'})")
    if bad:
        raise UsageError(f"calibration tensors without a known float type: {', '.join(bad[:5])}"
                         + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    return {t: types[t] for t in tensors}


class _Runner:
    """One onnxruntime session over the model with the tensors exposed as outputs."""

    def __init__(self, exposed, tensors: Sequence[str], threads: int):
        from onnxopt.verify.runtime import session
        self.tensors = list(tensors)
        self.session = session(exposed, "cpu", threads=threads)
        self.inputs = [i.name for i in self.session.get_inputs()]

    def run(self, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return self.session.run(self.tensors, {k: feed[k] for k in self.inputs})
        except Exception as exc:  # noqa: BLE001 - sorted below: the user's data, or a bug of ours
            raise feed_error(exc, feed, self.session, "calibration") or exc


def feed_error(exc: BaseException, feed: Mapping[str, np.ndarray], session, what: str) -> UsageError | None:
    """The one-line UsageError for onnxruntime refusing to run a float model on the user's feed (a shape
    the model's layers cannot take, a wrong rank or type), naming the feed's shapes and the model's declared
    ones; None for anything else (an error raised by our code is a bug, and stays one). Used only for runs
    of the float model the user gave (cleaned up): a quantized model failing where the float one ran is ours."""
    from onnxopt.ir import io

    if isinstance(exc, OnnxoptError) or not type(exc).__module__.startswith("onnxruntime"):
        return None
    return UsageError(f"{what} data: onnxruntime cannot run the model{feeds_text(feed, session.get_inputs())}: "
                      f"{io.first_line(exc, 300)}")


def check_runs(model, feeds: Sequence[Mapping[str, np.ndarray]], what: str, threads: int = 0) -> None:
    """Run the float ``model`` once on each distinct set of feed shapes and types in ``feeds``: a feed it
    cannot run is a one-line UsageError (:func:`feed_error`) before any later step runs it."""
    from onnxopt.verify.runtime import OrtModel, session

    seen: dict[tuple, Mapping] = {}
    for feed in feeds:
        seen.setdefault(tuple((k, np.shape(v), np.asarray(v).dtype.str) for k, v in sorted(feed.items())), feed)
    if not seen:
        return
    om = OrtModel(model, what) if not isinstance(model, OrtModel) else model
    try:
        sess = session(om.source(), "cpu", threads=threads)
        names = [i.name for i in sess.get_inputs()]
        for feed in seen.values():
            try:
                sess.run(None, {k: feed[k] for k in names if k in feed})
            except Exception as exc:  # noqa: BLE001 - sorted as in _Runner.run
                raise feed_error(exc, feed, sess, what) or exc
    finally:
        if om is not model:
            om.close()


def _exposed(model, tensors: Sequence[str]):
    """(the model with ``tensors`` as outputs: bytes or a path, the OrtModel to close)."""
    from onnxopt.verify.runtime import OrtModel
    om = OrtModel(model, "calibration") if not isinstance(model, OrtModel) else model
    return om.with_outputs(list(tensors), tensor_types(om.proto, tensors)), om


def _runner(model, tensors, threads: int) -> _Runner:
    if isinstance(model, _Runner):
        return model
    exposed, om = _exposed(model, tensors)
    try:
        return _Runner(exposed, tensors, threads)
    finally:
        om.close()


def _size(feeds) -> int:
    try:
        return len(feeds)
    except TypeError:
        return 0


def _ranges_pass(runner: _Runner, feeds: Iterable, progress: Progress | None, step: str,
                 done: int = 0, total: int = 0) -> RangeStats:
    stats = RangeStats(runner.tensors)
    for i, feed in enumerate(feeds, 1):
        for name, value in zip(runner.tensors, runner.run(feed)):
            stats.update(name, value)
        del feed
        stats.feeds += 1
        if progress is not None:
            progress(step, done + i, total)
    return stats


def _hist_pass(runner: _Runner, feeds: Iterable, spans, bins: int, progress: Progress | None, step: str,
               done: int = 0, total: int = 0) -> HistStats:
    stats = HistStats(spans, bins)
    for i, feed in enumerate(feeds, 1):
        for name, value in zip(runner.tensors, runner.run(feed)):
            stats.update(name, value)
        del feed
        stats.feeds += 1
        if progress is not None:
            progress(step, done + i, total)
    return stats


def collect_ranges(model, tensors: Sequence[str], feeds: Iterable[Mapping[str, np.ndarray]], *,
                   progress: Progress | None = None, threads: int = 0) -> RangeStats:
    """Pass 1 over ``feeds`` (a CalibrationSet, or any iterable of feed dicts), one feed at a time:
    the min/max of each of ``tensors`` (values of ``model``, a path or onnx.ModelProto).
    ``progress("calibrating: ranges", done, total)`` after each feed; ``threads``: onnxruntime's
    intra-op threads (0: its default)."""
    runner = _runner(model, tensors, threads)
    return _ranges_pass(runner, feeds, progress, "calibrating: ranges", 0, _size(feeds))


def collect_histograms(model, tensors: Sequence[str], feeds: Iterable[Mapping[str, np.ndarray]],
                       ranges: RangeStats, *, bins: int = DEFAULT_BINS, progress: Progress | None = None,
                       threads: int = 0) -> HistStats:
    """Pass 2 over ``feeds``: each tensor's histogram on the fixed edges of ``ranges.spans()`` (the
    MERGED pass-1 statistics of all the feeds, so that every shard bins alike)."""
    _same_tensors(list(tensors), ranges.tensors, "histograms and range statistics")
    runner = _runner(model, tensors, threads)
    spans = ranges.spans()
    return _hist_pass(runner, feeds, {t: spans[t] for t in runner.tensors}, bins, progress,
                      "calibrating: histograms", 0, _size(feeds))


# --- choosing ranges ------------------------------------------------------------------------------

def check_method(method: str, options: Mapping) -> dict:
    """The method's options with defaults, or a one-line UsageError (unknown method or option,
    bad values)."""
    if method not in METHODS:
        raise UsageError(f"unknown calibration method {method!r} (choose from {', '.join(METHODS)})")
    unknown = sorted(set(options) - _OPTIONS[method])
    if unknown:
        raise UsageError(f"calibration method {method} takes no option {unknown[0]!r} "
                         f"(its options: {', '.join(sorted(_OPTIONS[method]))})")
    opts = {"qmin": 0, "qmax": 255, "percentile": 99.999,
            "candidates": 256 if method == "entropy" else 512, **options}
    qmin, qmax = opts["qmin"], opts["qmax"]
    if not all(isinstance(q, (int, np.integer)) and not isinstance(q, bool) for q in (qmin, qmax)) or qmax - qmin < 1:
        raise UsageError(f"calibration: qmin {qmin!r} and qmax {qmax!r} must be integers with qmin < qmax")
    p = opts["percentile"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 50 < p <= 100:
        raise UsageError(f"calibration percentile: expected a number in (50, 100], got {p!r}")
    c = opts["candidates"]
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
        raise UsageError(f"calibration candidates: expected an integer >= 1, got {c!r}")
    return opts


def _finish(lo: float, hi: float, levels: int) -> tuple[float, float]:
    """Contains 0, finite, positive width (a scale at least float32's smallest normal)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise UsageError(f"calibration produced a non-finite range ({lo}, {hi})")  # (a bug: ranges are finite)
    if hi - lo <= 0:
        return 0.0, 1.0  # a tensor seen only as zeros: any scale represents it exactly
    tiny = float(np.finfo(np.float32).tiny) * levels
    if hi - lo < tiny:
        return (lo, lo + tiny) if hi == 0 and lo < 0 else (lo, hi + tiny)
    return lo, hi


def _percentile(counts: np.ndarray, edges: np.ndarray, p: float) -> tuple[float, float]:
    total = counts.sum()
    cum = np.cumsum(counts)
    out = []
    for target in ((100.0 - p) / 100.0 * total, p / 100.0 * total):
        k = int(np.searchsorted(cum, target, side="left"))
        k = min(k, len(counts) - 1)
        before = cum[k - 1] if k else 0
        frac = (target - before) / counts[k] if counts[k] else 0.0
        out.append(edges[k] + (edges[k + 1] - edges[k]) * min(max(frac, 0.0), 1.0))
    return out[0], out[1]


def _thin(indices: np.ndarray, n: int, keep: int) -> np.ndarray:
    """At most ``n`` of ``indices`` (sorted), evenly spread, always with ``keep`` (an end)."""
    if len(indices) > n:
        picks = np.unique(np.round(np.linspace(0, len(indices) - 1, n)).astype(np.intp))
        indices = indices[picks]
    return np.union1d(indices, [keep])


def _without_zeros(counts: np.ndarray, zeros: int, edges: np.ndarray) -> np.ndarray:
    """The counts as float64 without the exact zeros, which every range represents exactly (after
    Relu they are half the values: left in, their spike in one bin would dominate the search)."""
    c = counts.astype(np.float64)
    zbin = min(max(int(np.searchsorted(edges, 0.0, side="right")) - 1, 0), len(c) - 1)
    c[zbin] = max(c[zbin] - zeros, 0.0)
    return c


def _mse(counts: np.ndarray, zeros: int, edges: np.ndarray, steps: int, candidates: int) -> tuple[float, float]:
    c = _without_zeros(counts, zeros, edges)
    bins = len(c)
    x = (edges[:-1] + edges[1:]) / 2
    s0 = np.concatenate([[0.0], np.cumsum(c)])
    s1 = np.concatenate([[0.0], np.cumsum(c * x)])
    s2 = np.concatenate([[0.0], np.cumsum(c * x * x)])
    lo_idx = _thin(np.flatnonzero(edges <= 0), candidates, 0)
    hi_idx = _thin(np.flatnonzero(edges >= 0), candidates, bins)
    a, b = edges[lo_idx], edges[hi_idx]
    left = a * a * s0[lo_idx] - 2 * a * s1[lo_idx] + s2[lo_idx]  # mass below a, clipped up to a
    r0, r1, r2 = s0[-1] - s0[hi_idx], s1[-1] - s1[hi_idx], s2[-1] - s2[hi_idx]
    right = b * b * r0 - 2 * b * r1 + r2  # mass above b, clipped down to b
    inside = s0[hi_idx][None, :] - s0[lo_idx][:, None]
    width = b[None, :] - a[:, None]
    err = np.maximum(left, 0)[:, None] + np.maximum(right, 0)[None, :] + (width / steps) ** 2 / 12 * inside
    i, j = np.unravel_index(int(np.argmin(err)), err.shape)
    return float(a[i]), float(b[j])


def _entropy(counts: np.ndarray, zeros: int, edges: np.ndarray, levels: int, candidates: int) -> tuple[float, float]:
    c = _without_zeros(counts, zeros, edges)
    bins = len(c)
    width = edges[1] - edges[0]
    z = -edges[0] / width  # zero's position, in bins
    cum = np.concatenate([[0.0], np.cumsum(c)])
    smallest = min(levels, bins)
    sizes = np.unique(np.round(np.linspace(smallest, bins, min(candidates, bins - smallest + 1))).astype(np.intp))
    best, best_kl = (0, bins), math.inf
    for n in sizes[::-1]:  # widest first: on a tie the wider window (less clipping) wins
        s = int(round(z * (1 - n / bins)))
        s = min(max(s, 0), bins - n)
        e = s + n
        sliced = c[s:e]
        p = sliced.copy()
        p[0] += cum[s]
        p[-1] += cum[-1] - cum[e]
        # quantize the window (without the folded outliers) onto `levels` levels
        group = (np.arange(n) * min(levels, n)) // n
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        mass = np.add.reduceat(sliced, starts)
        filled = np.add.reduceat((sliced > 0).astype(np.float64), starts)
        per = np.divide(mass, filled, out=np.zeros_like(mass), where=filled > 0)
        q = np.where(sliced > 0, per[group], 0.0)
        ps, qs = p.sum(), q.sum()
        if ps <= 0 or qs <= 0:
            continue
        p /= ps
        q /= qs
        nz = p > 0
        kl = float(np.sum(p[nz] * np.log(p[nz] / np.maximum(q[nz], 1e-12))))
        if kl < best_kl:
            best_kl, best = kl, (s, e)
    return float(edges[best[0]]), float(edges[best[1]])


def choose_ranges(ranges: RangeStats, hists: HistStats | None, method: str, *, percentile: float = 99.999,
                  **options) -> dict[str, tuple[float, float]]:
    """``{tensor: (lo, hi)}`` by ``method`` (see the module docstring) from the merged statistics;
    ``hists`` may be None for minmax. Options: ``qmin``/``qmax`` (0/255) the integer range,
    ``percentile``, ``candidates`` (how many thresholds entropy tries, ends per side mse tries)."""
    opts = check_method(method, {"percentile": percentile, **options} if method == "percentile" else options)
    steps = opts["qmax"] - opts["qmin"]
    if method != "minmax":
        if hists is None:
            raise UsageError(f"calibration method {method} needs the histograms of the second pass")
        _same_tensors(ranges.tensors, hists.tensors, "histograms and range statistics")
    out = {}
    for t in ranges.tensors:
        r = ranges.range(t)
        if r is None:  # no finite value seen
            out[t] = _finish(0.0, 0.0, steps)
            continue
        counts = hists.counts[t] if hists is not None else None
        if method == "minmax" or counts is None or counts.sum() == 0:
            lo, hi = r
        elif method != "percentile" and counts.sum() == hists.zeros[t]:  # only zeros (and the range)
            lo, hi = r
        elif method == "percentile":
            lo, hi = _percentile(counts, hists.edges(t), float(opts["percentile"]))
        elif method == "mse":
            lo, hi = _mse(counts, hists.zeros[t], hists.edges(t), steps, int(opts["candidates"]))
        else:
            lo, hi = _entropy(counts, hists.zeros[t], hists.edges(t), steps + 1, int(opts["candidates"]))
        if method != "minmax":  # never wider than what was seen
            lo, hi = max(lo, min(r[0], 0.0)), min(hi, max(r[1], 0.0))
        out[t] = _finish(lo, hi, steps)
        _check_scale(t, *out[t])
    return out


def _check_scale(tensor: str, lo: float, hi: float) -> None:
    """A range whose 8-bit float32 scale, or the values it dequantizes to, leave float32 (values near its
    limit, 3.4e38: DequantizeLinear would give inf) is the data's: one line, exit 2, not a model that
    computes inf."""
    from onnxopt.quantize.plan import activation_params

    scale, zp = activation_params(lo, hi)
    with np.errstate(over="ignore", under="ignore"):
        ends = (np.float32(0 - int(zp)) * scale, np.float32(255 - int(zp)) * scale)
    if not (np.isfinite(scale) and scale >= np.finfo(np.float32).tiny and all(np.isfinite(e) for e in ends)):
        raise UsageError(f"calibration: tensor {tensor!r} ranges over [{lo:.4g}, {hi:.4g}], too wide for an 8-bit "
                         f"float32 scale (its ends would dequantize to inf; float32 ends at "
                         f"{float(np.finfo(np.float32).max):.4g}): scale the calibration data to the model's range, "
                         f"or leave the nodes that read it float (--exclude)")


# --- the whole calibration, in one process or several -----------------------------------------------

_WORKER: _Runner | None = None


def _init_worker(exposed, tensors, threads) -> None:
    global _WORKER
    _WORKER = _Runner(exposed, tensors, threads)


def _worker_ranges(feeds) -> dict:
    return _ranges_pass(_WORKER, feeds, None, "").to_dict()


def _worker_hists(feeds, spans, bins) -> dict:
    return _hist_pass(_WORKER, feeds, spans, bins, None, "").to_dict()


def calibrate(model, tensors: Sequence[str], calib, *, method: str = "minmax", workers: int = 1,
              progress: Progress | None = None, bins: int = DEFAULT_BINS, threads: int | None = None,
              **method_options) -> dict[str, tuple[float, float]]:
    """The float range ``(lo, hi)`` of each of ``tensors`` (values of ``model``: a path or
    onnx.ModelProto) over ``calib`` (a CalibrationSet, or any source :func:`open_calibration`
    takes) by ``method``, with its options (see
    :func:`choose_ranges`). ``workers > 1`` shards the set across that many processes (the result
    is identical for any ``workers``); ``threads``: onnxruntime's intra-op threads per session (by
    default its own choice with one worker, 1 with several). ``progress(step, done, total)`` over
    feeds: "calibrating: ranges", then "calibrating: histograms"."""
    opts = check_method(method, method_options)
    if not isinstance(workers, (int, np.integer)) or isinstance(workers, bool) or workers < 1:
        raise UsageError(f"calibration workers: expected an integer >= 1, got {workers!r}")
    HistStats({}, bins)  # (checks bins before any work)
    tensors = list(dict.fromkeys(tensors))
    if not tensors:
        return {}
    if not isinstance(calib, CalibrationSet):
        calib = open_calibration(calib, model)
    total = len(calib)
    exposed, om = _exposed(model, tensors)
    try:
        if workers == 1:
            runner = _Runner(exposed, tensors, 0 if threads is None else threads)
            ranges = _ranges_pass(runner, calib, progress, "calibrating: ranges", 0, total)
            hists = None
            if method != "minmax":
                hists = _hist_pass(runner, calib, ranges.spans(), bins, progress, "calibrating: histograms", 0,
                                   total)
        else:
            ranges, hists = _calibrate_parallel(exposed, tensors, calib, method, workers, bins,
                                                1 if threads is None else threads, progress)
    finally:
        om.close()
    choose = {k: v for k, v in opts.items() if k in _OPTIONS[method]}
    return choose_ranges(ranges, hists, method, **choose)


def _calibrate_parallel(exposed, tensors, calib, method, workers, bins, threads, progress):
    calib = calib.portable()  # (a reader is spooled to disk once, here)
    total = len(calib)
    chunks = [calib.shard(i, min(total, workers * 4)).portable() for i in range(min(total, workers * 4))]
    with tempfile.TemporaryDirectory(prefix="onnxopt-calib-model-") as tmp:
        if not isinstance(exposed, str):  # (bytes: written once, not pickled to every worker)
            path = os.path.join(tmp, "exposed.onnx")
            with open(path, "wb") as f:
                f.write(exposed)
            exposed = path
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(workers, len(chunks)), mp_context=ctx, initializer=_init_worker,
                                 initargs=(exposed, tensors, threads)) as pool:
            parts = _gather(pool, [(_worker_ranges, (ch,)) for ch in chunks], [len(ch) for ch in chunks],
                            progress, "calibrating: ranges", total)
            ranges = RangeStats.merge_all([RangeStats.from_dict(p) for p in parts])
            hists = None
            if method != "minmax":
                spans = ranges.spans()
                parts = _gather(pool, [(_worker_hists, (ch, spans, bins)) for ch in chunks],
                                [len(ch) for ch in chunks], progress, "calibrating: histograms", total)
                hists = HistStats.merge_all([HistStats.from_dict(p) for p in parts])
    return ranges, hists


def _gather(pool, calls, sizes, progress, step, total) -> list:
    futures = [pool.submit(fn, *args) for fn, args in calls]
    index = {f: i for i, f in enumerate(futures)}
    results: list = [None] * len(futures)
    done = 0
    from concurrent.futures import as_completed
    for fut in as_completed(futures):
        i = index[fut]
        results[i] = fut.result()
        done += sizes[i]
        if progress is not None:
            progress(step, done, total)
    return results  # in chunk order (the merge is exact in any order; this keeps it plain)
