"""Input and output layouts, and raw-image preprocessing, at a model's edges.

Standard ONNX has Conv, pooling and BatchNormalization channels-first only, so a model that is to
take (or return) channels-last tensors gets a Transpose at that edge: the graph input ``x`` becomes
``[N, H, W, C]`` and a Transpose ``[0, 3, 1, 2]`` gives the rest of the model the ``[N, C, H, W]``
it was made for; a graph output ``y`` becomes the Transpose ``[0, 2, 3, 1]`` of what the model
computes. Names stay: the user feeds ``x`` and reads ``y``. (The transpose rules move these
Transposes in and cancel them where they meet; here they are only inserted.)

Layouts (``LAYOUTS``): by rank, channels-first ``NCW``/``NCHW``/``NCDHW`` (the model's own: nothing
changes) and channels-last ``NWC``/``NHWC``/``NDHWC``.

Preprocessing (:class:`Preprocess`): the input becomes raw ``uint8`` pixels, ``HWC`` (one image, no
batch dimension, as OpenCV and PIL decode it), ``NHWC``, ``CHW`` or ``NCHW``; the model computes
``(x * scale - mean) / std`` per channel itself (``mean``/``std`` are in the model's channel order, one
value or one per channel), after reversing the channel order first with ``bgr`` (OpenCV's order).
Inserted after the layout Transpose (which so moves 1 byte per element, not 4): Cast to float,
Gather (the swap), Mul and Add (:func:`apply`). After the rules (:func:`fold`), where every
reader of the normalized input is a Conv (directly or through a zero Pad of the spatial
dimensions) with float32 constant weights and bias and group 1, the swap and normalization go
into those Convs: all of it into weights and bias when nothing pads; with padding only the
per-channel factor and the swap (a zero pad of ``a*z`` is ``a`` times a zero pad of ``z``), and an
Add of ``b/a`` stays before them (a zero pad of the normalized input is not a zero pad of the raw
one). Otherwise Gather, Mul and Add stay as element-wise ops; so they do where a folded constant
(the offset ``b/a``, a weight, a bias) would leave float32's range or become subnormal where it was
not (``not_folded`` says which). Coefficients ``scale/std`` or ``mean/std`` outside float32's range, or
a ``scale/std`` that rounds to 0 there, are a usage error.

Grammar (command line and API text): ``--input-layout x=NHWC`` (or just ``NHWC``: every input of a
matching rank), ``--output-layout y=NHWC``, ``--input-preprocess
x=uint8,HWC,scale=1/255,mean=0.485,0.456,0.406,std=0.229,0.224,0.225,bgr``.

Limits: the Transposes stay where they are inserted (moving and cancelling them is the transpose
rule family's work); only uint8 pixels, for float32 4-D inputs (``bgr`` for 3 channels); ``HWC``
makes the input's batch 1 (the model's other declared shapes keep their symbol); nothing folds
under ``exact`` (the rounding changes) or into grouped Convs; ``input_shapes`` are given in the
model's own layout.

Verification: the edited model records its edges in its metadata (``EDGES_KEY``); the verifier
(:func:`edge_feeds`, :func:`outputs_back`) gives it channels-last arrays, or for raw-image inputs the
pixels given (raw uint8, or derived from the original's float values by inverting the preprocessing,
refused where they are no pixels' preprocessing) or random ones where none are given, and the original the
same data transposed, or preprocessed in numpy as a user would (:func:`reference_input`), and compares
outputs in the original's layout.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from numbers import Real

import numpy as np
import onnx_ir as ir

from onnxopt.errors import UsageError
from onnxopt.ir.util import REPLACED_KEY, RULE_KEY

CHANNELS_FIRST = {3: "NCW", 4: "NCHW", 5: "NCDHW"}
CHANNELS_LAST = {3: "NWC", 4: "NHWC", 5: "NDHWC"}
LAYOUTS = (*CHANNELS_FIRST.values(), *CHANNELS_LAST.values())
PIXEL_LAYOUTS = ("HWC", "NHWC", "CHW", "NCHW")
PIXEL_TYPES = ("uint8",)
ALL = "*"  # a layout given without a name: every input (output) of its rank
PREPROCESS_FORM = ("NAME=uint8,LAYOUT[,scale=S][,mean=M[,M2,...]][,std=S[,S2,...]][,bgr] with LAYOUT one of "
                   f"{'/'.join(PIXEL_LAYOUTS)}, e.g. x=uint8,HWC,scale=1/255,mean=0.485,0.456,0.406,"
                   "std=0.229,0.224,0.225")
LAYOUT_FORM = f"NAME=LAYOUT or LAYOUT with LAYOUT one of {', '.join(LAYOUTS)}"
PROVENANCE = "onnxopt.layout"  # metadata key of the nodes inserted here (and of the Convs folded into)
# model metadata: the edges a model was given (:func:`edges_of`), so that ``verify`` can feed the
# original model what the edited one takes and compare their outputs in one layout
EDGES_KEY = "onnxopt.io_layout"


@dataclasses.dataclass(frozen=True)
class Preprocess:
    """Raw-image input: ``dtype`` pixels in ``layout``; the model computes ``(x*scale - mean)/std``
    per channel (``mean``/``std`` in the model's channel order), after reversing the channels when
    ``bgr``."""

    layout: str = "HWC"
    dtype: str = "uint8"
    scale: float = 1.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    bgr: bool = False

    @property
    def channels_last(self) -> bool:
        return self.layout.endswith("C")

    @property
    def batched(self) -> bool:
        return self.layout.startswith("N")


@dataclasses.dataclass
class Spec:
    """What :func:`apply` does: input and output layouts by name (``ALL`` for every one of the
    layout's rank) and the inputs' preprocessing."""

    inputs: dict[str, str] = dataclasses.field(default_factory=dict)
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)
    preprocess: dict[str, Preprocess] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs or self.preprocess)

    def as_dict(self) -> dict:
        return {**({"input_layout": dict(self.inputs)} if self.inputs else {}),
                **({"output_layout": dict(self.outputs)} if self.outputs else {}),
                **({"input_preprocess": {k: dataclasses.asdict(v) for k, v in self.preprocess.items()}}
                   if self.preprocess else {})}


# --------------------------------------------------------------------------------------------
# Parsing


def _layout(text: str, where: str) -> str:
    layout = text.strip().upper()
    if layout not in LAYOUTS:
        raise UsageError(f"{where}: unknown layout {text.strip()!r}; expected {LAYOUT_FORM}")
    return layout


def parse_layouts(items: Iterable[str] | Mapping | str | None, flag: str = "--input-layout") -> dict[str, str]:
    """``["x=NHWC", ...]`` (or ``"NHWC"`` for every input of rank 4), or the API's mapping
    ``{"x": "NHWC"}``, as ``{name: layout}``; UsageError (one line) otherwise."""
    if not items:
        return {}
    if isinstance(items, str):
        items = [items]
    out: dict[str, str] = {}
    if isinstance(items, Mapping):
        pairs = [(str(k), v, f"{flag} {k}={v}") for k, v in items.items()]
        for name, v, where in pairs:
            if not isinstance(v, str):
                raise UsageError(f"{where}: expected {LAYOUT_FORM}")
    else:
        pairs = []
        for item in items:
            if not isinstance(item, str):
                raise UsageError(f"{flag} {item!r}: expected {LAYOUT_FORM}")
            name, sep, text = item.rpartition("=")
            if sep and not name:
                raise UsageError(f"{flag} {item!r}: the input name is empty; expected {LAYOUT_FORM}")
            pairs.append((name if sep else ALL, text, f"{flag} {item}"))
    for name, text, where in pairs:
        layout = _layout(text, where)
        if name in out and out[name] != layout:
            raise UsageError(f"{flag} {name}: given twice, as {out[name]} and {layout}")
        out[name] = layout
    return out


_FRACTION = re.compile(r"\s*([-+]?[0-9.eE+-]+)\s*/\s*([-+]?[0-9.eE+-]+)\s*")


def _number(text: str, where: str) -> float:
    m = _FRACTION.fullmatch(text)
    try:
        value = float(m.group(1)) / float(m.group(2)) if m else float(text)
    except (ValueError, ZeroDivisionError):
        raise UsageError(f"{where}: {text.strip()!r} is not a number (e.g. 0.5, 1/255)") from None
    if not np.isfinite(value):
        raise UsageError(f"{where}: {text.strip()!r} is not a finite number")
    return value


def _preprocess_fields(fields: Mapping, where: str) -> Preprocess:
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(Preprocess)})
    if unknown:
        raise UsageError(f"{where}: unknown setting(s) {', '.join(unknown)}; expected {PREPROCESS_FORM}")
    dtype = str(fields.get("dtype", "uint8")).lower()
    if dtype not in PIXEL_TYPES:
        raise UsageError(f"{where}: pixel type {dtype!r} is not supported (only {', '.join(PIXEL_TYPES)})")
    layout = str(fields.get("layout", "")).upper()
    if layout not in PIXEL_LAYOUTS:
        raise UsageError(f"{where}: pixel layout {fields.get('layout')!r}: expected one of {', '.join(PIXEL_LAYOUTS)}")

    def number(x, key):
        if isinstance(x, str):
            return _number(x, f"{where} {key}")
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, Real) or not np.isfinite(x):
            raise UsageError(f"{where} {key}: {x!r} is not a finite number (e.g. 0.5, 1/255)")
        return float(x)

    def numbers(key, default):
        v = fields.get(key, default)
        if isinstance(v, Mapping):
            raise UsageError(f"{where} {key}: expected a number or a list of numbers, not a table")
        vals = [v] if isinstance(v, (Real, str)) else list(v)
        out = tuple(number(x, key) for x in vals)
        if not out:
            raise UsageError(f"{where}: {key} has no value")
        return out

    scale = numbers("scale", 1.0)
    if len(scale) != 1:
        raise UsageError(f"{where}: scale is one number (mean and std may be one per channel)")
    mean, std = numbers("mean", 0.0), numbers("std", 1.0)
    if scale[0] == 0 or any(s == 0 for s in std):
        raise UsageError(f"{where}: scale and std must not be 0")
    bgr = fields.get("bgr", False)
    if not isinstance(bgr, bool):  # (bool("false") is True: the channels reversed unasked)
        raise UsageError(f"{where} bgr: expected true or false, got {bgr!r}")
    return Preprocess(layout=layout, dtype=dtype, scale=scale[0], mean=mean, std=std, bgr=bgr)


def _parse_preprocess_text(text: str, where: str) -> Preprocess:
    fields: dict = {}
    key = None  # the list setting (mean, std) bare numbers continue
    for token in (t.strip() for t in text.split(",")):
        if not token:
            raise UsageError(f"{where}: an empty setting; expected {PREPROCESS_FORM}")
        k, sep, v = token.partition("=")
        k = k.strip().lower()
        if sep:
            if k in fields:
                raise UsageError(f"{where}: {k} given twice")
            if k not in ("scale", "mean", "std"):
                raise UsageError(f"{where}: unknown setting {k!r}; expected {PREPROCESS_FORM}")
            fields[k] = [v]
            key = k if k in ("mean", "std") else None
        elif k == "bgr":
            fields["bgr"], key = True, None
        elif k == "rgb":
            fields["bgr"], key = False, None
        elif k in PIXEL_TYPES:
            fields["dtype"], key = k, None
        elif k.upper() in PIXEL_LAYOUTS:
            if "layout" in fields:
                raise UsageError(f"{where}: the pixel layout is given twice")
            fields["layout"], key = k.upper(), None
        elif key is not None:
            fields[key].append(token)
        else:
            raise UsageError(f"{where}: {token!r} is not a setting; expected {PREPROCESS_FORM}")
    if "dtype" not in fields:
        raise UsageError(f"{where}: no pixel type (uint8); expected {PREPROCESS_FORM}")
    if "layout" not in fields:
        raise UsageError(f"{where}: no pixel layout ({'/'.join(PIXEL_LAYOUTS)}); expected {PREPROCESS_FORM}")
    return _preprocess_fields(fields, where)


def parse_preprocess(items, flag: str = "--input-preprocess") -> dict[str, Preprocess]:
    """``["x=uint8,HWC,scale=1/255,..."]``, or the API's ``{"x": "uint8,HWC,..."}`` /
    ``{"x": {"layout": "HWC", "scale": 1/255, "mean": [...], ...}}`` / ``{"x": Preprocess(...)}``,
    as ``{name: Preprocess}``; UsageError (one line) otherwise."""
    if not items:
        return {}
    if isinstance(items, str):
        items = [items]
    out: dict[str, Preprocess] = {}
    if isinstance(items, Mapping):
        for name, given in items.items():
            where = f"{flag} {name}"
            if isinstance(given, Preprocess):
                out[str(name)] = _preprocess_fields(dataclasses.asdict(given), where)
            elif isinstance(given, str):
                out[str(name)] = _parse_preprocess_text(given, where)
            elif isinstance(given, Mapping):
                out[str(name)] = _preprocess_fields(given, where)
            else:
                raise UsageError(f"{where}: expected text ({PREPROCESS_FORM}) or a dict of its settings")
        return out
    for item in items:
        if not isinstance(item, str):
            raise UsageError(f"{flag} {item!r}: expected {PREPROCESS_FORM}")
        name, sep, rest = item.partition("=")
        if not sep or not name.strip() or not rest:
            raise UsageError(f"{flag} {item!r}: expected {PREPROCESS_FORM}")
        if name.strip() in out:
            raise UsageError(f"{flag} {name.strip()}: given twice")
        out[name.strip()] = _parse_preprocess_text(rest, f"{flag} {item}")
    return out


def spec(input_layout=None, output_layout=None, input_preprocess=None) -> Spec:
    """The three settings (text or the API's forms) as one checked :class:`Spec`."""
    s = Spec(parse_layouts(input_layout, "--input-layout"), parse_layouts(output_layout, "--output-layout"),
             parse_preprocess(input_preprocess))
    for name, pre in s.preprocess.items():
        given = s.inputs.get(name, s.inputs.get(ALL))
        if given is not None and len(given) == 4 and given.endswith("C") != pre.channels_last:
            raise UsageError(f"--input-layout {given if name not in s.inputs else f'{name}={given}'} and "
                             f"--input-preprocess {name} (pixels {pre.layout}) "
                             "disagree on where the channels are")
    return s


# --------------------------------------------------------------------------------------------
# Applying


def _perm_to_first(rank: int) -> list[int]:
    """channels-last -> channels-first: [0, r-1, 1, ..., r-2]."""
    return [0, rank - 1, *range(1, rank - 1)]


def _perm_to_last(rank: int) -> list[int]:
    """channels-first -> channels-last: [0, 2, ..., r-1, 1]."""
    return [0, *range(2, rank), 1]


class _Names:
    def __init__(self, graph: ir.Graph):
        self.used = {v.name for v in graph.inputs} | {v.name for v in graph.outputs} | set(graph.initializers)
        self.used |= {o.name for node in graph for o in node.outputs}

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name


def _zero_pad(node: ir.Node, rank: int) -> bool:
    """``node`` is a constant-mode Pad by zeros of the spatial dimensions only (batch and channels
    not padded), with constant pads."""
    from onnxopt.ir.util import constant_tensor

    mode = node.attributes.get("mode")
    if mode is not None and mode.as_string() != "constant":
        return False
    if len(node.inputs) < 2 or len(node.inputs) > 3 and node.inputs[3] is not None:
        return False  # (axes: not taken)
    pads = constant_tensor(node.inputs[1])
    if pads is None or pads.numpy().size != 2 * rank:
        return False
    p = pads.numpy().reshape(2, rank)
    if np.any(p[:, :2] != 0) or np.any(p < 0):
        return False
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        value = constant_tensor(node.inputs[2])
        if value is None or np.any(value.numpy() != 0):
            return False
    return True


def _conv_readers(value: ir.Value, rank: int):
    """``(reason, readers)``: the Convs reading ``value`` (directly, or through a zero Pad of the
    spatial dimensions) as ``(conv, weights, bias, padded)`` when every reader is one with float32
    constant weights (and bias) and group 1; else a reason and None."""
    from onnxopt.ir.util import constant_tensor, use_count

    if value.is_graph_output():
        return "the normalized input is an output of the model", None
    convs = []
    for node, index in value.uses():
        padded = False
        if node.op_type == "Pad" and node.domain in ("", "ai.onnx") and index == 0 and _zero_pad(node, rank) \
                and use_count(node.outputs[0]) == 1 and not node.outputs[0].is_graph_output():
            node, index = node.outputs[0].uses()[0]
            padded = True
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or index != 0:
            return f"the normalized input is read by {node.op_type}, not only by Convs", None
        w = constant_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
        has_b = len(node.inputs) > 2 and node.inputs[2] is not None
        b = constant_tensor(node.inputs[2]) if has_b else None
        if w is None or w.dtype != ir.DataType.FLOAT or (has_b and (b is None or b.dtype != ir.DataType.FLOAT)):
            return "the first Conv's weights or bias are not float32 constants", None
        group = node.attributes.get("group")
        if group is not None and group.as_int() != 1:
            return "the first Conv is grouped", None
        convs.append((node, w, b, padded or not _unpadded(node)))
    if not convs:
        return "nothing reads the normalized input", None
    return None, convs


def _unpadded(node: ir.Node) -> bool:
    auto = node.attributes.get("auto_pad")
    auto = auto.as_string() if auto is not None else "NOTSET"
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        return False
    pads = node.attributes.get("pads")
    return auto == "VALID" or pads is None or not any(pads.as_ints())


def _const(graph: ir.Graph, names: _Names, base: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=names(base), const_value=ir.tensor(array, name=None))
    value.const_value.name = value.name
    value.shape = ir.Shape(array.shape)
    value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
    graph.register_initializer(value)
    return value


def _node(op: str, inputs, out_name: str, nodes: list, *, dtype, shape, **attrs) -> ir.Value:
    node = ir.node(op, inputs, attributes=attrs, name=out_name)
    node.metadata_props[PROVENANCE] = "input/output layout and preprocessing (onnxopt.transforms.edges)"
    node.metadata_props[RULE_KEY] = "layout"
    node.metadata_props[REPLACED_KEY] = "[]"  # inserted: it replaced nothing
    out = node.outputs[0]
    out.name = out_name
    out.type = ir.TensorType(dtype)
    out.shape = ir.Shape(shape)
    nodes.append(node)
    return out


def _channel_vector(values: tuple[float, ...], c: int, what: str, name: str) -> np.ndarray:
    if len(values) == 1:
        return np.full(c, values[0], dtype=np.float64)
    if len(values) != c:
        raise UsageError(f"--input-preprocess {name}: {what} has {len(values)} values but the input has {c} "
                         "channels (give one value or one per channel)")
    return np.asarray(values, dtype=np.float64)


def apply(model: ir.Model, spec: Spec) -> dict:
    """Give ``model`` (in place) the layouts and preprocessing of ``spec``; returns what was done,
    by input and output name (JSON-able; :func:`fold` takes it). The normalization is inserted as
    element-wise ops; :func:`fold` puts it into the first Convs once the rules have made their
    weights and biases constants (a bias the exporter computes, BatchNormalization folded into the
    Conv). UsageError (one line): an
    unknown name, a rank that has no such layout, a channel count that does not fit."""
    if not spec:
        return {}
    graph = model.graph
    opset = model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx", 1)
    names = _Names(graph)
    inputs = {v.name: v for v in graph.inputs if not v.is_initializer()}
    outputs = {v.name: v for v in graph.outputs}
    for flag, given, known in (("--input-layout", spec.inputs, inputs), ("--output-layout", spec.outputs, outputs),
                               ("--input-preprocess", spec.preprocess, inputs)):
        for name in given:
            if name != ALL and name not in known:
                raise UsageError(f"{flag} {name}: the model has no {'output' if 'output' in flag else 'input'} "
                                 f"{name!r} (its {'outputs' if 'output' in flag else 'inputs'}: "
                                 f"{', '.join(known) or 'none'})")
    for flag, table, values in (("--input-layout", spec.inputs, inputs), ("--output-layout", spec.outputs, outputs)):
        rank = len(table.get(ALL, ""))
        if rank and not any(v.shape is not None and len(v.shape) == rank for v in values.values()):
            what = "input" if flag == "--input-layout" else "output"
            ranks = ", ".join(f"{n} rank {len(v.shape) if v.shape is not None else '?'}" for n, v in values.items())
            raise UsageError(f"{flag} {table[ALL]}: the model has no {what} of rank {rank} (its {what}s: {ranks})")
    done: dict = {"inputs": {}, "outputs": {}}

    def layout_for(name, value, table, flag):
        layout = table.get(name)
        rank = len(value.shape) if value.shape is not None else None
        if layout is None and ALL in table:
            layout = table[ALL] if rank == len(table[ALL]) else None
        if layout is None:
            return None
        if rank is None:
            raise UsageError(f"{flag} {name}={layout}: the model does not declare {name}'s rank")
        if rank != len(layout):
            raise UsageError(f"{flag} {name}={layout}: {name} has rank {rank}, {layout} is for rank {len(layout)}")
        return layout

    edits = []
    for name, value in list(inputs.items()):
        pre = spec.preprocess.get(name)
        layout = layout_for(name, value, spec.inputs, "--input-layout")
        if pre is not None:
            if value.shape is None or len(value.shape) != 4:
                raise UsageError(f"--input-preprocess {name}: {name} is not a 4-D image input "
                                 f"(its shape: {value.shape})")
            layout = "NHWC" if pre.channels_last else "NCHW"
        if layout is None or (layout in CHANNELS_FIRST.values() and pre is None):
            continue
        if value.is_graph_output():
            raise UsageError(f"--input-layout {name}: {name} is also an output of the model")
        if pre is not None:
            _check_preprocess(name, value, pre)
        edits.append((name, value, layout, pre))
    out_edits = []
    for name, value in list(outputs.items()):
        layout = layout_for(name, value, spec.outputs, "--output-layout")
        if layout is not None and layout not in CHANNELS_FIRST.values():
            if value.is_graph_input():
                raise UsageError(f"--output-layout {name}: {name} is also an input of the model")
            out_edits.append((name, value, layout))
    earlier = _record(model.metadata_props)
    for side, table in (("input", [e[0] for e in edits]), ("output", [e[0] for e in out_edits])):
        for name in table:
            if name in earlier.get(f"{side}s", {}):
                raise UsageError(f"--{side}-layout {name}: onnxopt already changed this {side}'s layout or "
                                 f"preprocessing (metadata {EDGES_KEY}); give both when optimizing the original")
    for name, value, layout, pre in edits:  # (everything checked first: a refusal leaves the model as it was)
        done["inputs"][name] = _edit_input(graph, names, opset, value, layout, pre)
    for name, value, layout in out_edits:
        done["outputs"][name] = _edit_output(graph, names, value, layout)
    if edits or out_edits:  # (added to what an earlier optimize recorded)
        record = {"inputs": {**earlier.get("inputs", {}),
                             **{name: {"layout": layout, **({"preprocess": dataclasses.asdict(pre)} if pre else {})}
                                for name, _, layout, pre in edits}},
                  "outputs": {**earlier.get("outputs", {}),
                              **{name: {"layout": layout} for name, _, layout in out_edits}}}
        model.metadata_props[EDGES_KEY] = json.dumps(record, sort_keys=True)
    return done


def _check_preprocess(name: str, value: ir.Value, pre: Preprocess) -> None:
    """UsageError (one line) where ``pre`` does not fit the input ``value``."""
    dims = list(value.shape)
    if value.dtype != ir.DataType.FLOAT:
        raise UsageError(f"--input-preprocess {name}: {name} is {value.dtype}, preprocessing makes float32 inputs")
    if not isinstance(dims[1], int):
        raise UsageError(f"--input-preprocess {name}: the channel count (dimension 1) is not static ({dims[1]})")
    if not pre.batched and isinstance(dims[0], int) and dims[0] != 1:
        raise UsageError(f"--input-preprocess {name}: pixels {pre.layout} are one image, but {name} has a batch "
                         f"of {dims[0]} (use N{pre.layout})")
    _coefficients(pre, dims[1], name)


def _edit_input(graph, names, opset, old: ir.Value, layout: str, pre: Preprocess | None) -> dict:
    name, rank = old.name, len(old.shape)
    dims = list(old.shape)
    if pre is not None and not pre.batched:
        dims[0] = 1
    channels_last = layout.endswith("C")
    outer = [dims[0], *dims[2:], dims[1]] if channels_last else list(dims)
    if pre is not None and not pre.batched:
        outer = outer[1:]
    dtype = ir.DataType.UINT8 if pre is not None else old.dtype
    old.name = names(f"{name}_nchw" if channels_last else f"{name}_normalized")
    new = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(outer))
    graph.inputs[graph.inputs.index(old)] = new
    nodes: list[ir.Node] = []
    x = new
    shape = list(outer)
    record = {"layout": layout, "shape": [d if isinstance(d, int) else str(d) for d in outer]}
    if channels_last:  # Transpose first: on uint8 it moves a quarter of the bytes
        if pre is not None and not pre.batched:
            perm = [2, 0, 1]
        else:
            perm = _perm_to_first(rank)
        shape = [shape[p] for p in perm]
        x = _node("Transpose", [x], names(f"{name}_transposed"), nodes, dtype=dtype, shape=shape, perm=perm)
        record["transpose"] = perm
    if pre is not None and not pre.batched:
        shape = [1, *shape]
        if opset >= 13:
            axes = _const(graph, names, f"{name}_axes", np.array([0], dtype=np.int64))
            x = _node("Unsqueeze", [x, axes], names(f"{name}_batched"), nodes, dtype=dtype, shape=shape)
        else:
            x = _node("Unsqueeze", [x], names(f"{name}_batched"), nodes, dtype=dtype, shape=shape, axes=[0])
    if pre is not None:
        x = _node("Cast", [x], names(f"{name}_float"), nodes, dtype=ir.DataType.FLOAT, shape=shape,
                  to=int(ir.DataType.FLOAT))
        x, more = _normalize(graph, names, name, x, nodes, shape, pre)
        record.update(more)
    if nodes:
        old.replace_all_uses_with(x)
        first = next(iter(graph), None)
        if first is None:
            graph.extend(nodes)
        else:
            graph.insert_before(first, nodes)
    return record


def _coefficients(pre: Preprocess, c: int, name: str):
    """``(a, b, swap)``: the model's input is ``x[:, swap] * a + b`` per channel (model order)."""
    std = _channel_vector(pre.std, c, "std", name)
    a = pre.scale / std
    b = -_channel_vector(pre.mean, c, "mean", name) / std
    if pre.bgr and c != 3:
        raise UsageError(f"--input-preprocess {name}: bgr needs 3 channels, the input has {c}")
    swap = np.arange(c)[::-1].copy() if pre.bgr else np.arange(c)  # model channel k reads input channel swap[k]
    with np.errstate(over="ignore", under="ignore"):
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
    if not (np.all(np.isfinite(a32)) and np.all(np.isfinite(b32))):
        raise UsageError(f"--input-preprocess {name}: scale/std or mean/std is out of float32's range "
                         f"({_worst(a, b)}); the model computes in float32")
    if np.any(a32 == 0):
        raise UsageError(f"--input-preprocess {name}: scale/std ({_worst(a)}) rounds to 0 in float32, "
                         "which would erase the pixels; the model computes in float32")
    return a, b, swap


def _worst(*arrays) -> str:
    """The value of largest magnitude, or smallest nonzero one when all are tiny (for a message)."""
    values = np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in arrays])
    big = values[np.argmax(np.abs(values))]
    if abs(big) >= 1:
        return f"{big:.3g}"
    nonzero = values[values != 0]
    return f"{nonzero[np.argmin(np.abs(nonzero))]:.3g}" if nonzero.size else "0"


