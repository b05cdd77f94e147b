import pytest
import torch

from fedlight.errors import ConfigError
from fedlight.models.patch_features import build_patch_backbone


@pytest.mark.parametrize(
    ("name", "kwargs", "channels"),
    [
        ("vit_tiny_patch8", {}, 64),
        ("vit_tiny_patch8", {"embed_dim": 32}, 32),
        ("conv_patch8", {"out_channels": 16}, 16),
    ],
)
def test_feature_map_has_one_position_per_8x8_patch(name, kwargs, channels):
    backbone = build_patch_backbone(name, image_size=32, **kwargs)
    assert backbone(torch.zeros(2, 3, 32, 40)).shape == (2, channels, 4, 5)


def test_vit_features_are_the_normed_patch_tokens_without_the_class_token():
    torch.manual_seed(0)
    backbone = build_patch_backbone("vit_tiny_patch8", image_size=32).eval()
    images = torch.randn(2, 3, 32, 32)
    tokens = backbone.vit.forward_features(images)  # [2, 1 + 16, 64]
    expected = tokens[:, 1:].reshape(2, 4, 4, 64).permute(0, 3, 1, 2)  # row-major patch grid
    torch.testing.assert_close(backbone(images), expected, rtol=0, atol=0)


def test_dino_style_checkpoint_loads_from_the_teacher_with_prefixes(tmp_path):
    torch.manual_seed(0)
    source = build_patch_backbone("vit_tiny_patch8", image_size=32).eval()
    teacher = {f"module.backbone.{k}": v for k, v in source.vit.state_dict().items()}
    teacher["module.head.mlp.0.weight"] = torch.zeros(3, 3)  # DINO's projection head is not part of the ViT
    path = tmp_path / "dino.pth"
    torch.save({"teacher": teacher, "student": {}}, path)
    torch.manual_seed(1)
    target = build_patch_backbone("vit_tiny_patch8", image_size=32).eval()
    images = torch.randn(1, 3, 32, 32)
    assert not torch.equal(target(images), source(images))
    target.load_pretrained(path)
    assert torch.equal(target(images), source(images))


def test_weights_of_another_architecture_are_refused(tmp_path):
    other = build_patch_backbone("vit_tiny_patch8", image_size=32, depth=1)
    path = tmp_path / "other.pth"
    torch.save(other.vit.state_dict(), path)
    with pytest.raises(ConfigError, match="do not fit"):
        build_patch_backbone("vit_tiny_patch8", image_size=32, depth=2).load_pretrained(path)


@pytest.mark.parametrize("name", ["vit_tiny_patch8", "conv_patch8"])
def test_a_set_center_is_subtracted_from_every_feature_vector(name):
    torch.manual_seed(0)
    backbone = build_patch_backbone(name, image_size=16).eval()
    images = torch.randn(2, 3, 16, 16)
    before = backbone(images)
    center = torch.randn(backbone.out_channels)
    backbone.center.copy_(center)
    torch.testing.assert_close(backbone(images), before - center.view(1, -1, 1, 1))
    assert "center" in backbone.state_dict()  # frozen with the backbone, checkpointed with it
