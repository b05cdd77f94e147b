"""FedAU: Wang & Ji, *A Lightweight Method for Tackling Unknown Participation Statistics in Federated
Averaging*, ICLR 2024 (arXiv 2306.03401).

Clients that take part rarely are under-represented by FedAvg. FedAU weighs each participating client's
update by an online estimate of 1/p_n, the mean of its past participation intervals
(``IBM/fedau:main.py`` with ``-weighting adaptive``):

    ω_n = mean of client n's recorded intervals (1 before it has any)
    W^{t+1} = W^t + η_g · (1/N) Σ_{n participating} ω_n (W_n − W^t)         N = all clients

After a client's update is weighed, the rounds since its previous participation (this one included) are
appended to its intervals. A client that has not participated for K rounds (the cutoff, ∞ by default)
records K and starts counting again, which bounds the estimate.

The engine's sum gives A = Σ ω_n W_n / Σ ω_n, so the step is W^t + η_g (Σ ω_n / N)(A − W^t). Floating-point
buffers (BatchNorm statistics) take A itself. A client whose update is not aggregated (dropped straggler,
non-finite state) counts as not participating. With every client taking part in every round, ω = 1 and
FedAU is the uniform average of the clients (FedAvg with equal n_k): FedAU's objective weighs clients
equally.
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
    from fedlight.context import RunContext


class FedAU(ParameterMask, Strategy):
    """Aggregation weights from estimated participation intervals.

    Args:
        server_lr: η_g > 0, the server learning rate (1 in the paper).
        cutoff: K, the longest interval recorded: a client absent for K rounds records K and starts
            counting again. ``null`` is ∞ (the paper's default).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        server_lr: float = 1.0,
        cutoff: int | None = None,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not server_lr > 0:
            problems.append(f"Expected --strategy.init_args.server_lr (η_g) > 0, got {server_lr}.")
        if cutoff is not None and cutoff < 1:
            problems.append(f"Expected --strategy.init_args.cutoff (K) ≥ 1 or null (∞), got {cutoff}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.server_lr = server_lr
        self.cutoff = cutoff
        # Per client, all [N] int64: the sum and number of recorded intervals, and the rounds since it last took part.
        self.interval_sum: torch.Tensor | None = None
        self.interval_count: torch.Tensor | None = None
        self.absent: torch.Tensor | None = None

    def on_fit_start(self, context: RunContext) -> None:
        if self.interval_sum is None:
            num_clients = context.datamodule.num_clients
            self.interval_sum = torch.zeros(num_clients, dtype=torch.int64)
            self.interval_count = torch.zeros(num_clients, dtype=torch.int64)
            self.absent = torch.zeros(num_clients, dtype=torch.int64)
        self.cache_parameter_mask(context)

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        """ω_n: the mean of the client's past intervals, 1 before it has any."""
        assert self.interval_sum is not None, "FedAU.client_weights ran before on_fit_start"
        count = int(self.interval_count[update.client])
        return (float(self.interval_sum[update.client]) / count if count else 1.0,)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """W^t + η_g (Σ ω_n / N)(A − W^t) on parameters; A on buffers."""
        scale = self.server_lr * sum(u.weights[0] for u in updates) / len(self.interval_sum)
        return self.parameter_step(global_state, aggregate, scale)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """Records this round's intervals, after the weights were used."""
        participated = torch.zeros_like(self.absent, dtype=torch.bool)
        participated[[u.client for u in updates]] = True
        # participants: the interval since their last participation, this round included
        self.interval_sum[participated] += self.absent[participated] + 1
        self.interval_count[participated] += 1
        self.absent[participated] = 0
        # the others wait one round longer; at the cutoff K they record K and start again
        self.absent[~participated] += 1
        if self.cutoff is not None:
            reached = self.absent >= self.cutoff
            self.interval_sum[reached] += self.absent[reached]
            self.interval_count[reached] += 1
            self.absent[reached] = 0
        weights = [u.weights[0] for u in updates]
        return {"fedau/weight_max": max(weights), "fedau/weight_min": min(weights)} if weights else {}

    def state_dict(self) -> dict[str, Any]:
        """Every client's interval sum and count and its current absence."""
        if self.interval_sum is None:
            return {}
        return {
            "interval_sum": self.interval_sum.clone(),
            "interval_count": self.interval_count.clone(),
            "absent": self.absent.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            self.interval_sum = self.interval_count = self.absent = None
            return
        self.interval_sum = state["interval_sum"].clone()
        self.interval_count = state["interval_count"].clone()
        self.absent = state["absent"].clone()
