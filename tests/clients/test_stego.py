import math

import numpy as np
import pytest
import torch

from fedlight.clients.stego import (
    STEGO_PRESETS,
    ClusterLookup,
    CorrespondenceWeights,
    StegoHead,
    correspondence_loss,
    correspondence_term,
    feature_correlation,
    sample_at,
    super_perm,
)
from fedlight.errors import ConfigError

WEIGHTS = CorrespondenceWeights(lambda_self=1.0, lambda_knn=0.5, lambda_rand=0.25, b_self=0.4, b_knn=0.2, b_rand=0.3)


def _constant_maps(vectors, size=(5, 6)):
    """[B, C, h, w] maps whose every location holds the image's vector."""
    return torch.tensor(vectors, dtype=torch.float64)[:, :, None, None].expand(-1, -1, *size).contiguous()


def test_presets_are_the_official_configurations():
    city, coco = STEGO_PRESETS["cityscapes"], STEGO_PRESETS["cocostuff"]
    assert (city.lambda_self, round(city.lambda_knn, 4), round(city.lambda_rand, 4)) == (1.0, 0.5775, 0.9059)
    assert (round(city.b_self, 4), round(city.b_knn, 4), round(city.b_rand, 4)) == (0.4583, 0.1754, 0.3136)
    assert (coco.lambda_self, coco.lambda_knn, round(coco.lambda_rand, 4)) == (0.1, 1.0, 0.1538)
    assert (coco.b_self, coco.b_knn, coco.b_rand) == (0.12, 0.2, 1.0)


def test_identical_images_give_the_closed_form_loss():
    # Every location of every image, neighbour and negative holds u = (1, 0) with code v = (0, 2):
    # F = Cc = 1 everywhere, so each pairing contributes −1 · (1 − b).
    feats, codes = _constant_maps([[1.0, 0.0]] * 4), _constant_maps([[0.0, 2.0]] * 4)
    total, terms = correspondence_loss(feats, codes, feats, codes, WEIGHTS, samples=3)
    assert terms["self"].item() == pytest.approx(0.4 - 1)
    assert terms["knn"].item() == pytest.approx(0.2 - 1)
    assert terms["rand"].item() == pytest.approx(0.3 - 1)
    assert total.item() == pytest.approx(1.0 * (0.4 - 1) + 0.5 * (0.2 - 1) + 0.25 * (0.3 - 1))


def test_two_constant_images_give_the_closed_form_loss():
    # Image 0: u0 = (1, 0), v0 = (1, 0); image 1: u1 = (0.6, 0.8), v1 = (0.8, 0.6). Neighbours are the other image,
    # and with B = 2 every super_perm is the swap [1, 0]: cross pairs have F = ⟨u0, u1⟩ = 0.6, Cc = ⟨v0, v1⟩ = 0.8.
    feats, codes = _constant_maps([[1.0, 0.0], [0.6, 0.8]]), _constant_maps([[1.0, 0.0], [0.8, 0.6]])
    total, terms = correspondence_loss(feats, codes, feats.flip(0), codes.flip(0), WEIGHTS, samples=4)
    assert terms["self"].item() == pytest.approx(0.4 - 1)
    assert terms["knn"].item() == pytest.approx(-0.8 * (0.6 - 0.2))
    assert terms["rand"].item() == pytest.approx(-0.8 * (0.6 - 0.3))
    assert total.item() == pytest.approx((0.4 - 1) - 0.5 * 0.8 * 0.4 - 0.25 * 0.8 * 0.3)


def test_pointwise_centring_replaces_each_pair_correlation_by_the_batch_mean():
    # Partners (u0, u0) for anchors (u0, u1): raw F is 1 and 0.6, centred F is their mean 0.8 for both;
    # Cc is 1 and 0.8, so the term is mean(−1 · (0.8 − b), −0.8 · (0.8 − b)) with pointwise centring.
    feats, codes = _constant_maps([[1.0, 0.0], [0.6, 0.8]]), _constant_maps([[1.0, 0.0], [0.8, 0.6]])
    pair_feats, pair_codes = _constant_maps([[1.0, 0.0]] * 2), _constant_maps([[1.0, 0.0]] * 2)
    b = 0.2
    centred = correspondence_term(feats, pair_feats, codes, pair_codes, b, pointwise=True)
    raw = correspondence_term(feats, pair_feats, codes, pair_codes, b, pointwise=False)
    assert centred.item() == pytest.approx(-(1.0 + 0.8) / 2 * (0.8 - b))
    assert raw.item() == pytest.approx((-(1.0 - b) - 0.8 * (0.6 - b)) / 2)


