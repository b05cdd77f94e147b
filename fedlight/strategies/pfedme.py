"""pFedMe: T. Dinh, Tran & Nguyen, *Personalized Federated Learning with Moreau Envelopes*, NeurIPS 2020,
Algorithm 1.

Each client's personal model θ_i is tied to the global model through the Moreau envelope of its loss,
F_i(w) = min_θ f_i(θ) + (λ/2)‖θ − w‖². At every local step r of round t, client i draws a batch D and

    θ̂_i(w_{i,r}) ≈ argmin_θ  f_i(θ; D) + (λ/2)‖θ − w_{i,r}‖²        (K steps of gradient descent, lr personal_lr)
    w_{i,r+1} = w_{i,r} − η λ (w_{i,r} − θ̂_i(w_{i,r})),

from w_{i,0} = w^t; after its R steps the server takes w^{t+1} = (1 − β) w^t + β (1/S) Σ_{i∈S^t} w_{i,R}, over the
round's S clients drawn uniformly. The client is scored with its personal model θ̂_i (``clients/personal/*``).

The engine's local fit runs the R steps: ``training_loss`` solves the inner problem on the batch the engine drew and
returns (λ/2)‖w − θ̂‖², whose gradient λ(w − θ̂) the client's optimizer steps along. With plain SGD of lr η that is
the update above exactly; with momentum or weight decay the direction goes through them. The inner solve starts
from the previous step's θ̂ (from w^t at a round's start), as the authors' code does; the paper leaves its start
open. The last θ̂ of a client's round is kept as its personal model. β applies to the parameters; floating-point
buffers (BatchNorm statistics) take the average, which a step with β > 1 could make invalid.

Departures from Algorithm 1: there every client runs its local steps in every round and the server then draws S^t
to aggregate; here only the drawn clients train (the aggregate is the same), so a client's personal model is the
one of the last round it was drawn in. The authors' code weighs the clients' models by n_i
(``weighting: samples``); the paper takes their plain mean, the default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.strategies.base import Strategy
from fedlight.strategies.fedprox import proximal_term
from fedlight.strategies.parameters import ParameterMask
from fedlight.strategies.personal_functional import moreau_inner_solve
from fedlight.strategies.stateful_functional import current_parameters, parameter_names, parameter_views

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate


class PFedMe(ParameterMask, Strategy):
    """Personal models θ̂_i from the Moreau envelope of each client's loss; the global model follows their anchors.

    Args:
        lam: λ > 0, how strongly θ_i is tied to w (the paper: 15 on MNIST, 20 on Synthetic).
        inner_steps: K ≥ 1, gradient steps of the inner problem per local step (the paper: 5).
        personal_lr: > 0, the inner steps' learning rate (the paper: 0.1 for MNIST's logistic regression, 0.09 for
            its DNN, 0.01 on Synthetic). The outer step's η is the client optimizer's lr.
        beta: β > 0, the server's mix (1 − β) w^t + β · mean; 1 takes the mean (the paper's main setting), the
            authors also report β = 2.
        weighting: ``uniform`` averages the round's clients with 1/S, as the paper; ``samples`` by n_i, as the
            authors' code.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    personalised = True
    default_sampling = "uniform"

    def __init__(
        self,
        lam: float = 15.0,
        inner_steps: int = 5,
        personal_lr: float = 0.09,
        beta: float = 1.0,
        weighting: Literal["uniform", "samples"] = "uniform",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not lam > 0:
            problems.append(f"Expected --strategy.init_args.lam (λ) > 0, got {lam}; the paper uses 15 to 30.")
        if not (isinstance(inner_steps, int) and inner_steps >= 1):
            problems.append(f"Expected --strategy.init_args.inner_steps (K) an integer ≥ 1, got {inner_steps}.")
        if not personal_lr > 0:
            problems.append(
                f"Expected --strategy.init_args.personal_lr > 0, got {personal_lr}; the paper uses 0.01 to 0.1."
            )
        if not beta > 0:
            problems.append(f"Expected --strategy.init_args.beta (β) > 0, got {beta}; 1 takes the clients' mean.")
        if weighting not in ("uniform", "samples"):
            problems.append(f"Expected --strategy.init_args.weighting uniform or samples, got {weighting!r}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.lam, self.inner_steps, self.personal_lr, self.beta = lam, inner_steps, personal_lr, beta
        self.weighting = weighting
        self._fit: tuple[list[str], list[torch.Tensor]] | None = None  # during a fit: parameter names, θ̂

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        if not module.automatic_optimization:
            return [
                f"PFedMe steps the client's optimizer along λ(w − θ̂) through its loss, but {type(module).__name__} "
                "runs its own optimizer steps; choose a client with automatic optimization."
            ]
        return []

    def on_fit_start(self, context: RunContext) -> None:
        self.cache_parameter_mask(context)

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return {"personal": Slot.vector(context.layout.numel, init="received")}  # θ̂_i

    def personal_state(
        self, context: RunContext, client: int, values: Mapping[str, torch.Tensor], start: torch.Tensor
    ) -> torch.Tensor:
        return values["personal"]

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        names = parameter_names(module, context.layout)
        self._fit = names, [p.detach().clone() for p in current_parameters(module, names)]  # θ starts at w^t

    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(λ/2)‖w − θ̂(w)‖² with θ̂ solved on this batch: its gradient is λ(w − θ̂), the outer step's direction."""
        assert self._fit is not None, "PFedMe.training_loss ran outside a local fit"
        names, theta = self._fit
        params = current_parameters(module, names)  # w_{i,r}
        theta = moreau_inner_solve(
            module, names, theta, params, batch, self.lam, self.personal_lr, self.inner_steps
        )  # fmt: skip
        self._fit = names, theta
        return 0.5 * self.lam * proximal_term(params, theta)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Keeps the last θ̂ as the client's personal model, with the trained model's buffers."""
        assert self._fit is not None, "PFedMe.on_client_fit_end ran outside a local fit"
        personal = context.layout.flatten(module)
        _, views = parameter_views(module, context.layout, personal)
        for view, value in zip(views, self._fit[1], strict=True):
            view.copy_(value)
        context.client_state["personal"] = personal
        self._fit = None

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        return (1.0 if self.weighting == "uniform" else float(update.num_samples),)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """(1 − β) w^t + β · mean on the parameters; the mean on buffers."""
        mixed = (1.0 - self.beta) * global_state + self.beta * aggregate
        return self.on_parameters(mixed, aggregate)
