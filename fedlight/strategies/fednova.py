"""FedNova: Wang, Liu, Liang, Joshi & Poor, *Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization*, NeurIPS 2020.

Clients that run different numbers of local steps pull FedAvg towards the objectives of the busiest ones.
FedNova averages *normalised* updates instead (``JYWa/FedNova:distoptim/FedNova.py``):

    d_i = (W^t − W_i) / a_i                     client i's average step direction
    τ_eff = Σ_i p_i a_i   (Σ_i p_i τ_i when μ > 0, as the official code)
    W^{t+1} = W^t − τ_eff Σ_i p_i d_i,          p_i = n_i / Σ_j n_j over the round's clients

where a_i counts the local steps as plain-SGD steps: τ_i for SGD, more with momentum, fewer with a
proximal term (:func:`~fedlight.strategies.functional.fednova_normalizer`). With equal a_i it is FedAvg.

In fedlight the client sends W^t − d_i in place of W_i (its parameters are rescaled at the end of its
local fit), so the engine's n_k-weighted sum gives W^t − Σ p_i d_i and the server only scales the step
by τ_eff. Floating-point buffers (BatchNorm statistics) are sent and averaged as they are. The local
optimizer must be SGD; its momentum and learning rate are read from ``configure_optimizers``. Local
momentum is reset every round, as fedlight re-creates optimizers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.plans import ClientUpdate
from fedlight.strategies.fedprox import FedProx
from fedlight.strategies.functional import fednova_normalizer
from fedlight.strategies.parameters import ParameterMask

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext


class FedNova(ParameterMask, FedProx):
    """Normalised averaging of local updates; FedProx's proximal term is optional (``mu``).

    Args:
        mu: μ ≥ 0 of the proximal term (μ/2)‖w − w^t‖² added to the local loss; 0 (the default) is
            FedNova with plain or momentum SGD.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` keeps them, as heterogeneous
            local work is what FedNova corrects for.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``.
    """

    default_tolerate_stragglers = True
    default_sampling = "uniform"

    def __init__(
        self,
        mu: float = 0.0,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        super().__init__(mu=mu, tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.momentum = 0.0  # ρ of the local SGD
        self.lr = 0.0  # η of the local SGD

    def on_fit_start(self, context: RunContext) -> None:
        """Reads ρ and η of the client optimizer, which a_i depends on."""
        optimizer = context.module.configure_optimizers()
        keys = ("lr", "momentum", "dampening", "nesterov")
        settings = {tuple(group.get(key, 0) for key in keys) for group in optimizer.param_groups}
        if not isinstance(optimizer, torch.optim.SGD) or len(settings) != 1:
            raise ConfigError(
                f"FedNova normalises SGD steps, but --model.init_args.optimizer gives {type(optimizer).__name__} "
                f"with {len(settings)} parameter-group setting(s). Use torch.optim.SGD with one lr and momentum."
            )
        (lr, momentum, dampening, nesterov), *_ = settings
        if dampening != 0 or nesterov:
            raise ConfigError(
                "FedNova's a_i is defined for SGD with heavy-ball momentum: set "
                "--model.init_args.optimizer.init_args.dampening=0 and nesterov=false."
            )
        self.lr, self.momentum = float(lr), float(momentum)
        self.cache_parameter_mask(context)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Replaces the trained parameters W_i by W^t − d_i = W^t − (W^t − W_i)/a_i and sends a_i and τ_i."""
        # FedProx's on_client_fit_start kept the anchors w^t of the trainable parameters, also with μ = 0.
        normalizer = fednova_normalizer(update.num_steps, self.momentum, self.lr * self.mu)  # a_i
        if normalizer > 0:
            with torch.no_grad():
                params = [p for p in module.parameters() if p.requires_grad]  # in the anchors' order
                for param, anchor in zip(params, self._anchors, strict=True):
                    param.copy_(anchor + (param - anchor) / normalizer)
        update.payload.update(normalizer=normalizer, steps=update.num_steps)
        super().on_client_fit_end(context, module, update)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """W^t + τ_eff (Σ_i p_i (W^t − d_i) − W^t) on parameters; the average on buffers."""
        sizes = torch.tensor([float(u.num_samples) for u in updates], dtype=torch.float64)
        work = "steps" if self.mu > 0 else "normalizer"  # the official τ_eff with a proximal term counts steps
        local = torch.tensor([float(u.payload[work]) for u in updates], dtype=torch.float64)
        tau_eff = float((sizes / sizes.sum()) @ local)
        return self.parameter_step(global_state, aggregate, tau_eff)
