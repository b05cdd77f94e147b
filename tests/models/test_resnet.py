"""The timm ResNets: feature/head split, MOON's projection head, input standardisation, pretrained weights."""

import pytest
import timm
import torch

from fedlight.errors import ConfigError
from fedlight.models import create_model


def tiny(**kwargs):
    torch.manual_seed(0)
    kwargs = {"channels": (4, 8, 8, 8), "layers": (1, 1, 1, 1), **kwargs}
    return create_model("resnet18", input_shape=(3, 16, 16), num_classes=5, **kwargs).eval()


def test_full_size_models_have_the_papers_feature_sizes():
    assert create_model("resnet18", input_shape=(3, 32, 32), num_classes=10).num_features == 512
    assert create_model("resnet50", input_shape=(3, 64, 64), num_classes=200).num_features == 2048


def test_features_are_the_pooled_encoder_output():
    model = tiny()
    x = torch.randn(2, 3, 16, 16)
    pooled = model.backbone.forward_features(x).mean(dim=(2, 3))  # global average pooling, by hand
    torch.testing.assert_close(model.forward_features(x), pooled)


def test_moon_projection_head_feeds_the_classifier():
    model = tiny(projection_dim=6)
    x = torch.randn(2, 3, 16, 16)
    pooled = model.backbone.forward_features(x).mean(dim=(2, 3))  # h [2, 8]
    first, _, second = model.projection
    z = second(torch.relu(first(pooled)))
    torch.testing.assert_close(model.forward_features(x), z)
    assert (first.in_features, first.out_features, second.out_features) == (8, 8, 6)
    assert model.head.in_features == 6 and model.num_features == 6
    torch.testing.assert_close(model(x), model.head(z))


def test_uint8_images_are_standardised_floats_pass_unchanged():
    model = tiny(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    standardised = (images.float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(model(images), model(standardised))
    assert "mean" not in model.state_dict()  # constants are not aggregated or checkpointed


def test_cifar_stem_keeps_the_resolution():
    model = tiny(cifar_stem=True)
    assert model.backbone.conv1.stride == (1, 1) and model.backbone.conv1.kernel_size == (3, 3)
    assert model.backbone.forward_features(torch.randn(1, 3, 16, 16)).shape[-1] == 2  # 16 / 8


def test_pretrained_weights_load_from_a_local_file(tmp_path):
    # a stand-in for PyTorch's ImageNet checkpoint: a random timm ResNet-18 with its 1000-class classifier
    torch.manual_seed(1)
    reference = timm.create_model("resnet18", num_classes=1000)
    path = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), path)
    model = create_model(
        "resnet18", input_shape=(3, 32, 32), num_classes=10, pretrained=True, pretrained_file=str(path)
    )
    assert not torch.equal(model.backbone.conv1.weight, reference.conv1.weight)  # read once the run starts
    model.load_pretrained()
    torch.testing.assert_close(model.backbone.conv1.weight, reference.conv1.weight)
    torch.testing.assert_close(model.backbone.layer4[1].bn2.running_var, reference.layer4[1].bn2.running_var)
    assert model.head.out_features == 10  # a new classifier


def test_missing_pretrained_file_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match=r"pretrained_file=.*absent\.pth does not exist"):
        create_model(
            "resnet18", input_shape=(3, 32, 32), num_classes=10, pretrained=True,
            pretrained_file=str(tmp_path / "absent.pth"),
        )  # fmt: skip


def test_pretrained_with_custom_widths_is_refused():
    with pytest.raises(ConfigError, match="leave channels, layers and stem_width unset"):
        create_model("resnet18", input_shape=(3, 32, 32), num_classes=10, pretrained=True, channels=(8, 8, 8, 8))


def test_narrow_stem_feeds_the_first_block():
    model = tiny(stem_width=4)
    backbone = model.backbone
    assert backbone.conv1.out_channels == backbone.bn1.num_features == 4
    assert backbone.layer1[0].conv1.in_channels == backbone.layer1[0].downsample[0].in_channels == 4
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 5)


def test_a_damaged_pretrained_file_is_one_message_naming_it(tmp_path):
    path = tmp_path / "resnet18.pth"
    path.write_bytes(b"not a checkpoint")
    model = create_model(
        "resnet18", input_shape=(3, 32, 32), num_classes=10, pretrained=True, pretrained_file=str(path)
    )
    with pytest.raises(ConfigError, match=rf"The weights file {path} could not be read"):
        model.load_pretrained()


def test_weights_of_another_network_are_refused_by_name(tmp_path):
    path = tmp_path / "resnet50.pth"
    torch.save(timm.create_model("resnet50", num_classes=1000).state_dict(), path)
    model = create_model(
        "resnet18", input_shape=(3, 32, 32), num_classes=10, pretrained=True, pretrained_file=str(path)
    )
    with pytest.raises(ConfigError, match=rf"{path} do not fit resnet18"):
        model.load_pretrained()
