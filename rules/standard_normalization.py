"""RMS normalization as the standard ``RMSNormalization`` (opset 23), for target ``portable``.

``x / sqrt(mean(x^2) + eps) [* weight]`` over the last axis: the pattern and the plan are
rules/normalization.py's ``rms_normalization`` (``RMS_NORMALIZATION``, tried at the Sqrt, and its
condition's reading of the mean's axes, the epsilon and the weight), so both targets match the same
forms and refuse them for the same reasons. What differs is the output: onnxruntime's targets fold the
residual Add before it into com.microsoft SkipSimplifiedLayerNormalization; ``portable`` writes only
the standard op, so the Add stays. Written only where the model imports opset >= 23 and the installed
onnxruntime has the kernel (rules/_standard_parts.py), else refused with the reason.

Not exact (``exact=False``): the kernel accumulates in its own order (fp32 outputs agree within 1e-5).
"""

from __future__ import annotations

from onnxopt.core.pattern import Match, Rule
from onnxopt.targets import PORTABLE

from onnxopt.rules._semantic import typed
from onnxopt.rules._standard_parts import standard_refusal
from onnxopt.rules.normalization import RMS_NORMALIZATION, norm_plan


def _condition(m: Match):
    plan = norm_plan(m, layer=False)
    if isinstance(plan, str):
        return plan
    x, eps, gamma, _, dtype = plan
    if reason := standard_refusal("RMSNormalization", m.opset(""), dtype):
        return reason
    return x, eps, gamma


def _replace(m: Match, b):
    x, eps, gamma = m.plan
    return typed(b.op("RMSNormalization", x, b.const(gamma, name="rms_scale"), axis=-1, epsilon=float(eps)), x, m)


RULES = [
    Rule("standard_rms_normalization", RMS_NORMALIZATION, _replace, condition=_condition, targets=(PORTABLE,),
         benefit="rms_normalization", exact=False,
         doc="x / sqrt(mean(x^2) + eps) [* weight] over the last axis becomes the standard RMSNormalization "
             "(portable; the model at opset >= 23 and the installed onnxruntime with its kernel)."),
]
