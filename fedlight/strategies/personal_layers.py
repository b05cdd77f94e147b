"""Rules whose clients keep some entries of the model as their own: FedBN's BatchNorm, FedPer's and FedRep's head.

A client trains from W^t with its own values of those entries (per-client state: a local
:class:`~fedlight.client_state.Slot`, which the engine writes over the state the client receives and takes back
after its fit). A client that has not trained yet starts from W^t's values. The global model still averages
every entry, so that it has values of its own to be evaluated with (``clients/*``, ``test/*``); clients never
receive those entries after their first round, and ``clients/personal/*`` scores each client's own model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from fedlight.bank import GROUPS, cluster_entry_names
from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext


class PersonalLayers(FedAvg):
    """FedAvg whose clients keep the entries of ``groups`` as their own.

    Args:
        groups: named groups (``bn``, ``backbone``, ``classifier``, ``all``) or glob patterns over the model's
            state-dict keys, as :func:`fedlight.bank.cluster_entry_names` reads them.
        flag: the configuration key that sets ``groups``, for error messages.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is the rule's default.
    """

    personalised = True

    def __init__(
        self,
        groups: str | Sequence[str],
        flag: str,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.groups = [groups] if isinstance(groups, str) else list(groups)
        self._flag = flag

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        layout = FlatState(module, getattr(module, "frozen_modules", ()))
        try:
            names = self.local_names(module, layout)
        except ConfigError:
            names = []
        if not names or len(names) == len(layout.names):
            found = "none" if not names else "every one"
            return [
                f"{type(self).__name__} keeps the entries of {self.groups} ({self._flag}) local, which match {found} "
                f"of {type(module).__name__}'s federated entries: name some but not all, with {', '.join(GROUPS)} or "
                f"glob patterns over its state-dict keys, e.g. {layout.names[-1]!r}."
            ]
        return []

    def local_names(self, module: LightningModule, layout: FlatState) -> list[str]:
        """The names of the federated entries that stay with each client."""
        return cluster_entry_names(module, layout, self.groups)

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        names = self.local_names(context.module, context.layout)
        return {"local": Slot.local(context.layout.mask(names))}
