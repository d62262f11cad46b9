"""onnxruntime for the verifier: the module (imported on first use), execution providers,
sessions, the models handed to them, profiled runs with their kernel counts, and latency.

For every requested execution provider (``cpu``, ``cuda``) a model runs in a session whose
profiler records the kernels of one run (by op type, by provider, Memcpy nodes); latency is
timed as interleaved runs after a warm-up (median, 90th percentile).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.ir import io
from onnxopt.errors import OnnxoptError, UsageError


PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


class VerifyUnavailable(OnnxoptError):
    """onnxruntime (or the requested execution provider) is not installed."""


class OrtModel:
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


def parse_provider_options(items: Sequence[str] | Mapping | None) -> dict[str, dict[str, str]]:
    """Provider options as given on the command line (``cuda:prefer_nhwc=1``, repeatable) or as a
    mapping (``{"cuda": {"prefer_nhwc": 1}}``), as ``{provider: {option: text}}``; a malformed item or an
    unknown provider is a UsageError."""
    out: dict[str, dict[str, str]] = {}
    if not items:
        return out
    if isinstance(items, Mapping):
        for prov, opts in items.items():
            key = parse_providers([str(prov)])[0]
            if not isinstance(opts, Mapping):
                raise UsageError(f"provider options for {prov}: expected a mapping of option to value, not "
                                 f"{type(opts).__name__}")
            out.setdefault(key, {}).update({str(k): _option_text(v) for k, v in opts.items()})
        return out
    if isinstance(items, str):
        items = [items]
    for item in items:
        prov, sep, rest = str(item).partition(":")
        name, eq, value = rest.partition("=")
        if not sep or not eq or not name.strip() or not prov.strip():
            raise UsageError(f"--provider-option {item!r}: expected PROVIDER:NAME=VALUE, e.g. cuda:prefer_nhwc=1")
        key = parse_providers([prov])[0]
        out.setdefault(key, {})[name.strip()] = value.strip()
    return out


def _option_text(v) -> str:
    return ("1" if v else "0") if isinstance(v, bool) else str(v)


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


# The CPU provider's options onnxruntime's Python binding reads (it does not echo them back in
# get_provider_options(), so they are named here).
_CPU_OPTIONS = {"use_arena"}


def session(model, provider: str = "cpu", *, profile_prefix: str | None = None, threads: int = 0,
            optimization: str | None = None, exact: bool = False, spin: bool = True,
            provider_options: Mapping[str, Mapping[str, str]] | None = None):
    """An onnxruntime session on one provider (CUDA sessions fall back to CPU for what CUDA lacks);
    ``exact``: CUDA without TF32 (for comparing outputs; latency runs with the defaults);
    ``provider_options``: ``{provider: {option: value}}`` (:func:`parse_provider_options`), the options
    of this session's provider (``exact``'s use_tf32=0 unless they set use_tf32);
    ``spin=False``: its thread pool sleeps instead of spinning between runs (sessions timed in
    turn in one process would otherwise take the cores from the one running)."""
    ort = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 4  # fatal only: failures come back as exceptions, reported in one line
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        so.intra_op_num_threads = threads
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if optimization == "disable":
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    names = [PROVIDERS[provider]] + (["CPUExecutionProvider"] if provider != "cpu" else [])
    opts = {**(EXACT_CUDA_OPTIONS if provider == "cuda" and exact else {}),
            **{str(k): str(v) for k, v in ((provider_options or {}).get(provider) or {}).items()}}
    if opts:
        names = [(names[0], opts), *names[1:]]
    sess = ort.InferenceSession(model, so, providers=names)
    asked = {str(k) for k in ((provider_options or {}).get(provider) or {})}
    if asked and PROVIDERS[provider] in sess.get_providers():
        # onnxruntime drops an option its provider does not know, silently: say so instead
        taken = set((sess.get_provider_options() or {}).get(PROVIDERS[provider], {})) | \
            (_CPU_OPTIONS if provider == "cpu" else set())
        unknown = sorted(asked - taken)
        if unknown:
            raise UsageError(f"--provider-option {provider}:{unknown[0]}: onnxruntime's {PROVIDERS[provider]} has no "
                             f"such option" + (f" (it takes: {', '.join(sorted(taken))})" if taken else
                                               " (it takes none)"))
    return sess


def host_value(v):
    """An onnxruntime output as compared: an array, a list (a sequence), a dict (a map) or None."""
    if isinstance(v, (list, tuple)):
        return [host_value(x) for x in v]
    if isinstance(v, dict):
        return v
    return None if v is None else np.asarray(v)


def run_outputs(model, feeds: Mapping[str, np.ndarray], provider: str,
                provider_options: Mapping | None = None) -> list[tuple[str, np.ndarray]]:
    """The outputs of one run by name, compared as :func:`run_profiled`'s are (CUDA without TF32)."""
    sess = session(model, provider, exact=True, provider_options=provider_options)
    outs = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
    return [(o.name, host_value(v)) for o, v in zip(sess.get_outputs(), outs)]


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
                 threads: int = 0, provider_options: Mapping | None = None
                 ) -> tuple[list[tuple[str, np.ndarray]], dict, float]:
    """Outputs, kernel counts of one profiled run (after ``warmup`` runs) and session-creation seconds."""
    with tempfile.TemporaryDirectory(prefix="onnxopt-prof-") as tmp:
        t0 = time.perf_counter()
        sess = session(model, provider, profile_prefix=os.path.join(tmp, "p"), threads=threads, exact=True,
                       provider_options=provider_options)
        init_s = time.perf_counter() - t0
        feeds = {i.name: feeds[i.name] for i in sess.get_inputs()}
        for _ in range(max(0, warmup)):
            sess.run(None, feeds)
        outs = sess.run(None, feeds)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    names = [o.name for o in sess.get_outputs()]
    return [(n, host_value(v)) for n, v in zip(names, outs)], count_kernels(events), init_s


