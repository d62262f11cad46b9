"""On the GPU machine (after scripts/gpu/env.sh): issue 27 item 3's three float16 cases on the CUDA provider.

For each case: the plain float16 conversion (no data) run by onnxruntime's CUDA provider (real float16
kernels), onnx's reference evaluator, and onnxopt's verify with providers=cuda (its float16-arithmetic
judgement on CUDA); then the conversion given the data. Prints one JSON line per case.
    usage: python3 -m scripts.oracles.gpu_fp16_arith
"""
import argparse
import json

import numpy as np
import onnxruntime as ort

from onnxopt import optimize
from onnxopt.verify import verify
from tests.helpers import FP16_ARITH_CASES as CASES
from tests.helpers import error_of_range, reference_output


def cuda(proto, feeds):
    s = ort.InferenceSession(proto.SerializeToString(), providers=["CUDAExecutionProvider"])
    return s.run(None, feeds)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.oracles.gpu_fp16_arith",
                                     description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    for name, make in CASES.items():
        src, feeds = make()
        ref32 = reference_output(src, feeds)
        half = optimize(src, precision="fp16")
        got = cuda(half, feeds)
        rep = verify(src, half, feeds=feeds, runs=0, providers="cuda")
        kept, krep = optimize(src, precision="fp16", return_report=True, verify="cuda",
                              verify_options={"feeds": feeds, "runs": 0})
        row = {"case": name, "cuda_plain_finite": bool(np.isfinite(got).all()),
               "cuda_plain_error_of_range": None if not np.isfinite(got).all() else error_of_range(ref32, got),
               "reference_plain_finite": bool(np.isfinite(reference_output(half, feeds)).all()),
               "verify_cuda_ok": rep["ok"], "fp16_arithmetic": rep.get("fp16", {}).get("arithmetic"),
               "fp16_ok": rep.get("fp16", {}).get("ok")}
        row["with_data_verify_cuda_ok"] = krep.verification["ok"]
        k = cuda(kept, feeds)
        row["cuda_with_data_finite"] = bool(np.isfinite(k).all())
        row["cuda_with_data_error_of_range"] = error_of_range(ref32, k) if np.isfinite(k).all() else None
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
