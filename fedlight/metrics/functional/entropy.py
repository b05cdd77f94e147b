"""Pixel-wise entropy maps of a segmentation model: MO-FedProto's H_S and H_E (Sec. 5.2, Fig. 6, D10).

- H_S = H(softmax(logits)) at every pixel: low where the prediction is confident.
- H_E = H(Ê) with Ê the features normalised to sum to 1 over the channels at each (low-resolution) pixel,
  upsampled to the input size: high where many feature channels are active.

H is Shannon's entropy in nats, so H_S ∈ [0, log C] and H_E ∈ [0, log D] for C classes and D channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["feature_entropy", "softmax_entropy"]


def softmax_entropy(logits: Tensor) -> Tensor:
    """H_S: the entropy of the class distribution at every pixel.

    Args:
        logits: ``[B, C, H, W]`` per-pixel class scores.

    Returns:
        ``[B, H, W]`` entropies in [0, log C], in float32 or wider.

    Example:
        >>> logits = torch.tensor([[[[0.0]], [[0.0]]], [[[50.0]], [[0.0]]]])  # [2, 2, 1, 1]
        >>> [round(h, 4) for h in softmax_entropy(logits).flatten().tolist()]  # uniform: log 2; peaked: ≈ 0
        [0.6931, 0.0]
    """
    log_p = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=1)
    entropy = -(log_p.exp() * log_p).sum(dim=1)
    return torch.where(entropy > 0, entropy, 0.0)  # no −0 or −1e-8 from rounding


def feature_entropy(features: Tensor, size: tuple[int, int] | None = None, eps: float = 1e-12) -> Tensor:
    """H_E: the entropy of the features, normalised over the channels at each pixel, upsampled to ``size``.

    A pixel's features become a distribution q_d = e_d / (Σ_d' e_d' + ε) (D10: DeepLab-V3+'s decoder ends
    with a ReLU, so e ≥ 0; a pixel with negative values is first shifted by its minimum so that it is ≥ 0),
    and H_E = −Σ_d q_d log q_d, with 0 log 0 = 0: 0 for an all-zero pixel or a single active channel, log D
    when all channels are equal. The map is then upsampled bilinearly to the input size.

    Args:
        features: ``[B, D, h, w]`` per-pixel features.
        size: ``(H, W)`` of the returned map; ``None`` keeps ``(h, w)``.
        eps: ε of the normalisation.

    Returns:
        ``[B, H, W]`` entropies in [0, log D].

    Example:
        >>> features = torch.tensor([[[[1.0, 0.0]], [[1.0, 0.0]], [[1.0, 3.0]], [[1.0, 0.0]]]])  # [1, 4, 1, 2]
        >>> [round(h, 4) for h in feature_entropy(features).flatten().tolist()]  # log 4, then one channel
        [1.3863, 0.0]
    """
    features = features.to(torch.promote_types(features.dtype, torch.float32))
    shifted = features - features.amin(dim=1, keepdim=True).clamp(max=0.0)  # only pixels with negatives move
    q = shifted / (shifted.sum(dim=1, keepdim=True) + eps)  # [B, D, h, w], sums to 1 (or 0) over D
    entropy = -torch.xlogy(q, q).sum(dim=1, keepdim=True)  # [B, 1, h, w]
    entropy = torch.where(entropy > 0, entropy, 0.0)  # no −0 or −1e-8 from rounding
    if size is not None and tuple(size) != tuple(entropy.shape[-2:]):
        entropy = F.interpolate(entropy, size=size, mode="bilinear", align_corners=False)
    return entropy[:, 0]
