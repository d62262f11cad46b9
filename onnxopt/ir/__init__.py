"""The model itself: loading and saving (external data, atomic writes), shapes and their bounded
inference, input shapes, constant evaluation on onnxruntime's CPU kernels, element types, the
kernels onnxruntime registers, and the small graph helpers every other layer uses (``util``).

May import: ``onnxopt.errors``, ``onnxopt.readers``, onnx, onnx_ir, numpy, onnxruntime. Nothing else
of onnxopt.
"""
