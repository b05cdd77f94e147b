"""q-FedAvg: Li, Sanjabi, Beirami & Smith, *Fair Resource Allocation in Federated Learning*, ICLR 2020
(arXiv 1905.10497), Algorithm 2.

q-FFL (Eq. 2) minimises Σ_k p_k F_k^{q+1}(w) / (q + 1), which weighs the clients with a high loss more as q grows;
q = 0 is FedAvg's objective. q-FedAvg takes one step on it from the clients' local solutions w̄_k:

    Δw_k = L (w^t − w̄_k),   Δ_k = F_k^q(w^t) Δw_k,   h_k = q F_k^{q−1}(w^t) ‖Δw_k‖² + L F_k^q(w^t),
    w^{t+1} = w^t − Σ_k Δ_k / Σ_k h_k

over the round's clients S_t, where F_k(w^t) is client k's training loss of the global model before its local fit
and L a Lipschitz constant of the loss's gradient: h_k is Lemma 3's bound on the local Lipschitz constant of
F_k^{q+1}/(q + 1), so Σ_k h_k sets the step size without tuning. As the authors' code (``litian96/fair_flearn``,
``qffedavg.py``), L = 1/η with η the clients' learning rate, F_k is the mean loss over k's whole training split, and
F_k + 10⁻¹⁰ stands for F_k in the powers. With q = 0 the step is the plain mean of the w̄_k, whatever L.

Since Σ_k Δ_k = L (Σ_k F_k^q)(w^t − a) with a = Σ_k F_k^q w̄_k / Σ_k F_k^q, the engine's streamed weighted sum with
weights F_k^q gives a, and each client sends only F_k and ‖w^t − w̄_k‖². F_k is read in eval mode (no dropout, the
BatchNorm statistics W^t carries), through :func:`~fedlight.passes.mean_task_loss`. Only parameters take the step;
floating-point buffers (BatchNorm running statistics) take the F_k^q-weighted average, as in :class:`FedAvgM`.

Flower's ``QFedAvg`` (``flwr.server.strategy.qfedavg``) differs from Algorithm 2 in F_k: it uses one loss for every
client, the server's own evaluation of w^t (``evaluate_fn``; without one, the clients' mean reported fit loss, or 1),
so the F_k^q weights are all equal and only ‖Δw_k‖² tells the clients apart. Its L is 1/``qffl_learning_rate``, a
setting of its own (0.1 by default, with q = 0.2), not read from the clients' optimiser.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.passes import mean_task_loss
from fedlight.plans import ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.parameters import ParameterMask
from fedlight.strategies.scaffold import optimizer_lr

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan

#: added to F_k before its powers, as the authors' code does, so that a client with zero loss keeps a weight
LOSS_FLOOR = 1e-10


class QFedAvg(ParameterMask, Strategy):
    """One step of q-FFL from the clients' local solutions, with the step size Σ_k h_k (Algorithm 2).

    Args:
        q: q ≥ 0, how much more the clients with a high loss weigh; 0 is FedAvg with the plain mean. The paper uses
            q = 1 on Synthetic and Sent140, 5 on Vehicle and 0.001 on Shakespeare.
        lipschitz: L > 0, the Lipschitz constant estimate; ``null`` is 1/η with η the clients' learning rate (the
            first parameter group of ``configure_optimizers``), as the authors' code.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``proportional`` (p_k ∝ n_k), as in the paper.
    """

    def __init__(
        self,
        q: float = 1.0,
        lipschitz: float | None = None,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not q >= 0:
            problems.append(f"Expected --strategy.init_args.q >= 0, got {q}; 0 is FedAvg, the paper uses 0.001 to 5.")
        if lipschitz is not None and not lipschitz > 0:
            problems.append(
                f"Expected --strategy.init_args.lipschitz (L) > 0, got {lipschitz}; null reads 1/lr of the clients."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.q = q
        self.lipschitz = lipschitz
        self._lipschitz = lipschitz  # L in use, read from the client's optimiser when not given
        self._start: torch.Tensor | None = None  # w^t [P] of the client in its fit
        self._loss = 0.0  # F_k(w^t) of the client in its fit

    def on_fit_start(self, context: RunContext) -> None:
        self.cache_parameter_mask(context)
        if self.lipschitz is None:
            lr = optimizer_lr(context.module)
            if lr is None or not lr > 0:
                raise ConfigError(
                    "QFedAvg sets L = 1/lr from the client's optimizer, but --model's configure_optimizers gives no "
                    "single optimizer with a positive lr. Set --strategy.init_args.lipschitz."
                )
            self._lipschitz = 1.0 / lr

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        """Keeps w^t and reads F_k(w^t), the global model's mean training loss on the client, in eval mode."""
        self._start = context.layout.flatten(module)
        modes = {child: child.training for child in module.modules()}
        module.eval()
        try:
            self._loss = mean_task_loss(context, module, plan.client)
        finally:
            for child, training in modes.items():
                child.train(training)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Sends F_k(w^t) and ‖w^t − w̄_k‖² over the parameters."""
        assert self._start is not None, "QFedAvg: on_client_fit_start did not run"
        moved = (self._start - context.layout.flatten(module))[self.parameter_mask(self._start.device)]
        update.payload.update(loss=self._loss, moved_sq=float(moved.double().square().sum()))
        self._start = None

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        """F_k^q, so that the engine's weighted sum is a = Σ_k F_k^q w̄_k / Σ_k F_k^q."""
        return ((update.payload["loss"] + LOSS_FLOOR) ** self.q,)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """w^t − L (Σ_k F_k^q)(w^t − a) / Σ_k h_k on parameters; a on buffers."""
        q, lipschitz = self.q, self._lipschitz
        loss = torch.tensor([u.payload["loss"] for u in updates], dtype=torch.float64) + LOSS_FLOOR  # F_k
        moved_sq = torch.tensor([u.payload["moved_sq"] for u in updates], dtype=torch.float64)  # ‖w^t − w̄_k‖²
        # ‖Δw_k‖² = L² ‖w^t − w̄_k‖²
        h = q * loss ** (q - 1) * lipschitz**2 * moved_sq + lipschitz * loss**q  # h_k
        step = float(lipschitz * (loss**q).sum() / h.sum())
        new = global_state - step * (global_state - aggregate)
        return self.on_parameters(new, aggregate)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The spread of the clients' losses F_k(w^t), which q-FFL narrows."""
        losses = torch.tensor([u.payload["loss"] for u in updates if "loss" in u.payload])
        if not losses.numel():
            return {}
        return {"qfedavg/loss_mean": float(losses.mean()), "qfedavg/loss_max": float(losses.max())}
