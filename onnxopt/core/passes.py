"""The contract between the pipeline and the whole-graph passes.

Keys a pass leaves in the driver's options for the rules to read (a rule never imports a pass module):

- :data:`SETTLED`: the transpose pass (``onnxopt.transforms.transposes``) has placed the graph's
  Transposes; the transpose rules stop deferring to it.
"""

SETTLED = "transposes_settled"

__all__ = ["SETTLED"]
