"""torchvision classifiers exported to ONNX with their BatchNormalization nodes kept.

Random weights (no hub here), with BatchNormalization statistics randomized so that folding
changes numbers measurably. Needs the ``export`` extra (torch, torchvision).

    python -m onnxopt.models.torchvision_models resnet50 out.onnx [--exporter legacy|dynamo]
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

IMAGE_SIZE = {"resnet50": 224, "mobilenet_v2": 224, "efficientnet_b0": 224}


def import_torchvision():
    """torchvision's compiled ops link CUDA; its meta registrations are not needed for export."""
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    import torchvision

    return torchvision


def build_module(name: str, seed: int = 0):
    import torch

    torchvision = import_torchvision()
    torch.manual_seed(seed)
    model = getattr(torchvision.models, name)(weights=None)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                c = mod.num_features
                mod.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
                mod.running_var.copy_(torch.rand(c, generator=gen) * 1.5 + 0.5)
                mod.weight.copy_(torch.rand(c, generator=gen) + 0.5)
                mod.bias.copy_(torch.randn(c, generator=gen) * 0.1)
    return model.eval()


def export(name: str, path: str | Path, *, exporter: str = "legacy", batch: int = 1, seed: int = 0,
           opset: int = 17) -> Path:
    """Export torchvision ``name`` to ``path`` keeping BatchNormalization nodes."""
    import torch

    model = build_module(name, seed)
    size = IMAGE_SIZE.get(name, 224)
    example = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if exporter == "legacy":
        torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=opset,
                          do_constant_folding=False, training=torch.onnx.TrainingMode.PRESERVE,
                          input_names=["input"], output_names=["logits"])
    elif exporter == "dynamo":
        program = torch.onnx.export(model, (example,), dynamo=True, optimize=False,
                                    input_names=["input"], output_names=["logits"])
        program.save(str(path))
    else:
        raise ValueError(f"unknown exporter {exporter!r}")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", choices=sorted(IMAGE_SIZE))
    p.add_argument("output")
    p.add_argument("--exporter", choices=["legacy", "dynamo"], default="legacy")
    args = p.parse_args(argv)
    print(export(args.name, args.output, exporter=args.exporter))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
