"""Is a decoder's additive attention mask the causal mask of its attention_mask's padding? Checked by running it.

onnxruntime's GroupQueryAttention on CUDA takes no mask: it attends, for batch row b, the keys
``0 .. seqlens_k[b]`` of its own cache, causally (and the last ``local_window_size + 1`` of them where a
sliding window is set). onnxruntime-genai's models feed it ``seqlens_k = ReduceSum(attention_mask) - 1``,
which is the model's own attention exactly when each row's padding is at its end (or there is none) and the
model's mask *is* "causal, minus the padded keys (minus the keys beyond a window)". The first is the
user's promise (``--padding right``); the second is checked here, for the mask value a fused attention
adds to its scores, by evaluating the nodes that compute it (from the graph inputs: the attention mask,
the ids' and the cache's shapes, the positions) with onnxruntime on probe inputs, and comparing every
entry with that pattern:

- batch 2 of several new tokens without a past (where the new length is not fixed), one row padded at its
  end; batch 2 of one new token after a past, one row's past padded at its end; batch 1 of several new
  tokens after a past (where the new length is not fixed);
- the window: one new token after a past of ``LONG - 1`` keys (131,072 keys in all; 2,048 where the
  mask's computation grows faster than linearly with the length), or, without a cache, the last of 4,096
  new tokens (the mask is [S, T] there): the keys it sees are the last W, or all of them (no window
  shorter than that; the number of keys checked is kept in the answer and the rewrite's provenance).

An entry is "seen" when it is exactly 0 and "masked" when it is at most ``-1e9`` (float32; half the lowest
float16/bfloat16 value in those types) or -inf: softmax gives it weight 0 exactly either way. Anything
else (a bias, ALiBi, a mask that reads the ids' values, a mask not causal) is a refusal with the probe
that showed it. The cache's values are never needed: a cache input read only by Shape nodes is replaced
by those shapes. Same model, same answer: the probes are fixed, the evaluation deterministic, and no
timing is involved. The answer is kept in the graph's ``meta`` per mask value (every layer reads one).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.rules._attention_parts import dim_through

LONG = 131072
SHORT_LONG = 2048
PREFILL_LONG = 4096
MAX_NODES = 600
PROBE_KEY = "onnxopt.mask_probe"


_INTS = (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL)


def _shape_read(node: ir.Node) -> bool:
    """A Shape of a value that is not an integer input (a cache, the embeddings): its sizes are all the mask
    reads of it, fed to the probe as they are at the probe's sizes (its computation is not followed)."""
    return node.op_type == "Shape" and bool(node.inputs) and node.inputs[0] is not None \
        and node.inputs[0].dtype not in _INTS


def _subgraph(graph: ir.Graph, value: ir.Value) -> tuple[list[ir.Node], list[ir.Value], list[ir.Value]] | str:
    """(the nodes computing ``value`` in graph order, the graph inputs they read, the initializers they read);
    a Shape of a float value ends the walk there (``_shape_read``)."""
    want, inputs, inits, stack = set(), [], [], [value]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        node = v.producer()
        if node is None:
            if v.is_graph_input():
                inputs.append(v)
            elif v.const_value is not None:
                inits.append(v)
            else:
                return f"the mask reads {v.name!r}, which is neither computed nor an input"
            continue
        if node.graph is not graph:
            return "the mask is computed inside a subgraph"
        if id(node) in want:
            continue
        want.add(id(node))
        if len(want) > MAX_NODES:
            return f"the mask's computation has more than {MAX_NODES} nodes"
        for sub in node.attributes.values():
            if sub.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                return f"the mask's computation has a {node.op_type} with a subgraph"
        if not _shape_read(node):
            stack.extend(i for i in node.inputs if i is not None)
    return [n for n in graph if id(n) in want], inputs, inits


