"""FedAvgM: Hsu, Qi & Brown, *Measuring the Effects of Non-Identical Data Distribution for Federated
Visual Classification*, arXiv 1909.06335, 2019.

FedAvg's average taken as a pseudo-gradient of a server optimiser with momentum:

    Δ = W^t − Σ_k (n_k / Σ_j n_j) W_k^{t+1},   v ← βv + Δ,   W^{t+1} = W^t − η v

with β = 0.9 and η = 1. MOON's and FedDecorr's code use the EMA form v ← βv + (1 − β)Δ, the same rule
with the server learning rate scaled by (1 − β); ``form`` chooses. The maths is
:func:`~fedlight.strategies.functional.server_momentum`.

Only parameters are moved by the momentum; floating-point buffers (BatchNorm running statistics) take
the average, since an accumulated step can overshoot a running variance below zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.plans import ClientUpdate
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.functional import server_momentum
from fedlight.strategies.parameters import ParameterMask

if TYPE_CHECKING:
    from fedlight.context import RunContext


class FedAvgM(ParameterMask, FedAvg):
    """FedAvg with server momentum; β = 0 (with η = 1) is FedAvg.

    Args:
        momentum: β ∈ [0, 1), the server momentum (0.9 in Hsu et al.).
        server_lr: η > 0, the server learning rate.
        form: ``hsu`` (v ← βv + Δ) or ``ema`` (v ← βv + (1 − β)Δ, as MOON's and FedDecorr's code).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in Hsu et al.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        momentum: float = 0.9,
        server_lr: float = 1.0,
        form: Literal["hsu", "ema"] = "hsu",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not 0.0 <= momentum < 1.0:
            problems.append(f"Expected --strategy.init_args.momentum (β) in [0, 1), got {momentum}; 0 is FedAvg.")
        if not server_lr > 0:
            problems.append(f"Expected --strategy.init_args.server_lr (η) > 0, got {server_lr}; 1 is the paper's.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.momentum = momentum
        self.server_lr = server_lr
        self.form = form
        self.velocity: torch.Tensor | None = None  # v [P], zero on buffers; None before the first round

    def on_fit_start(self, context: RunContext) -> None:
        self.cache_parameter_mask(context)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        is_parameter = self.parameter_mask()
        velocity = torch.zeros_like(global_state) if self.velocity is None else self.velocity.to(global_state)
        # buffers: Δ = 0, so their velocity stays 0 and the step leaves them at W^t; they take the average below
        target = torch.where(is_parameter, aggregate, global_state)
        new, self.velocity = server_momentum(global_state, target, velocity, self.momentum, self.server_lr, self.form)
        return torch.where(is_parameter, new, aggregate)

    def state_dict(self) -> dict[str, Any]:
        """The velocity v once a round has ended."""
        return {} if self.velocity is None else {"velocity": self.velocity.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.velocity = state["velocity"].clone() if "velocity" in state else None
