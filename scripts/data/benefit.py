"""Measure whether each fusion pays on a target, and write the benefit table (onnxopt.targets.benefit).

    python -m scripts.data.benefit [--keys KEY ...] [--targets ort-cpu] [--models bert-legacy ...]
                                   [--model NAME=PATH ...] [--feeds NAME=NPZ ...] [--rules-file FILE] [--batch 1]
                                   [--sequence 128]
                                   [--fix-shapes] [--runs 30] [--warmup 5] [--threads 1]
                                   [-o scripts/results/benefit/benefit-cpu.json] [--into onnxopt/data/benefit.json]
    python -m scripts.data.benefit --advice --targets ort-cuda [--models resnet50-legacy bert-legacy ...]
                                   [--batch 32] [--precision fp16]
    python -m scripts.data.benefit --merge a.json b.json [-o all.json] [--into onnxopt/data/benefit.json]

For every benefit key (``Rule(..., benefit="<key>")``: the built-in rules' and a ``--rules-file``'s;
``--keys`` picks some) and every target (``ort-cpu`` runs on onnxruntime's CPU provider, ``ort-cuda``
on its CUDA provider, ``portable``, whose rules/standard_*.py fusions write standard opset-23 ops, on the
CPU provider), each model is optimized twice for the target: *with* the key's rules (the
table in effect, that key's entry for the target set aside so they run) and *without* them
(``disable=``); every other rule as the shipped table decides. A model where the key's rules fire
nowhere is recorded as not exercised. Both are run on the same inputs (outputs compared) and timed
interleaved (``onnxopt.verify.runtime.measure_latency``: median, p10, p90). The key's verdict for
the target: applied unless, over the models that exercised it, the geometric mean of the with/without
median ratios is above 1 + ``onnxopt.targets.benefit.NOISE`` (slower by more than noise). A model where
onnxruntime's own session-time fusions already make at least half as many of the fused ops in the
unfused model (its profile counts them) does not isolate the key: reported, not counted.

``--advice`` measures the session options the advice names (keys ``cuda_prefer_nhwc``:
``prefer_nhwc=1`` on models with Conv; ``cuda_graph``: ``enable_cuda_graph=1`` on models that run
wholly on CUDA at fixed shapes, timed through IOBinding on device buffers, as CUDA graphs need):
each model optimized once for ``ort-cuda`` with its inputs fixed, then timed with and without the
option.

The output (``-o``) is a benefit table (``{"schema", "entries", "runs"}``): each entry cites its run
(command, date, machine, versions, commit) and its figures per model; ``--merge`` merges such
files (later ones win per key and target; ``--keep`` keeps the first), ``--into`` merges the result
into a table file (the shipped one: ``onnxopt/data/benefit.json``), so runs from several machines
(CPU here, CUDA on the GPU machine) make one table. A model that fails is a row with its one-line
error, never a crash.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


TEXT_MODELS = [f"{kind}-{exporter}" for kind in ("bert", "gpt2", "minilm") for exporter in ("legacy", "dynamo")]
NHWC_MODELS = ["resnet50-legacy", "mobilenet_v2-legacy", "ppocrv4-det"]
GRAPH_MODELS = ["bert-legacy", "gpt2-legacy", "resnet50-legacy"]
PROVIDER = {"ort-cpu": "cpu", "ort-cuda": "cuda", "portable": "cpu"}  # (portable's standard ops: timed on the CPU provider)


def _gm(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _stats(times_ms: list[float]) -> dict:
    return {"median_ms": round(float(np.median(times_ms)), 4), "p10_ms": round(float(np.percentile(times_ms, 10)), 4),
            "p90_ms": round(float(np.percentile(times_ms, 90)), 4)}


# ---------------------------------------------------------------------------------------------
# The run's provenance


def provenance(argv: list[str]) -> dict:
    from scripts.bench.peers import gpu_info, machine_info, onnxopt_commit

    import onnxruntime

    machine = machine_info()
    gpu = gpu_info()
    if gpu:
        machine["gpu"] = gpu
    import onnx
    import onnx_ir

    import onnxopt

    return {"command": "python -m scripts.data.benefit " + shlex.join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine, "commit": onnxopt_commit(),
            "versions": {"onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
                         "onnx-ir": onnx_ir.__version__, "onnxopt": onnxopt.__version__}}


# ---------------------------------------------------------------------------------------------
# Rules and models


def rules_by_key(rules_file: str | None) -> tuple[list, list, dict[str, list]]:
    """(base rules, extra rules, {benefit key: rules carrying it})."""
    from onnxopt.library import registry

    base = registry.builtin_rules()
    extra = registry.load_rules_file(rules_file) if rules_file else []
    keys: dict[str, list] = {}
    for r in [*base, *extra]:
        if r.benefit:
            keys.setdefault(r.benefit, []).append(r)
    return base, extra, keys


def _rows(v: np.ndarray, batch: int) -> np.ndarray:
    """``batch`` rows of ``v``: its first ones, repeated when it has fewer."""
    if v.ndim == 0:
        return v
    if v.shape[0] < batch:
        v = np.concatenate([v] * (-(-batch // v.shape[0])), axis=0)
    return np.ascontiguousarray(v[:batch])


def load_models(names: list[str], paths: list[str], batch: int, sequence: int, cache,
                feed_files: list[str] = ()) -> dict[str, dict]:
    """{name: {"path", "feeds"} or {"error"}}: zoo models by name (built into the cache if needed) and
    models given as NAME=PATH (inputs generated by the verifier, at --batch/--sequence for dynamic dims,
    or read from the NAME=NPZ of ``feed_files``; without one, a decoder with a key/value cache takes one decode
    step after a generated prompt of --sequence tokens, batch 1)."""
    out: dict[str, dict] = {}
    given = dict(item.split("=", 1) for item in feed_files)
    if names:
        from onnxopt.models import zoo

        specs = {}
        for n in names:
            try:
                specs[n] = zoo.get(n)
            except KeyError as exc:
                out[n] = {"error": str(exc.args[0])}
        built = zoo.build(list(specs), cache=cache or zoo.DEFAULT_CACHE, log=lambda s: print("  " + s, flush=True)) \
            if specs else {}
        for n, spec in specs.items():
            where = built.get(n)
            if not isinstance(where, Path):
                out[n] = {"error": f"not built: {where}"}
                continue
            try:
                feeds = spec.inputs(where)
                feeds = {k: _rows(v[:, :sequence] if v.ndim == 2 and v.dtype.kind == "i" else v, batch)
                         for k, v in feeds.items()}
                out[n] = {"path": where, "feeds": feeds}
            except Exception as exc:  # noqa: BLE001 - a row, not a crash
                out[n] = {"error": _first_line(exc)}
    for item in paths:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).stem, item
        try:
            if name in given:
                with np.load(given[name]) as npz:
                    out[name] = {"path": Path(path), "feeds": {k: npz[k] for k in npz.files}}
                continue
            from onnxopt.verify import make_inputs
            from onnxopt.verify.decode import decoder_step_feeds, looks_like_a_decoder

            import onnx

            proto = onnx.load(path, load_external_data=False)
            if looks_like_a_decoder(proto):  # one decode step after a prompt of --sequence tokens, batch 1
                from onnxopt.verify.runtime import session

                made = decoder_step_feeds(session(path, "cpu"), prompt_tokens=sequence)
                if made is not None:
                    out[name] = {"path": Path(path), "feeds": made[0]}
                    continue
            inits = {i.name for i in proto.graph.initializer}
            shapes = {vi.name: [d.dim_value if d.HasField("dim_value") else (batch if i == 0 else sequence)
                                for i, d in enumerate(vi.type.tensor_type.shape.dim)]
                      for vi in proto.graph.input if vi.name not in inits}
            feeds, _ = make_inputs(path, shapes=shapes)
            out[name] = {"path": Path(path), "feeds": feeds}
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": _first_line(exc)}
    return out


# ---------------------------------------------------------------------------------------------
# Fusion keys


def provider_missing(target: str) -> str | None:
    """Why ``target``'s provider cannot be timed here (onnxruntime would fall back to the CPU silently)."""
    import onnxruntime

    name = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}[PROVIDER[target]]
    if name not in onnxruntime.get_available_providers():
        return (f"{name} is not available in this onnxruntime ({', '.join(onnxruntime.get_available_providers())}): "
                "no entry written")
    return None


