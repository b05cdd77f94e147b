"""Local-only training: every client trains a model of its own and nothing is aggregated.

The lower reference of federated papers, e.g. the "Local-Only" row of FUSS's Table 4 (Charalambous et al.,
*Federated Unsupervised Semantic Segmentation*): client k starts from the common initialisation W^0 and, in every
round, continues from its own model θ_k, trained on its own data only. The server never aggregates: W^t stays W^0,
so the global model's scores (``test/*``, ``clients/*``) are those of the untrained initialisation. The result of
the row is the clients' own models:

- ``test/personal/<metric>``: each θ_k scored on the whole global test set, a metric of its own per client (for
  unsupervised segmentation, its own Hungarian match), then the unweighted mean over the clients, (1/K) Σ_k s(θ_k);
  FUSS's released code logs this mean of the clients' validation scores after every local fit;
- ``clients/personal/<metric>``: each θ_k on its own held-out split, when clients hold data out.

Every federated entry is a local slot of the client (:mod:`fedlight.client_state`), so θ_k is kept, checkpointed
and resumed as FedPer's head is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch

from fedlight.client_state import Slot
from fedlight.plans import ClientUpdate
from fedlight.strategies.base import Strategy

if TYPE_CHECKING:
    from fedlight.context import RunContext


class LocalOnly(Strategy):
    """Each client keeps its whole model; the server keeps W^0.

    Args:
        tolerate_stragglers: a straggler's partial work stays its own; ``null`` keeps it.
        sampling: how the round's clients are drawn when fewer than all train; ``null`` is ``uniform``.
    """

    personalised = True
    personal_test = True
    default_tolerate_stragglers = True
    default_sampling = "uniform"

    def __init__(
        self,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return {"own": Slot.local(torch.ones(context.layout.numel, dtype=torch.bool))}  # θ_k: every entry

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """W^{t+1} = W^t = W^0: the clients' states are not combined."""
        return global_state
