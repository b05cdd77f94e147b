"""LatentSaliency: the FedSLS paper's three measures against references, and the callback on a short run."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlight.callbacks import LatentSaliency
from fedlight.callbacks.latent_saliency import imagenet_resnet50, latent_examples_figure, latent_scores_figure
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Scenes
from fedlight.data.partition import Dirichlet
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.metrics.functional.latent_similarity import (
    cosine_similarity,
    euclidean_distance,
    normalise_maps,
    structural_similarity,
)
from fedlight.metrics.functional.saliency import saliency_map, saliency_norms, vanilla_latent
from fedlight.strategies import FedSLS


def reference_ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM of two [H, W] maps in [0, 1] as Wang et al. (2004) define it: an 11×11 Gaussian window of σ = 1.5
    around every pixel, K1 = 0.01, K2 = 0.03, L = 1; windows at the border read the image mirrored (torchmetrics'
    border convention, the paper leaves borders open)."""
    offsets = np.arange(-5, 6)
    gauss = np.exp(-(offsets**2) / (2 * 1.5**2))
    window = np.outer(gauss, gauss) / np.outer(gauss, gauss).sum()
    c1, c2 = 0.01**2, 0.03**2
    pa, pb = np.pad(a, 5, mode="reflect"), np.pad(b, 5, mode="reflect")
    values = []
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            wa, wb = pa[i : i + 11, j : j + 11], pb[i : i + 11, j : j + 11]
            mu_a, mu_b = (window * wa).sum(), (window * wb).sum()
            var_a, var_b = (window * (wa - mu_a) ** 2).sum(), (window * (wb - mu_b) ** 2).sum()
            cov = (window * (wa - mu_a) * (wb - mu_b)).sum()
            values.append((2 * mu_a * mu_b + c1) * (2 * cov + c2) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)))
    return float(np.mean(values))


def test_ssim_matches_wang_et_al_on_small_pairs():
    rng = np.random.default_rng(0)
    ramp = np.tile(np.linspace(0, 1, 12), (12, 1))
    pairs = [
        (rng.random((12, 12)), rng.random((12, 12))),  # unrelated noise: SSIM near 0
        (ramp, np.clip(ramp + 0.1 * rng.standard_normal((12, 12)), 0, 1)),  # a noisy copy: high
        (ramp, 1 - ramp),  # the negative: SSIM below 0
    ]
    a = torch.tensor(np.stack([p[0] for p in pairs]), dtype=torch.float32)
    b = torch.tensor(np.stack([p[1] for p in pairs]), dtype=torch.float32)
    expected = [reference_ssim(x, y) for x, y in pairs]
    assert structural_similarity(a, b).tolist() == pytest.approx(expected, abs=2e-5)
    assert expected[1] > 0.5 and expected[2] < 0 and abs(expected[0]) < 0.2


def test_cosine_and_euclidean_against_hand_computed_values():
    a = torch.tensor([[1.0, 2.0, 2.0], [1.0, 0.0, 0.0]])
    b = torch.tensor([[2.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    # (2 + 0 + 2) / (3 · √5); a zero vector has no direction: 0
    assert cosine_similarity(a, b).tolist() == pytest.approx([4 / (3 * math.sqrt(5)), 0.0])
    # √(1 + 4 + 1), √1
    assert euclidean_distance(a, b).tolist() == pytest.approx([math.sqrt(6), 1.0])
    maps_a, maps_b = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]]), torch.tensor([[[1.0, 1.0], [1.0, 1.0]]])
    assert euclidean_distance(maps_a, maps_b).tolist() == pytest.approx([math.sqrt(2)])  # maps are flattened
    assert cosine_similarity(maps_a, maps_b).tolist() == pytest.approx([2 / (math.sqrt(2) * 2)])


def test_maps_are_resized_bilinearly_then_scaled_to_the_unit_range():
    # 1×2 → 1×4 with half-pixel centres: samples at x = −¼, ¼, ¾, 1¼ of (10, 20), clamped at the ends
    assert normalise_maps(torch.tensor([[[10.0, 20.0]]]), (1, 4)).tolist() == [[[0.0, 0.25, 0.75, 1.0]]]
    assert normalise_maps(torch.tensor([[[-3.0, 1.0], [5.0, 1.0]]]), (2, 2)).tolist() == [[[0.0, 0.5], [1.0, 0.5]]]