_TINY = np.finfo(np.float32).tiny  # the smallest normal float32


def _unfoldable(what: str, folded: np.ndarray, before: np.ndarray | None = None) -> str | None:
    """Why float32 constants ``folded`` (computed in float64 from finite values) cannot replace the
    element-wise chain: they overflow float32 (inf, or NaN), or (``before``: the values a factor
    scaled) a weight that was a normal number becomes 0 or a subnormal (its input's share of the
    sum rounds away). None when they can."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        f32 = np.asarray(folded).astype(np.float32)
    if not np.all(np.isfinite(f32)):
        return f"the folded {what} would not be finite in float32"
    if before is not None and np.any((np.abs(f32) < _TINY) & (np.abs(before) >= _TINY)):
        return f"the folded {what} would underflow float32"
    return None


def _elementwise(a, b, swap, bshape):
    """The element-wise chain as ``[(op, constant), ...]``."""
    chain = []
    if np.any(swap != np.arange(len(swap))):
        chain.append(("Gather", swap.astype(np.int64)))
    if np.any(a != 1):
        chain.append(("Mul", a.astype(np.float32).reshape(bshape)))
    if np.any(b != 0):
        chain.append(("Add", b.astype(np.float32).reshape(bshape)))
    return chain


def _normalize(graph, names, name, x, nodes, shape, pre: Preprocess) -> tuple[ir.Value, dict]:
    """Channel swap and ``(x*scale - mean)/std`` as Gather, Mul, Add on the float value ``x`` (the
    model's layout), appended to ``nodes``; returns the value the model's readers are to read,
    and what was done. :func:`fold` puts them into the first Convs after the rules."""
    c = shape[1]
    a, b, swap = _coefficients(pre, c, name)
    record = {"cast": True, "bgr": pre.bgr, "scale": pre.scale, "mean": list(pre.mean), "std": list(pre.std),
              "float": x.name, "folded": None}
    suffix = {"Gather": "rgb", "Mul": "scaled", "Add": "normalized"}
    const = {"Gather": "channel_order", "Mul": "scale", "Add": "shift"}
    for op, array in _elementwise(a, b, swap, [1, c] + [1] * (len(shape) - 2)):
        cv = _const(graph, names, f"{name}_{const[op]}", array)
        x = _node(op, [x, cv], names(f"{name}_{suffix[op]}"), nodes, dtype=ir.DataType.FLOAT, shape=shape,
                  **({"axis": 1} if op == "Gather" else {}))
    return x, record


def fold(model: ir.Model, done: dict) -> None:
    """After the rules: fold each preprocessed input's channel swap and normalization (the chain
    :func:`apply` inserted after the Cast) into the Convs reading it, where they all can take it
    (module docstring). Updates ``done``'s records: ``folded`` says what went where, or
    ``not_folded`` why nothing did."""
    for name, rec in done.get("inputs", {}).items():
        if "float" in rec:
            how, why = _fold_one(model.graph, name, rec)
            rec["folded"] = how
            if why:
                rec["not_folded"] = why


def _fold_one(graph: ir.Graph, name: str, rec: dict):
    from onnxopt.ir.util import constant_tensor, use_count

    start = next((o for node in graph for o in node.outputs if o.name == rec["float"]), None)
    if start is None or start.shape is None or not isinstance(start.shape[1], int):
        return None, "the rules rewrote the Cast"
    rank, c = len(start.shape), start.shape[1]
    pre = Preprocess(layout="NCHW", scale=rec["scale"], mean=tuple(rec["mean"]), std=tuple(rec["std"]), bgr=rec["bgr"])
    a, b, swap = _coefficients(pre, c, name)
    bshape = [1, c] + [1] * (rank - 2)
    want = _elementwise(a, b, swap, bshape)
    chain, v = [], start
    for op, array in want:
        uses = v.uses()
        if len(uses) != 1 or v.is_graph_output():
            break
        node, index = uses[0]
        const = constant_tensor(node.inputs[1]) if len(node.inputs) == 2 else None
        if node.op_type != op or index != 0 or PROVENANCE not in node.metadata_props or const is None \
                or not np.array_equal(const.numpy(), array):
            break
        chain.append(node)
        v = node.outputs[0]
    if len(chain) != len(want):
        return None, "the rules rewrote the normalization"
    if not chain:
        return "nothing to fold", None
    why, convs = _conv_readers(v, rank)
    if convs is None:
        return None, why
    names = _Names(graph)
    inv = np.argsort(swap)  # in the input's channel order: input channel j feeds model channel inv[j]
    a_in, b_in = a[inv], b[inv]
    padded = any(p for *_, p in convs)
    offset = b_in / a_in if padded and np.any(b_in != 0) else None  # x*a + b = a*(x + b/a)
    folded = []  # every folded constant is checked before the graph changes: a refusal keeps the chain
    for node, w, bias, _ in convs:
        wa = w.numpy().astype(np.float64)
        w_in = wa[:, swap]  # weights per input channel (the swap moves into them)
        scale = [1, c] + [1] * (wa.ndim - 2)
        new_w = w_in * a_in.reshape(scale)
        new_b = None if bias is None else bias.numpy().astype(np.float64)
        if not padded and np.any(b_in != 0):
            shift = (w_in * b_in.reshape(scale)).sum(axis=tuple(range(1, wa.ndim)))
            new_b = shift if new_b is None else new_b + shift
        folded.append((node, new_w, new_b))
        why = ((offset is not None and _unfoldable("offset mean/scale", offset))
               or _unfoldable("weights", new_w, w_in) or (new_b is not None and _unfoldable("bias", new_b)))
        if why:
            return None, why
    x, new = start, []
    if offset is not None:  # the Add stays, a goes into the weights
        off = _const(graph, names, f"{name}_offset", offset.astype(np.float32).reshape(bshape))
        x = _node("Add", [x, off], names(f"{name}_offset"), new, dtype=ir.DataType.FLOAT, shape=list(start.shape))
    old_consts = []
    for node, new_w, new_b in folded:
        old_consts.append(node.inputs[1])
        node.replace_input_with(1, _const(graph, names, f"{node.name or 'conv'}_W_preprocessed",
                                          new_w.astype(np.float32)))
        if new_b is not None:
            if len(node.inputs) > 2 and node.inputs[2] is not None:
                old_consts.append(node.inputs[2])
            else:
                node.resize_inputs(3)
            node.replace_input_with(2, _const(graph, names, f"{node.name or 'conv'}_B_preprocessed",
                                              new_b.astype(np.float32)))
        node.metadata_props[PROVENANCE] = "input preprocessing folded into the weights"
        if RULE_KEY not in node.metadata_props:  # (a node a rule made keeps its own record)
            node.metadata_props[RULE_KEY] = "layout"
            node.metadata_props[REPLACED_KEY] = json.dumps([node.name])
    v.replace_all_uses_with(x)
    if new:
        graph.insert_after(start.producer(), new)
    for node in reversed(chain):
        old_consts.append(node.inputs[1])
        graph.remove(node, safe=True)
    for value in old_consts:  # the replaced weights and the chain's constants, where nothing else reads them
        if value is not None and use_count(value) == 0 and value.is_initializer() and not value.is_graph_input() \
                and graph.initializers.get(value.name) is value:
            del graph.initializers[value.name]
        elif value is not None and use_count(value) == 0 and value.producer() is not None \
                and value.producer().op_type == "Constant" and all(use_count(o) == 0 for o in value.producer().outputs):
            graph.remove(value.producer(), safe=True)
    return ("weights and bias" if not padded else
            "weights (an Add of the offset stays before the padding)" if np.any(b_in != 0) else "weights"), None


def _edit_output(graph, names, old: ir.Value, layout: str) -> dict:
    name, rank = old.name, len(old.shape) if old.shape is not None else len(layout)
    perm = _perm_to_last(rank)
    old.name = names(f"{name}_nchw")
    shape = None if old.shape is None else [old.shape[p] for p in perm]
    node = ir.node("Transpose", [old], attributes={"perm": perm}, name=names(f"{name}_to_{layout.lower()}"))
    node.metadata_props[PROVENANCE] = "output layout (onnxopt.transforms.edges)"
    node.metadata_props[RULE_KEY] = "layout"
    node.metadata_props[REPLACED_KEY] = "[]"  # inserted: it replaced nothing
    out = node.outputs[0]
    out.name = name
    out.type = old.type
    if shape is not None:
        out.shape = ir.Shape(shape)
    graph.append(node)
    graph.outputs[graph.outputs.index(old)] = out
    return {"layout": layout, "transpose": perm}


def input_feed(array: np.ndarray, layout: str | None = None) -> np.ndarray:
    """What the model with input ``layout`` takes for ``array``, an input of the original model
    (channels-first): the array transposed to channels-last when ``layout`` is. (For raw images
    the other way round: :func:`reference_input`.)"""
    rank = array.ndim
    if layout is not None and layout.endswith("C"):
        return np.ascontiguousarray(np.transpose(array, _perm_to_last(rank)))
    return array


def summary(done: dict) -> list[str]:
    """One line per changed input and output, for the terminal report."""
    lines = []
    for name, rec in done.get("inputs", {}).items():
        if "cast" in rec:
            pix = "x".join(map(str, rec["shape"]))
            how = rec.get("folded") or f"left element-wise ({rec.get('not_folded', 'nothing to fold')})"
            lines.append(f"input {name}: uint8 {pix}{' BGR' if rec['bgr'] else ''} "
                         f"{'-> Transpose ' if 'transpose' in rec else ''}-> Cast; normalization: {how}")
        else:
            lines.append(f"input {name}: {rec['layout']} {'x'.join(map(str, rec['shape']))}, a Transpose to the "
                         "model's layout")
    for name, rec in done.get("outputs", {}).items():
        lines.append(f"output {name}: {rec['layout']}, a Transpose from the model's layout")
    return lines


def reference_input(pixels: np.ndarray, pre: Preprocess) -> np.ndarray:
    """The original model's NCHW float32 input for raw ``pixels`` in ``pre``'s layout, computed in
    numpy as a user would: channel swap, ``(x*scale - mean)/std``, transpose, batch dimension."""
    x = pixels.astype(np.float32)
    if not pre.batched:
        x = x[None]
    if pre.channels_last:
        x = np.transpose(x, (0, 3, 1, 2))
    c = x.shape[1]
    if pre.bgr:
        x = x[:, ::-1]
    mean = _channel_vector(pre.mean, c, "mean", "x").astype(np.float32).reshape(1, c, 1, 1)
    std = _channel_vector(pre.std, c, "std", "x").astype(np.float32).reshape(1, c, 1, 1)
    return np.ascontiguousarray((x * np.float32(pre.scale) - mean) / std, dtype=np.float32)


# --------------------------------------------------------------------------------------------
# The verifier's side: the original and the edited model compared on the same data


def _preprocess(fields: Mapping) -> Preprocess:
    return Preprocess(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def _record(metadata: Mapping[str, str] | None) -> dict:
    """The JSON record :func:`apply` wrote in a model's metadata (``EDGES_KEY``; ``{}`` without
    one), checked; UsageError (one line) where it is not what onnxopt writes."""
    text = (metadata or {}).get(EDGES_KEY)
    if not text:
        return {}
    try:
        record = json.loads(text)
        for rec in record.get("inputs", {}).values():
            if "preprocess" in rec:
                _preprocess(rec["preprocess"])
        return record
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise UsageError(f"the model's metadata {EDGES_KEY} is not what onnxopt writes: {exc}") from None


def edges_of(metadata: Mapping[str, str] | None) -> dict | None:
    """The edges :func:`apply` recorded in a model's metadata (``EDGES_KEY``), or None."""
    record = _record(metadata)
    for rec in record.get("inputs", {}).values():
        if "preprocess" in rec:
            rec["preprocess"] = _preprocess(rec["preprocess"])
    return record or None


