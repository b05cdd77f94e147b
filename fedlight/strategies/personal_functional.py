"""The maths of the personalised rules whose clients take gradient steps at parameters other than the module's own:
pFedMe's inner solve of the Moreau envelope and Per-FedAvg's MAML step.

Each function reads the client's task loss f(θ; batch), ``training_step``'s ``loss``, at parameter values θ that it is
given (``torch.func.functional_call``), so the module's own parameters stay as they are; its buffers and its other
parameters are its own. Parameters come as a list of names (:func:`~fedlight.strategies.stateful_functional.
parameter_names`) and a list of tensors in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call


class _TaskLoss(nn.Module):
    """``training_step``'s task loss as a module call, so that ``functional_call`` can put other values in its
    parameters."""

    def __init__(self, client: nn.Module) -> None:
        super().__init__()
        self.client = client

    def forward(self, batch: Any) -> torch.Tensor:
        return self.client.training_step(batch, 0)["loss"]


def task_gradients(
    module: nn.Module, names: Sequence[str], values: Sequence[torch.Tensor], batch: Any
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """∇_θ f(θ; batch) at θ = ``values`` (the module's parameters ``names``), and f(θ; batch), both detached.

    A forward pass in train mode moves BatchNorm statistics and draws dropout as any training step does.

    >>> from fedlight.testing import ScalarClient
    >>> batch = (torch.zeros(2, 1), torch.tensor([3.0, 3.0]))  # f(w) = ½(w − 3)²
    >>> grads, loss = task_gradients(ScalarClient(), ["w"], [torch.tensor(1.0)], batch)
    >>> grads[0].item(), loss.item()
    (-2.0, 2.0)
    """
    leaves = [value.detach().requires_grad_() for value in values]
    with torch.enable_grad():
        loss = functional_call(
            _TaskLoss(module), {f"client.{name}": leaf for name, leaf in zip(names, leaves, strict=True)}, (batch,)
        )
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    # a parameter the loss does not reach has a zero gradient
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True)]
    return [g.detach() for g in grads], loss.detach()


def moreau_inner_solve(
    module: nn.Module,
    names: Sequence[str],
    theta: Sequence[torch.Tensor],
    anchor: Sequence[torch.Tensor],
    batch: Any,
    lam: float,
    lr: float,
    steps: int,
) -> list[torch.Tensor]:
    """θ̂ ≈ argmin_θ h(θ) = f(θ; batch) + (λ/2)‖θ − w‖² by ``steps`` steps of gradient descent from ``theta``, with
    w = ``anchor``: pFedMe's personal model (Algorithm 1's inner problem)::

        θ ← θ − lr (∇f(θ; batch) + λ (θ − w))

    >>> from fedlight.testing import ScalarClient
    >>> batch = (torch.zeros(1, 1), torch.tensor([2.0]))  # f(θ) = ½(θ − 2)²: h's minimum is (2 + λw)/(1 + λ)
    >>> zero = [torch.tensor(0.0)]
    >>> moreau_inner_solve(ScalarClient(), ["w"], zero, zero, batch, lam=1.0, lr=0.5, steps=1)[0].item()
    1.0
    >>> round(moreau_inner_solve(ScalarClient(), ["w"], zero, zero, batch, lam=3.0, lr=0.1, steps=50)[0].item(), 4)
    0.5
    """
    theta = [t.detach() for t in theta]
    anchor = [w.detach() for w in anchor]
    for _ in range(steps):
        grads, _ = task_gradients(module, names, theta, batch)
        theta = [t - lr * (g + lam * (t - w)) for t, g, w in zip(theta, grads, anchor, strict=True)]
    return theta


def maml_direction(
    module: nn.Module,
    names: Sequence[str],
    w: Sequence[torch.Tensor],
    grad_w: Sequence[torch.Tensor],
    batch: Any,
    alpha: float,
    hessian_batch: Any | None = None,
    delta: float = 1e-3,
) -> list[torch.Tensor]:
    """Per-FedAvg's step direction at w, from ∇f(w; D) = ``grad_w``, D' = ``batch`` and D'' = ``hessian_batch``.

    With g = ∇f(w − α ∇f(w; D); D'), the first-order direction (no ``hessian_batch``) is g and the Hessian-free
    one is (I − α ∇²f(w; D'')) g, its Hessian-vector product by the central difference

        ∇²f(w; D'') g ≈ (∇f(w + δ g; D'') − ∇f(w − δ g; D'')) / (2δ).

    >>> from fedlight.testing import ScalarClient
    >>> batch = (torch.zeros(1, 1), torch.tensor([2.0]))  # f(w) = ½(w − 2)², ∇²f = 1
    >>> w, grad_w = [torch.tensor(0.0)], [torch.tensor(-2.0)]
    >>> maml_direction(ScalarClient(), ["w"], w, grad_w, batch, alpha=0.5)[0].item()  # temp = 1, g = −1
    -1.0
    >>> hessian_free = maml_direction(ScalarClient(), ["w"], w, grad_w, batch, alpha=0.5, hessian_batch=batch)
    >>> round(hessian_free[0].item(), 4)  # (1 − α·1)·g; the difference quotient costs fp32 digits
    -0.5
    """
    w = [p.detach() for p in w]
    temp = [p - alpha * g for p, g in zip(w, grad_w, strict=True)]  # one step of α on D
    outer, _ = task_gradients(module, names, temp, batch)
    if hessian_batch is None:
        return outer
    plus, _ = task_gradients(module, names, [p + delta * g for p, g in zip(w, outer, strict=True)], hessian_batch)
    minus, _ = task_gradients(module, names, [p - delta * g for p, g in zip(w, outer, strict=True)], hessian_batch)
    return [g - alpha * (a - b) / (2 * delta) for g, a, b in zip(outer, plus, minus, strict=True)]  # (I − α H) g
