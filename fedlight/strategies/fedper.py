"""FedPer: Arivazhagan, Aggarwal, Singh & Choudhary, *Federated Learning with Personalization Layers*,
arXiv 1912.00818, 2019.

The model is split into base layers, federated as in FedAvg, and personalisation layers that every client keeps
as its own (Sec. 3): client k trains base and head together from W^t's base with its own head, and only the base
is shared. The head is the classifier by default (``forward_head``'s layers). See
:mod:`~fedlight.strategies.personal_layers` for what the global model holds and how clients are evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from fedlight.strategies.personal_layers import PersonalLayers


class FedPer(PersonalLayers):
    """FedAvg whose clients keep the head's entries local.

    Args:
        head: the personalisation layers: ``classifier`` (the linear and convolutional layers under a submodule
            named ``classifier``, ``head``, ``decoder`` or ``segmentation_head``), another group of
            :func:`fedlight.bank.cluster_entry_names`, or glob patterns over the state-dict keys
            (``net.head.*``).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn: ``null`` is ``proportional`` to n_k, as FedAvg here.
    """

    def __init__(
        self,
        head: str | Sequence[str] = "classifier",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        super().__init__(head, "--strategy.init_args.head", tolerate_stragglers, sampling)
        self.head = head