def measure_latency(models: dict[str, object], inputs: Mapping[str, np.ndarray], *, provider: str = "cpu",
                    runs: int = 50, warmup: int = 5, budget_s: float = 120.0, min_rounds: int = 5,
                    gap_s: float = 0.002, threads: int = 0,
                    progress: Callable[[int, int], None] | None = None, spin: bool = True,
                    provider_options: Mapping | None = None, entry_options: Mapping | None = None,
                    entry_inputs: Mapping | None = None) -> dict:
    """One session per entry, warmed up, then ``runs`` interleaved rounds (fewer when the rounds
    would pass ``budget_s``, but at least ``min_rounds``); each round times one run of every
    session, the order rotated by one per round. ``spin=False``: the sessions' thread pools sleep
    between runs (see :func:`session`): with many sessions on few cores, spinning idle pools slow
    the one running. ``provider_options``: ``{provider: {option: value}}`` for every session;
    ``entry_options``: ``{name: {provider: {...}}}``, an entry's own (to time one model with and
    without an option); ``entry_inputs``: ``{name: feeds}``, an entry's own inputs (a model given
    its inputs in another layout)."""
    sessions, feeds, errors = {}, {}, {}
    for name, model in models.items():
        try:
            opts = (entry_options or {}).get(name, provider_options)
            sess = session(model, provider, threads=threads, spin=spin, provider_options=opts)
            given = (entry_inputs or {}).get(name, inputs)
            feeds[name] = {i.name: given[i.name] for i in sess.get_inputs()}
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
    start = time.perf_counter()
    for r in range(rounds):
        if r >= min(runs, min_rounds) and time.perf_counter() - start > budget_s:
            rounds = r  # (the warm-up underestimated a run: the budget bounds the rounds, not the estimate)
            break
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
                                "times_ms": [round(x, 6) for x in ms]}
    return out


# ---- comparing two models' latency --------------------------------------------------------------------------

