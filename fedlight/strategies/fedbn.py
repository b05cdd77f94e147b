"""FedBN: Li, Jiang, Zhang, Kamp & Dou, *FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization*, ICLR 2021.

Every client keeps its BatchNorm layers (weights, biases and running statistics) as its own and the server
averages the rest (Algorithm 1): client k trains from W^t with its own BatchNorm entries, which never leave it.
See :mod:`~fedlight.strategies.personal_layers` for what the global model holds and how clients are evaluated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from fedlight.strategies.personal_layers import PersonalLayers

if TYPE_CHECKING:
    from lightning import LightningModule


class FedBN(PersonalLayers):
    """FedAvg whose clients keep every BatchNorm's weight, bias and running statistics local.

    Args:
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn: ``null`` is ``proportional`` to n_k, as FedAvg here.
    """

    def __init__(
        self,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        super().__init__("bn", "its BatchNorm layers", tolerate_stragglers, sampling)

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        if not any(isinstance(sub, nn.modules.batchnorm._BatchNorm) for sub in module.modules()):
            return [
                f"FedBN keeps every BatchNorm layer local, but {type(module).__name__} has none: choose a model with "
                "BatchNorm layers (for the cnn and mlp models, --model.init_args.model_kwargs.batch_norm=true)."
            ]
        return super().check(module, datamodule)
