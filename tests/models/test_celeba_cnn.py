import pytest
import torch

from fedlight.errors import ConfigError
from fedlight.models import CelebACNN, create_model


def test_celeba_cnn_has_leafs_1152_features_at_84_pixels() -> None:
    torch.manual_seed(0)
    model = create_model("celeba_cnn", input_shape=(3, 84, 84), num_classes=2)
    assert isinstance(model, CelebACNN) and model.num_features == 32 * 6 * 6 == 1152
    x = torch.randn(4, 3, 84, 84)
    features = model.forward_features(x)
    assert features.shape == (4, 1152)
    torch.testing.assert_close(model(x), model.forward_head(features))
    assert model(x).shape == (4, 2)


def test_celeba_cnn_pools_with_tensorflow_same_padding() -> None:
    model = create_model("celeba_cnn", input_shape=(3, 84, 84), num_classes=2)
    sides = []
    for module in model.modules():
        if isinstance(module, torch.nn.MaxPool2d):
            module.register_forward_hook(lambda _, __, out: sides.append(out.shape[-1]))
    model.eval()(torch.zeros(1, 3, 84, 84))
    assert sides == [42, 21, 11, 6]  # ceil(side / 2), not floor: 21 → 11


def test_celeba_cnn_matches_leafs_layers() -> None:
    model = create_model("celeba_cnn", input_shape=(3, 84, 84), num_classes=2)
    kinds = [type(m).__name__ for m in model.encoder]
    assert kinds == ["Conv2d", "BatchNorm2d", "MaxPool2d", "ReLU"] * 4 + ["Flatten"]
    # conv 3·9·32 + 32, then three of 32·9·32 + 32; four BatchNorms of 2·32; dense 1152·2 + 2
    assert sum(p.numel() for p in model.parameters()) == 896 + 3 * 9248 + 4 * 64 + 2306


def test_celeba_cnn_rejects_flat_inputs_with_advice() -> None:
    with pytest.raises(ConfigError, match="mlp"):
        create_model("celeba_cnn", input_shape=(60,), num_classes=2)
