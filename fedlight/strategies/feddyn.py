"""FedDyn: Acar et al., *Federated Learning Based on Dynamic Regularization*, ICLR 2021.

Each client k keeps ∇L_k(θ_k^{t−1}), the gradient of its loss at its last local model (per-client state, zero
before its first round), and minimises a dynamically regularised loss from the model θ^{t−1} it receives
(Algorithm 1):

    θ_k^t = argmin_θ  L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + (α/2)‖θ − θ^{t−1}‖²
    ∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α (θ_k^t − θ^{t−1})

The server keeps h and, with m clients in all and P_t those of the round,

    h^t = h^{t−1} − α (1/m) Σ_{k∈P_t} (θ_k^t − θ^{t−1}),    θ^t = (1/|P_t|) Σ_{k∈P_t} θ_k^t − h^t / α.

The argmin is the local fit on that loss (its linear and proximal terms are
:func:`~fedlight.strategies.stateful_functional.linear_term` and
:func:`~fedlight.strategies.fedprox.proximal_term`). Parameters only: floating-point buffers (BatchNorm
statistics) are neither regularised nor corrected and take the plain average.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.strategies.base import Strategy, traceable_loss
from fedlight.strategies.fedprox import proximal_term
from fedlight.strategies.parameters import ParameterMask
from fedlight.strategies.stateful_functional import (
    current_parameters,
    feddyn_client_gradient,
    feddyn_server,
    linear_term,
    parameter_names,
    parameter_views,
)

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate


class FedDyn(ParameterMask, Strategy):
    """Dynamic regularisation: a linear and a proximal term on every client, a corrected average on the server.

    Args:
        alpha: α > 0, the weight of the dynamic regulariser (the paper tries 0.1, 0.01 and 0.001).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        alpha: float = 0.01,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        if not alpha > 0:
            raise ConfigError(
                f"Expected --strategy.init_args.alpha (α) > 0, got {alpha}; the paper tries 0.1, 0.01 and 0.001."
            )
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.alpha = alpha
        self.h: torch.Tensor | None = None  # the server state h [P]; None before the run starts
        self._num_clients = 0  # m
        # during a fit: the trainable parameters' names, −∇L_k(θ_k^{t−1}) on them, θ^{t−1} on them and whole
        self._fit: tuple[list[str], list[torch.Tensor], list[torch.Tensor], torch.Tensor] | None = None

    def on_fit_start(self, context: RunContext) -> None:
        self._num_clients = context.datamodule.num_clients
        self.cache_parameter_mask(context)
        self.h = (torch.zeros_like(context.global_state) if self.h is None else self.h).to(context.global_state)

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return {"gradient": Slot.vector(context.layout.numel)}  # ∇L_k(θ_k^{t−1}), zero before the first round

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        theta = context.layout.flatten(module)  # θ^{t−1}
        params, negated = parameter_views(module, context.layout, -context.client_state["gradient"])
        anchors = [p.detach().clone() for p in params]
        self._fit = parameter_names(module, context.layout), negated, anchors, theta

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        assert self._fit is not None, "FedDyn.training_loss ran outside a local fit"
        names, negated, anchors, _ = self._fit
        params = current_parameters(module, names)
        regulariser = linear_term(params, negated) + 0.5 * self.alpha * proximal_term(params, anchors)
        return outputs["loss"] + regulariser

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        assert self._fit is not None, "FedDyn.on_client_fit_end ran outside a local fit"
        theta, gradient = self._fit[3], context.client_state["gradient"]
        new = feddyn_client_gradient(gradient, context.layout.flatten(module), theta, self.alpha)
        context.client_state["gradient"] = torch.where(self.parameter_mask(new.device), new, 0.0)
        self._fit = None

    def client_weights(self, update: ClientUpdate) -> tuple[float, ...]:
        return (1.0,)  # θ^t starts from the unweighted mean over P_t

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        assert self.h is not None, "FedDyn.server_update ran before on_fit_start"
        is_parameter = self.parameter_mask(global_state.device)
        h = torch.where(is_parameter, self.h.to(global_state), 0.0)
        theta, h = feddyn_server(global_state, aggregate, h, self.alpha, len(updates), self._num_clients)
        self.h = torch.where(is_parameter, h, 0.0)
        return torch.where(is_parameter, theta, aggregate)

    def state_dict(self) -> dict[str, Any]:
        """The server state h, once the run has started."""
        return {} if self.h is None else {"h": self.h.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.h = state["h"].clone() if "h" in state else None
