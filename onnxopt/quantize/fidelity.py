"""Fidelity of a quantized model against its float model, measured: SQNR per output and per
quantized activation, the fallback that returns the layers that hurt most to float until an
output SQNR target is met, and the keep-float decision that keeps the float model when int8 is not
faster (from the cost table shipped in the package by default; a timing on this machine only when
asked).

SQNR (signal-to-quantization-noise ratio) of a test array against a reference is
``10 log10(sum ref^2 / sum (ref - test)^2)`` dB. Over several feeds the signal and noise
energies are summed first and the ratio taken once (an average of dB values would let one
near-silent feed dominate). 20 dB is a noise energy 1% of the signal's; 40 dB, 0.01%.
``sqnr_db`` itself lives in ``onnxopt.verify.compare`` (the verifier judges a quantized model
against its float model by it) and is re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx

from onnxopt.errors import UsageError
from onnxopt.verify.compare import sqnr_db, sqnr_energies, sqnr_from_energies

__all__ = ["FallbackResult", "LatencyCheck", "decide_keep", "held_out_estimate", "sqnr_interval", "table_decision", "fallback", "latency_check", "layer_sqnr",
           "node_damage", "output_sqnr", "sqnr_db"]


# ---- SQNR ----------------------------------------------------------------------------------------------------


_db = sqnr_from_energies
_energies = sqnr_energies


class _Energy:
    """Signal and noise energies summed per name over feeds."""

    def __init__(self):
        self.sums: dict[str, list[float]] = {}

    def add(self, name: str, reference, test) -> None:
        s, n = _energies(reference, test)
        acc = self.sums.setdefault(name, [0.0, 0.0])
        acc[0] += s
        acc[1] += n

    def db(self, name: str) -> float:
        return _db(*self.sums[name])

    def nsr(self, name: str) -> float:
        """Noise over signal (linear); inf for noise on a zero signal, 0 without noise."""
        s, n = self.sums[name]
        if n == 0:
            return 0.0
        return float("inf") if s == 0 or math.isnan(s) or math.isnan(n) else n / s


# ---- running models --------------------------------------------------------------------------------------------


def _feed_list(feeds) -> Iterable[Mapping[str, np.ndarray]]:
    if isinstance(feeds, Mapping):
        return [feeds]
    return feeds


def _ort_model(model, label: str):
    from onnxopt.verify.runtime import OrtModel

    return OrtModel(model, label)


def _types_with_float_default(proto: onnx.ModelProto, names: Iterable[str]) -> dict[str, onnx.TypeProto]:
    from onnxopt.verify.culprit import value_types

    types = value_types(proto)
    for n in names:
        if n not in types:
            t = onnx.TypeProto()
            t.tensor_type.elem_type = onnx.TensorProto.FLOAT
            types[n] = t
    return types


class _Runner:
    """One session over a model (optionally with values exposed as outputs) run feed after feed."""

    def __init__(self, model, label: str, expose: Sequence[str] = (), *, optimization: str | None = None,
                 provider: str = "cpu", threads: int = 0):
        from onnxopt.verify.runtime import session

        self.m = _ort_model(model, label)
        graph_outputs = [o.name for o in self.m.proto.graph.output]
        extra = [n for n in dict.fromkeys(expose) if n not in graph_outputs]
        source = self.m.with_outputs(extra, _types_with_float_default(self.m.proto, extra)) if extra \
            else self.m.source()
        self.sess = session(source, provider, optimization=optimization, threads=threads)
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]

    def run(self, feed: Mapping[str, np.ndarray], names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        missing = [n for n in self.inputs if n not in feed]
        if missing:
            raise UsageError(f"{self.m.label}: the feed lacks input {missing[0]!r}")
        names = list(names) if names is not None else self.outputs
        outs = self.sess.run(names, {n: feed[n] for n in self.inputs})
        values = dict(zip(names, (np.asarray(v) for v in outs)))
        values.update({n: np.asarray(feed[n]) for n in self.inputs if n in (names or ())})
        return values

    def close(self) -> None:
        self.m.close()


def _match_outputs(float_names: Sequence[str], quant_names: Sequence[str]) -> list[tuple[str, str]]:
    """(float output, quantized output) pairs: by name, else by position."""
    if set(float_names) <= set(quant_names):
        return [(n, n) for n in float_names]
    if len(float_names) != len(quant_names):
        raise UsageError(f"the quantized model has {len(quant_names)} outputs, the float model {len(float_names)}")
    return list(zip(float_names, quant_names))


SMALL_HELD_OUT = 8
"""Fewer held-out samples than this: the SQNR estimate is flagged as small (its interval is wide and
one unusual sample moves it)."""
SQNR_CONFIDENCE = 0.90
SQNR_RESAMPLES = 2000
SQNR_SEED = 20241127  # fixed: the same samples give the same interval


def _float_output_runs(float_model, quant_model, feeds, provider: str, threads: int, not_float: set):
    """Both models run on each feed: per feed, the float model's output names (in order) and
    {name: (float output, quantized output)} of the outputs matched between them (by name, else by
    position) that are floating-point in both; the names of those that are not join ``not_float``."""
    f = q = None
    try:
        f = _Runner(float_model, "float model", provider=provider, threads=threads)
        q = _Runner(quant_model, "quantized model", provider=provider, threads=threads)
        pairs = _match_outputs(f.outputs, q.outputs)
        for feed in _feed_list(feeds):
            a, b = f.run(feed), q.run(feed)
            row = {}
            for fn, qn in pairs:
                if a[fn].dtype.kind != "f" or b[qn].dtype.kind != "f":
                    not_float.add(fn)
                    continue
                row[fn] = (a[fn], b[qn])
            yield [fn for fn, _ in pairs], row
    finally:
        for r in (f, q):
            if r is not None:
                r.close()


def output_sqnr_samples(float_model, quant_model, feeds, *, provider: str = "cpu",
                        threads: int = 0) -> dict[str, list[tuple[float, float]]]:
    """Each float output's (signal, noise) energies per feed, the terms :func:`output_sqnr` sums
    (outputs matched, and non-float ones left out, as there)."""
    out: dict[str, list[tuple[float, float]]] = {}
    not_float: set[str] = set()
    for _, row in _float_output_runs(float_model, quant_model, feeds, provider, threads, not_float):
        for fn, (x, y) in row.items():
            out.setdefault(fn, []).append(tuple(float(e) for e in _energies(x, y)))
    return {fn: v for fn, v in out.items() if fn not in not_float and v}


def sqnr_interval(energies: Sequence[tuple[float, float]], *, confidence: float = SQNR_CONFIDENCE,
                  resamples: int = SQNR_RESAMPLES, seed: int = SQNR_SEED) -> tuple[float, float] | None:
    """A ``confidence`` percentile-bootstrap interval (dB) of the SQNR whose energies are summed over
    the samples: the samples are resampled with replacement ``resamples`` times with a fixed ``seed``
    (the same samples give the same interval). None for fewer than 2 samples."""
    e = np.asarray(energies, dtype=np.float64).reshape(-1, 2)
    n = len(e)
    if n < 2:
        return None
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    sig, noise = e[idx, 0].sum(axis=1), e[idx, 1].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        db = np.where(noise > 0, 10 * np.log10(sig / noise), np.inf)
    db = np.where(np.isnan(db), -np.inf, db)
    tail = (1 - confidence) / 2
    lo, hi = (float(x) for x in np.quantile(db, [tail, 1 - tail], method="inverted_cdf"))  # (no inf - inf)
    return lo, hi


def held_out_estimate(float_model, quant_model, feeds, *, held_out: int, provider: str = "cpu") -> tuple[dict, list]:
    """The output SQNR on the held-out ``feeds`` with its sample size and a bootstrap interval per
    output (:func:`sqnr_interval`), and the warnings: a small sample (under :data:`SMALL_HELD_OUT`),
    or none held out (``held_out`` 0: the calibration samples themselves, optimistic)."""
    samples = output_sqnr_samples(float_model, quant_model, feeds, provider=provider)
    n = max((len(v) for v in samples.values()), default=0)
    intervals = {}
    for name, energies in samples.items():
        ci = sqnr_interval(energies)
        intervals[name] = None if ci is None else [round(x, 2) if math.isfinite(x) else x for x in ci]
    est = {"samples": n, "held_out": bool(held_out), "confidence": SQNR_CONFIDENCE, "interval_db": intervals}
    warnings = []
    if held_out and n < SMALL_HELD_OUT:
        warnings.append(f"the output SQNR is estimated on {n} held-out sample(s) only (fewer than {SMALL_HELD_OUT}): "
                        "it may be optimistic; give more calibration samples or --held-out N")
    return est, warnings


def output_sqnr(float_model, quant_model, feeds, *, provider: str = "cpu", threads: int = 0) -> dict[str, float]:
    """SQNR in dB of each output of ``quant_model`` (run as a user runs it: onnxruntime's graph
    optimizations on, integer kernels fused) against ``float_model``'s, energies summed over all
    ``feeds`` (an iterable of feed dicts, or one dict). Outputs are matched by name, else by
    position; the dict follows the float model's output order. Only floating-point outputs are
    scored (an ArgMax's int64 classes or a bool mask is no signal plus noise: it is left out, as
    verify's int8 check does); a model with no float output gives {} (callers treat that as
    nothing to measure: ``min(result.values(), default=inf)``)."""
    acc = _Energy()
    count = 0
    names: list[str] = []
    not_float: set[str] = set()
    for names, row in _float_output_runs(float_model, quant_model, feeds, provider, threads, not_float):
        for fn, (x, y) in row.items():
            acc.add(fn, x, y)
        count += 1
    if not count:
        raise UsageError("output SQNR: no feeds")
    return {fn: acc.db(fn) for fn in names if fn not in not_float}


# ---- the QDQ graph's structure ---------------------------------------------------------------------------------


class _QdqGraph:
    """Which float value each value of a QDQ model stands for, and the Q/DQ around each node."""

    def __init__(self, proto: onnx.ModelProto, float_values: set[str]):
        g = proto.graph
        self.nodes = list(g.node)
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.consumers: dict[str, list] = {}
        for n in self.nodes:
            for x in n.input:
                if x:
                    self.consumers.setdefault(x, []).append(n)
        self.constants = {t.name for t in g.initializer} | {o for n in self.nodes if n.op_type == "Constant"
                                                           for o in n.output}
        self.float_values = float_values
        # quantized tensors: float name -> (value before Q, value after DQ)
        self.quantized: dict[str, tuple[str, str]] = {}
        self.q_of: dict[str, str] = {}  # value after DQ -> float name of the tensor quantized
        for n in self.nodes:
            if n.op_type != "QuantizeLinear" or n.input[0] in self.constants:
                continue
            dqs = [c for c in self.consumers.get(n.output[0], []) if c.op_type == "DequantizeLinear"]
            if not dqs:
                continue
            pre, post = n.input[0], dqs[0].output[0]
            name = pre if pre in float_values else post if post in float_values else None
            if name is None:
                continue
            self.quantized.setdefault(name, (pre, post))
            for d in dqs:
                self.q_of[d.output[0]] = name

    def counterpart(self, value: str) -> str | None:
        """The float model's value that ``value`` of the QDQ model approximates."""
        if value in self.q_of:
            return self.q_of[value]
        if value in self.float_values:
            return value
        for c in self.consumers.get(value, []):  # a renamed graph output: value -> Q -> DQ -> float name
            if c.op_type == "QuantizeLinear":
                for d in self.consumers.get(c.output[0], []):
                    if d.op_type == "DequantizeLinear" and d.output[0] in self.float_values:
                        return d.output[0]
        return None

    def compute_nodes(self) -> list:
        return [n for n in self.nodes if n.op_type not in ("QuantizeLinear", "DequantizeLinear", "Constant")
                and not all(x in self.constants for x in n.input if x)]

    def activation_inputs(self, n) -> list[str]:
        """Inputs that are neither constants nor DequantizeLinear'd constants (weights, biases)."""
        out = []
        for x in n.input:
            if not x or x in self.constants:
                continue
            p = self.producer.get(x)
            if p is not None and p.op_type == "DequantizeLinear" and p.input[0] in self.constants:
                continue
            out.append(x)
        return out

    def as_read(self, y: str) -> str:
        """The value consumers of ``y`` read: the output of the DequantizeLinear after its
        QuantizeLinear, if there is one, else ``y``."""
        for c in self.consumers.get(y, []):
            if c.op_type == "QuantizeLinear":
                for d in self.consumers.get(c.output[0], []):
                    if d.op_type == "DequantizeLinear":
                        return d.output[0]
        return y

    def from_graph_input(self, x: str) -> bool:
        """``x`` is a graph input, or its dequantized value (no node computed it)."""
        while x:
            p = self.producer.get(x)
            if p is None:
                return x not in self.constants
            if p.op_type not in ("QuantizeLinear", "DequantizeLinear"):
                return False
            x = p.input[0]
        return False

    def quantized_readers(self, y: str) -> list:
        """Compute nodes reading ``y`` through a QuantizeLinear/DequantizeLinear."""
        out = []
        for c in self.consumers.get(y, []):
            if c.op_type == "QuantizeLinear":
                for d in self.consumers.get(c.output[0], []):
                    if d.op_type == "DequantizeLinear":
                        out += [r for r in self.consumers.get(d.output[0], [])
                                if r.op_type not in ("QuantizeLinear", "DequantizeLinear")]
        return out


