"""Training-batch augmentations that act on an image batch and its targets together.

A :class:`BatchTransform` receives a stacked batch and the client's own ``torch.Generator`` and returns
the augmented batch, so augmentation costs one batched operation per step, not a loop over samples, and a
run's augmentations are fixed by its seed whatever order the clients train in.

:class:`RandomScaleCropFlip` is the DeepLab input pipeline of decision D11: random scale in [0.5, 2], a
random crop (padded where the scaled image is smaller) and a horizontal flip, applied to images
bilinearly and to label maps by nearest neighbour, with padded pixels void (255).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor

from fedlight.data.labels import IGNORE_INDEX
from fedlight.errors import ConfigError


class BatchTransform(ABC):
    """Augments a training batch ``(x, y)`` with draws from ``generator``."""

    @abstractmethod
    def __call__(self, x: Tensor, y: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Returns the augmented ``(x, y)``."""

    def output_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """The ``(H, W)`` of the batches returned for input batches of ``size``: the size the model trains on."""
        return tuple(size)

    def setup(self) -> None:
        """Reads and checks what the transform needs from disk, once, when the data are set up (before the run
        folder exists), so that a bad file is one error at set-up rather than a failure inside every local fit."""
        return None  # most transforms read nothing


class RandomScaleCropFlip(BatchTransform):
    """Random scale, crop and horizontal flip of images ``[B, C, H, W]`` and label maps ``[B, H, W]`` (D11).

    Each sample draws its own scale s ~ U(scale), crop position and flip. Its output pixel (i, j) shows
    the scaled image's pixel (top + i, left + j), mirrored when flipped; the crop's top-left corner is
    uniform over the positions that keep the crop inside the scaled image, or, where the scaled image is
    smaller than the crop, that keep the image inside the crop. Pixels outside the scaled image are 0 in
    the images (the mean of standardised inputs) and ``ignore_index`` in the label maps.

    Images are resampled bilinearly without antialiasing, label maps by nearest neighbour, both in one
    ``grid_sample`` call each.

    Args:
        crop_size: the output crop in pixels: a side for a square (512 for Pascal VOC in D11), ``[H, W]``
            for a rectangle (LADD's 512×1024), or ``null`` for each batch's input size.
        scale: range ``[low, high]`` of the random scale factor (D11: ``[0.5, 2.0]``).
        flip: mirror each sample horizontally with probability ½.
        ignore_index: label of padded pixels in the label maps.
    """

    def __init__(
        self,
        crop_size: int | tuple[int, int] | None = None,
        scale: tuple[float, float] = (0.5, 2.0),
        flip: bool = True,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        flag = "--data.train_transform.init_args"
        problems = []
        sides = (crop_size, crop_size) if isinstance(crop_size, int) else crop_size
        if sides is not None and (len(sides) != 2 or min(sides) < 1):
            problems.append(
                f"Expected {flag}.crop_size ≥ 1 (a side, or [H, W]) or null (the input size), got {crop_size}."
            )
        if not 0 < scale[0] <= scale[1]:
            problems.append(f"Expected {flag}.scale = [low, high] with 0 < low ≤ high, got {list(scale)}.")
        if problems:
            raise ConfigError(*problems)
        self.crop_size = None if sides is None else (int(sides[0]), int(sides[1]))
        self.scale = (float(scale[0]), float(scale[1]))
        self.flip = flip
        self.ignore_index = ignore_index

    def output_size(self, size: tuple[int, int]) -> tuple[int, int]:
        return self.crop_size or tuple(size)

    def __call__(self, x: Tensor, y: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Returns ``([B, C, H', W'], [B, H', W'])`` crops, ``[H', W']`` = ``crop_size`` (or the input's)."""
        batch, _, height, width = x.shape
        out_h, out_w = self.crop_size or (height, width)
        low, high = self.scale
        scales = low + (high - low) * torch.rand(batch, generator=generator)  # s, [B]
        # the crop's corner in the scaled image, between 0 and (scaled size − crop size), either sign
        slack_h, slack_w = scales * height - out_h, scales * width - out_w  # [B]
        top = torch.minimum(slack_h, torch.zeros(())) + slack_h.abs() * torch.rand(batch, generator=generator)
        left = torch.minimum(slack_w, torch.zeros(())) + slack_w.abs() * torch.rand(batch, generator=generator)
        flips = torch.rand(batch, generator=generator) < 0.5 if self.flip else torch.zeros(batch, dtype=torch.bool)
        grid = scale_crop_grid(scales, top.round(), left.round(), flips, (height, width), (out_h, out_w))
        grid = grid.to(x.device)
        images = F.grid_sample(x, grid.to(x.dtype), mode="bilinear", padding_mode="zeros", align_corners=False)
        # labels + 1 so that the zero padding reads as −1 → void after the shift back; exact in float32
        shifted = F.grid_sample((y[:, None] + 1).float(), grid, mode="nearest", align_corners=False)
        labels = shifted[:, 0].long() - 1
        labels = torch.where(labels < 0, self.ignore_index, labels)
        return images, labels


def scale_crop_grid(
    scales: Tensor,
    top: Tensor,
    left: Tensor,
    flips: Tensor,
    in_size: tuple[int, int],
    out_size: tuple[int, int],
) -> Tensor:
    """The ``grid_sample`` grid (``align_corners=False``) of a scale, crop and optional mirror per sample.

    Output pixel (i, j) of sample b reads the scaled image's pixel (top_b + i, left_b + j'), with
    j' = W_out − 1 − j when flipped; the scaled pixel p maps to input coordinate (p + ½)/s − ½, so pixel
    centres line up as in a resize.

    Args:
        scales: ``[B]`` scale factors s.
        top: ``[B]`` crop row offsets in the scaled image (may be negative: padding above).
        left: ``[B]`` crop column offsets in the scaled image.
        flips: ``[B]`` bool, mirror horizontally.
        in_size: input ``(H, W)``.
        out_size: output ``(H_out, W_out)``.

    Returns:
        ``[B, H_out, W_out, 2]`` normalised ``(x, y)`` sampling positions.

    Example:
        >>> one = torch.ones(1)
        >>> grid = scale_crop_grid(one, torch.zeros(1), torch.zeros(1), torch.tensor([True]), (2, 4), (2, 4))
        >>> grid[0, 0, :, 0].tolist()  # the first row reads columns 3, 2, 1, 0
        [0.75, 0.25, -0.25, -0.75]
    """
    (height, width), (out_h, out_w) = in_size, out_size
    rows = torch.arange(out_h, dtype=torch.float32)
    cols = torch.arange(out_w, dtype=torch.float32)
    cols = torch.where(flips[:, None], out_w - 1 - cols, cols)  # [B, W_out]
    s = scales.float()[:, None]
    src_y = (top.float()[:, None] + rows + 0.5) / s  # [B, H_out], in input pixels (edge-based)
    src_x = (left.float()[:, None] + cols + 0.5) / s  # [B, W_out]
    norm_y, norm_x = 2 * src_y / height - 1, 2 * src_x / width - 1
    return torch.stack([norm_x[:, None, :].expand(-1, out_h, -1), norm_y[:, :, None].expand(-1, -1, out_w)], dim=-1)
