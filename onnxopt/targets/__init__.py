"""Where an optimized model will run: the vocabulary rules and callers share.

- ``portable`` (the default): any ONNX runtime; rules emit standard ONNX ops only.
- ``ort-cpu``: onnxruntime's CPU provider; rules may emit its contrib ops and choose what it runs fastest.
- ``ort-cuda``: onnxruntime's CUDA provider, likewise.

``cpu`` and ``cuda`` are accepted as aliases of ``ort-cpu`` and ``ort-cuda``. A rule declares the
targets it is valid for (``Rule.targets``, all of them by default); choosing rules by target is
the registry's job (``onnxopt.library.registry.select``).
"""

from __future__ import annotations

from collections.abc import Iterable

from onnxopt.errors import UsageError

PORTABLE, ORT_CPU, ORT_CUDA = "portable", "ort-cpu", "ort-cuda"
TARGETS = (PORTABLE, ORT_CPU, ORT_CUDA)
ALIASES = {"cpu": ORT_CPU, "cuda": ORT_CUDA}
DEFAULT = PORTABLE


def normalize(name: str | None) -> str:
    """The target a name (or alias) stands for; None is the default, ``portable``."""
    if name is None:
        return DEFAULT
    target = ALIASES.get(name, name)
    if target not in TARGETS:
        raise UsageError(f"unknown target {name!r}; choose from {', '.join(TARGETS)} (aliases: cpu, cuda)")
    return target


def normalize_all(names: Iterable[str]) -> frozenset[str]:
    return frozenset(normalize(n) for n in names)


# A float16 model (onnxopt's --precision fp16) against its float32 original: each float output
# passes when its cosine similarity is at least FP16_MIN_COSINE, its largest absolute error at most
# FP16_MAX_ERROR of the original output's range (max - min; its largest magnitude for a constant
# output), and, for logits (a name with "logit",
# or a [batch, classes] output of 1000 or more classes), the top-1 class along the last axis agrees
# at FP16_MIN_TOP1 of the positions or more (next-token agreement for a language model).
FP16_MIN_COSINE = 0.999
FP16_MAX_ERROR = 0.01
FP16_MIN_TOP1 = 0.99
