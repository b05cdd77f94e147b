"""Style cities: an offline stand-in for FFREEDA's GTA5 → CrossCity (LADD, Shenaj et al., WACV 2023).

FFREEDA pre-trains on a labelled source domain (GTA5) and adapts on many small unlabelled clients of
four target cities that look different: weather, light, camera. This twin keeps that structure:

- **content** is one procedural scene per image (:func:`fedlight.data.twins.scenes.render_scenes`), drawn from
  the same distribution in every domain, so the domains share their layouts and classes;
- **appearance** differs by domain through low-frequency, global changes, the kind FDA's amplitude window
  captures (Yang & Soatto, CVPR 2020): colour saturation, gamma, contrast, a colour cast and a blur
  (:class:`Appearance`), and sensor noise, which FDA's window does not carry. The source is saturated,
  sharp and clean; the four cities are grey, warm, cool and dim (the dim one the noisiest, as at dusk);
- **content** may also differ by city, as streets in Rome and Tokyo hold different things: with
  ``class_skew`` < 1 every city favours its own object classes (:meth:`StyleCities.class_probabilities`);
- **clients** are many and small, like CrossCity's 17–37 images each (LADD, Table 1); every client of a
  city draws its own slight variation of the city's appearance, as cars of one city see different days.

``domain="source"`` gives the labelled source pool (one natural client, ``"source"``, for a centralized
pre-training run) and ``domain="target"`` the
cities' clients, their ids in ``groups`` (``"warm7"``: city and number, like CrossCity's ``"Rome7"``; or the city
alone with ``one_client_per_city``, like the four-client CrossCity of LADD's Table 8), for the
:class:`~fedlight.data.partition.Natural` partitioner. Both share one global test set drawn from
the four cities, whose groups are the cities' names, so a source-only model is scored where the federation is,
and city by city with ``--data.test_groups``. The target labels exist so that runs can be scored; FFREEDA's
clients must not train on them.

Inputs are normalised with mean = std = 0.5 per channel, LADD's normalisation, unless ``normalise=False``
leaves them raw in [0, 1]; FDA styles are taken from raw images (``inputs * 0.5 + 0.5``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.labels import VOC_CLASSES
from fedlight.data.twins.scenes import render_scenes
from fedlight.errors import ConfigError

_CHUNK = 256  # images rendered per step, fixed so that draws do not depend on it
_SOURCE_STREAM, _TARGET_STREAM, _TEST_STREAM = 0, 1, 2
_LUMA = torch.tensor([0.299, 0.587, 0.114])  # ITU-R BT.601 weights of R, G, B


@dataclass(frozen=True)
class Appearance:
    """A global, mostly low-frequency change of an image's look, applied in this order.

    Attributes:
        saturation: 0 grey, 1 unchanged, >1 more colourful (mixing each pixel with its luminance).
        gamma: x ↦ x^γ per channel; >1 darkens the mid-tones.
        contrast: x ↦ 0.5 + c·(x − 0.5).
        cast: ``(r, g, b)`` added to every pixel, a colour cast.
        blur: σ in pixels of a Gaussian blur, 0 for none.
        noise: standard deviation of white Gaussian pixel noise added last, a camera's sensor noise; FDA's
            low-frequency window carries none of it, so a restyled source image does not show it.
    """

    saturation: float = 1.0
    gamma: float = 1.0
    contrast: float = 1.0
    cast: tuple[float, float, float] = (0.0, 0.0, 0.0)
    blur: float = 0.0
    noise: float = 0.0

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Applies the appearance to ``[B, 3, H, W]`` RGB images in [0, 1]; returns them clipped to [0, 1].

        The noise is drawn from ``generator`` (torch's global one if None).

        >>> Appearance()(torch.full((1, 3, 2, 2), 0.25)).unique().tolist()
        [0.25]
        >>> grey = torch.full((1, 3, 1, 1), 0.5)
        >>> [round(v, 6) for v in Appearance(gamma=2.0, cast=(0.1, 0.0, 0.0))(grey).flatten().tolist()]
        [0.35, 0.25, 0.25]
        """
        luma = (images * _LUMA.to(images)[:, None, None]).sum(dim=1, keepdim=True)  # [B, 1, H, W]
        x = (luma + self.saturation * (images - luma)).clamp(0.0, 1.0)
        x = x.pow(self.gamma)
        x = 0.5 + self.contrast * (x - 0.5)
        x = x + torch.tensor(self.cast).to(x)[:, None, None]
        if self.blur > 0:
            x = _gaussian_blur(x, self.blur)
        if self.noise > 0:
            x = x + self.noise * torch.randn(x.shape, generator=generator, dtype=x.dtype)
        return x.clamp(0.0, 1.0)


