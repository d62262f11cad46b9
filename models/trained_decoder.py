"""The decoder with real weights that issue 30's fidelity checks use: a small Llama-style model (GQA, rotary,
SwiGLU, RMSNorm, untied LM head) trained by ``scripts/data/train_decoder.py`` on Python's standard-library
sources, kept in Hugging Face format (config, safetensors weights, tokenizer, ``train_metadata.json``) under
``<cache>/_trained/<name>/`` (``cache``: ``$ONNXOPT_CACHE``, else ``~/.cache/onnxopt/models``), never committed.

    trained_decoder_dir()                      the folder, or FileNotFoundError naming the command that builds it
    trained_decoder_dir(train_if_missing=True) builds it first when missing (~15 min on 2 uncontended cores)

Imports only ``cache``; training runs the script as a subprocess from the source checkout (no import of scripts).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .cache import cache_dir

MODEL_NAME = "llama-pystdlib-4l256"
METADATA_FILE = "train_metadata.json"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", METADATA_FILE)
TRAIN_COMMAND = "python -m scripts.data.train_decoder"
# the recipe version this accessor expects (scripts.data.train_decoder.FORMAT_VERSION writes it)
EXPECTED_FORMAT_VERSION = 1


def default_trained_dir(name: str = MODEL_NAME, cache: str | Path | None = None) -> Path:
    return cache_dir(cache) / "_trained" / name


def _source_root() -> Path:
    return Path(__file__).resolve().parents[1]


def missing_files(folder: Path) -> list[str]:
    return [f for f in REQUIRED_FILES if not (folder / f).is_file()]


def trained_decoder_dir(train_if_missing: bool = False, cache: str | Path | None = None,
                        name: str = MODEL_NAME) -> Path:
    """The trained decoder's Hugging Face folder. When it is missing, incomplete or of another recipe version:
    raises FileNotFoundError saying how to build it, or, with ``train_if_missing``, runs the training script
    (``--force``) from the source checkout and returns the folder it wrote."""
    folder = default_trained_dir(name, cache)
    problem = _problem(folder)
    if problem is None:
        return folder
    command = f"{TRAIN_COMMAND} --out {folder}" if cache or name != MODEL_NAME else TRAIN_COMMAND
    if not train_if_missing:
        raise FileNotFoundError(f"trained decoder {name}: {problem}; build it (~15 min on 2 uncontended cores) "
                                f"from the onnxopt source checkout with: {command}")
    script = _source_root() / "scripts" / "data" / "train_decoder.py"
    if not script.is_file():
        raise FileNotFoundError(f"trained decoder {name}: {problem}, and {script} is not here to train it "
                                "(training needs the onnxopt source checkout)")
    subprocess.run([sys.executable, "-m", "scripts.data.train_decoder", "--out", str(folder), "--force"],
                   cwd=_source_root(), check=True)
    problem = _problem(folder)
    if problem is not None:
        raise RuntimeError(f"trained decoder {name}: training finished but {problem}")
    return folder


def _problem(folder: Path) -> str | None:
    if not folder.is_dir():
        return f"{folder} does not exist"
    missing = missing_files(folder)
    if missing:
        return f"{folder} lacks {', '.join(missing)}"
    version = json.loads((folder / METADATA_FILE).read_text()).get("format_version")
    if version != EXPECTED_FORMAT_VERSION:
        return f"{folder} was trained by recipe version {version}, not {EXPECTED_FORMAT_VERSION}"
    return None


def metadata(folder: str | Path | None = None) -> dict:
    """``train_metadata.json`` of ``folder`` (default: the trained decoder's folder, which must exist)."""
    folder = Path(folder) if folder else trained_decoder_dir()
    return json.loads((folder / METADATA_FILE).read_text())