class _Probe:
    """The mask's computation as a model of its own, run with onnxruntime at given sizes."""

    def __init__(self, m, mask: ir.Value, attention_mask: ir.Value, ids: ir.Value | None, past: ir.Value | None):
        self.mask, self.am, self.ids, self.past = mask, attention_mask, ids, past
        self.opsets = m.opsets
        self.reason: str | None = None
        found = _subgraph(m.graph, mask)
        if isinstance(found, str):
            self.reason = found
            return
        nodes, inputs, inits = found
        b, t = attention_mask.shape.dims if attention_mask.shape is not None and len(attention_mask.shape) == 2 \
            else (None, None)
        if b is None:
            self.reason = "the attention mask input is not 2-D"
            return
        s = ids.shape.dims[1] if ids is not None and ids.shape is not None and len(ids.shape) == 2 else t
        p = past.shape.dims[2] if past is not None and past.shape is not None and len(past.shape) == 4 else 0
        self.dims = {"B": b, "S": s, "T": t, "P": p}
        self.fixed_s = s if isinstance(s, int) else None
        # the Shapes of float values (a cache, the embeddings): their outputs become the probe's inputs
        self.shape_feeds: dict[str, tuple[ir.Value, int | None, int | None]] = {}
        keep_nodes, feeds = [], []
        for node in nodes:
            if _shape_read(node):
                src = node.inputs[0]
                if src.shape is None:
                    self.reason = f"the mask reads the shape of {src.name!r}, which is unknown"
                    return
                start, end = node.attributes.get("start"), node.attributes.get("end")
                self.shape_feeds[node.outputs[0].name] = (src, start.value if start else None,
                                                          end.value if end else None)
                continue
            keep_nodes.append(node)
        for v in inputs:
            if v.dtype not in _INTS:
                self.reason = f"the mask reads the values of {v.name!r}"
                return
            if v is not attention_mask and v is not ids and (v.shape is None or len(v.shape) != 2):
                self.reason = f"the mask reads {v.name!r}, not [batch, length]"
                return
            feeds.append(v)
        self.feeds = feeds
        graph_inputs = [onnx.helper.make_tensor_value_info(v.name, int(v.dtype), None) for v in feeds]
        graph_inputs += [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None)
                         for name in self.shape_feeds]
        outs = [mask.name] + [o.name for n in keep_nodes for o in n.outputs if o.name and o.name != mask.name]
        outs = list(dict.fromkeys(outs))
        proto = onnx.helper.make_model(
            onnx.helper.make_graph([ir.serde.serialize_node(n) for n in keep_nodes], "mask_probe", graph_inputs,
                                   [onnx.helper.make_empty_tensor_value_info(o) for o in outs],
                                   [ir.serde.serialize_tensor(v.const_value) for v in inits]),
            opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in m.opsets.items()])
        proto.ir_version = min(proto.ir_version, 10)
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - the probe model is ours; onnxruntime's answer is the reason
            self.reason = f"the mask's computation does not run alone ({str(exc).splitlines()[0][:120]})"
        self.outs = outs

    def run(self, am: np.ndarray, s: int, p: int, intermediates: bool = False):
        b, t = am.shape
        size = {"B": b, "S": s, "T": t, "P": p}

        def dims(v: ir.Value) -> list[int]:
            out = []
            for i, d in enumerate(v.shape.dims):
                if not isinstance(d, int) and not any(_same(d, e) for e in self.dims.values()):
                    d = dim_through(v, i, self.opsets)  # (recorded as onnx's unknown: read through its makers)
                if isinstance(d, int):
                    out.append(d)
                    continue
                got = next((size[k] for k, e in self.dims.items() if _same(d, e)), None)
                if got is None:
                    raise ValueError(f"the mask reads dimension {i} of {v.name!r}, not one the probe sizes")
                out.append(got)
            return out

        feeds = {}
        for v in self.feeds:
            if v is self.am:
                feeds[v.name] = am.astype(v.dtype.numpy())
            elif v is self.ids:
                feeds[v.name] = np.ones(dims(v), v.dtype.numpy())
            else:  # positions: the new tokens' indices after the past
                shape = dims(v)
                feeds[v.name] = np.broadcast_to(p + np.arange(shape[1]), shape).astype(v.dtype.numpy())
        for name, (src, start, end) in self.shape_feeds.items():
            feeds[name] = np.asarray(dims(src)[start:end], np.int64)
        names = self.outs if intermediates else self.outs[:1]
        got = self.session.run(names, feeds)
        return got if intermediates else got[0]


