"""FedADMM: Wang, Marella & Anderson, *FedADMM: A Federated Primal-Dual Algorithm Allowing Partial Participation*,
IEEE CDC 2022 (arXiv 2203.15104), Algorithm 2 (FedADMM), with g ≡ 0.

ADMM on the consensus form of min_θ (1/n) Σ_k F_k(θ): every client k keeps a dual variable y_k (per-client state, zero
before its first round) and the last message x̂_k it sent (θ⁰ before its first round). A client of round t, sent θ^t,
minimises its augmented Lagrangian from θ^t and updates its dual:

    w_k = argmin_w  F_k(w) + ⟨y_k, w − θ^t⟩ + (ρ/2)‖w − θ^t‖²      (inexactly: the round's local epochs)
    y_k ← y_k + ρ (w_k − θ^t),    x̂_k ← w_k + y_k / ρ,    Δ_k = x̂_k^new − x̂_k^old

and the server adds the round's changes, each over all n clients, so that θ stays the mean of every client's last
message (with g ≡ 0 the server's prox is the identity):

    θ^{t+1} = θ^t + (1/n) Σ_{k∈S_t} Δ_k = (1/n) Σ_k x̂_k.

A client that did not come keeps its y_k and x̂_k, and its old message stays in θ. ``server_lr`` generalises the
server line to θ^t + η · (1/|S_t|) Σ_{k∈S_t} Δ_k: the paper's step is η = |S_t|/n (the default), and η = 1 moves θ
by the round's mean change. Each client sends θ^t + Δ_k as its state, so that the engine's unweighted mean over
S_t is θ^t + mean Δ_k. The server keeps θ⁰, which a client's first Δ_k is measured from. The paper's composite
term g (a server prox) is not implemented. Parameters only: floating-point buffers (BatchNorm statistics) are
neither penalised nor dual and take the plain average.
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
    linear_term,
    parameter_names,
    parameter_views,
)

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate


class FedADMM(ParameterMask, Strategy):
    """A dual variable per client, the augmented Lagrangian locally, the clients' messages averaged over all n.

    Args:
        rho: ρ > 0, the penalty of the augmented Lagrangian and the dual step size (the paper calls it η).
        server_lr: η > 0, the server's step on the mean change of the round's messages; ``null`` is |S_t|/n, the
            paper's (1/n) Σ_{k∈S_t} Δ_k.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        rho: float = 1.0,
        server_lr: float | None = None,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not rho > 0:
            problems.append(f"Expected --strategy.init_args.rho (ρ) > 0, got {rho}; it weighs (ρ/2)‖w − θ‖².")
        if server_lr is not None and not server_lr > 0:
            problems.append(
                f"Expected --strategy.init_args.server_lr (η) > 0 or null, got {server_lr}; null is the paper's "
                "step |S_t|/n."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.rho, self.server_lr = rho, server_lr
        self.start: torch.Tensor | None = None  # θ⁰ [P], every client's message before its first round
        self._num_clients = 0  # n
        # during a fit: the trainable parameters' names, y_k on them, θ^t on them and whole
        self._fit: tuple[list[str], list[torch.Tensor], list[torch.Tensor], torch.Tensor] | None = None

    def on_fit_start(self, context: RunContext) -> None:
        self._num_clients = context.datamodule.num_clients
        self.cache_parameter_mask(context)
        start = context.global_state.detach().clone() if self.start is None else self.start
        self.start = start.to(context.global_state)

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        numel = context.layout.numel
        return {"dual": Slot.vector(numel), "sent": Slot.vector(numel)}  # y_k; x̂_k − θ⁰ (zero before round one)

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        theta = context.layout.flatten(module)  # θ^t
        params, duals = parameter_views(module, context.layout, context.client_state["dual"])
        anchors = [p.detach().clone() for p in params]
        self._fit = parameter_names(module, context.layout), duals, anchors, theta

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """F_k(w) + ⟨y_k, w⟩ + (ρ/2)‖w − θ^t‖², whose gradient is the augmented Lagrangian's."""
        assert self._fit is not None, "FedADMM.training_loss ran outside a local fit"
        names, duals, anchors, _ = self._fit
        params = current_parameters(module, names)
        return outputs["loss"] + linear_term(params, duals) + 0.5 * self.rho * proximal_term(params, anchors)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Updates y_k and x̂_k, and leaves θ^t + Δ_k in the module (its trained buffers on the buffers)."""
        assert self._fit is not None and self.start is not None, "FedADMM.on_client_fit_end ran outside a local fit"
        theta, layout, slots = self._fit[3], context.layout, context.client_state
        is_parameter = self.parameter_mask(theta.device)
        trained = layout.flatten(module)  # w_k
        dual = torch.where(is_parameter, slots["dual"] + self.rho * (trained - theta), 0.0)  # y_k ← y_k + ρ(w_k − θ^t)
        sent = torch.where(is_parameter, trained + dual / self.rho - self.start.to(theta), 0.0)  # x̂_k − θ⁰
        change = sent - slots["sent"]  # Δ_k
        slots["dual"], slots["sent"] = dual, sent
        layout.load(module, torch.where(is_parameter, theta + change, trained))
        self._fit = None

    def client_weights(self, update: ClientUpdate) -> tuple[float, ...]:
        return (1.0,)  # every client's message counts alike

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """θ^t + η (mean Δ_k) on parameters, η = |S_t|/n unless ``server_lr``; the plain average on buffers."""
        step = self.server_lr if self.server_lr is not None else len(updates) / self._num_clients
        stepped = global_state + step * (aggregate - global_state)
        return self.on_parameters(stepped, aggregate)

    def state_dict(self) -> dict[str, Any]:
        """θ⁰, once the run has started."""
        return {} if self.start is None else {"start": self.start.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start = state["start"].clone() if "start" in state else None
