"""Generators of the tables shipped in the package, each recording in the table the provenance it was
made with (command, date, machine, versions): ``benefit`` writes onnxopt/data/benefit.json,
``quant_costs`` writes onnxopt/quantize/ort_cpu_costs.json (``decoder_benefit_models`` exports the decoders
and inputs a decoder fusion's benefit is timed on). Imports onnxopt, onnxopt.models and scripts.bench."""