def test_the_saliency_map_is_the_one_whose_norm_weighs_fedsls_clients():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(5 * 4 * 4, 3),
    ).eval()  # fmt: skip
    x, y = torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    for guided in (True, False):
        norms = saliency_norms(net, x, y, guided=guided)  # [6, 2], N_l of FedSLS's weights
        for layer in (1, 2):
            maps = saliency_map(net, x, y, layer=layer, guided=guided)
            assert maps.shape == ((6, 8, 8) if layer == 1 else (6, 4, 4))
            assert maps.flatten(1).norm(dim=1).tolist() == pytest.approx(norms[:, layer - 1].tolist(), rel=1e-5)


def test_saliency_map_of_a_hand_computed_network():
    # F = 2x at a 1×1 convolution, Y = Σ F: ∂Y/∂F = 1 and Ḡ = ReLU(F) = (2, 0, 6)
    net = nn.Sequential(nn.Conv2d(1, 1, 1, bias=False), nn.Flatten(), nn.Linear(3, 1, bias=False))
    net[0].weight.data.fill_(2.0)
    net[2].weight.data.fill_(1.0)
    assert saliency_map(net, torch.tensor([[[[1.0, -1.0, 3.0]]]]), torch.tensor([0])).tolist() == [[[2.0, 0.0, 6.0]]]


def test_vanilla_latent_is_the_channel_mean_of_the_pooled_image():
    image = torch.tensor([[[[0, 0, 255, 255]] * 2, [[255, 255, 255, 255]] * 2]], dtype=torch.uint8)  # [1, 2, 2, 4]
    # 2×2 blocks: channel 0 has means 0 and 1, channel 1 has 1 and 1
    assert vanilla_latent(image, 2).tolist() == [[[0.5, 1.0]]]


# -- the callback -------------------------------------------------------------------------------------------------


def small_run(tmp_path, callback, rounds=1):
    data = FederatedDataModule(
        Scenes(mode="classification", num_object_classes=10, num_samples=120, num_test_samples=40, image_size=32),
        Dirichlet(num_clients=3, alpha=1.0, min_size=5),
        batch_size=16,
        eval_batch_size=16,  # the drawn images span several test batches
    )
    torch.manual_seed(0)
    model = ClassificationClient(
        10,
        (3, 32, 32),
        model="resnet18",
        model_kwargs={"channels": [8, 8, 8, 8], "layers": [1, 1, 1, 1], "stem_width": 8},
    )
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=2, local_steps=1, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(model, data, FedSLS(warmup_epochs=0))
    return trainer, data


