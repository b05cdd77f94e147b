"""DAFormer (Hoyer, Dai & Van Gool, *DAFormer: Improving Network Architectures and Training Strategies for
Domain-Adaptive Semantic Segmentation*, CVPR 2022): the centralized UDA row of LADD's Table 2 (Shenaj et al.,
WACV 2023), where GTA5's labelled images and Cityscapes' unlabelled ones are trained on together.

The network (Sec. 3.2 of the DAFormer paper) is a Mix Transformer (MiT-B5) encoder with a context-aware fusion
decoder (:mod:`fedlight.models.daformer`). Each step takes a source batch (x_S, y_S) and a target batch x_T and
minimises

    L = CE(f_θ(x_S), y_S) + λ_FD · L_FD + CE_q(f_θ(x_M), y_M),

- **self-training** with a mean teacher φ ← α φ + (1 − α) θ (:func:`ema_update`, α = 0.999): the teacher labels the
  target ŷ_T = argmax f_φ(x_T), and the mixed loss weighs its pixels by q_T, the share of the image's pixels whose
  largest probability exceeds τ = 0.968 (:func:`confidence_weight`);
- **ClassMix** (after DACS): half of the classes of each source image are pasted on a target image, x_M = M x_S +
  (1 − M) x_T, y_M = M y_S + (1 − M) ŷ_T (:func:`class_mix_masks`), source pixels with weight 1;
- **rare-class sampling** (Sec. 3.3): a source image is drawn by first drawing a class with
  P(c) ∝ exp((1 − f_c) / T), f_c its share of the source's labelled pixels, T = 0.01 (:func:`rcs_probabilities`),
  then an image holding that class (:class:`RareClassSampling`);
- **thing-class ImageNet feature distance** (Sec. 3.4): the mean over thing-class pixels of the L2 distance between
  the encoder's bottleneck features and those of the frozen ImageNet encoder on x_S (:func:`feature_distance`,
  λ_FD = 0.005);
- **learning-rate warm-up** (Sec. 3.5): linear over the first 1,500 iterations, then polynomial decay
  (:func:`warmup_poly_factor`); AdamW with the decoder at 10× the encoder's rate.

The client holds the source (``source``, GTA5) as MCD's does; the target is the run's data (Cityscapes, every
client's images in one place with ``--data.centralized``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlight.clients.base import OptimizerCallable
from fedlight.clients.segmentation import SegmentationClient
from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.labels import IGNORE_INDEX
from fedlight.data.transforms import BatchTransform
from fedlight.errors import ConfigError

_FLAG = "--model.init_args"
#: Cityscapes' thing classes as DAFormer's feature distance reads them: traffic light, traffic sign, person, rider,
#: car, truck, bus, train, motorcycle, bicycle
CITYSCAPES_THINGS = (6, 7, 11, 12, 13, 14, 15, 16, 17, 18)


# -- the maths -------------------------------------------------------------------------------------------
def rcs_probabilities(class_pixels: Tensor, temperature: float) -> Tensor:
    """P(c) = exp((1 − f_c)/T) / Σ_c' exp((1 − f_c')/T) with f_c = n_c / Σ n: rare classes are drawn more often.

    Classes with no pixel (n_c = 0) get P(c) = 0: no image could show them.

    >>> rcs_probabilities(torch.tensor([3.0, 1.0, 0.0]), temperature=1.0)  # f = (¾, ¼, 0): e^¼ : e^¾ : 0
    tensor([0.3775, 0.6225, 0.0000], dtype=torch.float64)
    """
    counts = class_pixels.double()
    frequency = counts / counts.sum()  # f_c
    logits = ((1 - frequency) / temperature).masked_fill(counts == 0, float("-inf"))
    return logits.softmax(dim=0)


def class_mix_masks(
    labels: Tensor, generator: torch.Generator | None = None, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """ClassMix's masks M: per image, the pixels of ⌈n/2⌉ of its n labelled classes, drawn without replacement.

    Args:
        labels: ``[B, H, W]`` the source label maps; void pixels are no class and never pasted.
        generator: the draws' stream (torch's global one if None).
        ignore_index: the void label.

    Returns:
        ``[B, H, W]`` bool, True where the source pixel is pasted.
    """
    masks = torch.zeros_like(labels, dtype=torch.bool)
    for b, image in enumerate(labels):
        classes = image[image != ignore_index].unique()
        n = len(classes)
        chosen = classes[torch.randperm(n, generator=generator)[: (n + n % 2) // 2]]  # ⌈n/2⌉, DACS's rounding
        masks[b] = torch.isin(image, chosen.to(image.device))
    return masks


def mix(masks: Tensor, source: Tensor, target: Tensor) -> Tensor:
    """M · source + (1 − M) · target; ``masks`` ``[B, H, W]`` broadcast over the channels of ``[B, C, H, W]`` images.

    >>> mix(torch.tensor([[[True, False]]]), torch.ones(1, 2, 1, 2), torch.zeros(1, 2, 1, 2))[0, :, 0]
    tensor([[1., 0.],
            [1., 0.]])
    """
    m = masks if source.ndim == masks.ndim else masks.unsqueeze(1)
    return torch.where(m, source, target)


def confidence_weight(probs: Tensor, threshold: float) -> Tensor:
    """q_T per image: the share of its pixels whose largest class probability exceeds τ.

    >>> confidence_weight(torch.tensor([[[[0.99, 0.6]], [[0.01, 0.4]]]]), threshold=0.968)
    tensor([0.5000])
    """
    return (probs.max(dim=1).values > threshold).float().mean(dim=(1, 2))  # [B]


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, alpha: float) -> None:
    """φ ← α φ + (1 − α) θ on every floating-point entry of the state (weights and BatchNorm statistics).

    >>> teacher, student = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
    >>> _ = nn.init.constant_(teacher.weight, 1.0), nn.init.constant_(student.weight, 3.0)
    >>> ema_update(teacher, student, alpha=0.75); teacher.weight.item()  # 0.75 · 1 + 0.25 · 3
    1.5
    """
    student_state = student.state_dict()
    for name, value in teacher.state_dict().items():
        if value.is_floating_point():
            value.mul_(alpha).add_(student_state[name], alpha=1 - alpha)


def warmup_poly_factor(
    iteration: int, total: int, warmup: int, power: float = 1.0, warmup_ratio: float = 1e-6
) -> float:
    """The learning-rate factor of ``iteration`` (from 0) of ``total``: (1 − i/N)^power, scaled during the first
    ``warmup`` iterations by the linear ramp r + (1 − r)·i/W from r = ``warmup_ratio`` to 1.

    >>> round(warmup_poly_factor(750, 40_000, 1500), 6), warmup_poly_factor(20_000, 40_000, 1500)
    (0.490625, 0.5)
    """
    factor = max(0.0, 1.0 - iteration / total) ** power
    if iteration < warmup:
        factor *= warmup_ratio + (1 - warmup_ratio) * iteration / warmup
    return factor


def thing_mask(labels: Tensor, size: tuple[int, int], things: Tensor, min_ratio: float = 0.75) -> Tensor:
    """The feature cells of ``size`` that show a thing class: one class of ``things`` covers at least ``min_ratio``
    of the image pixels the cell pools (for ``min_ratio`` > ½, the cell's majority label is that thing).

    Args:
        labels: ``[B, H, W]`` label maps at image resolution (void pixels count against every class).
        size: ``(h, w)`` of the feature map.
        things: ``[K]`` the thing classes' labels.
        min_ratio: share of a cell the thing class must cover (0.75).

    Returns:
        ``[B, h, w]`` bool.
    """
    is_thing = (labels.unsqueeze(1) == things.to(labels.device)[None, :, None, None]).float()  # [B, K, H, W]
    return F.adaptive_avg_pool2d(is_thing, size).amax(dim=1) >= min_ratio


def feature_distance(features: Tensor, imagenet_features: Tensor, mask: Tensor) -> Tensor:
    """L_FD: the mean over the masked cells of ‖F_θ − F_ImageNet‖₂ across channels (0 when no cell is masked).

    >>> f, g = torch.zeros(1, 2, 1, 2), torch.tensor([[[[3.0, 1.0]], [[4.0, 1.0]]]])
    >>> feature_distance(f, g, torch.tensor([[[True, False]]])).item()  # ‖(3, 4)‖ = 5
    5.0
    """
    distance = (features.float() - imagenet_features.float()).norm(dim=1)  # [B, h, w]
    return (distance * mask).sum() / mask.sum().clamp(min=1)


# -- rare-class sampling ---------------------------------------------------------------------------------
class RareClassSampling:
    """DAFormer's rare-class sampling (Sec. 3.3) over a labelled pool: draw a class c with
    :func:`rcs_probabilities`, then uniformly one of the images that show at least ``min_pixels`` of it.

    Args:
        image_class_pixels: ``[N, Q]`` the pixels of each class in each image (void left out).
        temperature: T (0.01); smaller draws rare classes more often.
        min_pixels: the pixels of c an image must show to be drawn for c; a class no image shows that much of is
            never drawn.
    """

    def __init__(self, image_class_pixels: Tensor, temperature: float, min_pixels: int) -> None:
        self.eligible = image_class_pixels >= max(min_pixels, 1)  # [N, Q]
        available = self.eligible.any(dim=0)
        if not available.any():
            raise ConfigError(
                f"Rare-class sampling finds no source image with {min_pixels} pixels of any class: lower "
                f"{_FLAG}.rcs_min_pixel_share, or set {_FLAG}.rcs_temperature=null to draw images uniformly."
            )
        class_pixels = image_class_pixels.sum(dim=0).double()
        self.probabilities = rcs_probabilities(class_pixels, temperature) * available  # P(c) of drawable classes
        self.probabilities /= self.probabilities.sum()
        self.min_pixels = min_pixels

    @classmethod
    def from_labels(
        cls, targets: Tensor | Any, num_classes: int, temperature: float, min_pixel_share: float, ignore_index: int
    ) -> RareClassSampling:
        """Counts every label map's class pixels in one pass over ``targets`` (``[N, H, W]``, resident or read on
        demand), 16 maps at a time; ``min_pixels`` is ``min_pixel_share`` of one map's pixels."""
        counts = []
        for start in range(0, len(targets), 16):
            labels = targets[torch.arange(start, min(start + 16, len(targets)))].long()  # [b, H, W]
            labels = torch.where(labels == ignore_index, num_classes, labels).flatten(1)  # void → an extra bin
            offsets = torch.arange(len(labels)).unsqueeze(1) * (num_classes + 1)
            bins = torch.bincount((labels + offsets).flatten(), minlength=len(labels) * (num_classes + 1))
            counts.append(bins.view(len(labels), num_classes + 1)[:, :num_classes])
        image_pixels = targets.shape[1] * targets.shape[2]
        return cls(torch.cat(counts), temperature, round(min_pixel_share * image_pixels))

    def draw(self, generator: torch.Generator | None = None) -> tuple[int, int]:
        """A class c ~ P(c), then the index of an image that shows it, uniformly."""
        c = int(torch.multinomial(self.probabilities.float(), 1, generator=generator))
        images = self.eligible[:, c].nonzero().squeeze(1)
        return c, int(images[torch.randint(len(images), (), generator=generator)])


