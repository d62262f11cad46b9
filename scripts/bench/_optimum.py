"""optimum's ORTOptimizer (the optimum-onnx package) as a peer, run in an environment of its own.

optimum-onnx 0.1.0 pins ``transformers<4.58`` (hence ``huggingface-hub<1.0``, ``tokenizers<=0.23.0``), which
conflicts with the transformers this project builds its models with, so it never runs in our interpreter:
``optimize`` writes the model directory it asks for (config.json + model.onnx) and runs
``python -m scripts.bench._optimum --run JOB`` in optimum's environment, which calls it as its documentation
shows::

    optimizer = ORTOptimizer.from_pretrained(model_dir)
    optimizer.optimize(save_dir=out_dir, optimization_config=AutoOptimizationConfig.O2(for_gpu=...))

The environment (``environment()``), first found of:

- ``ONNXOPT_OPTIMUM_SITE``: a folder the pinned wheels were installed into with ``pip install --target``
  (the GPU machine: ``scripts/gpu/env.sh`` installs the carried ``.gpu/wheels-optimum`` into
  /tmp/site-optimum); this interpreter runs it with that folder first on ``PYTHONPATH``;
- a virtual environment, ``ONNXOPT_OPTIMUM_VENV`` or ``<repository>/.venv-optimum``, made by
  ``python -m scripts.bench._optimum setup`` (``--system-site-packages``: torch, onnx, onnxruntime come from
  the interpreter that makes it; the pins below are installed into it from PyPI).

``python -m scripts.bench._optimum wheels DIR`` downloads the pinned wheels for CPython 3.12 on
manylinux x86_64 (the GPU machine's), about 16 MB, for carrying.

This module imports only the standard library at load time: it is also the runner in optimum's
environment. It imports scripts.bench._peerlog (standard library only) and nothing of onnxopt.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

from scripts.bench._peerlog import PeerLog

ROOT = Path(__file__).resolve().parents[2]

# optimum-onnx and what its pins resolve to (pip install optimum-onnx==0.1.0, 2026-11-28): the environment
# gets exactly these, so runs here and on the GPU machine use the same code
PINS = ("optimum-onnx==0.1.0", "optimum==2.1.0", "transformers==4.57.6", "huggingface-hub==0.36.2",
        "tokenizers==0.22.2")
LEVELS = ("O1", "O2", "O3", "O4")
SITE_ENV, VENV_ENV = "ONNXOPT_OPTIMUM_SITE", "ONNXOPT_OPTIMUM_VENV"
DEFAULT_VENV = ROOT / ".venv-optimum"
SETUP_HINT = "python -m scripts.bench._optimum setup"
OPTIMIZED_NAME = "model_optimized.onnx"  # ORTOptimizer.optimize's output for model.onnx (file_suffix "optimized")


class OptimumUnavailable(RuntimeError):
    """optimum's environment is not there (the peer's row says why; tests skip)."""


def environment() -> tuple[list[str], dict[str, str]]:
    """(the command that starts optimum's interpreter, its environment); OptimumUnavailable with the reason
    when neither ``ONNXOPT_OPTIMUM_SITE`` nor the virtual environment is there."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    site = os.environ.get(SITE_ENV)
    if site:
        if not (Path(site) / "optimum" / "onnxruntime" / "optimization.py").is_file():
            raise OptimumUnavailable(f"{SITE_ENV}={site} holds no optimum-onnx (install the wheels of "
                                     f"`python -m scripts.bench._optimum wheels` there with pip install --target)")
        parts = [site] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
        if str(ROOT) not in parts:
            parts.append(str(ROOT))
        env["PYTHONPATH"] = os.pathsep.join(parts)
        return [sys.executable], env
    venv = Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)
    python = venv / "bin" / "python"
    if not python.exists():
        raise OptimumUnavailable(f"optimum-onnx's environment is absent ({venv}): make it with `{SETUP_HINT}` "
                                 f"(or set {SITE_ENV} to a folder its wheels were installed into)")
    env["PYTHONPATH"] = str(ROOT)  # this module only: our environment's transformers must not shadow its pin
    env.pop("PYTHONHOME", None)
    return [str(python)], env


