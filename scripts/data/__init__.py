"""Generators of the tables shipped in the package, each recording in the table the provenance it was
made with (command, date, machine, versions): ``benefit`` writes onnxopt/data/benefit.json,
``quant_costs`` writes onnxopt/quantize/ort_cpu_costs.json. Imports onnxopt and scripts.bench."""