def edges_between(before: Mapping[str, str] | None, after: Mapping[str, str] | None) -> dict | None:
    """The edges ``after``'s model has beyond ``before``'s (both models' metadata): what the
    verifier must translate to compare them; None when there is nothing."""
    b, a = edges_of(before) or {}, edges_of(after) or {}
    diff = {side: {k: v for k, v in a.get(side, {}).items() if b.get(side, {}).get(k) != v}
            for side in ("inputs", "outputs")}
    return diff if diff["inputs"] or diff["outputs"] else None


def pixel_inputs(edges: dict | None) -> dict[str, Preprocess]:
    """The raw-image inputs of ``edges`` (:func:`edges_between`) and their preprocessing, by name."""
    return {name: rec["preprocess"] for name, rec in ((edges or {}).get("inputs") or {}).items()
            if rec.get("preprocess") is not None}


def pixel_shape(shape, pre: Preprocess) -> list[int]:
    """The raw pixels' shape for the original's channels-first input ``shape`` ([N, C, H, W])."""
    shape = list(shape)
    if pre.channels_last:
        shape = [shape[0], *shape[2:], shape[1]]
    return shape if pre.batched else shape[1:]


def model_shape(pixels_shape, pre: Preprocess) -> list[int]:
    """The original's channels-first input shape for raw pixels of ``pixels_shape`` (:func:`pixel_shape`'s inverse)."""
    shape = list(pixels_shape)
    if not pre.batched:
        shape = [1, *shape]
    return [shape[0], shape[-1], *shape[1:-1]] if pre.channels_last else shape


