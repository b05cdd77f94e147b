"""MOON in FUSS (Charalambous et al., Sec. 5; Li, He & Song, CVPR 2021): a per-pixel model-contrastive
loss on the head's non-linear branch, with FedCC's or FedAvg's server.

FUSS's MOON rows (the official ``training_step``) contrast, at every pixel, the client's code z (both
branches, with dropout) with the code the *received* non-linear branch N^t gives the same features (the
positive) and the code its own previous local N gives (the negative):

    ℓ = −log( e^{cos(z, z_g)/τ} / (e^{cos(z, z_g)/τ} + e^{cos(z, z_p)/τ} + 1e-8) ),  averaged over pixels,

with z_g = N^t(f), z_p = N_prev(f), τ = 0.5 and weight 1. N^t is frozen at the round's start; N_prev is the
client's N after its previous local fit. A client with no previous fit has no negative and adds nothing, as
:class:`~fedlight.strategies.moon.MOON` does. Table 2's "FedMOON" row is ``centroids: average``.

**As released** (``previous: averaged``). FUSS's code keeps the previous local N as a submodule of the
client's model, so the server's average of whole state dicts averages it too, and every client then loads it
back: its "previous" N is the average of the clients' trained N, which is N^t itself (and at the start, the
same initial N). With z_p = z_g every pixel's term is −log(e^a / (2e^a + 1e-8)) ≈ log 2 whatever the head
does; its gradient is a's times −1e-8 / (2e^a + 1e-8), nothing in fp32. The rows the paper reports as FedMOON
are then FedAvg's (Table 3 gives 24.69 for both), and their differences from the FedAvg rows are run-to-run
noise. The paper's MOON (``previous: local``) is the default; ``averaged`` is the released behaviour.

Memory: one flat fp32 copy of N per client that has trained (DINO ViT-B/8's N: 2.6 MB), kept on the CPU and
checkpointed (none with ``previous: averaged``); two frozen copies of N on the training device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies.base import traceable_loss
from fedlight.strategies.fedcc import CentroidRule, FedCC
from fedlight.teachers import Teachers

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate


def pixel_contrastive_loss(codes: Tensor, positive: Tensor, negative: Tensor, temperature: float = 0.5) -> Tensor:
    """ℓ of FUSS's MOON variant, averaged over pixels, from codes ``[B, D, h, w]``.

    With z = z_g and z ⟂ z_p the ratio is e^{1/τ} / (e^{1/τ} + 1), so ℓ = log(1 + e^{−2}) at τ = 0.5:

    >>> z = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)
    >>> round(pixel_contrastive_loss(z, z, torch.tensor([0.0, 3.0]).view(1, 2, 1, 1)).item(), 6)
    0.126928
    """
    pos = torch.exp(F.cosine_similarity(codes, positive, dim=1) / temperature)  # [B, h, w]
    neg = torch.exp(F.cosine_similarity(codes, negative, dim=1) / temperature)
    return -torch.log(pos / (pos + neg + 1e-8)).mean()


class FedCCMOON(FedCC):
    """:class:`~fedlight.strategies.fedcc.FedCC` whose clients add μ·ℓ against N^t and their previous N.

    Args:
        mu: weight of the contrastive loss (1 in FUSS).
        temperature: τ (0.5).
        branch: the contrasted submodule (``head.nonlinear``, FUSS's N).
        previous: the negative model: ``local``, the client's N after its previous fit (the paper's MOON), or
            ``averaged``, what FUSS's released code contrasts with: the previous models averaged by the server
            like every other entry, i.e. N^t itself, from the first round on (the term then has no gradient).
        centroids: ``maximin``, ``kmeans`` or ``average`` (plain MOON); see FedCC.
        weighting: ``batches`` or ``uniform``; see FedCC.
        aggregated: ``all``, ``encoder`` or ``centroids``; see FedCC.
        tolerate_stragglers: see FedCC.
        sampling: see FedCC.
    """

    def __init__(
        self,
        mu: float = 1.0,
        temperature: float = 0.5,
        branch: str = "head.nonlinear",
        previous: Literal["local", "averaged"] = "local",
        centroids: CentroidRule = "maximin",
        weighting: Literal["batches", "uniform"] = "batches",
        aggregated: Literal["all", "encoder", "centroids"] = "all",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not mu >= 0:
            problems.append(f"Expected --strategy.init_args.mu ≥ 0, got {mu}; FUSS uses 1.")
        if not temperature > 0:
            problems.append(f"Expected --strategy.init_args.temperature (τ) > 0, got {temperature}; FUSS uses 0.5.")
        if previous not in ("local", "averaged"):
            problems.append(
                f"Expected --strategy.init_args.previous to be 'local' (the paper's MOON) or 'averaged' (FUSS's "
                f"released code), got {previous!r}."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(
            centroids=centroids,
            weighting=weighting,
            aggregated=aggregated,
            tolerate_stragglers=tolerate_stragglers,
            sampling=sampling,
        )
        self.mu, self.temperature, self.branch, self.previous_model = mu, temperature, branch, previous
        self.previous: dict[int, Tensor] = {}  # client → [P_N] its N after its last local fit
        self._fresh: dict[int, Tensor] = {}  # this round's entries of ``previous``, trained in this process
        self._layout: FlatState | None = None
        self._copies = Teachers()  # frozen copies of the branch: "global" holds N^t, "previous" N_prev
        self._global: nn.Module | None = None
        self._previous: nn.Module | None = None

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        try:
            module.get_submodule(self.branch)
        except AttributeError:
            return [
                f"--strategy FedCCMOON contrasts the submodule --strategy.init_args.branch={self.branch!r}, which "
                f"{type(module).__name__} lacks. Use fedlight.clients.UnsupervisedSegmentationClient (head.nonlinear) "
                "or name one of your client's submodules."
            ]
        return super().check(module, datamodule)

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        branch = module.get_submodule(self.branch)
        if self._layout is None:
            self._layout = FlatState(branch)
        self._global = self._copies.copy_of("global", branch)
        previous = self.previous.get(plan.client)
        self._previous = None if previous is None else self._copies.holding("previous", branch, self._layout, previous)

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, Tensor]) -> Tensor:
        averaged = self.previous_model == "averaged"
        if self.mu == 0 or not (self._previous is not None or averaged):
            return outputs["loss"]
        feats = outputs["features"]  # f [B, C, h, w], the dropped copy the correspondence loss reads (FUSS's code)
        with torch.no_grad():
            positive = self._global(feats)  # [B, D, h, w]
            negative = positive if averaged else self._previous(feats)  # the released code's N_prev is N^t
        contrastive = pixel_contrastive_loss(outputs["codes"], positive, negative, self.temperature)
        return outputs["loss"] + self.mu * contrastive

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        super().on_client_fit_end(context, module, update)
        if self.previous_model == "averaged":
            return  # the negative is N^t: nothing of the client's own to keep
        state = self._layout.flatten(module.get_submodule(self.branch)).cpu()
        if bool(torch.isfinite(state).all()):
            self.previous[update.client] = self._fresh[update.client] = state

    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        super().on_round_start(context, round_idx, plans)
        self._fresh = {}

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        metrics = super().on_round_end(context, round_idx, updates)
        for fresh in context.all_gather_objects(self._fresh):
            self.previous.update(fresh)
        self._fresh = {}
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"previous": {k: v.clone() for k, v in self.previous.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.previous = {int(k): v.clone() for k, v in state.get("previous", {}).items()}
