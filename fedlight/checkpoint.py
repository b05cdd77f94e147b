"""Run checkpoints: checksummed, written atomically with the one before kept, loaded without executing code.

``checkpoints/last.ckpt`` is written to a temporary file, flushed to disk and renamed over the old one, which
becomes ``previous.ckpt``: a kill at any moment leaves a complete ``last.ckpt``, and a ``last.ckpt`` damaged
later on disk still leaves the round before it. Every checkpoint carries a checksum of its tensors and
metadata; a file that does not match it is refused by name. Checkpoints written before checksums existed
load as they are.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlight.errors import ConfigError

FORMAT = "fedlight-checkpoint-1"
LAST, PREVIOUS = "last.ckpt", "previous.ckpt"
#: What resuming or scoring a run reads of its checkpoint (``engine.run_state``); others are optional.
RUN_KEYS = (
    "round", "seed", "global_state", "strategy", "torch_rng", "history", "wandb_id", "num_samples", "config"
)  # fmt: skip

#: Settings that may change when a run is resumed: how long it runs, where and how it logs, how its
#: processes start; none of them changes the numbers a round computes.
RESUMABLE_KEYS = (
    "trainer.rounds",
    "trainer.eval_every",
    "trainer.eval_clients",
    "trainer.full_eval_every",
    "trainer.checkpoint_every",
    "trainer.accelerator",
    "trainer.devices",
    "trainer.start_method",
    "trainer.channels_last",
    "trainer.num_nodes",
    "trainer.default_root_dir",
    "trainer.name",
    "trainer.logger",
    "trainer.wandb_",
    "trainer.enable_progress_bar",
    "trainer.callbacks",
    "trainer.init_from",
    "trainer.rewind",
    "trainer.fail_fast",
    "trainer.rendezvous_timeout",
    "trainer.gather_budget_mb",
    "trainer.client_state_budget_mb",
    "trainer.keep_client_states",
    "ckpt_path",
    "config",
)


def checksum(state: Any) -> str:
    """A digest of a checkpoint's contents: every tensor's dtype, shape and bytes, and every other value.

    Computed over the loaded objects, not the file, so it does not depend on how ``torch.save`` lays them out.

    >>> checksum({"w": torch.ones(2), "round": 3}) == checksum({"w": torch.ones(2), "round": 3})
    True
    >>> checksum({"w": torch.ones(2)}) == checksum({"w": torch.tensor([1.0, 1.0 + 2**-20])})
    False
    """
    digest = hashlib.blake2b(digest_size=20)
    _feed(digest, state)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the raw bytes, whatever the dtype
    elif isinstance(value, np.ndarray):
        digest.update(f"A{value.dtype}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, list | tuple):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def save_atomic(state: dict[str, Any], path: str | Path) -> None:
    """Writes ``state`` with its checksum to ``path`` so that a crash leaves either the old file or the new one.

    The file is written next to its destination, readable by its owner only (mode 0600: a checkpoint may hold a
    secret, such as DP's noise seed, from which the noise could be regenerated), flushed to disk, then renamed
    over it. The file it replaces stays as ``previous.ckpt`` beside it.

    Raises:
        ConfigError: when the disk is full; the checkpoints already on disk are left as they were.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()  # serialised first, so a failed write is an OSError that says why
    torch.save({**state, "checksum": checksum(state)}, buffer)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        _write(tmp, buffer.getbuffer())
        if path.exists():
            _keep_previous(path)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            kept = f"{path} from before is intact" if path.exists() else "no earlier checkpoint was written"
            raise ConfigError(
                f"No space left on the disk to write the checkpoint {path} ({buffer.tell() / 2**20:.1f} MiB): "
                f"it was not written and {kept}. Free space on {path.parent} and resume with --ckpt_path {path}."
            ) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the owner's alone, from its first byte
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _keep_previous(path: Path) -> None:
    """Makes the current ``path`` also ``previous.ckpt``, atomically: a hard link, renamed into place."""
    previous = path.with_name(PREVIOUS)
    link = path.parent / f".{PREVIOUS}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        os.link(path, link)
    except OSError:  # a file system without hard links: move it (a crash now leaves previous.ckpt only)
        os.replace(path, previous)
        return
    os.replace(link, previous)


def load(path: str | Path, flag: str = "--ckpt_path", keys: tuple[str, ...] = ("round",)) -> dict[str, Any]:
    """Loads a fedlight checkpoint with ``weights_only=True`` (the file's contents are never executed) and
    checks it against its checksum and for the ``keys`` a reader needs (:data:`RUN_KEYS` to resume or score it).

    Raises:
        ConfigError: when the path does not exist, is not a fedlight checkpoint, is corrupted or lacks some of
            ``keys``.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"{flag} {path} does not exist. Pass a checkpoint of a previous run, e.g. "
            "<default_root_dir>/<name>/version_<n>/checkpoints/last.ckpt."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged file fails in the unpickler, the zip reader or a tensor's storage
        raise ConfigError(
            f"{flag} {path} is not a readable fedlight checkpoint ({_reason(err, path)}).{_fallback(path)}"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"{flag} {path} is not a fedlight checkpoint (no '{FORMAT}' marker).")
    stored = state.pop("checksum", None)  # absent in checkpoints written before checksums
    if stored is not None and checksum(state) != stored:
        raise ConfigError(
            f"{flag} {path} is corrupted: its contents do not match the checksum written with it.{_fallback(path)}"
        )
    missing = [key for key in keys if key not in state]
    if missing:
        raise ConfigError(
            f"{flag} {path} has the fedlight marker but lacks {', '.join(missing)}: it was not written whole by "
            f"fedlight, or by another version.{_fallback(path)}"
        )
    return state


def _reason(err: BaseException, path: Path) -> str:
    """What ``torch.load`` said, or what the file is when it said nothing (an empty file's bare EOFError)."""
    if str(err).strip():
        return str(err)
    size = path.stat().st_size if path.is_file() else 0
    return "the file is empty" if size == 0 else f"{type(err).__name__} after reading a {size}-byte file"


def _fallback(path: Path) -> str:
    previous = path.with_name(PREVIOUS)
    if path.name == LAST and previous.is_file():
        return f" Resume from the checkpoint before it: --ckpt_path {previous}"
    return " Use another checkpoint of the run, or start it anew without --ckpt_path."


def saved_round(path: str | Path) -> int | None:
    """The round of the checkpoint at ``path``, or None when there is none or it cannot be read intact."""
    try:
        return int(load(path)["round"])
    except ConfigError:
        return None


def data_fingerprint(datamodule: Any) -> dict[str, str]:
    """Digests of what a run trains and evaluates on: the partition and the contents of the samples.

    ``partition`` covers every client's training indices and the held-out indices; ``samples`` the pool's
    and the test set's tensors (a lazily read pool contributes its shape only). Call after ``setup``.
    """
    partition = hashlib.blake2b(digest_size=16)
    for indices in [*datamodule.client_train, datamodule.held_out_index]:
        _feed(partition, indices)
    samples = hashlib.blake2b(digest_size=16)
    for data in (datamodule.pool, datamodule.test):
        for name in ("inputs", "targets", "labels"):
            value = getattr(data, name, None)
            _feed(samples, value if value is None or isinstance(value, torch.Tensor) else tuple(value.shape))
    return {"partition": partition.hexdigest(), "samples": samples.hexdigest()}


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``, the dotted names the command line uses.

    >>> flatten_config({"trainer": {"rounds": 5}, "seed_everything": 0})
    {'trainer.rounds': 5, 'seed_everything': 0}
    """
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Names the run-defining settings in which two resolved configs differ.

    >>> config_differences({"trainer": {"rounds": 5, "local_epochs": 2}},
    ...                    {"trainer": {"rounds": 9, "local_epochs": 3}})
    ['trainer.local_epochs: 2 in the checkpoint, 3 now']
    >>> config_differences({"origin": "python", "data": {"batch_size": 10}}, {"data": {"batch_size": 32, "seed": 0}})
    ['data.batch_size: 10 in the checkpoint, 32 now']
    """
    a, b = flatten_config(saved), flatten_config(current)
    # A side described from Python objects (``origin: python``) knows only some settings, and a class by its
    # module's path rather than the one the config named: only what both sides state is compared. Between two
    # such descriptions only the trainer's arguments, which are recorded as given, are compared.
    partial = "python" in (a.get("origin"), b.get("origin"))
    both = a.get("origin") == b.get("origin") == "python"
    differences = []
    for key in sorted(a):  # a setting the checkpoint lacks did not exist when it was written
        old, new = a.get(key), b.get(key)
        if key.startswith(RESUMABLE_KEYS) or key == "origin" or old == new:
            continue
        if both and not key.startswith(("trainer.", "seed_everything")):
            continue
        if partial and (old is None or new is None):
            continue
        if partial and key.endswith("class_path") and str(old).rsplit(".", 1)[-1] == str(new).rsplit(".", 1)[-1]:
            continue
        differences.append(f"{key}: {old} in the checkpoint, {new} now")
    return differences


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The model weights stored in ``path``: a fedlight checkpoint's global model (with its frozen parts), a
    Lightning checkpoint's ``state_dict``, or a plain ``state_dict``. Loaded with ``weights_only=True``.

    Raises:
        ConfigError: when the file is not readable or holds no weights.
    """
    path = Path(path)
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(
            f"--trainer.init_from {path} is not a readable checkpoint or state_dict ({_reason(err, path)})."
        ) from None
    if isinstance(stored, dict) and stored.get("format") == FORMAT:
        stored = load(path, "--trainer.init_from", keys=("global_state",))  # checked against its checksum
        return {**(stored.get("frozen_state") or {}), **stored["global_state"]}
    if isinstance(stored, dict) and isinstance(stored.get("state_dict"), dict):
        return stored["state_dict"]
    if isinstance(stored, dict) and stored and all(isinstance(v, torch.Tensor) for v in stored.values()):
        return stored
    raise ConfigError(
        f"--trainer.init_from {path} holds no model weights: expected a fedlight or Lightning checkpoint, or a "
        "dict of tensors (a state_dict)."
    )


def load_weights(module: torch.nn.Module, path: str | Path) -> None:
    """Loads :func:`read_weights` into ``module``; every key must match in name and shape.

    Raises:
        ConfigError: listing the missing, unexpected and mis-shaped keys.
    """
    weights = read_weights(path)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    mis_shaped = sorted(
        f"{name} {tuple(weights[name].shape)} in the file, {tuple(expected[name].shape)} in the model"
        for name in set(weights) & set(expected)
        if weights[name].shape != expected[name].shape
    )
    if missing or unexpected or mis_shaped:
        lines = [f"--trainer.init_from {path} does not fit --model:"]
        for title, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", mis_shaped)):
            if names:
                shown = ", ".join(names[:12]) + (f", … ({len(names)} in all)" if len(names) > 12 else "")
                lines.append(f"  - keys {title}: {shown}")
        lines.append("Start from a checkpoint of the same model (the run's config.yaml names it).")
        raise ConfigError(*lines)
    non_finite = sorted(
        name for name, value in weights.items() if value.is_floating_point() and not bool(value.isfinite().all())
    )
    if non_finite:
        shown = ", ".join(non_finite[:12]) + (f", … ({len(non_finite)} in all)" if len(non_finite) > 12 else "")
        raise ConfigError(
            f"--trainer.init_from {path} holds NaN/Inf in {shown}: the run that wrote it diverged. Start from an "
            "earlier checkpoint of it (previous.ckpt) or retrain it with a lower learning rate."
        )
    module.load_state_dict(weights, strict=True)
