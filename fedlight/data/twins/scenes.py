"""Procedural scenes: an offline stand-in for Pascal VOC (segmentation) and small image benchmarks (classification).

Every image is a textured background with one foreground object, so, as in MO-FedProto's filtered
Pascal VOC, each image holds exactly one object class and the VOC partitioners
apply unchanged. The object's class decides three cues at once, so a network can tell classes apart
by any of them:

- shape: ``c mod 5`` of disk, square, triangle, ring, cross (size, position and rotation random);
- colour: hue family ``c div 5`` of red, green, blue, yellow (brightness and tint jittered);
- texture: ``c mod 4`` of plain, horizontal stripes, vertical stripes, checker (frequency random),

where c = 0…19 indexes the 20 object classes, named after VOC's. The background mixes a few random
low-frequency colour waves with pixel noise. A band just outside the object is void (255) in the label
maps, one pixel wide by default, like VOC's annotation borders; the object itself stays whole, so small
images keep thin shapes (rings, crosses) labelled.

Labels follow VOC: ``label_set="fine"`` has background 0 and the classes 1…20 (21 in all),
``"macro"`` MO-FedProto's 4 groups (5 with background, :mod:`fedlight.data.labels`). In
``mode="classification"`` the label is the object class without background (0…19, or 0…3 for macro);
images of 32×32 then make a CIFAR-sized benchmark.

Everything is drawn from ``torch.Generator(seed)`` in chunks of fixed size, so one seed gives the same
pool on every machine and for every chunking of the work; the separate test set uses another stream of
the same seed. 2,000 images of 64×64 take 2–3 s to draw on one core.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.labels import IGNORE_INDEX, VOC_CLASSES, LabelSet, class_names, macro_lookup
from fedlight.errors import ConfigError

_NUM_SHAPES, _NUM_TEXTURES = 5, 4
_HUES = torch.tensor([[0.85, 0.15, 0.15], [0.15, 0.75, 0.2], [0.15, 0.3, 0.9], [0.9, 0.8, 0.1]])  # [4, 3] RGB
_CHUNK = 256  # images drawn per step: bounds memory at large sizes, fixed so results do not depend on it
_TRAIN_STREAM, _TEST_STREAM = 0, 1


class Scenes(FederatedDataset):
    """Seeded procedural scenes with one object each, labelled like Pascal VOC.

    Inputs are ``[N, 3, S, S]`` float32, standardised to about zero mean and unit variance. Targets are
    ``[N, S, S]`` int64 label maps with void borders (255) in ``segmentation`` mode and ``[N]`` object
    classes in ``classification`` mode. The image-level fine class goes to partitioners in both modes
    (``LabelledTensors.labels``), so the fine and macro variants of one seed share one partition.
    There are no natural clients.

    Args:
        mode: ``segmentation`` (per-pixel labels with background) or ``classification`` (one label per
            image: the object class, without background).
        label_set: ``fine``, the 20 VOC-named classes, or ``macro``, MO-FedProto's 4 groups of them
            (needs all 20 classes). Segmentation adds background as class 0.
        num_object_classes: use the first this many of the 20 object classes (e.g. 10 for a
            CIFAR-10-sized classification benchmark).
        num_samples: images in the pool that is partitioned over clients.
        num_test_samples: images of a separate global test set drawn from the same distribution; 0 means
            none (the union of the clients' held-out splits is then the test set).
        image_size: side S of the square images (64 for segmentation tests, 32 for classification).
        void_border: width in pixels of the void (255) band around the object in the label maps; 0 for
            none.
        seed: seed of the drawing; the test set uses a separate stream of the same seed.
    """

    def __init__(
        self,
        mode: Literal["segmentation", "classification"] = "segmentation",
        label_set: LabelSet = "fine",
        num_object_classes: int = 20,
        num_samples: int = 2000,
        num_test_samples: int = 0,
        image_size: int = 64,
        void_border: int = 1,
        seed: int = 0,
    ) -> None:
        flag = "--data.dataset.init_args"
        problems = []
        if not 1 <= num_object_classes <= 20:
            problems.append(f"Expected {flag}.num_object_classes in [1, 20], got {num_object_classes}.")
        if label_set == "macro" and num_object_classes != 20:
            problems.append(
                f"{flag}.label_set=macro groups all 20 object classes; got num_object_classes={num_object_classes}. "
                "Use label_set=fine for a subset of the classes."
            )
        if num_samples < 1:
            problems.append(f"Expected {flag}.num_samples ≥ 1, got {num_samples}.")
        if num_test_samples < 0:
            problems.append(f"Expected {flag}.num_test_samples ≥ 0 (0: no separate test set), got {num_test_samples}.")
        if image_size < 8:
            problems.append(f"Expected {flag}.image_size ≥ 8 pixels, got {image_size}.")
        if void_border < 0:
            problems.append(f"Expected {flag}.void_border ≥ 0 pixels, got {void_border}.")
        if problems:
            raise ConfigError(*problems)
        self.mode = mode
        self.label_set = label_set
        self.num_object_classes = num_object_classes
        self.num_samples = num_samples
        self.num_test_samples = num_test_samples
        self.image_size = image_size
        self.void_border = void_border
        self.seed = seed
        num_labels = 4 if label_set == "macro" else num_object_classes
        self.num_classes = num_labels + (mode == "segmentation")
        # background (class 0) is a class of the label maps only; classification numbers the objects from 0
        self.class_names = class_names(label_set)[: num_labels + 1][mode == "classification" :]
        self.input_shape = (3, image_size, image_size)
        #: the name of every partition label: VOC's numbering (background first) or, to classify, the objects only
        self.partition_classes = VOC_CLASSES[: num_object_classes + 1][mode == "classification" :]

    def load_train(self) -> LabelledTensors:
        """Draws the pool that is partitioned over clients."""
        return self._draw(self.num_samples, _TRAIN_STREAM)

    def load_test(self) -> LabelledTensors | None:
        """Draws the separate test set, or returns ``None`` when ``num_test_samples`` is 0."""
        return self._draw(self.num_test_samples, _TEST_STREAM) if self.num_test_samples else None

    def _draw(self, num_images: int, stream: int) -> LabelledTensors:
        # generate_state, not .entropy: the entropy is the root seed alone, so every stream would be the same
        sequence = np.random.SeedSequence(self.seed, spawn_key=(stream,))
        generator = torch.Generator().manual_seed(int(sequence.generate_state(1, dtype=np.uint64)[0] >> 1))
        images, masks, classes = [], [], []
        for start in range(0, num_images, _CHUNK):
            count = min(_CHUNK, num_images - start)
            chunk_classes = torch.randint(self.num_object_classes, (count,), generator=generator)
            chunk_images, chunk_masks = render_scenes(chunk_classes, self.image_size, generator, self.void_border)
            images.append(chunk_images)
            masks.append(chunk_masks)
            classes.append(chunk_classes)
        fine = torch.cat(classes)  # [N] object class 0…19
        image_labels = fine.numpy() + (self.mode == "segmentation")  # VOC's numbering in segmentation
        if self.mode == "classification":
            targets = macro_lookup()[fine + 1] - 1 if self.label_set == "macro" else fine
        else:
            targets = torch.cat(masks)  # [N, S, S]: 0 background, c + 1 object, 255 void
            if self.label_set == "macro":
                targets = macro_lookup()[targets]
        return LabelledTensors(inputs=torch.cat(images), targets=targets, labels=image_labels.astype(np.int64))


def render_scenes(
    classes: torch.Tensor, size: int, generator: torch.Generator, void_border: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one scene per object class in ``classes``.

    Args:
        classes: ``[B]`` object classes in ``[0, 20)``.
        size: image side S.
        generator: the source of every random draw.
        void_border: width of the void band around the object in the label maps.

    Returns:
        ``([B, 3, S, S]`` standardised images, ``[B, S, S]`` int64 label maps with 0 background, ``c + 1`` the
        object and 255 the band around it).

    >>> images, masks = render_scenes(torch.tensor([0, 7]), 32, torch.Generator().manual_seed(0))
    >>> images.shape, masks.shape, sorted(masks[1].unique().tolist())
    (torch.Size([2, 3, 32, 32]), torch.Size([2, 32, 32]), [0, 8, 255])
    """
    batch = len(classes)

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(batch, *shape, generator=generator)

    axis = torch.linspace(-1.0, 1.0, size)
    y, x = torch.meshgrid(axis, axis, indexing="ij")  # [S, S] each, image coordinates in [-1, 1]

    # background: a few random colour waves plus pixel noise, [B, 3, S, S] in about [0, 1]
    background = uniform(0.3, 0.7, 3, 1, 1).expand(batch, 3, size, size).clone()
    for _ in range(3):
        angle, frequency, phase = uniform(0, math.pi, 1, 1), uniform(1.0, 4.0, 1, 1), uniform(0, 2 * math.pi, 1, 1)
        wave = torch.sin(frequency * math.pi * (x * torch.cos(angle) + y * torch.sin(angle)) + phase)  # [B, S, S]
        background += uniform(-0.2, 0.2, 3, 1, 1) * wave[:, None]

    # object geometry in its own rotated, centred, scaled frame (u, v), |u|, |v| ≲ 1 inside the object
    centre_x, centre_y = uniform(-0.3, 0.3, 1, 1), uniform(-0.3, 0.3, 1, 1)
    radius, rotation = uniform(0.35, 0.6, 1, 1), uniform(0, 2 * math.pi, 1, 1)
    dx, dy = x - centre_x, y - centre_y  # [B, S, S]
    u = (dx * torch.cos(rotation) + dy * torch.sin(rotation)) / radius
    v = (-dx * torch.sin(rotation) + dy * torch.cos(rotation)) / radius
    rho = torch.sqrt(u**2 + v**2)
    shapes = torch.stack(
        [
            rho <= 1.0,  # disk
            torch.maximum(u.abs(), v.abs()) <= 0.8,  # square
            (v >= -0.5) & (math.sqrt(3) * u + v <= 1.0) & (-math.sqrt(3) * u + v <= 1.0),  # triangle
            (rho <= 1.0) & (rho >= 0.5),  # ring
            ((u.abs() <= 0.3) | (v.abs() <= 0.3)) & (torch.maximum(u.abs(), v.abs()) <= 1.0),  # cross
        ],
        dim=1,
    )  # [B, 5, S, S]
    inside = shapes[torch.arange(batch), classes % _NUM_SHAPES]  # [B, S, S]

    # object appearance: jittered hue family, modulated by the class's texture
    colour = _HUES[classes // _NUM_SHAPES] * uniform(0.8, 1.15, 1) + uniform(-0.08, 0.08, 3)  # [B, 3]
    stripes = uniform(3.0, 6.0, 1, 1)
    horizontal, vertical = torch.sin(stripes * math.pi * v) >= 0, torch.sin(stripes * math.pi * u) >= 0
    textures = torch.stack(
        [torch.ones_like(horizontal), horizontal, vertical, horizontal ^ vertical], dim=1
    ).float()  # [B, 4, S, S]
    pattern = textures[torch.arange(batch), classes % _NUM_TEXTURES]  # [B, S, S] in {0, 1}
    foreground = colour[:, :, None, None] * (0.65 + 0.35 * pattern[:, None])  # [B, 3, S, S]

    image = torch.where(inside[:, None], foreground, background)
    image = image + 0.04 * torch.randn(image.shape, generator=generator)
    image = (image.clamp(0.0, 1.0) - 0.5) / 0.25  # about zero mean, unit variance

    masks = torch.where(inside, classes[:, None, None] + 1, 0)
    if void_border > 0:
        kernel = 2 * void_border + 1
        near = F.max_pool2d(inside[:, None].float(), kernel, stride=1, padding=void_border)[:, 0] > 0
        masks = torch.where(near & ~inside, IGNORE_INDEX, masks)
    return image.float(), masks.long()
