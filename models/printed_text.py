"""Printed text drawn with a 5x7 pixel font (numpy only, deterministic): the pages and text lines
that the OCR models of the zoo are fed (``inputs.ocr_feeds``), so that the detector finds lines,
the recognizer reads the words and the classifiers see upright text."""

from __future__ import annotations

import numpy as np

FONT = {
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
    glyphs = [np.array([[c == "1" for c in row] for row in FONT[ch].split()], np.float32) for ch in text]
    spaced = [np.pad(g, ((0, 0), (0, 1))) for g in glyphs]
    bitmap = np.concatenate(spaced, axis=1)[:, :-1] if spaced else np.zeros((7, 0), np.float32)
    ink = np.kron(bitmap, np.ones((scale, scale), np.float32))
    if scale > 1:  # a little blur: print and scan are not crisp
        p = np.pad(ink, 1, mode="edge")
        ink = (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] + 4 * ink) / 8
    return ink


def to_rgb(ink, rng, noise: float = 0.02):
    """RGB in [0, 1], HWC: dark ink on slightly tinted paper with sensor noise."""
    paper = np.array([0.96, 0.95, 0.92], np.float32) + rng.uniform(-0.03, 0.03, 3).astype(np.float32)
    inkc = np.array([0.08, 0.08, 0.12], np.float32)
    img = paper * (1 - ink[..., None]) + inkc * ink[..., None]
    img = img + rng.normal(0, noise, img.shape).astype(np.float32)
    return np.clip(img, 0, 1).astype(np.float32)


def page_image(h: int, w: int, rng, scale: int = 3):
    """A page: lines of printed text at a ragged left margin, HWC RGB in [0, 1]."""
    ink = np.zeros((h, w), np.float32)
    line_h = 7 * scale
    y = int(rng.integers(line_h, 2 * line_h))
    while y + line_h < h - line_h:
        x = int(rng.integers(2 * scale, 8 * scale))
        text = text_line(rng, int(rng.integers(6, max(7, (w - x) // (6 * scale)))))
        glyphs = render_text(text, scale)[:, : w - x - 2 * scale]
        ink[y:y + glyphs.shape[0], x:x + glyphs.shape[1]] = glyphs
        y += int(line_h * rng.uniform(1.6, 2.4))
    return to_rgb(ink, rng)


def line_image(h: int, max_w: int, rng, scale: int | None = None):
    """One cropped text line as the detector hands it on: height ``h``, width of the text (at most
    ``max_w``), HWC RGB in [0, 1]."""
    scale = scale or max(1, int(h * 0.6) // 7)
    fits = (max_w - scale) // (6 * scale)  # characters of width 5, spaced 1, margins of 1
    text = text_line(rng, int(rng.integers(max(1, fits // 2), fits + 1)))
    glyphs = render_text(text, scale)[:, : max_w - 2 * scale]
    top = (h - glyphs.shape[0]) // 2
    ink = np.zeros((h, min(max_w, glyphs.shape[1] + 2 * scale)), np.float32)
    ink[top:top + glyphs.shape[0], scale:scale + glyphs.shape[1]] = glyphs
    return to_rgb(ink, rng)
