"""Fourier styles: the low-frequency amplitude window of FDA (Yang & Soatto, CVPR 2020), as LADD uses it.

FDA (Eq. 3 of the FDA paper) swaps the centre of an image's amplitude spectrum, the lowest spatial
frequencies, for another image's, keeping the phase: the scene stays, its global appearance (colour,
contrast, illumination) changes. LADD (Shenaj et al., WACV 2023, Sec. 4.1) calls that window a *style*:

1. a client sends the mean style of its images, s̄_k (:func:`client_style`);
2. the server restyles its labelled source images with styles drawn from the pool {s̄_k} during
   pre-training (:func:`apply_style`);
3. the clients are clustered by style and every test image is routed to the cluster whose centroid is
   nearest to its own style (:mod:`fedlight.strategies.clustering`).

Every image goes through the same steps as LADD's reference code: resize to ``size`` (1024×512 W×H,
bicubic), RGB → BGR, values 0–255 without normalisation, per-channel FFT. The style is the window
``[3, 2b+1, 2b+1]`` of the fftshifted amplitude at rows ⌊H/2⌋ ± b and columns ⌊W/2⌋ ± b, flattened:
27 numbers for LADD's b = 1 (Table 6 of the LADD paper: 1×1, 3×3, 5×5 are b = 0, 1, 2).

This module sits with the data because restyling is a data augmentation of the source images, and a
style is a statistic of raw images taken before any normalisation, not of a model's output.

Image convention: ``[B, 3, H, W]`` RGB, either ``uint8`` in 0–255 (what an image file holds, as in the
reference code's PIL images) or floating point in [0, 1] (``to_tensor``'s convention), never normalised.
:func:`apply_style` returns the dtype and range it was given. Spectra are computed in float64, and
styles are float64 (the DC term of a 1024×512 image is ~10⁸).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from fedlight.errors import ConfigError

#: (H, W) every image is resized to before its spectrum is taken: 1024×512 (W×H) in LADD.
FDA_SIZE = (512, 1024)
#: L of FDA: the window half-width is ⌊min(H, W)·L⌋ when b is not given.
FDA_L = 0.01


def window_half_width(size: tuple[int, int], b: int | None = 1, L: float = FDA_L) -> int:
    """Returns the half-width b of the style window: ``b`` itself, or ⌊min(H, W)·L⌋ when ``b`` is None.

    Args:
        size: ``(H, W)`` of the resized images.
        b: half-width, 0 for the 1×1 window (the DC term only), 1 for LADD's 3×3.
        L: FDA's β, the window half-width as a fraction of the shorter side, used when ``b`` is None.

    Raises:
        ConfigError: when the window does not fit in the image.

    >>> window_half_width((512, 1024)), window_half_width((512, 1024), b=None), window_half_width((512, 1024), 0)
    (1, 5, 0)
    """
    height, width = size
    half = math.floor(min(height, width) * L) if b is None else b
    if half < 0 or 2 * half + 1 > min(height, width):
        raise ConfigError(
            f"Expected an FDA window half-width b with 0 ≤ 2b+1 ≤ {min(height, width)} for {height}×{width} "
            f"images, got b={half} (b={b}, L={L}). b=1 gives LADD's 3×3 window."
        )
    return half


def _to_bgr255(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``[B, 3, H, W]`` RGB uint8 or float in [0, 1] → ``[B, 3, *size]`` float64 BGR in 0–255."""
    from torchvision.transforms.v2 import functional as TF  # here, not at import: the command starts faster

    assert images.ndim == 4 and images.shape[1] == 3, f"expected [B, 3, H, W] RGB images, got {tuple(images.shape)}"
    if images.dtype == torch.uint8:
        # resized as 8-bit, like the reference code's PIL images, then taken to float
        resized = TF.resize(images, list(size), interpolation=TF.InterpolationMode.BICUBIC, antialias=True).double()
    else:
        if images.numel() and (images.min() < 0 or images.max() > 1):
            raise ValueError(
                "FDA styles need raw images: floating-point images in [0, 1] or uint8 in 0–255, got values in "
                f"[{images.min().item():.3g}, {images.max().item():.3g}] (take the style before normalising)."
            )
        resized = TF.resize(
            images.double() * 255.0, list(size), interpolation=TF.InterpolationMode.BICUBIC, antialias=True
        )
    return resized.flip(1)  # RGB → BGR, the channel order of the reference code's styles