def _optimize(src: Path, dst: Path, *, target, base, extra, disable, table, input_shapes):
    from onnxopt.targets import benefit
    from onnxopt import optimize

    with benefit.using(table):
        _, report = optimize(str(src), output=str(dst), rules=base, extra_rules=extra, disable=disable,
                             target=target, return_report=True, input_shapes=input_shapes or None)
    return report


def bench_key(key: str, rules: list, target: str, models: dict, args, base, extra, work: Path) -> dict:
    """One key on one target over the models: per model the fired counts, outputs compared, latency with
    and without the key's rules; the verdict."""
    from onnxopt.targets import benefit
    from onnxopt.verify import compare_all, measure_latency, run_profiled

    provider = PROVIDER[target]
    names = sorted({r.name for r in rules if target in r.targets})
    if not names:
        return {"skipped": f"no rule with benefit={key!r} is valid for {target}"}
    shipped = benefit.current()
    forced = benefit.Table(shipped.entries)  # every other key as shipped; this one unmeasured (its rules run)
    forced.entries.get(key, {}).pop(target, None)
    rows: dict[str, dict] = {}
    for mname, m in models.items():
        if "error" in m:
            rows[mname] = {"error": m["error"]}
            continue
        print(f"  {key} / {target} / {mname} ...", flush=True)
        try:
            shapes = {k: list(v.shape) for k, v in m["feeds"].items()} if args.fix_shapes else None
            with_p, without_p = work / f"{mname}.{key}.with.onnx", work / f"{mname}.{key}.without.onnx"
            rep = _optimize(m["path"], with_p, target=target, base=None, extra=extra, disable=[], table=forced,
                            input_shapes=shapes)
            fired = {n: rep.rules[n].fired for n in names if n in rep.rules and rep.rules[n].fired}
            if not fired:
                refusals = {n: rep.rules[n].as_dict()["top_refusals"] for n in names if n in rep.rules}
                rows[mname] = {"exercised": False, "fired": {}, "top_refusals": refusals}
                continue
            rep_without = _optimize(m["path"], without_p, target=target, base=None, extra=extra, disable=names,
                                    table=forced, input_shapes=shapes)
            # the op types the key's rules made (more of them with than without)
            made = {op.rsplit(".", 1)[-1]: n - rep_without.after.get(op, 0) for op, n in rep.after.items()
                    if n > rep_without.after.get(op, 0)}
            feeds = m["feeds"]
            out_with, k_with, _ = run_profiled(str(with_p), feeds, provider, threads=args.threads)
            out_without, k_without, _ = run_profiled(str(without_p), feeds, provider, threads=args.threads)
            compared = compare_all(out_without, out_with, rtol=args.rtol, atol=args.atol)
            lat = measure_latency({"without": str(without_p), "with": str(with_p)}, feeds, provider=provider,
                                  runs=args.runs, warmup=args.warmup, threads=args.threads,
                                  budget_s=args.latency_budget, spin=False)
            res = lat["results"]
            if "with" not in res or "without" not in res:
                rows[mname] = {"exercised": True, "fired": fired, "error": "; ".join(
                    f"{k}: {v}" for k, v in lat["errors"].items()) or "no latency"}
                continue
            w, wo = _stats(res["with"]["times_ms"]), _stats(res["without"]["times_ms"])
            # onnxruntime may make the same fusions itself at session time (where shapes are known): then the
            # unfused model runs them too, and the pair measures only the difference
            # (only kernels beyond the unfused graph's own nodes of that type count: a Cast the key's rules add,
            # where the unfused graph already has Casts of its own, is no fusion onnxruntime makes)
            in_graph = collections.Counter()
            for op, count in rep_without.after.items():
                in_graph[op.rsplit(".", 1)[-1]] += count
            already = {op: k_without["by_op"].get(op, 0) - in_graph[op] for op in made
                       if k_without["by_op"].get(op, 0) > in_graph[op]}
            isolated = sum(already.values()) * 2 < sum(made.values())
            rows[mname] = {"exercised": True, "isolated": isolated, "made": made,
                           "runtime_fuses_without": already,
                           "fired": fired, "with_ms": w["median_ms"], "without_ms": wo["median_ms"],
                           "ratio": round(w["median_ms"] / wo["median_ms"], 4), "with": w, "without": wo,
                           "rounds": lat["rounds"], "kernels_with": k_with["kernels"],
                           "kernels_without": k_without["kernels"],
                           "kernels_by_provider_with": k_with["by_provider"],
                           "outputs_ok": all(r["ok"] for r in compared),
                           "max_abs_diff": max((r.get("max_abs", 0.0) or 0.0 for r in compared), default=0.0)}
        except Exception as exc:  # noqa: BLE001 - a row, not a crash
            rows[mname] = {"error": _first_line(exc)}
    return verdict(key, target, rows, names)


