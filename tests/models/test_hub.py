"""Pretrained weights by tag: sorting names, refusing a tag of another network, reading the hubs' local caches.

The timm tags are read from a Hugging Face hub cache written here as ``huggingface_hub`` lays it out
(``models--timm--<tag>/refs/main`` naming a snapshot that holds ``model.safetensors``) with random weights of the
right shapes, in a child process started with ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` pointing at it, as a user
without network would run. torchvision's tag is read from torch's hub folder under ``TORCH_HOME``.
"""

import json
import os
import subprocess
import sys
import textwrap
import urllib.error
from pathlib import Path

import pytest
import torch
import torchvision
from miniatures.weights import write_timm_tag

from fedlight.clients import UnsupervisedSegmentationClient
from fedlight.errors import ConfigError
from fedlight.models import create_model
from fedlight.models.hub import WeightsSource, resolve_weights
from fedlight.models.patch_features import build_patch_backbone

REPO = Path(__file__).resolve().parents[2]
LADD_FLAG = "--model.init_args.model_kwargs.encoder_weights"


def _ladd(**kwargs):
    return create_model("deeplabv3_mobilenetv2", input_shape=(3, 64, 64), num_classes=5, **kwargs)


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        ("pretrained/mobilenetv2_1.0-0c6065bc.pth", "file"),
        ("weights.safetensors", "file"),
        ("mobilenetv2_100.ra_in1k", "timm"),
        ("IMAGENET1K_V1", "torchvision"),
        ("MobileNet_V2_Weights.IMAGENET1K_V2", "torchvision"),
    ],
)
def test_a_weights_name_is_a_file_a_timm_tag_or_a_torchvision_tag(spec, kind):
    source = resolve_weights(spec, LADD_FLAG, ["mobilenetv2_100"], "MobileNet_V2_Weights")
    assert source == WeightsSource(kind, spec.rpartition(".")[2] if kind == "torchvision" else spec)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("vit_base_patch8_224.dino", "names weights of vit_base_patch8_224, which do not fit this model"),
        ("mobilenetv2_050.lamb_in1k", "names weights of mobilenetv2_050, which do not fit this model"),
        ("mobilenetv2_100", r"names no pretrained weights of timm: give architecture.tag, one of .*ra_in1k"),
        ("mobilenetv2_100.nope", "names no pretrained weights of timm"),
        ("weights", "is neither a local file nor a tag"),
    ],
)
def test_ladds_backbone_refuses_a_tag_of_another_network_when_built(spec, message):
    with pytest.raises(ConfigError, match=message) as error:
        _ladd(encoder_weights=spec)
    assert f"{LADD_FLAG}={spec}" in str(error.value) or "timm" in str(error.value)
    assert "mobilenetv2_100.ra_in1k" in str(error.value), "the message lists what fits"


def test_fuss_backbone_refuses_a_tag_of_another_network_when_built():
    common = {"num_classes": 3, "input_shape": (3, 32, 32)}
    with pytest.raises(ConfigError, match=r"pretrained=mobilenetv2_100.ra_in1k names weights of mobilenetv2_100.*dino"):
        UnsupervisedSegmentationClient(backbone="vit_base_patch8_224", pretrained="mobilenetv2_100.ra_in1k", **common)
    with pytest.raises(ConfigError, match="names weights of vit_base_patch8_224"):
        UnsupervisedSegmentationClient(backbone="vit_small_patch8_224", pretrained="vit_base_patch8_224.dino", **common)
    with pytest.raises(ConfigError, match="torchvision weights that do not fit"):
        UnsupervisedSegmentationClient(backbone="conv_patch8", pretrained="IMAGENET1K_V1", **common)


