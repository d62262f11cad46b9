"""What an optimization can run, found and selected: the built-in rule library (``onnxopt.rules``)
and users' rules files (onnxopt's and onnxscript's, ``onnxscript_rules``), chosen by name and
target (``registry``); the table of whole-graph passes (``passes``).

May import: ``onnxopt.core``, ``onnxopt.rules``, ``onnxopt.transforms``, ``onnxopt.targets``,
``onnxopt.ir``. Never quantize, verify, the API or the command line.
"""
