import math

import pytest
import torch
from scipy.stats import entropy as scipy_entropy

from fedlight.metrics.functional.entropy import feature_entropy, softmax_entropy


def test_softmax_entropy_matches_scipy_and_lies_in_0_log_c():
    logits = torch.randn(2, 5, 6, 7, generator=torch.Generator().manual_seed(0)) * 3
    maps = softmax_entropy(logits)
    assert maps.shape == (2, 6, 7)
    probs = logits.softmax(dim=1)
    expected = scipy_entropy(probs.permute(0, 2, 3, 1).reshape(-1, 5).numpy(), axis=1).reshape(2, 6, 7)
    torch.testing.assert_close(maps, torch.from_numpy(expected).float(), atol=1e-5, rtol=1e-5)
    assert maps.min() >= 0 and maps.max() <= math.log(5) + 1e-6
    assert softmax_entropy(torch.zeros(1, 5, 2, 2)).sub(math.log(5)).abs().max() < 1e-6  # uniform: the maximum


def test_feature_entropy_normalises_over_channels_then_upsamples():
    features = torch.rand(2, 8, 4, 4, generator=torch.Generator().manual_seed(1)).relu()
    low = feature_entropy(features)
    assert low.shape == (2, 4, 4)
    q = (features / features.sum(dim=1, keepdim=True)).permute(0, 2, 3, 1).reshape(-1, 8).numpy()
    torch.testing.assert_close(
        low, torch.from_numpy(scipy_entropy(q, axis=1)).float().view(2, 4, 4), atol=1e-5, rtol=1e-5
    )
    full = feature_entropy(features, size=(16, 16))
    assert full.shape == (2, 16, 16) and full.min() >= 0 and full.max() <= math.log(8) + 1e-6
    expected = torch.nn.functional.interpolate(low[:, None], size=(16, 16), mode="bilinear")[:, 0]
    torch.testing.assert_close(full, expected)


@pytest.mark.parametrize(
    ("pixel", "expected"),
    [
        ([0.0, 0.0, 0.0, 0.0], 0.0),
        ([0.0, 2.0, 0.0, 0.0], 0.0),
        ([1.0, 1.0, 1.0, 1.0], math.log(4)),
        ([-1.0, 1.0], math.log(1)),
    ],
)
def test_feature_entropy_edge_cases(pixel, expected):
    # an all-zero pixel and a single active channel have no entropy; a negative pixel is shifted to ≥ 0
    # first ([-1, 1] → [0, 2]: one active channel)
    features = torch.tensor(pixel).view(1, -1, 1, 1)
    assert feature_entropy(features).item() == pytest.approx(expected, abs=1e-6)
