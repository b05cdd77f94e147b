"""FedExP: Jhunjhunwala, Wang & Joshi, *FedExP: Speeding Up Federated Averaging via Extrapolation*, ICLR 2023
(arXiv 2301.09604), Algorithm 1.

The clients' mean update is extrapolated by a server step size from the pseudo-gradients' own diversity:

    Δ_k = w^t − w_k,   Δ̄ = (1/M) Σ_k Δ_k,   η_g^t = max(1, Σ_k ‖Δ_k‖² / (2M (‖Δ̄‖² + ε))),
    w^{t+1} = w^t − η_g^t Δ̄

over the round's M clients: the more the clients' updates cancel in their mean, the longer the step. ε > 0 keeps the
step bounded near a stationary point; the paper uses 10⁻³ on CIFAR-10, CIFAR-100 and CINIC-10 and 0.1 on EMNIST.

The iterates of FedExP oscillate, so the paper evaluates the average of the last two, (w^t + w^{t+1})/2 (from the
second round on; the first round's model is w^1), as its code does. ``average_last_two`` (on by default, as the
paper's results) makes that average the run's global model, the one evaluated, logged and checkpointed, while the
clients keep training from the iterate w^{t+1}, which the rule keeps in its state. With it off, the global model is
the iterate.

The authors' code (``Divyansh03/FedExP``, ``main.py``) differs from Algorithm 1 in three details that are not taken
here: it weighs Δ̄ and the mean of ‖Δ_k‖² by n_k, adds Mε rather than ε to ‖Δ̄‖², and decays ε by 0.998² every
round together with the clients' learning rate. Only parameters take the extrapolated step; floating-point buffers
(BatchNorm running statistics) take the clients' mean, as in :class:`FedAvgM`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.plans import ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.parameters import ParameterMask

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan


class FedExP(ParameterMask, Strategy):
    """FedAvg with the server step size η_g^t ≥ 1 of Algorithm 1, extrapolating the clients' mean update.

    Args:
        epsilon: ε > 0 in the step size's denominator; 10⁻³ (the paper's on CIFAR-10, CIFAR-100 and CINIC-10) by
            default, 0.1 on EMNIST.
        average_last_two: make the global model (evaluated and checkpointed) the average of the last two iterates,
            as the paper's results; the clients train from the iterate either way.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        epsilon: float = 1e-3,
        average_last_two: bool = True,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        if not epsilon > 0:
            raise ConfigError(
                f"Expected --strategy.init_args.epsilon (ε) > 0, got {epsilon}; the paper uses 0.001 (CIFAR) or 0.1."
            )
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.epsilon = epsilon
        self.average_last_two = average_last_two
        self.iterate: torch.Tensor | None = None  # w^t [P] the clients train from, when the global model averages
        self.step_size = 1.0  # η_g of the last round

    def on_fit_start(self, context: RunContext) -> None:
        self.cache_parameter_mask(context)

    def initial_state(self, context: RunContext, plan: ClientPlan | None, global_state: torch.Tensor) -> torch.Tensor:
        """The iterate w^t, which differs from the global model when that is the average of the last two."""
        return global_state if self.iterate is None else self.iterate.to(global_state)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Sends ‖Δ_k‖² over the parameters."""
        trained = context.layout.flatten(module)
        start = self.initial_state(context, None, context.global_state.to(trained))  # w^t, as the client received it
        delta = (start - trained)[self.parameter_mask(trained.device)]  # Δ_k
        update.payload["delta_sq"] = float(delta.double().square().sum())

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        """1: Δ̄ is Algorithm 1's plain mean."""
        return (1.0,)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """w^t − η_g Δ̄ on parameters and the mean on buffers; averaged with w^t when ``average_last_two``."""
        is_parameter = self.parameter_mask()
        start = global_state if self.iterate is None else self.iterate.to(global_state)  # w^t
        mean_delta = torch.where(is_parameter, start - aggregate, 0.0)  # Δ̄, zero on buffers
        spread = sum(u.payload["delta_sq"] for u in updates)  # Σ_k ‖Δ_k‖²
        mean_sq = float(mean_delta.double().square().sum())  # ‖Δ̄‖²
        self.step_size = max(1.0, spread / (2 * len(updates) * (mean_sq + self.epsilon)))  # η_g^t
        new = torch.where(is_parameter, start - self.step_size * mean_delta, aggregate)  # w^{t+1}
        if not self.average_last_two:
            return new
        first = self.iterate is None
        self.iterate = new
        return new if first else torch.where(is_parameter, (start + new) / 2, new)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The server step size η_g^t, 1 when FedExP takes FedAvg's step."""
        return {"fedexp/step_size": self.step_size}

    def state_dict(self) -> dict[str, Any]:
        """The iterate w^t once a round has ended, with ``average_last_two``."""
        return {} if self.iterate is None else {"iterate": self.iterate.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iterate = state["iterate"].clone() if "iterate" in state else None