def _same(d, e) -> bool:
    return d == e or (not isinstance(d, int) and not isinstance(e, int) and str(d) == str(e))


def _expected(am: np.ndarray, s: int, p: int, window: int | None) -> np.ndarray:
    b, t = am.shape
    q = p + np.arange(s)[:, None]
    k = np.arange(t)[None, :]
    seen = (k <= q) & (am[:, None, :] != 0)
    if window is not None:
        seen &= (q - k) < window
    return seen[:, None]  # [B, 1, S, T]


def _classify(mask: np.ndarray, dtype: ir.DataType, b: int, s: int, t: int) -> np.ndarray | str:
    if mask.ndim != 4:
        return f"the mask has rank {mask.ndim}, not 4"
    try:
        mask = np.broadcast_to(mask, (b, mask.shape[1], s, t))
    except ValueError:
        return f"the mask's shape {list(mask.shape)} is not [B|1, 1|N, S, T] at B={b}, S={s}, T={t}"
    x = mask.astype(np.float64)
    lowest = -1e9 if dtype == ir.DataType.FLOAT or dtype == ir.DataType.DOUBLE else \
        float(np.finfo(np.float16).min) / 2 if dtype == ir.DataType.FLOAT16 else -1e37
    seen, masked = x == 0, x <= lowest
    if not np.all(seen | masked):
        bad = x[~(seen | masked)]
        return f"the mask holds values that are neither 0 nor masked (e.g. {bad.reshape(-1)[0]:g}), a bias, not a " \
               "causal mask"
    if not np.all(seen == seen[:, :1]):
        return "the mask differs between heads"
    return seen[:, :1]


def read_input(m, mask: ir.Value) -> ir.Value | None:
    """The one 2-D integer graph input whose values the mask's computation reads (not only its shape), other than
    the positions (named so): the attention mask; None where there is not exactly one."""
    found = _subgraph(m.graph, mask)
    if isinstance(found, str):
        return None
    nodes, inputs, _ = found
    read = [v for v in inputs if v.dtype in _INTS and v.shape is not None and len(v.shape) == 2
            and "position" not in v.name and any(i is v for n in nodes if n.op_type != "Shape" for i in n.inputs)]
    return read[0] if len(read) == 1 else None


def causal_padding_window(m, mask: ir.Value, attention_mask: ir.Value, ids: ir.Value | None,
                          past: ir.Value | None, dtype: ir.DataType) -> dict | str:
    """``{"window": W or None}`` when ``mask`` is the causal mask of ``attention_mask``'s padding at the end
    of each row (no key beyond a window of W); else the reason, with the probe that showed it."""
    cache = m.graph.meta.setdefault(PROBE_KEY, {})
    key = (mask.name, attention_mask.name, past is not None)
    if key in cache:
        return cache[key]
    cache[key] = answer = _answer(m, mask, attention_mask, ids, past, dtype)
    return answer


def _answer(m, mask, attention_mask, ids, past, dtype) -> dict | str:
    probe = _Probe(m, mask, attention_mask, ids, past)
    if probe.reason:
        return probe.reason
    cached = past is not None
    cases = []  # (what, am, s, p)
    if probe.fixed_s in (None,) or not cached:
        s = probe.fixed_s or 5
        if not cached:
            cases.append(("batch 2, no past, row 1 padded at its end",
                          np.array([[1] * s, [1] * (s - 2) + [0] * 2]), s, 0))
    if cached:
        cases.append(("batch 2, one new token after 6, row 1's past padded at its end",
                      np.array([[1] * 7, [1, 1, 1, 0, 0, 0, 1]]), 1, 6))
        if probe.fixed_s is None:
            cases.append(("batch 1, 3 new tokens after 4", np.ones((1, 7), np.int64), 3, 4))
        elif probe.fixed_s != 1:
            s = probe.fixed_s
            cases.append((f"batch 1, {s} new tokens after 4", np.ones((1, s + 4), np.int64), s, 4))
    try:
        # the window: one new token after a long past; a prefill: its last row of as many new tokens
        if cached:
            n = LONG if _linear(probe) else SHORT_LONG
            s_long, p_long = 1, n - 1
        else:
            n = probe.fixed_s or PREFILL_LONG
            s_long, p_long = n, 0
        got = _classify(probe.run(np.ones((1, n), np.int64), s_long, p_long), dtype, 1, s_long, n)
        if isinstance(got, str):
            return f"{got} (one row of {n} keys)"
        last = got[0, 0, -1]
        count = int(last.sum())
        window = None
        if count < n:
            if not last[n - count:].all():
                return f"the last query does not see a contiguous run of the last keys (of {n})"
            window = count
        for what, am, s, p in cases:
            got = _classify(probe.run(am, s, p), dtype, am.shape[0], s, am.shape[1])
            if isinstance(got, str):
                return f"{got} ({what})"
            if not np.array_equal(got, _expected(am, s, p, window)):
                return f"the mask is not causal with the attention mask's padding" \
                       f"{f' and a window of {window}' if window else ''} ({what})"
    except Exception as exc:  # noqa: BLE001 - onnxruntime's answer on the probe is the reason
        return f"the mask's computation fails on a probe ({(str(exc).splitlines() or [type(exc).__name__])[0][:120]})"
    return {"window": window, "checked_keys": n}


