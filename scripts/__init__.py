"""The project's scripts, as a package grouped by purpose. Run them from the repository root with
``python -m`` (no path set-up: ``scripts`` imports from the root, ``onnxopt`` as installed,
``pip install -e .``):

    python -m scripts.bench.peers --help          onnxopt against its peers (BENCHMARKS.md's tables)
    python -m scripts.oracles.zoo_hashes --help   the zoo's outputs byte-identical to a recorded run

What lives where:

- ``bench/``: benchmarks. ``peers`` (onnxopt and the peer optimizers, CPU and CUDA columns),
  ``engine`` (optimize time against a bare load+save, the scaling run), ``layout`` (layouts, NHWC
  edges, the Keras models), ``quantize`` (onnxopt's quantization against onnxruntime's and AMD
  Quark's), ``targets`` (the target presets against the vendors' optimizers), ``input_shapes``
  (fixed against dynamic input shapes), ``peer_features`` (what each peer does with hard inputs);
  ``_peers`` (the peers, called as their documentation shows), ``_quant_data`` (data sets and
  metrics of the quantization benchmark), ``_quant_quark`` (run by Quark's own Python).
- ``data/``: the generators of the tables shipped in the package, each recording the provenance it
  writes: ``benefit`` (onnxopt/data/benefit.json), ``quant_costs`` (onnxopt/quantize/ort_cpu_costs.json),
  ``benefit_standin_rules`` (rules measured before the library's rule lands).
- ``oracles/``: checks of onnxopt against an independent answer: ``fold`` (constant folding against
  onnxruntime and exact arithmetic), ``flops``, ``fp16``, ``gpu_fp16_arith``, ``zoo_exact``,
  ``zoo_hashes`` (outputs byte-identical), ``fuzz_transposes``, ``memory_*`` (measured peak memory),
  ``diff_alignment``, ``transpose_report``, ``quant_profile``, ``big_model`` and ``big_decoder`` (past 2 GB:
  an encoder, a KV-cached decoder),
  ``keras_models`` (and ``build_keras_models`` with ``keras_models.sh``, in TensorFlow's own
  environment).
- ``gpu/``: shell commands for the lent GPU machine (``bash scripts/gpu/bench.sh``; ``env.sh`` is
  sourced by the others). They run from the repository root; ``.gpu/`` (staged wheels and models,
  git-ignored) stays there.
- ``docs/``: ``screenshots`` (the live diff page's screenshots for the documentation).
- ``results/``: recorded outputs (data, not code; their "command" fields are the commands as run then).

Imports: a script imports ``onnxopt`` (and ``onnxopt.models``), the other scripts as ``scripts.x.y``,
and, where it reuses the tests' builders, ``tests.helpers``. ``onnxopt`` never imports ``scripts``.
No file here edits ``sys.path`` (tests/test_scripts_package.py checks it); a subprocess that runs
a script by ``-m`` gets the repository root on its ``PYTHONPATH`` (``child_env``).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root
RESULTS = ROOT / "scripts" / "results"


def child_env(env: dict[str, str] | None = None, *extra: str) -> dict[str, str]:
    """``env`` (default: this process's environment) for a subprocess that runs ``python -m
    scripts.…`` from another folder: ``extra`` folders first on its ``PYTHONPATH``, the repository
    root last (after what is set, so a ``PYTHONPATH`` that chose another ``onnxopt`` keeps it)."""
    env = dict(os.environ if env is None else env)
    parts = [*extra, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    if str(ROOT) not in parts:
        parts.append(str(ROOT))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env
