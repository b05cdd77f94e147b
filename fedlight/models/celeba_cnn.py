"""LEAF's CelebA network (Caldas et al., 2018, ``TalwalkarLab/leaf:models/celeba/cnn.py``)

Four blocks of conv3×3-32 ('same') → BatchNorm → max-pool 2 ('same') → ReLU, then one dense layer to
the logits. TensorFlow's 'same' pooling pads odd sides at the end, which PyTorch's ``ceil_mode``
reproduces: an 84×84 input shrinks to 42, 21, 11 and 6, so the features are 32·6·6 = 1152-d (D5).

LEAF's TensorFlow code runs BatchNorm in training mode even at evaluation; here BatchNorm uses its
running statistics in eval mode, as PyTorch does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedlight.errors import ConfigError
from fedlight.models.registry import register_model

_NUM_BLOCKS, _CHANNELS = 4, 32


@register_model("celeba_cnn")
class CelebACNN(nn.Module):
    """Four conv–BN–pool–ReLU blocks and a linear classifier; the flattened conv output is the feature space.

    Args:
        input_shape: ``(channels, height, width)``; LEAF's is ``(3, 84, 84)``.
        num_classes: number of logits (2 for smiling or not).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(
                f"The 'celeba_cnn' model needs (channels, height, width) inputs, got input_shape={tuple(input_shape)}. "
                "Choose --model.init_args.model=mlp for flat inputs."
            )
        in_channels, height, width = input_shape
        layers: list[nn.Module] = []
        for block in range(_NUM_BLOCKS):
            layers += [
                nn.Conv2d(in_channels if block == 0 else _CHANNELS, _CHANNELS, kernel_size=3, padding=1),
                nn.BatchNorm2d(_CHANNELS),
                nn.MaxPool2d(2, ceil_mode=True),  # TF 'same' pooling: ceil(side / 2)
                nn.ReLU(),
            ]
            height, width = math.ceil(height / 2), math.ceil(width / 2)
        self.encoder = nn.Sequential(*layers, nn.Flatten())  # [B, 32 · H' · W']
        self.num_features = _CHANNELS * height * width  # 32 · 6 · 6 = 1152 at 84×84
        self.head = nn.Linear(self.num_features, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)  # [B, num_features]

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)  # [B, C]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
