"""FedFomo: Zhang, Sapra, Fidler, Yeung & Alvarez, *Personalized Federated Learning with First Order Model
Optimization*, ICLR 2021 (arXiv 2012.08565), Eqs. 4–6 and Algorithm 1.

There is no global model: every client i keeps a model θ_i of its own, and the server keeps every client's latest
one. At the start of a round, each of the round's clients receives the models of M other clients and moves its own
towards those that lower its loss on a local validation split, by how much each lowers it per unit of distance:

    w_n = max(0, (L_i(θ_i) − L_i(θ_n)) / ‖θ_n − θ_i‖),   w_n ← w_n / Σ_m w_m          (Eqs. 5–6)
    θ_i ← θ_i + Σ_n w_n (θ_n − θ_i)                                                   (Eq. 4)

and keeps θ_i when no received model beats it; it then trains θ_i locally and the server stores the result. The
server picks the M models from an affinity vector P_i that accumulates the weights client i gave (P_in += w_n):
for each of the M slots, with probability ε_t a client drawn uniformly from those not yet chosen, otherwise the one
of highest affinity (Algorithm 1), with ε_t = max(0, ε − t·decay) in round t (from 0). Only clients whose model the
server holds (those that have trained) are offered, never i itself; with fewer than M of them, all are sent.

Here θ_i is a local slot over every entry (:mod:`fedlight.client_state`), so the engine starts client i from it
and scores it on the client's held-out split (``clients/personal/*``); a client that has not trained holds the
common initialisation W^0, and the server's W^t stays W^0 (its ``test/*`` scores are the untrained model's, as
Local-only's). A client's fit cannot read another client's slot, so the rule also keeps a copy of every client's
latest θ (sent in the client's payload, so that every process has it) and checkpoints it with P. The loss L_i is the
mean task loss of ``training_step`` in eval mode over a fixed random ``val_fraction`` of the client's training
split; the distance is the L2 norm over the parameters, and the step of Eq. 4 moves every floating-point entry
(BatchNorm statistics too). Client i's draws in round t come from the run's strategy stream of round t alone, so
the same seed sends the same models. A received model equal to θ_i gets w_n = 0. Greedy picks among equal
affinities take the lower client index, so ε = 0 is deterministic.

Where the authors' code (``NVlabs/FedFomo``) differs: its default M is 8 (the paper's experiments use M = 5, ours);
the distance is the L1 norm; the candidates include the client's own latest model, weighed against the model it
started its last local training from; the affinities add the signed ratios of Eq. 5 divided by |Σ_n|, with 0.1 on
the client itself at the start; ties are broken at random; only the models uploaded in the previous round are offered;
and each client's data is split 60/20/20 into training, validation and test, the validation part never trained on.
Here the validation sample is also trained on, since a rule cannot withhold part of a client's training split from
the engine's local fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.strategies.base import Strategy

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate

_VALIDATION_STREAM = 7  # the clients' validation samples, apart from every other stream of the data seed


def fomo_weights(own_loss: float, losses: Sequence[float], distances: Sequence[float]) -> list[float]:
    """The normalised weights of Eqs. 5–6: each model's loss improvement over the own model per unit of distance,
    negative ones (and those of a model at distance 0) set to 0, the rest scaled to sum to 1 (all 0 if none is
    positive).

    >>> fomo_weights(2.0, [0.5, 0.0, 3.0], [1.0, 2.0, 1.0])
    [0.6, 0.4, 0.0]
    >>> fomo_weights(1.0, [1.5, 1.0], [1.0, 0.0])
    [0.0, 0.0]
    """
    pairs = zip(losses, distances, strict=True)
    raw = [max(0.0, (own_loss - loss) / distance) if distance > 0 else 0.0 for loss, distance in pairs]
    total = sum(raw)
    return [w / total if total > 0 else 0.0 for w in raw]


def first_order_update(own: torch.Tensor, received: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """θ_i + Σ_n w_n (θ_n − θ_i) (Eq. 4), in fp64, returned in ``own``'s dtype.

    >>> first_order_update(torch.tensor([2.0]), [torch.tensor([3.0]), torch.tensor([4.0])], [0.75, 0.25]).tolist()
    [3.25]
    """
    base = own.double()
    step = torch.zeros_like(base)
    for model, weight in zip(received, weights, strict=True):
        if weight > 0:
            step += weight * (model.to(base) - base)
    return (base + step).to(own.dtype)


def choose_models(
    affinity: Sequence[float], candidates: Sequence[int], num_models: int, epsilon: float, rng: np.random.Generator
) -> list[int]:
    """The ε-greedy draw of Algorithm 1: ``num_models`` of ``candidates`` (all when fewer), each with probability
    ``epsilon`` drawn uniformly from those left, else the one of highest ``affinity`` left (lower index on ties).

    >>> choose_models([0.0, 0.5, 0.0, 0.9], [0, 1, 2, 3], 3, 0.0, np.random.default_rng(0))
    [3, 1, 0]
    """
    left = sorted(candidates)
    greedy = sorted(left, key=lambda n: (-affinity[n], n))
    chosen = []
    for _ in range(min(num_models, len(left))):
        if rng.random() < epsilon:
            pick = left[int(rng.integers(len(left)))]
        else:
            pick = next(n for n in greedy if n in left)
        left.remove(pick)
        chosen.append(pick)
    return chosen


class FedFomo(Strategy):
    """Each client moves its own model towards the received models that lower its validation loss (Eq. 4).

    Args:
        num_models: M ≥ 1, the other clients' models each client receives per round (5 in the paper).
        epsilon: ε ∈ [0, 1], the probability of a random pick per slot instead of the highest affinity (0.3).
        epsilon_decay: ≥ 0, subtracted from ε after every round (0.05, as the authors' code).
        val_fraction: ∈ (0, 1], the share of each client's training samples its losses L_i are read on (0.2).
        tolerate_stragglers: a straggler's partial work is its own model all the same; ``null`` drops it.
        sampling: how the round's clients are drawn: ``null`` is ``uniform``, as the authors' code.
    """

    personalised = True
    default_sampling = "uniform"

    def __init__(
        self,
        num_models: int = 5,
        epsilon: float = 0.3,
        epsilon_decay: float = 0.05,
        val_fraction: float = 0.2,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not num_models >= 1:
            problems.append(f"Expected --strategy.init_args.num_models (M) ≥ 1, got {num_models}; the paper sends 5.")
        if not 0 <= epsilon <= 1:
            problems.append(f"Expected --strategy.init_args.epsilon (ε) in [0, 1], got {epsilon}; the paper uses 0.3.")
        if not epsilon_decay >= 0:
            problems.append(
                f"Expected --strategy.init_args.epsilon_decay ≥ 0, got {epsilon_decay}; 0 keeps ε, 0.05 is the code's."
            )
        if not 0 < val_fraction <= 1:
            problems.append(
                f"Expected --strategy.init_args.val_fraction in (0, 1], got {val_fraction}: the share of a client's "
                "training samples its validation losses are read on (0.2)."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.num_models, self.epsilon, self.epsilon_decay = int(num_models), epsilon, epsilon_decay
        self.val_fraction = val_fraction
        self.models: dict[int, torch.Tensor] = {}  # θ_n [P] (CPU) of every client that has trained
        self.affinity: torch.Tensor | None = None  # P [K, K] fp64, row i client i's affinities
        self._is_parameter: torch.Tensor | None = None  # [P] bool, the entries the distance is taken over
        self._received: dict[int, list[int]] = {}  # the round's clients → the clients whose models they get
        self._weights: list[float] = []  # w_n of the client in its fit

    def on_fit_start(self, context: RunContext) -> None:
        self._is_parameter = context.layout.parameter_mask(context.module)
        if self.affinity is None:  # a resumed run has it from its checkpoint
            num_clients = context.datamodule.num_clients
            self.affinity = torch.zeros(num_clients, num_clients, dtype=torch.float64)

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return {"own": Slot.local(torch.ones(context.layout.numel, dtype=torch.bool))}  # θ_i: every entry

    def epsilon_at(self, round_idx: int) -> float:
        """ε_t = max(0, ε − t·decay)."""
        return max(0.0, self.epsilon - round_idx * self.epsilon_decay)

    # -- server: which models each client receives -----------------------------------------------------------
    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        """Draws each client's M models by ε-greedy over its affinities (the same on every process)."""
        assert self.affinity is not None, "FedFomo.on_round_start ran before on_fit_start"
        seeds = context.strategy_rng(round_idx).integers(2**62, size=len(self.affinity))  # one stream per client
        held, epsilon = sorted(self.models), self.epsilon_at(round_idx)
        self._received = {}
        for plan in plans:
            if plan.dropped:
                continue
            i, rng = plan.client, np.random.default_rng(int(seeds[plan.client]))
            others = [n for n in held if n != i]
            self._received[i] = choose_models(self.affinity[i].tolist(), others, self.num_models, epsilon, rng)

    # -- client: the first-order step, then local training ---------------------------------------------------
    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        """Replaces θ_i in ``module`` by Eq. 4's step towards the received models that beat it."""
        received = self._received.get(plan.client, [])
        self._weights = []
        if not received:
            return
        layout, device = context.layout, context.device
        own = layout.flatten(module)  # θ_i [P]
        models = [self.models[n].to(device) for n in received]  # θ_n [P] each
        batches = self._validation_batches(context, plan.client)
        modes = {child: child.training for child in module.modules()}
        module.eval()
        try:
            own_loss = self._loss(context, module, batches)
            losses = []
            for model in models:
                layout.load(module, model)
                losses.append(self._loss(context, module, batches))
        finally:
            for child, training in modes.items():
                child.train(training)
        mask = self._is_parameter.to(device)
        distances = [float((model - own)[mask].double().norm()) for model in models]
        self._weights = fomo_weights(own_loss, losses, distances)
        layout.load(module, first_order_update(own, models, self._weights))

    def _validation_batches(self, context: RunContext, client: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The client's validation sample: a fixed random ``val_fraction`` of its training split, drawn from the data
        seed and the client, in the split's evaluation batches."""
        data = context.datamodule
        size = int(data.num_samples[client])
        rng = np.random.default_rng(np.random.SeedSequence(data.seed, spawn_key=(_VALIDATION_STREAM, client)))
        chosen = np.zeros(size, dtype=bool)
        chosen[rng.choice(size, max(1, int(self.val_fraction * size)), replace=False)] = True
        batches, start = [], 0
        for x, y in data.client_batches(client, "train"):
            keep = torch.from_numpy(chosen[start : start + len(y)]).to(y.device)
            start += len(y)
            if keep.any():
                batches.append((x[keep], y[keep]))
        return batches

    @torch.no_grad()
    def _loss(self, context: RunContext, module: LightningModule, batches: list[Any]) -> float:
        """L_i: the mean task loss of ``module`` over the validation batches, by sample."""
        precision, total, count = context.precision, 0.0, 0
        for index, batch in enumerate(batches):
            batch = precision.convert_input(batch)
            with precision.forward_context():
                loss = module.training_step(batch, index)["loss"]
            total += float(loss) * len(batch[1])
            count += len(batch[1])
        return total / count

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Sends the trained θ_i for the server to keep, and the clients and weights w_n of the step."""
        update.payload.update(
            model=context.layout.flatten(module).cpu(),
            fomo_received=list(self._received.get(update.client, [])),
            fomo_weights=list(self._weights),
        )
        self._weights = []

    # -- server: keep the models and the affinities ---------------------------------------------------------
    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """W^{t+1} = W^t = W^0: the clients' own models are kept apart, not combined."""
        return global_state

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """Stores each client's trained θ_i and adds its weights to its affinities (P_in += w_n)."""
        assert self.affinity is not None, "FedFomo.on_round_end ran before on_fit_start"
        kept = 0
        for update in updates:
            payload = update.payload
            self.models[update.client] = payload["model"]
            for n, weight in zip(payload["fomo_received"], payload["fomo_weights"], strict=True):
                self.affinity[update.client, n] += weight
            kept += bool(payload["fomo_received"]) and not any(w > 0 for w in payload["fomo_weights"])
        federated = sum(bool(u.payload["fomo_received"]) for u in updates)
        metrics = {"fedfomo/epsilon": self.epsilon_at(round_idx)}
        if federated:
            metrics["fedfomo/kept_own"] = kept / federated  # clients none of whose received models beat their own
        return metrics

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every trained client's latest θ and the affinities P (nothing before the first round)."""
        if self.affinity is None:
            return {}
        return {
            "affinity": self.affinity.clone(),
            "models": {client: model.clone() for client, model in self.models.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        affinity = state.get("affinity")
        self.affinity = None if affinity is None else affinity.clone()
        self.models = {int(client): model.clone() for client, model in state.get("models", {}).items()}
