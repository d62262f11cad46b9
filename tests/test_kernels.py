"""onnxopt.ir.kernels: onnxruntime's kernel listing, read in this process on a CPU-only build and in a
child process elsewhere (on onnxruntime-gpu without TensorRT the listing segfaults the process)."""

from __future__ import annotations

import subprocess

import pytest

from onnxopt.ir import kernels

pytest.importorskip("onnxruntime")


@pytest.fixture
def fresh():
    kernels.kernel_defs.cache_clear()
    yield
    kernels.kernel_defs.cache_clear()


def test_the_listing_has_cpu_kernels(fresh):
    defs = kernels.kernel_defs()
    assert defs is not None
    conv = [k for k in defs if k[0] == "Conv" and k[1] == "" and k[4] == "CPUExecutionProvider"]
    assert conv and all(lo <= hi for _, _, lo, hi, _, _ in conv)
    assert any("tensor(float)" in k[5] for k in conv)


def test_a_build_with_other_providers_is_asked_in_a_child_with_the_same_answer(fresh, monkeypatch):
    here = kernels.kernel_defs()
    kernels.kernel_defs.cache_clear()
    monkeypatch.setattr(kernels, "_SAFE_PROVIDERS", set())  # as on a GPU build
    calls = []
    real = subprocess.run
    monkeypatch.setattr(kernels.subprocess, "run", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert kernels.kernel_defs() == here
    assert len(calls) == 1


def test_a_child_that_crashes_means_cannot_tell(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "_SAFE_PROVIDERS", set())
    monkeypatch.setattr(kernels, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert kernels.kernel_defs() is None
