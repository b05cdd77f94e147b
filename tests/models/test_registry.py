"""``create_model`` by registered name or by import path."""

import sys

import pytest
import torch
from torch import nn

from fedlight.errors import ConfigError
from fedlight.models import create_model
from fedlight.models.mlp import MLP


def linear_probe(input_shape: tuple[int, ...], num_classes: int, bias: bool = True) -> nn.Module:
    """A function, not a class, building a network (imported by path in the tests below)."""
    net = MLP(input_shape, num_classes, hidden=())
    net.head = nn.Linear(net.num_features, num_classes, bias=bias)
    return net


def test_an_import_path_builds_a_class_with_the_shapes_and_model_kwargs():
    net = create_model("fedlight.models.MLP", input_shape=[12], num_classes=3, hidden=[5])
    assert isinstance(net, MLP) and net.num_features == 5
    assert net(torch.zeros(2, 12)).shape == (2, 3)


def test_an_import_path_may_name_a_function():
    net = create_model(f"{__name__}.linear_probe", input_shape=(4, 2), num_classes=3, bias=False)
    assert net.head.bias is None and net.head.in_features == 8


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("resnet999", "Unknown model 'resnet999' (--model.init_args.model). Registered models: celeba_cnn, cnn"),
        ("nopkg_here.Net", "--model.init_args.model=nopkg_here.Net is neither a registered model"),
        ("fedlight.models.NoSuchNet", "--model.init_args.model=fedlight.models.NoSuchNet is neither"),
        ("fedlight.models.registry._REGISTRY", "is not a class or function that builds a network"),
    ],
)
def test_a_name_that_is_neither_registered_nor_importable_names_the_flag(name, message):
    with pytest.raises(ConfigError) as error:
        create_model(name, input_shape=(4,), num_classes=2)
    assert message in str(error.value)
    assert "nopkg_here" not in sys.modules


def test_a_torchvision_constructor_is_called_with_num_classes_only():
    # torchvision's resnet18(*, weights, progress, **kwargs) has no input_shape: fedlight's convention would
    # hand it an argument ResNet refuses.
    net = create_model("torchvision.models.resnet18", input_shape=(3, 32, 32), num_classes=7)
    assert net.fc.out_features == 7
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_a_timm_network_reads_its_pooled_features_as_the_classifiers_input():
    net = create_model("timm.create_model", input_shape=(3, 32, 32), num_classes=5, model_name="resnet18")
    x = torch.randn(2, 3, 32, 32)
    features = net.forward_features(x)
    assert features.shape == (2, net.num_features) == (2, 512)
    # the pooled map: the mean over space of timm's own unpooled features
    assert torch.allclose(features, net.net.forward_features(x).mean(dim=(2, 3)), atol=1e-6)
    assert torch.allclose(net.forward_head(features), net(x), atol=1e-5)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("torch.nn.Linear", {}, "its parameters are (in_features, out_features, bias, device, dtype)"),
        ("torchvision.models.resnet18", {"width": 3}, "unexpected keyword argument 'width'"),
        (f"{__name__}.not_a_network", {}, "it returned a str, not a torch.nn.Module"),
    ],
)
def test_a_callable_that_does_not_fit_the_contract_says_how_it_is_called(name, kwargs, message):
    with pytest.raises(ConfigError) as error:
        create_model(name, input_shape=(3, 8, 8), num_classes=2, **kwargs)
    text = str(error.value)
    assert f"--model.init_args.model={name} cannot build the network" in text and message in text
    assert f"{name}(num_classes=..., **model_kwargs)" in text


def not_a_network(num_classes: int) -> str:
    return "mlp"