def _float_values(proto: onnx.ModelProto) -> set[str]:
    g = proto.graph
    return {x.name for x in g.input} | {o for n in g.node for o in n.output if o}


def _qdq_graph(float_model, quant_model) -> _QdqGraph:
    """The QDQ model's structure, its quantized tensors matched to the float model's values."""
    fm = _ort_model(float_model, "float model")
    qm = _ort_model(quant_model, "quantized model")
    try:
        return _QdqGraph(qm.proto, _float_values(fm.proto))
    finally:
        fm.close()
        qm.close()


def layer_sqnr(float_model, quant_model, tensors: Sequence[str] | None, feeds, *, provider: str = "cpu",
               threads: int = 0) -> dict[str, float]:
    """SQNR in dB of each quantized activation: for every float tensor T that the QDQ model
    quantizes (a QuantizeLinear reads T, or the DequantizeLinear after it writes T), the value the
    QDQ model's DequantizeLinear gives against the float model's T, energies summed over ``feeds``.

    This measures the *simulated* QDQ graph: the QDQ model runs with onnxruntime's graph
    optimizations off, so every Q/DQ computes as written (what onnxruntime's integer kernels compute
    differs by rounding of the int32 accumulator's requantization). ``tensors``: the float tensor
    names to measure (a name the QDQ model does not quantize is an error), None for all, in
    model order."""
    g = _qdq_graph(float_model, quant_model)
    if tensors is None:
        names = list(g.quantized)
    else:
        names = list(dict.fromkeys(tensors))
        missing = [t for t in names if t not in g.quantized]
        if missing:
            raise UsageError(f"layer SQNR: tensor {missing[0]!r} is not quantized in the QDQ model")
    if not names:
        return {}
    pairs = [(t, g.quantized[t][1]) for t in names]
    acc = _measure(float_model, quant_model, pairs, feeds, provider, threads)
    return {t: acc.db(pair) for t, pair in zip(names, pairs)}


