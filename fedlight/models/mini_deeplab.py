"""A small DeepLab-shaped segmentation network for offline twins and tests on a CPU.

It keeps the structure LADD's parameter groups are defined on (Shenaj et al., WACV 2023, Table 7): a
``backbone`` of strided convolutions with BatchNorm and a ``classifier`` head of a dilated 3×3 convolution,
BatchNorm and a 1×1 classifier, logits upsampled bilinearly to the input size, as in DeepLab-V3. With a
few ten thousand parameters instead of DeepLab-V3-MobileNet-V2's 12.6 million, a local step on 64×64 images
takes milliseconds, so federated runs of hundreds of small clients fit in minutes.

- ``forward_features(x)``: backbone + the head's 3×3 convolution, BatchNorm and ReLU, ``[B, width, H/8, W/8]``;
- ``forward_head(features, size)``: the 1×1 classifier and the bilinear upsampling, ``[B, Q, H, W]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedlight.errors import ConfigError
from fedlight.models.registry import register_model

OUTPUT_STRIDE = 8


def _conv_bn_relu(cin: int, cout: int, stride: int = 1, dilation: int = 1) -> list[nn.Module]:
    conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=dilation, dilation=dilation, bias=False)
    return [conv, nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


@register_model("mini_deeplab")
class MiniDeepLab(nn.Module):
    """Three stride-2 convolutions as the backbone, a dilated convolution and a 1×1 classifier as the head.

    Args:
        input_shape: ``(3, height, width)``; height and width must be multiples of 8, the output stride.
        num_classes: number of classes Q.
        width: channels of the last backbone stage and of the head (the first stages have ¼ and ½ of it).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> None:
        super().__init__()
        if len(input_shape) != 3 or any(side % OUTPUT_STRIDE for side in input_shape[1:]):
            raise ConfigError(
                f"The 'mini_deeplab' model needs (channels, height, width) inputs with sides divisible by "
                f"{OUTPUT_STRIDE}, got input_shape={tuple(input_shape)}."
            )
        channels = input_shape[0]
        self.backbone = nn.Sequential(
            *_conv_bn_relu(channels, width // 4, stride=2),
            *_conv_bn_relu(width // 4, width // 2, stride=2),
            *_conv_bn_relu(width // 2, width, stride=2),
        )  # [B, width, H/8, W/8]
        self.classifier = nn.Sequential(*_conv_bn_relu(width, width, dilation=2), nn.Conv2d(width, num_classes, 1))
        self.num_features = width

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        features = self.backbone(x)
        for layer in list(self.classifier)[:-1]:
            features = layer(features)
        return features  # [B, width, H/8, W/8]

    def forward_head(self, features: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """Classifies the features and upsamples the logits to ``size`` (default: 8× the feature map)."""
        logits = self.classifier[-1](features)  # [B, Q, h, w]
        if size is None:
            size = (features.shape[-2] * OUTPUT_STRIDE, features.shape[-1] * OUTPUT_STRIDE)
        return F.interpolate(logits, size=tuple(size), mode="bilinear", align_corners=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x), size=x.shape[-2:])
