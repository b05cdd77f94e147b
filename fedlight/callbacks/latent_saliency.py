"""FedSLS's latent-space analysis: saliency and vanilla latents against the images (the paper's Figs. 3 and 5).

The FedSLS paper (Sec. 4.3.1–4.3.4) argues that saliency latents keep more of an image than "vanilla latents"
obtained by down-sampling it f = 2, 4 and 8 times. It encodes 10,000 images both ways, averages each latent
over its channels into a grey map, brings maps and images to one size, brightness and contrast, and scores every
latent against its image with SSIM, cosine similarity (between a ResNet-50's outputs for the two) and Euclidean
distance: Fig. 5 shows the scores as box plots, Fig. 3 some images with their four latents.

At the rounds due (every ``every_n_rounds``, and after the last one) this callback does the same with the
global model W^{t+1} on ``num_images`` images of the global test set (the union of the clients' held-out splits
where the data have no test set): a uniform draw without replacement seeded by the run, the same images in every
round (decision S11). For each image x with label y:

- the image: its channel mean;
- the saliency latent Ḡ_1: the map FedSLS's weights are made of (Eqs. 4–5,
  :func:`~fedlight.metrics.functional.saliency.saliency_map`), guided backpropagation from the ground-truth
  logit to the output of the first convolution, the stem (S8);
- the vanilla latents mean_c AvgPool_f(x), FedSL's (:func:`~fedlight.metrics.functional.saliency.vanilla_latent`,
  S9);
- every map resized bilinearly to the image's size and min–max scaled to [0, 1] (S7), then scored against the
  image (:mod:`fedlight.metrics.functional.latent_similarity`, S10): SSIM and Euclidean distance of the maps, and
  the cosine similarity of two embeddings of them: the pooled 2048-d features of PyTorch's ImageNet ResNet-50
  (``cosine_network: resnet50``, the paper's network), or of the run's own global model (``global_model``, for
  machines without the ResNet-50's weights).

Logged per encoding e ∈ {saliency, f2, f4, f8}: ``analysis/latent_ssim_<e>``, ``analysis/latent_cosine_<e>`` and
``analysis/latent_euclidean_<e>``, the means over the images. Written under ``<run_dir>/latent_saliency/``:
``round_<t>.png`` (Fig. 5: one box plot per measure, means marked), ``round_<t>_examples.png`` (Fig. 3: the first
images with their normalised latents) and ``round_<t>.npz`` (every image's scores and its test-set index); both
pictures go to W&B as ``analysis/latent_scores`` and ``analysis/latent_examples``. With several processes, each
scores its share of the images. Drawing needs matplotlib (``pip install -e ".[plots]"``).

Cost: one guided backward pass of the global model and 1 + 4 forward passes of the embedding network per image,
in batches of ``batch_size``; nothing is kept per image but its 12 scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from fedlight.callbacks.base import RoundCallback, features_problem
from fedlight.callbacks.figures import matplotlib_problem
from fedlight.errors import ConfigError
from fedlight.metrics.functional.latent_similarity import (
    cosine_similarity,
    euclidean_distance,
    grey,
    normalise_maps,
    structural_similarity,
)
from fedlight.metrics.functional.saliency import saliency_map, vanilla_latent

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from fedlight.context import RunContext

_FLAG = "--trainer.callbacks (fedlight.callbacks.LatentSaliency) init_args"
#: the three measures of Fig. 5, left to right, and whether higher is closer to the image
MEASURES = {"ssim": ("SSIM", True), "cosine": ("cosine similarity", True), "euclidean": ("Euclidean distance", False)}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class LatentSaliency(RoundCallback):
    """Scores the saliency latent and the down-sampled latents of test images against the images (Fig. 5).

    Args:
        every_n_rounds: measure after every this many rounds, and after the last one; 0 measures after the last
            round only.
        num_images: test images scored (the paper: 10,000), drawn uniformly with the run's seed; all of them when
            the test set is smaller.
        factors: the down-sampling factors f of the vanilla latents (the paper: 2, 4, 8).
        layer: the convolution whose saliency map is compared, counted from 1 in forward order (the paper takes
            the first).
        guided: guided backpropagation (the paper's, as FedSLS's weights); ``false`` uses plain gradients.
        cosine_network: the network whose outputs the cosine similarity compares: ``resnet50``, PyTorch's
            ImageNet ResNet-50 (the paper's; its pooled 2048-d features), or ``global_model``, the run's global
            model's ``forward_features`` (no extra weights).
        resnet50_weights: a local file of the ResNet-50's ImageNet weights (timm's or torchvision's); ``null``
            reads timm's ``resnet50.tv_in1k`` through the Hugging Face cache.
        batch_size: images per pass; bounds the memory, does not change the scores.
        num_examples: images shown with their latents in the examples figure (Fig. 3).
    """

    def __init__(
        self,
        every_n_rounds: int = 0,
        num_images: int = 10000,
        factors: Sequence[int] = (2, 4, 8),
        layer: int = 1,
        guided: bool = True,
        cosine_network: Literal["resnet50", "global_model"] = "resnet50",
        resnet50_weights: str | None = None,
        batch_size: int = 64,
        num_examples: int = 4,
    ) -> None:
        problems = []
        if every_n_rounds < 0:
            problems.append(f"Expected {_FLAG}.every_n_rounds ≥ 0 (0: the last round only), got {every_n_rounds}.")
        if num_images < 1:
            problems.append(f"Expected {_FLAG}.num_images ≥ 1, got {num_images}; the paper scores 10,000 images.")
        if not factors or any(f < 1 for f in factors):
            problems.append(
                f"Expected {_FLAG}.factors to be down-sampling factors ≥ 1 such as [2, 4, 8], got {factors}."
            )
        if layer < 1:
            problems.append(f"Expected {_FLAG}.layer ≥ 1 (1: the first convolution), got {layer}.")
        if cosine_network not in ("resnet50", "global_model"):
            problems.append(f"Expected {_FLAG}.cosine_network to be resnet50 or global_model, got {cosine_network!r}.")
        if batch_size < 1:
            problems.append(f"Expected {_FLAG}.batch_size ≥ 1, got {batch_size}.")
        if num_examples < 0:
            problems.append(f"Expected {_FLAG}.num_examples ≥ 0, got {num_examples}.")
        if problems:
            raise ConfigError(*problems)
        self.every_n_rounds = every_n_rounds
        self.num_images = num_images
        self.factors = tuple(int(f) for f in factors)
        self.layer = layer
        self.guided = guided
        self.cosine_network = cosine_network
        self.resnet50_weights = resnet50_weights
        self.batch_size = batch_size
        self.num_examples = num_examples
        self.encodings = ("saliency", *(f"f{f}" for f in self.factors))
        self.resnet50: nn.Module | None = None
        self.last_paths: list[Path] = []

    def check(self, module, datamodule) -> list[str]:
        from fedlight.clients import ClassificationClient

        name = "fedlight.callbacks.LatentSaliency"
        problems = []
        if not isinstance(module, ClassificationClient):
            problems.append(
                f"{name} backpropagates from each test image's ground-truth logit, which needs a classifier "
                f"(fedlight.clients.ClassificationClient), but --model is {type(module).__name__}; remove it from "
                "--trainer.callbacks."
            )
        shape = tuple(datamodule.input_shape)
        if len(shape) != 3:
            problems.append(f"{name} compares latents with images [channels, height, width], but --data gives {shape}.")
        elif min(shape[1:]) < max(6, *self.factors):
            problems.append(
                f"{name} needs images of at least {max(6, *self.factors)} pixels a side (SSIM's window and the largest "
                f"of {_FLAG}.factors={list(self.factors)}), but --data gives {shape[1]}×{shape[2]}."
            )
        convolutions = sum(isinstance(m, nn.Conv2d) for m in module.modules())
        if convolutions < self.layer:
            problems.append(
                f"{name} takes the saliency map of convolution {self.layer} ({_FLAG}.layer), but --model has "
                f"{convolutions} nn.Conv2d; use a convolutional network (e.g. model: resnet18 or cnn)."
            )
        if self.cosine_network == "global_model":
            problems += features_problem(name, module)
        if self.resnet50_weights is not None and not Path(self.resnet50_weights).expanduser().is_file():
            problems.append(
                f"{_FLAG}.resnet50_weights={self.resnet50_weights} does not exist. Give a file of PyTorch's ImageNet "
                "ResNet-50 (timm's resnet50.tv_in1k or torchvision's IMAGENET1K_V1), leave it null to read timm's "
                "through the Hugging Face cache, or set cosine_network: global_model."
            )
        return problems + matplotlib_problem(name)

    def on_fit_start(self, context: RunContext) -> None:
        """Loads the ResNet-50 of the cosine similarity (``cosine_network: resnet50``)."""
        if self.cosine_network == "resnet50" and self.resnet50 is None:
            self.resnet50 = imagenet_resnet50(self.resnet50_weights).to(context.device)

    def on_round_end(self, context: RunContext, round_idx: int, metrics: dict[str, Any]) -> None:
        """Scores the latents of W^{t+1} when the round is due (each rank its share; rank 0 draws)."""
        if not context.due(round_idx, self.every_n_rounds):
            return
        indices, scores, examples = self._scores(context)  # [N], [N, 3, E], [k, 1 + E, H, W]
        for m, measure in enumerate(MEASURES):
            for e, encoding in enumerate(self.encodings):
                metrics[f"analysis/latent_{measure}_{encoding}"] = scores[:, m, e].mean().item()
        if context.rank != 0 or context.run_dir is None:
            return
        folder = context.run_dir / "latent_saliency"
        folder.mkdir(parents=True, exist_ok=True)
        stem = folder / f"round_{round_idx + 1:04d}"
        np.savez(
            stem.with_suffix(".npz"), scores=scores.numpy(), indices=indices.numpy(),
            measures=np.array(list(MEASURES)), encodings=np.array(self.encodings),
        )  # fmt: skip
        title = f"{context.name}, round {round_idx + 1}, {len(indices)} test images"
        scores_path, examples_path = Path(f"{stem}.png"), Path(f"{stem}_examples.png")
        latent_scores_figure(scores.numpy(), self.encodings, title).savefig(scores_path, dpi=110)
        self.last_paths = [scores_path]
        images = {"analysis/latent_scores": [str(scores_path)]}
        if len(examples):
            latent_examples_figure(examples.numpy(), self.encodings, title).savefig(examples_path, dpi=100)
            self.last_paths.append(examples_path)
            images["analysis/latent_examples"] = [str(examples_path)]
        context.log_images(images, step=round_idx + 1)

    def _scores(self, context: RunContext) -> tuple[Tensor, Tensor, Tensor]:
        """The drawn test-set indices ``[N]``, their scores ``[N, 3, E]`` (float64, summed over ranks) and rank 0's
        first ``num_examples`` normalised maps ``[k, 1 + E, H, W]``, image first."""
        module, data = context.global_module(), context.datamodule
        total = len(data.test) if data.test is not None else len(data.held_out_index)
        rng = np.random.default_rng(context.seed)
        indices = torch.from_numpy(np.sort(rng.choice(total, min(self.num_images, total), replace=False)))
        scores = torch.zeros(len(indices), len(MEASURES), len(self.encodings), dtype=torch.float64)
        examples: list[Tensor] = []
        done, piece, offset = 0, 0, 0  # images scored or skipped, pieces handed out, test images read
        for x, y, _ in data.test_batches():
            chosen = indices[done:][indices[done:] < offset + len(x)] - offset  # drawn images of this batch
            offset += len(x)
            for start in range(0, len(chosen), self.batch_size):
                rows = chosen[start : start + self.batch_size].to(x.device)
                if piece % context.world_size == context.rank:
                    piece_scores, maps = self._compare(context, module, x[rows], y[rows])
                    scores[done : done + len(rows)] = piece_scores.double().cpu()
                    if context.rank == 0 and sum(map(len, examples)) < self.num_examples:
                        examples.append(maps[: self.num_examples - sum(map(len, examples))].cpu())
                piece, done = piece + 1, done + len(rows)
            if done == len(indices):
                break
        assert done == len(indices), f"read {done} of the {len(indices)} drawn test images: the test set shrank"
        scores = context.all_reduce(scores.to(context.device)).cpu()  # each image was scored by one rank
        return indices, scores, torch.cat(examples) if examples else torch.zeros(0)

    def _compare(self, context: RunContext, module: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Scores ``[n, 3, E]`` of the latents of images ``x`` with labels ``y`` and the normalised maps
        ``[n, 1 + E, H, W]`` (the image first)."""
        precision = context.precision
        size = (x.shape[-2], x.shape[-1])
        with precision.forward_context():
            saliency = saliency_map(module, precision.convert_input(x), y, self.layer, self.guided)  # [n, H_l, W_l]
        latents = [saliency, *(vanilla_latent(x, f) for f in self.factors)]  # [n, H/f, W/f] each
        maps = torch.stack([normalise_maps(m, size) for m in [grey(x), *latents]], dim=1)  # [n, 1 + E, H, W]
        image, encoded = maps[:, 0], maps[:, 1:]
        embedded = self._embed(context, module, maps, x)  # [n, 1 + E, D]
        columns = [
            torch.stack([structural_similarity(image, encoded[:, e]) for e in range(len(self.encodings))], dim=1),
            torch.stack([cosine_similarity(embedded[:, 0], embedded[:, 1 + e]) for e in range(len(self.encodings))], 1),
            torch.stack([euclidean_distance(image, encoded[:, e]) for e in range(len(self.encodings))], dim=1),
        ]  # [n, E] each, in the order of MEASURES
        return torch.stack(columns, dim=1), maps

    @torch.no_grad()
    def _embed(self, context: RunContext, module: nn.Module, maps: Tensor, x: Tensor) -> Tensor:
        """Embeddings ``[n, 1 + E, D]`` of the normalised maps ``[n, 1 + E, H, W]`` of images ``x`` by the network of
        the cosine similarity."""
        if self.cosine_network == "resnet50":
            assert self.resnet50 is not None, "on_fit_start did not load the ResNet-50"
            mean = torch.tensor(IMAGENET_MEAN, device=maps.device).view(1, 3, 1, 1)
            std = torch.tensor(IMAGENET_STD, device=maps.device).view(1, 3, 1, 1)
            features = self.resnet50((maps.flatten(0, 1)[:, None].expand(-1, 3, -1, -1) - mean) / std)
        else:
            # the run's model reads images in their own units: each map takes the range of its image's channel mean
            grey_x = x.float().mean(dim=1)  # [n, H, W]
            low = grey_x.amin(dim=(1, 2)).view(-1, 1, 1, 1)
            values = (low + maps * (grey_x.amax(dim=(1, 2)).view(-1, 1, 1, 1) - low)).flatten(0, 1)  # [n(1 + E), H, W]
            values = values.round().clamp(0, 255).to(torch.uint8) if x.dtype == torch.uint8 else values.to(x.dtype)
            inputs = context.precision.convert_input(values[:, None].expand(-1, x.shape[1], -1, -1))
            with context.precision.forward_context():
                features = module.net.forward_features(inputs)
        return features.float().flatten(1).unflatten(0, tuple(maps.shape[:2]))


def imagenet_resnet50(weights_file: str | None = None) -> nn.Module:
    """PyTorch's ImageNet ResNet-50 (timm's layout) without its classifier: ImageNet-standardised ``[B, 3, H, W]``
    images → pooled ``[B, 2048]`` features; in eval mode, frozen.

    Args:
        weights_file: a local timm or torchvision checkpoint; ``None`` reads timm's ``resnet50.tv_in1k`` through
            the Hugging Face cache.

    Raises:
        ConfigError: when the weights can be neither fetched nor read, or are not a ResNet-50's.
    """
    import timm

    from fedlight.models.hub import read_weights_file, timm_state_dict

    flag = f"{_FLAG}.cosine_network=resnet50"
    if weights_file is None:
        state = timm_state_dict("resnet50.tv_in1k", flag)
    else:
        state = read_weights_file(Path(weights_file).expanduser())
        state = state.get("state_dict", state)
    state = {key: value for key, value in state.items() if not key.startswith("fc.")}
    network = timm.create_model("resnet50", pretrained=False, num_classes=0)  # forward: pooled features
    own = network.state_dict()
    if set(state) != set(own) or any(state[k].shape != own[k].shape for k in own):
        source = weights_file or "resnet50.tv_in1k"
        raise ConfigError(
            f"The weights {source} ({_FLAG}.resnet50_weights) are not an ImageNet ResNet-50's: give PyTorch's "
            "(timm's resnet50.tv_in1k or torchvision's IMAGENET1K_V1), or set cosine_network: global_model."
        )
    network.load_state_dict(state)
    return network.eval().requires_grad_(False)


def latent_scores_figure(scores: np.ndarray, encodings: Sequence[str], title: str = "") -> Figure:
    """Fig. 5: one box plot per measure (SSIM, cosine similarity, Euclidean distance), a box per encoding.

    Boxes span the quartiles, whiskers 1.5 interquartile ranges, circles are the images beyond them and a
    triangle marks the mean.

    Args:
        scores: ``[N, 3, E]`` every image's scores, measures in the order of :data:`MEASURES`.
        encodings: the E encodings' names (``saliency``, ``f2``, …).
        title: the figure's title.
    """
    from matplotlib.figure import Figure

    labels = [_label(e) for e in encodings]
    figure = Figure(figsize=(4.2 * len(MEASURES), 4.2), layout="constrained")
    axes = figure.subplots(1, len(MEASURES))
    for m, (axis, (name, higher)) in enumerate(zip(axes, MEASURES.values(), strict=True)):
        axis.boxplot([scores[:, m, e] for e in range(len(encodings))], showmeans=True, flierprops={"markersize": 3})
        axis.set_xticks(range(1, len(encodings) + 1), labels)
        axis.set_title(f"{name} ({'higher' if higher else 'lower'}: closer to the image)", fontsize="medium")
        axis.grid(axis="y", alpha=0.3)
    if title:
        figure.suptitle(title)
    return figure


def latent_examples_figure(maps: np.ndarray, encodings: Sequence[str], title: str = "") -> Figure:
    """Fig. 3: one row per image, its normalised grey image and then each latent, all on [0, 1].

    Args:
        maps: ``[k, 1 + E, H, W]`` normalised maps, the image first.
        encodings: the E encodings' names.
        title: the figure's title.
    """
    from matplotlib.figure import Figure

    columns = ["image", *(_label(e) for e in encodings)]
    figure = Figure(figsize=(1.9 * len(columns), 1.9 * len(maps) + 0.6), layout="constrained")
    axes = figure.subplots(len(maps), len(columns), squeeze=False)
    for row in range(len(maps)):
        for column in range(len(columns)):
            axes[row, column].imshow(maps[row, column], cmap="gray", vmin=0.0, vmax=1.0)
            axes[row, column].set_xticks([])
            axes[row, column].set_yticks([])
    for axis, name in zip(axes[0], columns, strict=True):
        axis.set_title(name, fontsize="medium")
    if title:
        figure.suptitle(title, fontsize="medium")
    return figure


def _label(encoding: str) -> str:
    return "saliency" if encoding == "saliency" else f"{encoding[1:]}× down"
