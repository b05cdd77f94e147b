"""A model's state as one flat fp32 vector: what the server holds, aggregates and all-reduces.

Floating-point entries of ``state_dict()`` (parameters and buffers such as BatchNorm running
statistics, which every official repository averages like parameters) are laid end to end in one
vector. Integer buffers (``num_batches_tracked``) are not averaged: they are kept aside and the
largest value among the clients is copied (spec §0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: torch.Size
    offset: int
    numel: int


class FlatState:
    """The layout of a module's floating-point state inside one flat vector.

    >>> layout = FlatState(nn.Linear(3, 2))
    >>> layout.numel, layout.names
    (8, ['weight', 'bias'])
    """

    def __init__(self, module: nn.Module) -> None:
        self.entries: list[_Entry] = []
        self.integer_names: list[str] = []
        offset = 0
        for name, tensor in module.state_dict().items():
            if tensor.is_floating_point():
                self.entries.append(_Entry(name, tensor.shape, offset, tensor.numel()))
                offset += tensor.numel()
            else:
                self.integer_names.append(name)
        self.numel = offset

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.entries]

    def flatten(self, module: nn.Module) -> torch.Tensor:
        """Returns the module's floating-point state as a new ``[P]`` fp32 CPU-or-device vector."""
        state = module.state_dict()
        return torch.cat([state[e.name].detach().reshape(-1).float() for e in self.entries])

    def integers(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Returns copies of the integer buffers."""
        if not self.integer_names:  # most models: skip the state_dict walk, done for every client
            return {}
        state = module.state_dict()
        return {name: state[name].detach().clone() for name in self.integer_names}

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
        """Returns an ordinary ``state_dict`` (fp32 CPU tensors) built from the flat vector."""
        out = {e.name: flat[e.offset : e.offset + e.numel].view(e.shape).detach().cpu().clone() for e in self.entries}
        out.update({name: value.detach().cpu().clone() for name, value in integers.items()})
        return out

    def from_state_dict(self, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Inverse of :meth:`to_state_dict`."""
        flat = torch.cat([state[e.name].reshape(-1).float() for e in self.entries])
        return flat, {name: state[name].clone() for name in self.integer_names}

    def parameter_mask(self, module: nn.Module) -> torch.Tensor:
        """Returns ``[P]`` bool: true where the flat state holds a parameter, false for floating-point buffers.

        Server optimisers (momentum, normalised or rescaled steps) move parameters; buffers such as
        BatchNorm running statistics are averaged, since a step scaled past 1 could make a variance negative.

        >>> norm = nn.BatchNorm1d(2)  # weight [2], bias [2], then running_mean [2] and running_var [2]
        >>> FlatState(norm).parameter_mask(norm).tolist()
        [True, True, True, True, False, False, False, False]
        """
        parameters = {name for name, _ in module.named_parameters()}
        return torch.cat([torch.full((e.numel,), e.name in parameters) for e in self.entries])

    def signature(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes, to check that a checkpoint belongs to the same model."""
        return [(e.name, tuple(e.shape)) for e in self.entries]
