import math

import numpy as np
import pytest
import torch
from torch import nn

from fedlight.clients import DAFormerClient, LocalFit
from fedlight.clients.daformer import (
    RareClassSampling,
    class_mix_masks,
    confidence_weight,
    ema_update,
    mix,
    rcs_probabilities,
    thing_mask,
    warmup_poly_factor,
)
from fedlight.data import FederatedDataModule, Scenes
from fedlight.data.partition import DirichletPowerLaw
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.models.daformer import ContextAwareFusion
from fedlight.strategies import FedAvg

VOID = 255
# three 2×4 label maps over classes 0…3 (class 3 only in image 2), a void pixel in image 0
LABELS = torch.tensor(
    [
        [[0, 0, 0, 0], [0, 1, 1, VOID]],
        [[0, 0, 2, 2], [0, 0, 2, 2]],
        [[1, 1, 0, 0], [3, 0, 0, 0]],
    ]
)


# -- rare-class sampling ---------------------------------------------------------------------------------
def test_class_probabilities_match_a_numpy_computation():
    temperature = 0.5
    pixels = np.array([[(LABELS[i] == c).sum().item() for c in range(4)] for i in range(3)])  # [N, Q]
    frequency = pixels.sum(0) / pixels.sum()  # f = (14, 4, 4, 1) / 23
    expected = np.exp((1 - frequency) / temperature) / np.exp((1 - frequency) / temperature).sum()
    sampling = RareClassSampling.from_labels(LABELS, 4, temperature, min_pixel_share=1 / 8, ignore_index=VOID)
    np.testing.assert_allclose(sampling.probabilities.numpy(), expected, rtol=1e-12)
    np.testing.assert_array_equal(sampling.eligible.numpy(), pixels >= 1)  # ⌊⅛ · 8⌉ = 1 pixel
    assert rcs_probabilities(torch.tensor(pixels.sum(0)), 0.01).argmax() == 3  # the rarest class dominates


def test_a_class_no_image_shows_enough_of_is_never_drawn_and_images_are_drawn_given_their_class():
    sampling = RareClassSampling.from_labels(LABELS, 4, 0.5, min_pixel_share=2 / 8, ignore_index=VOID)  # ≥ 2 pixels
    assert sampling.probabilities[3] == 0  # class 3 has one pixel
    generator = torch.Generator().manual_seed(0)
    draws = [sampling.draw(generator) for _ in range(600)]
    eligible = {0: {0, 1, 2}, 1: {0, 2}, 2: {1}}
    assert all(image in eligible[c] for c, image in draws)
    for c, images in eligible.items():  # every image holding c is drawn, about uniformly
        drawn = [image for cc, image in draws if cc == c]
        assert {image: drawn.count(image) / len(drawn) for image in images} == pytest.approx(
            dict.fromkeys(images, 1 / len(images)), abs=0.1
        )
    classes = np.bincount([c for c, _ in draws], minlength=4) / len(draws)
    np.testing.assert_allclose(classes, sampling.probabilities.numpy(), atol=0.05)


# -- ClassMix --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("present, pasted", [((0, 1, 2), 2), ((0, 1, 2, 3), 2), ((4,), 1)])
def test_class_mix_pastes_half_the_classes_of_each_source_image_rounded_up(present, pasted):
    labels = torch.tensor(present * 4 + (VOID,) * 3)[torch.randperm(4 * len(present) + 3)].view(1, 1, -1)
    for seed in range(5):
        mask = class_mix_masks(labels, torch.Generator().manual_seed(seed), VOID)
        chosen = set(labels[mask].tolist())
        assert len(chosen) == pasted and VOID not in chosen
        assert torch.equal(mask, torch.isin(labels, torch.tensor(sorted(chosen))))  # every pixel of a chosen class


def test_mixed_image_and_pseudo_labels_follow_one_mask():
    generator = torch.Generator().manual_seed(3)
    source_x, target_x = torch.randn(2, 3, 2, 4, generator=generator), torch.randn(2, 3, 2, 4, generator=generator)
    source_y = LABELS[:2]
    pseudo = torch.randint(4, (2, 2, 4), generator=generator)
    mask = class_mix_masks(source_y, torch.Generator().manual_seed(0), VOID)
    mixed_x, mixed_y = mix(mask, source_x, target_x), mix(mask, source_y, pseudo)
    m = mask.numpy()
    for b, i, j in np.ndindex(m.shape):  # the reference, pixel by pixel
        expected_x = (source_x if m[b, i, j] else target_x)[b, :, i, j]
        assert torch.equal(mixed_x[b, :, i, j], expected_x)
        assert mixed_y[b, i, j] == (source_y if m[b, i, j] else pseudo)[b, i, j]


# -- teacher, confidence, schedule ----------------------------------------------------------------------
def test_ema_teacher_update_by_hand():
    teacher, student = nn.BatchNorm1d(1), nn.BatchNorm1d(1)
    nn.init.constant_(teacher.weight, 1.0), nn.init.constant_(student.weight, 3.0)
    student.running_mean.fill_(2.0)
    ema_update(teacher, student, alpha=0.999)
    assert teacher.weight.item() == pytest.approx(0.999 * 1 + 0.001 * 3)  # 1.002
    assert teacher.running_mean.item() == pytest.approx(0.002)
    assert teacher.num_batches_tracked.item() == 0  # integers are not averaged


