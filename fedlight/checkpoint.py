"""Run checkpoints: written atomically, loaded without executing code from the file."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from fedlight.errors import ConfigError

FORMAT = "fedlight-checkpoint-1"

#: Settings that may change when a run is resumed: how long it runs, where and how it logs.
RESUMABLE_KEYS = (
    "trainer.rounds",
    "trainer.eval_every",
    "trainer.checkpoint_every",
    "trainer.accelerator",
    "trainer.devices",
    "trainer.channels_last",
    "trainer.num_nodes",
    "trainer.default_root_dir",
    "trainer.name",
    "trainer.logger",
    "trainer.wandb_",
    "trainer.enable_progress_bar",
    "trainer.callbacks",
    "ckpt_path",
    "config",
)


def save_atomic(state: dict[str, Any], path: str | Path) -> None:
    """Writes ``state`` to ``path`` so that a crash leaves either the old file or the new one.

    The file is written next to its destination, flushed to disk, then renamed over it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | Path) -> dict[str, Any]:
    """Loads a fedlight checkpoint with ``weights_only=True``: the file's contents are never executed.

    Raises:
        ConfigError: when the path does not exist or is not a fedlight checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"--ckpt_path {path} does not exist. Pass a checkpoint of a previous run, e.g. "
            "<run_dir>/checkpoints/last.ckpt."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise ConfigError(f"--ckpt_path {path} is not a readable fedlight checkpoint ({err}).") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"--ckpt_path {path} is not a fedlight checkpoint (no '{FORMAT}' marker).")
    return state


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
    """
    a, b = flatten_config(saved), flatten_config(current)
    differences = []
    for key in sorted(set(a) | set(b)):
        if key.startswith(RESUMABLE_KEYS) or a.get(key) == b.get(key):
            continue
        differences.append(f"{key}: {a.get(key)} in the checkpoint, {b.get(key)} now")
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
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
        raise ConfigError(f"--trainer.init_from {path} is not a readable checkpoint or state_dict ({err}).") from None
    if isinstance(stored, dict) and stored.get("format") == FORMAT:
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
    module.load_state_dict(weights, strict=True)