# -- the client ------------------------------------------------------------------------------------------
def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01)


def _pixel_mean_ce(logits: Tensor, labels: Tensor, ignore_index: int, weights: Tensor | None = None) -> Tensor:
    """Cross-entropy averaged over every pixel, void ones counting 0 (the mean DAFormer's losses take)."""
    pixel_loss = F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="none")  # [B, H, W]
    return (pixel_loss if weights is None else pixel_loss * weights).mean()


class DAFormerClient(SegmentationClient):
    """DAFormer's UDA training (the module docstring) on one client holding the target images and the source.

    The EMA teacher and the frozen ImageNet encoder live beside the network: the teacher's parameters keep
    ``requires_grad`` so that the engine carries and checkpoints them with the student's (no optimizer holds them,
    and it always runs in eval mode); the ImageNet encoder is a frozen module, loaded once.

    Args:
        num_classes: number of classes Q; filled in from ``--data`` by the command line.
        input_shape: shape of one input; filled in from ``--data``.
        source: the labelled source dataset (GTA5 with the target's classes).
        source_transform: augmentation of each source image (DAFormer: a 512×512 random crop and a flip), drawn from
            the client's stream; its crop must match the target batches'.
        model: a network with ``encode``/``decode`` and an ``encoder`` (``daformer``).
        model_kwargs: its arguments (``encoder_name``, ``pretrained``).
        optimizer: the optimizer, re-created every round (AdamW, lr 6e-5, weight decay 0.01); the encoder's norm
            layers get no weight decay.
        head_lr_mult: the decoder's learning rate over the encoder's (10).
        warmup_iters: iterations of the linear warm-up (1,500).
        poly_power: power of the polynomial decay over the run (1).
        ema_alpha: α of the teacher's update (0.999); iteration i uses min(1 − 1/(i + 1), α).
        pseudo_threshold: τ of the confidence weight q_T (0.968).
        pseudo_ignore_rows: ``[top, bottom]`` rows of each target crop whose pseudo-labels weigh 0 (DAFormer's
            Cityscapes setting: 15 and 120, the image's border and the ego car).
        fd_lambda: λ_FD, the weight of the thing-class feature distance (0.005); 0 drops it.
        fd_classes: the thing classes' labels (Cityscapes': traffic light, sign, person … bicycle).
        fd_min_ratio: share of a feature cell its label must cover to count (0.75).
        rcs_temperature: T of rare-class sampling (0.01); null draws source images uniformly.
        rcs_min_pixel_share: share of an image's pixels a class must cover for rare-class sampling to draw the image
            for it (DAFormer's 3,000 of a 1280×720 image).
        rcs_crop_tries: augmentations drawn at most until the crop shows half ``min_pixels`` of the drawn class.
        ignore_index: label of void pixels.
    """

    def __init__(
        self,
        num_classes: int,
        input_shape: tuple[int, ...],
        source: FederatedDataset,
        source_transform: BatchTransform | None = None,
        model: str = "daformer",
        model_kwargs: dict[str, Any] | None = None,
        optimizer: OptimizerCallable = _adamw,
        head_lr_mult: float = 10.0,
        warmup_iters: int = 1500,
        poly_power: float = 1.0,
        ema_alpha: float = 0.999,
        pseudo_threshold: float = 0.968,
        pseudo_ignore_rows: tuple[int, int] = (0, 0),
        fd_lambda: float = 0.005,
        fd_classes: tuple[int, ...] = CITYSCAPES_THINGS,
        fd_min_ratio: float = 0.75,
        rcs_temperature: float | None = 0.01,
        rcs_min_pixel_share: float = 3000 / (1280 * 720),
        rcs_crop_tries: int = 10,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        problems = []
        if not 0.0 <= ema_alpha < 1.0:
            problems.append(f"Expected {_FLAG}.ema_alpha in [0, 1), got {ema_alpha}.")
        if warmup_iters < 0 or head_lr_mult <= 0 or fd_lambda < 0 or rcs_crop_tries < 1:
            problems.append(
                f"Expected {_FLAG}.warmup_iters ≥ 0, head_lr_mult > 0, fd_lambda ≥ 0 and rcs_crop_tries ≥ 1, got "
                f"{warmup_iters}, {head_lr_mult}, {fd_lambda} and {rcs_crop_tries}."
            )
        if rcs_temperature is not None and rcs_temperature <= 0:
            problems.append(f"Expected {_FLAG}.rcs_temperature > 0 or null (uniform draws), got {rcs_temperature}.")
        if any(not 0 <= c < num_classes for c in fd_classes):
            problems.append(f"{_FLAG}.fd_classes={list(fd_classes)} names classes outside 0…{num_classes - 1}.")
        if source.num_classes != num_classes:
            problems.append(
                f"{_FLAG}.source has {source.num_classes} classes, the target data {num_classes}: give the source "
                "the target's classes (GTA5's target option)."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(num_classes, input_shape, model, model_kwargs, optimizer, poly_power, ignore_index)
        if not all(hasattr(self.net, part) for part in ("encode", "decode", "encoder")):
            raise ConfigError(f"{_FLAG}.model={model!r} has no encode/decode/encoder: use 'daformer'.")
        self.ema_teacher = copy.deepcopy(self.net)  # φ, set to θ again at set-up
        self.imagenet_encoder = copy.deepcopy(self.net.encoder).requires_grad_(False) if fd_lambda > 0 else None
        self.frozen_modules = ("imagenet_encoder",) if fd_lambda > 0 else ()
        self.source, self.source_transform = source, source_transform
        self.head_lr_mult, self.warmup_iters = head_lr_mult, warmup_iters
        self.ema_alpha, self.pseudo_threshold, self.pseudo_ignore_rows = ema_alpha, pseudo_threshold, pseudo_ignore_rows
        self.fd_lambda, self.fd_min_ratio = fd_lambda, fd_min_ratio
        self.register_buffer("fd_classes", torch.tensor(fd_classes, dtype=torch.long), persistent=False)
        self.rcs_temperature, self.rcs_min_pixel_share, self.rcs_crop_tries = (
            rcs_temperature, rcs_min_pixel_share, rcs_crop_tries,
        )  # fmt: skip
        self._source_pool: LabelledTensors | None = None
        self._rcs: RareClassSampling | None = None
        self._fit_step = 0  # steps taken in the current local fit

    def train(self, mode: bool = True) -> DAFormerClient:
        super().train(mode)
        self.ema_teacher.eval()  # the teacher labels, it never trains
        return self

    # -- set-up --------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Loads the ImageNet encoder (when ``pretrained``), starts φ and the frozen ImageNet encoder from the
        network, and counts the source's class pixels for rare-class sampling (one pass over its label maps)."""
        super().configure_model()
        self.ema_teacher.load_state_dict(self.net.state_dict())
        if self.imagenet_encoder is not None:
            self.imagenet_encoder.load_state_dict(self.net.encoder.state_dict())
        self.rcs  # noqa: B018  (computed now: its cost and its errors belong to set-up)

    @property
    def source_pool(self) -> LabelledTensors:
        """The source's training pool, read on first use."""
        if self._source_pool is None:
            self._source_pool = self.source.load_train()
        return self._source_pool

    @property
    def rcs(self) -> RareClassSampling | None:
        """Rare-class sampling over the source (None when ``rcs_temperature`` is null), built on first use."""
        if self._rcs is None and self.rcs_temperature is not None:
            targets = self.source_pool.targets
            self._rcs = RareClassSampling.from_labels(
                targets, self.num_classes, self.rcs_temperature, self.rcs_min_pixel_share, self.ignore_index
            )
        return self._rcs

    def source_batch(self, size: int) -> tuple[Tensor, Tensor]:
        """``size`` source images ``[B, 3, H, W]`` and label maps ``[B, H, W]``, each drawn by rare-class sampling
        (or uniformly) from torch's generator (the client's stream during a fit) and augmented by
        ``source_transform``, re-drawn until the crop shows half ``min_pixels`` of the image's drawn class."""
        pool, rcs, images, labels = self.source_pool, self.rcs, [], []
        for _ in range(size):
            c, index = rcs.draw() if rcs is not None else (None, int(torch.randint(len(pool), ())))
            generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))  # the augmentations' draws
            x = pool.inputs[torch.tensor([index])].to(self.device, torch.float32)
            y = pool.targets[torch.tensor([index])].to(self.device, torch.long)
            for _ in range(self.rcs_crop_tries if c is not None else 1):
                crop_x, crop_y = (x, y) if self.source_transform is None else self.source_transform(x, y, generator)
                if c is None or (crop_y == c).sum() >= rcs.min_pixels / 2:
                    break
            images.append(crop_x)
            labels.append(crop_y)
        return torch.cat(images), torch.cat(labels)

    # -- training -------------------------------------------------------------------------------------------
    def iteration(self) -> int:
        """The run's iteration i of the next step (from 0): the rounds before this one, then this fit's steps."""
        fit = self.local_fit
        return (0 if fit is None else fit.round_idx * fit.num_steps) + self._fit_step

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> dict[str, Tensor]:
        target_x = batch[0]  # batch[1], the target's labels, stays unread
        iteration = self.iteration()
        if iteration > 0:  # φ follows the θ of the previous step
            ema_update(self.ema_teacher, self.net, min(1 - 1 / (iteration + 1), self.ema_alpha))
        self._fit_step += 1
        source_x, source_y = self.source_batch(len(target_x))
        if source_x.shape != target_x.shape:
            raise ConfigError(
                f"Source crops {tuple(source_x.shape[-2:])} and target crops {tuple(target_x.shape[-2:])} differ, so "
                f"ClassMix cannot paste one on the other: give {_FLAG}.source_transform and --data.train_transform "
                "the same crop_size."
            )
        levels = self.net.encode(source_x)  # 4 × [B, C_i, H/s, W/s]
        loss_source = _pixel_mean_ce(self.net.decode(levels, source_x.shape[-2:]), source_y, self.ignore_index)
        outputs = {"loss_source": loss_source.detach()}
        loss = loss_source
        if self.imagenet_encoder is not None:
            with torch.no_grad():
                imagenet_features = self.imagenet_encoder(source_x)[-1]  # [B, C_4, H/32, W/32]
            things = thing_mask(source_y, levels[-1].shape[-2:], self.fd_classes, self.fd_min_ratio)
            loss_fd = feature_distance(levels[-1], imagenet_features, things)
            loss = loss + self.fd_lambda * loss_fd
            outputs["loss_fd"] = loss_fd.detach()
        with torch.no_grad():
            probs = self.ema_teacher(target_x).float().softmax(dim=1)  # [B, Q, H, W]
        pseudo_labels = probs.argmax(dim=1)  # ŷ_T
        weight = confidence_weight(probs, self.pseudo_threshold)  # q_T: [B]
        pixel_weight = weight[:, None, None].expand_as(pseudo_labels).clone()
        top, bottom = self.pseudo_ignore_rows
        pixel_weight[:, :top] = 0
        pixel_weight[:, pixel_weight.shape[1] - bottom :] = 0
        masks = class_mix_masks(source_y, ignore_index=self.ignore_index)  # M: [B, H, W]
        mixed_x = mix(masks, source_x, target_x)
        mixed_y = mix(masks, source_y, pseudo_labels)
        mixed_weight = mix(masks, torch.ones_like(pixel_weight), pixel_weight)
        loss_mix = _pixel_mean_ce(self.net(mixed_x), mixed_y, self.ignore_index, mixed_weight)
        loss = loss + loss_mix
        return {"loss": loss, **outputs, "loss_mix": loss_mix.detach(), "pseudo_weight": weight.mean()}

    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        """The optimizer over the network (not φ, not the ImageNet encoder) in three groups: the encoder, its norm
        layers without weight decay, the decoder at ``head_lr_mult`` times the rate; with the warm-up and the
        polynomial decay over the run's iterations (rounds × steps per fit)."""
        self._fit_step = 0
        encoder = dict(self.net.encoder.named_parameters())
        norms = [p for name, p in encoder.items() if "norm" in name]
        others = [p for name, p in encoder.items() if "norm" not in name]
        head = [p for name, p in self.net.named_parameters() if not name.startswith("encoder.")]
        optimizer = self.optimizer([{"params": others}, {"params": norms, "weight_decay": 0.0}, {"params": head}])
        optimizer.param_groups[2]["lr"] *= self.head_lr_mult
        fit = self.local_fit
        if fit is None:
            return optimizer
        start, total = fit.round_idx * fit.num_steps, fit.rounds * fit.num_steps
        warmup, power = self.warmup_iters, self.poly_power
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_poly_factor(start + step, total, warmup, power)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
