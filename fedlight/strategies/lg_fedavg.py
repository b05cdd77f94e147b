"""LG-FedAvg: Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov & Morency, *Think Locally, Act Globally:
Federated Learning with Local and Global Representations*, arXiv 2001.01523, 2020.

Each client m keeps local layers ℓ_m that turn its inputs into a representation, and only the global layers g
that operate on that representation are federated (Algorithm 1): client m trains ℓ_m and g jointly on its
own data, from its own ℓ_m and W^t's g, and the server averages the round's g_m (by n_k, as FedAvg). This is
FedPer's mirror: there the head is local and the body shared, here the body is local and the head (by default)
global.

The local layers are per-client state (see :mod:`~fedlight.strategies.personal_layers`). Unlike FedPer's, the
global model never averages them: its local entries keep their initial values, so a client that has not trained
yet starts from W^0's body, as every device's local model starts from the one initialisation in Algorithm 1.
``clients/*`` and ``test/*`` therefore score W^0's body under the federated head (what a newly arriving device
starts from), and ``clients/personal/*`` scores each client's own model (the paper's local test accuracy).

The paper's released code differs: it starts from a FedAvg-trained model (``--trainer.init_from`` does that
here), averages the global layers without weights, and lists its CIFAR-10 CNN's layers so that its two global
layers are the convolutions. Here the top layers are global, as the paper describes, with FedAvg's n_k weights.
The paper's auxiliary unsupervised and fairness objectives for the local representations are not implemented:
the local and global layers minimise the task loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.bank import GROUPS, cluster_entry_names
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies.personal_layers import PersonalLayers

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientUpdate


class LGFedAvg(PersonalLayers):
    """FedAvg of the global layers only; every client keeps every other entry (its local representation).

    Args:
        global_layers: the layers g the server federates: ``classifier`` (the linear and convolutional layers
            under a submodule named ``classifier``, ``head``, ``decoder`` or ``segmentation_head``), another group
            of :func:`fedlight.bank.cluster_entry_names`, or glob patterns over the state-dict keys
            (``net.head.*``). Every other federated entry is local.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn: ``null`` is ``proportional`` to n_k, as FedAvg here.
    """

    def __init__(
        self,
        global_layers: str | Sequence[str] = "classifier",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        super().__init__(global_layers, "--strategy.init_args.global_layers", tolerate_stragglers, sampling)
        self.global_layers = global_layers
        self._local: torch.Tensor | None = None  # [P] bool, the entries of ℓ_m

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        layout = FlatState(module, getattr(module, "frozen_modules", ()))
        try:
            shared = cluster_entry_names(module, layout, self.groups)
        except ConfigError:
            shared = []
        if shared and len(shared) < len(layout.names):
            return []
        found = "none" if not shared else "every one"
        return [
            f"LGFedAvg federates the entries of {self.groups} (--strategy.init_args.global_layers) and keeps the "
            f"rest local, but they match {found} of {type(module).__name__}'s federated entries: name the top "
            f"layers, some but not all, with {', '.join(GROUPS)} or glob patterns over its state-dict keys, e.g. "
            f"{layout.names[-1]!r}."
        ]

    def local_names(self, module: LightningModule, layout: FlatState) -> list[str]:
        shared = set(cluster_entry_names(module, layout, self.groups))
        return [name for name in layout.names if name not in shared]

    def on_fit_start(self, context: RunContext) -> None:
        self._local = context.layout.mask(self.local_names(context.module, context.layout))

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        assert self._local is not None, "LGFedAvg.server_update ran before on_fit_start"
        # g^{t+1} is the average; the local entries of W stay W^0's, the body a new client starts from
        return torch.where(self._local.to(aggregate.device), global_state, aggregate)
