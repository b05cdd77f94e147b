"""APFL: Deng, Kamani & Mahdavi, *Adaptive Personalized Federated Learning*, arXiv 2003.13461, 2020, Algorithm 1.

Every client k keeps a personal model v_k and a mixing weight α_k (per-client state: v_k is the first model it
receives, α_k starts at ``alpha``) beside its copy w of the global model. Each local step t draws one batch ξ and
takes, with the values of step t − 1 on the right:

    w   ← w − η ∇f_k(w; ξ)                                the global copy, trained on the task loss alone
    v̄   = α_k v_k + (1 − α_k) w                           the mixed model, on the parameters
    v_k ← v_k − η ∇_v f_k(v̄; ξ) = v_k − η α_k ∇f_k(v̄; ξ)
    α_k ← α_k − η_α ∇_α f_k(v̄; ξ) = α_k − η_α ⟨v_k − w, ∇f_k(v̄; ξ)⟩          Eq. 10, with ``adapt_alpha``

and every τ steps (a round) the server averages the w's of the round's clients U_t, 1/|U_t| each, U_t drawn
uniformly. A client is scored with α_k v_k + (1 − α_k) W^t (``clients/personal/*``), Algorithm 1's output v̂_k with
the last iterate for the average over t. The w steps are the engine's local fit; the v_k and α_k steps run inside
``training_loss`` on the same batch, before w's own step, so they see w^(t−1). v_k steps with a fresh optimizer of
the client's kind and settings (the paper's SGD with the clients' η), α_k with η_α (the clients' η by default),
projected onto [0, 1]. The mixture covers the parameters; v̄'s forward passes update v_k's own floating-point
buffers (BatchNorm statistics), which its scored model uses.

The authors' code (FedTorch, ``comms/trainings/federated/apfl.py``) differs: it mixes the outputs
α v_k(x) + (1 − α) w(x) instead of the parameters, takes v's step after w's (with w^(t)), and updates α once per
round, at its first step, with an added 0.02 α term.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.func import functional_call

from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.strategies.base import Strategy
from fedlight.strategies.parameters import ParameterMask

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate


def single_optimizer(configured: Any) -> torch.optim.Optimizer | None:
    """The optimizer of ``configure_optimizers``'s return if it is one, alone or as a dict without a scheduler."""
    if isinstance(configured, dict) and "lr_scheduler" not in configured:
        configured = configured.get("optimizer")
    return configured if isinstance(configured, torch.optim.Optimizer) else None


class _TaskLoss(nn.Module):
    """The client's task loss as a module call, so that ``functional_call`` evaluates it at v̄."""

    def __init__(self, client: nn.Module) -> None:
        super().__init__()
        self.client = client

    def forward(self, batch: Any) -> torch.Tensor:
        return self.client.training_step(batch, 0)["loss"]


@dataclass
class _Personal:
    """A client's personal model and mixing weight during its fit."""

    params: dict[str, torch.Tensor]  # v_k's trainable parameters, leaves of its optimizer
    buffers: dict[str, torch.Tensor]  # its floating-point buffers, and copies of the module's integer ones
    optimizer: torch.optim.Optimizer
    alpha: torch.Tensor  # α_k, 0-dim
    task_loss: _TaskLoss


