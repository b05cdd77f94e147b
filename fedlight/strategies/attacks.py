"""Byzantine clients around any rule: a fraction of the clients send poisoned updates.

An attacker's update is Δ_k = θ_k − W^t, transformed as (s is ``scale``):

- ``sign_flip``: Δ ← −s·Δ, the reversed update (e.g. Li et al., *RSA*, AAAI 2019; Fang et al., USENIX Security
  2020); applied on the client, after its local fit.
- ``gaussian``: Δ ← s·ξ, ξ ~ N(0, I), the Gaussian Byzantine worker of Blanchard et al., NeurIPS 2017 (Sec. 5);
  on the client, from a stream derived from the client's own ``(seed, round, client)`` seed.
- ``label_flip``: the client trains on flipped labels y ← C − 1 − y (Fang et al. 2020; Tolpegin et al.,
  ESORICS 2020); labels ≥ C (an ignore index such as 255) are kept. The batches are rewritten as they are drawn
  (:meth:`~fedlight.strategies.Strategy.transform_batch`), so the client's own ``training_step`` runs unchanged.
- ``alie``: *A Little Is Enough*, Baruch, Baruch & Goldberg, NeurIPS 2019: every attacker sends μ − z·σ, the
  coordinate-wise mean and standard deviation of the round's honest updates, with
  z = Φ⁻¹((K − s)/K), s = ⌊K/2 + 1⌋ − m for m attackers of K clients, unless ``scale`` sets z;
- ``ipm``: inner-product manipulation, Xie, Koyejo & Gupta, *Fall of Empires*, UAI 2020: every attacker sends
  −ε·μ with ε = ``scale`` (0.1 by default, the paper's setting against Krum and the median).

ALIE and IPM read the honest updates of the round, so they run in the aggregation step, where the states are
gathered (``gather_states``); they need only the honest updates' per-coordinate mean and standard deviation, so
they rewrite the attackers' rows block by block as the engine reads the states in column blocks. The other
attacks run on the client and work with any rule, gathered or not.
Attacks change parameters only: floating-point buffers (BatchNorm statistics) stay the client's, since a flipped
or noisy running variance is negative or meaningless rather than adversarial.

Which clients attack: with ``redraw: false`` a fixed set of round(f·N) of the N clients, drawn once from the
run's seed, attacks whenever sampled; with ``redraw: true`` round(f·K) of each round's K training clients are
drawn anew every round. Both draws come from the strategy's stream (``context.strategy_rng``), so every process
knows the same attackers and a resumed run re-draws them identically. Each round logs ``attack/clients`` and,
as a W&B histogram, ``attack/attackers`` (the attacking clients' ids, when there are two or more).
"""

from __future__ import annotations

from statistics import NormalDist
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.errors import ConfigError
from fedlight.gather import StateChunks
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.robust_functional import row_sum
from fedlight.strategies.wrapper import RuleWrapper

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext

AttackKind = Literal["sign_flip", "gaussian", "label_flip", "alie", "ipm"]
_AGGREGATION_ATTACKS = ("alie", "ipm")


def alie_z(num_clients: int, num_attackers: int) -> float:
    """ALIE's z_max (Baruch et al. 2019, Alg. 3): the largest shift that still hides in the honest spread.

    s = ⌊K/2 + 1⌋ − m honest clients must look "further" than the attackers, z = Φ⁻¹((K − s)/K).

    >>> round(alie_z(10, 2), 4)  # s = 4: Φ⁻¹(0.6)
    0.2533
    """
    supporters = num_clients // 2 + 1 - num_attackers
    return NormalDist().inv_cdf((num_clients - supporters) / num_clients)


def alie_update(honest: torch.Tensor, z: float) -> torch.Tensor:
    """ALIE's malicious update μ − z·σ from ``[H, P]`` honest updates (σ unbiased; 0 with one honest update).

    Sums run row by row (:func:`~fedlight.strategies.robust_functional.row_sum`), so a block of columns gives the
    same bits as the whole states.

    >>> alie_update(torch.tensor([[1.0, 0.0], [3.0, 0.0]]), z=2.0).tolist()  # μ = (2, 0), σ = (√2, 0)
    [-0.8284270763397217, 0.0]
    """
    count = honest.shape[0]
    mean = row_sum(honest) / count
    variance = row_sum((honest - mean).square()) / max(count - 1, 1)
    return mean - z * variance.sqrt()


