"""Fairness: the uniform-averaging baseline of Michieli & Ozay, *Prototype Guided Federated Learning of
Visual Feature Representations* (Table 3; decision D8).

Every aggregated client gets the same weight, f^t[k] = 1/K' for all k and t:

    W^{t+1} = (1/K') Σ_{k∈K^t} W_k^{t+1},

with K' the number of clients aggregated in round t. Table 3's rows map to the options: "Fairness"
samples clients ∝ n_k and drops stragglers (the defaults), "Fairness sampling i.i.d." is
``sampling="uniform"``, "Fairness + toleration" is ``tolerate_stragglers=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedlight.plans import ClientUpdate
from fedlight.strategies.fedavg import FedAvg


class Fairness(FedAvg):
    """FedAvg with every client's weight 1 instead of n_k; the trainer normalises them to 1/K'."""

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        return (1.0,) * self.weight_channels