def edge_shape(rec: Mapping, shape) -> list[int]:
    """The shape the edited model's input takes for the original's input ``shape``; ``rec``: its
    record in :func:`edges_of` (a channels-last layout, or raw pixels)."""
    pre = rec.get("preprocess")
    if pre is not None:
        return pixel_shape(shape, pre)
    shape = list(shape)
    return [shape[i] for i in _perm_to_last(len(shape))] if str(rec.get("layout", "")).endswith("C") else shape


PIXEL_TOLERANCE = 1e-2  # pixel units: how far a given float value's inverse may be from a whole pixel


def pixels_from(x: np.ndarray, pre: Preprocess, name: str, where: str) -> np.ndarray:
    """The uint8 pixels whose :func:`reference_input` is ``x`` (the original's float input), the
    preprocessing inverted: ``x*std + mean`` divided by ``scale``, the channel swap undone, in the
    pixel layout. Refused (UsageError, one line) where ``x`` is not the preprocessing of whole
    pixels 0..255 (random floats are not): the optimized model, which takes raw pixels, cannot be
    given the same data then."""
    x = np.asarray(x)
    if x.ndim != 4 or (not pre.batched and x.shape[0] != 1):
        raise UsageError(f"input {name} {where}: the optimized model takes one {pre.layout} image per run; the "
                         f"original's input has shape {'x'.join(map(str, x.shape))}")
    c = x.shape[1]
    mean = _channel_vector(pre.mean, c, "mean", name).reshape(1, c, 1, 1)
    std = _channel_vector(pre.std, c, "std", name).reshape(1, c, 1, 1)
    with np.errstate(all="ignore"):
        y = (x.astype(np.float64) * std + mean) / pre.scale
    if pre.bgr:
        y = y[:, ::-1]
    r = np.rint(y)
    bad = ~(np.isfinite(y) & (np.abs(y - r) <= PIXEL_TOLERANCE) & (r >= 0) & (r <= 255))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise UsageError(
            f"input {name} {where}: the float values are not uint8 pixels preprocessed (scale {pre.scale:g}, "
            f"mean {list(pre.mean)}, std {list(pre.std)}{', bgr' if pre.bgr else ''}): {int(bad.sum())} of {bad.size} "
            f"are not (at {list(at)} the value {float(x[at]):g} is pixel {float(y[at]):g}), so the optimized model, "
            f"which takes raw uint8 {pre.layout} pixels, cannot run the same data; give the raw pixels instead "
            f"(uint8, shape {'x'.join(map(str, pixel_shape(x.shape, pre)))}, under the name {name})")
    pixels = r.astype(np.uint8)
    if pre.channels_last:
        pixels = np.transpose(pixels, (0, 2, 3, 1))
    return np.ascontiguousarray(pixels if pre.batched else pixels[0])


