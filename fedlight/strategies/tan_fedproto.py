"""FedProto of Tan, Long, Liu, Zhou, Lu, Jiang & Zhang, *FedProto: Federated Prototype Learning across Heterogeneous
Clients*, AAAI 2022 (arXiv 2105.00243), Algorithm 1.

Not fedlight's :class:`~fedlight.strategies.fedproto.FedProto`, which is Michieli & Ozay's prototype-margin rule: that
one still averages the clients' models into one global model, with attention weights read off prototype margins.
Here no model is ever averaged: clients and server exchange class prototypes only, and every client keeps a model of
its own (per-client state; all start from W^0). With the global prototypes C̄ of the previous rounds, client k trains
its model on

    L_k = CE(F_k(x), y) + λ · (1/B) Σ_b ‖f_k(x_b) − C̄^{y_b}‖²

where f_k is the embedding its classifier reads (``forward_features``); a sample whose class has no global prototype
yet (every sample in the first round) adds no term. After its local fit it computes its local prototypes, the class
means of f_k over its training split with the trained model, C_k^j = (1/n_k^j) Σ_{y = j} f_k(x) (in eval mode), and
sends them with its class counts n_k^j. The server's global prototypes are their sample-weighted means over the
round's clients,

    C̄^j = Σ_k n_k^j C_k^j / Σ_k n_k^j,

and a class that none of the round's clients holds keeps its previous prototype. The engine's global model stays
W^0, so ``test/*`` and ``clients/*`` score the untrained initialisation; each client is scored with its own model
(``clients/personal/*``), the paper's evaluation.

Where the authors' code (``yuetan031/FedProto``, ``lib/update.py`` and ``lib/utils.py``) differs:

- its regulariser is ``nn.MSELoss``, the squared distance averaged over the D embedding dimensions as well:
  ``distance: mse`` (the paper's λ values were tuned with it); the default is the squared Euclidean distance above;
- it averages the clients' prototypes of a class without weights; here they weigh by the clients' class counts;
- its local prototypes are the embeddings of the last local epoch's batches, taken while the model still trains;
  here one pass with the trained model;
- its clients may run different architectures (the paper's model heterogeneity); fedlight's clients share one.

Nearest-prototype classification, the paper's other inference, is not scored: the personal evaluation reads the
client's classifier.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.metrics.functional.prototypes import aggregate_prototypes, prototypes_from_sums
from fedlight.passes import class_feature_batches
from fedlight.plans import ClientUpdate
from fedlight.strategies.base import Strategy, traceable_loss

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan


def prototype_distance(
    features: Tensor, labels: Tensor, prototypes: Tensor, known: Tensor, distance: Literal["squared_l2", "mse"]
) -> Tensor:
    """(1/B) Σ_b d(f_b, C̄^{y_b}) over the samples whose class has a prototype (the others add 0).

    Args:
        features: ``[B, D]`` embeddings f(x_b).
        labels: ``[B]`` their classes y_b.
        prototypes: ``[C, D]`` global prototypes C̄.
        known: ``[C]`` bool, the classes that have one.
        distance: ``squared_l2``, ‖f − C̄‖²; ``mse``, the same divided by D.

    >>> features, labels = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]]), torch.tensor([0, 1, 2])
    >>> prototypes, known = torch.tensor([[0.0, 0.0], [0.0, 1.0], [9.0, 9.0]]), torch.tensor([True, True, False])
    >>> prototype_distance(features, labels, prototypes, known, "squared_l2").item()  # (1 + 1 + 0) / 3
    0.6666666865348816
    """
    squares = (features - prototypes[labels].to(features.dtype)).square()  # [B, D]
    per_sample = squares.sum(dim=1) if distance == "squared_l2" else squares.mean(dim=1)  # [B]
    return (per_sample * known[labels]).mean()


class TanFedProto(Strategy):
    """Clients keep their own models and learn towards the global class prototypes; no model is averaged.

    Args:
        lam: λ ≥ 0, the weight of the prototype distance (1 in the authors' code, with ``distance: mse``); 0 trains
            every client on its own data alone.
        distance: ``squared_l2``, ‖f(x) − C̄^y‖²; ``mse``, the same averaged over the embedding's D dimensions, as
            the authors' code.
        tolerate_stragglers: let stragglers train their partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``.
    """

    personalised = True
    default_sampling = "uniform"

    def __init__(
        self,
        lam: float = 1.0,
        distance: Literal["squared_l2", "mse"] = "squared_l2",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not lam >= 0:
            problems.append(f"Expected --strategy.init_args.lam (λ) ≥ 0, got {lam}; the authors' code uses 1.")
        if distance not in ("squared_l2", "mse"):
            problems.append(f"Expected --strategy.init_args.distance to be 'squared_l2' or 'mse', got {distance!r}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.lam, self.distance = lam, distance
        self.prototypes: Tensor | None = None  # C̄ [C, D] (CPU); None until a round has ended
        self.known: Tensor | None = None  # [C] bool: the classes C̄ holds
        self._targets: tuple[Tensor, Tensor] | None = None  # C̄ and its mask on the device, during a client's fit

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        net = getattr(module, "net", None)
        if net is not None and hasattr(net, "forward_features") and hasattr(net, "forward_head"):
            return []
        return [
            "--strategy TanFedProto learns towards class prototypes of the embedding the classifier reads "
            f"(module.net.forward_features, then forward_head), but --model {type(module).__name__} has "
            f"{'a net ' + type(net).__name__ + ' without them' if net is not None else 'no net'}. Use "
            "fedlight.clients.ClassificationClient with a registered network."
        ]

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return {"own": Slot.local(torch.ones(context.layout.numel, dtype=torch.bool))}  # the client's whole model

    # -- client side -------------------------------------------------------------------------------
    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        if self.prototypes is not None and self.lam > 0:
            self._targets = (self.prototypes.to(context.device), self.known.to(context.device))

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, Tensor]) -> Tensor:
        if self._targets is None:  # no global prototype yet, or λ = 0
            return outputs["loss"]
        if "features" not in outputs:
            raise ConfigError(
                f"TanFedProto needs the embedding of each batch, but {type(module).__name__}.training_step returns "
                f"only {sorted(outputs)}. Use a client whose training_step returns 'features' (ClassificationClient)."
            )
        prototypes, known = self._targets
        return outputs["loss"] + self.lam * prototype_distance(
            outputs["features"], batch[1], prototypes, known, self.distance
        )

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Sends the client's local prototypes C_k [C, D] and class counts n_k [C]."""
        self._targets = None
        was_training = module.training
        module.eval()
        sums, counts = None, None
        for batch_sums, batch_counts in class_feature_batches(context, module, update.client):
            sums = batch_sums if sums is None else sums + batch_sums
            counts = batch_counts if counts is None else counts + batch_counts
        module.train(was_training)
        assert sums is not None, f"client {update.client} has no training samples"
        update.payload.update(prototypes=prototypes_from_sums(sums, counts).float().cpu(), counts=counts.cpu())

    # -- server side -------------------------------------------------------------------------------
    def server_update(self, global_state: Tensor, aggregate: Tensor, updates: list[ClientUpdate]) -> Tensor:
        """W^{t+1} = W^t = W^0: models are not exchanged."""
        return global_state

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """C̄^j = Σ_k n_k^j C_k^j / Σ_k n_k^j over the round's clients; classes none of them holds keep theirs."""
        if not updates:
            return {}
        prototypes = torch.stack([u.payload["prototypes"] for u in updates])  # [K, C, D]
        counts = torch.stack([u.payload["counts"] for u in updates])  # [K, C]
        aggregate, _, self.known = aggregate_prototypes(prototypes, counts, self.prototypes, self.known)
        self.prototypes = aggregate.float()
        return {"tan_fedproto/classes_with_prototype": float(self.known.sum())}

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The global prototypes and the classes they hold, once a round has ended."""
        if self.prototypes is None:
            return {}
        return {"prototypes": self.prototypes.clone(), "known": self.known.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "prototypes" in state:
            self.prototypes, self.known = state["prototypes"].clone(), state["known"].clone()
        else:
            self.prototypes, self.known = None, None
