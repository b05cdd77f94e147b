"""Frozen models a strategy hands to its clients' loss: distillation teachers, running-average teachers.

A strategy keeps each teacher as a named flat state (fp32 CPU: the federated entries of the client module,
parameters and floating-point buffers alike, so BatchNorm statistics are part of a teacher) and owns one
frozen copy of the client module per *role* and process, into which a teacher's state is copied before a
client uses it. Nothing is deep-copied per client, and :meth:`Teachers.state_dict` goes into the strategy's
checkpoint.

Running-average teachers (LADD's SWA teacher, Shenaj et al., WACV 2023, Sec. 3.4) keep a count next to
their state: :meth:`Teachers.average_in` sets w ← (1 − a)·w + a·w_new with a = 1/(n + 1), so the first
state in overwrites and after n updates the teacher is the mean of the n states.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fedlight.state import FlatState


class Teachers:
    """Named teacher states and the frozen modules they are run in.

    >>> net = nn.Linear(1, 1, bias=False)
    >>> teachers = Teachers()
    >>> for value in (1.0, 2.0, 6.0):
    ...     teachers.average_in("swa", torch.tensor([value]))
    >>> teachers.states["swa"].item(), teachers.counts["swa"]
    (3.0, 3)
    >>> teachers.module("swa", net, FlatState(net)).weight.item()
    3.0
    """

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}  # name → [P] fp32 CPU
        self.counts: dict[str, int] = {}  # name → states averaged in, for running means
        self._modules: dict[str, nn.Module] = {}  # role → frozen copy of the client module, per process

    def __contains__(self, name: str) -> bool:
        return name in self.states

    def set(self, name: str, state: torch.Tensor) -> None:
        """Stores ``state`` (``[P]``) as teacher ``name``."""
        self.states[name] = state.detach().float().cpu().clone()
        self.counts[name] = 1

    def average_in(self, name: str, state: torch.Tensor) -> None:
        """Teacher ``name`` ← its running mean with ``state`` (the first call stores ``state``)."""
        n = self.counts.get(name, 0)
        new = state.detach().float().cpu()
        self.states[name] = new.clone() if n == 0 else self.states[name] + (new - self.states[name]) / (n + 1)
        self.counts[name] = n + 1

    def module(self, name: str, like: nn.Module, layout: FlatState, role: str | None = None) -> nn.Module:
        """The frozen module of ``role`` (``name`` by default) holding teacher ``name``'s state.

        The module is a copy of ``like`` made once per role and process, in eval mode and without gradients;
        its frozen entries (a pretrained backbone) are those of ``like``, its federated entries are copied in.
        """
        return self.holding(role or name, like, layout, self.states[name])

    def holding(self, role: str, like: nn.Module, layout: FlatState, state: torch.Tensor) -> nn.Module:
        """The frozen module of ``role`` holding the flat ``state`` (``[P]``, on any device), not stored here."""
        teacher = self._frozen(role, like)
        layout.load(teacher, state.to(next(teacher.parameters()).device))
        return teacher

    def copy_of(self, role: str, module: nn.Module) -> nn.Module:
        """The frozen module of ``role`` holding ``module``'s current weights, copied on their device."""
        teacher = self._frozen(role, module)
        teacher.load_state_dict(module.state_dict())
        return teacher

    def _frozen(self, role: str, like: nn.Module) -> nn.Module:
        """The copy of ``like`` for ``role``, made on first use, in eval mode and without gradients."""
        if role not in self._modules:
            saved = getattr(like, "teachers", None)
            if saved is not None:
                like.teachers = {}  # a teacher holds no teachers of its own
            self._modules[role] = copy.deepcopy(like).requires_grad_(False).eval()
            if saved is not None:
                like.teachers = saved
        return self._modules[role]

    def state_dict(self) -> dict[str, Any]:
        return {"states": {k: v.clone() for k, v in self.states.items()}, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.states = {k: v.clone() for k, v in state.get("states", {}).items()}
        self.counts = {k: int(v) for k, v in state.get("counts", {}).items()}