LATENCY_BUDGET_S = 10.0
"""Seconds of timed rounds per provider a latency comparison takes at most by default (``--latency-budget``)."""
LATENCY_THREADS = 1
"""onnxruntime's intra-op threads for timing unless asked (``--threads``): one thread is the setting
whose timings repeat; a pool of several waits on cores other processes hold."""
LATENCY_RUNS = 200
"""The most interleaved rounds a latency comparison times by default (``--runs``)."""
CONFIDENCE = 0.90
"""The confidence of the interval on the ratio of medians."""
MIN_INTERVAL_ROUNDS = 10
"""Fewer rounds than this give no interval: the verdict is then "too few rounds"."""
SESSION_SPREAD = 0.02
"""Two sessions of one model differ in latency by a little, steadily (where their weights and
buffers lie): up to 1% between bit-identical models on a 2-core x86 machine, with intervals of
+-0.1% that exclude 1.0. A ratio whose whole interval lies within this fraction of 1.0 is no
measurable difference either."""
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20241127  # fixed: the same timings give the same interval
NO_DIFFERENCE = "no measurable difference"


def ratio_interval(before_ms: Sequence[float], after_ms: Sequence[float], *, confidence: float = CONFIDENCE,
                   resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict:
    """The ratio of medians ``median(after) / median(before)`` of paired timings (round i timed
    ``before_ms[i]`` and ``after_ms[i]``, interleaved) with a ``confidence`` percentile-bootstrap
    interval: the rounds are resampled with replacement, pairs kept together, ``resamples`` times
    with a fixed ``seed`` (the same timings give the same interval). ``verdict``: "faster" or
    "slower" when the interval excludes 1.0, :data:`NO_DIFFERENCE` when it contains it, "too few
    rounds" (no interval) under :data:`MIN_INTERVAL_ROUNDS` pairs. An interval inside
    ``[1 - SESSION_SPREAD, 1 + SESSION_SPREAD]`` is :data:`NO_DIFFERENCE` too: two sessions of one
    model differ that much."""
    b = np.asarray(before_ms, dtype=np.float64)
    a = np.asarray(after_ms, dtype=np.float64)
    n = min(len(a), len(b))
    b, a = b[:n], a[:n]
    out: dict = {"rounds": int(n), "confidence": confidence}
    if n == 0 or not np.median(b) > 0:
        return {**out, "ratio": None, "interval": None, "verdict": "not measured"}
    out["ratio"] = float(np.median(a) / np.median(b))
    if n < MIN_INTERVAL_ROUNDS:
        return {**out, "interval": None, "verdict": "too few rounds"}
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples)
    chunk = max(1, 2_000_000 // n)  # (bounded memory for many rounds)
    for lo in range(0, resamples, chunk):
        idx = rng.integers(0, n, size=(min(chunk, resamples - lo), n))
        ratios[lo:lo + len(idx)] = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    tail = (1 - confidence) / 2
    low, high = (float(x) for x in np.quantile(ratios, [tail, 1 - tail]))
    within = 1 - SESSION_SPREAD <= low and high <= 1 + SESSION_SPREAD
    verdict = NO_DIFFERENCE if within else "faster" if high < 1.0 else "slower" if low > 1.0 else NO_DIFFERENCE
    return {**out, "interval": [low, high], "session_spread": SESSION_SPREAD, "verdict": verdict}


def latency_text(entry: Mapping) -> str:
    """A comparison's verdict in words: "1.52x faster (90% interval 1.40-1.61x)", "no measurable
    difference (x1.012, 90% interval 0.97-1.05)"; ``entry``: a report's latency entry (``ratio_median``,
    ``interval``, ``verdict``)."""
    ratio, ci, verdict = entry.get("ratio_median"), entry.get("interval"), entry.get("verdict")
    if ratio is None:
        return verdict or "not measured"
    conf = f"{100 * float(entry.get('confidence', CONFIDENCE)):.0f}%"
    if not ci:
        return f"x{ratio:.3f}, {verdict or 'no interval'} (no {conf} interval under {MIN_INTERVAL_ROUNDS} rounds)"
    span = f"{conf} interval x{ci[0]:.3f}-x{ci[1]:.3f}"
    if verdict == "faster":
        return f"{1 / ratio:.2f}x faster (x{ratio:.3f}, {span})"
    if verdict == "slower":
        return f"{ratio:.2f}x slower (x{ratio:.3f}, {span})"
    return f"{verdict} (x{ratio:.3f}, {span})"
