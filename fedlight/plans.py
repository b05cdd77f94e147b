"""What a round hands a client and what the client hands back: plans and updates, shared by the engine,
the strategies and the hooks' context."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ClientPlan:
    """One sampled client's workload in a round.

    Attributes:
        client: client index.
        epochs: local epochs to run: F, or F' < F for a tolerated straggler.
        straggler: whether the client is one of the round's δ-fraction of stragglers.
        dropped: a straggler whose partial work the strategy does not accept; it does not train.
    """

    client: int
    epochs: int
    straggler: bool = False
    dropped: bool = False


@dataclass
class ClientUpdate:
    """What a client sends back besides its state.

    Attributes:
        client: client index.
        num_samples: n_k, the client's training-set size.
        epochs: local epochs run.
        num_steps: optimizer steps run.
        train_loss: mean task loss (``training_step``'s ``loss``, without strategy terms) over the local steps.
        payload: strategy-defined side information (prototypes, margins, saliency weight…),
            small and made of tensors/numbers so it can cross processes.
        weights: the unnormalised aggregation weights the strategy gave it, one per channel.
        finite: false when the returned state held NaN/Inf; such a client is not aggregated.
    """

    client: int
    num_samples: int
    epochs: int
    num_steps: int
    train_loss: float
    payload: dict[str, Any] = field(default_factory=dict)
    weights: tuple[float, ...] = ()
    finite: bool = True
