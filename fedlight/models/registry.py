"""Name → model-constructor registry, in the style of timm's ``create_model``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from fedlight.errors import ConfigError

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Registers a model constructor under ``name`` (used as a class or function decorator)."""

    def decorator(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        assert name not in _REGISTRY, f"model {name!r} is registered twice"
        _REGISTRY[name] = factory
        return factory

    return decorator


def list_models() -> list[str]:
    """Returns the registered model names, sorted."""
    return sorted(_REGISTRY)


def create_model(name: str, *, input_shape: tuple[int, ...], num_classes: int, **kwargs: Any) -> nn.Module:
    """Builds a registered model.

    Args:
        name: a name from :func:`list_models`.
        input_shape: shape of one input sample, without the batch axis (``(60,)``, ``(1, 28, 28)``).
        num_classes: number of output classes.
        **kwargs: model-specific options (``--model.init_args.model_kwargs`` in YAML).

    Raises:
        ConfigError: for an unknown name, listing the known ones.

    >>> import torch
    >>> create_model("mlp", input_shape=(60,), num_classes=10).forward_features(torch.zeros(2, 60)).shape
    torch.Size([2, 256])
    """
    if name not in _REGISTRY:
        raise ConfigError(
            f"Unknown model {name!r} (--model.init_args.model). Registered models: {', '.join(list_models())}."
        )
    return _REGISTRY[name](input_shape=tuple(input_shape), num_classes=num_classes, **kwargs)
