"""FedBABU: Oh, Kim & Yun, *FedBABU: Toward Enhanced Representation for Federated Image Classification*, ICLR 2022.

During federated training the head (the classifier) stays at its random initialisation and only the body (the
extractor) learns (Algorithm 1): client k trains the body from W^t with the head fixed, and the server
averages the bodies by n_k. Here the head's gradients are turned off for the length of a client's fit, so its
optimizer skips it, and the server keeps W^t's head entries as they are (the clients' copies, all equal, are not
averaged back in, which would only add float rounding).

A client's personalised model is the global model fine-tuned on its own training data for τ epochs (τ = 5 in the
paper's tables), the whole network by default. The engine has no hook that runs at evaluation time other than
:meth:`~fedlight.strategies.base.Strategy.personal_state`, which gives a client's own model when the clients' own
models are scored (``clients/personal/*``): there the resident module is trained from W^t with the engine's local
loop (a fresh optimizer from the client's ``configure_optimizers``, so the training learning rate; batches from a
stream of the client's own, the same at every evaluation, so that scoring a checkpoint repeats the run's numbers),
scored, and discarded. Nothing of the fine-tuning reaches the server. The engine scores clients' own models only
for rules that keep per-client state, so FedBABU declares one empty slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.bank import GROUPS, cluster_entry_names
from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate

_FINETUNE_STREAM = 3  # the fine-tuning batches, apart from every round's own stream of the client
_PARTS = ("full", "body", "head")


class FedBABU(FedAvg):
    """FedAvg of the body with the head fixed at its initialisation; clients personalise by fine-tuning.

    Args:
        finetune_epochs: τ ≥ 0, epochs of fine-tuning from the global model before a client's own model is scored
            (5 in the paper's tables); 0 scores the global model itself.
        finetune_part: what fine-tuning trains: the ``full`` network (the paper's default), the ``body`` with the
            head fixed, or the ``head`` with the body fixed.
        head: the layers kept at their initialisation during training: ``classifier`` (the linear and
            convolutional layers under a submodule named ``classifier``, ``head``, ``decoder`` or
            ``segmentation_head``), another group of :func:`fedlight.bank.cluster_entry_names`, or glob patterns
            over the state-dict keys (``net.head.*``).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn: ``null`` is ``proportional`` to n_k, as FedAvg here.
    """

    personalised = True

    def __init__(
        self,
        finetune_epochs: int = 5,
        finetune_part: Literal["full", "body", "head"] = "full",
        head: str | Sequence[str] = "classifier",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not finetune_epochs >= 0:
            problems.append(
                f"Expected --strategy.init_args.finetune_epochs (τ) ≥ 0, got {finetune_epochs}; the paper fine-tunes "
                "for 5 epochs, and 0 scores the global model itself."
            )
        if finetune_part not in _PARTS:
            problems.append(
                f"Expected --strategy.init_args.finetune_part to be one of {', '.join(_PARTS)}, got "
                f"{finetune_part!r}; the paper fine-tunes the full network."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.finetune_epochs, self.finetune_part = finetune_epochs, finetune_part
        self.head = head
        self._head_entries: torch.Tensor | None = None  # [P] bool
        self._parts: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # trainable (head, body) parameters

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        layout = FlatState(module, getattr(module, "frozen_modules", ()))
        try:
            names = set(self.head_names(module, layout))
        except ConfigError:
            names = set()
        trainable = [name for name, p in module.named_parameters() if p.requires_grad and name in layout.names]
        fixed = [name for name in trainable if name in names]
        if fixed and len(fixed) < len(trainable):
            return []
        found = "none" if not fixed else "every one"
        return [
            f"FedBABU keeps the entries of {self.head} (--strategy.init_args.head) at their initialisation and trains "
            f"the rest, but they match {found} of {type(module).__name__}'s trainable parameters: name the "
            f"classifier, with {', '.join(GROUPS)} or glob patterns over its state-dict keys, e.g. "
            f"{layout.names[-1]!r}."
        ]

    def head_names(self, module: LightningModule, layout: FlatState) -> list[str]:
        """The names of the federated entries that stay at their initialisation."""
        return cluster_entry_names(module, layout, self.head)

    def on_fit_start(self, context: RunContext) -> None:
        self._head_entries = context.layout.mask(self.head_names(context.module, context.layout))
        self._parts = None

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return {"none": Slot.vector(0)}  # personal models are fine-tuned when scored; nothing is kept

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        head, body = self._trainable(context)
        _train_only(body, head)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        head, body = self._trainable(context)
        _train_only(head + body, [])

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        assert self._head_entries is not None, "FedBABU.server_update ran before on_fit_start"
        return torch.where(self._head_entries.to(aggregate.device), global_state, aggregate)

    def personal_state(
        self, context: RunContext, client: int, values: Mapping[str, torch.Tensor], start: torch.Tensor
    ) -> torch.Tensor:
        if self.finetune_epochs == 0:
            return start
        module, layout = context.module, context.layout
        head, body = self._trainable(context)
        fixed = {"full": [], "body": head, "head": body}[self.finetune_part]
        layout.load(module, start, context.global_integers)
        seed = np.random.SeedSequence(context.client_seed(0, client), spawn_key=(_FINETUNE_STREAM,))
        _train_only(head + body, fixed)
        try:
            with torch.enable_grad():  # scoring runs without gradients
                context.local_train(
                    client, self.finetune_epochs, int(seed.generate_state(1, dtype=np.uint64)[0] >> 1), module,
                    full_batches=False,
                )  # fmt: skip
        finally:
            _train_only(head + body, [])
        return layout.flatten(module)

    def _trainable(self, context: RunContext) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The resident module's trainable parameters: those of the head, and the others (the body)."""
        if self._parts is None:
            names = set(self.head_names(context.module, context.layout))
            trainable = [(name, p) for name, p in context.module.named_parameters() if p.requires_grad]
            self._parts = (
                [p for name, p in trainable if name in names],
                [p for name, p in trainable if name not in names],
            )
        return self._parts


def _train_only(trained: list[torch.Tensor], fixed: list[torch.Tensor]) -> None:
    """Turns on the gradients of ``trained`` and off those of ``fixed``, which optimizers then skip."""
    for p in trained:
        p.requires_grad_(True)
    for p in fixed:
        p.requires_grad_(False)
