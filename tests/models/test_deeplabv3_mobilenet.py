import re

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.segmentation.deeplabv3 import ASPP, DeepLabV3

from fedlight.errors import ConfigError
from fedlight.models import create_model, list_models


def _model(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return create_model("deeplabv3_mobilenetv2", input_shape=(3, 64, 96), num_classes=5, **kwargs)


def _imagenet_state(seed: int) -> dict[str, torch.Tensor]:
    """A MobileNet-V2 state dict in torchvision's layout, with BatchNorm statistics that are not the defaults."""
    torch.manual_seed(seed)
    state = torchvision.models.mobilenet_v2().state_dict()
    return {key: value + torch.rand_like(value) if value.is_floating_point() else value for key, value in state.items()}


def _d_li14_layout(state: dict[str, torch.Tensor], counters: bool) -> dict[str, torch.Tensor]:
    """Renames torchvision's MobileNet-V2 keys as d-li14's model names them (the weights LADD loads).

    d-li14 flattens each block's layers into ``conv.k`` (expansion 1×1 conv, BN, ReLU6, depth-wise conv, BN,
    ReLU6, projection conv, BN: k = 0, 1, 3, 4, 6, 7; the first block has no expansion: 0, 1, 3, 4) and keeps
    the last 1×1 convolution outside ``features``, as ``conv.0`` and ``conv.1``.
    """
    expanded = {"0.0": "0", "0.1": "1", "1.0": "3", "1.1": "4", "2": "6", "3": "7"}
    first = {"0.0": "0", "0.1": "1", "1": "3", "2": "4"}
    renamed = {}
    for key, value in state.items():
        if key.startswith("classifier.") or (not counters and key.endswith("num_batches_tracked")):
            continue
        block = re.match(r"features\.(\d+)\.conv\.(\d\.\d|\d)\.(\w+)$", key)
        if block:
            index, layer, name = block.groups()
            layer = (first if index == "1" else expanded)[layer]
            key = f"features.{index}.conv.{layer}.{name}"
        key = key.replace("features.18.", "conv.")
        renamed[key] = value
    renamed["classifier.weight"] = torch.zeros(1000, 1280)
    return renamed


def test_logits_at_the_input_size_and_features_at_stride_32():
    model = _model().eval()
    x = torch.randn(2, 3, 64, 96)
    features = model.forward_features(x)
    assert features.shape == (2, 256, 2, 3) and features.min() >= 0  # after the head's ReLU
    logits = model(x)
    assert logits.shape == (2, 5, 64, 96)
    torch.testing.assert_close(model.forward_head(features), logits)
    assert model(torch.randn(1, 3, 50, 70)).shape == (1, 5, 50, 70)  # any size through forward


def test_same_outputs_as_torchvisions_deeplabv3_with_the_same_weights():
    model = _model().eval()
    backbone = IntermediateLayerGetter(torchvision.models.mobilenet_v2().features, {"18": "out"})
    reference = DeepLabV3(backbone, torchvision.models.segmentation.deeplabv3.DeepLabHead(1280, 5)).eval()
    reference.load_state_dict(model.state_dict())  # the same keys: backbone.*, classifier.*
    x = torch.randn(2, 3, 64, 96)
    torch.testing.assert_close(model(x), reference(x)["out"])


def test_submodules_are_named_for_ladds_parameter_groups():
    model = _model()
    assert [name for name, _ in model.named_children()] == ["backbone", "classifier"]
    assert model.backbone[-1][0].out_channels == 1280
    aspp = model.classifier[0]
    assert isinstance(aspp, ASPP)
    assert [conv[0].dilation for conv in aspp.convs[1:4]] == [(12, 12), (24, 24), (36, 36)]
    assert aspp.project[0].out_channels == 256 and model.classifier[-1].out_channels == 5
    convs = {name.split(".")[0] for name, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    norms = {name.split(".")[0] for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert convs == norms == {"backbone", "classifier"}  # "bn" spans both, told apart by module type


def test_torchvision_imagenet_weights_load_into_the_backbone_only(tmp_path):
    imagenet = _imagenet_state(seed=1)
    torch.save(imagenet, tmp_path / "mobilenet_v2-b0353104.pth")
    model = _model(encoder_weights=str(tmp_path / "mobilenet_v2-b0353104.pth"))
    head_before = {key: value.clone() for key, value in model.classifier.state_dict().items()}
    model.load_pretrained()
    for key, value in model.backbone.state_dict().items():
        torch.testing.assert_close(value, imagenet[f"features.{key}"])
    torch.testing.assert_close(model.classifier.state_dict(), head_before)


@pytest.mark.parametrize("counters", [True, False])
def test_d_li14_weights_as_ladd_uses_them_load_by_position(tmp_path, counters):
    imagenet = _imagenet_state(seed=2)
    torch.save(_d_li14_layout(imagenet, counters), tmp_path / "mobilenetv2_1.0-0c6065bc.pth")
    model = _model(encoder_weights=str(tmp_path / "mobilenetv2_1.0-0c6065bc.pth"))
    model.load_pretrained()
    for key, value in model.backbone.state_dict().items():
        if counters or not key.endswith("num_batches_tracked"):
            torch.testing.assert_close(value, imagenet[f"features.{key}"])


def test_missing_weights_say_where_to_put_them(tmp_path):
    model = _model(encoder_weights=str(tmp_path / "absent.pth"))  # building needs no file
    with pytest.raises(ConfigError, match=r"MobileNet-V2 ImageNet weights not found at .*absent\.pth") as error:
        model.load_pretrained()
    assert "encoder_weights" in str(error.value) and "mobilenet_v2-b0353104.pth" in str(error.value)


def test_a_file_of_other_weights_is_refused(tmp_path):
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "resnet18.pth")
    with pytest.raises(ConfigError, match="holds no MobileNet-V2"):
        _model(encoder_weights=str(tmp_path / "resnet18.pth")).load_pretrained()


def test_no_weights_keep_the_random_initialisation():
    model = _model()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    model.load_pretrained()
    torch.testing.assert_close(model.state_dict(), before)


def test_registered_and_input_sides_must_fit_the_output_stride():
    assert "deeplabv3_mobilenetv2" in list_models()
    with pytest.raises(ConfigError, match="divisible by its output stride 32"):
        create_model("deeplabv3_mobilenetv2", input_shape=(3, 48, 64), num_classes=5)
