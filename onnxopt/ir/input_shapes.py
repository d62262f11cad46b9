"""Input-shape overrides: one grammar for every command and for ``optimize(input_shapes=...)``,
and a model's inputs fixed to them.

``NAME=D1,D2,...``: each D a whole number or a symbol name (``x=batch,3,224,224`` keeps the first
dimension's symbol, ``x=n,3,224,224`` renames it); ``NAME=1x3x224x224`` when every D is a number;
``NAME=`` for a scalar. From Python: ``{"x": [1, 3, 224, 224]}`` (numbers, symbol names, or the
same text as on the command line).

:func:`fix` sets the inputs' shapes and gives every other place of a fixed or renamed symbol the
same value (the other inputs, graph outputs, values the model declares, subgraphs), so the model
has one consistent set of values; dimensions of declared shapes that onnx's shape inference then
proves static become numbers. The rules fold what became static.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from numbers import Integral
from typing import Union

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.errors import UsageError
from onnxopt.ir.shapes import PLACEHOLDER_DIMS, infer_model
from onnxopt.ir.util import constant_tensor, graphs

Dim = Union[int, str]
Shapes = dict[str, tuple[Dim, ...]]

FLAG = "--input-shape"
FORM = ("NAME=D1,D2,... with each D a whole number or a symbol name (x=1,3,224,224, x=batch,3,224,224), "
        "or NAME=1x3x224x224")
INT64_MAX = 2**63 - 1
_NUMBER = re.compile(r"[0-9]+")
_X_FORM = re.compile(r"[0-9]+(?:x[0-9]+)+")
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def _dim(text: str) -> Dim:
    """One dimension: a whole number up to 2**63-1, or a symbol name; ValueError with the reason."""
    text = text.strip()
    if _NUMBER.fullmatch(text):
        if int(text) > INT64_MAX:
            raise ValueError(f"{text} is over 2**63-1")
        return int(text)
    if re.fullmatch(r"-[0-9]+", text):
        raise ValueError(f"{text} is negative")
    if not _SYMBOL.fullmatch(text):
        raise ValueError(f"{text!r} is neither a whole number nor a symbol name" if text else "a dimension is empty")
    if text in PLACEHOLDER_DIMS:
        raise ValueError(f"{text!r} names no dimension (exporters write it for any unknown one); give a symbol name")
    return text


def parse_dims(text: str) -> tuple[Dim, ...]:
    """``1x3x224x224``, ``batch,3,224,224`` or ``""`` (a scalar) as dimensions; ValueError with the reason."""
    if not text:
        return ()
    return tuple(_dim(p) for p in text.split("x" if _X_FORM.fullmatch(text) else ","))


def format_dims(dims: Sequence[Dim]) -> str:
    """Dimensions as the grammar writes them: 1x3x224x224 when all are numbers, else batch,3,224,224."""
    return ("x" if all(isinstance(d, int) for d in dims) else ",").join(map(str, dims))


def _add(out: Shapes, name: str, dims: tuple[Dim, ...], flag: str) -> None:
    if name in out and out[name] != dims:
        raise UsageError(f"{flag} {name}: given twice, as {format_dims(out[name]) or 'a scalar'} and "
                         f"{format_dims(dims) or 'a scalar'}")
    out[name] = dims


def parse(items: Iterable[str], *, flag: str = FLAG, numbers: bool = False) -> Shapes:
    """``NAME=DIMS`` entries by name; an input given twice must be given the same shape.
    ``numbers``: every dimension must be a number (running a model needs one)."""
    out: Shapes = {}
    for item in items:
        name, sep, text = item.rpartition("=")
        if not (sep and name):
            raise UsageError(f"{flag} {item!r}: expected {FORM}")
        try:
            dims = parse_dims(text)
        except ValueError as exc:
            raise UsageError(f"{flag} {item!r}: {exc}; expected {FORM}") from None
        _add(out, name, dims, flag)
    if numbers:
        check_numbers(out, flag)
    return out


def normalize(shapes, *, numbers: bool = False) -> Shapes:
    """The API's forms as :func:`parse` gives them: None, ``{"x": [1, "seq"]}`` (numbers, symbol
    names, or text as on the command line: ``{"x": "1x3x224x224"}``), or ``["x=1x3x224x224", ...]``."""
    if not shapes:
        return {}
    if isinstance(shapes, str):
        shapes = [shapes]
    if not isinstance(shapes, Mapping):
        shapes = list(shapes)  # (an iterator is read once: by the check, then by parse)
        if not all(isinstance(s, str) for s in shapes):
            raise UsageError(f"input_shapes: expected a mapping of input names to shapes or a list of {FORM}")
        return parse(shapes, numbers=numbers)
    out: Shapes = {}
    for name, given in shapes.items():
        try:
            if isinstance(given, str):
                dims = parse_dims(given)
            elif isinstance(given, Iterable) and not isinstance(given, (Mapping, bytes)):  # (not its keys)
                dims = tuple(_api_dim(d) for d in given)
            else:
                raise ValueError(f"{given!r} is not a list of dimensions")
        except ValueError as exc:
            raise UsageError(f"input_shapes[{name!r}]: {exc}; expected a list of whole numbers and symbol names "
                             "(e.g. [1, 3, 224, 224] or ['batch', 3, 224, 224])") from None
        _add(out, str(name), dims, "input_shapes")
    if numbers:
        check_numbers(out, "input_shapes")
    return out


def _api_dim(d) -> Dim:
    if isinstance(d, Integral) and not isinstance(d, bool):
        if not 0 <= int(d) <= INT64_MAX:
            raise ValueError(f"{int(d)} is negative" if d < 0 else f"{int(d)} is over 2**63-1")
        return int(d)
    if isinstance(d, str):
        return _dim(d)
    raise ValueError(f"{d!r} is neither a whole number nor a symbol name")


def check_numbers(shapes: Shapes, flag: str = FLAG) -> None:
    """Every dimension is a number: a model is run at these shapes, and a symbol has no value."""
    for name, dims in shapes.items():
        symbol = next((d for d in dims if isinstance(d, str)), None)
        if symbol is not None:
            raise UsageError(f"{flag} {name}={format_dims(dims)}: dimension {dims.index(symbol)} is the symbol "
                             f"{symbol!r}, and running the model needs a number (a symbol keeps or renames a "
                             "dimension when optimizing: onnxopt IN -o OUT --input-shape ...)")


def _symbol(dim) -> str | None:
    """The name of a symbolic dimension that names one value (not a placeholder), else None."""
    if isinstance(dim, ir.SymbolicDim) and dim.value and dim.value not in PLACEHOLDER_DIMS:
        return dim.value
    return None


def _model_dims(shape: ir.Shape | None) -> str:
    return "unknown" if shape is None else format_dims(
        [d if isinstance(d, int) else (d.value or "?") for d in shape]) or "a scalar"


def fix(model: ir.Model, shapes: Mapping[str, Sequence[Dim]], *, flag: str = FLAG, refine: bool = True) -> None:
    """Fix ``model``'s inputs (in place) to ``shapes`` (as :func:`normalize` gives them): each
    given input takes its shape; a symbol given a number or a new name takes it everywhere it
    appears (other inputs, graph outputs, declared values, subgraphs); then dimensions of
    declared shapes that onnx's shape inference proves static become numbers. Refused
    (UsageError, one line): an unknown input, a wrong rank, a static dimension changed or made a
    symbol, one symbol given two values (a number or a name); the messages name ``flag``.
    ``refine=False`` leaves the inference out (a copy about to be inferred anyway: its declared
    symbols take their numbers, and inference proves the rest as it would have)."""
    inputs = {v.name: v for v in model.graph.inputs if not v.is_initializer()}
    for name, dims in shapes.items():
        if name not in inputs:
            raise UsageError(f"{flag} {name}={format_dims(dims)}: the model has no input {name!r} (its inputs: "
                             f"{', '.join(inputs) or 'none'})")
    claims: dict[str, dict[Dim, str]] = {}  # model symbol -> what it is given -> where
    for value in model.graph.inputs:
        if value.name in shapes and not value.is_initializer():
            _claim(value, shapes[value.name], claims, flag)
    for name, dims in shapes.items():  # a name the user gives is a symbol too: it must keep its own value
        for k, d in enumerate(dims):
            if isinstance(d, str) and d in claims:
                claims[d].setdefault(d, f"{name} dimension {k}")
    elsewhere = _declared_symbols(model)
    for name, dims in shapes.items():  # a new name must not be one the model gives another dimension
        for k, (d, was) in enumerate(zip(dims, inputs[name].shape or ())):
            if isinstance(d, str) and d != _symbol(was) and d not in claims and d in elsewhere:
                raise UsageError(f"{flag} {name}={format_dims(dims)}: dimension {k} cannot take the name {d!r}, "
                                 f"which the model gives another dimension ({elsewhere[d]}); choose a new name")
    given = {}
    for symbol, values in claims.items():
        if len(values) > 1:
            (a, at), (b, bt) = list(values.items())[:2]
            raise UsageError(f"{flag}: the symbol {symbol!r} is given two values, {a} ({at}) and {b} ({bt})")
        given[symbol] = next(iter(values))
    changed = {s: v for s, v in given.items() if v != s}
    for graph in graphs(model):
        values = [*graph.inputs, *graph.outputs, *(o for node in graph for o in node.outputs)]
        for value in values:
            if value.name in shapes and inputs.get(value.name) is value:
                value.shape = ir.Shape(shapes[value.name], denotations=_denotations(value, len(shapes[value.name])))
            elif value.shape is not None and changed:
                _substitute(value, changed)
    if refine and any(isinstance(v, int) for dims in shapes.values() for v in dims):
        _refine(model)


def _declared_symbols(model: ir.Model) -> dict[str, str]:
    """Each symbol the model's declared shapes use, and one value that has it."""
    found: dict[str, str] = {}
    for graph in graphs(model):
        for value in [*graph.inputs, *graph.outputs, *(o for node in graph for o in node.outputs)]:
            for k, d in enumerate(value.shape or ()):
                if _symbol(d) is not None:
                    found.setdefault(_symbol(d), f"{value.name} dimension {k}")
    return found


