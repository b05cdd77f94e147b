"""Dense CRF refinement of per-pixel class scores, as STEGO and FUSS apply it for their Tables 2–3.

A fully connected CRF (Krähenbühl & Koltun, NeurIPS 2011) smooths a segmentation so that pixels that are close
and of similar colour take the same label. STEGO's evaluation runs it on every test image with 10 mean-field
iterations, a Gaussian kernel (σ_xy 1, weight 3) and a bilateral kernel (σ_xy 67, σ_rgb 3, weight 4), on the
softmax of the cluster scores; FUSS reports its gain at about 2 mIoU points.

The inference itself is ``pydensecrf``'s (the ``pydensecrf2`` package on PyPI, a C++ extension), which is not
a dependency of fedlight: ``pip install pydensecrf2`` (or ``pip install 'fedlight[crf]'``) before setting
``--model.init_args.crf=true``. What is written here is only the conversion of fedlight's tensors to the
extension's arrays and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from fedlight.errors import ConfigError


@dataclass(frozen=True)
class CrfParameters:
    """Kernels and iterations of the dense CRF; the defaults are STEGO's ``crf.py`` values."""

    iterations: int = 10
    gaussian_sxy: float = 1.0
    gaussian_compat: float = 3.0
    bilateral_sxy: float = 67.0
    bilateral_srgb: float = 3.0
    bilateral_compat: float = 4.0


def require_pydensecrf(flag: str = "--model.init_args.crf") -> tuple[ModuleType, ModuleType]:
    """``pydensecrf.densecrf`` and ``pydensecrf.utils``, or a ConfigError that says how to install them."""
    try:
        import pydensecrf.densecrf as densecrf
        import pydensecrf.utils as utils
    except ImportError as error:
        raise ConfigError(
            f"{flag}=true refines the segmentation with a dense CRF, which needs the pydensecrf extension: "
            "pip install pydensecrf2 (it compiles C++; a few minutes), or set the flag to false."
        ) from error
    return densecrf, utils


def to_rgb_bytes(image: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """A standardised image ``[3, H, W]`` back to contiguous ``uint8`` RGB ``[H, W, 3]``."""
    mean_t = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    pixels = (image.detach().float().cpu() * std_t + mean_t).clamp(0, 1)
    return np.ascontiguousarray((pixels * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())


def dense_crf(image: np.ndarray, log_probs: Tensor, parameters: CrfParameters | None = None) -> Tensor:
    """Refined probabilities ``[n, H, W]`` from an RGB image ``[H, W, 3]`` (uint8) and log-probabilities ``[n, H, W]``.

    The CRF's unary term is −log of the softmax of ``log_probs`` (clipped as ``pydensecrf.utils`` does). The
    image goes to the bilateral kernel as BGR, as STEGO hands it over: the kernel has one σ for all three
    channels, but its permutohedral-lattice approximation depends on the order of the features (on a random
    40×48 image, RGB and BGR gave the same label on 99.8% of the pixels, not all).
    """
    parameters = parameters or CrfParameters()
    densecrf, utils = require_pydensecrf()
    n, height, width = log_probs.shape
    if image.shape != (height, width, 3):
        raise ValueError(f"Expected an RGB image of {height}×{width}×3 for the CRF, got {image.shape}.")
    probs = torch.softmax(log_probs.detach().float().cpu(), dim=0).numpy()
    crf = densecrf.DenseCRF2D(width, height, n)
    crf.setUnaryEnergy(np.ascontiguousarray(utils.unary_from_softmax(probs)))
    crf.addPairwiseGaussian(sxy=parameters.gaussian_sxy, compat=parameters.gaussian_compat)
    crf.addPairwiseBilateral(
        sxy=parameters.bilateral_sxy,
        srgb=parameters.bilateral_srgb,
        rgbim=np.ascontiguousarray(image[:, :, ::-1]),
        compat=parameters.bilateral_compat,
    )
    refined = np.asarray(crf.inference(parameters.iterations), dtype=np.float32).reshape(n, height, width)
    return torch.from_numpy(refined)
