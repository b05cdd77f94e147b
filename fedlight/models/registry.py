"""Name → model-constructor registry, in the style of timm's ``create_model``."""

from __future__ import annotations

import importlib
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
    """Builds a registered model, or your own one given by import path.

    Args:
        name: a name from :func:`list_models`, or the import path of a class or function
            (``mypkg.MyNet``) called the same way as the registered ones.
        input_shape: shape of one input sample, without the batch axis (``(60,)``, ``(1, 28, 28)``).
        num_classes: number of output classes.
        **kwargs: model-specific options (``--model.init_args.model_kwargs`` in YAML).

    Raises:
        ConfigError: for an unknown name, listing the known ones, or an import path that does not import.

    >>> import torch
    >>> create_model("mlp", input_shape=(60,), num_classes=10).forward_features(torch.zeros(2, 60)).shape
    torch.Size([2, 256])
    >>> type(create_model("fedlight.models.MLP", input_shape=(60,), num_classes=10)).__name__
    'MLP'
    """
    if name in _REGISTRY:
        factory = _REGISTRY[name]
    elif "." in name:
        factory = _import(name)
    else:
        raise ConfigError(
            f"Unknown model {name!r} (--model.init_args.model). Registered models: {', '.join(list_models())}; "
            "or give the import path of your own network (mypkg.MyNet)."
        )
    return factory(input_shape=tuple(input_shape), num_classes=num_classes, **kwargs)


def _import(path: str) -> Callable[..., nn.Module]:
    module_name, _, attribute = path.rpartition(".")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"--model.init_args.model={path} is neither a registered model ({', '.join(list_models())}) nor "
            f"importable: {err}. Check the module path; the working directory is on the import path."
        ) from None
    if not callable(factory):
        raise ConfigError(f"--model.init_args.model={path} is not a class or function that builds a network.")
    return factory