def ipm_update(honest: torch.Tensor, epsilon: float) -> torch.Tensor:
    """IPM's malicious update −ε·μ from ``[H, P]`` honest updates (Xie et al. 2020).

    >>> ipm_update(torch.tensor([[1.0, 2.0], [3.0, -2.0]]), epsilon=0.5).tolist()
    [-1.0, -0.0]
    """
    return -epsilon * (row_sum(honest) / honest.shape[0])


def flip_labels(targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """y ← C − 1 − y for labels below C; others (an ignore index) are kept.

    >>> flip_labels(torch.tensor([0, 1, 9, 255]), 10).tolist()
    [9, 8, 0, 255]
    """
    return torch.where(targets < num_classes, num_classes - 1 - targets, targets)


class Attack(RuleWrapper):
    """A rule some of whose clients are Byzantine; wrap it around the defense to test
    (``Attack(rule=RobustAggregation(rule=FedAvg()), kind="alie")``).

    Args:
        rule: the wrapped rule (its client hooks, aggregation and state); ``null`` is FedAvg.
        kind: ``sign_flip``, ``gaussian``, ``label_flip``, ``alie`` or ``ipm`` (see the module docstring).
        fraction: f ∈ [0, 1), the share of attackers: of all clients (``redraw: false``) or of each round's.
        redraw: draw the attackers anew among each round's clients instead of fixing them once.
        scale: s of ``sign_flip`` (Δ ← −sΔ, default 1), the standard deviation of ``gaussian`` (default 1),
            z of ``alie`` (default ALIE's z_max for the round's K and m), ε of ``ipm`` (default 0.1).
    """

    def __init__(
        self,
        rule: Strategy | None = None,
        kind: AttackKind = "sign_flip",
        fraction: float = 0.2,
        redraw: bool = False,
        scale: float | None = None,
    ) -> None:
        problems = []
        if not 0.0 <= fraction < 1.0:
            problems.append(f"Expected --strategy.init_args.fraction (f) in [0, 1), got {fraction}; 0.2 is 20 %.")
        if scale is not None and not scale > 0:
            problems.append(f"Expected --strategy.init_args.scale > 0 (or null for the attack's default), got {scale}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(FedAvg() if rule is None else rule)
        self.kind = kind
        self.fraction = fraction
        self.redraw = redraw
        self.scale = scale
        self.malicious: set[int] = set()  # the fixed attackers among all clients (redraw: false)
        self.attackers: set[int] = set()  # the round's attackers
        self._round = 0
        self._is_parameter: torch.Tensor | None = None  # [P] bool
        self._start: torch.Tensor | None = None  # W^t as the attacking client received it
        self._num_classes = 0

    @property
    def gather_states(self) -> bool:
        return self.rule.gather_states or self.kind in _AGGREGATION_ATTACKS

    # -- who attacks ----------------------------------------------------------------------------------
    def on_fit_start(self, context: RunContext) -> None:
        self.rule.on_fit_start(context)
        self._is_parameter = context.layout.parameter_mask(context.module)
        self._num_classes = context.datamodule.num_classes
        num_clients = context.datamodule.num_clients
        # a child of round 0's strategy stream: independent of the draws the wrapped rule makes from it
        rng = context.strategy_rng(0).spawn(1)[0]
        count = round(self.fraction * num_clients)
        self.malicious = set(rng.choice(num_clients, size=count, replace=False).tolist())

    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        self.rule.on_round_start(context, round_idx, plans)
        self._round = round_idx
        training = [p.client for p in plans if not p.dropped]
        if self.redraw:
            rng = context.strategy_rng(round_idx).spawn(1)[0]
            count = round(self.fraction * len(training))
            self.attackers = set(rng.choice(training, size=count, replace=False).tolist())
        else:
            self.attackers = self.malicious & set(training)

    # -- client-side attacks ----------------------------------------------------------------------------
    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        self.rule.on_client_fit_start(context, module, plan)
        if plan.client in self.attackers and self.kind in ("sign_flip", "gaussian"):
            self._start = context.layout.flatten(module)

    def transform_batch(self, context: RunContext, client: int, batch: Any) -> Any:
        """The rule's batch; an attacking client's labels flipped (``label_flip``)."""
        batch = self.rule.transform_batch(context, client, batch)
        if self.kind != "label_flip" or client not in self.attackers:
            return batch
        inputs, targets, *rest = batch
        return (inputs, flip_labels(targets, self._num_classes), *rest)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        if update.client in self.attackers and self.kind in ("sign_flip", "gaussian"):
            self._poison(context, module, update.client)
        self.rule.on_client_fit_end(context, module, update)

    def _poison(self, context: RunContext, module: LightningModule, client: int) -> None:
        layout, start = context.layout, self._start
        assert start is not None, "Attack._poison ran without the state the client started from"
        update = layout.flatten(module) - start  # Δ_k
        if self.kind == "sign_flip":
            poisoned = -(1.0 if self.scale is None else self.scale) * update
        else:
            seed = np.random.SeedSequence(context.client_seed(self._round, client), spawn_key=(1,))
            generator = torch.Generator().manual_seed(int(seed.generate_state(1, dtype=np.uint64)[0] >> 1))
            noise = torch.randn(update.shape, generator=generator).to(update)
            poisoned = (1.0 if self.scale is None else self.scale) * noise
        is_parameter = self._is_parameter.to(update.device)
        layout.load(module, start + torch.where(is_parameter, poisoned, update), layout.integers(module))
        self._start = None

    # -- aggregation-side attacks -----------------------------------------------------------------------
    def aggregate_chunks(
        self, global_state: torch.Tensor, states: StateChunks, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        attacking = [i for i, u in enumerate(updates) if u.client in self.attackers]
        honest = [i for i, u in enumerate(updates) if u.client not in self.attackers]
        if self.kind in _AGGREGATION_ATTACKS and attacking and honest:

            def poison(columns: slice, block: torch.Tensor) -> torch.Tensor:
                return self.poison_block(global_state, columns, block, attacking, honest)

            states = states.map(poison)
        return super().aggregate_chunks(global_state, states, updates)

    def poison_states(
        self, global_state: torch.Tensor, states: torch.Tensor, attacking: list[int], honest: list[int]
    ) -> torch.Tensor:
        """``[K, P]`` states whose ``attacking`` rows carry ALIE's or IPM's update computed from the ``honest`` rows."""
        return self.poison_block(global_state, slice(0, states.shape[1]), states, attacking, honest)

    def poison_block(
        self, global_state: torch.Tensor, columns: slice, block: torch.Tensor, attacking: list[int], honest: list[int]
    ) -> torch.Tensor:
        """The ``[K, c]`` columns ``columns`` of the states with the ``attacking`` rows replaced by ALIE's or IPM's
        update, which is coordinate-wise in the ``honest`` rows' updates."""
        start = global_state[columns].to(block)
        updates = block - start  # [K, c] Δ_k
        if self.kind == "alie":
            z = alie_z(len(attacking) + len(honest), len(attacking)) if self.scale is None else self.scale
            malicious = alie_update(updates[honest], z)
        else:
            malicious = ipm_update(updates[honest], 0.1 if self.scale is None else self.scale)
        is_parameter = self._is_parameter[columns].to(block.device)
        poisoned = block.clone()
        poisoned[attacking] = torch.where(is_parameter, start + malicious, block[attacking])
        return poisoned

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The rule's metrics, the number of attackers among the aggregated clients and their ids."""
        metrics = dict(self.rule.on_round_end(context, round_idx, updates))
        attacking = sorted(u.client for u in updates if u.client in self.attackers)
        metrics["attack/clients"] = float(len(attacking))
        if len(attacking) > 1:  # a W&B histogram; a single id would be logged as a scalar
            metrics["attack/attackers"] = torch.tensor(attacking, dtype=torch.long)
        return metrics
