"""LADD's source augmentation: every source image restyled with a target client's style (Shenaj et al., WACV 2023,
Sec. 4.1), then colour jitter, then the geometric crops.

Before pre-training, the server gathers the pool of client styles {s̄_k} (the mean FDA amplitude window of each
target client's images, :func:`fedlight.data.style.fda.client_style`); each source image of each pre-training batch
is restyled with a style drawn uniformly from that pool (:func:`fedlight.data.style.fda.apply_style`: the FDA swap of
the lowest frequencies, Eq. 3 of the FDA paper), which moves the source's global appearance towards the
clients' without any target label.

The pool lives in a file so that the pre-training run and the federated run agree on it: :class:`StyleAugment`
reads ``style_file``; when the file does not exist and a ``target`` dataset is given, it computes the pool from
that dataset's natural clients on first use and writes the file (``{"styles": [K, D], "client_ids": [...],
"b": b, "size": (H, W)}``, a ``torch.save`` of tensors, lists and numbers).

Batches arrive normalised; the normalisation (``mean``/``std``) is undone before the style swap and the colour
jitter, which act on raw RGB in [0, 1], and applied again afterwards. The colour jitter follows torchvision's
``ColorJitter(brightness, contrast, saturation)`` factors, one of each per image uniform in [1 − j, 1 + j],
applied in that fixed order (torchvision permutes the order per image).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlight.data.base import FederatedDataset
from fedlight.data.style.fda import FDA_SIZE, apply_style, client_style, window_half_width
from fedlight.data.transforms import BatchTransform
from fedlight.errors import ConfigError

_LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601, torchvision's grayscale weights
_FLAG = "--data.train_transform.init_args"


def style_pool(
    dataset: FederatedDataset,
    b: int | None = 1,
    size: tuple[int, int] = FDA_SIZE,
    mean: tuple[float, ...] = (0.5, 0.5, 0.5),
    std: tuple[float, ...] = (0.5, 0.5, 0.5),
    chunk: int = 64,
) -> tuple[Tensor, list[str]]:
    """Returns the style of every natural client of ``dataset``, ``[K, D]`` float64, and the clients' ids.

    Args:
        dataset: the target clients' dataset (natural ids in ``groups``); its inputs are normalised with
            ``mean``/``std``, which is undone.
        b: style window half-width.
        size: ``(H, W)`` images are resized to for the FFT.
        mean: the dataset's per-channel normalisation mean.
        std: its per-channel standard deviation.
        chunk: images read at once.
    """
    pool = dataset.load_train()
    if pool.groups is None:
        raise ConfigError(
            f"{type(dataset).__name__} has no natural clients (groups), so it gives no pool of client styles; "
            "pass the target clients' dataset as --data.train_transform.init_args.target."
        )
    m, s = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]
    ids = np.unique(pool.groups)
    styles = []
    for client in ids:
        where = torch.from_numpy(np.flatnonzero(pool.groups == client))
        batches = ((pool.inputs[where[i : i + chunk]] * s + m).clamp(0, 1) for i in range(0, len(where), chunk))
        styles.append(client_style(batches, b, size))
    return torch.stack(styles), [str(i) for i in ids]


class StyleAugment(BatchTransform):
    """Restyles each source image with a style from the clients' pool, jitters its colours, then crops.

    Args:
        style_file: the pool of client styles (see the module docstring), written from ``target`` if missing;
            null restyles nothing and keeps the colour jitter and crops (LADD's source-only pre-training).
        target: the target clients' dataset, used only to compute a missing ``style_file``.
        b: style window half-width (1: LADD's 3×3; Table 6: 0, 1, 2).
        size: ``(H, W)`` images are resized to for the FFT (LADD: 512×1024).
        color_jitter: ``(brightness, contrast, saturation)`` of the colour jitter (LADD: 0.5 each; 0: none).
        mean: per-channel mean of the batches' normalisation (LADD: 0.5).
        std: per-channel standard deviation of it (LADD: 0.5).
        geometry: a transform applied last, e.g. :class:`~fedlight.data.transforms.RandomScaleCropFlip`.
    """

    def __init__(
        self,
        style_file: str | None,
        target: FederatedDataset | None = None,
        b: int | None = 1,
        size: tuple[int, int] = FDA_SIZE,
        color_jitter: tuple[float, float, float] = (0.5, 0.5, 0.5),
        mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
        std: tuple[float, float, float] = (0.5, 0.5, 0.5),
        geometry: BatchTransform | None = None,
    ) -> None:
        flag = _FLAG
        problems = []
        if any(not 0 <= j < 1 for j in color_jitter):
            problems.append(f"Expected every {flag}.color_jitter in [0, 1), got {list(color_jitter)}.")
        if min(std) <= 0:
            problems.append(f"Expected {flag}.std > 0 per channel, got {list(std)}.")
        if problems:
            raise ConfigError(*problems)
        self.style_file = None if style_file is None else Path(style_file)
        self.target = target
        self.b = window_half_width(tuple(size), b)
        self.size = (int(size[0]), int(size[1]))
        self.color_jitter = tuple(float(j) for j in color_jitter)
        self.mean = torch.tensor(mean, dtype=torch.float32)[:, None, None]
        self.std = torch.tensor(std, dtype=torch.float32)[:, None, None]
        self.geometry = geometry
        self._styles: Tensor | None = None

    @property
    def styles(self) -> Tensor:
        """``[K, D]`` the pool, read (or computed and written) and checked by :meth:`setup`."""
        if self._styles is None:
            self.setup()
        return self._styles

    def setup(self) -> None:
        """Reads the pool (computing and writing it first if it is missing) and checks it, once, when the data
        are set up: a damaged file is one error naming it before the run starts, not a failure in every fit."""
        if self.style_file is not None and self._styles is None:
            if not self.style_file.is_file():
                self._write_pool()
            self._styles = self._read_pool()

    def _write_pool(self) -> None:
        if self.target is None:
            raise ConfigError(
                f"Style pool {self.style_file} not found ({_FLAG}.style_file). Give the target clients' dataset as "
                f"{_FLAG}.target to compute and write it."
            )
        styles, ids = style_pool(self.target, self.b, self.size, tuple(self.mean.flatten().tolist()),
                                 tuple(self.std.flatten().tolist()))  # fmt: skip
        self.style_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.style_file.with_name(f".{self.style_file.name}.{os.getpid()}.tmp")
        torch.save({"styles": styles, "client_ids": ids, "b": self.b, "size": list(self.size)}, tmp)
        os.replace(tmp, self.style_file)  # a run killed while writing leaves no half pool

    def _read_pool(self) -> Tensor:
        """The pool of ``style_file`` after checking its keys, shape, values and client ids."""
        where = f"Style pool {self.style_file} ({_FLAG}.style_file)"
        fix = f"Delete the file to recompute it from {_FLAG}.target, or restore it."
        try:
            saved: Any = torch.load(self.style_file, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated, not a torch file, unpickling refused: all mean a damaged file
            raise ConfigError(f"{where} cannot be read ({type(err).__name__}: {err}). {fix}") from None
        if not isinstance(saved, dict) or not isinstance(saved.get("styles"), Tensor):
            raise ConfigError(f"{where} holds no 'styles' tensor. {fix}")
        styles, ids = saved["styles"], saved.get("client_ids")
        side = 2 * self.b + 1
        if (
            styles.ndim != 2
            or styles.shape[1] != 3 * side * side
            or list(saved.get("size", self.size)) != list(self.size)
        ):
            raise ConfigError(
                f"{where} holds styles of shape {tuple(styles.shape)} taken at size {saved.get('size')}, but "
                f"b={self.b} and size={list(self.size)} need [K, {3 * side * side}] at that size. Delete the file to "
                "recompute it, or match the options it was written with."
            )
        problems = []
        if len(styles) == 0:
            problems.append(f"{where} holds no style.")
        if not styles.is_floating_point():
            problems.append(f"{where} holds {styles.dtype} styles, not floating-point amplitudes.")
        else:
            bad = ~(torch.isfinite(styles) & (styles >= 0)).all(dim=1)  # amplitudes are finite and ≥ 0
            if bad.any():
                named = [
                    ids[i] if isinstance(ids, list) and i < len(ids) else i for i in bad.nonzero().flatten().tolist()
                ]
                problems.append(
                    f"{where} holds non-finite or negative amplitudes in {int(bad.sum())} of {len(styles)} styles "
                    f"(clients {named[:5]})."
                )
        if not isinstance(ids, list) or len(ids) != len(styles) or len(set(map(str, ids))) != len(ids):
            problems.append(
                f"{where} needs one distinct client id per style in 'client_ids': {len(styles)} styles, "
                f"{len(ids) if isinstance(ids, list) else 'no list of'} ids."
            )
        if problems:
            raise ConfigError(*problems, fix)
        return styles

    def __call__(self, x: Tensor, y: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``[B, 3, H, W]`` normalised source images and ``[B, H, W]`` labels → restyled, jittered, cropped."""
        mean, std = self.mean.to(x), self.std.to(x)
        raw = (x * std + mean).clamp(0.0, 1.0)  # [B, 3, H, W] RGB in [0, 1]
        if self.style_file is not None:
            chosen = torch.randint(len(self.styles), (len(x),), generator=generator)  # one client style per image
            raw = apply_style(raw, self.styles[chosen], self.b, self.size)
        raw = self._jitter(raw, generator)
        x = (raw - mean) / std
        if self.geometry is not None:
            x, y = self.geometry(x, y, generator)
        return x, y

    def output_size(self, size: tuple[int, int]) -> tuple[int, int]:
        return tuple(size) if self.geometry is None else self.geometry.output_size(size)

    def _jitter(self, raw: Tensor, generator: torch.Generator) -> Tensor:
        """Brightness, contrast and saturation factors per image, uniform in [1 − j, 1 + j]."""
        factors = 1 + (2 * torch.rand(3, len(raw), generator=generator) - 1) * torch.tensor(self.color_jitter)[:, None]
        brightness, contrast, saturation = (f.to(raw)[:, None, None, None] for f in factors)  # [B, 1, 1, 1]
        luma = torch.tensor(_LUMA).to(raw)[:, None, None]
        raw = (raw * brightness).clamp(0, 1)
        grey_mean = (raw * luma).sum(1, keepdim=True).mean(dim=(2, 3), keepdim=True)  # [B, 1, 1, 1]
        raw = (grey_mean + contrast * (raw - grey_mean)).clamp(0, 1)
        grey = (raw * luma).sum(1, keepdim=True)  # [B, 1, H, W]
        return (grey + saturation * (raw - grey)).clamp(0, 1)
