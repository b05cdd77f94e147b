"""DeepLab-V3+ (Chen et al., 2018) from segmentation-models-pytorch, with fedlight's encoder/head split.

MO-FedProto's segmentation model (Table 1): DeepLab-V3+ with a MobileNet-V2 encoder
pretrained on ImageNet, output stride 16. fedlight's uniform interface cuts it before the final 1×1
classifier (decision D5):

- ``forward_features(x)``: encoder + DeepLab-V3+ decoder (ASPP, upsampling, fusion with the stride-4
  encoder features), ``[B, 256, H/4, W/4]`` after a ReLU: the features of dense prototypes and of H_E;
- ``forward_head(features)``: the 1×1 classifier and the ×4 bilinear upsampling, ``[B, C, H, W]`` logits.

Pretrained encoder weights are not read at construction but by :meth:`DeepLabV3Plus.load_pretrained`,
which the segmentation client calls from ``configure_model`` when a run starts from scratch: configs
instantiate without network or weight files, and a resumed run never needs them.
"""

from __future__ import annotations

import torch
from torch import nn

from fedlight.errors import ConfigError
from fedlight.models.hub import hub_files
from fedlight.models.registry import register_model


@register_model("deeplabv3plus")
class DeepLabV3Plus(nn.Module):
    """DeepLab-V3+ whose decoder output is the feature space.

    Args:
        input_shape: ``(channels, height, width)``; height and width must be divisible by the output stride.
        num_classes: number of classes C, background included.
        encoder_name: a segmentation-models-pytorch encoder (``mobilenet_v2`` in MO-FedProto).
        encoder_weights: pretrained encoder weights, ``imagenet`` as in the paper (fetched from the Hugging
            Face Hub by segmentation-models-pytorch, or read from its local cache), or ``null`` for a random
            initialisation, which needs no network.
        output_stride: encoder output stride, 16 (MO-FedProto, D11) or 8.
        decoder_channels: width of the ASPP and decoder, D of the features (256 in DeepLab-V3+).
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        encoder_name: str = "mobilenet_v2",
        encoder_weights: str | None = "imagenet",
        output_stride: int = 16,
        decoder_channels: int = 256,
    ) -> None:
        super().__init__()
        problems = []
        if len(input_shape) != 3 or input_shape[1] % output_stride or input_shape[2] % output_stride:
            problems.append(
                f"The 'deeplabv3plus' model needs (channels, height, width) inputs with sides divisible by "
                f"output_stride={output_stride}, got input_shape={tuple(input_shape)}."
            )
        if output_stride not in (8, 16):
            problems.append(f"Expected --model.init_args.model_kwargs.output_stride in {{8, 16}}, got {output_stride}.")
        if problems:
            raise ConfigError(*problems)
        import segmentation_models_pytorch as smp  # here, not at import: it pulls timm in (~1.5 s per process)

        # the architecture only: pretrained weights come later, from load_pretrained
        self.model = smp.DeepLabV3Plus(
            encoder_name=encoder_name,
            encoder_weights=None,
            encoder_output_stride=output_stride,
            decoder_channels=decoder_channels,
            in_channels=input_shape[0],
            classes=num_classes,
        )
        self.encoder_name = encoder_name
        self.encoder_weights = encoder_weights
        self.output_stride = output_stride
        self.in_channels = input_shape[0]
        self.num_features = decoder_channels

    def load_pretrained(self) -> None:
        """Loads the ``encoder_weights`` into the encoder (nothing for ``None``).

        Raises:
            ConfigError: when the weights can be neither downloaded nor found in the local cache.
        """
        if self.encoder_weights is None:
            return
        import segmentation_models_pytorch as smp

        try:
            # into the cache first, where a copied cache is read without network and no network fails at once
            settings = smp.encoders.encoders[self.encoder_name]["pretrained_settings"][self.encoder_weights]
            hub_files(settings["repo_id"], ["config.json", "model.safetensors"], settings["revision"])
            pretrained = smp.encoders.get_encoder(
                self.encoder_name,
                in_channels=self.in_channels,
                weights=self.encoder_weights,
                output_stride=self.output_stride,
            )
        except (OSError, ValueError, KeyError) as error:  # hub errors are OSErrors; unknown weight names KeyErrors
            raise ConfigError(
                f"Could not load {self.encoder_weights!r} weights of the {self.encoder_name} encoder "
                f"(--model.init_args.model_kwargs.encoder_weights): {error}",
                "segmentation-models-pytorch downloads them from the Hugging Face Hub into ~/.cache/huggingface/hub "
                "(HF_HUB_CACHE). "
                "Run once on a machine with network and copy that folder here (then HF_HUB_OFFLINE=1 works), or set "
                "--model.init_args.model_kwargs.encoder_weights=null to start from a random initialisation.",
            ) from error
        self.model.encoder.load_state_dict(pretrained.state_dict())

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.decoder(self.model.encoder(x))  # [B, D, H/4, W/4], after a ReLU

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.segmentation_head(features)  # [B, C, H, W]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
