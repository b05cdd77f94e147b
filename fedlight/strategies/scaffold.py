"""SCAFFOLD: Karimireddy et al., *SCAFFOLD: Stochastic Controlled Averaging for Federated Learning*, ICML 2020.

Client drift is corrected with control variates: the server keeps c, every client keeps its own c_k (per-client
state, zero before its first round). Algorithm 1, with option II for the client's new control variate:

    y ← y − η_l (g_k(y) − c_k + c)                      every local step, from y = x
    c_k⁺ = c_k − c + (x − y_k) / (K η_l)                option II, K local steps
    x ← x + η_g · (1/|S|) Σ_{k∈S} (y_k − x)             server step size η_g
    c ← c + (1/N) Σ_{k∈S} (c_k⁺ − c_k)                  N: every client

The correction enters as a term ⟨c − c_k, y⟩ added to the loss, whose gradient is c − c_k: with plain SGD that is
the paper's step exactly; with momentum or Adam the corrected gradient goes through the optimizer. The maths is
in :mod:`~fedlight.strategies.stateful_functional`. The server step and the control variates move parameters
only: floating-point buffers (BatchNorm statistics) take the plain average.

Each process keeps its own clients' Δc_k until the round ends; every process then sums all of them in client
order, so one or several processes give the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.strategies.base import Strategy, traceable_loss
from fedlight.strategies.parameters import ParameterMask
from fedlight.strategies.stateful_functional import (
    current_parameters,
    linear_term,
    parameter_names,
    parameter_views,
    scaffold_control_variate,
    scaffold_server_control,
    server_step,
)

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate


def optimizer_lr(module: LightningModule) -> float | None:
    """The learning rate of the optimizer ``configure_optimizers`` returns (its first group), if it is one."""
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if isinstance(configured, torch.optim.Optimizer):
        return float(configured.param_groups[0]["lr"])
    return None


class SCAFFOLD(ParameterMask, Strategy):
    """Control variates c (server) and c_k (each client) correct every local step; option II updates c_k.

    Args:
        server_lr: η_g > 0, the server step size (1 in most of the paper's experiments).
        local_lr: η_l of option II; ``null`` reads it from the client's optimizer (its first parameter group).
            Give it when the optimizer is built in a way that does not say (several optimizers).
        weighting: ``uniform`` averages the clients' models with 1/|S| as the paper does; ``samples`` weighs
            them by n_k as FedAvg does.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        server_lr: float = 1.0,
        local_lr: float | None = None,
        weighting: Literal["uniform", "samples"] = "uniform",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not server_lr > 0:
            problems.append(f"Expected --strategy.init_args.server_lr (η_g) > 0, got {server_lr}; 1 is FedAvg's step.")
        if local_lr is not None and not local_lr > 0:
            problems.append(f"Expected --strategy.init_args.local_lr (η_l) > 0 or null, got {local_lr}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.server_lr, self.local_lr, self.weighting = server_lr, local_lr, weighting
        self.control: torch.Tensor | None = None  # c [P]; None before the run starts
        self._lr: float | None = None  # η_l in use
        self._deltas: dict[int, torch.Tensor] = {}  # this process's Δc_k of the round
        # during a fit: the trainable parameters' names, c − c_k on them, x
        self._fit: tuple[list[str], list[torch.Tensor], torch.Tensor] | None = None

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        if self.local_lr is None and optimizer_lr(module) is None:
            return [
                f"SCAFFOLD reads η_l from the client's optimizer, but {type(module).__name__}.configure_optimizers "
                "returns several or none; set --strategy.init_args.local_lr."
            ]
        return []

    def on_fit_start(self, context: RunContext) -> None:
        self._lr = self.local_lr if self.local_lr is not None else optimizer_lr(context.module)
        self.cache_parameter_mask(context)
        if self.control is None:
            self.control = torch.zeros_like(context.global_state)
        self.control = self.control.to(context.global_state.device)

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return {"control": Slot.vector(context.layout.numel)}  # c_k, zero before the client's first round

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        x = context.layout.flatten(module)
        correction = self.control.to(x) - context.client_state["control"]  # c − c_k
        _, views = parameter_views(module, context.layout, correction)
        self._fit = parameter_names(module, context.layout), views, x

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        assert self._fit is not None, "SCAFFOLD.training_loss ran outside a local fit"
        names, corrections, _ = self._fit
        return outputs["loss"] + linear_term(current_parameters(module, names), corrections)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        assert self._fit is not None and self._lr is not None, "SCAFFOLD.on_client_fit_end ran outside a local fit"
        x, c_k = self._fit[2], context.client_state["control"]
        y = context.layout.flatten(module)
        new = scaffold_control_variate(c_k, self.control.to(x), x, y, update.num_steps, self._lr)
        new = torch.where(self.parameter_mask(x.device), new, 0.0)  # buffers keep no control variate
        context.client_state["control"] = new
        self._deltas[update.client] = (new - c_k).cpu()
        self._fit = None

    def client_weights(self, update: ClientUpdate) -> tuple[float, ...]:
        return (1.0 if self.weighting == "uniform" else float(update.num_samples),)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        stepped = server_step(global_state, aggregate, self.server_lr)
        return self.on_parameters(stepped, aggregate)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        mine = {client: delta for client, delta in self._deltas.items() if client in {u.client for u in updates}}
        self._deltas = {}
        gathered = {client: delta for part in context.all_gather_objects(mine) for client, delta in part.items()}
        deltas = [gathered[client].to(self.control.device) for client in sorted(gathered)]
        self.control = scaffold_server_control(self.control, deltas, context.datamodule.num_clients)
        return {"scaffold/control_norm": torch.linalg.vector_norm(self.control).item()}

    def state_dict(self) -> dict[str, Any]:
        """The server's control variate c, once the run has started."""
        return {} if self.control is None else {"control": self.control.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.control = state["control"].clone() if "control" in state else None
