"""How close a latent map stays to its image: the three measures of the FedSLS paper's latent-space analysis.

The paper (Sec. 4.3, Fig. 5) compares grey-scale latent maps with the images they encode after bringing both
to one size, brightness and contrast: :func:`normalise_maps` resizes a ``[B, h, w]`` map bilinearly to the
image's size (the paper enlarges the small latents "by linear interpolation") and min–max scales it to [0, 1].
On such pairs of ``[B, H, W]`` maps, per image:

- :func:`structural_similarity`: SSIM (Wang et al. 2004) with an 11×11 Gaussian window of σ = 1.5,
  K1 = 0.01, K2 = 0.03 and data range 1, torchmetrics' implementation (borders reflect-padded);
- :func:`euclidean_distance`: ‖a − b‖₂ over the H·W values;
- :func:`cosine_similarity`: a·b / (‖a‖ ‖b‖) of two vectors; the paper takes it between the outputs of a
  network for the image and for the latent, so it is applied to embeddings, not to the maps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: σ of SSIM's Gaussian window (Wang et al. 2004); torchmetrics derives the 11×11 window from it
SSIM_SIGMA = 1.5


def grey(images: Tensor) -> Tensor:
    """``[B, C, H, W]`` images → ``[B, H, W]`` float32 channel means; uint8 images are scaled to [0, 1] first.

    >>> grey(torch.tensor([[[[0, 255]], [[255, 255]]]], dtype=torch.uint8)).tolist()
    [[[0.5, 1.0]]]
    """
    return (images.float() / 255.0 if images.dtype == torch.uint8 else images.float()).mean(dim=1)


def normalise_maps(maps: Tensor, size: tuple[int, int]) -> Tensor:
    """``[B, h, w]`` maps → ``[B, *size]``: bilinear resizing, then each map min–max scaled to [0, 1].

    A constant map has no contrast to scale and becomes all zeros.

    >>> normalise_maps(torch.tensor([[[2.0, 4.0], [6.0, 10.0]]]), (2, 2)).tolist()
    [[[0.0, 0.25], [0.5, 1.0]]]
    >>> normalise_maps(torch.full((1, 1, 1), 3.0), (1, 2)).tolist()
    [[[0.0, 0.0]]]
    """
    maps = maps.float()
    if tuple(maps.shape[-2:]) != tuple(size):
        maps = F.interpolate(maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
    low = maps.amin(dim=(1, 2), keepdim=True)
    span = maps.amax(dim=(1, 2), keepdim=True) - low
    return torch.where(span > 0, (maps - low) / span.clamp(min=torch.finfo(maps.dtype).tiny), 0.0)


def structural_similarity(a: Tensor, b: Tensor) -> Tensor:
    """``[B]`` SSIM of two ``[B, H, W]`` batches of maps in [0, 1] (H, W ≥ 6 for the reflect padding).

    >>> a = torch.rand(2, 16, 16, generator=torch.Generator().manual_seed(0))
    >>> structural_similarity(a, a).round(decimals=6).tolist()
    [1.0, 1.0]
    """
    from torchmetrics.functional.image import structural_similarity_index_measure

    scores = structural_similarity_index_measure(
        a[:, None].float(), b[:, None].float(), gaussian_kernel=True, sigma=SSIM_SIGMA, data_range=1.0,
        reduction="none",
    )  # fmt: skip
    return scores.reshape(len(a))


def euclidean_distance(a: Tensor, b: Tensor) -> Tensor:
    """``[B]`` Euclidean distances ‖a_i − b_i‖₂ between the rows of two batches of equal shape.

    >>> euclidean_distance(torch.tensor([[[0.0, 0.0]]]), torch.tensor([[[3.0, 4.0]]])).tolist()
    [5.0]
    """
    return torch.linalg.vector_norm((a.float() - b.float()).flatten(1), dim=1)


def cosine_similarity(a: Tensor, b: Tensor) -> Tensor:
    """``[B]`` cosine similarities a_i·b_i / (‖a_i‖ ‖b_i‖) of two batches of vectors (or maps, flattened); 0 where
    either is zero.

    >>> a, b = torch.tensor([[3.0, 4.0], [3.0, 4.0], [3.0, 4.0]]), torch.tensor([[6.0, 8.0], [-4.0, 3.0], [0.0, 0.0]])
    >>> cosine_similarity(a, b).tolist()
    [1.0, 0.0, 0.0]
    """
    return F.cosine_similarity(a.float().flatten(1), b.float().flatten(1), dim=1, eps=1e-12)