def _measure(float_model, quant_model, pairs: list[tuple[str, str]], feeds, provider: str,
             threads: int) -> _Energy:
    """Energies of (float model value, QDQ model value) pairs summed over ``feeds``, keyed by the
    pair; the QDQ model runs with graph optimizations off (its values as written). A pair whose
    shapes differ is left out."""
    f = q = None
    fnames = list(dict.fromkeys(a for a, _ in pairs))
    qnames = list(dict.fromkeys(b for _, b in pairs))
    try:
        f = _Runner(float_model, "float model", fnames, provider=provider, threads=threads)
        q = _Runner(quant_model, "quantized model", qnames, optimization="disable", provider=provider,
                    threads=threads)
        acc = _Energy()
        count = 0
        for feed in _feed_list(feeds):
            a, b = f.run(feed, fnames), q.run(feed, qnames)
            for pair in pairs:
                if a[pair[0]].shape == b[pair[1]].shape:
                    acc.add(pair, a[pair[0]], b[pair[1]])
            count += 1
        if not count:
            raise UsageError("SQNR: no feeds")
        return acc
    finally:
        for r in (f, q):
            if r is not None:
                r.close()


def _added(after: float, before: float) -> float:
    """Noise added between two noise-to-signal ratios (never negative; inf over a finite one)."""
    if math.isinf(after):
        return 0.0 if math.isinf(before) else float("inf")
    return max(0.0, after - before)


