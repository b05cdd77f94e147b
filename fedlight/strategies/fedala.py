"""FedALA: Zhang, Hua, Wang, Song, Xue, Ma & Guan, *FedALA: Adaptive Local Aggregation for Personalized Federated
Learning*, AAAI 2023 (arXiv 2212.01197), Algorithm 1 and Eqs. 3–6.

The server is FedAvg's. What changes is where a client starts: instead of overwriting its previous local model θ_k
with the global model Θ, it mixes the two element-wise with weights W_k ∈ [0, 1] that it learns on its own data
(Adaptive Local Aggregation, ALA):

    θ̂_k = θ_k + (Θ − θ_k) ⊙ W_k                                      (Eqs. 3–4)

on the top ``layer_idx`` = p layers, while the lower layers take Θ as is (W = 1 there). W_k starts at 1 and is
trained on a random s% of the client's training set (``rand_percent``), one SGD step per batch of the client's
batch size, each followed by a clip to [0, 1]:

    W_k ← clip(W_k − η ∇_{W_k} L(θ̂_k), 0, 1),   ∇_{W_k} L = ∇_θ̂ L ⊙ (Θ − θ_k)   (Eq. 5)

In a client's first ALA (the paper's start phase, its second iteration) W_k is trained until it converges: epochs
over the sample repeat until the standard deviation of the last ``loss_window`` epochs' losses falls below
``threshold``; in later rounds it takes one epoch from the W_k it kept. The client then trains θ̂_k as usual
(Eq. 6), and its trained model is both what it sends to the server and its next θ_k.

Per-client state: θ_k, W_k and where the client stands (no local model yet; a model but W_k not learned; W_k
learned). A client that has never trained holds the initial model Θ^0 (in the authors' code every client's model
starts as a copy of it), so its first ALA is a no-op in round 1 (θ_k = Θ) and a start phase later on; ALA is
skipped whenever Θ = θ_k on the top layers, where θ̂_k = Θ whatever W_k. Each client is scored with its own θ_k
(``clients/personal/*``).

Choices where the paper is silent or the authors' code (``TsingZ0/FedALA``, ``utils/ALA.py``) differs:

- p counts layers (modules that own parameters, a BatchNorm among them), as the paper; the code's ``layer_idx``
  counts parameter tensors (its default 2 is the paper's p = 1 on a linear head);
- ALA runs for the round's clients only, as Algorithm 1; the code runs it on every client every round;
- the s% sample is drawn at random each round from the client's stream; the code takes a contiguous slice at a
  random offset. W is learned in train mode; buffers (BatchNorm statistics) take Θ's values, as lower layers do
  (the code keeps the local model's buffers);
- convergence is read on each epoch's mean loss (the code's window of 10 losses, each its epoch's last batch's);
  the threshold 0.01 is the paper's. ``max_start_epochs`` caps the start phase (ours: the code has no cap, and its
  README warns that a small threshold may never be reached); the threshold is read on the population standard
  deviation, as ``np.std``;
- a client is scored with θ_k, its trained model; the code scores the next round's ALA result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate

_ALA_STREAM = 3  # the s% sample, apart from the local fit's stream of the same client and round
# where a client stands, the "phase" slot
_NO_MODEL, _WEIGHTS_UNTRAINED, _WEIGHTS_TRAINED = 0.0, 1.0, 2.0


def local_aggregation(local: torch.Tensor, received: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """θ̂ = θ + (Θ − θ) ⊙ W (Eq. 4): W = 1 takes the global model, W = 0 keeps the local one.

    >>> local_aggregation(torch.tensor([0.0, 2.0]), torch.tensor([4.0, 4.0]), torch.tensor([0.25, 1.0])).tolist()
    [1.0, 4.0]
    """
    return local + (received - local) * weights


def weight_step(weights: torch.Tensor, grad: torch.Tensor, gap: torch.Tensor, eta: float) -> torch.Tensor:
    """One step of Eq. 5 and the clip: clip(W − η ∇_θ̂L ⊙ (Θ − θ), 0, 1).

    >>> weights, grad = torch.tensor([1.0, 0.5, 0.5]), torch.tensor([2.0, -1.0, 8.0])
    >>> weight_step(weights, grad, torch.tensor([0.125, 0.25, 0.25]), eta=1.0).tolist()
    [0.75, 0.75, 0.0]
    """
    return (weights - eta * grad * gap).clamp(0.0, 1.0)


def parameter_layers(module: nn.Module, layout: FlatState) -> list[list[str]]:
    """The federated trainable parameters grouped by the module that owns them (a layer), in state-dict order."""
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    layers: dict[str, list[str]] = {}
    for name in layout.names:
        if name in trainable:
            layers.setdefault(name.rpartition(".")[0], []).append(name)
    return list(layers.values())


class FedALA(FedAvg):
    """FedAvg whose clients start from an adaptive, element-wise mix of their previous model and the global one.

    Args:
        layer_idx: p ≥ 1, how many top layers ALA mixes (the paper's default is 1: the classifier); the layers below
            take the global model as is.
        rand_percent: s ∈ (0, 100], the percentage of the client's training samples W_k is learned on (80).
        eta: η > 0, the learning rate of W_k (1.0 in the paper).
        threshold: the start phase ends once the standard deviation of the last ``loss_window`` epoch losses is
            below it (0.01 in the paper); 0 runs ``max_start_epochs`` epochs.
        loss_window: how many epoch losses the convergence test reads (10, the authors' code).
        max_start_epochs: the most epochs of the start phase (our cap; the paper has none).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as the paper's join ratio.
    """

    personalised = True
    default_sampling = "uniform"

    def __init__(
        self,
        layer_idx: int = 1,
        rand_percent: float = 80.0,
        eta: float = 1.0,
        threshold: float = 0.01,
        loss_window: int = 10,
        max_start_epochs: int = 100,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not layer_idx >= 1:
            problems.append(f"Expected --strategy.init_args.layer_idx (p) ≥ 1, got {layer_idx}; the paper uses 1.")
        if not 0 < rand_percent <= 100:
            problems.append(
                f"Expected --strategy.init_args.rand_percent (s) in (0, 100], got {rand_percent}; the paper uses 80."
            )
        if not eta > 0:
            problems.append(f"Expected --strategy.init_args.eta (η) > 0, got {eta}; the paper uses 1.0.")
        if not threshold >= 0:
            problems.append(f"Expected --strategy.init_args.threshold ≥ 0, got {threshold}; the paper uses 0.01.")
        if not loss_window >= 2:
            problems.append(
                f"Expected --strategy.init_args.loss_window ≥ 2, got {loss_window}; a standard deviation needs two "
                "losses (the authors' code reads 10)."
            )
        if not max_start_epochs >= 1:
            problems.append(f"Expected --strategy.init_args.max_start_epochs ≥ 1, got {max_start_epochs}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.layer_idx, self.rand_percent, self.eta = layer_idx, rand_percent, eta
        self.threshold, self.loss_window, self.max_start_epochs = threshold, loss_window, max_start_epochs
        self.initial: torch.Tensor | None = None  # Θ^0 [P] (CPU), the local model of a client that never trained
        self._names: list[str] = []  # the top p layers' parameters, in state-dict order
        self._mask: torch.Tensor | None = None  # [P] bool, their entries
        self._epochs = 0  # ALA epochs of the client in its fit

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        layers = parameter_layers(module, FlatState(module, getattr(module, "frozen_modules", ())))
        if self.layer_idx <= len(layers):
            return []
        return [
            f"FedALA mixes the top --strategy.init_args.layer_idx={self.layer_idx} layers, but "
            f"{type(module).__name__} has {len(layers)} layers with federated parameters. Choose 1 to {len(layers)}."
        ]

    def on_fit_start(self, context: RunContext) -> None:
        layers = parameter_layers(context.module, context.layout)
        chosen = {name for layer in layers[-self.layer_idx :] for name in layer}
        self._names = [name for name in context.layout.names if name in chosen]  # the order of their entries
        self._mask = context.layout.mask(self._names)
        if self.initial is None:  # a resumed run has it from its checkpoint
            self.initial = context.global_state.detach().cpu().clone()

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return {
            "local": Slot.vector(context.layout.numel),  # θ_k, once the client has trained
            "weights": Slot.vector(int(self._mask.sum())),  # W_k on the top p layers, once learned
            "phase": Slot.vector(1),  # _NO_MODEL, _WEIGHTS_UNTRAINED or _WEIGHTS_TRAINED
        }

    def personal_state(
        self, context: RunContext, client: int, values: Mapping[str, torch.Tensor], start: torch.Tensor
    ) -> torch.Tensor:
        return self._local_model(values, start)

    def _local_model(self, values: Mapping[str, torch.Tensor], received: torch.Tensor) -> torch.Tensor:
        """θ_k: the client's last trained model, or Θ^0 before it has one."""
        if values["phase"].item() == _NO_MODEL:
            return self.initial.to(received.device)
        return values["local"]

    # -- client side -------------------------------------------------------------------------------
    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        """Replaces the received Θ in ``module`` by θ̂_k (Eq. 4), with W_k learned first (Eq. 5)."""
        own, layout = context.client_state, context.layout
        received = layout.flatten(module)  # Θ^{t−1} [P]
        mask = self._mask.to(received.device)
        local, received_top = self._local_model(own, received)[mask], received[mask]  # θ_k, Θ on the top layers [A]
        self._epochs = 0
        if torch.equal(local, received_top):  # θ̂_k = Θ whatever W_k: nothing to learn
            return
        phase = own["phase"].item()
        weights = own["weights"] if phase == _WEIGHTS_TRAINED else torch.ones_like(local)  # W_k, 1 at first
        params = dict(module.named_parameters())
        top = [params[name] for name in self._names]
        weights, self._epochs = self._learn_weights(
            context, module, top, self._sample(context, plan.client), local, received_top, weights,
            until_converged=phase != _WEIGHTS_TRAINED,
        )  # fmt: skip
        start = received.clone()
        start[mask] = local_aggregation(local, received_top, weights)
        layout.load(module, start)  # also Θ's buffers again, which the train-mode passes moved
        own["weights"] = weights
        own["phase"] = torch.full_like(own["phase"], _WEIGHTS_TRAINED)

    def _sample(self, context: RunContext, client: int) -> list[Any]:
        """A random s% of the client's training samples, in batches of its batch size (Algorithm 1, line 6)."""
        data = context.datamodule
        wanted = max(1, int(self.rand_percent * len(data.client_train[client]) / 100))
        seed = np.random.SeedSequence(context.client_seed(context.round, client), spawn_key=(_ALA_STREAM,))
        generator = torch.Generator().manual_seed(int(seed.generate_state(1, dtype=np.uint64)[0] >> 1))
        batches, taken = [], 0
        for batch in data.train_batches(client, generator):
            keep = min(len(batch[1]), wanted - taken)
            if keep < data.min_last_batch and batches:  # a remainder BatchNorm could not normalise
                break
            batches.append(tuple(part[:keep] for part in batch))
            taken += keep
            if taken >= wanted:
                break
        return batches

    def _learn_weights(
        self,
        context: RunContext,
        module: LightningModule,
        top: Sequence[nn.Parameter],
        batches: list[Any],
        local: torch.Tensor,
        received: torch.Tensor,
        weights: torch.Tensor,
        until_converged: bool,
    ) -> tuple[torch.Tensor, int]:
        """W_k after one epoch of Eq. 5 over ``batches``, or after the start phase's epochs; and the epochs run.

        ``top`` are the top layers' parameters, ``local`` and ``received`` θ_k and Θ on their entries ``[A]``.
        """
        precision, eta, gap = context.precision, self.eta, received - local  # Θ − θ_k
        _write(top, local_aggregation(local, received, weights))
        losses: list[float] = []
        for _ in range(self.max_start_epochs if until_converged else 1):
            total, count = 0.0, 0
            for index, batch in enumerate(batches):
                batch = precision.convert_input(batch)
                with precision.forward_context():
                    loss = module.training_step(batch, index)["loss"]
                grads = torch.autograd.grad(loss, top)  # ∇_θ̂ L on the top layers
                grad = torch.cat([g.detach().reshape(-1).float() for g in grads])  # [A]
                weights = weight_step(weights, grad, gap, eta)
                _write(top, local_aggregation(local, received, weights))
                total, count = total + float(loss.detach()) * len(batch[1]), count + len(batch[1])
            losses.append(total / count)
            window = losses[-self.loss_window :]
            if len(losses) > self.loss_window and float(np.std(window)) < self.threshold:
                break
        return weights, len(losses)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Keeps the trained model as θ_k for the next round and the personal score."""
        own = context.client_state
        own["local"] = context.layout.flatten(module)
        own["phase"] = own["phase"].clamp(min=_WEIGHTS_UNTRAINED)
        update.payload["ala_epochs"] = self._epochs
        if own["phase"].item() == _WEIGHTS_TRAINED:
            update.payload["ala_weight_mean"] = float(own["weights"].mean())

    # -- server side -------------------------------------------------------------------------------
    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """How long the round's clients learned W_k, and the mean weight they give the global model."""
        epochs = [u.payload["ala_epochs"] for u in updates if "ala_epochs" in u.payload]
        weights = [u.payload["ala_weight_mean"] for u in updates if "ala_weight_mean" in u.payload]
        metrics = {"fedala/epochs_mean": float(np.mean(epochs))} if epochs else {}
        if weights:
            metrics["fedala/weight_mean"] = float(np.mean(weights))
        return metrics

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Θ^0, the local model of the clients that have not trained yet (the rest is per-client state)."""
        return {} if self.initial is None else {"initial": self.initial.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        initial = state.get("initial")
        self.initial = None if initial is None else initial.clone()


@torch.no_grad()
def _write(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """Copies ``flat`` into ``params`` in place, in order (the optimizer keeps the same tensors)."""
    offset = 0
    for p in params:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