def versions() -> dict[str, str]:
    """The pinned distributions' versions in optimum's environment ({"optimum-onnx": "absent (why)"} when
    it is not there)."""
    try:
        command, env = environment()
    except OptimumUnavailable as exc:
        return {"optimum-onnx": f"absent ({exc})"}
    names = [p.split("==")[0] for p in PINS]
    code = ("import importlib.metadata as m, json, sys\nout = {}\nfor d in sys.argv[1:]:\n    try:\n"
            "        out[d] = m.version(d)\n    except m.PackageNotFoundError:\n        out[d] = 'not installed'\n"
            "print(json.dumps(out))")
    try:
        proc = subprocess.run(command + ["-c", code, *names], capture_output=True, text=True, timeout=60, env=env)
        return json.loads(proc.stdout)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return {"optimum-onnx": f"unknown ({type(exc).__name__})"}


def model_dir(src: str | Path, config: dict, where: Path) -> Path:
    """The directory ORTOptimizer.from_pretrained reads: ``config.json`` (the transformers config the model
    was built with, ``model_type`` included) and ``model.onnx`` (a hard link to ``src``, else a copy)."""
    if not config.get("model_type"):
        raise ValueError("the transformers config has no model_type")
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    try:
        os.link(src, where / "model.onnx")
    except OSError:
        shutil.copyfile(src, where / "model.onnx")
    return where