_PLAN_KEY = "quantize.plan_node"  # (rules/qdq.py's PLAN_KEY: apply_plan(keep_plan_keys=True) leaves it)


def _node_key(node) -> str:
    """A NodeProto's name as the quantizer's plan knows it (see node_damage)."""
    return next((p.value for p in node.metadata_props if p.key == _PLAN_KEY), node.name)


def node_damage(float_model, quant_model, feeds, *, excluded: Iterable[str] = (),
                candidates: Iterable[str] | None = None, provider: str = "cpu", threads: int = 0) -> dict[str, float]:
    """How much quantization noise each named compute node of the QDQ model adds, as a
    noise-to-signal ratio (linear: 0.01 is the noise of a 20 dB SQNR), measured against the float
    model over ``feeds`` on the simulated QDQ graph; in model order.

    A node's damage is the noise-to-signal ratio of its output as its consumers read it (after the
    QuantizeLinear/DequantizeLinear that follows it, if any) minus the largest ratio among its
    activation inputs as it reads them: the noise its quantized weights, its int32 bias and the
    requantization of its output add. The quantization of a graph input is charged to the nodes
    reading it. Why ratios and not dB: the noise of independent sources adds, and passes through
    linear layers about unchanged relative to the signal, so ratios rank nodes by the output noise
    that returning them to float removes; a drop in dB would rank a 60 -> 50 dB layer (ratio
    +9e-6) above a 25 -> 20 dB one (+6.8e-3).

    ``excluded``: nodes already float. The requantization of an excluded node's output that its
    quantized consumers still keep is charged to those consumers (returning them to float removes it).
    ``candidates``: the nodes that can be returned to float (None: all); the damage of another node
    (a Relu whose range the QuantizeLinear after it absorbs) is charged to the candidate whose value
    it reads (through up to 3 such nodes), else to the quantized readers of its output."""
    g = _qdq_graph(float_model, quant_model)
    nodes = [n for n in g.compute_nodes() if n.name]
    # a node's name as the caller's plan knows it: the plan key the quantizer leaves in the QDQ
    # model's node metadata (its rules rename what they rewrite), else the node's own name
    key = {id(n): next((p.value for p in n.metadata_props if p.key == _PLAN_KEY), n.name) for n in nodes}
    plan = {}
    pairs: list[tuple[str, str]] = []
    for n in nodes:
        ins, outs = [], []
        for x in g.activation_inputs(n):
            f = g.counterpart(x)
            if f is not None:
                ins.append(((f, x), g.from_graph_input(x)))
        for y in n.output:
            if y:
                seen = g.as_read(y)
                f = g.counterpart(seen)
                if f is not None:
                    outs.append((f, seen))
        plan[key[id(n)]] = (ins, outs)
        pairs += [p for p, _ in ins] + outs
    pairs = list(dict.fromkeys(pairs))
    if not pairs:
        return {key[id(n)]: 0.0 for n in nodes}
    acc = _measure(float_model, quant_model, pairs, feeds, provider, threads)
    nsr = {p: acc.nsr(p) for p in pairs if p in acc.sums}
    damage: dict[str, float] = {}
    for n in nodes:
        ins, outs = plan[key[id(n)]]
        before = max((0.0 if graph_input else nsr[p] for p, graph_input in ins if p in nsr), default=0.0)
        after = max((nsr[p] for p in outs if p in nsr), default=before)
        damage[key[id(n)]] = max(damage.get(key[id(n)], 0.0), _added(after, before))
    by_name = {key[id(n)]: n for n in nodes}
    excluded = set(excluded)
    movable = set(by_name) - excluded if candidates is None else set(candidates) - excluded
    for name in [key[id(n)] for n in nodes if key[id(n)] not in movable and damage[key[id(n)]] > 0]:
        node, target = by_name[name], None
        if name not in excluded:  # a node that cannot be chosen: charge the candidate it reads
            x = next(iter(g.activation_inputs(node)), None)
            for _ in range(3):
                p = g.producer.get(x) if x else None
                while p is not None and p.op_type in ("QuantizeLinear", "DequantizeLinear"):
                    p = g.producer.get(p.input[0])
                pk = _node_key(p) if p is not None else None
                if p is None or not pk or pk in excluded:
                    break
                if pk in movable:
                    target = pk
                    break
                x = next(iter(g.activation_inputs(p)), None)
        if target is not None:
            damage[target] += damage[name]
            continue
        readers = [_node_key(c) for y in node.output if y for c in g.quantized_readers(y) if _node_key(c) in movable]
        for r in dict.fromkeys(readers):
            damage[r] += damage[name]
    return damage