def test_torchvisions_tag_is_read_from_torchs_hub_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    imagenet = torchvision.models.mobilenet_v2().state_dict()
    folder = tmp_path / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(imagenet, folder / "mobilenet_v2-b0353104.pth")  # the file name of IMAGENET1K_V1's URL
    model = _ladd(encoder_weights="IMAGENET1K_V1")
    model.load_pretrained()
    for key, value in model.backbone.state_dict().items():
        torch.testing.assert_close(value, imagenet[f"features.{key}"])

    def offline(url, *args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    (folder / "mobilenet_v2-b0353104.pth").unlink()
    with pytest.raises(ConfigError) as error:
        model.load_pretrained()
    assert "https://download.pytorch.org/models/mobilenet_v2-b0353104.pth" in str(error.value)
    assert str(folder) in str(error.value)


CHILD = """
import json, sys, torch
from fedlight.clients import UnsupervisedSegmentationClient
from fedlight.errors import ConfigError
from fedlight.models import create_model

ladd = create_model("deeplabv3_mobilenetv2", input_shape=(3, 64, 64), num_classes=5,
                    encoder_weights="mobilenetv2_100.ra_in1k")
ladd.load_pretrained()
fuss = UnsupervisedSegmentationClient(num_classes=3, input_shape=(3, 32, 32), backbone="vit_small_patch8_224",
                                      pretrained="vit_small_patch8_224.dino")
fuss.configure_model()
try:
    UnsupervisedSegmentationClient(num_classes=3, input_shape=(3, 32, 32), backbone="vit_base_patch8_224",
                                   pretrained="vit_base_patch8_224.dino").configure_model()
    absent = None
except ConfigError as error:
    absent = str(error)
torch.save({"ladd": ladd.backbone.state_dict(), "fuss": fuss.backbone.vit.state_dict()}, sys.argv[1])
print(json.dumps({"absent": absent}))
"""


def test_timm_tags_load_from_a_local_hub_cache_offline(tmp_path):
    timm = pytest.importorskip("timm")
    cache = tmp_path / "hub"
    mobilenet = timm.create_model("mobilenetv2_100").state_dict()  # with its ImageNet classifier, as on the Hub
    # random values in ViT-S/8's shapes at 224×224, without timm's slow initialisation
    shapes = build_patch_backbone("vit_small_patch8_224", image_size=224, initialize=False).vit.state_dict()
    vit = {key: torch.randn(value.shape) for key, value in shapes.items()}
    write_timm_tag(cache, "mobilenetv2_100.ra_in1k", mobilenet)
    write_timm_tag(cache, "vit_small_patch8_224.dino", vit)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "loaded.pt")], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    # timm's MobileNet-V2 lands in torchvision's layout by position: stem, first block, last 1×1 convolution
    backbone = loaded["ladd"]
    torch.testing.assert_close(backbone["0.0.weight"], mobilenet["conv_stem.weight"])
    torch.testing.assert_close(backbone["1.conv.0.0.weight"], mobilenet["blocks.0.0.conv_dw.weight"])
    torch.testing.assert_close(backbone["18.1.running_var"], mobilenet["bn2.running_var"])
    for key in ("blocks.0.attn.qkv.weight", "cls_token", "norm.bias"):
        torch.testing.assert_close(loaded["fuss"][key], vit[key])
    assert loaded["fuss"]["pos_embed"].shape == (1, 1 + 4 * 4, 384), "resized to the 32×32 images' 4×4 patches"
    absent = json.loads(result.stdout.strip().splitlines()[-1])["absent"]
    assert absent is not None and "vit_base_patch8_224.dino" in absent and "HF_HUB_OFFLINE is set" in absent
    assert str(cache) in absent and "https://huggingface.co/timm/vit_base_patch8_224.dino" in absent


def test_a_damaged_weights_file_in_the_hub_cache_is_named(tmp_path, monkeypatch):
    import huggingface_hub.constants
    from miniatures.weights import write_hub_snapshot

    from fedlight.models.hub import timm_state_dict

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    write_hub_snapshot(tmp_path, "timm/resnet18.tv_in1k", {"model.safetensors": b"\x00" * 64}, "0" * 40)
    with pytest.raises(
        ConfigError, match=r"The weights file .*models--timm--resnet18.tv_in1k.*model.safetensors could not be read"
    ):
        timm_state_dict("resnet18.tv_in1k", "--model.init_args.model_kwargs.pretrained")


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_a_damaged_weights_file_given_by_path_is_named(tmp_path, suffix):
    """LADD's MobileNet-V2 and FUSS's backbone read a local file as they read the cache: a damaged one is named."""
    path = tmp_path / f"weights{suffix}"
    path.write_bytes(b"PK\x03\x04 not a whole checkpoint")
    damaged = rf"The weights file {path} could not be read"
    with pytest.raises(ConfigError, match=damaged):
        _ladd(encoder_weights=str(path)).load_pretrained()
    client = UnsupervisedSegmentationClient(num_classes=3, input_shape=(3, 32, 32), backbone="vit_tiny_patch8",
                                            pretrained=str(path))  # fmt: skip
    with pytest.raises(ConfigError, match=damaged):
        client.configure_model()
