"""Screenshots of the live diff page (onnxopt.diff_live) in headless Chromium, for the README.

    python scripts/diff_screenshots.py resnet50-dynamo minilm-legacy --out docs/img

Each zoo model (~/.cache/onnxopt/models/NAME.onnx) is optimized, the page served, both Netron views
rendered, the first fused node chosen in the table (brought into view in both graphs), and the window
saved as NAME-diff.png. The mapping is the provenance stand-in of tests/test_diff_live.py until
onnxopt.diff (branch d-core) is merged; then it should come from there."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from onnxopt import diff_live, optimize  # noqa: E402
from tests.test_diff_live import _chromedriver, _chromium, stand_in_mapping  # noqa: E402

ZOO = Path(os.path.expanduser("~/.cache/onnxopt/models"))


def shoot(name: str, out: Path, size=(1800, 1100)) -> Path:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    before = ZOO / f"{name}.onnx"
    with tempfile.TemporaryDirectory() as tmp:
        after = Path(tmp) / f"{name}.opt.onnx"
        optimize(str(before), output=str(after))
        mapping = stand_in_mapping(before, after)
        options = webdriver.ChromeOptions()
        options.binary_location = _chromium()
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    f"--window-size={size[0]},{size[1]}"):
            options.add_argument(arg)
        with diff_live.serve(before, after, mapping) as server:
            driver = webdriver.Chrome(options=options, service=Service(_chromedriver()))
            try:
                driver.get(server.url)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    ready = driver.execute_script("return window.onnxoptDiff && window.onnxoptDiff.ready")
                    if ready and ready["before"] and ready["after"]:
                        break
                    time.sleep(0.5)
                else:
                    raise SystemExit(f"{name}: Netron did not render both graphs")
                time.sleep(1)
                fused = [i for i, c in enumerate(mapping["created"]) if len(c["replaced"]) > 1]
                if mapping["created"]:
                    driver.execute_script("window.onnxoptDiff.choose(arguments[0])", (fused or [0])[0])
                time.sleep(1)
                out.mkdir(parents=True, exist_ok=True)
                path = out / f"{name}-diff.png"
                driver.save_screenshot(str(path))
                state = driver.execute_script("return window.onnxoptDiff")
                print(f"{name}: {len(mapping['created'])} created, {len(mapping['removed'])} removed; "
                      f"marked {len(state['applied']['before'])} before, {len(state['applied']['after'])} after; "
                      f"not drawn by Netron {len(state['missing']['before'])} before, "
                      f"{len(state['missing']['after'])} after -> {path}")
                return path
            finally:
                driver.quit()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--out", default="docs/img")
    args = ap.parse_args()
    for name in args.models:
        shoot(name, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
