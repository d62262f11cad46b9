"""Screenshots of the live diff page (onnxopt.diff.live) in headless Chromium, for the README.

    python -m scripts.docs.screenshots resnet50-dynamo --out docs/img
    python -m scripts.docs.screenshots minilm-legacy --target ort-cpu --choose bias_gelu --out docs/img

Each zoo model (~/.cache/onnxopt/models/NAME.onnx) is optimized, the page served, both Netron views
rendered, the node standing for the most original nodes (of the rule ``--choose`` names) chosen in the table (brought into view in both graphs), and the window
saved as NAME-diff.png. The mapping is onnxopt.diff's, as ``python -m onnxopt diff`` serves it. Needs
netron, selenium and Chromium (tests/browser.py)."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from onnxopt import diff, optimize
from onnxopt.diff import live as diff_live
from tests import browser

ZOO = Path(os.path.expanduser("~/.cache/onnxopt/models"))


def shoot(name: str, out: Path, size=(1800, 1100), target: str | None = None, choose: str | None = None) -> Path:
    before = ZOO / f"{name}.onnx"
    with tempfile.TemporaryDirectory() as tmp:
        after = Path(tmp) / f"{name}.opt.onnx"
        optimize(str(before), output=str(after), **({"target": target} if target else {}))
        mapping = diff.live_mapping(*diff.run(before, after))
        with diff_live.serve(before, after, mapping) as server, browser.headless(*size) as driver:
            driver.get(server.url)
            browser.wait_for_diff(driver, timeout=120)
            time.sleep(1)
            if mapping["created"]:  # the node of that rule (else any) that stands for the most
                sizes = [len(c["replaced"]) * (choose is None or c["rule"] == choose) for c in mapping["created"]]
                driver.execute_script("window.onnxoptDiff.choose(arguments[0])", sizes.index(max(sizes)))
            time.sleep(1)
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"{name}{'-' + target if target else ''}-diff.png"
            driver.save_screenshot(str(path))
            state = driver.execute_script("return window.onnxoptDiff")
            print(f"{name}: {len(mapping['created'])} created, {len(mapping['removed'])} removed; "
                  f"marked {len(state['applied']['before'])} before, {len(state['applied']['after'])} after; "
                  f"not drawn by Netron {len(state['missing']['before'])} before, "
                  f"{len(state['missing']['after'])} after -> {path}")
            return path


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.docs.screenshots", description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--target", help="optimize for this target (e.g. ort-cpu: the transformer fusions)")
    ap.add_argument("--choose", metavar="RULE", help="choose a node this rule made (default: any)")
    args = ap.parse_args()
    for name in args.models:
        shoot(name, Path(args.out), target=args.target, choose=args.choose)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
