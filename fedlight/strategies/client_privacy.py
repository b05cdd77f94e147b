"""What the wrappers whose clients privatise their own work share: secret noise per client, a per-client ledger.

:class:`~fedlight.strategies.local_dp.LocalDP` (noise on the update a client sends) and
:class:`~fedlight.strategies.dp_sgd.DPSGD` (noise on every gradient step of a client) draw their noise on the
client, so each client's privacy loss is its own and grows only with the rounds it takes part in. This base
keeps the two things they have in common:

- **Secret noise streams.** As in :class:`~fedlight.strategies.dp.DPFedAvg`, whoever can regenerate the noise
  can subtract it, so a fresh run draws a 128-bit secret from the operating system (rank 0's ``secrets``,
  shared with the other processes) and client k's noise of round t is drawn from the seed
  ``SeedSequence(secret, spawn_key=(t, k))`` gives. The secret lives only in the strategy's state, hence in the
  checkpoint, so a resumed run draws the same noise. ``insecure_seeded_noise`` derives the seed from the
  client's own stream of the run's seed instead (child ``noise_stream`` of ``context.client_seed(t, k)``), for
  simulations that must be reproducible from their configuration alone; ε then describes the mechanism, not a
  protection against anyone who has the configuration.
- **A per-client ledger.** Each process notes what the clients it hosts released in the round (a round for
  LocalDP, a number of noisy steps for DPSGD), when their local fit ends; one gather at the round's end gives
  every process the same counts, so a client counts from the moment its noisy state exists, whether or not the
  engine aggregates it (a state left out as outsized was still seen by the server). Per client, the cumulative
  count and ε(δ) are part of the strategy's state, so a resumed run reports what a straight one would. Each
  round logs ``<prefix>/epsilon_max``, ``<prefix>/epsilon_mean`` (over the clients that have released
  something) and ``<prefix>/epsilon_per_client`` (all N clients, 0 for those that never trained; a histogram
  and a table in W&B).
"""

from __future__ import annotations

import secrets
import warnings
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.wrapper import RuleWrapper

if TYPE_CHECKING:
    from fedlight.context import RunContext

Accountant = Literal["rdp", "pld"]


class ClientPrivacy(RuleWrapper):
    """A rule whose clients add noise of their own; subclasses say what a client releases and what it costs.

    Args:
        rule: the wrapped rule.
        delta: δ of every reported ε(δ).
        accountant: ``rdp`` (Rényi DP) or ``pld`` (privacy loss distributions) of ``dp-accounting``.
        insecure_seeded_noise: draw the noise from ``--seed_everything`` rather than from a secret (simulation only).
    """

    #: the metrics' prefix, e.g. ``local_dp``
    metric_prefix: str = ""
    #: the child of a client's round stream that seeds its noise with ``insecure_seeded_noise``
    noise_stream: int = 0

    def __init__(self, rule: Strategy, delta: float, accountant: Accountant, insecure_seeded_noise: bool) -> None:
        super().__init__(rule)
        self.delta = delta
        self.accountant = accountant
        self.insecure_seeded_noise = insecure_seeded_noise
        self._secret: int | None = None  # of the noise seeds; the checkpoint's only, never logged
        self.counts: torch.Tensor | None = None  # [N] int64: what each client has released so far
        self.epsilons: torch.Tensor | None = None  # [N] fp64: each client's ε(δ) after it
        self._released: dict[int, int] = {}  # this process's clients of the round in progress

    def client_epsilon(self, client: int, count: int) -> float:
        """ε(δ) of client ``client`` after it released ``count`` (rounds, noisy steps) in all."""
        raise NotImplementedError(f"{type(self).__name__} does not account its clients' privacy")

    def adds_noise(self) -> bool:
        """Whether the settings add any noise (the warning about seeded noise is moot without)."""
        return True

    # -- round ----------------------------------------------------------------------------------------
    def on_fit_start(self, context: RunContext) -> None:
        self.rule.on_fit_start(context)
        num_clients = context.datamodule.num_clients
        if self.counts is None:  # a resumed run has its checkpoint's
            self.counts = torch.zeros(num_clients, dtype=torch.int64)
            self.epsilons = torch.zeros(num_clients, dtype=torch.float64)
        assert len(self.counts) == num_clients, f"the checkpoint accounts {len(self.counts)} clients, not {num_clients}"
        if not self.insecure_seeded_noise and self._secret is None:
            self._secret = context.all_gather_objects(secrets.randbits(128) if context.rank == 0 else None)[0]
        if self.insecure_seeded_noise and self.adds_noise() and context.rank == 0:
            warnings.warn(
                f"{type(self).__name__} draws its noise from --seed_everything (insecure_seeded_noise=true): whoever "
                "has this run's configuration can subtract the noise, so the reported ε protects nothing against "
                "them. Use it for simulations only.",
                stacklevel=2,
            )

    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        self.rule.on_round_start(context, round_idx, plans)
        self._released = {}

    def noise_generator(self, context: RunContext, client: int) -> torch.Generator:
        """A CPU generator of client ``client``'s noise in the round in progress, the same on every process:
        seeded from the secret, or with ``insecure_seeded_noise`` from the client's stream of the run's seed."""
        if self.insecure_seeded_noise:
            seed = context.client_seed(context.round, client)
            sequence = np.random.SeedSequence(seed, spawn_key=(self.noise_stream,))
        else:
            assert self._secret is not None, f"{type(self).__name__} drew no secret: on_fit_start did not run"
            sequence = np.random.SeedSequence(self._secret, spawn_key=(context.round, client))
        return torch.Generator().manual_seed(int(sequence.generate_state(1, np.uint64)[0]))

    def release(self, client: int, count: int) -> None:
        """Notes that client ``client`` released ``count`` more (its noisy update, its noisy steps) this round."""
        self._released[client] = self._released.get(client, 0) + count

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The rule's metrics and the clients' ε(δ), after adding every process's releases of the round."""
        metrics = dict(self.rule.on_round_end(context, round_idx, updates))
        assert self.counts is not None and self.epsilons is not None, "on_fit_start did not run"
        for released in context.all_gather_objects(self._released):
            for client, count in released.items():
                self.counts[client] += count
                self.epsilons[client] = self.client_epsilon(client, int(self.counts[client]))
        self._released = {}
        taken_part = self.epsilons[self.counts > 0]
        prefix = self.metric_prefix
        metrics[f"{prefix}/epsilon_max"] = float(taken_part.max()) if len(taken_part) else 0.0
        metrics[f"{prefix}/epsilon_mean"] = float(taken_part.mean()) if len(taken_part) else 0.0
        metrics[f"{prefix}/epsilon_per_client"] = self.epsilons.float().clone()
        return metrics

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rule's state, each client's count and ε(δ), and the noise's secret."""
        return {**super().state_dict(), "counts": self.counts, "epsilons": self.epsilons, "noise_secret": self._secret}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("counts") is not None:
            self.counts = state["counts"].clone()
            self.epsilons = state["epsilons"].clone()
        self._secret = state.get("noise_secret", self._secret)