def _gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of ``[B, C, H, W]`` with reflected borders (radius ⌈3σ⌉)."""
    radius = max(1, math.ceil(3 * sigma))
    offsets = torch.arange(-radius, radius + 1, dtype=images.dtype, device=images.device)
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    kernel = kernel / kernel.sum()
    channels = images.shape[1]
    x = F.pad(images, (radius, radius, radius, radius), mode="reflect")
    x = F.conv2d(x, kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1), groups=channels)
    return F.conv2d(x, kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1), groups=channels)


#: The labelled source domain: saturated and sharp, like a game engine's renders.
SOURCE = Appearance(saturation=1.35, contrast=1.1)
#: The four target cities and their looks.
CITIES: dict[str, Appearance] = {
    "grey": Appearance(saturation=0.35, gamma=0.9, contrast=0.75, cast=(0.02, 0.02, 0.05), blur=0.8, noise=0.04),
    "warm": Appearance(saturation=1.0, gamma=0.75, contrast=0.9, cast=(0.12, 0.04, -0.10)),
    "cool": Appearance(saturation=0.8, gamma=1.2, cast=(-0.08, 0.0, 0.12), blur=0.5, noise=0.02),
    "dim": Appearance(saturation=0.9, gamma=1.7, contrast=0.85, cast=(-0.02, 0.06, -0.02), noise=0.08),
}


def city_of(client_id: str) -> str:
    """Returns the city of a client id: its name without the number.

    >>> city_of("warm12")
    'warm'
    """
    return re.sub(r"\d+$", "", client_id)


class StyleCities(FederatedDataset):
    """A labelled source domain and four target cities of small clients that differ in appearance only.

    Args:
        domain: ``source``, the labelled pre-training pool, or ``target``, the cities' clients.
        num_clients_per_city: clients in each of the four cities (target domain).
        one_client_per_city: merge each city's clients into one client with the city's name as its id; the images
            are those of ``num_clients_per_city`` clients, drawn as without it.
        client_size: ``(min, max)`` images per client, drawn uniformly per client (CrossCity: 17–37).
        num_source_samples: images of the source pool (source domain).
        num_test_per_city: images of each city in the global test set, shared by both domains; 0 for none.
        num_object_classes: object classes of the scenes (VOC's first ones), background added as class 0.
        image_size: side S of the square images.
        client_jitter: standard deviation of each client's own variation of its city's cast and, in log
            scale, of its gamma; 0 makes all clients of a city look alike.
        class_skew: how much the cities' contents differ, in (0, 1]. City i ranks the object classes from
            its own first one, ⌊i·C/4⌋, each next class ``class_skew`` times as likely as the one before;
            1 draws every class uniformly in every city. The source always draws them uniformly.
        normalise: normalise with mean = std = 0.5 (LADD's), or leave the images raw in [0, 1].
        seed: one seed gives the same source, clients and test set on every machine.
    """

    def __init__(
        self,
        domain: Literal["source", "target"] = "target",
        num_clients_per_city: int = 25,
        one_client_per_city: bool = False,
        client_size: tuple[int, int] = (17, 37),
        num_source_samples: int = 1000,
        num_test_per_city: int = 25,
        num_object_classes: int = 5,
        image_size: int = 64,
        client_jitter: float = 0.03,
        class_skew: float = 1.0,
        normalise: bool = True,
        seed: int = 0,
    ) -> None:
        flag = "--data.dataset.init_args"
        problems = []
        if domain not in ("source", "target"):
            problems.append(f"Expected {flag}.domain in {{source, target}}, got {domain!r}.")
        if num_clients_per_city < 1:
            problems.append(f"Expected {flag}.num_clients_per_city ≥ 1, got {num_clients_per_city}.")
        if len(client_size) != 2 or not 1 <= client_size[0] <= client_size[1]:
            problems.append(f"Expected {flag}.client_size as (min, max) with 1 ≤ min ≤ max, got {client_size}.")
        if num_source_samples < 1:
            problems.append(f"Expected {flag}.num_source_samples ≥ 1, got {num_source_samples}.")
        if num_test_per_city < 0:
            problems.append(f"Expected {flag}.num_test_per_city ≥ 0 (0: no test set), got {num_test_per_city}.")
        if not 1 <= num_object_classes <= 20:
            problems.append(f"Expected {flag}.num_object_classes in [1, 20], got {num_object_classes}.")
        if image_size < 8:
            problems.append(f"Expected {flag}.image_size ≥ 8 pixels, got {image_size}.")
        if client_jitter < 0:
            problems.append(f"Expected {flag}.client_jitter ≥ 0, got {client_jitter}.")
        if not 0 < class_skew <= 1:
            problems.append(f"Expected {flag}.class_skew in (0, 1] (1: the same classes everywhere), got {class_skew}.")
        if problems:
            raise ConfigError(*problems)
        self.domain = domain
        self.num_clients_per_city = num_clients_per_city
        self.one_client_per_city = one_client_per_city
        self.client_size = tuple(client_size)
        self.num_source_samples = num_source_samples
        self.num_test_per_city = num_test_per_city
        self.num_object_classes = num_object_classes
        self.image_size = image_size
        self.client_jitter = client_jitter
        self.class_skew = class_skew
        self.normalise = normalise
        self.seed = seed
        self.num_classes = num_object_classes + 1
        self.class_names = VOC_CLASSES[: self.num_classes]  # background, then the scenes' VOC objects
        self.input_shape = (3, image_size, image_size)

    def load_train(self) -> LabelledTensors:
        """Draws the source pool (one client, ``"source"``), or the cities' clients with their ids in ``groups``."""
        if self.domain == "source":
            generator = self._generator(_SOURCE_STREAM)
            images, masks, classes = self._scenes(self.num_source_samples, generator, SOURCE)
            # one natural client, so the Natural partitioner gives the centralized pre-training run its data
            return self._finish(images, masks, classes, groups=np.full(len(images), "source"))
        generator = self._generator(_TARGET_STREAM)
        parts, ids = [], []
        for index, (city, look) in enumerate(CITIES.items()):
            probabilities = self.class_probabilities(index)
            for number in range(self.num_clients_per_city):
                size = int(torch.randint(self.client_size[0], self.client_size[1] + 1, (), generator=generator))
                parts.append(self._scenes(size, generator, self._client_look(look, generator), probabilities))
                ids += [city if self.one_client_per_city else f"{city}{number}"] * size
        images, masks, classes = (torch.cat(part) for part in zip(*parts, strict=True))
        return self._finish(images, masks, classes, groups=np.array(ids))

    def load_test(self) -> LabelledTensors | None:
        """Draws the global test set, ``num_test_per_city`` images per city; ``groups`` holds each one's city."""
        if self.num_test_per_city == 0:
            return None
        generator = self._generator(_TEST_STREAM)
        parts = [
            self._scenes(self.num_test_per_city, generator, look, self.class_probabilities(index))
            for index, look in enumerate(CITIES.values())
        ]
        images, masks, classes = (torch.cat(part) for part in zip(*parts, strict=True))
        cities = np.repeat(list(CITIES), self.num_test_per_city)
        return self._finish(images, masks, classes, groups=cities)

    def class_probabilities(self, city: int) -> torch.Tensor | None:
        """``[C]`` how likely each object class is in city number ``city``; None when all are equally likely.

        >>> StyleCities(num_object_classes=4, class_skew=0.5).class_probabilities(1).tolist()
        [0.0666..., 0.5333..., 0.2666..., 0.1333...]
        """
        if self.class_skew == 1:
            return None
        count = self.num_object_classes
        rank = (torch.arange(count) - city * count // len(CITIES)) % count
        weights = torch.tensor(self.class_skew, dtype=torch.float64) ** rank
        return weights / weights.sum()

    def _generator(self, stream: int) -> torch.Generator:
        sequence = np.random.SeedSequence(self.seed, spawn_key=(stream,))  # generate_state: .entropy ignores the key
        return torch.Generator().manual_seed(int(sequence.generate_state(1, dtype=np.uint64)[0] >> 1))

    def _client_look(self, look: Appearance, generator: torch.Generator) -> Appearance:
        """The city's appearance with this client's own cast and gamma."""
        jitter = self.client_jitter * torch.randn(4, generator=generator)
        cast = tuple(float(c + n) for c, n in zip(look.cast, jitter[:3], strict=True))
        gamma = look.gamma * math.exp(float(jitter[3]))
        return Appearance(look.saturation, gamma, look.contrast, cast, look.blur, look.noise)

    def _scenes(
        self, count: int, generator: torch.Generator, look: Appearance, probabilities: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``count`` scenes in ``look``, object classes drawn from ``probabilities`` (None: uniformly): raw
        images ``[N, 3, S, S]`` in [0, 1], label maps, object classes."""
        images, masks, classes = [], [], []
        for start in range(0, count, _CHUNK):
            size = min(_CHUNK, count - start)
            if probabilities is None:
                chunk = torch.randint(self.num_object_classes, (size,), generator=generator)
            else:
                chunk = torch.multinomial(probabilities, size, replacement=True, generator=generator)
            standardised, chunk_masks = render_scenes(chunk, self.image_size, generator, void_border=0)
            images.append(look(standardised * 0.25 + 0.5, generator))  # render_scenes standardises clipped [0, 1]
            masks.append(chunk_masks)
            classes.append(chunk)
        return torch.cat(images), torch.cat(masks), torch.cat(classes)

    def _finish(
        self, images: torch.Tensor, masks: torch.Tensor, classes: torch.Tensor, groups: np.ndarray | None = None
    ) -> LabelledTensors:
        inputs = (images - 0.5) / 0.5 if self.normalise else images
        labels = (classes + 1).numpy().astype(np.int64)  # the image's object class, for partitioners
        return LabelledTensors(inputs=inputs.float(), targets=masks, groups=groups, labels=labels)
