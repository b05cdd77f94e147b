"""The maths of the rules that keep per-client state (SCAFFOLD, FedDyn), as pure tensor functions.

States are flat ``[P]`` vectors laid out as :class:`~fedlight.state.FlatState`; the rules apply these to the
parameters' entries and leave floating-point buffers (BatchNorm statistics) to the plain average.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fedlight.state import FlatState


class _LinearTerm(torch.autograd.Function):
    """Σ_i ⟨d_i, p_i⟩ as one node, whose gradient with respect to p_i is d_i.

    Its context is set up apart from its forward pass, as ``torch.func``'s transforms need.
    """

    @staticmethod
    def forward(coefficients: Sequence[torch.Tensor], *params: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [torch.vdot(d.reshape(-1), p.reshape(-1)) for d, p in zip(coefficients, params, strict=True)]
        ).sum()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.coefficients = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return None, *torch._foreach_mul(list(ctx.coefficients), grad)


def linear_term(params: Sequence[torch.Tensor], coefficients: Sequence[torch.Tensor]) -> torch.Tensor:
    """Returns Σ_i ⟨d_i, p_i⟩, differentiable in ``params`` with gradient d_i: added to a loss, it shifts every
    gradient by d (SCAFFOLD's correction c − c_k, FedDyn's −∇L_k(θ_k^{t−1})).

    Args:
        params: the trainable tensors p_i.
        coefficients: d_i, detached, of the same shapes.

    >>> p = torch.tensor([1.0, 2.0], requires_grad=True)
    >>> term = linear_term([p], [torch.tensor([3.0, -1.0])])
    >>> term.backward()
    >>> term.item(), p.grad.tolist()
    (1.0, [3.0, -1.0])
    """
    # the run's states are fp32; under --trainer.precision=64-true the parameters are fp64
    coefficients = [d if d.dtype == p.dtype else d.to(p.dtype) for d, p in zip(coefficients, params, strict=True)]
    return _LinearTerm.apply(coefficients, *params)


def scaffold_control_variate(
    c_k: torch.Tensor, c: torch.Tensor, x: torch.Tensor, y_k: torch.Tensor, steps: int, lr: float
) -> torch.Tensor:
    """SCAFFOLD's new client control variate, option II (Karimireddy et al., 2020, Alg. 1, line 12):

        c_k⁺ = c_k − c + (x − y_k) / (K η_l)

    Args:
        c_k: the client's control variate ``[P]``.
        c: the server's control variate ``[P]``.
        x: the model the client received ``[P]``.
        y_k: the client's model after its ``K`` local steps ``[P]``.
        steps: K, the local steps it ran (at least 1).
        lr: η_l, the local learning rate.

    >>> x, y = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 1.0])
    >>> scaffold_control_variate(torch.zeros(2), torch.zeros(2), x, y, steps=5, lr=0.1).tolist()
    [1.0, 2.0]
    >>> scaffold_control_variate(torch.ones(2), torch.full((2,), 3.0), x, x, steps=5, lr=0.1).tolist()
    [-2.0, -2.0]
    """
    return c_k - c + (x - y_k) / (max(steps, 1) * lr)


def server_step(x: torch.Tensor, average: torch.Tensor, lr: float) -> torch.Tensor:
    """The server's step on the averaged model change (SCAFFOLD Alg. 1, line 16): x + η_g · (average − x).

    η_g = 1 takes the average as it is (FedAvg).

    >>> server_step(torch.tensor([1.0]), torch.tensor([3.0]), lr=0.5).tolist()
    [2.0]
    """
    return x + lr * (average - x)


def scaffold_server_control(c: torch.Tensor, deltas: Sequence[torch.Tensor], num_clients: int) -> torch.Tensor:
    """The server's control variate after a round (SCAFFOLD Alg. 1, line 17): c + (1/N) Σ_{k∈S} Δc_k.

    The sum runs in fp64 in the order given, so every process that sums the same deltas gets the same bits.

    Args:
        c: the server's control variate ``[P]``.
        deltas: Δc_k = c_k⁺ − c_k of the round's aggregated clients.
        num_clients: N, every client of the federation.

    >>> scaffold_server_control(torch.zeros(1), [torch.tensor([2.0]), torch.tensor([4.0])], 4).tolist()
    [1.5]
    """
    total = torch.zeros_like(c, dtype=torch.float64)
    for delta in deltas:
        total += delta.to(total)
    return (c.double() + total / num_clients).to(c.dtype)


def feddyn_client_gradient(g_k: torch.Tensor, theta_k: torch.Tensor, theta: torch.Tensor, alpha: float) -> torch.Tensor:
    """FedDyn's stored gradient of client k after its fit (Acar et al., 2021, Alg. 1, Eq. 2):

        ∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α (θ_k^t − θ^{t−1})

    which holds at the first-order optimum of the client's dynamic regulariser
    L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + (α/2)‖θ − θ^{t−1}‖².

    >>> feddyn_client_gradient(torch.zeros(2), torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0]), 0.5).tolist()
    [-0.5, -1.0]
    """
    return g_k - alpha * (theta_k - theta)


def feddyn_server(
    theta: torch.Tensor, average: torch.Tensor, h: torch.Tensor, alpha: float, participants: int, num_clients: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FedDyn's server update (Acar et al., 2021, Alg. 1): with the mean ``average`` = (1/|P_t|) Σ_{k∈P_t} θ_k^t,

        h^t = h^{t−1} − α (1/m) Σ_{k∈P_t} (θ_k^t − θ^{t−1}) = h^{t−1} − α (|P_t|/m)(average − θ^{t−1})
        θ^t = average − h^t / α

    Returns ``(θ^t, h^t)``.

    Args:
        theta: θ^{t−1}, the model the round's clients received.
        average: the unweighted mean of their models.
        h: the server state h^{t−1} (zeros before the first round).
        alpha: α > 0.
        participants: |P_t|.
        num_clients: m, every client of the federation.

    >>> theta, h = feddyn_server(torch.zeros(1), torch.tensor([2.0]), torch.zeros(1), 0.5, 2, 4)
    >>> theta.tolist(), h.tolist()
    ([3.0], [-0.5])
    """
    h = h - alpha * (participants / num_clients) * (average - theta)
    return average - h / alpha, h