def _window(height: int, width: int, b: int) -> tuple[slice, slice]:
    """Rows ⌊H/2⌋ ± b and columns ⌊W/2⌋ ± b of an fftshifted spectrum: its lowest frequencies."""
    return slice(height // 2 - b, height // 2 + b + 1), slice(width // 2 - b, width // 2 + b + 1)


def extract_style(
    images: torch.Tensor, b: int | None = 1, size: tuple[int, int] = FDA_SIZE, L: float = FDA_L
) -> torch.Tensor:
    """Returns the FDA style of each image: the centre of its amplitude spectrum (LADD, Sec. 4.1).

    Args:
        images: ``[B, 3, H, W]`` RGB, uint8 in 0–255 or float in [0, 1].
        b: window half-width (1: 3×3, LADD's ``fda_b``); None derives it from ``L``.
        size: ``(H, W)`` the images are resized to (bicubic) before the FFT.
        L: window half-width as a fraction of the shorter side, used when ``b`` is None.

    Returns:
        ``[B, 3(2b+1)²]`` float64, channel-major in BGR order (27 numbers for b = 1).

    A constant image's spectrum is its DC term alone, the pixel sum 10·4·6 = 240 per channel:

    >>> extract_style(torch.full((1, 3, 4, 6), 10, dtype=torch.uint8), b=0, size=(4, 6))
    tensor([[240., 240., 240.]], dtype=torch.float64)
    """
    half = window_half_width(size, b, L)
    bgr = _to_bgr255(images, size)  # [B, 3, h, w]
    amplitude = torch.fft.fftshift(torch.fft.fft2(bgr).abs(), dim=(-2, -1))  # [B, 3, h, w], DC at the centre
    rows, cols = _window(*size, half)
    return amplitude[..., rows, cols].flatten(1)  # [B, 3(2b+1)²]


def client_style(
    batches: Iterable[torch.Tensor], b: int | None = 1, size: tuple[int, int] = FDA_SIZE, L: float = FDA_L
) -> torch.Tensor:
    """Returns s̄_k, the element-wise mean style over all of a client's images, read batch by batch.

    Args:
        batches: ``[B_i, 3, H, W]`` image batches (see :func:`extract_style`); sizes may differ.
        b: window half-width.
        size: ``(H, W)`` the images are resized to.
        L: window fraction, used when ``b`` is None.

    Returns:
        ``[3(2b+1)²]`` float64.

    >>> dark, bright = torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.full((1, 3, 4, 4), 3, dtype=torch.uint8)
    >>> client_style([dark, bright], b=0, size=(4, 4)).tolist()  # (0 + 0 + 48) / 3
    [16.0, 16.0, 16.0]
    """
    total, count = None, 0
    for images in batches:
        styles = extract_style(images, b, size, L)  # [B_i, D]
        total = styles.sum(0) if total is None else total + styles.sum(0)
        count += styles.shape[0]
    if count == 0:
        raise ValueError("a client style needs at least one image, got none")
    return total / count


def apply_style(
    images: torch.Tensor,
    style: torch.Tensor,
    b: int | None = 1,
    size: tuple[int, int] = FDA_SIZE,
    L: float = FDA_L,
) -> torch.Tensor:
    """Restyles images: their amplitude window becomes ``style``, their phase stays (FDA, Eq. 3).

    Each image is resized to ``size``, its amplitude window replaced, the spectrum inverted (real part,
    rounded and clipped to 0–255 like an 8-bit image) and resized back to its own size (bicubic).

    Args:
        images: ``[B, 3, H, W]`` RGB, uint8 in 0–255 or float in [0, 1].
        style: ``[D]`` one style for all images, or ``[B, D]`` one per image, D = 3(2b+1)² in BGR order.
        b: window half-width the style was taken with.
        size: ``(H, W)`` the images are resized to for the FFT.
        L: window fraction, used when ``b`` is None.

    Returns:
        ``[B, 3, H, W]`` with the dtype and value range of ``images``.

    A constant image restyled with the style of a brighter constant image becomes that image:

    >>> bright = torch.full((1, 3, 4, 4), 9, dtype=torch.uint8)
    >>> apply_style(torch.zeros(1, 3, 4, 4, dtype=torch.uint8), extract_style(bright, 0, (4, 4)), 0, (4, 4)).unique()
    tensor([9], dtype=torch.uint8)
    """
    from torchvision.transforms.v2 import functional as TF  # here, not at import: the command starts faster

    half = window_half_width(size, b, L)
    side = 2 * half + 1
    style = torch.as_tensor(style, dtype=torch.float64, device=images.device)
    assert style.shape[-1] == 3 * side * side and style.ndim in (1, 2), (
        f"a style for b={half} has {3 * side * side} numbers, got shape {tuple(style.shape)}"
    )
    spectrum = torch.fft.fftshift(torch.fft.fft2(_to_bgr255(images, size)), dim=(-2, -1))  # [B, 3, h, w] complex128
    rows, cols = _window(*size, half)
    window = spectrum[..., rows, cols]  # [B, 3, 2b+1, 2b+1]
    # only the window's amplitude changes, so only its entries are rebuilt from (style, source phase)
    amplitude = style.reshape(-1, 3, side, side).expand(window.shape)  # one style may serve the whole batch
    spectrum[..., rows, cols] = torch.polar(amplitude.contiguous(), window.angle())
    bgr = torch.fft.ifft2(torch.fft.ifftshift(spectrum, dim=(-2, -1))).real.round().clamp(0.0, 255.0)  # 8-bit
    rgb = bgr.flip(1)
    out_size = list(images.shape[-2:])
    interpolation = TF.InterpolationMode.BICUBIC
    if images.dtype == torch.uint8:
        return TF.resize(rgb.to(torch.uint8), out_size, interpolation=interpolation, antialias=True)
    back = TF.resize(rgb, out_size, interpolation=interpolation, antialias=True)
    return (back / 255.0).clamp(0.0, 1.0).to(images.dtype)