def _linear(probe: _Probe) -> bool:
    """The mask's computation grows at most linearly with the keys' length at one new token (so a long probe
    is cheap): its largest intermediate at 64 keys is at most 2.5x its largest at 32."""
    sizes = []
    for n in (32, 64):
        outs = probe.run(np.ones((1, n), np.int64), 1, n - 1, intermediates=True)
        sizes.append(max(np.asarray(o).size for o in outs))
    return sizes[1] <= 2.5 * sizes[0]


# onnxruntime's GroupQueryAttention with local_window_size=L attends L keys (the newest included) in
# onnxruntime 1.32's CPU kernel, L + 1 in older ones: asked once per process of the installed build, by one
# tiny op (``window_keys``). ort-cuda's kernel is not here to ask on a machine without a GPU:
# CUDA_WINDOW_EXTRA is what the GPU machine measured (scripts/gpu/decoders.sh, ``window_keys`` there).
CUDA_WINDOW_EXTRA = 0


@functools.lru_cache(maxsize=None)
def window_extra(provider: str = "CPUExecutionProvider") -> int | None:
    """How many keys more than ``local_window_size`` onnxruntime's GroupQueryAttention attends on ``provider``
    (0 or 1), or None where the op does not run."""
    seen = window_keys(2, provider)
    return None if seen is None else seen - 2


def window_keys(lws: int, provider: str, dtype=np.float32) -> int | None:
    """The keys one new token attends after a past of 6 with ``local_window_size=lws``: every value 1 in channel
    0 but the new one's (0), all scores equal, so the output is (seen - 1) / seen."""
    from onnx import TensorProto, helper as h

    import onnxruntime as ort

    tt = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    node = h.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tl"], ["y", "prk", "prv"],
                       domain="com.microsoft", num_heads=1, kv_num_heads=1, local_window_size=lws)
    g = h.make_graph([node], "window", [h.make_tensor_value_info(n, tt, None) for n in ("q", "k", "v", "pk", "pv")]
                     + [h.make_tensor_value_info("sl", TensorProto.INT32, None),
                        h.make_tensor_value_info("tl", TensorProto.INT32, None)],
                     [h.make_tensor_value_info(n, tt, None) for n in ("y", "prk", "prv")])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    past, d = 6, 8
    pv = np.zeros((1, 1, past, d), dtype)
    pv[0, 0, :, 0] = 1
    zeros = np.zeros((1, 1, d), dtype)
    if provider not in ort.get_available_providers():
        return None
    try:
        s = ort.InferenceSession(model.SerializeToString(), providers=[provider])
        y = s.run(["y"], {"q": zeros, "k": zeros, "v": zeros, "pk": np.zeros((1, 1, past, d), dtype), "pv": pv,
                          "sl": np.array([past], np.int32), "tl": np.array(past + 1, np.int32)})[0]
    except Exception:  # noqa: BLE001 - no such kernel here
        return None
    return int(round(1 / (1 - float(y[0, 0, 0]))))
