"""MOON: Li, He & Song, *Model-Contrastive Federated Learning*, CVPR 2021.

Each client pulls the representation of its local model towards that of the global model and away from
that of its own previous local model (``QinbinLi/MOON:main.py:train_net_fedcon``):

    ℓ_con = −log [ exp(cos(z, z_glob)/τ) / (exp(cos(z, z_glob)/τ) + exp(cos(z, z_prev)/τ)) ]
    L = CE + μ ℓ_con

where z is the representation the classifier reads (``forward_features``; the projection head's output
for the MOON model, ``model_kwargs: {projection_dim: 256}`` of the ResNets), z_glob comes from the frozen
global model W^t and z_prev from the client's model at the end of its previous participation (a buffer
of one model per client). τ = 0.5; μ = 5 for CIFAR-10 and 1 otherwise in the paper. The server is
FedAvg's.

A client that has not participated before has no previous model, and its contrastive term is 0. MOON's
code is the same in its first round (the logits hold the positive pair alone), but later uses the
untrained initial network of such a client as its negative; fedlight does not invent a previous model.

Memory: the previous models are kept as flat fp32 CPU tensors of ``module.net``'s floating-point state,
one per client that has participated (ResNet-18: 45 MB each, 4.5 GB for 100 clients), and they are part
of the checkpoint. Two frozen copies of the network (global and previous) live on the training device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedlight.errors import ConfigError
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.state import FlatState
from fedlight.strategies.base import traceable_loss
from fedlight.strategies.fedavg import FedAvg
from fedlight.teachers import Teachers

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext


def model_contrastive_loss(
    features: torch.Tensor,
    global_features: torch.Tensor,
    previous_features: Sequence[torch.Tensor],
    temperature: float = 0.5,
) -> torch.Tensor:
    """Returns ℓ_con, averaged over the batch: cross-entropy of the cosine logits with the global pair as target.

    Args:
        features: ``[B, D]`` z of the model being trained.
        global_features: ``[B, D]`` z_glob of the global model (the positive pair).
        previous_features: ``[B, D]`` z_prev of each previous local model (the negatives; MOON's buffer).
        temperature: τ.

    With z = z_glob and z ⟂ z_prev the logits are (1/τ, 0), so ℓ = log(1 + e^{−1/τ}) = log(1 + e^{−2}):

    >>> z = torch.tensor([[1.0, 0.0]])
    >>> round(model_contrastive_loss(z, z, [torch.tensor([[0.0, 3.0]])]).item(), 6)
    0.126928
    """
    pairs = [global_features, *previous_features]
    logits = torch.stack([F.cosine_similarity(features, other, dim=-1) for other in pairs], dim=1)  # [B, 1 + M]
    target = torch.zeros(features.shape[0], dtype=torch.long, device=features.device)  # the global pair
    return F.cross_entropy(logits.float() / temperature, target)


class MOON(FedAvg):
    """FedAvg whose clients add μ·ℓ_con against the global model and their previous local model.

    Args:
        mu: μ ≥ 0, the weight of the model-contrastive loss (5 for CIFAR-10, 1 for CIFAR-100 and
            Tiny-ImageNet in the MOON paper).
        temperature: τ > 0 of the cosine logits (0.5).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        mu: float = 1.0,
        temperature: float = 0.5,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not mu >= 0:
            problems.append(f"Expected --strategy.init_args.mu ≥ 0, got {mu}; MOON uses 5 (CIFAR-10) or 1.")
        if not temperature > 0:
            problems.append(f"Expected --strategy.init_args.temperature (τ) > 0, got {temperature}; MOON uses 0.5.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.mu = mu
        self.temperature = temperature
        self.previous: dict[int, torch.Tensor] = {}  # client → [P_net] fp32 CPU state of its last local model
        self._fresh: dict[int, torch.Tensor] = {}  # this round's entries of ``previous``, trained in this process
        self._layout: FlatState | None = None  # the layout of module.net's floating-point state
        # frozen copies of the network, one per role: "global" holds W^t, "previous" the client's previous model
        self._copies = Teachers()
        self._global_net: nn.Module | None = None
        self._previous_net: nn.Module | None = None

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        try:
            _network_of(module)
        except ConfigError as err:
            return [str(err)]
        return []

    # -- client side -------------------------------------------------------------------------------
    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        """Loads W^t (the module's state now) and the client's previous model into the frozen copies."""
        net = _network_of(module)
        if self._layout is None:
            self._layout = FlatState(net)
        self._global_net = self._copies.copy_of("global", net)
        previous = self.previous.get(plan.client)
        self._previous_net = None if previous is None else self._copies.holding("previous", net, self._layout, previous)

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.mu == 0 or self._previous_net is None:
            return outputs["loss"]  # no negative: MOON's logits would hold the positive pair alone, ℓ_con = 0
        if "features" not in outputs:
            raise ConfigError(
                f"MOON needs the representation z of each batch, but {type(module).__name__}.training_step returns "
                f"only {sorted(outputs)}. Use a client whose training_step returns 'features' (ClassificationClient)."
            )
        inputs = batch[0]
        with torch.no_grad():
            global_features = self._global_net.forward_features(inputs)  # z_glob [B, D]
            previous_features = self._previous_net.forward_features(inputs)  # z_prev [B, D]
        features = outputs["features"]  # z [B, D]
        return outputs["loss"] + self.mu * model_contrastive_loss(
            features, global_features, [previous_features], self.temperature
        )

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Keeps the trained local model as the client's next previous model (if it is finite)."""
        state = self._layout.flatten(_network_of(module)).cpu()
        if bool(torch.isfinite(state).all()):
            self.previous[update.client] = self._fresh[update.client] = state

    # -- server side -------------------------------------------------------------------------------
    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        self._fresh = {}

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """With several processes, every rank learns the previous models the others trained this round."""
        for fresh in context.all_gather_objects(self._fresh):
            self.previous.update(fresh)
        self._fresh = {}
        return {"moon/clients_with_previous_model": float(len(self.previous))}

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every client's previous local model (flat fp32 CPU tensors)."""
        return {"previous": {client: state.clone() for client, state in self.previous.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous = {int(client): s.clone() for client, s in state.get("previous", {}).items()}


def _network_of(module: LightningModule) -> nn.Module:
    net = getattr(module, "net", None)
    if net is None or not hasattr(net, "forward_features"):
        raise ConfigError(
            f"MOON runs copies of the client's network, but {type(module).__name__} has no 'net' with "
            "forward_features. Use fedlight.clients.ClassificationClient with a registered model."
        )
    return net
