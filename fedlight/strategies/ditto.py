"""Ditto: Li, Hu, Beirami & Smith, *Ditto: Fair and Robust Federated Learning Through Personalization*, ICML 2021.

The global model is trained as in FedAvg, and every client also keeps a personal model v_k (per-client state,
the model it first received before its first round) that it trains in each of its rounds on its own objective
regularised towards the global model it received (Eq. 2, Algorithm 1):

    min_{v_k}  h_k(v_k; w^t) = F_k(v_k) + (λ/2)‖v_k − w^t‖²

Here a client's round first runs the engine's local fit of the global model (sent to the server as FedAvg's),
then ``personal_epochs`` epochs of SGD on h_k from its stored v_k (a fresh optimizer from the client's
``configure_optimizers``, batches from a stream of their own). The proximal term covers the trainable
parameters; buffers (BatchNorm statistics) of v_k follow its own training. Each client is evaluated with v_k
(``clients/personal/*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.fedprox import proximal_term

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate

_PERSONAL_STREAM = 2  # the personal epochs' batches, apart from the global fit's stream of the same client and round


class Ditto(FedAvg):
    """FedAvg for the global model, and a personal model per client regularised towards it.

    Args:
        lam: λ ≥ 0, the weight of (λ/2)‖v_k − w^t‖²; 0 trains personal models on local data alone, and large
            values keep them at the global model (the paper picks λ from {0.01, 0.1, 1, 2} per dataset).
        personal_epochs: epochs of the personal model per round; ``null`` runs as many as the client's global
            fit (``--trainer.local_epochs``, or F' for a tolerated straggler).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn: ``null`` is ``proportional`` to n_k, as FedAvg here.
    """

    personalised = True

    def __init__(
        self,
        lam: float = 0.1,
        personal_epochs: int | None = None,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not lam >= 0:
            problems.append(f"Expected --strategy.init_args.lam (λ) ≥ 0, got {lam}; the paper picks from 0.01 to 2.")
        if personal_epochs is not None and not personal_epochs >= 1:
            problems.append(f"Expected --strategy.init_args.personal_epochs ≥ 1 or null, got {personal_epochs}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.lam, self.personal_epochs = lam, personal_epochs
        self._anchors: list[torch.Tensor] = []  # w^t on the trainable parameters
        self._epochs = 0

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return {"personal": Slot.vector(context.layout.numel, init="received")}  # v_k

    def personal_state(
        self, context: RunContext, client: int, values: Mapping[str, torch.Tensor], start: torch.Tensor
    ) -> torch.Tensor:
        return values["personal"]

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        self._anchors = [p.detach().clone() for p in module.parameters() if p.requires_grad]
        self._epochs = self.personal_epochs or plan.epochs

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        assert self._anchors, "Ditto.on_client_fit_end ran outside a local fit"
        layout = context.layout
        trained, integers = layout.flatten(module), layout.integers(module)  # w_k, sent to the server
        layout.load(module, context.client_state["personal"])
        params, anchors, lam = [p for p in module.parameters() if p.requires_grad], self._anchors, self.lam

        def personal_loss(module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
            return outputs["loss"] + 0.5 * lam * proximal_term(params, anchors)  # h_k(v_k; w^t)

        seed = np.random.SeedSequence(context.client_seed(context.round, update.client), spawn_key=(_PERSONAL_STREAM,))
        context.local_train(
            update.client, self._epochs, int(seed.generate_state(1, dtype=np.uint64)[0] >> 1), module,
            full_batches=False, loss=personal_loss,
        )  # fmt: skip
        context.client_state["personal"] = layout.flatten(module)
        layout.load(module, trained, integers)
        self._anchors = []
