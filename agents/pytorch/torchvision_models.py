"""torchvision's model definitions next to the CPU build of torch, for exports.

The torchvision wheels on PyPI are CUDA builds: their compiled ops (``_C.so``) link against
``libtorch_cuda.so``, which the CPU torch lacks, so they do not load, and ``import
torchvision`` then fails in ``_meta_registrations`` (``RuntimeError: operator
torchvision::nms does not exist``). The model definitions are plain Python and do not need
them. So torchvision (the release that pins this torch: 0.28.0 for torch 2.13) and pillow
are installed, without dependencies, into a folder of their own that is *not* on the
environment's path (so ``import torchvision`` elsewhere, e.g. ``torch.onnx``'s probe for
it, sees no torchvision), and ``load()`` imports it from there with the two modules that
register fake and autograd kernels for the compiled ops replaced by empty ones. Everything
but the compiled ops works: ``torchvision.models`` builds every classification and
segmentation model (``weights=None``); ``torchvision.ops`` (nms, roi_align, ...) raise when
called, so the detection models do not run.

    .venv/bin/python -m agents.pytorch.torchvision_models --install   # once: pip install --target
    .venv/bin/python -m agents.pytorch.torchvision_models             # check: build the models

In code::

    from agents.pytorch.torchvision_models import load
    models = load().models
    net = models.resnet18(weights=None)

``REMAT_TORCHVISION`` names another folder.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.28.0"  # the torchvision release that pins torch 2.13
FOLDER = Path(
    os.environ.get("REMAT_TORCHVISION", ROOT / ".venv" / "vendor" / f"torchvision-{VERSION}")
)
# The modules that register fake (meta) and autograd kernels for the compiled ops.
SKIPPED = ("torchvision._meta_registrations", "torchvision._autograd_registrations")
CLASSIFIERS = (
    "resnet18",
    "mobilenet_v2",
    "squeezenet1_0",
    "efficientnet_b0",
    "densenet121",
    "shufflenet_v2_x0_5",
    "regnet_y_400mf",
    "vgg11",
    "mobilenet_v3_small",
    "googlenet",
    "inception_v3",
    "convnext_tiny",
    "vit_b_16",
    "swin_t",
    "resnet50",
)
# Segmentation models (``torchvision.models.segmentation``): they return a dict of tensors.
SEGMENTATION = ("deeplabv3_mobilenet_v3_large", "fcn_resnet50")


class Unavailable(ImportError):
    """torchvision is not installed in ``FOLDER`` (run this file with ``--install``)."""


def load() -> types.ModuleType:
    """The ``torchvision`` package from ``FOLDER``, without its compiled ops."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    if not (FOLDER / "torchvision" / "__init__.py").exists():
        raise Unavailable(
            f"torchvision is not in {FOLDER}; run .venv/bin/python -m "
            "agents.pytorch.torchvision_models --install"
        )
    sys.path.insert(0, str(FOLDER))
    for name in SKIPPED:
        sys.modules[name] = types.ModuleType(name)
    import torchvision  # only after the path and the stubs

    return torchvision


def ensure_installed() -> None:
    """``install`` quietly, unless ``FOLDER`` already holds torchvision."""
    if not (FOLDER / "torchvision" / "__init__.py").exists():
        install(quiet=True)


def install(quiet: bool = False) -> None:
    """``pip install --no-deps --target FOLDER`` torchvision and pillow: torch stays as it is."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(FOLDER)]
    command += ["--quiet", "--disable-pip-version-check"] if quiet else []
    subprocess.run([*command, f"torchvision=={VERSION}", "pillow"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help=f"install into {FOLDER}")
    args = parser.parse_args()
    if args.install:
        install()
    torchvision = load()
    print(f"torchvision {torchvision.__version__} from {FOLDER}")
    print(f"compiled ops: {'loaded' if torchvision.extension._has_ops() else 'not loaded'}")
    for name in CLASSIFIERS:
        net = getattr(torchvision.models, name)(weights=None)
        print(f"{name}: {sum(p.numel() for p in net.parameters()):,} parameters")
    for name in SEGMENTATION:
        net = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None)
        print(f"{name}: {sum(p.numel() for p in net.parameters()):,} parameters")


if __name__ == "__main__":
    main()
