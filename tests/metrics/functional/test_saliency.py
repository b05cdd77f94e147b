"""Guided-backpropagation saliency against a two-layer network computed by hand, and its invariances."""

import math

import pytest
import torch
from torch import nn

from fedlight.metrics.functional.saliency import (
    guided_relus,
    layer_weights,
    saliency_norms,
    vanilla_latent_norms,
)
from fedlight.models import create_model


def hand_network() -> nn.Module:
    """conv1 (1→2, 1×1, weights (1, −1)) → ReLU → conv2 (2→1, 1×1, weights (2, −1)) → linear (2 → 2 classes)."""
    net = nn.Sequential(
        nn.Conv2d(1, 2, 1, bias=False), nn.ReLU(), nn.Conv2d(2, 1, 1, bias=False), nn.Flatten(),
        nn.Linear(2, 2, bias=False),
    )  # fmt: skip
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([1.0, -1.0]).view(2, 1, 1, 1))
        net[2].weight.copy_(torch.tensor([2.0, -1.0]).view(1, 2, 1, 1))
        net[4].weight.copy_(torch.tensor([[1.0, 3.0], [1.0, -1.0]]))
    return net


# The 1×2 image x = (1, −2), twice: once with target class 0, once with class 1.
#   F1 = (x, −x) = ((1, −2), (−1, 2)),  ReLU(F1) = ((1, 0), (0, 2)),  F2 = 2·(1, 0) − (0, 2) = (2, −2)
# class 0: ∂Y/∂F2 = (1, 3).  G2 = (1, 3)⊙ReLU(F2) = (2, 0): N2 = 2.
#   ∂Y/∂ReLU(F1) = (2·(1, 3), −1·(1, 3)) = ((2, 6), (−1, −3)).
#   guided: keep positive gradients at positive F1: ((2, 0), (0, 0)); G1 = ((2, 0), (0, 0)); Ḡ1 = (1, 0): N1 = 1.
#   plain: ((2, 0), (0, −3)); G1 = ((2, 0), (0, −6)); Ḡ1 = (1, −3): N1 = √10.
# class 1: ∂Y/∂F2 = (1, −1).  G2 = (2, 0): N2 = 2.
#   ∂Y/∂ReLU(F1) = ((2, −2), (−1, 1)); guided: ((2, 0), (0, 1)); G1 = ((2, 0), (0, 2)); Ḡ1 = (1, 1): N1 = √2.
#   plain: ((2, 0), (0, 1)): the same, as the masked-out gradients were the negative ones.
IMAGES = torch.tensor([1.0, -2.0]).view(1, 1, 1, 2).repeat(2, 1, 1, 1)
TARGETS = torch.tensor([0, 1])


def test_guided_backprop_by_hand():
    norms = saliency_norms(hand_network(), IMAGES, TARGETS)
    torch.testing.assert_close(norms, torch.tensor([[1.0, 2.0], [math.sqrt(2), 2.0]]))


def test_plain_gradient_times_activation_by_hand():
    norms = saliency_norms(hand_network(), IMAGES, TARGETS, guided=False)
    torch.testing.assert_close(norms, torch.tensor([[math.sqrt(10), 2.0], [math.sqrt(2), 2.0]]))


def test_layer_weights_decay_from_shallow_to_deep():
    # R for the class-0 image with τ = 0.5: N1 + 0.5·N2 = 1 + 1
    assert float(layer_weights(2, 0.5) @ saliency_norms(hand_network(), IMAGES[:1], TARGETS[:1])[0].double()) == 2.0


def test_hooks_are_removed_and_no_parameter_gradient_is_left():
    net = hand_network()
    saliency_norms(net, IMAGES, TARGETS)
    assert all(p.grad is None for p in net.parameters())
    assert not any(m._forward_hooks for m in net.modules())
    with guided_relus(net) as count:
        assert count == 1
    assert not net[1]._forward_hooks


def tiny_resnet() -> nn.Module:
    torch.manual_seed(0)
    net = create_model("resnet18", input_shape=(3, 16, 16), num_classes=4, channels=(4, 8, 8, 8), layers=(1, 1, 1, 1))
    for module in net.modules():  # timm starts each block's last BatchNorm at 0, which would silence its convs
        if isinstance(module, nn.BatchNorm2d):
            nn.init.uniform_(module.weight, 0.5, 1.5)
    return net.eval()


def test_norms_do_not_depend_on_the_batch():
    # in eval mode images do not interact: one batch of 6 equals 6 batches of 1, image by image
    net = tiny_resnet()
    images = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([0, 1, 2, 3, 0, 1])
    together = saliency_norms(net, images, targets)
    apart = torch.cat([saliency_norms(net, images[i : i + 1], targets[i : i + 1]) for i in range(6)])
    torch.testing.assert_close(together, apart, rtol=1e-4, atol=1e-7)
    # stem, then two convs per block and a 1×1 downsample where the shape changes: in every stage here,
    # as timm's stem stays 64 wide
    assert together.shape == (6, 1 + 2 * 4 + 4)
    assert bool((together.sum(dim=0) > 0).all())  # every convolution has some saliency


def test_vanilla_latents_by_hand():
    # 2 channels of 4×4, f = 2: channel 0 is all 1, channel 1 holds 0…15 row by row.
    # Pooled channel 1: (2.5, 4.5, 10.5, 12.5); channel mean: (1.75, 2.75, 5.75, 6.75).
    image = torch.stack([torch.ones(4, 4), torch.arange(16.0).view(4, 4)])[None]
    expected = math.sqrt(1.75**2 + 2.75**2 + 5.75**2 + 6.75**2)
    assert vanilla_latent_norms(image, 2).item() == pytest.approx(expected)
    # f = 4 leaves one value, the mean of everything: (1 + 7.5)/2
    assert vanilla_latent_norms(image, 4).item() == pytest.approx(4.25)
