"""Pretrained weights named by a local file, a timm tag or a torchvision tag.

A weights option (FUSS's ``pretrained``, LADD's ``encoder_weights``) takes one of three kinds of name:

- a local file (a path with a folder or a weights suffix, or any existing file): read as it is;
- a timm tag, ``<architecture>.<pretrained tag>`` (``vit_base_patch8_224.dino``, ``mobilenetv2_100.ra_in1k``):
  the file timm's pretrained configuration names is fetched from the Hugging Face Hub into the hub's cache
  (``HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``); with ``HF_HUB_OFFLINE=1`` only that cache is read;
- a torchvision tag, a member of the architecture's weights enum (``IMAGENET1K_V1``): torchvision fetches it
  into torch's hub folder (``TORCH_HOME``, by default ``~/.cache/torch/hub/checkpoints``), its hash checked.

:func:`resolve_weights` sorts a name into one of those at set-up, without fetching anything, and refuses a tag
whose architecture is not the model's in one :class:`~fedlight.errors.ConfigError`. The weights are read later
(:func:`timm_state_dict`, :func:`torchvision_state_dict`), when the model is first loaded, so a resumed run,
whose checkpoint holds them, never needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from fedlight.errors import ConfigError

_WEIGHT_SUFFIXES = {".pth", ".pt", ".bin", ".safetensors", ".ckpt", ".tar", ".npz"}


@dataclass(frozen=True)
class WeightsSource:
    """Where a weights option's value points.

    Attributes:
        kind: ``file``, ``timm`` or ``torchvision``.
        name: the path, the timm tag or the torchvision enum member's name.
    """

    kind: Literal["file", "timm", "torchvision"]
    name: str


def resolve_weights(
    spec: str,
    flag: str,
    timm_architectures: Sequence[str],
    torchvision_weights: str | None = None,
) -> WeightsSource:
    """Sorts ``spec`` into a local file, a timm tag or a torchvision tag, checking the tag against the model.

    Args:
        spec: the option's value.
        flag: the option, for messages (``--model.init_args.pretrained``).
        timm_architectures: the timm architectures whose weights fit the model (``vit_base_patch8_224``).
        torchvision_weights: the torchvision weights enum that fits the model (``MobileNet_V2_Weights``), if any.

    Raises:
        ConfigError: for a tag of another architecture or one that timm or torchvision does not know.

    >>> resolve_weights("weights/dino.pth", "--pretrained", ["vit_base_patch8_224"])
    WeightsSource(kind='file', name='weights/dino.pth')
    >>> resolve_weights("vit_base_patch8_224.dino", "--pretrained", ["vit_base_patch8_224"])
    WeightsSource(kind='timm', name='vit_base_patch8_224.dino')
    """
    path = Path(spec).expanduser()
    if path.is_file() or "/" in spec or "\\" in spec or path.suffix in _WEIGHT_SUFFIXES:
        return WeightsSource("file", spec)
    fits = _what_fits(timm_architectures, torchvision_weights)
    enum_name, _, member = spec.rpartition(".")
    if member in _torchvision_members_of_any() and enum_name in ("", *_TORCHVISION_MODELS):
        fitting = torchvision_weights is not None and member in _torchvision_members(torchvision_weights)
        if fitting and enum_name in ("", torchvision_weights):
            return WeightsSource("torchvision", member)
        raise ConfigError(f"{flag}={spec} names torchvision weights that do not fit this model: {fits}.")
    import timm

    architecture = spec.split(".", 1)[0]
    if timm.is_model(architecture):
        if architecture not in timm_architectures:
            raise ConfigError(f"{flag}={spec} names weights of {architecture}, which do not fit this model: {fits}.")
        known = timm.list_pretrained(f"{architecture}.*")
        if spec not in known:
            known = ", ".join(known) or "none"
            raise ConfigError(
                f"{flag}={spec} names no pretrained weights of timm: give architecture.tag, one of {known}."
            )
        return WeightsSource("timm", spec)
    raise ConfigError(
        f"{flag}={spec} is neither a local file nor a tag of pretrained weights: {fits}. A file path needs a "
        f"folder or a suffix ({', '.join(sorted(_WEIGHT_SUFFIXES))})."
    )


def timm_state_dict(tag: str, flag: str) -> dict[str, torch.Tensor]:
    """The checkpoint of timm's ``tag`` as stored (classifier included), fetched through the Hugging Face Hub's cache.

    Only the file is fetched, where timm's pretrained configuration says it is (its Hub repository, or a URL for
    the few tags without one): the callers load it into their own modules, so timm's model is never built (a
    randomly initialised ViT-B/8 alone takes seconds).

    Raises:
        ConfigError: when the file can be neither downloaded nor found in the cache, naming both.
    """
    import timm
    from huggingface_hub import constants

    config = timm.models.get_pretrained_cfg(tag)
    try:
        if config.hf_hub_id:
            return _hub_file(config.hf_hub_id, config.hf_hub_filename)
        return torch.hub.load_state_dict_from_url(config.url, map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except (OSError, RuntimeError, ValueError) as error:  # the hub's errors are OSErrors or ValueErrors
        source = f"https://huggingface.co/{config.hf_hub_id}" if config.hf_hub_id else config.url
        offline = " (HF_HUB_OFFLINE is set: only the cache is read)" if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"Could not load timm's {tag!r} weights ({flag}){offline}: {str(error).splitlines()[0]}",
            f"They come from {source} and are kept in the Hugging Face cache, {constants.HF_HUB_CACHE}. Without "
            f"network, run timm.create_model({tag!r}, pretrained=True) on a machine that has it and copy its cache "
            "folder here (or point HF_HUB_CACHE at a copy), or give the weights as a local file.",
        ) from error


def _hub_file(repo_id: str, filename: str | None) -> dict[str, torch.Tensor]:
    """A checkpoint from a Hub repository: ``filename``, else timm's safetensors file, else its PyTorch file.

    The cache is read first, so that a copied cache works without network and without the hub client's retries;
    before going online, one connection to the Hub tells at once whether it can be reached at all.
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    repo, _, revision = repo_id.partition("@")  # timm pins some repositories as repo@revision
    names = [filename] if filename else ["model.safetensors", "pytorch_model.bin"]
    for name in names:
        try:
            return read_weights_file(hf_hub_download(repo, name, revision=revision or None, local_files_only=True))
        except (LocalEntryNotFoundError, EntryNotFoundError):
            continue
    if constants.HF_HUB_OFFLINE:
        raise LocalEntryNotFoundError(f"{repo} is not in the cache")
    _check_reachable(constants.ENDPOINT)
    for name in names:
        try:
            path = hf_hub_download(repo, name, revision=revision or None)
        except EntryNotFoundError:
            if name == names[-1]:
                raise
            continue
        return read_weights_file(path)
    raise AssertionError(f"no weights file tried for {repo_id}")


