"""Per-FedAvg: Fallah, Mokhtari & Ozdaglar, *Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach*, NeurIPS 2020, Algorithm 1 with its first-order (FO) and Hessian-free (HF)
approximations.

The global model is trained for the MAML objective F(w) = (1/n) Σ_i f_i(w − α ∇f_i(w)): a model from which one step
of α on a client's own data is a good personal model. Every local step of client i draws three independent batches
D, D', D'' and takes

    temp = w − α ∇f_i(w; D)
    w ← w − β (I − α ∇²f_i(w; D'')) ∇f_i(temp; D')

which FO approximates by dropping the Hessian term, w ← w − β ∇f_i(temp; D'), and HF by the central difference
∇²f_i(w; D'') g ≈ (∇f_i(w + δ g; D'') − ∇f_i(w − δ g; D'')) / (2δ) with g = ∇f_i(temp; D'). The server averages the
round's clients, drawn uniformly, with 1/S. Each client is scored with w − α ∇f_i(w; D) of the global model w, one
step of α on a batch D of its own training data (``clients/personal/*``).

In the engine, D is the batch the local fit draws; D' and D'' come from a stream of the client's training batches of
its own, shuffled from the client's seed of the round, each of ``--data.batch_size``. ``training_loss`` returns
⟨w, d⟩ with d the step's direction, so the client's optimizer steps along d: with plain SGD its lr is β and the step
is the one above exactly (with momentum or weight decay the direction goes through them). The personalisation step
of the evaluation reads the gradient in eval mode (no dropout, and the BatchNorm statistics the scored model uses),
on one batch drawn from the client's seed of the round, so the scores are reproducible.

The widely used implementation in the pFedMe authors' code (not Per-FedAvg's authors') takes two consecutive batches
of one stream per local step and no Hessian term (FO), and personalises at evaluation with two steps (α, then β);
we follow the paper.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.strategies.base import Strategy
from fedlight.strategies.personal_functional import maml_direction, task_gradients
from fedlight.strategies.stateful_functional import (
    current_parameters,
    linear_term,
    parameter_names,
    parameter_views,
)

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate

_OUTER_STREAM = 3  # D' and D'' of the local steps, apart from the fit's own batches (D)
_PERSONAL_STREAM = 4  # the evaluation's personalisation batch


class PerFedAvg(Strategy):
    """FedAvg of MAML steps; each client's own model is one step of α from the global model on its data.

    Args:
        variant: ``hessian_free`` (HF) keeps the Hessian term by a finite difference, ``first_order`` (FO) drops it.
        alpha: α ≥ 0, the personalisation step, inside the local steps and at evaluation (0 is FedAvg's
            objective). The outer step β is the client optimizer's lr.
        delta: δ > 0, the finite difference of the Hessian-vector product (HF only).
        weighting: ``uniform`` averages the round's clients with 1/S, as the paper; ``samples`` by n_i.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    personalised = True
    default_sampling = "uniform"

    def __init__(
        self,
        variant: Literal["hessian_free", "first_order"] = "hessian_free",
        alpha: float = 0.01,
        delta: float = 0.001,
        weighting: Literal["uniform", "samples"] = "uniform",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if variant not in ("hessian_free", "first_order"):
            problems.append(f"Expected --strategy.init_args.variant hessian_free or first_order, got {variant!r}.")
        if not alpha >= 0:
            problems.append(f"Expected --strategy.init_args.alpha (α) ≥ 0, got {alpha}; 0 is FedAvg's objective.")
        if not delta > 0:
            problems.append(
                f"Expected --strategy.init_args.delta (δ) > 0, got {delta}; the finite difference needs a small step."
            )
        if weighting not in ("uniform", "samples"):
            problems.append(f"Expected --strategy.init_args.weighting uniform or samples, got {weighting!r}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.variant, self.alpha, self.delta, self.weighting = variant, alpha, delta, weighting
        self._fit: tuple[list[str], Iterator[Any]] | None = None  # during a fit: parameter names, D' and D''

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        if not module.automatic_optimization:
            return [
                f"PerFedAvg steps the client's optimizer along its MAML direction through its loss, but "
                f"{type(module).__name__} runs its own optimizer steps; choose a client with automatic optimization."
            ]
        return []

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        # The own model is derived from W^t at evaluation; the engine scores own models only for rules that keep
        # per-client state, so the rule keeps the one number it has of each client: the rounds it trained in.
        return {"rounds": Slot.vector(1)}

    def personal_state(
        self, context: RunContext, client: int, values: Mapping[str, torch.Tensor], start: torch.Tensor
    ) -> torch.Tensor:
        """w − α ∇f_i(w; D) on one batch D of the client's training data, the gradient read in eval mode."""
        if not context.datamodule.num_batches(client):  # no training batch to take the step on
            return start
        module, layout = context.module, context.layout
        layout.load(module, start)  # the buffers the step's forward pass reads
        names = parameter_names(module, layout)
        batch = next(self._batches(context, client, _PERSONAL_STREAM, transform=False))
        modes = {child: child.training for child in module.modules()}
        module.eval()
        try:
            with context.precision.forward_context():
                grads, _ = task_gradients(module, names, current_parameters(module, names), batch)
        finally:
            for child, training in modes.items():
                child.train(training)
        personal = start.clone()
        _, views = parameter_views(module, layout, personal)
        for view, grad in zip(views, grads, strict=True):
            view.sub_(self.alpha * grad.to(view))
        return personal

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        names = parameter_names(module, context.layout)
        self._fit = names, self._batches(context, plan.client, _OUTER_STREAM, transform=True)

    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """⟨w, d⟩ with d the MAML direction at w: its gradient is d."""
        assert self._fit is not None, "PerFedAvg.training_loss ran outside a local fit"
        names, extra = self._fit
        params = current_parameters(module, names)
        grads = torch.autograd.grad(outputs["loss"], params, allow_unused=True)  # ∇f(w; D)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)]
        outer = next(extra)  # D'
        hessian = next(extra) if self.variant == "hessian_free" else None  # D''
        direction = maml_direction(module, names, params, grads, outer, self.alpha, hessian, self.delta)
        return linear_term(params, direction)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        assert self._fit is not None, "PerFedAvg.on_client_fit_end ran outside a local fit"
        context.client_state["rounds"] = context.client_state["rounds"] + 1
        self._fit = None

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        return (1.0 if self.weighting == "uniform" else float(update.num_samples),)

    def _batches(self, context: RunContext, client: int, stream: int, transform: bool) -> Iterator[Any]:
        """Endless epochs of the client's training batches, shuffled from its seed of the round and ``stream``."""
        seed = np.random.SeedSequence(context.client_seed(context.round, client), spawn_key=(stream,))
        generator = torch.Generator().manual_seed(int(seed.generate_state(1, dtype=np.uint64)[0] >> 1))
        data, precision = context.datamodule, context.precision
        assert data.num_batches(client), f"client {client} has no training batch to draw"
        while True:
            for batch in data.train_batches(client, generator):
                if transform:  # as the fit's own batches are
                    batch = self.transform_batch(context, client, batch)
                yield precision.convert_input(batch)
