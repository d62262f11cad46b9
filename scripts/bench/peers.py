"""Side-by-side benchmark of onnxopt against its peers, on the models of onnxopt.models.zoo.

    python -m scripts.bench.peers [--models NAME ...] [--family F ...] [--tools T ...] [--repeat N] [--runs N]
                                  [--cache DIR] [--providers cpu[,cuda]] [--json OUT.json] [--markdown BENCHMARKS.md]

For each model (built or fetched into the zoo cache first) and each tool (scripts/bench/_peers.py:
onnxopt, onnxsim, onnxslim, onnxoptimizer, onnxscript, ort-extended and, for transformer models,
ort-transformers at each opt_level and optimum's ORTOptimizer O2/O3 in its own environment, see
docs/benchmarks-peers.md), plus the original model as the baseline:

- status: ok, ``differs`` (outputs off by more than --tolerance, relative), or the error;
- optimize time: median of --repeat runs, each in a fresh subprocess (imports not timed; the timed
  region is load + optimize + save, as the tool's users call it; see _peers.TOOLS[i].timed);
- nodes: nodes of the optimized file, all graphs (If/Loop/Scan bodies included);
- CPU kernels: kernels onnxruntime's CPU provider executes in one run, from its profiler (events
  with cat "Node" and a name ending in "_kernel_time" inside the last "model_run"), with the
  session's default graph optimizations, as a user would run the model;
- CPU latency: one session per tool (onnxruntime defaults), warmed up, then timed one run at a time
  in interleaved rounds (each round runs every tool once, the order rotated by one each round) so
  machine noise hits all alike; median, p10 and p90;
- max abs diff / max rel diff: against the original model's outputs on the zoo's realistic inputs;
  rel = max|a-b| / max|a| per output (scale-relative), the JSON also has the elementwise
  max |a-b| / max(|a|, 1e-3 * max|a|);
- with ``--providers cpu,cuda`` and onnxruntime-gpu: CUDA kernels, nodes left on CPU, Memcpy nodes
  and CUDA latency.

Every tool call, evaluation and latency measurement runs in a subprocess with a timeout: a crash or
hang is that row's error, and the benchmark goes on. A peer that logs or raises that it was called
wrongly (_peers.CONFIG_FAILURES) is marked in the tables and the run exits 3 after writing them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from onnxopt.verify import count_kernels, measure_latency, session  # (the verifier's own measures)
from scripts import ROOT, child_env
from scripts.bench import _peers as peers

Tool = peers.Tool

ORIGINAL = "original"


@dataclasses.dataclass
class Options:
    repeat: int = 3
    runs: int = 50
    warmup: int = 5
    timeout: float = 600.0
    latency_budget: float = 120.0  # seconds of timed runs per model and provider, at most
    min_rounds: int = 5
    gap: float = 0.002  # pause before each timed run, so the previous session's spinning threads settle
    providers: tuple[str, ...] = ("cpu",)
    tolerance: float = 1e-3  # max rel diff above which a row is marked "differs"
    threads: int = 0  # intra-op threads of the latency sessions (0: onnxruntime's default)


# ---------------------------------------------------------------------------------------------
# Measurements (run in subprocesses; plain functions, so tests can call them directly)


def count_nodes(model) -> tuple[int, dict[str, int]]:
    """Nodes of every graph of an onnx.ModelProto (subgraphs of If/Loop/Scan included), by op type."""
    import onnx

    ops: Counter = Counter()

    def walk(graph):
        for node in graph.node:
            ops[node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"] += 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        walk(g)

    walk(model.graph)
    return sum(ops.values()), dict(sorted(ops.items()))


def compare_outputs(ref: list[tuple[str, np.ndarray]], got: list[tuple[str, np.ndarray]]) -> dict:
    """max abs and relative differences of ``got`` against ``ref``, outputs matched by name, else position.

    max_rel: max over outputs of max|a-b| / max|a| (scale-relative; 0 when both are all zero).
    max_elem_rel: max over elements of |a-b| / max(|a|, 1e-3 * max|a|).
    """
    names = {n: a for n, a in got}
    max_abs = max_rel = max_elem = 0.0
    matched = []
    for i, (name, a) in enumerate(ref):
        if name in names:
            b, how = names[name], "name"
        elif i < len(got):
            b, how = got[i][1], "position"
        else:
            return {"error": f"output {name!r} missing"}
        matched.append(how)
        if a.shape != b.shape:
            return {"error": f"output {name!r}: shape {list(b.shape)} instead of {list(a.shape)}"}
        a64 = np.asarray(a, dtype=np.float64)
        b64 = np.asarray(b, dtype=np.float64)
        if a64.size == 0:
            continue
        both_nan = np.isnan(a64) & np.isnan(b64)
        d = np.abs(a64 - b64)
        d[both_nan] = 0.0
        if np.isnan(d).any():
            return {"max_abs": float("nan"), "max_rel": float("nan"), "max_elem_rel": float("nan"),
                    "matched_by": matched, "note": f"output {name!r}: NaN where the original has none"}
        scale = float(np.max(np.abs(np.where(both_nan, 0.0, a64))))
        dmax = float(d.max())
        max_abs = max(max_abs, dmax)
        if dmax > 0:
            max_rel = max(max_rel, dmax / scale if scale > 0 else float("inf"))
            floor = 1e-3 * scale if scale > 0 else np.finfo(np.float64).tiny
            max_elem = max(max_elem, float(np.max(d / np.maximum(np.abs(a64), floor))))
    return {"max_abs": max_abs, "max_rel": max_rel, "max_elem_rel": max_elem,
            "matched_by": "name" if all(m == "name" for m in matched) else "position"}


def _feeds_for(sess, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    feeds = {}
    for i in sess.get_inputs():
        if i.name not in inputs:
            raise KeyError(f"model input {i.name!r} has no realistic input")
        feeds[i.name] = inputs[i.name]
    return feeds


def _load_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def evaluate(model_path: str, inputs: dict[str, np.ndarray], *, provider: str = "cpu",
             reference: list[tuple[str, np.ndarray]] | None = None, profile_dir: str | None = None,
             warmup: int = 1) -> tuple[dict, list[tuple[str, np.ndarray]]]:
    """Nodes, kernels per run (profiled), outputs and their differences from ``reference``."""
    import onnx

    proto = onnx.load(model_path, load_external_data=False)
    nodes, ops = count_nodes(proto)
    del proto
    # a folder of this evaluation's own (onnxruntime names a profile by prefix and the millisecond;
    # evaluations side by side may profile models of the same name)
    profile_dir = tempfile.mkdtemp(prefix="bench-prof-", dir=profile_dir)
    t0 = time.perf_counter()
    sess = session(model_path, provider, profile_prefix=str(Path(profile_dir) / f"{Path(model_path).stem}-{provider}"))
    init_s = time.perf_counter() - t0
    feeds = _feeds_for(sess, inputs)
    for _ in range(max(1, warmup)):
        outs = sess.run(None, feeds)
    sess.run(None, feeds)  # the profiled run counted
    prof = sess.end_profiling()
    with open(prof) as f:
        events = json.load(f)
    os.unlink(prof)
    kern = count_kernels(events)
    got = [(o.name, np.asarray(v)) for o, v in zip(sess.get_outputs(), outs)]
    result = {"nodes": nodes, "op_types": ops, "session_init_s": round(init_s, 4), **kern,
              "providers": sess.get_providers()}
    if reference is not None:
        result.update(compare_outputs(reference, got))
    return result, got


def one_line(exc: BaseException, limit: int = 300) -> str:
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}".strip().rstrip(":")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Subprocess jobs


def _job(job: dict) -> dict:
    kind = job["kind"]
    if kind == "optimize":
        setup = peers.load_setup(job["target"], job.get("pythonpath"))
        with peers.PeerLog() as plog:  # what the peer logs, a failure of its configuration above all
            run = setup(job.get("ctx", {}))
            t0 = time.perf_counter()
            info = run(job["src"], job["dst"])
            seconds = time.perf_counter() - t0
        if not Path(job["dst"]).exists():
            raise RuntimeError("the tool wrote no output file")
        return {"seconds": seconds, "info": info or {}, **peer_log(plog.lines)}
    inputs = _load_npz(job["inputs"])
    if kind == "evaluate":
        reference = None
        if job.get("reference"):
            ref = _load_npz(job["reference"])
            names = [str(n) for n in ref.pop("__names__")]
            reference = [(n, ref[f"out{i}"]) for i, n in enumerate(names)]
        result, got = evaluate(job["model"], inputs, provider=job["provider"], reference=reference,
                               profile_dir=job.get("profile_dir"))
        if job.get("save_outputs"):
            arrays = {f"out{i}": a for i, (_, a) in enumerate(got)}
            np.savez(job["save_outputs"], __names__=np.array([n for n, _ in got]), **arrays)
        return result
    if kind == "latency":
        return measure_latency(job["models"], inputs, provider=job["provider"], runs=job["runs"],
                               warmup=job["warmup"], budget_s=job["budget_s"], min_rounds=job["min_rounds"],
                               gap_s=job["gap_s"], threads=job.get("threads", 0))
    raise ValueError(f"unknown job kind {kind!r}")


def peer_log(lines: list[str], limit: int = 40) -> dict:
    """{"log": the first ``limit`` distinct lines (each at most 300 characters), "config_failures": the
    lines saying the peer was called wrongly (_peers.CONFIG_FAILURES)}; {} for a silent run."""
    seen: list[str] = []
    for line in lines:
        line = line.strip()[:300]
        if line and line not in seen:
            seen.append(line)
    if not seen:
        return {}
    return {"log": seen[:limit], "config_failures": peers.config_failures(seen)}


def _child_main(job_file: str, job_fn: Callable[[dict], dict] | None = None) -> int:
    """Run the job in ``job_file`` (``job_fn``, default this script's ``_job``) and write its result."""
    with open(job_file) as f:
        job = json.load(f)
    try:
        result = {"ok": True, **(job_fn or _job)(job)}
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as the row's error
        result = {"ok": False, "error": one_line(exc), "traceback": traceback.format_exc()[-4000:]}
        code = 1
    with open(job["result"], "w") as f:
        json.dump(result, f, default=_json_default)
    return code


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def run_job(job: dict, work: Path, timeout: float, pythonpath: str | None = None,
            module: str = "scripts.bench.peers") -> dict:
    """Run one job in a fresh interpreter (``python -m MODULE --child JOB``, default this script, from
    ``work``; ``pythonpath`` first on its path); returns its result, or {"ok": False, "error": ...}."""
    work.mkdir(parents=True, exist_ok=True)
    fd, job_file = tempfile.mkstemp(prefix=f"job-{job['kind']}-", suffix=".json", dir=work)
    os.close(fd)
    result_file = job_file[:-5] + ".result.json"
    job = {**job, "result": result_file}
    with open(job_file, "w") as f:
        json.dump(job, f)
    env = child_env(None, *([pythonpath] if pythonpath else []))
    try:
        proc = subprocess.run([sys.executable, "-m", module, "--child", job_file],
                              capture_output=True, text=True, timeout=timeout, cwd=str(work), env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:g} s"}
    finally:
        Path(job_file).unlink(missing_ok=True)
    try:
        with open(result_file) as f:
            result = json.load(f)
        Path(result_file).unlink()
        if job["kind"] == "optimize" and result.get("ok"):  # printed outside Python's logging (C++, print)
            lines = [ln.strip()[:300] for ln in (proc.stderr or "").splitlines() if ln.strip()]
            warned = [ln for ln in lines if re.search(r"\[[WE]:onnxruntime|\bwarning\b|\berror\b", ln, re.I)]
            if warned:
                result["log"] = list(dict.fromkeys(result.get("log", []) + warned))[:40]
            extra = peers.config_failures(lines)
            if extra:
                result["config_failures"] = list(dict.fromkeys(result.get("config_failures", []) + extra))
    except (OSError, ValueError):
        if proc.returncode < 0:
            try:
                sig = signal.Signals(-proc.returncode).name
            except ValueError:
                sig = str(-proc.returncode)
            err = f"crashed ({sig})"
        else:
            tail = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
            err = f"exited with {proc.returncode}" + (f": {tail[-1].strip()[:250]}" if tail else "")
        result = {"ok": False, "error": err, "stderr_tail": (proc.stderr or "")[-2000:]}
    return result


# ---------------------------------------------------------------------------------------------
# One model


def external_files(path: Path) -> list[str]:
    """Relative locations of the external-data files a model file refers to."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    found: set[str] = set()

    def tensors(graph):
        yield from graph.initializer
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.GRAPH:
                    yield from tensors(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        yield from tensors(g)

    for t in tensors(proto.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            found.update(e.value for e in t.external_data if e.key == "location")
    return sorted(found)


def snapshot(path: Path, dest: Path) -> Path:
    """Hard-link (else copy) a model and its external data into ``dest``, so that every tool and
    measurement reads the same bytes even if the cache is rebuilt meanwhile."""
    dest.mkdir(parents=True, exist_ok=True)
    for rel in [path.name] + external_files(path):
        src, dst = path.parent / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    return dest / path.name


def bench_model(name: str, path: Path, family: str, inputs: dict[str, np.ndarray], tools: list[Tool],
                opts: Options, work: Path, log: Callable[[str], None] = print) -> dict:
    """All measurements of one model; returns {"rows": {tool: {...}}, ...} (raw numbers)."""
    work = work / name
    work.mkdir(parents=True, exist_ok=True)
    source = path
    path = snapshot(Path(path), work / "original")
    inputs_file = work / "inputs.npz"
    np.savez(inputs_file, **inputs)
    tools = [t for t in tools if t.applies(family)]
    rows: dict[str, dict] = {ORIGINAL: {"status": "baseline", "path": str(path)}}
    paths: dict[str, str] = {ORIGINAL: str(path)}
    ctx = {"model": name, "family": family, "model_type": peers.model_type(name), **peers.attention_params(name),
           "use_gpu": "cuda" in opts.providers}

    # 1. optimize, each run in a fresh subprocess
    for tool in tools:
        dst = work / f"{tool.name}.onnx"
        row = rows[tool.name] = {"status": "ok", "path": str(dst), "optimize_s": [], "info": {}}
        for i in range(opts.repeat):
            res = run_job({"kind": "optimize", "target": tool.target, "pythonpath": tool.pythonpath,
                           "src": str(path), "dst": str(dst), "ctx": ctx},
                          work / "jobs", opts.timeout, tool.pythonpath)
            if not res.get("ok"):
                row.update(status="error", error=res["error"], traceback=res.get("traceback", res.get("stderr_tail")))
                break
            row["optimize_s"].append(res["seconds"])
            row["info"] = res.get("info", {})
            for key in ("log", "config_failures"):
                if res.get(key):
                    row[key] = res[key]
        if row["status"] == "ok":
            row["optimize_median_s"] = statistics.median(row["optimize_s"])
            paths[tool.name] = str(dst)
            log(f"  {name} / {tool.name}: optimized in {row['optimize_median_s']:.3f} s "
                f"(median of {len(row['optimize_s'])})")
        else:
            log(f"  {name} / {tool.name}: FAILED: {row['error']}")

    # 2. nodes, kernels, accuracy (the original first: its outputs are the reference)
    reference = work / "reference.npz"
    reference.unlink(missing_ok=True)
    for provider in opts.providers:
        for tname in list(paths):
            row = rows[tname]
            job = {"kind": "evaluate", "model": paths[tname], "inputs": str(inputs_file), "provider": provider,
                   "profile_dir": str(work / "profiles")}
            if provider == "cpu":
                if tname == ORIGINAL:
                    job["save_outputs"] = str(reference)
                elif reference.exists():
                    job["reference"] = str(reference)
            elif reference.exists():
                job["reference"] = str(reference)
            (work / "profiles").mkdir(exist_ok=True)
            res = run_job(job, work / "jobs", opts.timeout)
            if not res.get("ok"):
                row[f"{provider}_error"] = res["error"]
                if provider == "cpu":
                    row.update(status="error", error=row.get("error") or f"evaluation: {res['error']}")
                    paths.pop(tname)
                log(f"  {name} / {tname}: {provider} evaluation FAILED: {res['error']}")
                continue
            res.pop("ok")
            if provider == "cpu":
                row["nodes"] = res.pop("nodes")
                row["op_types"] = res.pop("op_types")
                if "error" in res:  # outputs could not be compared
                    row.update(status="error", error=f"outputs: {res.pop('error')}")
                for key in ("max_abs", "max_rel", "max_elem_rel", "matched_by", "note"):
                    if key in res:
                        row[key] = res.pop(key)
                if tname != ORIGINAL and row["status"] == "ok" and not (row.get("max_rel", 0) <= opts.tolerance):
                    row["status"] = "differs"
            else:
                for key in ("nodes", "op_types"):
                    res.pop(key, None)
            row[provider] = res
            diff = f", max abs diff {row['max_abs']:.3g}" if provider == "cpu" and "max_abs" in row else ""
            log(f"  {name} / {tname}: {provider}: {res['kernels']} kernels per run"
                + (f", {row['nodes']} nodes" if provider == "cpu" else "") + diff)
        if provider == "cpu" and not reference.exists():
            log(f"  {name}: the original model did not run; no accuracy figures")

    # 3. latency, interleaved
    for provider in opts.providers:
        live = {t: p for t, p in paths.items() if provider in rows[t]}
        if not live:
            continue
        log(f"  {name}: {provider} latency, {len(live)} sessions, up to {opts.runs} interleaved rounds ...")
        res = run_job({"kind": "latency", "models": live, "inputs": str(inputs_file), "provider": provider,
                       "runs": opts.runs, "warmup": opts.warmup, "budget_s": opts.latency_budget,
                       "min_rounds": opts.min_rounds, "gap_s": opts.gap, "threads": opts.threads},
                      work / "jobs", max(opts.timeout, 4 * opts.latency_budget))
        if not res.get("ok"):
            for t in live:
                rows[t][f"{provider}_latency_error"] = res["error"]
            log(f"  {name}: {provider} latency FAILED: {res['error']}")
            continue
        for t, err in res["errors"].items():
            rows[t][f"{provider}_latency_error"] = err
        base = res["results"].get(ORIGINAL, {}).get("median_ms")
        for t, lat in res["results"].items():
            lat["rounds"] = res["rounds"]
            if lat.get("times_ms"):
                lat["p10_ms"] = float(np.percentile(lat["times_ms"], 10))
            if base:
                lat["ratio"] = lat["median_ms"] / base
            rows[t][f"{provider}_latency"] = lat
        log(f"  {name}: {provider} latency over {res['rounds']} rounds: "
            + ", ".join(f"{t} {v['median_ms']:.3g} ms" for t, v in res["results"].items()))
    return {"path": str(source), "family": family, "tools": [t.name for t in tools], "rows": rows}


# ---------------------------------------------------------------------------------------------
# Report


def onnxopt_commit() -> str | None:
    """The checkout's commit (with "+changes" when the tree differs from it, the benchmark's own
    outputs aside), if in a git checkout."""
    root = ROOT
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)scripts/results", ":(exclude)BENCHMARKS.md"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "logical_cores": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        models = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")]
        info["cpu"] = models[0] if models else platform.processor()
        cores = set()
        phys = core = None
        for ln in text.splitlines() + [""]:
            if ln.startswith("physical id"):
                phys = ln.split(":", 1)[1].strip()
            elif ln.startswith("core id"):
                core = ln.split(":", 1)[1].strip()
            elif not ln.strip():
                if core is not None:
                    cores.add((phys, core))
                phys = core = None
        if cores:
            info["physical_cores"] = len(cores)
    except OSError:
        info["cpu"] = platform.processor()
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemTotal"):
                info["ram_gib"] = round(int(ln.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def gpu_info() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return "; ".join(ln.strip() for ln in out.stdout.splitlines() if ln.strip()) or None
    except (OSError, subprocess.SubprocessError):
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # importable without being installed (e.g. a copied tree on PYTHONPATH)
        import importlib as _il

        return str(getattr(_il.import_module(dist.replace("-", "_")), "__version__", "?"))
    except Exception:  # noqa: BLE001
        return None


def versions(tools: list[Tool]) -> dict[str, str]:
    names = ["onnxopt", "onnx", "onnx-ir", "numpy"]
    for t in tools:
        if t.package not in names:
            names.append(t.package)
    out = {}
    for n in names + ["torch", "torchvision", "transformers"]:
        if n == "onnxruntime":
            for dist in ("onnxruntime", "onnxruntime-gpu"):
                try:
                    out[dist] = importlib.metadata.version(dist)
                except importlib.metadata.PackageNotFoundError:
                    pass
            if not any(k.startswith("onnxruntime") for k in out):
                out["onnxruntime"] = _version("onnxruntime") or "not installed"
            continue
        v = _version(n)
        if v is not None or n in names:
            out[n] = v or "not installed"
    return out


def _sig(x: float, digits: int = 3) -> str:
    if x == 0:
        return "0"
    if x != x:
        return "nan"
    if x == float("inf"):
        return "inf"
    if abs(x) >= 10 ** digits or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}" if abs(x) >= 1 else f"{x:.{digits}f}".rstrip("0").rstrip(".")


def _cell_text(s: str, limit: int = 110) -> str:
    s = s.replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= limit else s[: limit - 3] + "..."


COLUMNS = [
    # key, header, getter, formatter, original eligible
    ("time", "optimize s", lambda r: r.get("optimize_median_s"), lambda v: _sig(v), False),
    ("nodes", "nodes", lambda r: r.get("nodes"), lambda v: str(v), True),
    ("cpu_kernels", "CPU kernels", lambda r: r.get("cpu", {}).get("kernels"), lambda v: str(v), True),
    ("cpu_ms", "CPU ms (median)", lambda r: r.get("cpu_latency", {}).get("median_ms"), lambda v: _sig(v), True),
    ("cpu_ratio", "× original", lambda r: r.get("cpu_latency", {}).get("ratio"), lambda v: f"{v:.2f}", True),
    ("cpu_p10", "CPU ms (p10)", lambda r: r.get("cpu_latency", {}).get("p10_ms"), lambda v: _sig(v), True),
    ("cpu_p90", "CPU ms (p90)", lambda r: r.get("cpu_latency", {}).get("p90_ms"), lambda v: _sig(v), True),
    ("max_abs", "max abs diff", lambda r: r.get("max_abs"), lambda v: _sig(v, 2), False),
    ("max_rel", "max rel diff", lambda r: r.get("max_rel"), lambda v: _sig(v, 2), False),
]
CUDA_COLUMNS = [
    ("cuda_kernels", "CUDA kernels", lambda r: r.get("cuda", {}).get("kernels"), lambda v: str(v), True),
    ("cuda_on_cpu", "on CPU / Memcpy", lambda r: _on_cpu(r), lambda v: f"{v[0]} / {v[1]}", True),
    ("cuda_ms", "CUDA ms (median)", lambda r: r.get("cuda_latency", {}).get("median_ms"), lambda v: _sig(v), True),
    ("cuda_ratio", "× original", lambda r: r.get("cuda_latency", {}).get("ratio"), lambda v: f"{v:.2f}", True),
]


def _on_cpu(row: dict):
    c = row.get("cuda")
    if not c:
        return None
    return (c.get("by_provider", {}).get("CPUExecutionProvider", 0), c.get("memcpy", 0))


def _eligible(tname: str, row: dict, original_ok: bool) -> bool:
    if tname == ORIGINAL:
        return original_ok and row.get("status") == "baseline"
    return row.get("status") == "ok"


def model_table(result: dict, cuda: bool) -> str:
    cols = COLUMNS + (CUDA_COLUMNS if cuda else [])
    rows = result["rows"]
    order = [ORIGINAL] + [t for t in result["tools"] if t in rows]
    best = {}
    for key, _, get, _, orig_ok in cols:
        vals = []
        for t in order:
            v = get(rows[t])
            if v is None or not _eligible(t, rows[t], orig_ok):
                continue
            v = sum(v) if isinstance(v, tuple) else v
            if v == v:  # not NaN
                vals.append(v)
        best[key] = min(vals) if len(set(vals)) > 1 else None  # no bold when all tie
    head = "| tool | status | " + " | ".join(h for _, h, *_ in cols) + " |"
    sep = "|---|---|" + "---:|" * len(cols)
    lines = [head, sep]
    for t in order:
        row = rows[t]
        status = row.get("status", "?")
        if status == "error":
            status = f"error: {_cell_text(row.get('error', ''))}"
        notes = [f"{p} latency: {_cell_text(row[k], 80)}" for p in ("cpu", "cuda")
                 for k in [f"{p}_latency_error"] if k in row]
        if cuda and "cuda_error" in row:
            notes.append(f"cuda: {_cell_text(row['cuda_error'], 80)}")
        if row.get("config_failures"):  # the peer was called wrongly: its figures do not count as its best
            notes.append(f"**configuration failure**: {_cell_text(row['config_failures'][0], 100)}")
        if (row.get("info") or {}).get("note"):
            notes.append(_cell_text(row["info"]["note"], 120))
        if notes and row.get("status") != "error":
            status += " (" + "; ".join(notes) + ")"
        cells = []
        for key, _, get, fmt, orig_ok in cols:
            v = get(row)
            if t == ORIGINAL and key in ("max_abs", "max_rel"):
                cells.append("ref" if "cpu" in row else "")
                continue
            if v is None:
                cells.append("—" if (t == ORIGINAL and key == "time") else "")
                continue
            text = fmt(v)
            cmp = sum(v) if isinstance(v, tuple) else v
            if best[key] is not None and cmp == best[key] and _eligible(t, row, orig_ok):
                text = f"**{text}**"
            cells.append(text)
        lines.append(f"| {t} | {status} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_tables(results: dict, cuda: bool = False) -> str:
    models = [m for m, r in results.items() if "rows" in r]
    if not models:
        return ""
    tools = []
    for m in models:
        for t in [ORIGINAL] + results[m]["tools"]:
            if t not in tools:
                tools.append(t)
    out = []
    for title, get, fmt in [
        ("CPU kernels per run", lambda r: r.get("cpu", {}).get("kernels"), str),
        ("CPU latency, median relative to the original", lambda r: r.get("cpu_latency", {}).get("ratio"),
         lambda v: f"{v:.2f}×"),
        ("optimize time, s", lambda r: r.get("optimize_median_s"), _sig),
    ] + ([
        ("CUDA kernels per run", lambda r: r.get("cuda", {}).get("kernels"), str),
        ("CUDA latency, median relative to the original", lambda r: r.get("cuda_latency", {}).get("ratio"),
         lambda v: f"{v:.2f}×"),
    ] if cuda else []):
        out.append(f"**{title}** (best per model in bold, none when all tie; failed tools and tools whose outputs differ are not ranked)\n")
        out.append("| tool | " + " | ".join(models) + " |")
        out.append("|---|" + "---:|" * len(models))
        best = {}
        for m in models:
            rows = results[m]["rows"]
            vals = [get(rows[t]) for t in rows if get(rows[t]) is not None and _eligible(t, rows[t], True)]
            best[m] = min(vals) if len(set(vals)) > 1 else None
        for t in tools:
            cells = []
            for m in models:
                row = results[m]["rows"].get(t)
                if row is None:
                    cells.append("n/a")
                    continue
                v = get(row)
                if row.get("status") == "error":
                    cells.append("error")
                elif v is None and title.startswith("CUDA") and "cuda_error" in row:
                    cells.append("CUDA error")
                elif v is None:
                    cells.append("—" if t == ORIGINAL else "")
                else:
                    text = fmt(v)
                    if row.get("status") == "differs":
                        text += " (differs)"
                    if v == best[m] and _eligible(t, row, True):
                        text = f"**{text}**"
                    cells.append(text)
            out.append(f"| {t} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def render_markdown(report: dict) -> str:
    meta = report["meta"]
    mach = meta["machine"]
    cuda = "cuda" in meta["providers"]
    L = ["# Benchmarks: onnxopt and its peers", ""]
    commit = f" (onnxopt at commit {meta['onnxopt_commit']})" if meta.get("onnxopt_commit") else ""
    L.append(f"Generated by `python -m scripts.bench.peers` on {meta['date']}{commit}.")
    L.append("")
    L.append(f"- Command: `{meta['command']}`")
    cores = f"{mach.get('physical_cores', '?')} physical / {mach.get('logical_cores', '?')} logical cores"
    L.append(f"- Machine: {mach.get('cpu', '?')}, {cores}, {mach.get('ram_gib', '?')} GiB RAM; {mach['platform']}")
    if meta.get("gpu"):
        L.append(f"- GPU: {meta['gpu']}")
    if meta.get("cuda_note"):
        L.append(f"- CUDA: {meta['cuda_note']}")
    L.append(f"- Python {mach['python']}; " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    o = meta["options"]
    L.append(f"- Optimize time: median of {o['repeat']} runs; latency: up to {o['runs']} interleaved rounds after "
             f"{o['warmup']} warm-up runs per session (fewer rounds when they would pass {o['latency_budget']:g} s; "
             f"the number used is under each table)"
             + (f", sessions with {o['threads']} intra-op thread(s)" if o.get("threads") else "")
             + f"; rows whose max rel diff passes {o['tolerance']:g} are marked `differs`.")
    L.append("")
    L.append("## Summary")
    L.append("")
    L.append(summary_tables(report["models"], cuda))
    for name, res in report["models"].items():
        L.append(f"## {name}")
        L.append("")
        if "rows" not in res:
            L.append(f"Not measured: {res.get('skipped', res.get('error', '?'))}")
            L.append("")
            continue
        desc = res.get("description")
        L.append(f"{res['family']}" + (f": {desc}" if desc else ""))
        L.append("")
        L.append(model_table(res, cuda))
        L.append("")
        rounds = {p: next((r[f"{p}_latency"]["rounds"] for r in res["rows"].values() if f"{p}_latency" in r), None)
                  for p in meta["providers"]}
        L.append("Latency rounds: " + ", ".join(f"{p} {n}" for p, n in rounds.items() if n) if any(rounds.values())
                 else "No latency figures.")
        L.append("")
    L.append("## Method")
    L.append("")
    L.append("Columns (lowest is best in every column; the best tool is in **bold**, nothing when all tie; the "
             "original competes in nodes, kernels and latency; rows that failed or whose outputs differ do not "
             "compete):")
    L.append("")
    L.append("- **status**: `ok`; `differs` when max rel diff > the tolerance; or the error (the tool's exception, "
             "a crash, a timeout, or onnxruntime refusing the result).")
    L.append("- **optimize s**: median wall time of the tool's optimize call, each run in a fresh subprocess with "
             "the tool's imports done before timing. What is timed, per tool:")
    for t in meta["tool_docs"]:
        L.append(f"  - {t['name']}: {t['timed']}")
    L.append("- **nodes**: nodes in the resulting file, every graph (If/Loop/Scan bodies) included.")
    L.append("- **CPU kernels**: kernels onnxruntime's CPU provider runs per inference, from its profiler: events with "
             "`cat == \"Node\"` and a name ending in `_kernel_time` inside the last `model_run` (one profiled "
             "run after a warm-up run), session with onnxruntime's default graph optimizations as a user runs it.")
    L.append("- **CPU ms (median / p10 / p90)** and **× original**: one onnxruntime session per tool (defaults), warmed up, "
             "then timed one `run` at a time in interleaved rounds, each round running every tool once in an order "
             f"rotated by one per round, with a {o['gap'] * 1e3:g} ms pause before each timed run, so machine noise "
             "hits all tools alike.")
    L.append("- **max abs diff**: max |a − b| over all outputs, a the original model's output and b the optimized "
             "model's (onnxruntime CPU) on the zoo's realistic inputs; outputs matched by name, else by position.")
    L.append("- **max rel diff**: max over outputs of max |a − b| / max |a| (relative to the output's scale). The JSON "
             "also has `max_elem_rel`, the elementwise max |a − b| / max(|a|, 1e-3 · max |a|).")
    if cuda:
        L.append("- **CUDA kernels**, **on CPU / Memcpy** (kernels left on the CPU provider / Memcpy nodes), "
                 "**CUDA ms**: the same measurements with the CUDA provider (CPU as fallback).")
    L.append("")
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", metavar="NAME", help="zoo models (default: all)")
    p.add_argument("--family", nargs="+", metavar="F", help="only models of these families")
    p.add_argument("--tools", nargs="+", metavar="T",
                   help=f"tools (default: all): {', '.join(t.name for t in peers.TOOLS)}")
    p.add_argument("--repeat", type=int, default=3, help="optimize runs per tool; the median is reported (default 3)")
    p.add_argument("--runs", type=int, default=50, help="interleaved latency rounds (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up runs per session before latency (default 5)")
    p.add_argument("--latency-budget", type=float, default=120.0,
                   help="cap on seconds of timed latency runs per model and provider; fewer rounds past it (default 120)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per tool run / evaluation (default 600)")
    p.add_argument("--tolerance", type=float, default=1e-3, help="max rel diff beyond which a row is 'differs'")
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads of the latency sessions (default: onnxruntime's); 1 gives steadier "
                        "figures on a small shared machine, where sessions of 2 threads contend with everything else")
    p.add_argument("--cache", type=Path, default=None, help="zoo cache directory (default $ONNXOPT_CACHE)")
    p.add_argument("--providers", default="cpu", help="cpu or cpu,cuda (default cpu)")
    p.add_argument("--work", type=Path, default=None,
                   help="keep the optimized models, profiles and inputs here (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=None, help="write all raw numbers here")
    p.add_argument("--markdown", type=Path, default=None, help="write the report here (e.g. BENCHMARKS.md)")
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="measure nothing: write --markdown from this earlier --json report")
    p.add_argument("--cuda-report", type=Path, nargs="+", default=None, metavar="JSON",
                   help="with --render: --json reports of a run with --providers cpu,cuda (e.g. on a GPU machine, "
                        "possibly split by --family), appended as the CUDA section")
    return p.parse_args(argv)


def merge_reports(reports: list[dict]) -> dict:
    """One report from several runs of the same setup split by model (e.g. --family on a GPU machine)."""
    if not reports:
        raise ValueError("no report to merge")
    meta = json.loads(json.dumps(reports[0]["meta"]))
    if len(reports) > 1:
        meta["command"] = "`; `".join(r["meta"]["command"] for r in reports)
        dates = sorted({r["meta"]["date"] for r in reports})
        meta["date"] = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
        for r in reports[1:]:
            for k, v in r["meta"].get("versions", {}).items():
                if meta["versions"].get(k) != v:
                    meta["versions"][k] = f"{meta['versions'].get(k)} / {v}"
    models: dict = {}
    for r in reports:
        for name, res in r["models"].items():
            if name not in models or ("rows" in res and "rows" not in models[name]):
                models[name] = res
    models = dict(sorted(models.items(), key=lambda kv: _zoo_position(kv[0])))  # stable: unknown names keep order
    return {"meta": meta, "models": models}


def _zoo_position(name: str) -> int:
    try:
        from onnxopt.models import zoo

        return [s.name for s in zoo.SPECS].index(name)
    except (ImportError, ValueError):
        return 1 << 30


def render_with_cuda(main: dict, cuda_reports: list[dict] | None) -> str:
    text = render_markdown(main)
    if not cuda_reports:
        return text
    cuda = merge_reports(cuda_reports)
    if "cuda" not in cuda["meta"]["providers"]:
        raise ValueError("--cuda-report: the report has no CUDA measurements (run with --providers cpu,cuda)")
    body = render_markdown(cuda).split("\n", 2)[2]  # drop the top title
    body = "\n".join(("#" + line) if line.startswith("#") else line for line in body.split("\n"))
    gpu = cuda["meta"].get("gpu") or "GPU"
    when = cuda["meta"].get("date", "?")
    stale = ""
    if when < main["meta"].get("date", "") or cuda["meta"].get("onnxopt_commit") != main["meta"].get("onnxopt_commit"):
        built = cuda["meta"].get("onnxopt_commit") or "an earlier commit"
        stale = (f" It was measured on {when} with onnxopt at {built}, so its onnxopt rows show that version, "
                 f"not the one measured above ({main['meta'].get('date', '?')}).")
    rebuilt = sorted(name for name, m in cuda["models"].items()
                     if name in main["models"] and m.get("description") != main["models"][name].get("description"))
    if rebuilt:
        stale += (f" The zoo has changed since: {', '.join(rebuilt)} were built differently then (see their "
                  "descriptions below), so their rows there are of other models.")
    return (text.rstrip("\n") + "\n\n" + f"## CUDA ({gpu.split(',')[0]})\n\n"
            + "A separate run on a GPU machine, CPU and CUDA providers side by side; its CPU figures come from that "
              "machine, not from the one above." + stale + "\n" + body)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child_main(argv[1])
    args = parse_args(argv)
    if args.render or args.cuda_report:
        if not (args.render and args.markdown):
            print("scripts.bench.peers: error: --render and --cuda-report need --render JSON and --markdown OUT",
                  file=sys.stderr)
            return 2
        try:
            main_report = json.loads(args.render.read_text())
            cuda_reports = [json.loads(p.read_text()) for p in args.cuda_report or []]
            text = render_with_cuda(main_report, cuda_reports)
        except (OSError, ValueError, KeyError) as exc:
            print(f"scripts.bench.peers: error: {one_line(exc)}", file=sys.stderr)
            return 2
        args.markdown.write_text(text)
        print(f"wrote {args.markdown}")
        return 0
    from onnxopt.models import zoo

    def log(s: str) -> None:
        print(s, flush=True)

    try:
        tools = [peers.get_tool(t) for t in args.tools] if args.tools else list(peers.TOOLS)
        specs = [zoo.get(n) for n in args.models] if args.models else list(zoo.SPECS)
    except KeyError as exc:
        print(f"scripts.bench.peers: error: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.family:
        specs = [s for s in specs if s.family in args.family]
    if not specs:
        print("scripts.bench.peers: error: no model selected", file=sys.stderr)
        return 2
    providers = tuple(p.strip().lower() for p in args.providers.split(",") if p.strip())
    bad = [p for p in providers if p not in ("cpu", "cuda")]
    if bad or "cpu" not in providers:
        print(f"scripts.bench.peers: error: --providers takes cpu or cpu,cuda (got {args.providers!r})",
              file=sys.stderr)
        return 2
    cuda_note = None
    if "cuda" in providers:
        import onnxruntime

        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            cuda_note = "requested, but CUDAExecutionProvider is not available (onnxruntime-gpu not installed?); skipped"
            log(f"CUDA: {cuda_note}")
            providers = ("cpu",)
    opts = Options(repeat=max(1, args.repeat), runs=max(1, args.runs), warmup=max(1, args.warmup),
                   threads=max(0, args.threads),
                   timeout=args.timeout, latency_budget=args.latency_budget, providers=providers,
                   tolerance=args.tolerance)
    cache = args.cache or zoo.DEFAULT_CACHE
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m scripts.bench.peers " + shlex.join(argv),
        "machine": machine_info(),
        "gpu": gpu_info() if "cuda" in providers else None,
        "cuda_note": cuda_note,
        "versions": versions(tools),
        "providers": list(providers),
        "options": dataclasses.asdict(opts),
        "tool_docs": [{"name": t.name, "timed": t.timed, "families": t.families} for t in tools],
        "cache": str(cache),
        "onnxopt_commit": onnxopt_commit(),
    }
    log(f"building/fetching {len(specs)} model(s) into {cache} ...")
    built = zoo.build([s.name for s in specs], cache=cache, log=lambda s: log("  " + s))
    work = args.work or Path(tempfile.mkdtemp(prefix="onnxopt-bench-"))
    report = {"meta": meta, "models": {}}
    try:
        for i, spec in enumerate(specs, 1):
            where = built.get(spec.name)
            if not isinstance(where, Path):
                report["models"][spec.name] = {"family": spec.family, "skipped": where}
                log(f"[{i}/{len(specs)}] {spec.name}: {where}")
                continue
            log(f"[{i}/{len(specs)}] {spec.name} ({spec.family}) ...")
            t0 = time.perf_counter()
            try:
                feeds = spec.inputs(where)
            except Exception as exc:  # noqa: BLE001
                report["models"][spec.name] = {"family": spec.family, "error": f"inputs: {one_line(exc)}"}
                log(f"  {spec.name}: no inputs: {one_line(exc)}")
                continue
            res = bench_model(spec.name, where, spec.family, feeds, tools, opts, work, log)
            res["description"] = spec.description
            report["models"][spec.name] = res
            log(f"[{i}/{len(specs)}] {spec.name}: done in {time.perf_counter() - t0:.0f} s")
            _write(report, args)  # partial results survive an interrupted run
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    _write(report, args)
    if args.markdown:
        log(f"wrote {args.markdown}")
    if args.json:
        log(f"wrote {args.json}")
    if not args.markdown and not args.json:
        print()
        print(render_markdown(report))
    failed = config_failure_lines(report["models"])
    if failed:  # a peer called wrongly is a bug of this benchmark: its figures are not the peer's
        print(f"scripts.bench.peers: error: {len(failed)} peer configuration failure(s), the benchmark called a "
              "peer wrongly (fix the call in scripts/bench/_peers.py):", file=sys.stderr)
        for ln in failed[:20]:
            print(f"  {ln}", file=sys.stderr)
        return 3
    return 0


def config_failure_lines(models: dict) -> list[str]:
    """``model tool: line`` for every row that logged or raised a configuration failure (_peers.CONFIG_FAILURES)."""
    out = []
    for name, res in models.items():
        for tool, row in (res.get("rows") or {}).items():
            lines = list(row.get("config_failures") or [])
            if row.get("status") == "error":
                lines += peers.config_failures([row.get("error") or ""])
            out += [f"{name} {tool}: {ln}" for ln in dict.fromkeys(lines)]
    return out


def _write(report: dict, args: argparse.Namespace) -> None:
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=_json_default) + "\n")
    if args.markdown:
        args.markdown.write_text(render_markdown(report))


if __name__ == "__main__":
    sys.exit(main())
