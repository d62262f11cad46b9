"""Stand-in fusions for scripts/data/benefit.py: what a benefit key's fusion makes, measured before the
library's own rule lands (``--rules-file scripts/data/benefit_standin_rules.py``). Not part of the rule library,
never loaded by optimize().

- ``standin_skip_layer_norm`` (key ``skip_layer_normalization``): Add of two 3-D values, then the standard
  LayerNormalization over the last axis -> com.microsoft SkipLayerNormalization (the residual Add + LayerNorm
  of every transformer layer; the zoo's exports emit LayerNormalization-17 themselves).
"""
from onnxopt import Op, Rule


def _cond(m):
    ln = m.root
    axis = ln.attributes.get("axis")
    if axis is not None and axis.value != -1:
        return "axis is not -1"
    a, b = m["a"], m["b"]
    if a.shape is None or b.shape is None or len(a.shape) != 3 or len(b.shape) != 3:
        return "inputs are not 3-D"
    return None


def _fuse(m, b):
    eps = m.root.attributes.get("epsilon")
    return b.op("SkipLayerNormalization", m["a"], m["b"], m["gamma"], m["beta"], domain="com.microsoft",
                epsilon=float(eps.value) if eps is not None else 1e-5)


RULES = [Rule("standin_skip_layer_norm", Op("LayerNormalization", Op("Add", "a", "b"), "gamma", "beta", name="ln"),
              replacement=_fuse, condition=_cond, targets=("ort-cpu", "ort-cuda"), exact=False,
              benefit="skip_layer_normalization",
              doc="Add + LayerNormalization -> SkipLayerNormalization (a stand-in for measuring)")]
