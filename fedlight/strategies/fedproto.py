"""MO-FedProto: Michieli & Ozay, *Prototype Guided Federated Learning of Visual Feature Representations*
(arXiv 2105.08982)

The paper calls its method FedProto. It is *not* Tan et al.'s FedProto (AAAI'22, ``yuetan031/FedProto``),
a different method with the same name, which exchanges prototypes instead of models.

Every client computes class prototypes of its training set (Eq. 4) with the received model W^t and again
with its trained model W_k^{t+1}, min–max normalised over the channels (D1). From them:

- LPM, μ_loc,k[c] = μ(p̂_k^before[c], p̂_k^after)         (Eq. 8, on the client)
- APM, μ_agg,k[c] = μ(p̂_k^after[c], p̂_agg^{t−1})        (Eq. 9, p̂_agg of the previous round)
- v_ι[k] = σ(Σ_c μ_ι,k[c]),  a_ι[k] = v_ι[k] / Σ_j v_ι[j]  (Eqs. 11–12)
- a[k] = n_k / Σ_j n_j while no aggregate prototypes exist (round 0, D3), else (a_agg[k] + a_loc[k]) / 2
  (Eq. 13), and W^{t+1} = Σ_k a[k] W_k^{t+1} (Eq. 14)
- p̂_agg^t[c] = Σ_k n_k[c] p̂_k[c] / Σ_k n_k[c], classes nobody holds this round carried over (Eq. 10, D2)

Eq. 13 is two normalised weight channels, (v_agg, v_loc), mixed with coefficients (½, ½); the trainer's
streaming sum normalises each channel, so no client state is held. Stragglers are tolerated by default.
The maths lives in :mod:`fedlight.metrics.functional.prototypes`; this class wires it into the hooks.

Payload of a client (CPU tensors, a few KB): the *unnormalised* after-training prototypes p_k [C, D], the
counts n_k [C], and its LPM/APM [C]. The server normalises p_k itself with the same function the client
used, so one [C, D] tensor serves both Eq. 10 (p̂) and the AMM analysis metric (p, D6).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from fedlight.errors import ConfigError
from fedlight.metrics.functional.prototypes import (
    aggregate_mean_margin,
    aggregate_prototypes,
    client_deviation,
    minmax_normalize,
    prototypes_from_sums,
    semantic_prototype_margin,
)
from fedlight.passes import class_feature_batches
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.base import Strategy

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext


class FedProto(Strategy):
    """Prototype-margin attention over the clients' states (Michieli & Ozay's FedProto, "MO-FedProto").

    Args:
        tolerate_stragglers: aggregate stragglers' partial work (F' < F epochs); ``null`` keeps them, as
            the paper does; ``false`` drops them (Table 3's "FedProto (no toleration)" row).
        sampling: how the round's clients are drawn: ``proportional`` to n_k without replacement (the
            paper) or ``uniform``.
        use_lpm: use the local prototype margin (Eq. 8) in the attention; ``use_apm=false`` with this on
            is Table 3's "LPM only" row.
        use_apm: use the aggregate prototype margin (Eq. 9) in the attention; ``use_lpm=false`` with this
            on is Table 3's "APM only" row. At least one of the two must be on.
        use_negatives: margins with the other classes' prototypes, Eq. 7; ``false`` uses d⁺ only (Table 3's
            "d⁺ only" row; see ``semantic_prototype_margin`` for the formula fedlight chose).
        reduction: how Eq. 11 reduces the margins over the classes present on both sides: ``sum`` as
            written, or ``mean``, which does not grow with the number of classes a client holds (D2).
    """

    weight_channels = 2  # (v_agg, v_loc): Eq. 13's two normalised attention vectors
    default_tolerate_stragglers = True

    def __init__(
        self,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
        use_lpm: bool = True,
        use_apm: bool = True,
        use_negatives: bool = True,
        reduction: Literal["sum", "mean"] = "sum",
    ) -> None:
        if not (use_lpm or use_apm):
            raise ConfigError(
                "--strategy.init_args.use_lpm and --strategy.init_args.use_apm are both false: FedProto's "
                "attention needs at least one margin. Enable one of them, or use FedAvg for n_k weights."
            )
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.use_lpm = use_lpm
        self.use_apm = use_apm
        self.use_negatives = use_negatives
        self.reduction = reduction
        self.aggregate: Tensor | None = None  # p̂_agg^{t−1} [C, D]; None until a round has ended (D3)
        self.seen: Tensor | None = None  # [C] bool: the classes p̂_agg holds
        self.attention: Tensor | None = None  # a^t [K'] of the last round, clients in increasing order
        self._before: Tensor | None = None  # p̂_k^before [C, D] of the client training in this process

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        """FedProto's prototypes are class means of ``module.net.forward_features`` (Eq. 4, D5)."""
        net = getattr(module, "net", None)
        if net is not None and hasattr(net, "forward_features"):
            return []
        return [
            "--strategy FedProto computes class prototypes from the penultimate features of the client's network "
            f"(module.net.forward_features), but --model {type(module).__name__} has "
            f"{'a net ' + type(net).__name__ + ' without it' if net is not None else 'no net'}. Use "
            "fedlight.clients.ClassificationClient or SegmentationClient with a registered network, or give your "
            "network forward_features (the classifier's input)."
        ]

    # -- client side -------------------------------------------------------------------------------
    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        """Prototypes of the client's training set with the received model W^t (the "t−1" side of Eq. 8)."""
        if self.use_lpm:
            prototypes, _ = _client_prototypes(context, module, plan.client)
            self._before = minmax_normalize(prototypes)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Prototypes with the trained model, the client's margins, and its payload."""
        prototypes, counts = _client_prototypes(context, module, update.client)  # p_k [C, D], n_k [C]
        normalised = minmax_normalize(prototypes)
        update.payload.update(prototypes=prototypes, counts=counts)
        if self.use_lpm:
            assert self._before is not None, "on_client_fit_start did not run for this client"
            update.payload["lpm"] = self._margin(self._before, normalised, counts, counts)  # μ_loc, Eq. 8
            self._before = None
        if self.use_apm and self.aggregate is not None:
            update.payload["apm"] = self._margin(normalised, self.aggregate, counts, self.seen)  # μ_agg, Eq. 9

    def _margin(self, p_i: Tensor, p_j: Tensor, n_i: Tensor, n_j: Tensor) -> Tensor:
        return semantic_prototype_margin(p_i, p_j, n_i, n_j, use_negatives=self.use_negatives)

    # -- server side -------------------------------------------------------------------------------
    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        """(v_agg[k], v_loc[k]) of Eq. 11, or (n_k, n_k) in the first round; one clue fills both channels."""
        if self.aggregate is None:  # no p̂_agg^{t−1} yet: FedAvg's weights (Eq. 13, t = 0)
            return (float(update.num_samples),) * 2
        present = update.payload["counts"] > 0  # C′ of LPM: the client's classes, on both sides
        v = []
        if self.use_apm:
            v.append(client_deviation(update.payload["apm"], self.reduction, present & self.seen))  # v_agg
        if self.use_lpm:
            v.append(client_deviation(update.payload["lpm"], self.reduction, present))  # v_loc
        return (float(v[0]), float(v[-1]))

    def channel_coefficients(self) -> Sequence[float]:
        """Eq. 13: a = ½ a_agg + ½ a_loc."""
        return (0.5, 0.5)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """Updates p̂_agg (Eq. 10) and reports the attention actually applied and the margins."""
        if not updates:
            return {}
        prototypes = torch.stack([u.payload["prototypes"] for u in updates])  # p_k, [K, C, D]
        counts = torch.stack([u.payload["counts"] for u in updates])  # n_k, [K, C]
        weights = torch.tensor([u.weights for u in updates], dtype=torch.float64)  # [K, 2]
        # a[k] = Σ_j c_j w_kj / Σ_l w_lj: exactly the mixture the trainer applied to the states
        coefficients = torch.tensor(self.channel_coefficients(), dtype=torch.float64)
        self.attention = (weights / weights.sum(dim=0)) @ coefficients  # [K]
        metrics: dict[str, Any] = {
            "fedproto/attention": self.attention.float(),  # a^t[k], a W&B histogram per round (Fig. S2)
            "fedproto/attention_max": self.attention.max().item(),
            "fedproto/attention_min": self.attention.min().item(),
        }
        if self.use_lpm:
            metrics["fedproto/lpm_mean"] = _mean_over(updates, "lpm", counts > 0)
        if self.use_apm and self.aggregate is not None:
            metrics["fedproto/apm_mean"] = _mean_over(updates, "apm", (counts > 0) & self.seen)
        # AMM (D6) on this round's aggregate of the unnormalised prototypes
        raw_aggregate, n_agg, _ = aggregate_prototypes(prototypes, counts)
        metrics["fedproto/amm"] = aggregate_mean_margin(raw_aggregate, n_agg).item()
        self.aggregate, _, self.seen = aggregate_prototypes(
            minmax_normalize(prototypes), counts, self.aggregate, self.seen
        )
        return metrics

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """p̂_agg and its seen mask once a round has ended; ``first_round_done`` says whether they exist."""
        if self.aggregate is None:
            return {"first_round_done": False}
        return {"first_round_done": True, "aggregate_prototypes": self.aggregate.clone(), "seen": self.seen.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`; without aggregate prototypes the next round uses FedAvg's weights."""
        if state.get("first_round_done", False):
            self.aggregate, self.seen = state["aggregate_prototypes"].clone(), state["seen"].clone()
        else:
            self.aggregate, self.seen = None, None


@torch.no_grad()
def _client_prototypes(context: RunContext, module: LightningModule, client: int) -> tuple[Tensor, Tensor]:
    """Class prototypes ``[C, D]`` and counts ``[C]`` of a client's training set, on the CPU (Eq. 4, D5).

    Dense models (segmentation) give ``[B, D, h, w]`` decoder features: every feature pixel is a sample,
    labelled by the label map downsampled by nearest neighbour, void pixels (the module's ``ignore_index``)
    left out and background counted as a class (D5).

    Eval mode and no gradients only: BatchNorm statistics, dropout and the RNG streams are left as they
    were, so the local fit runs exactly as without this pass.
    """
    was_training = module.training
    module.eval()
    sums, counts = None, None
    for batch_sums, batch_counts in class_feature_batches(context, module, client):
        sums = batch_sums if sums is None else sums + batch_sums
        counts = batch_counts if counts is None else counts + batch_counts
    module.train(was_training)
    assert sums is not None, f"client {client} has no training samples"
    return prototypes_from_sums(sums, counts).float().cpu(), counts.cpu()


def _mean_over(updates: Iterable[ClientUpdate], key: str, present: Tensor) -> float:
    """Mean margin over the (client, class) pairs of ``present`` ``[K, C]``, the margins' C′."""
    margins = torch.stack([u.payload[key] for u in updates])  # [K, C]
    return margins[present].mean().item() if present.any() else 0.0