def optimize(src: str, dst: str, config: dict, *, level: str, for_gpu: bool, timeout: float = 900.0) -> dict:
    """ORTOptimizer at ``level`` (O1-O4) on ``src`` with the transformers ``config``, written to ``dst``,
    in optimum's environment. What it logs is logged again here (same logger names and levels; its Python
    warnings as warnings), so the bench's PeerLog sees it. Returns the facts for the report."""
    if level not in LEVELS:
        raise ValueError(f"unknown optimum level {level!r}; known: {', '.join(LEVELS)}")
    command, env = environment()
    work = Path(dst).parent / f".{Path(dst).stem}.optimum"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        d = model_dir(src, config, work / "model")
        job = {"model_dir": str(d), "save_dir": str(work / "out"), "level": level, "for_gpu": bool(for_gpu),
               "result": str(work / "result.json")}
        (work / "job.json").write_text(json.dumps(job))
        proc = subprocess.run(command + ["-m", "scripts.bench._optimum", "--run", str(work / "job.json")],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=str(work))
        try:
            res = json.loads((work / "result.json").read_text())
        except (OSError, ValueError):
            tail = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
            raise RuntimeError(f"optimum's process exited with {proc.returncode}"
                               + (f": {tail[-1].strip()[:250]}" if tail else "")) from None
        replay(res.get("records", []))
        if not res.get("ok"):
            raise RuntimeError(res.get("error", "optimum failed"))
        shutil.move(str(work / "out" / OPTIMIZED_NAME), dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = {k: res[k] for k in ("level", "for_gpu", "options", "fused", "versions") if k in res}
    info["optimum_s"] = round(res["seconds"], 3)  # ORTOptimizer.optimize alone (the row's time adds the start)
    return info


def replay(records: list) -> None:
    """Log again, in this process, what optimum's process logged: ``["log", levelno, logger, message]`` or
    ``["warning", category, message]``."""
    import builtins

    for rec in records:
        if rec[0] == "log":
            logging.getLogger(rec[2]).log(int(rec[1]), "%s", rec[3])
        else:
            cat = getattr(builtins, rec[1], None)
            if not (isinstance(cat, type) and issubclass(cat, Warning)):
                cat = UserWarning
            warnings.warn(rec[2] if cat is not UserWarning or rec[1] == "UserWarning" else f"{rec[1]}: {rec[2]}",
                          cat, stacklevel=2)


# ---------------------------------------------------------------------------------------------
# In optimum's environment


def _records(level: int = logging.WARNING):
    """A context manager collecting every log record at ``level`` and above (whatever the loggers' own
    levels, as _peers.PeerLog) and every warning, as replay() takes them."""
    class Records(PeerLog):
        def _add(self, record):
            try:
                msg = record.getMessage()
            except Exception:  # noqa: BLE001
                msg = str(record.msg)
            self.lines.append(["log", record.levelno, record.name, msg])

        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.lines = [ln if isinstance(ln, list) else ["warning", *_split_warning(ln)] for ln in self.lines]
            return False

    return Records(level)


def _split_warning(line: str) -> tuple[str, str]:
    cat, _, msg = line.partition(": ")
    return cat, msg


def run_job(job_file: str) -> int:
    job = json.loads(Path(job_file).read_text())
    out: dict = {"ok": False, "level": job["level"], "for_gpu": job["for_gpu"]}
    # transformers imports torchvision when it is installed; a torchvision without its compiled ops (the CPU
    # wheel here) fails on its meta registrations, which nothing here needs (as onnxopt.models.torchvision_models)
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    rec = _records()
    try:
        with rec:
            from optimum.onnxruntime import AutoOptimizationConfig, ORTOptimizer

            optimizer = ORTOptimizer.from_pretrained(job["model_dir"])
            config = getattr(AutoOptimizationConfig, job["level"])(for_gpu=job["for_gpu"])
            t0 = time.perf_counter()
            optimizer.optimize(save_dir=job["save_dir"], optimization_config=config)
            out["seconds"] = time.perf_counter() - t0
            out["options"] = {k: v for k, v in vars(config).items()
                              if k in ("optimization_level", "optimize_for_gpu", "fp16",
                                       "enable_transformers_specific_optimizations", "enable_gelu_approximation",
                                       "disable_embed_layer_norm_fusion", "use_mask_index")}
            out["fused"] = ORTOptimizer.get_fused_operators(str(Path(job["save_dir"]) / OPTIMIZED_NAME))
        import importlib.metadata as md

        out["versions"] = {d: md.version(d) for d in ("optimum-onnx", "optimum", "transformers", "onnxruntime")
                           if _installed(d)}
        out["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the caller as the row's error
        msg = str(exc).strip().splitlines()
        out["error"] = f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]
    out["records"] = rec.lines
    Path(job["result"]).write_text(json.dumps(out, default=repr))
    return 0 if out["ok"] else 1


def _installed(dist: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


# ---------------------------------------------------------------------------------------------
# Making the environment


def setup(venv: Path = DEFAULT_VENV, python: str | None = None) -> Path:
    """``python -m venv --system-site-packages VENV`` and the pins installed into it from PyPI (pip)."""
    base = python or getattr(sys, "_base_executable", None) or sys.executable
    if not (venv / "bin" / "python").exists():
        subprocess.run([base, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *PINS], check=True)
    return venv


def download_wheels(dest: Path, python_version: str = "3.12") -> list[Path]:
    """The pinned wheels for CPython ``python_version`` on manylinux x86_64 (``pip download --no-deps``:
    exactly the pins; torch, onnx, numpy and the like are the machine's own)."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(dest),
                    *PINS], check=True)
    return sorted(dest.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run"]:
        return run_job(argv[1])
    p = argparse.ArgumentParser(prog="python -m scripts.bench._optimum", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="make the virtual environment (default <repository>/.venv-optimum)")
    s.add_argument("--venv", type=Path, default=Path(os.environ.get(VENV_ENV) or DEFAULT_VENV))
    s.add_argument("--python", default=None, help="the interpreter to base it on (default: this one's base)")
    w = sub.add_parser("wheels", help="download the pinned wheels for the GPU machine (CPython 3.12)")
    w.add_argument("dest", type=Path)
    w.add_argument("--python-version", default="3.12")
    args = p.parse_args(argv)
    try:
        if args.cmd == "setup":
            print(f"optimum-onnx's environment: {setup(args.venv, args.python)}")
        else:
            files = download_wheels(args.dest, args.python_version)
            print("\n".join(f"{f} ({f.stat().st_size / 1e6:.1f} MB)" for f in files))
    except subprocess.CalledProcessError as exc:
        print(f"scripts.bench._optimum: error: {exc.cmd[0]} {exc.cmd[1]} ... exited with {exc.returncode}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
