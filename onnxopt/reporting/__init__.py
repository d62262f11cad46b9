"""Presentation of an optimization's report: terminal text (``text``), the HTML page (``html``), and
the terminal's colour, tables and progress (``console``, the only module that loads rich).

May import: ``onnxopt.verify``, ``onnxopt.transforms``, ``onnxopt.library``, ``onnxopt.core``,
``onnxopt.ir``, ``onnxopt.targets``. Never the API or the command line.
"""
