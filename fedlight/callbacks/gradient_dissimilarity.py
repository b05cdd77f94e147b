"""Gradient dissimilarity of the clients at the global model (Michieli & Ozay, Fig. 2 row 3).

At the start of round t, with the global model W^t and every client k ∈ K (all of them, not only the sampled
ones), ∇L_k is the full-batch gradient of client k's mean training loss, and

    ∇L = Σ_k (n_k / n) ∇L_k,        dissimilarity = (1/|K|) Σ_k ‖∇L_k − ∇L‖²,

as in ``litian96/FedProx:flearn/trainers/fedprox.py``: the global gradient weights clients by sample count,
the squared deviations are averaged uniformly over clients.

No K gradient vectors are kept. With g_k = ∇L_k, ḡ = ∇L and Σ_k w_k = 1 (w_k = n_k/n), expanding the square,

    (1/K) Σ_k ‖g_k − ḡ‖² = (1/K) Σ_k ‖g_k‖² − 2 ḡ · (1/K) Σ_k g_k + ‖ḡ‖²,

so three running sums, Σ_k n_k g_k, Σ_k g_k and Σ_k ‖g_k‖², give the value (:func:`dissimilarity_from_sums`).
They are additive, so processes split the clients and one all-reduce merges the sums.

Mode: the gradients are taken in **eval mode**. The paper does not say; eval mode makes the measurement
deterministic and side-effect free (no dropout draws, no BatchNorm running-statistics update, which would
change the model the next round starts from). For models without dropout or BatchNorm, such as the Synthetic
MLP, train and eval mode give the same gradient. The loss is the client's task loss (``training_step``'s
``loss``), without a strategy's extra terms such as FedProx's proximal term, which is 0 at W^t anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fedlight.callbacks.base import RoundCallback
from fedlight.errors import ConfigError

if TYPE_CHECKING:
    from fedlight.context import RunContext


def dissimilarity_from_sums(sum_sq_norms: Tensor, sum_grads: Tensor, mean_grad: Tensor, num_clients: int) -> Tensor:
    """(1/K) Σ_k ‖g_k − ḡ‖² from running sums, for any ḡ (here the sample-weighted mean gradient).

    (1/K) Σ_k ‖g_k − ḡ‖² = (1/K) Σ_k ‖g_k‖² − 2 ḡ · (1/K) Σ_k g_k + ‖ḡ‖². Pass float64 sums: the terms can be
    much larger than their difference.

    Args:
        sum_sq_norms: scalar Σ_k ‖g_k‖².
        sum_grads: ``[P]`` Σ_k g_k.
        mean_grad: ``[P]`` ḡ = Σ_k (n_k/n) g_k.
        num_clients: K.

    Returns:
        Scalar (1/K) Σ_k ‖g_k − ḡ‖², clamped at 0 against rounding.

    Example:
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)  # two clients, n = (1, 3)
        >>> mean = (1 * g[0] + 3 * g[1]) / 4  # [0.25, 1.5]
        >>> # ‖g_0 − ḡ‖² = 0.5625 + 2.25, ‖g_1 − ḡ‖² = 0.0625 + 0.25; their mean:
        >>> dissimilarity_from_sums(g.square().sum(), g.sum(dim=0), mean, 2).item()
        1.5625
    """
    value = sum_sq_norms / num_clients - 2 * mean_grad.dot(sum_grads) / num_clients + mean_grad.dot(mean_grad)
    return value.clamp(min=0)


class GradientDissimilarity(RoundCallback):
    """Logs ``analysis/gradient_dissimilarity``, (1/|K|) Σ_k ‖∇L_k(W^t) − ∇L(W^t)‖², of each due round.

    The value is measured at the start of round t on W^t and added to round t's metrics. The measurement
    leaves training untouched: it runs under a forked RNG, in eval mode, and restores the module's mode and
    the parameters' ``.grad``.

    Args:
        every_n_rounds: measure in every this many rounds (and in the last one). One measurement is a
            forward and backward pass of W^t over every client's training split.
    """

    def __init__(self, every_n_rounds: int = 1) -> None:
        if every_n_rounds < 1:
            raise ConfigError(
                "Expected --trainer.callbacks (fedlight.callbacks.GradientDissimilarity) init_args.every_n_rounds "
                f"≥ 1, got {every_n_rounds}. 1 measures in every round."
            )
        self.every_n_rounds = every_n_rounds
        self._measured: tuple[int, float] | None = None  # (round, value) between the round's start and end

    def on_round_start(self, context: RunContext, round_idx: int) -> None:
        """Measures the dissimilarity at W^t when the round is due."""
        self._measured = None
        if not context.due(round_idx, self.every_n_rounds):
            return
        self._measured = (round_idx, gradient_dissimilarity(context).item())

    def on_round_end(self, context: RunContext, round_idx: int, metrics: dict[str, Any]) -> None:
        """Adds the value measured at the start of this round."""
        if self._measured is not None and self._measured[0] == round_idx:
            metrics["analysis/gradient_dissimilarity"] = self._measured[1]
        self._measured = None


def gradient_dissimilarity(context: RunContext) -> Tensor:
    """(1/|K|) Σ_k ‖∇L_k − ∇L‖² at the trainer's global model W^t over all its clients (float64 scalar)."""
    data, device = context.datamodule, context.device
    module = context.module
    was_training = module.training
    context.global_module()  # W^t, eval mode
    params = [p for p in module.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    numel = sum(p.numel() for p in params)

    def client_sums(client: int) -> Tensor:  # [n_k g_k (P), g_k (P), ‖g_k‖² (1)]
        grad = _full_batch_gradient(context, params, client).double()  # g_k, [P]
        return torch.cat([grad * float(data.num_samples[client]), grad, grad.dot(grad)[None]])

    sums = torch.zeros(2 * numel + 1, dtype=torch.float64, device=device)  # the three running sums
    cuda_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices), torch.enable_grad():
        sums = context.sum_over_clients(client_sums, range(data.num_clients), sums)
    for p, grad in zip(params, saved_grads, strict=True):
        p.grad = grad
    module.train(was_training)
    mean_grad = sums[:numel] / float(data.num_samples.sum())  # ∇L = Σ_k (n_k/n) ∇L_k
    return dissimilarity_from_sums(sums[-1], sums[numel:-1], mean_grad, data.num_clients)


def _full_batch_gradient(context: RunContext, params: list[torch.nn.Parameter], client: int) -> Tensor:
    """``[P]`` gradient of client ``client``'s mean training loss, from batch means weighted by batch size."""
    data, precision, module = context.datamodule, context.precision, context.module
    num_samples = int(data.num_samples[client])
    for p in params:
        p.grad = None
    for batch_idx, batch in enumerate(data.client_batches(client, split="train")):
        batch = precision.convert_input(batch)
        with precision.forward_context():
            loss = module.training_step(batch, batch_idx)["loss"]  # mean over the batch
        (loss.float() * (len(batch[1]) / num_samples)).backward()  # Σ_b (B_b/n_k) L_b = L_k
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