def edge_feeds(edges: dict, feeds: Mapping[str, np.ndarray], seed: int = 0,
               how: dict | None = None) -> tuple[dict, dict]:
    """``(original's feeds, edited model's feeds)`` from ``feeds`` made for the original: a
    channels-last input gets the array transposed. A raw-image input uses the data given: raw uint8
    pixels in ``feeds`` (in the pixel layout) go to the edited model and their
    :func:`reference_input` (what a user's numpy preprocessing computes) to the original; float
    values given for the original go to it as they are and the edited model gets the pixels they
    are the preprocessing of (:func:`pixels_from`; refused where there are none). Only an input
    ``how`` records as generated (``how[name]["source"] == "generated"``; all when ``how`` is None)
    gets seeded random pixels (0..255, shaped as the original's array in the pixel layout) instead.
    ``how`` (:func:`onnxopt.verify.inputs.make_inputs`'s record) is updated to say what each model got."""
    before, after = dict(feeds), dict(feeds)
    rng = np.random.default_rng(seed + 7919)
    for name, rec in edges.get("inputs", {}).items():
        if name not in feeds:
            continue
        x = np.asarray(feeds[name])
        pre = rec.get("preprocess")
        if pre is None:
            after[name] = input_feed(x, rec["layout"])
            continue
        info = (how or {}).get(name) or {}
        source = info.get("source", "generated")
        px = f"uint8 {pre.layout} pixels{' (BGR)' if pre.bgr else ''}"
        if x.dtype == np.uint8:  # raw pixels given (the edited model's own input)
            pixels, given = x, None
            note = f"the optimized model takes raw {px} as given; the original them preprocessed in numpy"
        elif source != "generated":  # the original's float input given: the pixels it is made of
            pixels, given = pixels_from(x, pre, name, f"in {info['file']}" if info.get("file") else f"({source})"), x
            note = (f"the original takes the values as given; the optimized model the {px} they are the "
                    f"preprocessing of (exact inverse)")
        else:
            if not pre.batched and x.shape[0] != 1:
                raise UsageError(f"input {name}: takes one {pre.layout} image; the original's input has a batch "
                                 f"of {x.shape[0]}")
            pixels, given = rng.integers(0, 256, size=pixel_shape(x.shape, pre), dtype=np.uint8), None
            note = f"the optimized model takes random {px} (seed {seed}); the original them preprocessed in numpy"
            if how is not None and name in how:
                how[name] = {**info, "shape": list(pixels.shape), "dtype": "uint8", "distribution": "uniform 0..255"}
        after[name] = pixels
        before[name] = reference_input(pixels, pre) if given is None else given
        if how is not None and name in how:
            how[name]["pixels"] = note
    return before, after


