"""A mirror of the pretrained weights the paper rows name, written where a user without network copies them.

Each file holds a freshly initialised network's values in the real architecture's tensor names and shapes, so
that fedlight's real loading code reads it by the row's own name: timm's tags and segmentation-models-pytorch's
ImageNet encoders from a Hugging Face hub cache (``models--<org>--<name>/refs/main`` naming a snapshot), and
LADD's released-code file (d-li14's MobileNet-V2, torchvision's tensor names) at the relative path its configs
give.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: every timm tag a row under conf/ names (FedSLS's ResNets, FUSS's DINO ViT, LADD's MobileNet-V2)
TIMM_TAGS = ("resnet18.tv_in1k", "resnet50.tv_in1k", "vit_base_patch8_224.dino", "mobilenetv2_100.ra_in1k")
#: segmentation-models-pytorch encoders with ImageNet weights that a row names (Pascal's DeepLab-V3+, LADD's DAFormer)
SMP_ENCODERS = ("mobilenet_v2", "mit_b5")
#: LADD's released code reads d-li14's MobileNet-V2 from this path, relative to where it runs
DLI14_MOBILENET = Path("pretrained/mobilenetv2_1.0-0c6065bc.pth")


def _initialised(build) -> dict[str, torch.Tensor]:
    """The state of a freshly initialised network (its own initialisation: activations stay finite, running
    variances positive, as in real weights), drawn from a fixed seed."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build().state_dict()


def _timm_state(architecture: str) -> dict[str, torch.Tensor]:
    import timm

    return _initialised(lambda: timm.create_model(architecture, pretrained=False))


def write_hub_snapshot(cache: Path, repo_id: str, files: dict[str, bytes | dict[str, torch.Tensor]], revision: str):
    """Writes ``files`` as the snapshot ``revision`` of ``repo_id`` in huggingface_hub's cache layout."""
    from safetensors.torch import save_file

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if isinstance(content, bytes):
            (snapshot / name).write_bytes(content)
        else:
            save_file({key: value.contiguous() for key, value in content.items()}, snapshot / name)


def write_timm_tag(cache: Path, tag: str, state: dict[str, torch.Tensor] | None = None) -> None:
    """timm's ``tag`` (``architecture.pretrained_tag``) in the hub cache, as ``timm/<tag>``'s model.safetensors."""
    state = _timm_state(tag.split(".")[0]) if state is None else state
    write_hub_snapshot(cache, f"timm/{tag}", {"model.safetensors": state}, "0" * 40)


def write_smp_encoder(cache: Path, encoder: str, weights: str = "imagenet") -> None:
    """segmentation-models-pytorch's ``encoder`` with ``weights`` in the hub cache, at the revision it pins."""
    import segmentation_models_pytorch as smp

    settings = smp.encoders.encoders[encoder]["pretrained_settings"][weights]
    state = _initialised(lambda: smp.encoders.get_encoder(encoder, weights=None))
    files = {"config.json": b"{}", "model.safetensors": state}
    write_hub_snapshot(cache, settings["repo_id"], files, settings["revision"])


def write_dli14_mobilenet(path: Path) -> None:
    """d-li14's ImageNet MobileNet-V2 file (torchvision's tensor names, with its classifier), random values."""
    import torchvision

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(_initialised(torchvision.models.mobilenet_v2), path)


def write_mirror(cache: Path, workdir: Path) -> None:
    """Every weight a row under conf/ names: the hub cache under ``cache``, LADD's released file under ``workdir``."""
    for tag in TIMM_TAGS:
        write_timm_tag(cache, tag)
    for encoder in SMP_ENCODERS:
        write_smp_encoder(cache, encoder)
    write_dli14_mobilenet(workdir / DLI14_MOBILENET)