def _claim(value: ir.Value, dims: tuple[Dim, ...], claims: dict[str, dict[Dim, str]], flag: str = FLAG) -> None:
    """Check ``dims`` against input ``value``'s type and shape; record what each symbol is given."""
    what = f"{flag} {value.name}={format_dims(dims)}"
    if value.type is not None and not isinstance(value.type, ir.TensorType):
        raise UsageError(f"{what}: input {value.name!r} is not a tensor ({value.type})")
    shape = value.shape
    if shape is None:
        return
    if len(shape) != len(dims):
        raise UsageError(f"{what}: {len(dims)} dimensions, the model's input has {len(shape)} "
                         f"({_model_dims(shape)})")
    for k, (d, u) in enumerate(zip(shape, dims)):
        if isinstance(d, int) and d >= 0:  # (some exporters write -1 for "unknown")
            if u != d:
                raise UsageError(f"{what}: dimension {k} is {d} in the model, not {u}" if isinstance(u, int) else
                                 f"{what}: dimension {k} is {d} in the model; it cannot become the symbol {u!r}")
            continue
        symbol = _symbol(d)
        if symbol is not None:
            claims.setdefault(symbol, {}).setdefault(u, f"{value.name} dimension {k}")


def _denotations(value: ir.Value, rank: int) -> list[str | None] | None:
    shape = value.shape
    if shape is None or len(shape) != rank:
        return None
    return [shape.get_denotation(k) for k in range(rank)]


