"""``onnxopt inspect``: what a model costs, read from the graph: FLOPs, bytes moved, the roofline on a
device of the shipped table (``onnxopt/data/devices.json``) or this CPU measured once.

May import: ``onnxopt.ir``, ``onnxopt.reporting``, ``onnxopt.errors``. Never the command line.
"""
