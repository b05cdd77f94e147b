"""FedRep: Collins, Hassani, Mokhtari & Shakkottai, *Exploiting Shared Representations for Personalized Federated
Learning*, ICML 2021.

As FedPer, clients keep their head and share the representation (the body), but a client's round trains them
one after the other (Algorithm 1): first its head for τ_h epochs with the body fixed, then the body for τ
epochs with the new head fixed. Only the body is averaged into the next global representation.

Here the head epochs run at the start of the client's fit (``head_epochs``, a fresh optimizer from the client's
``configure_optimizers``, batches from a stream of their own derived from the client's), and the round's local
epochs (``--trainer.local_epochs``) train the body. A part is fixed by turning off its parameters' gradients, so
optimizers skip it; a body module whose parameters are all fixed also runs in eval mode during the head epochs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from fedlight.errors import ConfigError
from fedlight.state import freeze_modes
from fedlight.strategies.fedper import FedPer

if TYPE_CHECKING:
    import torch
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate

_HEAD_STREAM = 1  # the head epochs' batches, apart from the body epochs' stream of the same client and round


class FedRep(FedPer):
    """FedPer whose clients train their head first, then the shared body.

    Args:
        head_epochs: τ_h ≥ 1, epochs of head training (body fixed) before the body's local epochs (10 in the
            paper's image experiments, with 1 epoch of the body).
        head: the personalisation layers, as for :class:`~fedlight.strategies.FedPer`.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn: ``null`` is ``proportional`` to n_k, as FedAvg here.
    """

    def __init__(
        self,
        head_epochs: int = 10,
        head: str | Sequence[str] = "classifier",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        if not head_epochs >= 1:
            raise ConfigError(
                f"Expected --strategy.init_args.head_epochs (τ_h) ≥ 1, got {head_epochs}; the paper trains the head "
                "for 10 epochs before 1 epoch of the body."
            )
        super().__init__(head, tolerate_stragglers, sampling)
        self.head_epochs = head_epochs
        self._head: list[torch.Tensor] = []  # the head's trainable parameters
        self._body: list[torch.Tensor] = []  # every other trainable parameter

    def on_fit_start(self, context: RunContext) -> None:
        module = context.module
        names = set(self.local_names(module, context.layout))
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._head = [p for name, p in trainable if name in names]
        self._body = [p for name, p in trainable if name not in names]

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        seed = np.random.SeedSequence(context.client_seed(context.round, plan.client), spawn_key=(_HEAD_STREAM,))
        _fix(self._head, False)  # in case an earlier client's fit raised before its end
        _fix(self._body)
        try:
            context.local_train(
                plan.client, self.head_epochs, int(seed.generate_state(1, dtype=np.uint64)[0] >> 1), module,
                full_batches=False,
            )  # fmt: skip
        finally:
            _fix(self._body, False)
        module.train()  # the body's modes, which the head epochs may have fixed with it
        freeze_modes(module, context.layout.frozen_modules)
        _fix(self._head)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        _fix(self._head, False)


def _fix(params: list[torch.Tensor], fixed: bool = True) -> None:
    for p in params:
        p.requires_grad_(not fixed)
