"""Measured latency by op type, from onnxruntime's own profiler.

A session with profiling on (``SessionOptions.enable_profiling``) runs the model ``warmup`` times,
then ``runs`` times; the trace's kernel events ("Node" events named ``..._kernel_time``, their op
type in ``args.op_name``, their duration in µs) inside the timed runs' ``model_run`` events are
summed per op type and divided by the number of timed runs: milliseconds per run.

The session is made as the verifier's latency sessions are (:func:`onnxopt.verify.runtime.session`
without ``optimization``): onnxruntime's default graph optimizations (``ORT_ENABLE_ALL``). So the op
types are those of the kernels onnxruntime ran after its own rewrites, not always the model file's:
nodes it fused count under the op name it gives the fused kernel (a Conv with its activation stays
``Conv`` on the CPU, MatMul+Add may become ``Gemm`` or ``FusedMatMul``, attention ``Attention``), and
nodes it added appear (``ReorderInput``/``ReorderOutput`` of its NCHWc layout, ``MemcpyToHost``). The
figures are measurements: they change from run to run.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Mapping

import numpy as np

from onnxopt.verify.runtime import session

# How the profiled sessions optimize the graph (for the reports that show the figures).
GRAPH_OPTIMIZATION = "ORT_ENABLE_ALL"


def kernel_times(events: list[dict], skip_runs: int = 0) -> tuple[dict[str, float], int]:
    """Microseconds per op type summed over the ``model_run`` events after the first
    ``skip_runs`` (all kernel events when the trace has no ``model_run``), and the number of runs
    summed."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    kernels = [e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]
    if runs:
        timed = runs[skip_runs:] or runs[-1:]
        spans = [(r["ts"], r["ts"] + r.get("dur", 0)) for r in timed]
        kernels = [e for e in kernels if any(lo <= e["ts"] <= hi for lo, hi in spans)]
        count = len(timed)
    else:
        count = 1
    total: dict[str, float] = defaultdict(float)
    for e in kernels:
        total[str(e.get("args", {}).get("op_name", "?"))] += float(e.get("dur", 0))
    return dict(total), count


def op_type_latency_pair(before, after, feeds_before: Mapping[str, np.ndarray], feeds_after: Mapping[str, np.ndarray],
                         provider: str = "cpu", *, runs: int = 10, warmup: int = 2, threads: int = 1,
                         provider_options: Mapping | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`op_type_latency` of two models measured together: both sessions warmed up, then their
    ``runs`` timed runs interleaved (before, after, after, before, ...), so that a change in the
    machine's load falls on both alike; ``threads`` intra-op threads (default 1: figures that
    repeat; 0: onnxruntime's choice)."""
    runs = max(1, int(runs))
    with tempfile.TemporaryDirectory(prefix="onnxopt-optime-") as tmp:
        sessions, feeds = [], []
        for i, (model, given) in enumerate(((before, feeds_before), (after, feeds_after))):
            sess = session(model, provider, profile_prefix=os.path.join(tmp, f"p{i}"), threads=threads,
                           provider_options=provider_options, spin=False)
            sessions.append(sess)
            feeds.append({x.name: given[x.name] for x in sess.get_inputs()})
        for sess, f in zip(sessions, feeds):
            for _ in range(max(0, warmup)):
                sess.run(None, f)
        for r in range(runs):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                sessions[i].run(None, feeds[i])
        out = []
        for sess in sessions:
            with open(sess.end_profiling()) as fh:
                total, count = kernel_times(json.load(fh), skip_runs=max(0, warmup))
            out.append({op: round(us / count / 1e3, 4) for op, us in sorted(total.items())})
    return out[0], out[1]


def op_type_latency(model, feeds: Mapping[str, np.ndarray], provider: str = "cpu", *, runs: int = 10,
                    warmup: int = 2, threads: int = 0, provider_options: Mapping | None = None) -> dict[str, float]:
    """``{op type: milliseconds per run}`` of ``model`` (a path or serialized bytes) on ``provider``
    ("cpu", "cuda"), sorted by op type: the kernel time onnxruntime's profiler records, averaged
    over ``runs`` runs after ``warmup`` (see the module's docstring for the op types' names)."""
    runs = max(1, int(runs))
    with tempfile.TemporaryDirectory(prefix="onnxopt-optime-") as tmp:
        sess = session(model, provider, profile_prefix=os.path.join(tmp, "p"), threads=threads,
                       provider_options=provider_options)
        feeds = {i.name: feeds[i.name] for i in sess.get_inputs()}
        for _ in range(max(0, warmup) + runs):
            sess.run(None, feeds)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    total, count = kernel_times(events, skip_runs=max(0, warmup))
    return {op: round(us / count / 1e3, 4) for op, us in sorted(total.items())}