def parameter_names(module: torch.nn.Module, layout: FlatState) -> list[str]:
    """The names of the parameters :func:`parameter_views` returns, in its order.

    A loss reads the parameters by these names at every call (:func:`current_parameters`), not as objects kept
    from before the fit, so that a compiled whole step, which swaps copies into the module, differentiates it.

    >>> parameter_names(torch.nn.Linear(2, 1), FlatState(torch.nn.Linear(2, 1)))
    ['weight', 'bias']
    """
    named = dict(module.named_parameters())
    return [e.name for e in layout.entries if e.name in named and named[e.name].requires_grad]


def current_parameters(module: torch.nn.Module, names: Sequence[str]) -> list[torch.Tensor]:
    """The module's parameters ``names``, as the module holds them at the call."""
    named = dict(module.named_parameters())
    return [named[name] for name in names]


def parameter_views(
    module: torch.nn.Module, layout: FlatState, flat: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The module's trainable parameters that the flat state holds, and the matching views of ``flat`` ``[P]``.

    >>> net = torch.nn.Linear(2, 1)
    >>> params, views = parameter_views(net, FlatState(net), torch.arange(3.0))
    >>> [tuple(p.shape) for p in params], [v.tolist() for v in views]
    ([(1, 2), (1,)], [[[0.0, 1.0]], [2.0]])
    """
    named = dict(module.named_parameters())
    pairs = [
        (named[e.name], flat[e.offset : e.offset + e.numel].view(e.shape))
        for e in layout.entries
        if e.name in named and named[e.name].requires_grad
    ]
    return [p for p, _ in pairs], [v for _, v in pairs]
