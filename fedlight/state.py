"""A model's federated state as one flat fp32 vector: what the server holds, aggregates and all-reduces.

Only what is federated is laid out: the floating-point entries of ``state_dict()`` (parameters and
buffers such as BatchNorm running statistics, which every official repository averages like parameters)
that are not frozen. Integer buffers (``num_batches_tracked``) are kept aside and the largest value among
the clients is copied rather than averaged.

Frozen entries never enter a round: a pretrained backbone that no client trains (a DINO ViT) would
otherwise be summed in fp64, all-reduced and reloaded for every client in every round. An entry is frozen
when

- it is a parameter with ``requires_grad=False``;
- it lies under a submodule the client names in ``frozen_modules`` (parameters and buffers alike);
- it lies under a module that has parameters and all of them, its children's included, are frozen (the
  running statistics of a BatchNorm whose affine weights are frozen follow their module's choice).

One frozen parameter does not freeze the module that holds it: a block with a fixed temperature beside a
trainable linear layer and a BatchNorm trains, averages and checkpoints both, and only the temperature is
left out. A client with no federated parameter at all is refused when its layout is built.

Frozen modules run in eval mode during local training (:func:`freeze_modes`), so their buffers stay
exactly as loaded; the engine loads them once and checkpoints them once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fedlight.errors import ConfigError


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: torch.Size
    offset: int
    numel: int


def frozen_module_names(module: nn.Module, frozen_modules: Iterable[str] = ()) -> list[str]:
    """Qualified names of the submodules that local training leaves unchanged.

    Those named in ``frozen_modules`` (with everything under them) and those that have parameters, all of
    them frozen, their children's included.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> _ = net[1].requires_grad_(False)
    >>> frozen_module_names(net)
    ['1']
    >>> _ = net[0].weight.requires_grad_(False)  # one frozen parameter of the Linear: the Linear still trains
    >>> frozen_module_names(net)
    ['1']
    """
    prefixes = tuple(f"{name}." for name in frozen_modules)
    names = []
    for name, sub in module.named_modules():
        params = list(sub.parameters())
        named = name in frozen_modules or name.startswith(prefixes)
        if named or (params and not any(p.requires_grad for p in params)):
            names.append(name)
    return names


def frozen_state_names(module: nn.Module, frozen_modules: Iterable[str] = ()) -> set[str]:
    """Names of the ``state_dict`` entries that are not federated (see the module docstring).

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> _ = net[0].requires_grad_(False)
    >>> sorted(frozen_state_names(net))
    ['0.bias', '0.weight']
    >>> sorted(frozen_state_names(net, frozen_modules=["1"]))  # doctest: +NORMALIZE_WHITESPACE
    ['0.bias', '0.weight', '1.bias', '1.num_batches_tracked', '1.running_mean', '1.running_var', '1.weight']
    """
    frozen_modules = tuple(frozen_modules)
    unknown = [name for name in frozen_modules if name not in dict(module.named_modules())]
    if unknown:
        raise ConfigError(
            f"{type(module).__name__}.frozen_modules names {unknown}, which are not submodules of the model; "
            f"name modules of model.named_modules(), e.g. {[n for n, _ in module.named_modules()][1:4]}."
        )
    names = {name for name, p in module.named_parameters() if not p.requires_grad}
    for prefix in frozen_module_names(module, frozen_modules):
        sub = module.get_submodule(prefix) if prefix else module
        dotted = f"{prefix}." if prefix else ""
        names.update(f"{dotted}{key}" for key in sub.state_dict(keep_vars=True))
    return names


def freeze_parameters(module: nn.Module, frozen_modules: Iterable[str]) -> None:
    """Turns off gradients of the submodules named in ``frozen_modules``, so no optimizer moves them."""
    for name in frozen_modules:
        module.get_submodule(name).requires_grad_(False)


def freeze_modes(module: nn.Module, frozen_modules: Iterable[str] = ()) -> None:
    """Puts the frozen submodules in eval mode (after ``module.train()``): their buffers must not move."""
    for name in frozen_module_names(module, frozen_modules):
        (module.get_submodule(name) if name else module).eval()


class FlatState:
    """The layout of a module's federated floating-point state inside one flat vector.

    Args:
        module: the client module.
        frozen_modules: submodules that are not federated (see :func:`frozen_state_names`).

    >>> layout = FlatState(nn.Linear(3, 2))
    >>> layout.numel, layout.names
    (8, ['weight', 'bias'])
    """

    def __init__(self, module: nn.Module, frozen_modules: Iterable[str] = ()) -> None:
        self.frozen_modules = tuple(frozen_modules)
        frozen = frozen_state_names(module, self.frozen_modules)
        self.entries: list[_Entry] = []
        self.integer_names: list[str] = []
        self.frozen_names: list[str] = []
        offset = 0
        for name, tensor in module.state_dict().items():
            if name in frozen:
                self.frozen_names.append(name)
            elif tensor.is_floating_point():
                self.entries.append(_Entry(name, tensor.shape, offset, tensor.numel()))
                offset += tensor.numel()
            else:
                self.integer_names.append(name)
        self.numel = offset
        parameters = {name for name, _ in module.named_parameters()}
        if not any(entry.name in parameters for entry in self.entries):
            raise ConfigError(
                f"{type(module).__name__} has no federated parameter: every parameter has requires_grad=False or "
                f"lies under frozen_modules {list(self.frozen_modules)}, so clients would train nothing and the "
                "server would average nothing. Leave requires_grad=True on the parts the clients train, and name in "
                "frozen_modules only the parts that stay fixed (a pretrained backbone)."
            )

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.entries]

    def flatten(self, module: nn.Module) -> torch.Tensor:
        """Returns the module's federated floating-point state as a new ``[P]`` fp32 vector on its device."""
        state = module.state_dict()
        return torch.cat([state[e.name].detach().reshape(-1).float() for e in self.entries])

    def integers(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Returns copies of the federated integer buffers."""
        if not self.integer_names:  # most models: skip the state_dict walk, done for every client
            return {}
        state = module.state_dict()
        return {name: state[name].detach().clone() for name in self.integer_names}

    def frozen_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Copies (CPU) of the frozen entries: checkpointed once, never aggregated."""
        state = module.state_dict()
        return {name: state[name].detach().cpu().clone() for name in self.frozen_names}

    def load(self, module: nn.Module, flat: torch.Tensor, integers: dict[str, torch.Tensor] | None = None) -> None:
        """Copies ``flat`` (and the integer buffers) into the module in place, casting to its dtypes."""
        assert flat.numel() == self.numel, f"flat state has {flat.numel()} values, the layout {self.numel}"
        state = module.state_dict()
        with torch.no_grad():
            for e in self.entries:
                state[e.name].copy_(flat[e.offset : e.offset + e.numel].view(e.shape))
            for name, value in (integers or {}).items():
                state[name].copy_(value)

    def to_state_dict(self, flat: torch.Tensor, integers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Returns an ordinary ``state_dict`` (fp32 CPU tensors) of the federated entries."""
        out = {e.name: flat[e.offset : e.offset + e.numel].view(e.shape).detach().cpu().clone() for e in self.entries}
        out.update({name: value.detach().cpu().clone() for name, value in integers.items()})
        return out

    def from_state_dict(self, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Inverse of :meth:`to_state_dict`."""
        flat = torch.cat([state[e.name].reshape(-1).float() for e in self.entries])
        return flat, {name: state[name].clone() for name in self.integer_names}

    def mask(self, names: Iterable[str]) -> torch.Tensor:
        """Returns ``[P]`` bool: true on the entries named in ``names``.

        >>> FlatState(nn.Linear(2, 1)).mask(["bias"]).tolist()
        [False, False, True]
        """
        names = set(names)
        return torch.cat([torch.full((e.numel,), e.name in names) for e in self.entries])

    def parameter_mask(self, module: nn.Module) -> torch.Tensor:
        """Returns ``[P]`` bool: true where the flat state holds a parameter, false for floating-point buffers.

        Server optimisers (momentum, normalised or rescaled steps) move parameters; buffers such as
        BatchNorm running statistics are averaged, since a step scaled past 1 could make a variance negative.

        >>> norm = nn.BatchNorm1d(2)  # weight [2], bias [2], then running_mean [2] and running_var [2]
        >>> FlatState(norm).parameter_mask(norm).tolist()
        [True, True, True, True, False, False, False, False]
        """
        return self.mask(name for name, _ in module.named_parameters())

    def signature(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes, to check that a checkpoint belongs to the same model."""
        return [(e.name, tuple(e.shape)) for e in self.entries]