def hub_files(repo_id: str, filenames: Sequence[str], revision: str | None = None) -> list[str]:
    """Local paths of ``filenames`` of a Hub repository: from the cache when there (no network used), otherwise
    downloaded into it after one connection tells at once whether the Hub can be reached.

    Raises:
        OSError: when the files are not in the cache and cannot be fetched (with ``HF_HUB_OFFLINE=1``, at once).
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return [hf_hub_download(repo_id, name, revision=revision, local_files_only=True) for name in filenames]
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise
    _check_reachable(constants.ENDPOINT)
    return [hf_hub_download(repo_id, name, revision=revision) for name in filenames]


def read_weights_file(path: str | Path) -> dict[str, Any]:
    """A weights file's contents (``.safetensors`` or a PyTorch checkpoint), or one :class:`ConfigError` naming a
    file that is damaged or not a checkpoint."""
    try:
        if str(path).endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path, device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors', pickle's and zip's errors alike
        raise ConfigError(
            f"The weights file {Path(path).resolve()} could not be read ({type(error).__name__}): it is damaged or "
            "not a checkpoint.",
            "Delete it so that it is fetched again, or copy an intact one there.",
        ) from None


def _check_reachable(endpoint: str, timeout: float = 5.0) -> None:
    """Raises an ``OSError`` at once when ``endpoint``'s host takes no connection (no network, no name service)."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as error:
        raise OSError(
            f"{url.hostname} cannot be reached ({error}); with a copied cache, set HF_HUB_OFFLINE=1 to read only the "
            "cache"
        ) from None


def torchvision_state_dict(enum_name: str, member: str, flag: str) -> dict[str, torch.Tensor]:
    """The weights of torchvision's ``<enum_name>.<member>``, fetched into torch's hub folder, hash checked.

    Raises:
        ConfigError: when they can be neither downloaded nor found in torch's hub folder, naming both.
    """
    from torchvision.models import get_weight

    weights = get_weight(f"{enum_name}.{member}")
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    try:
        return weights.get_state_dict(progress=False, check_hash=True)
    except (OSError, RuntimeError) as error:
        raise ConfigError(
            f"Could not load torchvision's {enum_name}.{member} weights ({flag}): {str(error).splitlines()[0]}",
            f"Download {weights.url} on a machine with network into {folder}/ (TORCH_HOME moves it), or give the "
            "weights as a local file.",
        ) from error


def _torchvision_members(enum_name: str) -> list[str]:
    from torchvision.models import get_model_weights

    return [weights.name for weights in get_model_weights(_TORCHVISION_MODELS[enum_name])]


def _torchvision_members_of_any() -> set[str]:
    """Member names of every weights enum the models here can use, to recognise another model's tag."""
    return {name for enum_name in _TORCHVISION_MODELS for name in _torchvision_members(enum_name)}


def _what_fits(timm_architectures: Sequence[str], torchvision_weights: str | None) -> str:
    import timm

    tags = [tag for architecture in timm_architectures for tag in timm.list_pretrained(f"{architecture}.*")]
    fits = f"timm tags {', '.join(tags)}" if tags else "no timm tag"
    if torchvision_weights is not None:
        fits += f"; torchvision's {', '.join(_torchvision_members(torchvision_weights))}"
    return fits + "; or a local file"


# the torchvision model each weights enum belongs to, for get_model_weights
_TORCHVISION_MODELS = {"MobileNet_V2_Weights": "mobilenet_v2"}
