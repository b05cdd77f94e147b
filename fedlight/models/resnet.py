"""ResNet-18 and ResNet-50 from timm, as the FedSLS paper uses them (CIFAR-10/100 and CINIC-10: ResNet-18;
TinyImageNet: ResNet-50; all starting from PyTorch's ImageNet weights).

The timm network is the encoder: ``forward_features`` returns its globally average-pooled features
``[B, 512]`` (ResNet-18) or ``[B, 2048]`` (ResNet-50), and ``forward_head`` is a linear classifier. With
``projection_dim`` set, the model is MOON's (``QinbinLi/MOON:model.py:ModelFedCon``): pooled features h →
Linear(d, d) → ReLU → Linear(d, projection_dim) = z → Linear(projection_dim, C), and ``forward_features``
returns z, the representation MOON contrasts and the classifier reads.

Inputs: uint8 images (how the CIFAR-style loaders keep them, 4× smaller than float32) are scaled to [0, 1]
and standardised with ``mean``/``std`` (ImageNet's by default, which the pretrained weights expect);
floating-point inputs are taken as already standardised.

Pretrained weights are PyTorch's (timm's ``resnet18.tv_in1k``/``resnet50.tv_in1k``), fetched through the
Hugging Face Hub's cache (:mod:`fedlight.models.hub`) or read from ``pretrained_file`` (a timm or torchvision
checkpoint) where there is no network. They are read by :meth:`ResNet.load_pretrained`, which the client calls once
before the first round, not when the network is built: a resumed run, whose checkpoint holds them, never needs them,
and a run that cannot get them is refused at set-up together with any other missing input.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from fedlight.errors import ConfigError
from fedlight.models.hub import read_weights_file, timm_state_dict
from fedlight.models.registry import register_model

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_PRETRAINED_TAGS = {"resnet18": "resnet18.tv_in1k", "resnet50": "resnet50.tv_in1k"}


class ResNet(nn.Module):
    """A timm ResNet with fedlight's ``forward_features`` / ``forward_head`` split.

    Args:
        arch: ``resnet18`` or ``resnet50``.
        input_shape: ``(channels, height, width)`` of one image.
        num_classes: number of logits.
        pretrained: start from PyTorch's ImageNet weights (the paper's setting), loaded once before the first
            round; the classifier (and a CIFAR stem) is new.
        pretrained_file: a local checkpoint of those weights (timm's or torchvision's ``.pth``/``.safetensors``),
            for machines without network.
        projection_dim: MOON's projection head of this output size (256 in MOON); ``null``: no head.
        cifar_stem: replace the 7×7 stride-2 stem and its max-pool by a 3×3 stride-1 stem, the usual choice
            for training 32×32 images from scratch (the paper keeps the ImageNet stem to load its weights).
        channels: widths of the four stages (default (64, 128, 256, 512)); smaller ones give tiny test models.
        layers: blocks per stage (default (2, 2, 2, 2) for ResNet-18, (3, 4, 6, 3) for ResNet-50).
        stem_width: output channels of the stem convolution (64); with narrow ``channels`` a narrow stem
            keeps the tiny models cheap (the 64-wide stem would cost most of their compute).
        mean: per-channel mean that standardises uint8 inputs (after scaling them to [0, 1]).
        std: per-channel standard deviation that standardises uint8 inputs.
    """

    def __init__(
        self,
        arch: str,
        input_shape: tuple[int, ...],
        num_classes: int,
        pretrained: bool = False,
        pretrained_file: str | None = None,
        projection_dim: int | None = None,
        cifar_stem: bool = False,
        channels: Sequence[int] | None = None,
        layers: Sequence[int] | None = None,
        stem_width: int | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        super().__init__()
        problems = []
        if len(input_shape) != 3:
            problems.append(f"The '{arch}' model needs (channels, height, width) images, got {tuple(input_shape)}.")
        if pretrained and (channels is not None or layers is not None or stem_width is not None):
            problems.append(
                f"--model.init_args.model_kwargs.pretrained=true loads {arch}'s own weights: leave channels, "
                "layers and stem_width unset, or train from scratch with pretrained=false."
            )
        if len(mean) != input_shape[0] or len(std) != input_shape[0]:
            problems.append(f"mean and std need one value per input channel ({input_shape[0]}), got {mean}, {std}.")
        if pretrained and pretrained_file is not None and not Path(pretrained_file).expanduser().is_file():
            problems.append(
                f"--model.init_args.model_kwargs.pretrained_file={pretrained_file} does not exist. Give the path of "
                f"{arch}'s ImageNet checkpoint (timm's {_PRETRAINED_TAGS[arch]!r} or torchvision's IMAGENET1K_V1 "
                "file), leave it unset to fetch timm's, or train from scratch with pretrained=false."
            )
        if problems:
            raise ConfigError(*problems)
        import timm  # here, not at import: timm's model zoo takes ~1.5 s to import, and most runs never need it

        overrides = {key: tuple(value) for key, value in (("channels", channels), ("layers", layers)) if value}
        # the architecture only, without a classifier (num_classes=0): the weights come from load_pretrained
        self.backbone = timm.create_model(arch, pretrained=False, num_classes=0, in_chans=input_shape[0], **overrides)
        self.arch, self.pretrained, self.pretrained_file = arch, pretrained, pretrained_file
        if stem_width is not None:
            _narrow_stem(self.backbone, stem_width)
        if cifar_stem:
            stem = self.backbone.conv1
            self.backbone.conv1 = nn.Conv2d(stem.in_channels, stem.out_channels, 3, stride=1, padding=1, bias=False)
            self.backbone.maxpool = nn.Identity()
        width = self.backbone.num_features  # d, the pooled feature size
        self.projection = None
        if projection_dim is not None:
            self.projection = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, projection_dim))
            width = projection_dim
        self.head = nn.Linear(width, num_classes)
        self.num_features = width
        # not in the state: the server neither aggregates nor checkpoints constants
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    #: uint8 images are scaled and standardised here (:meth:`standardise`)
    accepts_uint8 = True

    def load_pretrained(self) -> None:
        """Loads PyTorch's ImageNet weights into the encoder when ``pretrained`` (the classifier stays new).

        Raises:
            ConfigError: when the weights can be neither fetched nor read, or do not fit the architecture.
        """
        if not self.pretrained:
            return
        from timm.models import adapt_input_conv

        state = {k: v for k, v in _imagenet_state(self.arch, self.pretrained_file).items() if not k.startswith("fc.")}
        if "conv1.weight" in state:  # 1-channel (or other) inputs: timm's summed or repeated RGB filters
            state["conv1.weight"] = adapt_input_conv(self.backbone.conv1.in_channels, state["conv1.weight"])
        own = self.backbone.state_dict()
        missing = [k for k in own if k not in state]
        foreign = [k for k in state if k not in own or state[k].shape != own[k].shape]
        if missing or foreign:
            source = self.pretrained_file or _PRETRAINED_TAGS[self.arch]
            raise ConfigError(
                f"The weights {source} do not fit {self.arch}: missing {missing[:3]}, unexpected or of another "
                f"shape {foreign[:3]}. Give {self.arch}'s own ImageNet checkpoint."
            )
        self.backbone.load_state_dict(state)

    def standardise(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 images → ((x / 255) − mean) / std in the model's dtype; floating-point inputs pass unchanged."""
        if x.dtype != torch.uint8:
            return x
        return (x.to(self.mean.dtype) / 255.0 - self.mean) / self.std

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        maps = self.backbone.forward_features(self.standardise(x))  # [B, C, H/32, W/32] (H/8 with cifar_stem)
        pooled = self.backbone.forward_head(maps, pre_logits=True)  # [B, C]
        return pooled if self.projection is None else self.projection(pooled)  # [B, d] or z [B, projection_dim]

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)  # [B, num_classes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _imagenet_state(arch: str, pretrained_file: str | None) -> dict[str, torch.Tensor]:
    """PyTorch's ImageNet weights of ``arch`` from ``pretrained_file`` or timm's Hub tag (timm and torchvision name
    a ResNet's tensors alike, so either file fits)."""
    if pretrained_file is None:
        return timm_state_dict(_PRETRAINED_TAGS[arch], "--model.init_args.model_kwargs.pretrained")
    state = read_weights_file(Path(pretrained_file).expanduser())
    return state.get("state_dict", state) if isinstance(state, dict) else state