def _reference_maps(images: np.ndarray, factor: int) -> tuple[np.ndarray, np.ndarray]:
    """The grey image and its f× down-sampled latent, both at the image's size and scaled to [0, 1]."""
    grey = images.mean(axis=1)  # [n, H, W]
    n, h, w = grey.shape
    pooled = grey.reshape(n, h // factor, factor, w // factor, factor).mean(axis=(2, 4))
    enlarged = F.interpolate(torch.from_numpy(pooled)[:, None], size=(h, w), mode="bilinear", align_corners=False)

    def unit(m):
        low, high = m.min(axis=(1, 2), keepdims=True), m.max(axis=(1, 2), keepdims=True)
        return (m - low) / (high - low)

    return unit(grey), unit(enlarged[:, 0].numpy())


def test_scores_figures_and_metrics_of_a_short_run(tmp_path):
    callback = LatentSaliency(every_n_rounds=1, num_images=25, cosine_network="global_model", batch_size=6)
    trainer, data = small_run(tmp_path, callback, rounds=2)
    folder = trainer.run_dir / "latent_saliency"
    first, last = np.load(folder / "round_0001.npz"), np.load(folder / "round_0002.npz")
    indices = last["indices"]
    assert len(np.unique(indices)) == 25 and indices.max() < 40 and np.array_equal(indices, first["indices"])
    assert last["measures"].tolist() == ["ssim", "cosine", "euclidean"]
    assert last["encodings"].tolist() == ["saliency", "f2", "f4", "f8"]
    scores = last["scores"]  # [25, 3, 4]
    assert scores.shape == (25, 3, 4) and np.isfinite(scores).all()

    # the down-sampled latents do not depend on the model: recomputed from the drawn test images
    images = data.test.inputs[torch.from_numpy(indices)].double().numpy()
    for e, factor in enumerate((2, 4, 8), start=1):
        image, latent = _reference_maps(images, factor)
        ssim = [reference_ssim(a, b) for a, b in zip(image[:3], latent[:3], strict=True)]
        assert scores[:3, 0, e] == pytest.approx(ssim, abs=1e-4)
        assert scores[:, 2, e] == pytest.approx(np.sqrt(((image - latent) ** 2).sum(axis=(1, 2))), rel=1e-4)
    assert np.array_equal(first["scores"][:, [0, 2], 1:], scores[:, [0, 2], 1:])
    assert (scores[:, 0] <= 1 + 1e-6).all() and (np.abs(scores[:, 1]) <= 1 + 1e-6).all()
    assert (scores[:, 2] >= 0).all() and (scores[:, 2] <= 32).all()  # ‖a − b‖ ≤ √(32·32) for maps in [0, 1]

    for row, saved in zip(trainer.history, (first, last), strict=True):
        for m, measure in enumerate(("ssim", "cosine", "euclidean")):
            for e, encoding in enumerate(("saliency", "f2", "f4", "f8")):
                assert row[f"analysis/latent_{measure}_{encoding}"] == pytest.approx(saved["scores"][:, m, e].mean())
    assert [p.name for p in callback.last_paths] == ["round_0002.png", "round_0002_examples.png"]
    assert all(p.stat().st_size > 5_000 for p in callback.last_paths)


def test_the_cosine_of_an_imagenet_resnet50_from_a_local_file(tmp_path):
    import timm

    torch.manual_seed(0)
    weights = tmp_path / "resnet50.pth"
    torch.save(timm.create_model("resnet50", pretrained=False).state_dict(), weights)  # its classifier is dropped
    callback = LatentSaliency(num_images=100, resnet50_weights=str(weights), batch_size=20, num_examples=2)
    trainer, data = small_run(tmp_path / "run", callback)
    saved = np.load(trainer.run_dir / "latent_saliency" / "round_0001.npz")
    assert saved["indices"].tolist() == list(range(40))  # fewer test images than asked: all of them

    # the cosine of the image and its 2× latent, through the same network read independently
    network = timm.create_model("resnet50", pretrained=False, num_classes=0).eval()
    network.load_state_dict({k: v for k, v in torch.load(weights).items() if not k.startswith("fc.")})
    image, latent = _reference_maps(data.test.inputs[:5].double().numpy(), 2)
    mean, std = (
        torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1),
        torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1),
    )
    with torch.no_grad():
        embedded = [
            network((torch.tensor(m, dtype=torch.float32)[:, None].repeat(1, 3, 1, 1) - mean) / std)
            for m in (image, latent)
        ]
    expected = F.cosine_similarity(*embedded, dim=1).numpy()
    assert saved["scores"][:5, 1, 1] == pytest.approx(expected, abs=1e-4)
    assert (trainer.run_dir / "latent_saliency" / "round_0001_examples.png").is_file()


def test_weights_of_another_network_are_refused(tmp_path):
    import timm

    path = tmp_path / "resnet18.pth"
    torch.save(timm.create_model("resnet18", pretrained=False).state_dict(), path)
    with pytest.raises(ConfigError, match="not an ImageNet ResNet-50"):
        imagenet_resnet50(str(path))


def test_what_cannot_run_is_reported_together():
    with pytest.raises(ConfigError) as err:
        LatentSaliency(every_n_rounds=-1, num_images=0, factors=[], layer=0, batch_size=0)
    assert len(err.value.problems) == 5
    data = FederatedDataModule(
        Scenes(mode="classification", num_object_classes=10, num_samples=60, image_size=32),
        Dirichlet(num_clients=2, alpha=1.0),
    )
    data.setup()
    mlp = ClassificationClient(10, (3, 32, 32), model="mlp", model_kwargs={"hidden": [8]})
    problems = LatentSaliency(cosine_network="global_model", resnet50_weights="missing.pth").check(mlp, data)
    assert len(problems) == 2
    assert "nn.Conv2d" in problems[0] and "resnet50_weights=missing.pth does not exist" in problems[1]


def test_figures_have_a_box_per_encoding_and_a_row_per_image():
    scores = np.random.default_rng(0).random((30, 3, 4))
    figure = latent_scores_figure(scores, ("saliency", "f2", "f4", "f8"), "run")
    assert len(figure.axes) == 3
    assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == ["saliency", "2× down", "4× down", "8× down"]
    assert figure.axes[2].get_title().startswith("Euclidean distance (lower")
    examples = latent_examples_figure(np.zeros((2, 5, 8, 8)), ("saliency", "f2", "f4", "f8"))
    assert len(examples.axes) == 2 * 5 and examples.axes[0].get_title() == "image"
