"""FedDecorr: Shi, Liang, Zhang, Tan & Bai, *Towards Understanding and Mitigating Dimensional Collapse in
Heterogeneous Federated Learning*, ICLR 2023.

Heterogeneous clients collapse their representations onto few dimensions. FedDecorr adds to the local
loss a penalty on the correlations between the dimensions of a batch's features
(``bytedance/FedDecorr:loss.py``):

    ẑ = (z − mean_b z) / sqrt(var_b z + 1e-8)          z: [N, D] penultimate features, unbiased variance
    L_dec = mean over j ≠ l of (ẑᵀẑ)_{jl}²  /  N         (0 when N = 1)
    L = CE + β L_dec,  β = 0.1

The server is FedAvg's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.strategies.base import traceable_loss
from fedlight.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from lightning import LightningModule


def decorrelation_loss(features: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Returns L_dec, the mean squared off-diagonal correlation of ``features`` ``[N, D]``, divided by N.

    Columns that are already uncorrelated give 0; two perfectly correlated columns over 2 samples give
    correlations ẑᵀẑ = [[1, 1], [1, 1]] (unbiased variance), so the off-diagonal mean is 1 and L_dec = 1/2:

    >>> round(decorrelation_loss(torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])).item(), 6)
    0.0
    >>> round(decorrelation_loss(torch.tensor([[1.0, 1.0], [-1.0, -1.0]])).item(), 6)
    0.5
    """
    num, dim = features.shape
    if num == 1:
        return features.new_zeros(())
    features = features.float()  # the correlation sums over the batch: keep it in fp32 under autocast
    features = features - features.mean(dim=0, keepdim=True)
    features = features / torch.sqrt(eps + features.var(dim=0, keepdim=True))
    correlation = features.T @ features  # [D, D]
    off_diagonal = correlation[~torch.eye(dim, dtype=torch.bool, device=features.device)]  # [D(D − 1)]
    return off_diagonal.square().mean() / num


class FedDecorr(FedAvg):
    """FedAvg whose clients add β·L_dec of their batch's features (``training_step``'s ``features``).

    Args:
        beta: β ≥ 0, the weight of the decorrelation loss (0.1 in the paper).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        beta: float = 0.1,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        if not beta >= 0:
            raise ConfigError(f"Expected --strategy.init_args.beta ≥ 0, got {beta}; the paper uses 0.1.")
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.beta = beta

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        net = getattr(module, "net", None)
        if net is not None and not hasattr(net, "forward_features"):
            return [
                f"FedDecorr penalises correlations between the features the classifier reads, but the network of "
                f"--model ({type(net).__name__}) has only forward. Give it forward_features and forward_head (see "
                "'Your own network' in the README), or choose another rule."
            ]
        return []

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if "features" not in outputs:
            raise ConfigError(
                f"FedDecorr needs the features of each batch, but {type(module).__name__}.training_step returns "
                f"only {sorted(outputs)}. Use a client whose training_step returns 'features' (ClassificationClient)."
            )
        return outputs["loss"] + self.beta * decorrelation_loss(outputs["features"])
