"""Model registry: ``create_model(name, input_shape=..., num_classes=..., **kwargs)``.

Every registered model is an ``nn.Module`` with one uniform interface, so generic code (prototypes,
MOON, FedDecorr, feature discrepancy) can split encoder from classifier without knowing the model:

- ``forward_features(x)`` returns the encoder output, the input of the final classifier (``[B, D]``, or
  ``[B, D, h, w]`` for dense models);
- ``forward_head(features)`` returns the logits;
- ``forward(x) == forward_head(forward_features(x))``.
"""

from fedlight.models.celeba_cnn import CelebACNN
from fedlight.models.cnn import CNN
from fedlight.models.daformer import DAFormerNet
from fedlight.models.deeplab import DeepLabV3Plus
from fedlight.models.deeplabv3_mobilenet import DeepLabV3MobileNetV2
from fedlight.models.mini_deeplab import MiniDeepLab
from fedlight.models.mlp import MLP
from fedlight.models.registry import create_model, list_models, register_model
from fedlight.models.resnet import ResNet

__all__ = [
    "CNN",
    "MLP",
    "CelebACNN",
    "DAFormerNet",
    "DeepLabV3MobileNetV2",
    "DeepLabV3Plus",
    "MiniDeepLab",
    "ResNet",
    "create_model",
    "list_models",
    "register_model",
]
