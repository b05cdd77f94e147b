"""FedSLS: *Exploring Federated Aggregation in the Saliency Latent Space*.

Each client's aggregation weight is its saliency weight R_k: guided backpropagation from the ground-truth
logit to every convolution, Ḡ = channel mean of ∂Y/∂F ⊙ ReLU(F), N = ‖Ḡ‖_F, summed over the client's
images with layer weights τ^{l−1} (Eqs. 4–8, :mod:`fedlight.metrics.functional.saliency`). The server then
takes a step along the R-weighted mean update of the round's clients (Eqs. 9–10):

    Δ^r = Σ_{k∈S} R_k (θ_k − θ^r) / Σ_{k∈S} R_k,      θ^{r+1} = θ^r + η Δ^r

(the paper's Eqs. 3 and 10 flip the sign of Δ twice; this is the consistent form).

``mode=static`` (the paper's method, Eq. 11): before the first round every client fine-tunes the initial
model θ^0 on its data for ``warmup_epochs`` (S4: one epoch with the local optimizer), computes R_k with the
fine-tuned model and discards it; R_k stays fixed for the whole run and is checkpointed. ``mode=dynamic``
(the paper's comparison): a client computes R_k with its trained local model at the end of every local fit.

:class:`~fedlight.strategies.fedsl.FedSL` is the paper's ablation with vanilla latents instead of saliency maps.

Cost: the static weights take one epoch of training plus one guided pass over every client's data before
the first round. The pass runs in batches of ``batch_size`` images and keeps only per-image norms
(``benchmarks/fedsls/saliency_memory.py`` measures its peak memory). Floating-point buffers (BatchNorm
statistics) take the R-weighted average; η scales the step of the parameters only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.errors import ConfigError
from fedlight.metrics.functional.saliency import layer_weights, saliency_norms
from fedlight.plans import ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.parameters import ParameterMask

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext

log = logging.getLogger(__name__)


class FedSLS(ParameterMask, Strategy):
    """Saliency-weighted aggregation.

    Args:
        tau: τ > 0, the decay of the layer weights w_l = τ^{l−1} from shallow to deep (0.5).
        server_lr: η > 0, the server learning rate of Eq. 10 (1).
        mode: ``static``: R_k computed once, after a local warm-up from θ^0 (Eq. 11, the paper's method);
            ``dynamic``: recomputed by every client with its trained model in every round.
        warmup_epochs: local epochs of the static warm-up (decision S4: 1); 0 computes R_k with θ^0 itself.
        guided: guided backpropagation (the paper's); ``false`` uses plain gradients (gradient × activation).
        batch_size: images per saliency pass; bounds its memory, does not change R_k.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    default_sampling = "uniform"
    #: whether R_k depends on the model (FedSL's vanilla latents do not, so it skips the warm-up)
    uses_model = True

    def __init__(
        self,
        tau: float = 0.5,
        server_lr: float = 1.0,
        mode: Literal["static", "dynamic"] = "static",
        warmup_epochs: int = 1,
        guided: bool = True,
        batch_size: int = 64,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not tau > 0:
            problems.append(f"Expected --strategy.init_args.tau > 0, got {tau}; the paper uses 0.5.")
        if not server_lr > 0:
            problems.append(f"Expected --strategy.init_args.server_lr (η) > 0, got {server_lr}; the paper uses 1.")
        if warmup_epochs < 0:
            problems.append(f"Expected --strategy.init_args.warmup_epochs ≥ 0, got {warmup_epochs}.")
        if batch_size < 1:
            problems.append(f"Expected --strategy.init_args.batch_size ≥ 1, got {batch_size}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.tau = tau
        self.server_lr = server_lr
        self.mode = mode
        self.warmup_epochs = warmup_epochs
        self.guided = guided
        self.batch_size = batch_size
        self.saliency: torch.Tensor | None = None  # static R_k of every client, [N] float64

    # -- saliency weights ------------------------------------------------------------------------------
    def on_fit_start(self, context: RunContext) -> None:
        """Computes the static R_k of every client (once: a resumed run restores them)."""
        self.cache_parameter_mask(context)
        if self.mode == "static" and self.saliency is None:
            started = time.perf_counter()
            self.saliency = self._static_weights(context)
            elapsed = time.perf_counter() - started
            log.info("%s: static weights of %d clients in %.1f s", type(self).__name__, len(self.saliency), elapsed)

    def _static_weights(self, context: RunContext) -> torch.Tensor:
        """R_k of all clients, each after its warm-up from θ^0 (θ'_k: ``warmup_epochs`` of the engine's local
        training with a fresh optimizer and full batches only, as MOON's loaders drop a short last batch)."""
        num_clients, module = context.datamodule.num_clients, context.module
        # one warm-up seed per client from the strategy's stream, the same on every rank
        seeds = context.strategy_rng(0).integers(2**62, size=num_clients)

        def saliency(client: int) -> float:
            context.layout.load(module, context.global_state, context.global_integers)  # θ^0
            if self.uses_model and self.warmup_epochs > 0:
                context.local_train(client, self.warmup_epochs, int(seeds[client]), full_batches=True)
            return self.client_saliency(context, module, client)

        weights = torch.tensor(context.map_clients(saliency, range(num_clients)), dtype=torch.float64)
        context.layout.load(module, context.global_state, context.global_integers)
        return weights

    def client_saliency(self, context: RunContext, module: LightningModule, client: int) -> float:
        """R_k = Σ_l τ^{l−1} Σ_i N_{i,l} over the client's training set, with the module's current weights."""
        precision = context.precision
        was_training = module.training
        module.eval()
        totals: torch.Tensor | None = None  # Σ_i N_{i,l}, [L] float64
        for inputs, targets in self._batches(context, client):
            inputs = precision.convert_input(inputs)
            with precision.forward_context():
                norms = saliency_norms(module, inputs, targets, guided=self.guided)  # [B, L]; forward gives logits
            batch_totals = norms.sum(dim=0, dtype=torch.float64)
            totals = batch_totals if totals is None else totals + batch_totals
        module.train(was_training)
        assert totals is not None, f"client {client} has no training samples"
        return float(layer_weights(len(totals), self.tau).to(totals.device) @ totals)

    def _batches(self, context: RunContext, client: int):
        """The client's training set in a fixed order, in batches of at most ``batch_size`` images."""
        for inputs, targets in context.datamodule.client_batches(client):
            for start in range(0, len(targets), self.batch_size):
                yield inputs[start : start + self.batch_size], targets[start : start + self.batch_size]

    # -- rounds ----------------------------------------------------------------------------------------
    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Dynamic mode: R_k of the trained local model."""
        if self.mode == "dynamic":
            update.payload["saliency"] = self.client_saliency(context, module, update.client)

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        """R_k (Eq. 9)."""
        if self.mode == "dynamic":
            return (update.payload["saliency"],)
        assert self.saliency is not None, f"{type(self).__name__}.client_weights ran before on_fit_start"
        return (float(self.saliency[update.client]),)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """θ^r + η(Σ R_k θ_k / Σ R_k − θ^r) on parameters (Eq. 10); the R-weighted average on buffers."""
        if self.server_lr == 1.0:
            return aggregate
        return self.parameter_step(global_state, aggregate, self.server_lr)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The weights applied this round, R_k / Σ R_k, against FedAvg's n_k / Σ n_k."""
        if not updates:
            return {}
        saliency = np.array([u.weights[0] for u in updates])
        sizes = np.array([u.num_samples for u in updates], dtype=np.float64)
        weights = saliency / saliency.sum()
        name = type(self).__name__.lower()
        return {
            f"{name}/weight_max": float(weights.max()),
            f"{name}/weight_min": float(weights.min()),
            f"{name}/weight_minus_fedavg_l1": float(np.abs(weights - sizes / sizes.sum()).sum()),
        }

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The static R_k of every client, once computed."""
        return {} if self.saliency is None else {"saliency": self.saliency.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saliency = state["saliency"].clone() if "saliency" in state else None