def _narrow_stem(backbone: nn.Module, width: int) -> None:
    """Gives the stem ``width`` output channels, and the first block (its convolution and shortcut) as many inputs."""
    stem = backbone.conv1
    backbone.conv1 = nn.Conv2d(stem.in_channels, width, stem.kernel_size, stem.stride, stem.padding, bias=False)
    backbone.bn1 = nn.BatchNorm2d(width)
    block = backbone.layer1[0]
    assert block.downsample is not None, "the first block has no shortcut convolution to narrow"
    for parent, name in ((block, "conv1"), (block.downsample, "0")):
        conv = getattr(parent, name)
        narrow = nn.Conv2d(width, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, bias=False)
        setattr(parent, name, narrow)


@register_model("resnet18")
def resnet18(input_shape: tuple[int, ...], num_classes: int, **kwargs) -> ResNet:
    """ResNet-18 (CIFAR-10/100, CINIC-10 in the FedSLS paper); keyword arguments as :class:`ResNet`."""
    return ResNet("resnet18", input_shape, num_classes, **kwargs)


@register_model("resnet50")
def resnet50(input_shape: tuple[int, ...], num_classes: int, **kwargs) -> ResNet:
    """ResNet-50 (TinyImageNet in the FedSLS paper); keyword arguments as :class:`ResNet`."""
    return ResNet("resnet50", input_shape, num_classes, **kwargs)