class APFL(ParameterMask, Strategy):
    """FedAvg of the global copies, and a personal model per client trained through its mixture with them.

    Args:
        alpha: α ∈ [0, 1], every client's mixing weight (its first one with ``adapt_alpha``); 0 is FedAvg's model,
            1 a local one. The paper's experiments fix α at 0.25, 0.5 or 0.75, or adapt it.
        adapt_alpha: step each α_k by its gradient at every local step (Eq. 10).
        alpha_lr: η_α > 0 of Eq. 10; ``null`` is the clients' learning rate (the first parameter group's), as the
            paper's η_t.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    personalised = True
    default_sampling = "uniform"

    def __init__(
        self,
        alpha: float = 0.25,
        adapt_alpha: bool = False,
        alpha_lr: float | None = None,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not 0 <= alpha <= 1:
            problems.append(
                f"Expected --strategy.init_args.alpha (α) in [0, 1], got {alpha}; 0 is the global model, 1 a local one."
            )
        if alpha_lr is not None and not alpha_lr > 0:
            problems.append(f"Expected --strategy.init_args.alpha_lr (η_α) > 0 or null, got {alpha_lr}.")
        if alpha_lr is not None and not adapt_alpha:
            problems.append(
                "--strategy.init_args.alpha_lr is set but --strategy.init_args.adapt_alpha is false, so α never "
                "moves: set adapt_alpha: true, or leave alpha_lr null."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.alpha, self.adapt_alpha, self.alpha_lr = alpha, adapt_alpha, alpha_lr
        self._alpha_lr = alpha_lr or 0.0  # η_α in use
        self._personal: _Personal | None = None  # during a fit

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        if single_optimizer(module.configure_optimizers()) is None:
            return [
                f"APFL trains each personal model with an optimizer like the client's, but "
                f"{type(module).__name__}.configure_optimizers returns several, none or one with a scheduler; "
                "give the client a single optimizer."
            ]
        return []

    def on_fit_start(self, context: RunContext) -> None:
        self.cache_parameter_mask(context)
        if self.adapt_alpha and self.alpha_lr is None:
            self._alpha_lr = single_optimizer(context.module.configure_optimizers()).param_groups[0]["lr"]

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        slots = {"personal": Slot.vector(context.layout.numel, init="received")}  # v_k
        if self.adapt_alpha:
            slots["alpha_shift"] = Slot.vector(1)  # α_k − α, zero before the client's first round
        return slots

    def personal_state(
        self, context: RunContext, client: int, values: Mapping[str, torch.Tensor], start: torch.Tensor
    ) -> torch.Tensor:
        """α_k v_k + (1 − α_k) W^t on the parameters, v_k's own buffers."""
        v, alpha = values["personal"], self._alpha_of(values)
        return torch.where(self.parameter_mask(v.device), alpha * v + (1 - alpha) * start, v)

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        layout, values = context.layout, context.client_state
        state, named = module.state_dict(), dict(module.named_parameters())
        params, buffers = {}, {name: state[name].clone() for name in layout.integer_names}
        for e in layout.entries:
            value = values["personal"][e.offset : e.offset + e.numel].view(e.shape).to(state[e.name].dtype).clone()
            if e.name in named and named[e.name].requires_grad:
                params[e.name] = value.requires_grad_()
            elif e.name not in named:
                buffers[e.name] = value
        configured = single_optimizer(module.configure_optimizers())
        names = {id(p): name for name, p in named.items()}
        groups = [
            {**{key: setting for key, setting in group.items() if key != "params"}, "params": chosen}
            for group in configured.param_groups
            if (chosen := [params[names[id(p)]] for p in group["params"] if names[id(p)] in params])
        ]
        alpha = torch.as_tensor(self._alpha_of(values), device=values["personal"].device)
        self._personal = _Personal(params, buffers, type(configured)(groups), alpha, _TaskLoss(module))

    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Steps v_k (and α_k) on the batch at v̄, from w^(t−1); w's own loss is the task loss."""
        personal = self._personal
        assert personal is not None, "APFL.training_loss ran outside a local fit"
        alpha, named = personal.alpha, dict(module.named_parameters())
        w = {name: named[name].detach() for name in personal.params}
        mixed = {  # v̄^(t−1), a leaf: its gradient is ∇f_k(v̄; ξ)
            name: (alpha * v + (1 - alpha) * w[name]).detach().requires_grad_() for name, v in personal.params.items()
        }
        tensors = {f"client.{name}": value for name, value in {**mixed, **personal.buffers}.items()}
        loss = functional_call(personal.task_loss, tensors, (batch,))  # f_k(v̄; ξ)
        gradients = torch.autograd.grad(loss, list(mixed.values()))  # ∇f_k(v̄; ξ)
        with torch.no_grad():
            if self.adapt_alpha:  # from v_k^(t−1) and w^(t−1), before v_k's step
                slope = sum(
                    torch.vdot((v - w[name]).reshape(-1), g.reshape(-1))
                    for (name, v), g in zip(personal.params.items(), gradients, strict=True)
                )  # ∇_α f_k(v̄; ξ)
                personal.alpha = (alpha - self._alpha_lr * slope).clamp(0.0, 1.0)
            for v, g in zip(personal.params.values(), gradients, strict=True):
                v.grad = alpha * g  # ∇_v f_k(v̄; ξ), with α_k^(t−1)
            personal.optimizer.step()
        return outputs["loss"]

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        personal = self._personal
        assert personal is not None, "APFL.on_client_fit_end ran outside a local fit"
        values = context.client_state
        v = values["personal"].clone()
        for e in context.layout.entries:
            own = personal.params.get(e.name, personal.buffers.get(e.name))
            if own is not None:
                v[e.offset : e.offset + e.numel] = own.detach().reshape(-1)
        values["personal"] = v
        if self.adapt_alpha:
            values["alpha_shift"] = (personal.alpha - self.alpha).reshape(1).to(v)
            update.payload["alpha"] = personal.alpha.item()
        self._personal = None

    def client_weights(self, update: ClientUpdate) -> tuple[float, ...]:
        return (1.0,)  # w^(t) = (1/|U_t|) Σ_{k∈U_t} w_k

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The round's mean mixing weight, when it adapts."""
        alphas = [u.payload["alpha"] for u in updates if "alpha" in u.payload]
        return {"apfl/alpha_mean": sum(alphas) / len(alphas)} if alphas else {}

    def _alpha_of(self, values: Mapping[str, torch.Tensor]) -> float | torch.Tensor:
        """α_k from the client's slots."""
        return self.alpha + values["alpha_shift"][0] if self.adapt_alpha else self.alpha
