"""The rule language and the machinery that runs it.

``pattern`` (Rule, Op, Const, Var: what a rule matches, when it applies, what it becomes), ``driver``
(the worklist to a fixpoint), ``pipeline`` (the driver and the whole-graph passes in their phases),
``passes`` (the contract a whole-graph pass keeps), ``stats`` (what a run records) and ``purity``
(which nodes may be merged or removed).

May import: ``onnxopt.errors``, ``onnxopt.ir``, ``onnxopt.targets``. Never a rule family, a pass
module (``onnxopt.transforms``), quantize, verify, the API or the command line.
"""