# ---- fallback to float ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class FallbackResult:
    """What :func:`fallback` ended with: the ``model`` (the last one made), the nodes returned to
    float in the order they were chosen, ``history`` rows (nodes excluded, min output SQNR in dB)
    for every model measured, ``met``: its min output SQNR reached the target, and the last
    model's ``output_db`` per output."""

    model: onnx.ModelProto
    excluded: tuple[str, ...]
    history: list[tuple[int, float]]
    met: bool
    min_db: float
    output_db: dict[str, float]
    rounds: list[dict] = dataclasses.field(default_factory=list)  # per round: excluded then, and the damage

    def as_dict(self) -> dict:
        return {"met": self.met, "target_db": _json_db(self.min_db), "excluded": list(self.excluded),
                "history": [[k, _json_db(v)] for k, v in self.history],
                "output_db": {k: _json_db(v) for k, v in self.output_db.items()}, "rounds": self.rounds}


def _json_db(v: float):
    """A dB figure for JSON: rounded to 0.01 dB; +inf/-inf/NaN as strings (JSON has no infinities)."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return round(v, 2)


def _min_db(values: Mapping[str, float]) -> float:
    vals = list(values.values())
    return float("nan") if any(math.isnan(v) for v in vals) else min(vals, default=float("inf"))


def fallback(float_model, requantize: Callable[[frozenset[str]], onnx.ModelProto], feeds, min_db: float, *,
             candidates: Sequence[str], model: onnx.ModelProto | None = None, first_batch: int = 1,
             provider: str = "cpu", threads: int = 0,
             progress: Callable[[str, int, int], None] | None = None) -> FallbackResult:
    """Return the nodes that hurt most to float until the quantized model's output SQNR (the
    lowest over its outputs, on ``feeds``: held-out samples, re-iterable) is at least ``min_db``.

    ``requantize(excluded)`` makes the QDQ model with the nodes ``excluded`` left float;
    ``model``: the one for no exclusion when already made (else ``requantize(frozenset())``).
    Below the target it ranks the ``candidates`` still quantized by :func:`node_damage` (ties in
    ``candidates`` order) and tries the worst ``first_batch`` nodes in float: a trial that raises
    the output SQNR is kept and the next batch is twice as large; one that does not (returning a
    node to float can leave its neighbours' requantization in place, or change what shares a
    range) is dropped and the next-ranked nodes are tried instead (as many). After ``MAX_MISSES`` misses in the
    run the worst-ranked nodes go to float regardless, batches doubling, so the search is bounded
    and ends: every candidate float meets any target. ``progress(step, done, total)`` hears each round."""
    if not math.isfinite(min_db):
        raise UsageError(f"fidelity target {min_db} dB: must be a finite number")
    order = list(dict.fromkeys(candidates))
    rank = {name: i for i, name in enumerate(order)}
    excluded: list[str] = []
    history: list[tuple[int, float]] = []
    rounds: list[dict] = []
    batch = max(1, first_batch)
    current = model if model is not None else requantize(frozenset())
    outs = output_sqnr(float_model, current, feeds, provider=provider, threads=threads)
    worst = _min_db(outs)
    history.append((0, worst))
    rejected: set[str] = set()
    misses = 0  # trials in a row that did not raise the SQNR
    damage: dict[str, float] | None = None
    readers = _readers(float_model, set(order))
    while True:
        if progress is not None:
            progress(f"fidelity: {len(excluded)} node(s) float, min output SQNR {_json_db(worst)} dB "
                     f"(target {min_db:g})", len(excluded), len(order))
        left = [n for n in order if n not in set(excluded)]
        if worst >= min_db or not left:
            return FallbackResult(current, tuple(excluded), history, worst >= min_db, min_db, outs, rounds)
        if damage is None:
            damage = node_damage(float_model, current, feeds, excluded=excluded, candidates=order, provider=provider,
                                 threads=threads)
        ranked = sorted(left, key=lambda n: (-damage.get(n, 0.0), rank[n]))
        pool = [n for n in ranked if n not in rejected]
        forced = not pool or misses >= MAX_MISSES  # (misses count over the whole run: a bounded search)
        chosen = ranked[:batch] if forced else pool[:batch]
        trial = requantize(frozenset(excluded + chosen))
        t_outs = output_sqnr(float_model, trial, feeds, provider=provider, threads=threads)
        t_worst = _min_db(t_outs)
        history.append((len(excluded) + len(chosen), t_worst))
        accepted = forced or t_worst > worst
        rounds.append({"excluded_before": len(excluded), "min_output_db": _json_db(worst),
                       "trial_db": _json_db(t_worst), "accepted": accepted, "forced": forced,
                       "chosen": [{"node": n, "damage_nsr": _json_nsr(damage.get(n, 0.0))} for n in chosen]})
        wider = [r for n in chosen for r in readers.get(n, ()) if r not in set(excluded) | set(chosen)]
        if not accepted and wider:  # their outputs stayed quantized for their readers: those go float too
            chosen = chosen + list(dict.fromkeys(wider))
            trial = requantize(frozenset(excluded + chosen))
            t_outs = output_sqnr(float_model, trial, feeds, provider=provider, threads=threads)
            t_worst = _min_db(t_outs)
            history.append((len(excluded) + len(chosen), t_worst))
            accepted = t_worst > worst
            rounds.append({"excluded_before": len(excluded), "min_output_db": _json_db(worst),
                           "trial_db": _json_db(t_worst), "accepted": accepted, "forced": False, "with_readers": True,
                           "chosen": [{"node": n, "damage_nsr": _json_nsr(damage.get(n, 0.0))} for n in chosen]})
        if accepted:  # the trial is the new model; the next batch is twice as large
            excluded += chosen
            current, outs, worst = trial, t_outs, t_worst
            batch *= 2
            rejected.clear()
            damage = None
        else:  # returning these to float did not help (their neighbours' requantization stays): try others
            rejected.update(chosen)
            misses += 1


def _readers(float_model, names: set[str]) -> dict[str, list[str]]:
    """For each node named in ``names``: the nodes among ``names`` that read its outputs, in model
    order (from the float model: a path or an onnx.ModelProto; other forms give none)."""
    if isinstance(float_model, (str, os.PathLike)):
        if not os.path.isfile(float_model):
            return {}
        proto = onnx.load(str(float_model), load_external_data=False)
    elif isinstance(float_model, onnx.ModelProto):
        proto = float_model
    else:
        return {}
    by_input: dict[str, list[str]] = {}
    for node in proto.graph.node:
        for x in node.input:
            if x and node.name in names:
                by_input.setdefault(x, []).append(node.name)
    return {node.name: [r for y in node.output for r in by_input.get(y, ())]
            for node in proto.graph.node if node.name in names}


MAX_MISSES = 8
"""fallback: trials (over the whole run) that may fail to raise the output SQNR; after that the
worst-ranked nodes are returned to float regardless, batches doubling, so the search is bounded: at
most MAX_MISSES + log2(candidates) + 2 models are measured (all float meets any target)."""


def _json_nsr(v: float):
    return "inf" if math.isinf(v) else float(f"{v:.4g}")


# ---- keep float when int8 is not faster ----------------------------------------------------------------------


@dataclasses.dataclass
class LatencyCheck:
    """:func:`latency_check`'s verdict: ``keep`` "int8" or "float", a one-line ``reason`` and the
    figures (milliseconds: median, p10, p90 of each model; ``ratio``: int8 median / float median;
    ``ratio_ci90``: the 90% bootstrap interval of that ratio over the interleaved rounds
    (``onnxopt.verify.runtime.ratio_interval``, deterministic); None when too few rounds), the
    rounds and the intra-op threads they ran at."""

    keep: str
    reason: str
    float_ms: dict[str, float]
    int8_ms: dict[str, float]
    ratio: float
    ratio_ci90: tuple[float, float] | None
    min_speedup: float
    rounds: int
    threads: int = 1

    def as_dict(self) -> dict:
        r = lambda x: float(f"{x:.5g}")  # noqa: E731 - 5 significant digits (a tiny model runs in microseconds)
        return {"mode": "measure", "keep": self.keep, "reason": self.reason,
                "float_ms": {k: r(v) for k, v in self.float_ms.items()},
                "int8_ms": {k: r(v) for k, v in self.int8_ms.items()}, "ratio": r(self.ratio),
                "ratio_ci90": [r(x) for x in self.ratio_ci90] if self.ratio_ci90 else None,
                "min_speedup": self.min_speedup, "rounds": self.rounds, "threads": self.threads,
                "machine_dependent": True}


def table_decision(costs: Mapping | None, min_speedup: float = 0.03) -> tuple[str, str, dict]:
    """``quantize(keep_float="auto")``: keep the int8 model when the shipped cost table
    (``plan.costs``: ``onnxopt.quantize.plan._cost_estimate``) estimates its covered nodes at least
    ``min_speedup`` faster than in float, else the float model; no timing, so the same input gives
    the same bytes. When the table covers no quantized node, int8 is kept (nothing says it is
    slower). Returns (keep, reason, the report's latency entry: mode "table", the estimate, the
    entries that decided it)."""
    costs = dict(costs or {})
    entry = {"mode": "table", "min_speedup": min_speedup, **costs}
    ratio = costs.get("ratio")
    if ratio is None:
        return "int8", ("the cost table covers none of the quantized nodes: int8 kept (--keep-float measure times "
                        "both models on this machine)"), entry
    top = costs.get("entries") or []
    named = "; ".join(f"{e['entry']} ({e['nodes']} node{'s' if e['nodes'] != 1 else ''}, {100 * e['share']:.0f}% "
                      f"of the float time, x{e['ratio']:.2f})" for e in top[:3])
    more = f"; {len(top) - 3} more entries" if len(top) > 3 else ""
    change = f"{100 * (1 - ratio):.1f}% faster" if ratio <= 1 else f"{100 * (ratio - 1):.1f}% slower"
    figures = (f"cost table estimate for the {costs.get('nodes', 0)} quantized node(s) it covers: int8 x{ratio:.3f} "
               f"of float ({change}; {named}{more})")
    if ratio <= 1 - min_speedup:
        return "int8", f"{figures}: at least {100 * min_speedup:g}% faster, int8 kept", entry
    return "float", f"{figures}: not at least {100 * min_speedup:g}% faster, float model kept", entry


def decide_keep(float_median_ms: float, int8_median_ms: float, min_speedup: float = 0.03) -> tuple[str, str]:
    """The rule: keep int8 when its median latency is at least ``min_speedup`` (a fraction) below
    float's, i.e. ``int8 <= (1 - min_speedup) * float``; else keep float. Returns (keep, reason)."""
    if not (float_median_ms > 0 and math.isfinite(float_median_ms) and math.isfinite(int8_median_ms)):
        return "float", f"latency could not be compared (float {float_median_ms} ms, int8 {int8_median_ms} ms)"
    ratio = int8_median_ms / float_median_ms
    change = f"{100 * (1 - ratio):.1f}% faster" if ratio <= 1 else f"{100 * (ratio - 1):.1f}% slower"
    figures = f"int8 median {int8_median_ms:.3f} ms vs float {float_median_ms:.3f} ms (x{ratio:.3f}, {change})"
    if int8_median_ms <= (1 - min_speedup) * float_median_ms:
        return "int8", f"{figures}: at least {100 * min_speedup:g}% faster, int8 kept"
    return "float", f"{figures}: not at least {100 * min_speedup:g}% faster, float model kept"


