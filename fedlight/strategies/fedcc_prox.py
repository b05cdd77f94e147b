"""FedProx in FUSS (Charalambous et al., Sec. 5; Li et al., MLSys 2020): a proximal term on the head's
non-linear branch, with FedCC's or FedAvg's server.

FUSS's FedProx rows regularise only the non-linear branch N of the head (``net.cluster2`` in the official
``training_step``): the client adds (μ/2)‖θ_N − θ_N^t‖² to its loss, μ = 0.001, where θ_N^t is the branch it
received. The linear branch, the centroids and the probe are not regularised. Table 2's "FedProx" row is
``centroids: average``; "FedProx + FedCC" is the default, maximin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.strategies.base import traceable_loss
from fedlight.strategies.fedcc import CentroidRule, FedCC
from fedlight.strategies.fedprox import proximal_term

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate


class FedCCProx(FedCC):
    """:class:`~fedlight.strategies.fedcc.FedCC` whose clients add (μ/2)‖θ_N − θ_N^t‖² over one submodule.

    Args:
        mu: μ ≥ 0 (0.001 in FUSS).
        branch: the regularised submodule (``head.nonlinear``, FUSS's N).
        centroids: ``maximin``, ``kmeans`` or ``average`` (plain FedProx); see FedCC.
        weighting: ``batches`` or ``uniform``; see FedCC.
        aggregated: ``all``, ``encoder`` or ``centroids``; see FedCC.
        tolerate_stragglers: see FedCC.
        sampling: see FedCC.
    """

    def __init__(
        self,
        mu: float = 1e-3,
        branch: str = "head.nonlinear",
        centroids: CentroidRule = "maximin",
        weighting: Literal["batches", "uniform"] = "batches",
        aggregated: Literal["all", "encoder", "centroids"] = "all",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        if not mu >= 0:
            raise ConfigError(f"Expected --strategy.init_args.mu ≥ 0, got {mu}; FUSS uses 0.001.")
        super().__init__(
            centroids=centroids,
            weighting=weighting,
            aggregated=aggregated,
            tolerate_stragglers=tolerate_stragglers,
            sampling=sampling,
        )
        self.mu, self.branch = mu, branch
        self._anchors: list[torch.Tensor] = []  # θ_N^t, as received

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        self._anchors = [p.detach().clone() for p in module.get_submodule(self.branch).parameters()]

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.mu == 0:
            return outputs["loss"]
        assert self._anchors, "FedCCProx.training_loss ran outside a local fit"
        params = list(module.get_submodule(self.branch).parameters())  # read at the call (see loss_is_traceable)
        return outputs["loss"] + 0.5 * self.mu * proximal_term(params, self._anchors)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        super().on_client_fit_end(context, module, update)
        self._anchors = []