def verdict(key: str, target: str, rows: dict, names: list[str]) -> dict:
    from onnxopt.targets.benefit import NOISE

    timed = {m: r for m, r in rows.items() if isinstance(r.get("ratio"), float) and r.get("outputs_ok", True)
             and r.get("isolated", True)}
    out = {"rules": names, "models": rows}
    if not timed:
        out["skipped"] = ("no model exercised the rules apart from what onnxruntime fuses itself (or none could be "
                          "timed): no entry written")
        return out
    ratio = _gm([r["ratio"] for r in timed.values()])
    out["ratio"] = round(ratio, 4)
    out["apply"] = bool(ratio <= 1 + NOISE)
    return out


# ---------------------------------------------------------------------------------------------
# Session options (--advice)


def _time_iobinding(path: str, feeds: dict, options: dict, runs: int, warmup: int) -> list[float]:
    """Latency of ``path`` on CUDA through IOBinding on device buffers (CUDA graphs replay on fixed addresses)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(path, so, providers=[("CUDAExecutionProvider", options), "CPUExecutionProvider"])
    return time_bound_runs(sess, feeds, "cuda", runs, max(2, warmup))  # (the first runs capture the graph)


def time_bound_runs(sess, feeds: dict, device: str, runs: int, warmup: int) -> list[float]:
    """ms of each of ``runs`` runs of ``sess`` after ``warmup``, its inputs and outputs bound to buffers on
    ``device`` ("cuda" or "cpu") through IOBinding, so no copy between host and device is timed."""
    import onnxruntime as ort

    binding = sess.io_binding()
    for i in sess.get_inputs():
        binding.bind_ortvalue_input(i.name, ort.OrtValue.ortvalue_from_numpy(feeds[i.name], device, 0))
    for o in sess.get_outputs():
        binding.bind_output(o.name, device, 0)
    for _ in range(warmup):
        sess.run_with_iobinding(binding)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def bench_option(key: str, option: str, value: str, models: dict, args, work: Path) -> dict:
    from onnxopt import optimize
    from onnxopt.targets.advice import advise
    from onnxopt.verify import measure_latency

    import onnx_ir as ir

    rows: dict[str, dict] = {}
    for mname, m in models.items():
        if "error" in m:
            rows[mname] = {"error": m["error"]}
            continue
        print(f"  {key} / ort-cuda / {mname} ...", flush=True)
        try:
            shapes = {k: list(v.shape) for k, v in m["feeds"].items()}
            dst = work / f"{mname}.cuda.onnx"
            extra = {"precision": args.precision} if args.precision != "fp32" else {}
            optimize(str(m["path"]), output=str(dst), target="ort-cuda", input_shapes=shapes, **extra)
            adv = advise(ir.load(str(dst)), "ort-cuda")
            eligible = {o["option"] for o in adv["provider_options"]} | {
                o["option"] for o in adv["not_advised"] if "evidence" in o}
            if option not in eligible:
                why = next((o.get("why") for o in adv["not_advised"] if o["option"] == option), "not eligible")
                rows[mname] = {"exercised": False, "why": why}
                continue
            if key == "cuda_graph":
                with_t, without_t = [], []
                for _ in range(2):  # two alternations of both, each its own session
                    without_t += _time_iobinding(str(dst), m["feeds"], {}, args.runs // 2, args.warmup)
                    with_t += _time_iobinding(str(dst), m["feeds"], {option: value}, args.runs // 2, args.warmup)
                w, wo, rounds = _stats(with_t), _stats(without_t), len(with_t)
            else:
                lat = measure_latency({"without": str(dst), "with": str(dst)}, m["feeds"], provider="cuda",
                                      runs=args.runs, warmup=args.warmup, budget_s=args.latency_budget,
                                      entry_options={"without": {}, "with": {"cuda": {option: value}}})
                res = lat["results"]
                if "with" not in res or "without" not in res:
                    rows[mname] = {"error": "; ".join(f"{k}: {v}" for k, v in lat["errors"].items()) or "no latency"}
                    continue
                w, wo, rounds = _stats(res["with"]["times_ms"]), _stats(res["without"]["times_ms"]), lat["rounds"]
            rows[mname] = {"exercised": True, "with_ms": w["median_ms"], "without_ms": wo["median_ms"],
                           "ratio": round(w["median_ms"] / wo["median_ms"], 4), "with": w, "without": wo,
                           "rounds": rounds, "input_shapes": shapes}
        except Exception as exc:  # noqa: BLE001
            rows[mname] = {"error": _first_line(exc)}
    out = verdict(key, "ort-cuda", rows, [])
    out.pop("rules", None)
    out["option"] = f"{option}={value}"
    return out


# ---------------------------------------------------------------------------------------------
# The table


def to_table(results: dict, source: dict, settings: dict):
    """The benefit table of one run: an entry per key and target that has a verdict."""
    from onnxopt.targets.benefit import Table

    t = Table(meta={"runs": [{**source, "settings": settings}]})
    for key, by_target in results.items():
        for target, r in by_target.items():
            if "apply" not in r:
                continue
            models = {m: {k: row[k] for k in ("without_ms", "with_ms", "ratio", "fired", "kernels_with",
                                                 "kernels_without", "max_abs_diff", "outputs_ok", "isolated",
                                                 "runtime_fuses_without") if k in row}
                      for m, row in r["models"].items() if "ratio" in row}
            t.set(key, target, r["apply"], {"ratio": r["ratio"], "models": models, "settings": settings,
                                            **({"rules": r["rules"]} if r.get("rules") else {}),
                                            **({"option": r["option"]} if r.get("option") else {}),
                                            "source": source})
    return t


def merge_files(paths: list[str], keep: bool):
    from onnxopt.targets.benefit import Table

    out = Table()
    runs = []
    for p in paths:
        t = Table.load(p)
        out.merge(t, overwrite=not keep)
        runs += t.meta.get("runs", [])
    out.meta["runs"] = runs
    return out


def summary(results: dict) -> str:
    lines = ["key                       target    model            fired  without ms  with ms   ratio  outputs",
             "------------------------  --------  ---------------  -----  ----------  -------  ------  -------"]
    for key, by_target in results.items():
        for target, r in by_target.items():
            if "models" not in r:
                lines.append(f"{key:<24}  {target:<8}  {r.get('skipped', '')}")
                continue
            for m, row in r["models"].items():
                if "ratio" in row:
                    fired = sum(row.get("fired", {}).values()) if row.get("fired") else "-"
                    ok = "ok" if row.get("outputs_ok", True) else "DIFFER"
                    if row.get("isolated") is False:
                        ok += (" (not counted: onnxruntime fuses " + ", ".join(
                            f"{n} {op}" for op, n in row["runtime_fuses_without"].items()) + " itself without)")
                    lines.append(f"{key:<24}  {target:<8}  {m:<15}  {fired!s:>5}  {row['without_ms']:>10.3f}  "
                                 f"{row['with_ms']:>7.3f}  {row['ratio']:>6.3f}  {ok}")
                else:
                    what = row.get("error") or row.get("why") or "not exercised"
                    lines.append(f"{key:<24}  {target:<8}  {m:<15}  {what}")
            if "apply" in r:
                lines.append(f"{'':<24}  {'':<8}  => {'apply' if r['apply'] else 'SKIP'} (geometric mean ratio "
                             f"{r['ratio']:.3f})")
            elif r.get("skipped"):
                lines.append(f"{'':<24}  {'':<8}  => {r['skipped']}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m scripts.data.benefit", description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", nargs="+", metavar="KEY",
                   help="benefit keys to measure (default: every key the rules use)")
    p.add_argument("--targets", nargs="+", default=["ort-cpu"], choices=sorted(PROVIDER),
                   help="default ort-cpu")
    p.add_argument("--models", nargs="*", default=None, metavar="NAME",
                   help=f"zoo models (default: {' '.join(TEXT_MODELS)}; with --advice: the Conv and fixed-shape "
                        "models)")
    p.add_argument("--model", action="append", default=[], metavar="NAME=PATH", help="another model file (repeatable)")
    p.add_argument("--feeds", action="append", default=[], metavar="NAME=NPZ",
                   help="the inputs of a --model NAME, as numpy.savez wrote them (repeatable; default: generated)")
    p.add_argument("--rules-file", help="extra rules (a Python file with RULES), e.g. rules under development")
    p.add_argument("--advice", action="store_true", help="measure the session options of the advice (ort-cuda)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--sequence", type=int, default=128)
    p.add_argument("--fix-shapes", action="store_true", help="optimize with the inputs fixed at the timed shapes")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16"],
                   help="with --advice: the models optimized at this precision (optimize(precision=...))")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1; 0: its choice)")
    p.add_argument("--latency-budget", type=float, default=60.0, metavar="S")
    p.add_argument("--rtol", type=float, default=1e-4, help="outputs with/without compared at (default 1e-4)")
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--cache", type=Path, default=None)
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge these run files instead of measuring")
    p.add_argument("--keep", action="store_true", help="with --merge/--into: an existing entry wins")
    p.add_argument("-o", "--output", type=Path, help="write the run's table here")
    p.add_argument("--into", type=Path,
                   help="merge the run's table into this table file (e.g. onnxopt/data/benefit.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from onnxopt.targets.benefit import Table

    if args.merge:
        table = merge_files(args.merge, args.keep)
        results = None
    else:
        source = provenance(argv)
        if args.output:
            source["file"] = str(args.output)
        settings = {"batch": args.batch, "sequence": args.sequence, "fix_shapes": args.fix_shapes, "runs": args.runs,
                    "warmup": args.warmup, "threads": args.threads,
                    **({"precision": args.precision} if args.advice else {})}
        results: dict[str, dict] = {}
        with tempfile.TemporaryDirectory(prefix="onnxopt-benefit-") as tmp:
            work = Path(tmp)
            if args.advice:
                names = args.models if args.models is not None else sorted(set(NHWC_MODELS + GRAPH_MODELS))
                missing = provider_missing("ort-cuda")
                models = load_models(names, args.model, args.batch, args.sequence, args.cache) if not missing else {}
                for key, option in (("cuda_prefer_nhwc", "prefer_nhwc"), ("cuda_graph", "enable_cuda_graph")):
                    if args.keys and key not in args.keys:
                        continue
                    results.setdefault(key, {})["ort-cuda"] = {"skipped": missing} if missing else \
                        bench_option(key, option, "1", models, args, work)
            else:
                base, extra, keys = rules_by_key(args.rules_file)
                chosen = args.keys or sorted(keys)
                missing = [k for k in chosen if k not in keys]
                for k in missing:
                    results[k] = {t: {"skipped": "no rule carries this benefit key"} for t in args.targets}
                names = args.models if args.models is not None else ([] if args.model else TEXT_MODELS)
                models = load_models(names, args.model, args.batch, args.sequence, args.cache, args.feeds)
                for key in [k for k in chosen if k in keys]:
                    for target in args.targets:
                        missing = provider_missing(target)
                        results.setdefault(key, {})[target] = {"skipped": missing} if missing else \
                            bench_key(key, keys[key], target, models, args, base, extra, work)
        table = to_table(results, source, settings)
        table.meta["results"] = results
        print(summary(results))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        table.save(args.output)
        print(f"wrote {args.output}")
    if args.into:
        into = Table.load(args.into) if args.into.exists() else Table()
        taken = into.merge(table, overwrite=not args.keep)
        into.save(args.into)
        print(f"merged {len(taken)} entr{'y' if len(taken) == 1 else 'ies'} into {args.into}: "
              + (", ".join(f"{k}/{t}" for k, t in taken) or "none"))
    if not args.output and not args.into:
        print(json.dumps(table.as_dict()["entries"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