def _stats(times_ms: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(times_ms), "p10": float(np.percentile(times_ms, 10)),
            "p90": float(np.percentile(times_ms, 90))}


def latency_check(float_model, quant_model, feeds, *, min_speedup: float = 0.03, runs: int = 400, warmup: int = 10,
                  min_rounds: int = 30, budget_s: float = 10.0, threads: int = 1, provider: str = "cpu",
                  measure: Callable[..., dict] | None = None) -> LatencyCheck:
    """``quantize(keep_float="measure")``: time the quantized model against the float model on one
    feed (the first of ``feeds``) on this machine with onnxruntime at ``threads`` intra-op threads
    (default 1; 0: onnxruntime's choice), interleaved (``onnxopt.verify.runtime.measure_latency``:
    each round runs both, the order alternating) after ``warmup`` runs: ``runs`` rounds, fewer when
    they would pass ``budget_s`` but at least ``min_rounds``. int8 is kept when its median is at
    least ``min_speedup`` below float's and the 90% bootstrap interval of the ratio
    (``ratio_interval``) lies below 1.0; the result depends on the machine and its load.
    ``measure``: a stand-in for measure_latency (tests)."""
    from onnxopt.verify.runtime import ratio_interval

    if not 0 <= min_speedup < 1:
        raise UsageError(f"min_speedup {min_speedup}: a fraction in [0, 1)")
    feed = next(iter(_feed_list(feeds)), None)
    if feed is None:
        raise UsageError("latency check: no feeds")
    if measure is None:
        import functools

        from onnxopt.verify.runtime import measure_latency

        # thread pools that sleep between runs: the idle session's spinning pool would slow the other
        measure = functools.partial(measure_latency, spin=False)
    fm = _ort_model(float_model, "float model")
    qm = _ort_model(quant_model, "quantized model")
    try:
        lat = measure({"float": fm.source(), "int8": qm.source()}, feed, provider=provider, runs=runs,
                      warmup=warmup, budget_s=budget_s, min_rounds=min_rounds, threads=threads)
    finally:
        fm.close()
        qm.close()
    res = lat.get("results", {})
    if "float" not in res or "int8" not in res:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(lat.get("errors", {}).items())) or "no timings"
        keep = "int8" if "float" not in res and "int8" in res else "float"
        return LatencyCheck(keep, f"latency not measured ({why}), {keep} model kept", {}, {}, float("nan"), None,
                            min_speedup, lat.get("rounds", 0), threads)
    ft, it = res["float"]["times_ms"], res["int8"]["times_ms"]
    fs, qs = _stats(ft), _stats(it)
    keep, reason = decide_keep(fs["median"], qs["median"], min_speedup)
    ci = ratio_interval(ft, it)
    interval = tuple(ci["interval"]) if ci["interval"] else None
    where = f"measured on this machine at {threads or 'default'} thread(s), {lat['rounds']} interleaved rounds"
    if keep == "int8" and ci["verdict"] != "faster":
        keep = "float"
        reason = (f"{reason.rsplit(':', 1)[0]}, but the 90% interval of the ratio "
                  + (f"x{interval[0]:.3f}-x{interval[1]:.3f} contains 1.0" if interval else "needs 10 rounds")
                  + ": no measurable difference, float model kept")
    return LatencyCheck(keep, f"{reason} ({where})", fs, qs, qs["median"] / fs["median"], interval, min_speedup,
                        lat["rounds"], threads)
