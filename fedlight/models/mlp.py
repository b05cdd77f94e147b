"""The multilayer perceptron of the prototype-margin paper's Synthetic experiments (60→128→256→C)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import nn

from fedlight.models.registry import register_model


@register_model("mlp")
class MLP(nn.Module):
    """Fully connected ReLU network; the last hidden layer is the feature space.

    Args:
        input_shape: shape of one sample; it is flattened.
        num_classes: number of logits.
        hidden: widths of the hidden layers. The paper's Synthetic model is ``(128, 256)``.
        batch_norm: a BatchNorm after every hidden linear layer, before its ReLU (for rules that treat
            BatchNorm apart, such as FedBN); the paper's model has none.
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        hidden: Sequence[int] = (128, 256),
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        widths = [math.prod(input_shape), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for width_in, width_out in pairwise(widths):
            norm = [nn.BatchNorm1d(width_out)] if batch_norm else []
            layers += [nn.Linear(width_in, width_out), *norm, nn.ReLU()]
        self.encoder = nn.Sequential(*layers)
        self.head = nn.Linear(widths[-1], num_classes)
        self.num_features = widths[-1]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)  # [B, hidden[-1]]

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)  # [B, C]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