def _substitute(value: ir.Value, changed: Mapping[str, Dim]) -> None:
    dims = [changed.get(_symbol(d), d) if _symbol(d) is not None else d for d in value.shape]
    if dims != list(value.shape):
        value.shape = ir.Shape(dims, denotations=_denotations(value, len(dims)))


def _refine(model: ir.Model) -> None:
    """Dimensions of the main graph's declared shapes (graph outputs, values the model records)
    that are not numbers take the numbers onnx's inference now proves (:func:`refine`, not deep:
    the rules fold the rest, and :func:`refine_fixed` writes it after them); nothing is added where
    the model declares no shape. Left as they are when inference fails."""
    refine(model, add=False, deep=False)


def refine(model: ir.Model, *, add: bool = True, deep: bool = True) -> int:
    """Write in ``model``'s main graph the dimensions inference proves: onnx's shape inference
    with data propagation (``onnxopt.ir.shapes.infer_model``, bounded as it is), and onnxruntime's
    symbolic shape inference where onnx's leaves a dimension open (exported shape arithmetic;
    with ``deep``).
    A declared dimension that is a symbol (or unknown), of a graph output or of a value the model
    records (value_info), becomes the number proven; with ``add``, a graph output with no declared
    shape takes the shape (and type) inferred where every dimension is proven. No value_info is
    added where the model declares none; numbers are never changed, symbols never invented.
    Returns how many values changed; 0 where inference fails (the declared shapes stay)."""
    from onnxopt.ir.shapes import light_proto, symbolic_infer

    graph = model.graph
    values = list(dict.fromkeys([*graph.outputs, *(o for node in graph for o in node.outputs)]))
    outputs = set(graph.outputs)
    values = [v for v in values if v.name and ((add and v.shape is None and v in outputs) or
                                               (v.shape is not None and not v.shape.is_static()))]
    if not values:
        return 0
    try:
        proto = infer_model(model)
    except Exception:  # noqa: BLE001 - inference refusing the model: the declared shapes stay as they are
        return 0
    inferred = {vi.name: vi.type for vi in (*proto.graph.value_info, *proto.graph.output)}
    if deep and any(not _proven(inferred.get(v.name)) for v in values):
        try:
            deeper = symbolic_infer(light_proto(model))
        except Exception:  # noqa: BLE001 - a second opinion only
            deeper = None
        if deeper is not None:
            for vi in (*deeper.graph.value_info, *deeper.graph.output):
                if _proven(vi.type) and not _proven(inferred.get(vi.name)):
                    inferred[vi.name] = vi.type
    changed = 0
    for value in values:
        tp = inferred.get(value.name)
        if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
            continue
        found = tp.tensor_type.shape.dim
        if value.shape is None:
            if not _proven(tp) or (value.type is not None and not isinstance(value.type, ir.TensorType)):
                continue
            if value.type is None:
                if not tp.tensor_type.elem_type:
                    continue
                value.type = ir.TensorType(ir.DataType(tp.tensor_type.elem_type))
            elif value.dtype is not None and int(value.dtype) != tp.tensor_type.elem_type:
                continue  # (inference disagrees with the declared type: leave it)
            value.shape = ir.Shape([f.dim_value for f in found])
            changed += 1
            continue
        if len(found) != len(value.shape):
            continue
        dims = [d if isinstance(d, int) or not f.HasField("dim_value") or f.dim_value < 0 else f.dim_value
                for d, f in zip(value.shape, found)]
        if dims != list(value.shape):
            value.shape = ir.Shape(dims, denotations=_denotations(value, len(dims)))
            changed += 1
    return changed


