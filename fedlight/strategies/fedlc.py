"""FedLC: Zhang, Li, Li, Xu, Wu, Ding & Wu, *Federated Learning with Label Distribution Skew via Logits
Calibration*, ICML 2022 (PMLR 162), Sec. 4, Eq. 7.

Under label skew, a client's softmax cross-entropy keeps pushing down the logits of the classes it rarely or never
sees, so its local model over-fits to its majority classes and drifts from the others' (Sec. 3). FedLC calibrates
every logit before the softmax by a margin that grows as a class gets rarer on the client: client k minimises

    L_cal(y; f(x)) = −log [ e^{f_y(x) − τ n_{k,y}^{−1/4}} / Σ_{y'} e^{f_{y'}(x) − τ n_{k,y'}^{−1/4}} ]      (Eq. 7)

with n_{k,c} the samples of class c in client k's training split (:mod:`fedlight.label_counts`), and the server
averages the local models as FedAvg does. A class the client has no sample of has n_{k,c}^{−1/4} = ∞: its
calibrated logit is −∞, so it leaves the softmax (for every τ > 0; τ = 0 is FedAvg's loss over all classes).

Eq. 7 as printed sums its denominator over y' ≠ y only. Read so, the loss is −(g_y − log Σ_{y'≠y} e^{g_{y'}}) of the
calibrated logits g, unbounded below: it never saturates, and training diverges (FL-bench's reimplementation reports
its runs collapsing). The paper describes the loss as a calibration of the logits "before softmax cross-entropy" by
pairwise label margins, and log(1 + Σ_{y'≠y} e^{Δ_{yy'}} e^{f_{y'} − f_y}) with Δ_{yy'} = τ(n_{k,y}^{−1/4} −
n_{k,y'}^{−1/4}) is exactly the softmax cross-entropy of the calibrated logits over all classes, which is what is
minimised here (as FL-bench's and FedDecorr's implementations of FedLC also do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

from fedlight.errors import ConfigError
from fedlight.label_counts import client_class_counts, label_count_problems
from fedlight.strategies.base import traceable_loss
from fedlight.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate


def logit_calibration(counts: torch.Tensor, tau: float) -> torch.Tensor:
    """``[C]`` fp32: −τ n_c^{−1/4}, what FedLC adds to each logit; −∞ for a class with no sample (when τ > 0).

    >>> logit_calibration(torch.tensor([1, 16, 0]), 1.0).tolist()
    [-1.0, -0.5, -inf]
    >>> logit_calibration(torch.tensor([1, 16, 0]), 0.0).tolist()
    [0.0, 0.0, 0.0]
    """
    if tau == 0:
        return torch.zeros(counts.shape)
    margin = tau * counts.clamp(min=1).double().pow(-0.25)  # τ n_c^{−1/4}
    return torch.where(counts > 0, -margin, -torch.inf).float()


def calibrated_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, calibration: torch.Tensor) -> torch.Tensor:
    """Eq. 7 over all classes: the mean softmax cross-entropy of ``logits + calibration``.

    Args:
        logits: ``[B, C]`` f(x).
        targets: ``[B]`` the classes y.
        calibration: ``[C]`` −τ n_c^{−1/4} (:func:`logit_calibration`).

    With logits 0, counts (1, 16) and τ = 1 a sample of class 0 costs log(1 + e^{−0.5 + 1}) = log(1 + e^{0.5}):

    >>> loss = calibrated_cross_entropy(torch.zeros(1, 2), torch.tensor([0]), torch.tensor([-1.0, -0.5]))
    >>> round(loss.item(), 6)
    0.974077
    """
    return F.cross_entropy(logits.float() + calibration, targets)


class FedLC(FedAvg):
    """FedAvg whose clients train on logits calibrated by their own class counts (Eq. 7).

    Args:
        tau: τ ≥ 0, the strength of the calibration; 0 is FedAvg. The paper tunes τ without a value we could
            find stated; 1.0 is our default (FL-bench's; FedDecorr's comparison runs FedLC with 0.1).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``proportional`` to n_k, as FedAvg here.
    """

    def __init__(
        self,
        tau: float = 1.0,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        if not tau >= 0:
            raise ConfigError(
                f"Expected --strategy.init_args.tau (τ) ≥ 0, got {tau}; 0 is FedAvg, larger values shift the logits "
                "of the classes a client rarely sees further down during its training."
            )
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.tau = tau
        self._counts: torch.Tensor | None = None  # [K, C] n_{k,c}
        self._calibration: torch.Tensor | None = None  # [C] −τ n_{k,c}^{−1/4} of the client in its fit

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        return label_count_problems("FedLC", datamodule)

    def on_fit_start(self, context: RunContext) -> None:
        self._counts = client_class_counts(context.datamodule)

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        assert self._counts is not None, "FedLC.on_client_fit_start ran before on_fit_start"
        self._calibration = logit_calibration(self._counts[plan.client], self.tau).to(context.device)

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        assert self._calibration is not None, "FedLC.training_loss ran outside a local fit"
        if "logits" not in outputs:
            raise ConfigError(
                f"FedLC calibrates the logits of each batch, but {type(module).__name__}.training_step returns only "
                f"{sorted(outputs)}. Use a client whose training_step returns 'logits' (ClassificationClient)."
            )
        return calibrated_cross_entropy(outputs["logits"], batch[1], self._calibration)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        self._calibration = None
