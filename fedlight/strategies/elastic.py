"""Elastic aggregation: Chen, Hu, Tan, Wei & Wu, *Elastic Aggregation for Federated Optimization*, CVPR 2023
(pp. 12187–12197), the parameter sensitivity Ω and the elastic server step ζ of its method.

FedAvg moves every parameter by the clients' mean update. Elastic aggregation rescales that step parameter by
parameter with how sensitive the model's prediction is to it: it "reduces the magnitudes of updates to the more
sensitive parameters so as to prevent the server model from drifting to any one client distribution, and conversely
boosts updates to the less sensitive parameters". Sensitivity is measured as Memory Aware Synapses (Aljundi et al.,
ECCV 2018) measure it, by the gradient of the squared L2 norm of the network's output, which needs no labels, online
during local training:

    client k, every local step on a batch b:  g = ∂ mean_{x∈b} ‖F(x; θ)‖² / ∂θ,   Ω_k ← μ Ω_k + (1 − μ) |g|
    server:  Ω = Σ_k n_k Ω_k / Σ_k n_k,   ζ = 1 + τ − Ω / max(Ω),
             θ^{t+1} = θ^t − ζ ⊙ Σ_k (n_k / n) (θ^t − θ_k)

so ζ ∈ [τ, 1 + τ]: the most sensitive parameter takes τ times FedAvg's step, an insensitive one 1 + τ times it.
Ω_k starts from zero at every local fit, so it describes the model the client trains in the round; g is taken at the
step's parameters before the optimizer moves them, one extra backward pass per step; the max is over every parameter
of the model. ``sensitivity: loss`` measures g on the training loss instead of the output (for clients whose
``training_step`` returns no ``logits``). Only parameters take the elastic step; floating-point buffers (BatchNorm
running statistics) take the average, as in :class:`~fedlight.strategies.fedavgm.FedAvgM`.

FL-bench's implementation (``KarhouTam/FL-bench``, ``elastic.py``) differs: it keeps one sensitivity per parameter
tensor (its gradient's squared norm), measures it on the training loss before local training, on 30% of the client's
samples kept out of training, and normalises each tensor's by the largest client's. Its defaults τ = 0.5 and μ = 0.95
are this rule's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.parameters import ParameterMask
from fedlight.strategies.stateful_functional import current_parameters, parameter_names, parameter_views

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate


def elasticity(sensitivity: torch.Tensor, tau: float) -> torch.Tensor:
    """ζ = 1 + τ − Ω / max(Ω): the factor of every parameter's FedAvg step, from its sensitivity Ω ≥ 0.

    A model with no sensitive parameter (Ω = 0) takes the step 1 + τ everywhere.

    >>> elasticity(torch.tensor([0.0, 1.0, 4.0]), tau=0.5).tolist()
    [1.5, 1.25, 0.5]
    """
    peak = sensitivity.max()
    scaled = sensitivity / peak if peak > 0 else torch.zeros_like(sensitivity)
    return 1.0 + tau - scaled


def training_output_keys(module: torch.nn.Module, datamodule: Any) -> set[str] | None:
    """What ``training_step`` returns, for two training samples of the first client with any, in eval mode without
    gradients; ``None`` when the probe cannot run (the engine's own set-up probe reports why)."""
    client = next((k for k in range(datamodule.num_clients) if datamodule.num_samples[k]), None)
    if client is None:
        return None
    x, y = next(datamodule.client_batches(client, split="train"))[:2]
    device = next(module.parameters()).device
    modes = {child: child.training for child in module.modules()}
    module.eval()
    try:
        with torch.no_grad():
            return set(module.training_step((x[:2].to(device), y[:2].to(device)), 0))
    except Exception:
        return None
    finally:
        for child, training in modes.items():
            child.train(training)


class ElasticAggregation(ParameterMask, FedAvg):
    """FedAvg whose server step is scaled, parameter by parameter, by ζ = 1 + τ − Ω / max(Ω).

    Args:
        tau: τ ≥ 0; ζ runs from τ (the most sensitive parameter) to 1 + τ (an insensitive one). 0.5 by default.
        mu: μ ∈ [0, 1), the moving average of a client's sensitivity over its local steps. 0.95 by default.
        sensitivity: ``output`` differentiates the squared L2 norm of ``training_step``'s ``logits`` (the paper's
            unsupervised measure); ``loss`` differentiates the training loss.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``proportional``, as FedAvg.
    """

    def __init__(
        self,
        tau: float = 0.5,
        mu: float = 0.95,
        sensitivity: Literal["output", "loss"] = "output",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not tau >= 0:
            problems.append(f"Expected --strategy.init_args.tau (τ) >= 0, got {tau}; ζ runs from τ to 1 + τ.")
        if not 0.0 <= mu < 1.0:
            problems.append(f"Expected --strategy.init_args.mu (μ) in [0, 1), got {mu}; 0 keeps only the last step.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.tau, self.mu, self.sensitivity = tau, mu, sensitivity
        self.zeta_mean = 1.0  # mean ζ over the parameters in the last round, logged
        self._names: list[str] = []  # the trainable parameters the sensitivity covers, in the flat state's order
        self._omega: torch.Tensor | None = None  # Ω_k [P] of the client in its fit
        self._views: list[torch.Tensor] = []  # Ω_k's views shaped as the parameters

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        """The output sensitivity needs ``training_step`` to return ``logits``."""
        problems = super().check(module, datamodule)
        if self.sensitivity == "output":
            keys = training_output_keys(module, datamodule)
            if keys is not None and "logits" not in keys:
                problems.append(
                    f"ElasticAggregation measures sensitivity on the network's output "
                    f"(--strategy.init_args.sensitivity=output), but {type(module).__name__}.training_step returns "
                    f"{sorted(keys)}, no 'logits'. Set --strategy.init_args.sensitivity=loss to measure it on the "
                    "training loss, or use a client that returns its logits (ClassificationClient)."
                )
        return problems

    def on_fit_start(self, context: RunContext) -> None:
        self._names = parameter_names(context.module, context.layout)
        self.cache_parameter_mask(context)

    # -- client side ----------------------------------------------------------------------------------
    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        """Ω_k = 0, in the flat state's layout."""
        self._omega = torch.zeros(context.layout.numel, device=context.global_state.device)
        self._views = parameter_views(module, context.layout, self._omega)[1]

    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The task loss; before it is minimised, Ω_k ← μ Ω_k + (1 − μ) |g| at the step's parameters."""
        if self.sensitivity == "output":
            target = outputs["logits"].float().flatten(1).square().sum(dim=1).mean()  # mean ‖F(x)‖²
        else:
            target = outputs["loss"]
        params = current_parameters(module, self._names)
        grads = torch.autograd.grad(target, params, retain_graph=True, allow_unused=True)
        with torch.no_grad():
            for view, grad in zip(self._views, grads, strict=True):
                view.mul_(self.mu)
                if grad is not None:
                    view.add_(grad.abs(), alpha=1.0 - self.mu)
        return outputs["loss"]

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Sends Ω_k over the parameters."""
        assert self._omega is not None, "Elastic: on_client_fit_start did not run"
        update.payload["sensitivity"] = self._omega[self.parameter_mask(self._omega.device)].cpu()
        self._omega, self._views = None, []

    # -- server side ----------------------------------------------------------------------------------
    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """θ^t + ζ ⊙ (average − θ^t) on parameters, ζ from the weighted mean sensitivity; the average on buffers."""
        total, omega = 0.0, None
        for update in updates:  # Ω = Σ_k w_k Ω_k / Σ_k w_k, w_k = n_k as the average's
            weighted = update.payload["sensitivity"].double() * update.weights[0]
            omega = weighted if omega is None else omega + weighted
            total += update.weights[0]
        zeta = elasticity(omega / total, self.tau).to(global_state)  # [P_params]
        self.zeta_mean = float(zeta.mean())
        mask = self.parameter_mask()
        new = aggregate.clone()
        new[mask] = global_state[mask] + zeta * (aggregate[mask] - global_state[mask])
        return new

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The mean step factor ζ over the parameters (1 is FedAvg's)."""
        return {"elastic/zeta_mean": self.zeta_mean}
