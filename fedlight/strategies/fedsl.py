"""FedSL: the FedSLS paper's ablation with "vanilla latents" instead of saliency maps (Table 1, bottom rows).

The paper replaces the saliency latents of FedSLS by perceptually compressed latents obtained by
downsampling the image by f ∈ {2, 4, 8}, averaged over the channels to save memory (Sec. 4.1.3, 4.3.5).
Everything else is FedSLS with static weights: per image N_i = ‖mean_c AvgPool_f(x_i)‖_F
(:func:`~fedlight.metrics.functional.saliency.vanilla_latent_norms`; uint8 images scaled to [0, 1]),
R_k = Σ_{i∈D_k} N_i, and the server step of Eqs. 9–10. The latents do not depend on the model, so there
is no warm-up and no dynamic mode; downsampling is by average pooling (the paper does not say which).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.metrics.functional.saliency import vanilla_latent_norms
from fedlight.strategies.fedsls import FedSLS

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext


class FedSL(FedSLS):
    """FedSLS's static weighting and server step with R_k = Σ_i ‖mean_c AvgPool_f(x_i)‖_F.

    Args:
        factor: f, the downsampling factor (2, 4 or 8 in the paper).
        server_lr: η > 0, the server learning rate (1).
        batch_size: images per pass.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``.
    """

    uses_model = False

    def __init__(
        self,
        factor: Literal[2, 4, 8] = 2,
        server_lr: float = 1.0,
        batch_size: int = 256,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        if factor < 1:
            raise ConfigError(f"Expected --strategy.init_args.factor ≥ 1, got {factor}; the paper uses 2, 4 and 8.")
        super().__init__(
            server_lr=server_lr,
            mode="static",
            warmup_epochs=0,
            batch_size=batch_size,
            tolerate_stragglers=tolerate_stragglers,
            sampling=sampling,
        )
        self.factor = factor

    def client_saliency(self, context: RunContext, module: LightningModule, client: int) -> float:
        """R_k = Σ_i ‖mean_c AvgPool_f(x_i)‖_F over the client's training set."""
        total = 0.0
        for inputs, _ in self._batches(context, client):
            total += float(vanilla_latent_norms(inputs, self.factor).sum(dtype=torch.float64))
        return total