def refine_fixed(model: ir.Model) -> int:
    """:func:`refine` for a model whose every input has a static shape (fixed by ``--input-shape``
    or by the model): after the rewrites, every shape follows from those, so the outputs and the
    values the model records state the dimensions inference proves, as onnxsim and onnxslim write
    them. A model with a symbolic input is left as it is (0)."""
    if any(v.shape is None or not v.shape.is_static() for v in model.graph.inputs if not v.is_initializer()):
        return 0
    return refine(model)


def _proven(tp) -> bool:
    """A tensor type whose every dimension is a number."""
    return (tp is not None and tp.HasField("tensor_type") and tp.tensor_type.HasField("shape")
            and all(d.HasField("dim_value") and d.dim_value >= 0 for d in tp.tensor_type.shape.dim))


def dims_text(shape) -> str:
    """A shape as the messages write it: 1x3x224x224, or "scalar"."""
    return "x".join(map(str, shape)) or "scalar"


def check_shape(vi: onnx.ValueInfoProto, shape: list[int], what: str) -> None:
    """``shape`` has the rank of input ``vi`` and the dimensions it fixes."""
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return
    if len(shape) != len(tt.shape.dim):
        raise UsageError(f"{what}: shape {dims_text(shape)} has rank {len(shape)}, the model's input has rank "
                         f"{len(tt.shape.dim)}")
    for d, v in zip(tt.shape.dim, shape):
        if d.HasField("dim_value") and d.dim_value >= 0 and d.dim_value != v:
            raise UsageError(f"{what}: dimension {v} where the model fixes {d.dim_value}")


