"""DeepLab-V3 (Chen et al., 2017) on a MobileNet-V2 backbone: LADD's segmentation network.

LADD (Shenaj et al., WACV 2023, supplementary S3) uses torchvision's DeepLab-V3 head on the ``features`` of a
width-1.0 MobileNet-V2 (Sandler et al., 2018) pretrained on ImageNet: the backbone ends in 1280 channels
at output stride 32, the head is ASPP with rates 12/24/36 and 256 channels, and the logits are
upsampled bilinearly to the input size.

The two submodules are named ``backbone`` and ``classifier``, as in torchvision's ``DeepLabV3``, so
state-dict keys match LADD's checkpoints and LADD's parameter groups can be told apart by name:
"backbone" (convolutions under ``backbone``), "classifier" (convolutions under ``classifier``), "bn"
(every BatchNorm). fedlight's uniform interface cuts before the final 1×1 convolution:

- ``forward_features(x)``: backbone + ASPP + 3×3 convolution, BatchNorm and ReLU, ``[B, 256, ⌈H/32⌉, ⌈W/32⌉]``;
- ``forward_head(features, size)``: the 1×1 classifier and the bilinear upsampling, ``[B, Q, H, W]``.

ImageNet weights are read by :meth:`DeepLabV3MobileNetV2.load_pretrained`, which the segmentation client calls
when a run starts from scratch, so configs instantiate without them and a resumed run never needs them. They
are named by a local file (torchvision's layout, or d-li14's, which LADD's released code loads), by timm's tag
``mobilenetv2_100.ra_in1k`` (from the Hugging Face Hub) or by torchvision's ``IMAGENET1K_V1``/``IMAGENET1K_V2``
(:mod:`fedlight.models.hub`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedlight.errors import ConfigError
from fedlight.models.hub import read_weights_file, resolve_weights, timm_state_dict, torchvision_state_dict
from fedlight.models.registry import register_model

OUTPUT_STRIDE = 32
_FLAG = "--model.init_args.model_kwargs.encoder_weights"
_WEIGHTS_HELP = (
    f"Set {_FLAG} to timm's mobilenetv2_100.ra_in1k or torchvision's IMAGENET1K_V1 "
    "(https://download.pytorch.org/models/mobilenet_v2-b0353104.pth), downloaded once and read from the cache "
    "offline, or download d-li14's weights, which LADD uses (pretrained/mobilenetv2_1.0-0c6065bc.pth of "
    "github.com/d-li14/mobilenetv2.pytorch), and pass the file's path; null starts from a random initialisation."
)


def _is_counter(key: str) -> bool:
    return key.endswith("num_batches_tracked")


def _backbone_state(raw: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], source: str) -> dict:
    """Maps a MobileNet-V2 ImageNet state dict onto torchvision's ``features`` keys.

    torchvision's files name the backbone ``features.*``. d-li14's (LADD's) and timm's name the same tensors in
    the same order differently (d-li14: flat ``conv.k`` inside blocks, the last 1×1 convolution ``conv.*``;
    timm: ``conv_stem``, ``blocks.i.j.conv_pw``/``conv_dw``/``conv_pwl``, ``conv_head``), so they are matched by
    position, every shape checked; the ImageNet classifier is left out. BatchNorm counters may be absent from
    older files.
    """
    features = {key.removeprefix("features."): value for key, value in raw.items() if key.startswith("features.")}
    if features.keys() == target.keys():
        return features
    tensors = [value for key, value in raw.items() if not key.startswith("classifier") and not _is_counter(key)]
    names = [key for key in target if not _is_counter(key)]
    if len(tensors) == len(names) and all(t.shape == target[n].shape for t, n in zip(tensors, names, strict=True)):
        return dict(zip(names, tensors, strict=True))
    raise ConfigError(
        f"{source} holds no MobileNet-V2 (width 1.0) ImageNet weights in torchvision's, timm's or d-li14's layout: "
        f"found {len(tensors)} backbone tensors for the {len(names)} expected ({_FLAG}).",
        _WEIGHTS_HELP,
    )


def _in_network_order(state: Mapping[str, torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
    """timm's checkpoint with its tensors in the network's module order, which matching by position needs.

    safetensors files list their tensors sorted by name; the order comes from timm's network, built on the meta
    device (shapes only, nothing allocated).
    """
    import timm

    with torch.device("meta"):
        order = timm.create_model(tag.split(".")[0]).state_dict()
    return {key: state[key] for key in order if key in state}


@register_model("deeplabv3_mobilenetv2")
class DeepLabV3MobileNetV2(nn.Module):
    """torchvision's DeepLab-V3 head on MobileNet-V2 ``features``, with the logits at the input size.

    Args:
        input_shape: ``(3, height, width)`` of the training crops; height and width must be multiples of
            32, the output stride, so that ``forward_head`` restores them (``forward`` takes any size).
        num_classes: number of classes Q.
        encoder_weights: MobileNet-V2 ImageNet weights, loaded by :meth:`load_pretrained`: a local state dict
            (torchvision's, timm's or d-li14's layout), timm's tag ``mobilenetv2_100.ra_in1k`` or torchvision's
            ``IMAGENET1K_V1``/``IMAGENET1K_V2``; None keeps torchvision's random initialisation.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, encoder_weights: str | None = None) -> None:
        super().__init__()
        if len(input_shape) != 3 or input_shape[0] != 3 or any(side % OUTPUT_STRIDE for side in input_shape[1:]):
            raise ConfigError(
                f"The 'deeplabv3_mobilenetv2' model needs RGB (3, height, width) inputs with sides divisible by its "
                f"output stride {OUTPUT_STRIDE}, got input_shape={tuple(input_shape)}."
            )
        # torchvision.models pulls in the whole model zoo (~1 s per process): import it when a model is built
        from torchvision.models import mobilenet_v2
        from torchvision.models.segmentation.deeplabv3 import DeepLabHead

        self.backbone = mobilenet_v2().features  # [B, 1280, H/32, W/32]
        self.classifier = DeepLabHead(1280, num_classes)  # ASPP(12, 24, 36) → 3×3 conv → BN → ReLU → 1×1 conv
        self.encoder_weights = encoder_weights
        # checked now, read in load_pretrained: a tag of another network is refused before the run starts
        self.weights_source = (
            resolve_weights(encoder_weights, _FLAG, ["mobilenetv2_100"], "MobileNet_V2_Weights")
            if encoder_weights is not None
            else None
        )
        self.num_features = 256

    def load_pretrained(self) -> None:
        """Loads the ``encoder_weights`` into the backbone (nothing for ``None``).

        Raises:
            ConfigError: when the weights cannot be read or are no MobileNet-V2's, saying where to get them.
        """
        source = self.weights_source
        if source is None:
            return
        if source.kind == "timm":
            raw = _in_network_order(timm_state_dict(source.name, _FLAG), source.name)
        elif source.kind == "torchvision":
            raw = torchvision_state_dict("MobileNet_V2_Weights", source.name, _FLAG)
        else:
            path = Path(source.name).expanduser()
            if not path.is_file():
                raise ConfigError(f"MobileNet-V2 ImageNet weights not found at {path} ({_FLAG}).", _WEIGHTS_HELP)
            raw = read_weights_file(path)
            if isinstance(raw, Mapping) and isinstance(raw.get("state_dict"), Mapping):
                raw = raw["state_dict"]
        state = _backbone_state(raw, self.backbone.state_dict(), source.name)
        missing, unexpected = self.backbone.load_state_dict(state, strict=False)
        assert not unexpected and all(map(_is_counter, missing)), f"missing {missing}, unexpected {unexpected}"

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        features = self.backbone(x)  # [B, 1280, ⌈H/32⌉, ⌈W/32⌉]
        for layer in list(self.classifier)[:-1]:  # ASPP, 3×3 conv, BN, ReLU (DeepLabHead cannot be sliced)
            features = layer(features)
        return features  # [B, 256, ⌈H/32⌉, ⌈W/32⌉], after a ReLU

    def forward_head(self, features: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """Classifies the features and upsamples the logits to ``size`` (default: 32× the feature map)."""
        logits = self.classifier[-1](features)  # [B, Q, h, w]
        if size is None:
            size = (features.shape[-2] * OUTPUT_STRIDE, features.shape[-1] * OUTPUT_STRIDE)
        return F.interpolate(logits, size=tuple(size), mode="bilinear", align_corners=False)  # [B, Q, H, W]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x), size=x.shape[-2:])