def test_pointwise_centring_matches_a_direct_computation():
    generator = torch.Generator().manual_seed(0)
    f1, f2 = torch.randn(2, 6, 3, 4, generator=generator), torch.randn(2, 6, 5, 2, generator=generator)
    a = f1.numpy() / np.linalg.norm(f1.numpy(), axis=1, keepdims=True)
    b = f2.numpy() / np.linalg.norm(f2.numpy(), axis=1, keepdims=True)
    raw = np.einsum("bchw,bcij->bhwij", a, b)
    expected = raw - raw.mean(axis=(3, 4), keepdims=True) + raw.mean()
    centred = feature_correlation(f1, f2).numpy()
    np.testing.assert_allclose(centred, expected, atol=1e-6)
    # every anchor location's correlations now average to the global mean of the raw tensor
    np.testing.assert_allclose(centred.mean(axis=(3, 4)), np.full((2, 3, 4), raw.mean()), atol=1e-6)
    np.testing.assert_allclose(feature_correlation(f1, f2, pointwise=False).numpy(), raw, atol=1e-6)


def test_zero_clamp_ignores_codes_that_already_disagree():
    feats, codes = _constant_maps([[1.0, 0.0], [0.6, 0.8]]), _constant_maps([[1.0, 0.0], [-0.8, 0.6]])
    pair_feats, pair_codes = feats.flip(0), codes.flip(0)  # Cc = −0.8 for both pairs, F = 0.6
    assert correspondence_term(feats, pair_feats, codes, pair_codes, 0.2).item() == 0.0
    unclamped = correspondence_term(feats, pair_feats, codes, pair_codes, 0.2, zero_clamp=False)
    assert unclamped.item() == pytest.approx(0.8 * (0.6 - 0.2))


def test_gradient_reaches_the_codes_only():
    generator = torch.Generator().manual_seed(1)
    feats = torch.randn(4, 8, 6, 6, generator=generator, requires_grad=True)
    codes = torch.randn(4, 3, 6, 6, generator=generator, requires_grad=True)
    feats_knn = torch.randn(4, 8, 6, 6, generator=generator, requires_grad=True)
    codes_knn = torch.randn(4, 3, 6, 6, generator=generator, requires_grad=True)
    total, _ = correspondence_loss(feats, codes, feats_knn, codes_knn, STEGO_PRESETS["cityscapes"], generator=generator)
    total.backward()
    assert feats.grad is None and feats_knn.grad is None
    assert codes.grad.abs().sum() > 0 and codes_knn.grad.abs().sum() > 0


def test_loss_is_reproducible_from_the_generator():
    generator = torch.Generator().manual_seed(2)
    feats, codes = torch.randn(3, 8, 5, 5, generator=generator), torch.randn(3, 4, 5, 5, generator=generator)
    first, _ = correspondence_loss(feats, codes, feats, codes, WEIGHTS, generator=torch.Generator().manual_seed(7))
    second, _ = correspondence_loss(feats, codes, feats, codes, WEIGHTS, generator=torch.Generator().manual_seed(7))
    assert first.item() == second.item()


def test_sampling_follows_the_align_corners_convention():
    maps = torch.arange(12.0).view(1, 1, 3, 4)  # rows y = 0..2, columns x = 0..3
    coords = torch.tensor([[[[-1.0, -1.0], [1.0, 1.0], [1.0, -1.0], [0.0, 0.0], [3.0, -1.0]]]])  # (x, y)
    # corners are pixel centres; (0, 0) is the middle of the 3×4 grid: row 1, column 1.5; (3, −1) clamps to the border
    assert sample_at(maps, coords).flatten().tolist() == [0.0, 11.0, 3.0, 5.5, 3.0]


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_super_perm_has_no_fixed_points(size):
    generator = torch.Generator().manual_seed(size)
    for _ in range(200):
        assert (super_perm(size, generator) != torch.arange(size)).all()
        derangement = super_perm(size, generator, derangement=True)
        assert (derangement != torch.arange(size)).all()
        assert sorted(derangement.tolist()) == list(range(size))