DEFAULT_DIM = 16  # a generated input's undeclared dimension (not the first), where the model suggests none


def run_dims(graph_inputs: Sequence[onnx.ValueInfoProto], shapes: Mapping[str, Sequence[int]],
              given: Mapping[str, Sequence[int]], suggested: Mapping[str, Mapping[int, int]] | None = None,
              why: dict | None = None) -> dict[str, list[int]]:
    """The shape each tensor input is run at, for those ``given`` (arrays' shapes, by name) lacks:
    from ``shapes`` (checked against the input), else its declared dimensions, a named symbol
    taking the value it has elsewhere (from ``shapes`` or ``given`` first), else the value the model
    suggests (``suggested``: :func:`suggest`'s, by input and axis), else 1 on the first axis and 16
    on others. An input with no declared shape and none in ``shapes`` is left out. ``why``, when
    given, receives ``{input: {axis: reason}}`` for each dimension onnxopt chose."""
    for name in shapes.keys() & given.keys():
        if list(shapes[name]) != list(given[name]):
            raise UsageError(f"input {name!r}: the inputs file gives shape {dims_text(given[name])}, --input-shape "
                             f"{dims_text(shapes[name])}")
    suggested = suggested or {}
    tensors = [vi for vi in graph_inputs if vi.type.HasField("tensor_type")]
    symbols: dict[str, int] = {}
    for vi in tensors:  # symbols fixed by the shapes the user gave (or the npz arrays)
        dims = vi.type.tensor_type.shape.dim
        fixed = shapes.get(vi.name, given.get(vi.name))
        if fixed is not None and len(fixed) == len(dims):
            for d, v in zip(dims, fixed):
                if d.dim_param and d.dim_param not in PLACEHOLDER_DIMS:
                    symbols.setdefault(d.dim_param, v)
    out = {}
    for vi in tensors:
        if vi.name in given:
            continue
        if vi.name in shapes:
            out[vi.name] = list(shapes[vi.name])
            check_shape(vi, out[vi.name], f"--input-shape {vi.name}")
            continue
        if not vi.type.tensor_type.HasField("shape"):
            continue
        shape = []
        for k, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value >= 0:  # (some exporters write -1 for "unknown")
                shape.append(d.dim_value)
            elif d.dim_param and d.dim_param in symbols:
                shape.append(symbols[d.dim_param])
            else:
                hint = suggested.get(vi.name, {}).get(k)
                v = hint[0] if hint else 1 if k == 0 else DEFAULT_DIM
                if why is not None:
                    why.setdefault(vi.name, {})[k] = hint[1] if hint else "default"
                if d.dim_param and d.dim_param not in PLACEHOLDER_DIMS:
                    symbols[d.dim_param] = v
                shape.append(v)
        out[vi.name] = shape
    return out


# ---------------------------------------------------------------------------------------------
# Shapes the model itself suggests for its undeclared dimensions


_STRIDED = {"Conv", "MaxPool", "AveragePool", "LpPool", "QLinearConv", "ConvInteger"}
_UPSAMPLED = {"ConvTranspose"}
_GLOBAL = {"GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool", "Flatten"}


