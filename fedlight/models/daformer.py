"""DAFormer's network: a Mix Transformer encoder (segmentation-models-pytorch) with the context-aware fusion decoder.

Hoyer, Dai & Van Gool, *DAFormer: Improving Network Architectures and Training Strategies for Domain-Adaptive Semantic
Segmentation*, CVPR 2022, Sec. 3.2; trained by :class:`fedlight.clients.DAFormerClient`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlight.errors import ConfigError
from fedlight.models.hub import hub_files
from fedlight.models.registry import register_model

_FLAG = "--model.init_args"


def _separable(channels: int, out: int, dilation: int) -> nn.Sequential:
    """A 3×3 depthwise convolution of the given dilation, then a pointwise one, each with BatchNorm and ReLU."""
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=dilation, dilation=dilation, groups=channels, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(channels, out, 1, bias=False),
        nn.BatchNorm2d(out),
        nn.ReLU(inplace=True),
    )


class ContextAwareFusion(nn.Module):
    """DAFormer's decoder (Sec. 3.2): each encoder level embedded by a 1×1 linear layer to C_e channels and
    upsampled to stride 4; the stack of the four fused by parallel 3×3 depthwise-separable convolutions with
    dilations 1, 6, 12, 18 (ASPP without image pooling), concatenated and projected by a 1×1 convolution.

    Args:
        in_channels: channels of the encoder's four levels (strides 4, 8, 16, 32).
        embed_dim: C_e, the embedding and fusion width (256).
        dilations: the fusion branches' dilation rates.
    """

    def __init__(self, in_channels: list[int], embed_dim: int = 256, dilations: tuple[int, ...] = (1, 6, 12, 18)):
        super().__init__()
        self.embed = nn.ModuleList(nn.Conv2d(c, embed_dim, 1) for c in in_channels)
        stacked = embed_dim * len(in_channels)
        self.branches = nn.ModuleList(_separable(stacked, embed_dim, d) for d in dilations)
        self.project = nn.Sequential(
            nn.Conv2d(embed_dim * len(dilations), embed_dim, 1, bias=False),
            nn.BatchNorm2d(embed_dim),
            nn.ReLU(inplace=True),
        )

    def forward(self, levels: list[Tensor]) -> Tensor:
        size = levels[0].shape[-2:]
        embedded = [
            F.interpolate(embed(level), size=size, mode="bilinear", align_corners=False)
            for embed, level in zip(self.embed, levels, strict=True)
        ]
        stacked = torch.cat(embedded, dim=1)  # [B, 4·C_e, H/4, W/4]
        return self.project(torch.cat([branch(stacked) for branch in self.branches], dim=1))  # [B, C_e, H/4, W/4]


@register_model("daformer")
class DAFormerNet(nn.Module):
    """A Mix Transformer encoder (segmentation-models-pytorch's ``mit_b0``–``mit_b5``) with the context-aware fusion
    decoder; ``forward_features`` is the decoder's ``[B, C_e, H/4, W/4]`` output, ``forward_head`` the 1×1
    classifier with the ×4 bilinear upsampling.

    Args:
        input_shape: ``(3, height, width)``.
        num_classes: number of classes.
        encoder_name: the MiT variant (``mit_b5`` in DAFormer).
        pretrained: load segmentation-models-pytorch's ImageNet weights of the encoder at set-up (the paper's
            setting; fetched into, or read from, the Hugging Face cache); false starts from a random encoder.
        embed_dim: C_e of the decoder (256).
        dilations: the decoder's fusion dilations (1, 6, 12, 18).
        dropout: dropout before the classifier (0.1).
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        encoder_name: str = "mit_b5",
        pretrained: bool = True,
        embed_dim: int = 256,
        dilations: tuple[int, ...] = (1, 6, 12, 18),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if not encoder_name.startswith("mit_b") or input_shape[0] != 3:
            raise ConfigError(
                f"The 'daformer' model takes a Mix Transformer (--model.init_args.model_kwargs.encoder_name: mit_b0 "
                f"… mit_b5) on RGB images, got {encoder_name!r} on input_shape={tuple(input_shape)}."
            )
        import segmentation_models_pytorch as smp  # here, not at import: it pulls timm in

        self.encoder = smp.encoders.get_encoder(encoder_name, in_channels=3, weights=None)
        self.decoder = ContextAwareFusion(list(self.encoder.out_channels[-4:]), embed_dim, tuple(dilations))
        self.classifier = nn.Sequential(nn.Dropout2d(dropout), nn.Conv2d(embed_dim, num_classes, 1))
        self.encoder_name, self.pretrained, self.num_features = encoder_name, pretrained, embed_dim

    def load_pretrained(self) -> None:
        """Loads the ImageNet weights into the encoder when ``pretrained`` (the path of the other smp encoders)."""
        if not self.pretrained:
            return
        import segmentation_models_pytorch as smp

        try:
            settings = smp.encoders.encoders[self.encoder_name]["pretrained_settings"]["imagenet"]
            hub_files(settings["repo_id"], ["config.json", "model.safetensors"], settings["revision"])
            weights = smp.encoders.get_encoder(self.encoder_name, in_channels=3, weights="imagenet").state_dict()
        except (OSError, ValueError, KeyError) as error:
            raise ConfigError(
                f"Could not load the ImageNet weights of the {self.encoder_name} encoder "
                f"(--model.init_args.model_kwargs.pretrained=true): {error}",
                "segmentation-models-pytorch downloads them from the Hugging Face Hub into ~/.cache/huggingface/hub "
                "(HF_HUB_CACHE). Run once on a machine with network and copy that folder here (then "
                "HF_HUB_OFFLINE=1 works), or set --model.init_args.model_kwargs.pretrained=false.",
            ) from error
        self.encoder.load_state_dict(weights)

    def encode(self, x: Tensor) -> list[Tensor]:
        """The encoder's four levels, ``[B, C_i, H/s, W/s]`` for s = 4, 8, 16, 32."""
        return list(self.encoder(x)[-4:])

    def decode(self, levels: list[Tensor], size: tuple[int, int]) -> Tensor:
        """Logits ``[B, Q, *size]`` of the encoder's ``levels``."""
        return F.interpolate(self.classifier(self.decoder(levels)), size=size, mode="bilinear", align_corners=False)

    def forward_features(self, x: Tensor) -> Tensor:
        return self.decoder(self.encode(x))  # [B, C_e, H/4, W/4]

    def forward_head(self, features: Tensor) -> Tensor:
        logits = self.classifier(features)
        return F.interpolate(logits, scale_factor=4, mode="bilinear", align_corners=False)  # [B, Q, H, W]

    def forward(self, x: Tensor) -> Tensor:
        return self.decode(self.encode(x), x.shape[-2:])
