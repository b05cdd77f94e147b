"""The 2-conv network of the FedProx/LEAF MNIST and FEMNIST experiments.

conv5×5-32 → max-pool 2 → conv5×5-64 → max-pool 2 → FC-256 + ReLU → FC-C, with 'same' padding as in
the TensorFlow original, so a 28×28 input flattens to 7·7·64.
"""

from __future__ import annotations

import torch
from torch import nn

from fedlight.errors import ConfigError
from fedlight.models.registry import register_model


@register_model("cnn")
class CNN(nn.Module):
    """Two convolutions and one hidden dense layer; the 256-d hidden layer is the feature space.

    Args:
        input_shape: ``(channels, height, width)``; height and width must be divisible by 4.
        num_classes: number of logits.
        hidden: width of the dense layer before the classifier (256 in the papers).
        batch_norm: a BatchNorm after each convolution, before its ReLU (for rules that treat BatchNorm apart,
            such as FedBN); the papers' model has none.
    """

    def __init__(
        self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 256, batch_norm: bool = False
    ) -> None:
        super().__init__()
        if len(input_shape) != 3 or input_shape[1] % 4 or input_shape[2] % 4:
            raise ConfigError(
                f"The 'cnn' model needs (channels, height, width) inputs with sides divisible by 4, "
                f"got input_shape={tuple(input_shape)}. Choose --model.init_args.model=mlp for flat inputs."
            )
        channels, height, width = input_shape
        self.encoder = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=5, padding=2),
            *([nn.BatchNorm2d(32)] if batch_norm else []),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5, padding=2),
            *([nn.BatchNorm2d(64)] if batch_norm else []),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),  # [B, 64 · H/4 · W/4]
            nn.Linear(64 * (height // 4) * (width // 4), hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden, num_classes)
        self.num_features = hidden

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)  # [B, hidden]

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)  # [B, C]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