def _graph_view(model) -> tuple[list, dict, list]:
    """``(nodes, constants, inputs)`` of a main graph (an onnx.ModelProto or an onnx_ir model):
    nodes as ``(op, input names, output names, {attribute: ints})``, constant integer/float
    vectors by name (initializers and Constant nodes, small ones only), inputs as ValueInfoProtos."""
    nodes, consts = [], {}

    def small(arr):
        return arr if arr is not None and arr.ndim <= 1 and arr.size <= 16 else None

    if isinstance(model, onnx.ModelProto):
        g = model.graph
        for t in g.initializer:
            if len(t.dims) <= 1 and (not t.dims or t.dims[0] <= 16) and t.data_location != onnx.TensorProto.EXTERNAL:
                try:
                    consts[t.name] = small(onnx.numpy_helper.to_array(t))
                except Exception:  # noqa: BLE001 - not a constant onnxopt can read: no hint from it
                    pass
        for n in g.node:
            attrs = {a.name: (list(a.ints) if a.ints else a.i if a.type == onnx.AttributeProto.INT else None)
                     for a in n.attribute}
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                try:
                    consts[n.output[0]] = small(onnx.numpy_helper.to_array(n.attribute[0].t))
                except Exception:  # noqa: BLE001
                    pass
            nodes.append((n.op_type, list(n.input), list(n.output), attrs))
        inits = {t.name for t in g.initializer}
        return nodes, consts, [vi for vi in g.input if vi.name not in inits]
    g = model.graph
    for v in g.initializers.values():
        if v.const_value is not None and len(v.const_value.shape) <= 1 and v.const_value.size <= 16:
            try:
                consts[v.name] = small(v.const_value.numpy())
            except Exception:  # noqa: BLE001
                pass
    for n in g:
        attrs = {}
        for name, a in n.attributes.items():
            try:
                attrs[name] = list(a.as_ints()) if a.type == ir.AttributeType.INTS else \
                    a.as_int() if a.type == ir.AttributeType.INT else None
            except Exception:  # noqa: BLE001
                attrs[name] = None
        if n.op_type == "Constant" and n.domain == "" and "value" in n.attributes:
            tensor = constant_tensor(n.outputs[0])
            try:  # (a large one is no hint: its array is not made)
                if tensor is not None and len(tensor.shape) <= 1 and tensor.size <= 16:
                    consts[n.outputs[0].name] = small(tensor.numpy())
            except Exception:  # noqa: BLE001
                pass
        nodes.append((n.op_type, [v.name if v is not None else "" for v in n.inputs], [v.name for v in n.outputs],
                      attrs))
    return nodes, consts, [ir.serde.serialize_value(v) for v in g.inputs if not v.is_initializer()]


def suggest(model) -> dict[str, dict[int, tuple[int, str]]]:
    """Sizes the model itself suggests for its inputs' undeclared dimensions, by input and axis,
    each with the reason the report gives: the shape of a Reshape that reads the input directly
    (a constant with those dimensions), and for image inputs (rank 3 to 5) spatial dimensions that
    are a multiple of the largest downsampling the model applies to them (the product of Conv and
    pooling strides along any path, less ConvTranspose's and Resize's upsampling; a detector whose
    features are added back after upsampling needs it), at least 16. ``model``: an
    onnx.ModelProto or an onnx_ir model. Never raises: a model it cannot read suggests nothing."""
    try:
        return _suggest(*_graph_view(model))
    except Exception:  # noqa: BLE001 - a hint only: the defaults stand
        return {}