def outputs_back(edges: dict, outputs: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """The edited model's outputs ``[(name, array), ...]`` in the original's layouts (a
    channels-last output transposed back to channels-first)."""
    changed = edges.get("outputs", {})
    back = []
    for name, value in outputs:
        rec = changed.get(name)
        if rec is not None and isinstance(value, np.ndarray) and rec["layout"].endswith("C") and value.ndim > 2:
            value = np.ascontiguousarray(np.transpose(value, _perm_to_first(value.ndim)))
        back.append((name, value))
    return back


def describe_edges(edges: dict, how: Mapping | None = None) -> list[str]:
    """What the verifier did at the edges, one line per input/output, for its report (``how``: the
    inputs' record, as :func:`edge_feeds` updated it)."""
    lines = []
    for name, rec in edges.get("inputs", {}).items():
        pre = rec.get("preprocess")
        if pre is None:
            lines.append(f"input {name}: the optimized model takes it {rec['layout']}; the original the same "
                         "values transposed")
        else:
            note = (how or {}).get(name, {}).get("pixels") or (
                f"the optimized model takes uint8 {pre.layout} pixels{' (BGR)' if pre.bgr else ''}; the original "
                f"them preprocessed in numpy")
            lines.append(f"input {name}: {note} (scale {pre.scale:g}, mean {list(pre.mean)}, std {list(pre.std)})")
    for name, rec in edges.get("outputs", {}).items():
        lines.append(f"output {name}: the optimized model returns it {rec['layout']}; compared transposed back")
    return lines