def test_confidence_weight_is_the_share_of_pixels_above_tau():
    top = torch.tensor([[0.99, 0.97, 0.5, 0.968]])  # > τ: two of four
    probs = torch.stack([top, 1 - top]).unsqueeze(0)  # [1, 2, 1, 4]
    assert confidence_weight(probs, 0.968).tolist() == [0.5]


def test_warmup_then_polynomial_decay_over_the_run_with_a_tenfold_head():
    client = _client(warmup_iters=15)
    client.local_fit = LocalFit(round_idx=1, rounds=4, num_steps=10)  # iterations 10…19 of 40
    configured = client.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    encoder_lr, head_lr = [], []
    for _ in range(10):
        encoder_lr.append(optimizer.param_groups[0]["lr"])
        head_lr.append(optimizer.param_groups[2]["lr"])
        optimizer.step()
        scheduler.step()
    by_hand = {10: 6e-5 * (1 - 10 / 40) * (1e-6 + (1 - 1e-6) * 10 / 15), 15: 6e-5 * (1 - 15 / 40), 19: 6e-5 * 21 / 40}
    for iteration, lr in by_hand.items():
        assert encoder_lr[iteration - 10] == pytest.approx(lr)
        assert head_lr[iteration - 10] == pytest.approx(10 * lr)
    assert warmup_poly_factor(0, 40, 15) == pytest.approx(1e-6)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.01, 0.0, 0.01]
    assert all("norm" in name for name, p in client.net.encoder.named_parameters() if any(
        p is q for q in optimizer.param_groups[1]["params"]))  # fmt: skip


# -- feature distance and network ------------------------------------------------------------------------
def test_thing_mask_keeps_cells_mostly_of_a_thing_class():
    labels = torch.tensor([[[5, 5, 1, 1], [5, 0, 1, 1]]])  # two 2×2 cells: ¾ of class 5, all of class 1
    assert thing_mask(labels, (1, 2), torch.tensor([5])).tolist() == [[[True, False]]]
    assert thing_mask(labels, (1, 2), torch.tensor([5]), min_ratio=0.8).tolist() == [[[False, False]]]


def test_context_aware_fusion_shapes():
    levels = [torch.randn(2, c, 16 // s, 16 // s) for c, s in ((8, 1), (16, 2), (24, 4), (32, 8))]
    fusion = ContextAwareFusion([8, 16, 24, 32], embed_dim=12)
    assert fusion(levels).shape == (2, 12, 16, 16)
    assert [branch[0].dilation for branch in fusion.branches] == [(1, 1), (6, 6), (12, 12), (18, 18)]
    assert all(branch[0].groups == 48 and branch[0].kernel_size == (3, 3) for branch in fusion.branches)


# -- the client through the engine -----------------------------------------------------------------------
def _scenes(seed: int) -> Scenes:
    return Scenes(num_samples=8, image_size=32, label_set="macro", num_test_samples=4, seed=seed)


def _client(**kwargs) -> DAFormerClient:
    torch.manual_seed(0)
    settings = {"encoder_name": "mit_b0", "pretrained": False, "embed_dim": 16}
    return DAFormerClient(5, (3, 32, 32), _scenes(1), model_kwargs=settings, fd_classes=(1, 2), **kwargs)


def test_one_training_step_through_the_engine_changes_the_weights(tmp_path):
    client = _client(rcs_min_pixel_share=0.01)
    client.configure_model()
    before = {name: p.detach().clone() for name, p in client.net.named_parameters()}
    teacher_before = {name: p.detach().clone() for name, p in client.ema_teacher.named_parameters()}
    data = FederatedDataModule(_scenes(2), DirichletPowerLaw(num_clients=2, alpha=1.0), batch_size=2, centralized=True)
    settings = {"logger": "csv", "enable_progress_bar": False, "default_root_dir": tmp_path}
    metrics = FederatedTrainer(rounds=1, clients_per_round=1, local_steps=2, **settings).fit(client, data, FedAvg())
    assert math.isfinite(metrics["test/miou"]) and not metrics.get("round/clients_failed")
    after = dict(client.net.named_parameters())
    assert any(not torch.equal(before[name], after[name]) for name in before)
    # the second step moved φ by (1 − ½) towards θ, and the frozen ImageNet encoder stayed as it was
    teacher = dict(client.ema_teacher.named_parameters())
    assert any(not torch.equal(teacher_before[name], teacher[name]) for name in teacher)
    imagenet = dict(client.imagenet_encoder.named_parameters())
    assert all(torch.equal(imagenet[name], before[f"encoder.{name}"]) for name in imagenet)


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as error:
        _client(ema_alpha=1.0, rcs_temperature=0.0, fd_lambda=-1.0)
    message = str(error.value)
    assert "ema_alpha" in message and "rcs_temperature" in message and "fd_lambda" in message