def _suggest(nodes, consts, inputs) -> dict[str, dict[int, tuple[int, str]]]:
    out: dict[str, dict[int, tuple[int, str]]] = {}
    open_dims = {}
    for vi in inputs:
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        dims = vi.type.tensor_type.shape.dim
        undeclared = [k for k, d in enumerate(dims) if not (d.HasField("dim_value") and d.dim_value >= 0)]
        if undeclared:
            open_dims[vi.name] = (len(dims), undeclared)
    if not open_dims:
        return out
    # a Reshape of the input itself to a constant shape of its rank with every dimension positive
    for op, ins, _, _ in nodes:
        if op == "Reshape" and len(ins) > 1 and ins[0] in open_dims and consts.get(ins[1]) is not None:
            rank, undeclared = open_dims[ins[0]]
            target = consts[ins[1]]
            if len(target) == rank and all(int(t) > 0 for t in target):
                for k in undeclared:
                    out.setdefault(ins[0], {}).setdefault(k, (int(target[k]), "the Reshape that reads it"))
    # image inputs: the largest downsampling along any path from each input
    for name, (rank, undeclared) in open_dims.items():
        spatial = [k for k in undeclared if k >= 2]
        if not 3 <= rank <= 5 or not spatial:
            continue
        n = rank - 2  # per spatial axis
        stride = {name: (Fraction(1),) * n}
        largest = [Fraction(1)] * n

        def along(values, default=1):
            values = list(values or [])
            return [Fraction(int(v)) for v in values] if len(values) == n else [Fraction(default)] * n

        for op, ins, outs, attrs in nodes:
            got = [stride[i] for i in ins if i in stride]
            if not got or op in _GLOBAL:
                continue
            s = tuple(max(g[a] for g in got) for a in range(n))
            first = stride.get(ins[0]) if ins else None
            if first is not None and op in _STRIDED:
                s = tuple(a * b for a, b in zip(first, along(attrs.get("strides"))))
            elif first is not None and op in _UPSAMPLED:
                s = tuple(a / b for a, b in zip(first, along(attrs.get("strides"))))
            elif first is not None and op in ("Resize", "Upsample"):
                scales = next((consts.get(i) for i in ins[1:][::-1] if consts.get(i) is not None and
                               consts[i].dtype.kind == "f" and len(consts[i]) == rank), None)
                if scales is not None and all(np.isfinite(scales)) and all(float(x) > 0 for x in scales[2:]):
                    s = tuple(a / Fraction(float(x)).limit_denominator(64) for a, x in zip(first, scales[2:]))
            for o in outs:
                stride[o] = s
            largest = [max(a, b) for a, b in zip(largest, s)]
        for k in spatial:
            step = math.ceil(largest[k - 2])
            if step > 1:
                out.setdefault(name, {}).setdefault(
                    k, (step * math.ceil(DEFAULT_DIM / step), f"a multiple of its downsampling there, x{step}"))
    return out


# graph.meta key: the shapes the verification's data runs a model's inputs at ({name: dims}), set
# by optimize where its verifier reads them from --inputs (or feeds), so that the report's figures
# (peak memory, FLOPs) are taken at those shapes, not at generated ones: one set of shapes per report
RUN_SHAPES_KEY = "onnxopt.run_shapes"


def symbolic_run_shapes(model: ir.Model) -> dict[str, list[int]]:
    """``onnxopt.verify.inputs.run_shapes`` for the inputs with a symbolic dimension only ({} where every input is fixed):
    the shapes a dynamic model's figures (peak memory, FLOPs) are taken at, as the verifier runs it: the
    shapes of its data where ``model.graph.meta[RUN_SHAPES_KEY]`` records them (each checked against
    the input's rank and static dimensions), else generated ones."""
    symbolic = {v.name: v for v in model.graph.inputs if any(not isinstance(d, int) for d in (v.shape or ()))}
    if not symbolic:
        return {}
    data = model.graph.meta.get(RUN_SHAPES_KEY) or {}
    data = {k: list(d) for k, d in data.items() if k in symbolic and _fits(symbolic[k].shape, d)}
    inputs = [ir.serde.serialize_value(v) for v in model.graph.inputs if not v.is_initializer()]
    return {k: v for k, v in run_dims(inputs, {}, data, suggest(model)).items() if k in symbolic} | data


def _fits(shape: ir.Shape, dims) -> bool:
    return len(shape) == len(dims) and all(not isinstance(d, int) or d < 0 or d == v for d, v in zip(shape, dims))
