"""Name → model-constructor registry, in the style of timm's ``create_model``."""

from __future__ import annotations

import importlib
import inspect
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
    return _build(name, factory, tuple(input_shape), num_classes, kwargs)


def _build(
    name: str, factory: Callable[..., nn.Module], input_shape: tuple[int, ...], num_classes: int, kwargs: dict
) -> nn.Module:
    """Calls ``factory`` as fedlight's models are called (``input_shape``, ``num_classes``, ``model_kwargs``) when
    it takes ``input_shape``, else as torchvision's and timm's constructors are (``num_classes``, ``model_kwargs``);
    a timm network is wrapped so that its features are the classifier's input (:class:`TimmNetwork`)."""
    try:
        parameters = dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: try our convention
        parameters = {"input_shape": None}
    ours = "input_shape" in parameters
    arguments = {"input_shape": input_shape, "num_classes": num_classes} if ours else {"num_classes": num_classes}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values() if p is not None)
    if not ours and "num_classes" not in parameters and not takes_any:
        raise ConfigError(_contract(name, f"its parameters are ({', '.join(parameters)})"))
    try:
        net = factory(**arguments, **kwargs)
    except TypeError as err:
        raise ConfigError(_contract(name, f"calling it raised TypeError: {err}")) from None
    if not isinstance(net, nn.Module):
        raise ConfigError(_contract(name, f"it returned a {type(net).__name__}, not a torch.nn.Module"))
    if not ours and _is_timm(net):
        net = TimmNetwork(net)
    return net


def _contract(name: str, problem: str) -> str:
    return (
        f"--model.init_args.model={name} cannot build the network: {problem}. fedlight calls it as "
        f"{name}(input_shape=..., num_classes=..., **model_kwargs), or, when it has no input_shape parameter, as "
        f"torchvision's and timm's constructors take it, {name}(num_classes=..., **model_kwargs); other settings "
        "go in --model.init_args.model_kwargs."
    )


def _is_timm(net: nn.Module) -> bool:
    """A timm classifier: ``forward_features`` gives the unpooled map and ``forward_head`` pools it."""
    head = getattr(net, "forward_head", None)
    return (
        callable(head)
        and "pre_logits" in inspect.signature(head).parameters
        and callable(getattr(net, "get_classifier", None))
    )


class TimmNetwork(nn.Module):
    """A timm classifier with fedlight's interface: ``forward_features`` is the pooled input of the last linear
    layer (``[B, D]``, timm's "pre-logits"), which prototypes and feature analyses expect, rather than timm's
    unpooled ``[B, D, h, w]`` map; ``forward_head`` is that last layer."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.num_features = net.num_features

    def forward_features(self, x):
        return self.net.forward_head(self.net.forward_features(x), pre_logits=True)  # [B, D]

    def forward_head(self, features):
        return self.net.get_classifier()(features)  # [B, num_classes]

    def forward(self, x):
        return self.net(x)


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
