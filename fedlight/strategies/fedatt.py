"""FedAtt: Ji et al., *Learning Private Neural Language Modeling with Attentive Aggregation*, IJCNN 2019.

Layer-wise attentive aggregation, as in ``shaoxiongji/fed-att``. For every tensor l of the model,
with w the server's model and w_k client k's:

    s_k^l = ‖w^l − w_k^l‖₂                                        (L2 norm of the flattened tensor)
    α_k^l = softmax_k(s_k^l)                                      (farther clients get *more* weight)
    w^{l,t+1} = w^l − ε Σ_k α_k^l (w^l − w_k^l) + σ·N(0, I)       (ε = 1, σ = 0.001 by default)

The official code takes scipy's ``ord=2``, a spectral norm for matrices that fails on 4-D kernels; the
flattened (Frobenius) norm is used instead. Floating-point buffers (BatchNorm running statistics) are
statistics rather than weights: they take FedAvg's n_k-weighted average, without noise. Integer
buffers are copied by the context. Stragglers are dropped by default, as in the prototype-margin
paper's FedAtt row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from fedlight.errors import ConfigError
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.functional import weighted_average

if TYPE_CHECKING:
    from fedlight.context import RunContext


def attentive_step(server: torch.Tensor, clients: torch.Tensor, epsilon: float = 1.0) -> torch.Tensor:
    """Returns one tensor's FedAtt update w − ε Σ_k softmax_k(‖w − w_k‖₂) (w − w_k), without noise.

    Args:
        server: ``[n]`` the server's flattened tensor w^l.
        clients: ``[K, n]`` the clients' flattened tensors w_k^l.
        epsilon: ε, the server's step size.

    With ε = 1 the result is the attention-weighted mean Σ_k α_k w_k; here s = (5, 0), so α ≈ (0.9933, 0.0067):

    >>> attentive_step(torch.zeros(2), torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    tensor([2.9799, 3.9732])
    """
    deltas = server - clients  # w − w_k, [K, n]
    attention = torch.linalg.vector_norm(deltas, dim=1).softmax(dim=0)  # α_k, [K]
    return server - epsilon * (attention @ deltas)


class FedAtt(Strategy):
    """Layer-wise attention over the clients' distances to the server model, plus Gaussian noise.

    The noise of round t is drawn from the trainer's strategy stream for t, so runs are reproducible
    and a resumed run draws the same noise.

    Args:
        epsilon: ε > 0, the server's step size towards the attention-weighted clients; with ε = 1 the new
            model is the attention-weighted mean of the client models.
        sigma: σ ≥ 0, the standard deviation of the Gaussian noise added to every parameter (σ_dp of the
            paper's differential-privacy variant); 0 disables it.
        tolerate_stragglers: aggregate stragglers' partial work (F' < F epochs); ``null`` drops them, as
            FedAvg does in the paper's comparison.
        sampling: how the round's clients are drawn: ``proportional`` to n_k without replacement
            (the prototype-margin paper) or ``uniform``.
    """

    gather_states = True

    def __init__(
        self,
        epsilon: float = 1.0,
        sigma: float = 0.001,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not epsilon > 0:
            problems.append(
                f"Expected --strategy.init_args.epsilon > 0, got {epsilon}. "
                "It is the server's step size; the paper uses 1."
            )
        if not sigma >= 0:
            problems.append(
                f"Expected --strategy.init_args.sigma ≥ 0, got {sigma}. "
                "It is the noise's standard deviation; 0 disables it."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.epsilon = epsilon
        self.sigma = sigma
        self._tensors: list[tuple[slice, bool]] = []  # per layout entry: its flat slice, whether it is a buffer
        self._noise: np.random.Generator | None = None  # this round's strategy stream

    def on_fit_start(self, context: RunContext) -> None:
        buffers = {name for name, _ in context.module.named_buffers()}
        self._tensors = [(slice(e.offset, e.offset + e.numel), e.name in buffers) for e in context.layout.entries]

    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        self._noise = context.strategy_rng(round_idx)

    def aggregate_states(
        self, global_state: torch.Tensor, states: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        assert self._tensors and self._noise is not None, "aggregate_states ran before on_fit_start/on_round_start"
        sizes = torch.tensor([float(u.num_samples) for u in updates], device=states.device)  # n_k, [K]
        new = torch.empty_like(global_state)  # [P]
        # One tensor at a time: peak memory is K × the largest tensor, and each norm sums pairwise in fp32.
        for where, is_buffer in self._tensors:
            if is_buffer:
                new[where] = weighted_average(states[:, where], sizes)
                continue
            tensor = attentive_step(global_state[where], states[:, where], self.epsilon)  # [n_l]
            if self.sigma > 0:
                noise = self._noise.standard_normal(tensor.numel(), dtype=np.float32)  # drawn in layout order
                tensor += self.sigma * torch.from_numpy(noise).to(tensor.device)
            new[where] = tensor
        return new
