"""Procedural street scenes in cities of their own: an offline twin of FUSS's Cityscapes federations.

Each image is a street seen from the road: sky on top, a band of façades (buildings, walls, fences,
vegetation…) as vertical strips, the ground below (road in the middle, a sidewalk, terrain or parking on each
side), and a few objects (cars, people, poles, signs…) standing on it. Classes are Cityscapes' 27 (labelIds
7…33 renumbered 0…26, in that order) or a 12-class subset for tests; each class has a role (sky, façade,
ground, object) that decides where it may appear.

A class looks the same everywhere up to its city: it has a base colour and one of four textures (plain,
horizontal or vertical stripes, checker) with its own frequency, as in :mod:`fedlight.data.twins.scenes`. The base
colours are by default the 27 points of the grid {0.2, 0.5, 0.8}³ in a seeded order, so any two classes differ
by at least 0.3 in one channel; ``class_colours="random"`` draws them uniformly instead, which puts some
classes so close that a city's palette turns one into another and no patch feature can tell them apart. A *city*
is a client (``groups`` are city ids, so ``Natural`` partitions by city) and differs from the others in

- its palette: a colour transform near the identity (tint, contrast) applied to every class;
- its textures: a scale of every class's stripe frequency;
- its class frequencies: Dirichlet(1) weights within every role, so one city has many buses and few
  trucks, another the reverse.

The separate test set is drawn from further cities, as Cityscapes validates on three cities that no client
holds. Labels are only for evaluation: FUSS's clients never read them (only the supervised linear probe
does). Everything is drawn from ``torch.Generator(seed)`` streams, so one seed gives one dataset.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.labels import CITYSCAPES_27
from fedlight.errors import ConfigError

#: The 12 classes of the small variant (names of CITYSCAPES_27), in this order.
STREET_12 = (
    "road", "sidewalk", "building", "wall", "fence", "pole", "traffic sign", "vegetation", "terrain", "sky",
    "person", "car",
)  # fmt: skip
#: the per-channel mean and scale that standardise the images (what a dense CRF needs to see their colours)
PIXEL_MEAN, PIXEL_STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)

_ROLES = {
    "sky": ("sky",),
    "facade": ("building", "wall", "fence", "guard rail", "bridge", "tunnel", "vegetation"),
    "ground": ("road", "sidewalk", "parking", "rail track", "terrain"),
    "object": (
        "pole", "polegroup", "traffic light", "traffic sign", "person", "rider", "car", "truck", "bus",
        "caravan", "trailer", "train", "motorcycle", "bicycle",
    ),
}  # fmt: skip
_TRAIN_STREAM, _TEST_STREAM, _STYLE_STREAM = 0, 1, 2


class StreetScenes(FederatedDataset):
    """Street scenes from ``num_cities`` client cities and a test set from ``num_test_cities`` others.

    Inputs are ``[N, 3, S, S]`` float32 standardised to about zero mean and unit variance; targets are
    ``[N, S, S]`` int64 label maps (every pixel labelled). ``groups`` give each image's city.

    Args:
        num_classes: 27 (Cityscapes' classes) or 12 (a subset, for quick runs).
        num_cities: client cities.
        images_per_city: training images of every city.
        num_test_cities: further cities the test set is drawn from.
        num_test_samples: images of the test set.
        image_size: side S (a multiple of 8 for patch-8 backbones).
        style_strength: how far cities' palettes and textures stray from the shared one (0: identical looks).
        class_colours: ``distinct`` (a permuted grid of well-separated colours) or ``random`` (uniform draws).
        seed: seed of everything.
    """

    def __init__(
        self,
        num_classes: Literal[12, 27] = 27,
        num_cities: int = 6,
        images_per_city: int = 100,
        num_test_cities: int = 3,
        num_test_samples: int = 150,
        image_size: int = 64,
        style_strength: float = 1.0,
        class_colours: Literal["distinct", "random"] = "distinct",
        seed: int = 0,
    ) -> None:
        flag = "--data.dataset.init_args"
        problems = []
        if num_classes not in (12, 27):
            problems.append(f"Expected {flag}.num_classes 12 or 27, got {num_classes}.")
        for name, value in [("num_cities", num_cities), ("images_per_city", images_per_city)]:
            if value < 1:
                problems.append(f"Expected {flag}.{name} ≥ 1, got {value}.")
        if num_test_samples > 0 and num_test_cities < 1:
            problems.append(f"Expected {flag}.num_test_cities ≥ 1 for a test set, got {num_test_cities}.")
        if class_colours not in ("distinct", "random"):
            problems.append(f"Expected {flag}.class_colours 'distinct' or 'random', got {class_colours!r}.")
        if image_size < 16:
            problems.append(f"Expected {flag}.image_size ≥ 16 pixels, got {image_size}.")
        if problems:
            raise ConfigError(*problems)
        self.class_names = CITYSCAPES_27 if num_classes == 27 else STREET_12
        self.num_classes = num_classes
        self.num_cities, self.images_per_city = num_cities, images_per_city
        self.num_test_cities, self.num_test_samples = num_test_cities, num_test_samples
        self.image_size, self.style_strength, self.seed = image_size, style_strength, seed
        self.class_colours = class_colours
        self.input_shape = (3, image_size, image_size)
        self.roles = {role: [self.class_names.index(c) for c in names if c in self.class_names]
                      for role, names in _ROLES.items()}  # fmt: skip

    def load_train(self) -> LabelledTensors:
        cities = np.repeat(np.arange(self.num_cities), self.images_per_city)
        return self._draw(cities, _TRAIN_STREAM)

    def load_test(self) -> LabelledTensors | None:
        if self.num_test_samples == 0:
            return None
        cities = self.num_cities + np.arange(self.num_test_samples) % self.num_test_cities
        return self._draw(cities, _TEST_STREAM)

    # -- drawing ----------------------------------------------------------------------------------------
    def _generator(self, *stream: int) -> torch.Generator:
        state = np.random.SeedSequence(self.seed, spawn_key=stream).generate_state(1, dtype=np.uint64)[0]
        return torch.Generator().manual_seed(int(state >> 1))

    def _classes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every class's base colour ``[C, 3]``, texture kind ``[C]`` (0…3) and stripe frequency ``[C]``."""
        g = self._generator(_STYLE_STREAM)
        colours = 0.15 + 0.7 * torch.rand(self.num_classes, 3, generator=g)
        if self.class_colours == "distinct":
            levels = torch.tensor([0.2, 0.5, 0.8])
            grid = torch.cartesian_prod(levels, levels, levels)  # [27, 3]
            colours = grid[torch.randperm(len(grid), generator=g)[: self.num_classes]]
        textures = torch.arange(self.num_classes) % 4
        frequencies = 2.0 + 4.0 * torch.rand(self.num_classes, generator=g)
        return colours, textures, frequencies

    def _city(self, city: int) -> dict[str, torch.Tensor]:
        """A city's colour transform, texture scale and class weights, from its own stream."""
        g = self._generator(_STYLE_STREAM, city + 1)
        s = self.style_strength
        mixing = torch.eye(3) + 0.6 * s * (torch.rand(3, 3, generator=g) - 0.5)  # tint and cross-talk
        offset = 0.3 * s * (torch.rand(3, generator=g) - 0.5)
        scale = 1.0 + 0.5 * s * (torch.rand(self.num_classes, generator=g) - 0.5)
        weights = -torch.log(torch.rand(self.num_classes, generator=g))  # Exp(1) = Gamma(1): Dirichlet(1) within a role
        return {"mixing": mixing, "offset": offset, "scale": scale, "weights": weights}

    def _pick(self, role: str, weights: torch.Tensor, g: torch.Generator, count: int = 1) -> list[int]:
        classes = self.roles[role]
        p = weights[classes]
        return [classes[i] for i in torch.multinomial(p / p.sum(), count, replacement=True, generator=g).tolist()]

    def _draw(self, cities: np.ndarray, stream: int) -> LabelledTensors:
        size = self.image_size
        colours, textures, frequencies = self._classes()
        styles = {int(c): self._city(int(c)) for c in np.unique(cities)}
        g = self._generator(stream)
        axis = torch.linspace(0.0, 1.0, size)
        y, x = torch.meshgrid(axis, axis, indexing="ij")  # [S, S]
        masks = torch.stack([self._layout(styles[c]["weights"], g, x, y) for c in cities.tolist()])  # [N, S, S]
        count = len(cities)
        phase = torch.rand(count, 1, 1, generator=g) * 2 * math.pi
        light = 0.85 + 0.3 * torch.rand(count, 1, 1, 1, generator=g)
        noise = 0.03 * torch.randn(count, 3, size, size, generator=g)
        scale = torch.stack([styles[int(c)]["scale"] for c in cities])  # [N, C]
        mixing = torch.stack([styles[int(c)]["mixing"] for c in cities])  # [N, 3, 3]
        offset = torch.stack([styles[int(c)]["offset"] for c in cities])  # [N, 3]
        freq = frequencies[masks] * scale.gather(1, masks.flatten(1)).view_as(masks)  # [N, S, S]
        stripes_h = torch.sin(freq * math.pi * y * 4 + phase) >= 0
        stripes_v = torch.sin(freq * math.pi * x * 4 + phase) >= 0
        pattern = torch.stack([torch.ones_like(stripes_h), stripes_h, stripes_v, stripes_h ^ stripes_v], dim=1)
        texture = pattern.gather(1, textures[masks][:, None]).float()  # [N, 1, S, S] in {0, 1}
        image = colours[masks].permute(0, 3, 1, 2) * (0.7 + 0.3 * texture)  # [N, 3, S, S]
        image = torch.einsum("nij,njhw->nihw", mixing, image) + offset[:, :, None, None]
        image = image * light + noise
        images = ((image.clamp(0, 1) - PIXEL_MEAN[0]) / PIXEL_STD[0]).float()
        targets = masks
        dominant = np.array([int(torch.bincount(m.flatten(), minlength=self.num_classes).argmax()) for m in masks])
        return LabelledTensors(inputs=images, targets=targets, groups=cities.copy(), labels=dominant)

    def _layout(self, weights: torch.Tensor, g: torch.Generator, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One image's label map ``[S, S]``: sky, façade strips, ground, objects."""

        def uniform(low: float, high: float) -> float:
            return low + (high - low) * float(torch.rand(1, generator=g))

        sky_line, horizon = uniform(0.1, 0.35), uniform(0.5, 0.65)
        mask = torch.full(x.shape, self.roles["sky"][0], dtype=torch.int64)
        # façade strips between the sky line and the horizon, each with its own top
        left = 0.0
        while left < 1.0:
            width = uniform(0.15, 0.45)
            top = sky_line + uniform(-0.1, 0.15)
            strip = (x >= left) & (x < left + width) & (y >= top) & (y < horizon)
            mask[strip] = self._pick("facade", weights, g)[0]
            left += width
        # ground: a road narrowing towards the horizon between two side classes
        side_left, road, side_right = self._pick("ground", weights, g, 3)
        road = self.roles["ground"][0] if float(torch.rand(1, generator=g)) < 0.7 else road
        ground = y >= horizon
        depth = (y - horizon) / (1.0 - horizon)  # 0 at the horizon, 1 at the bottom
        half = 0.08 + 0.42 * depth
        centre = uniform(0.4, 0.6)
        mask[ground & (x < centre - half)] = side_left
        mask[ground & (x > centre + half)] = side_right
        mask[ground & (x >= centre - half) & (x <= centre + half)] = road
        # objects standing on the ground, nearer ones lower and larger
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            cls = self._pick("object", weights, g)[0]
            base, cx = uniform(horizon + 0.05, 1.0), uniform(0.05, 0.95)
            height = 0.15 + 0.35 * (base - horizon) / (1.0 - horizon)
            thin = self.class_names[cls] in ("pole", "polegroup", "person", "rider", "traffic light", "traffic sign")
            width = height * (0.25 if thin else uniform(0.8, 1.6))
            if self.class_names[cls] in ("person", "rider", "traffic sign"):  # rounded shapes
                inside = ((x - cx) / (width / 2)) ** 2 + ((y - (base - height / 2)) / (height / 2)) ** 2 <= 1
            else:
                inside = ((x - cx).abs() <= width / 2) & (y <= base) & (y >= base - height)
            mask[inside] = cls
        return mask