def test_super_perm_moves_fixed_points_one_place_on():
    # A permutation of 3 with fixed points may map two anchors to one partner: not always a bijection.
    generator = torch.Generator().manual_seed(0)
    draws = {tuple(super_perm(3, generator).tolist()) for _ in range(300)}
    assert (1, 2, 0) in draws and (2, 0, 1) in draws
    assert any(len(set(d)) < 3 for d in draws)
    reference = torch.Generator().manual_seed(5)
    perm = torch.randperm(6, generator=reference)
    expected = [(p + 1) % 6 if p == i else p for i, p in enumerate(perm.tolist())]
    assert super_perm(6, torch.Generator().manual_seed(5)).tolist() == expected


def test_head_sums_a_linear_and_a_nonlinear_branch():
    head = StegoHead(in_channels=8, dim=3).eval()
    features = torch.randn(2, 8, 4, 5)
    pixels = features.permute(0, 2, 3, 1)  # [B, h, w, C]

    def conv(layer, x):
        return x @ layer.weight[:, :, 0, 0].T + layer.bias

    first, _, second = head.nonlinear
    expected = conv(head.linear, pixels) + conv(second, torch.relu(conv(first, pixels)))
    torch.testing.assert_close(head(features), expected.permute(0, 3, 1, 2))
    assert head.linear_dropout.p == head.nonlinear_dropout.p == 0.1


def test_head_dropout_drops_whole_channels():
    head = StegoHead(in_channels=8, dim=3, dropout=0.5).train()
    with torch.no_grad():
        for layer in (head.nonlinear[0], head.nonlinear[2]):
            layer.weight.zero_(), layer.bias.zero_()
        head.linear.bias.zero_()
        head.linear.weight.copy_(torch.eye(3, 8)[:, :, None, None])  # code = the first 3 input channels
    torch.manual_seed(0)
    codes = head(torch.ones(16, 8, 2, 2))
    # a channel is either dropped everywhere (0) or kept and rescaled by 1 / (1 − p) = 2
    assert set(codes.unique().tolist()) == {0.0, 2.0}
    assert (codes.amax(dim=(2, 3)) == codes.amin(dim=(2, 3))).all()


def test_centroid_loss_of_hand_placed_codes():
    lookup = ClusterLookup(num_clusters=2, dim=2)
    with torch.no_grad():
        lookup.clusters.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    codes = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, -3.0]]).T.reshape(1, 2, 1, 3)  # [B, D, h, w]
    similarities = lookup(codes)
    expected = [[1.0, 0.0], [1 / math.sqrt(2), 1 / math.sqrt(2)], [0.0, -1.0]]
    torch.testing.assert_close(similarities[0, :, 0].T, torch.tensor(expected))
    # best similarity per pixel: 1, 1/√2, 0
    assert lookup.loss(codes).item() == pytest.approx(-(1 + 1 / math.sqrt(2) + 0) / 3)


def test_centroid_loss_trains_the_centroids_only():
    lookup = ClusterLookup(num_clusters=4, dim=3)
    codes = torch.randn(2, 3, 4, 4, requires_grad=True)
    lookup.loss(codes).backward()
    assert codes.grad is None
    assert lookup.clusters.grad.abs().sum() > 0


def test_separation_term_adds_the_mean_cosine_of_distinct_centroids():
    lookup = ClusterLookup(num_clusters=3, dim=2, separation_weight=0.5)
    with torch.no_grad():
        lookup.clusters.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]))
    codes = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)  # best similarity 1
    # distinct pairs: cos = 0, 1/√2, 1/√2 → mean √2/3
    assert lookup.loss(codes).item() == pytest.approx(-1 + 0.5 * math.sqrt(2) / 3)


def test_a_separation_term_with_one_centroid_names_both_flags():
    with pytest.raises(ConfigError, match=r"separation_weight=0\.5.*num_clusters=1"):
        ClusterLookup(num_clusters=1, dim=2, separation_weight=0.5)
    assert ClusterLookup(num_clusters=1, dim=2).clusters.shape == (1, 2)  # no term, no problem
