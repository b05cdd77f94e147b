"""FedAdagrad, FedYogi and FedAdam: Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar & McMahan, *Adaptive
Federated Optimization*, ICLR 2021 (arXiv 2003.00295), Algorithm 2.

The clients' average update Δ_t = avg_k x_k − x_t is a pseudo-gradient for an adaptive server optimiser:

    m_t = β1 m_{t−1} + (1 − β1) Δ_t,   v_t from v_{t−1} and Δ_t² (Adagrad, Yogi or Adam),
    x_{t+1} = x_t + η m_t / (√v_t + τ)

with m_{−1} = 0 and v_{−1} = τ², the smallest value Algorithm 2 admits (v_{−1} ≥ τ²). η is the server learning
rate and τ the degree of adaptivity: the larger τ, the closer the step is to momentum SGD with rate η/τ. The maths is
:func:`~fedlight.strategies.functional.adaptive_server_step`; the three rules are :class:`FedOpt` with its
``variant`` fixed.

Algorithm 2 averages the client updates uniformly over the round's clients, and samples clients uniformly;
``weighting: samples`` weighs them by n_k instead, as FedAvg and Flower do. Only parameters take the adaptive
step; floating-point buffers (BatchNorm running statistics) take the average, as in :class:`FedAvgM`. Where Flower's
strategies of the same names differ (v_{−1} = 0, bias correction, no momentum in FedAdagrad, n_k weights), see
``docs/decisions.md`` (O1–O6).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.plans import ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.functional import adaptive_server_step
from fedlight.strategies.parameters import ParameterMask

if TYPE_CHECKING:
    from fedlight.context import RunContext


class FedOpt(ParameterMask, Strategy):
    """An adaptive server optimiser over the clients' average update (Reddi et al. 2021, Algorithm 2).

    Args:
        variant: the server optimiser: ``adagrad`` (v_t = v_{t−1} + Δ²), ``yogi`` or ``adam``.
        server_lr: η > 0, the server learning rate (tuned per task in the paper).
        beta1: β1 ∈ [0, 1), the server momentum (0.9 in the paper).
        beta2: β2 ∈ [0, 1), the decay of the second moment of Yogi and Adam (0.99 in the paper; Adagrad has none).
        tau: τ > 0, the degree of adaptivity; v starts at τ² (tuned per task in the paper; 10^{-3} is the
            authors' suggested start).
        weighting: how the round's updates are averaged: ``uniform`` (Algorithm 2's 1/|S|) or ``samples`` (∝ n_k,
            as FedAvg).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    default_sampling = "uniform"
    #: The variant a subclass fixes (``None``: chosen by the ``variant`` argument).
    fixed_variant: ClassVar[str | None] = None

    def __init__(
        self,
        variant: Literal["adagrad", "yogi", "adam"] = "adam",
        server_lr: float = 1e-2,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        weighting: Literal["uniform", "samples"] = "uniform",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if variant not in ("adagrad", "yogi", "adam"):
            problems.append(f"Expected --strategy.init_args.variant in adagrad, yogi, adam, got {variant!r}.")
        if not server_lr > 0:
            problems.append(f"Expected --strategy.init_args.server_lr (η) > 0, got {server_lr}.")
        for flag, value in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= value < 1.0:
                problems.append(f"Expected --strategy.init_args.{flag} in [0, 1), got {value}; the paper's: 0.9, 0.99.")
        if not tau > 0:
            problems.append(f"Expected --strategy.init_args.tau (τ) > 0, got {tau}; larger τ is less adaptive.")
        if weighting not in ("uniform", "samples"):
            problems.append(f"Expected --strategy.init_args.weighting 'uniform' or 'samples', got {weighting!r}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.variant = variant
        self.server_lr = server_lr
        self.beta1 = beta1
        self.beta2 = beta2
        self.tau = tau
        self.weighting = weighting
        # m and v [P] (m zero and v τ² on buffers); None before the first round
        self.first_moment: torch.Tensor | None = None
        self.second_moment: torch.Tensor | None = None

    def on_fit_start(self, context: RunContext) -> None:
        self.cache_parameter_mask(context)

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        """1 for Algorithm 2's mean, n_k with ``weighting: samples``."""
        return (float(update.num_samples) if self.weighting == "samples" else 1.0,)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """x_t + η m_t / (√v_t + τ) on parameters; the average on buffers."""
        is_parameter = self.parameter_mask()
        if self.first_moment is None:
            self.first_moment = torch.zeros_like(global_state)
            self.second_moment = torch.full_like(global_state, self.tau**2)
        # buffers: Δ = 0, so their m stays 0 and the step leaves them at x_t; they take the average below
        target = torch.where(is_parameter, aggregate, global_state)
        new, self.first_moment, self.second_moment = adaptive_server_step(
            global_state,
            target,
            self.first_moment.to(global_state),
            self.second_moment.to(global_state),
            self.variant,
            self.server_lr,
            self.beta1,
            self.beta2,
            self.tau,
        )
        return torch.where(is_parameter, new, aggregate)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The mean effective step size η/(√v + τ) over parameters, to watch the adaptivity at work."""
        if self.second_moment is None or self._parameter_mask is None:
            return {}
        rates = self.server_lr / (self.second_moment[self.parameter_mask()].sqrt() + self.tau)
        return {"fedopt/step_size_mean": float(rates.mean())} if rates.numel() else {}

    def state_dict(self) -> dict[str, Any]:
        """m and v once a round has ended."""
        if self.first_moment is None:
            return {}
        return {"first_moment": self.first_moment.cpu().clone(), "second_moment": self.second_moment.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.first_moment = state["first_moment"].clone() if "first_moment" in state else None
        self.second_moment = state["second_moment"].clone() if "second_moment" in state else None


class _FixedVariant(FedOpt):
    """A :class:`FedOpt` whose ``variant`` is the class's, so a config names only the rule."""

    def __init__(
        self,
        server_lr: float = 1e-2,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        weighting: Literal["uniform", "samples"] = "uniform",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        super().__init__(self.fixed_variant, server_lr, beta1, beta2, tau, weighting, tolerate_stragglers, sampling)


class FedAdagrad(_FixedVariant):
    """FedOpt with Adagrad on the server: v_t = v_{t−1} + Δ_t² (Algorithm 2, line 12); ``beta2`` is unused.

    Args:
        server_lr: η > 0, the server learning rate.
        beta1: β1 ∈ [0, 1), the server momentum (0.9 in the paper).
        beta2: unused by Adagrad; accepted so that configs may switch between the three rules.
        tau: τ > 0, the degree of adaptivity; v starts at τ².
        weighting: ``uniform`` (Algorithm 2's mean) or ``samples`` (∝ n_k).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    fixed_variant = "adagrad"


class FedYogi(_FixedVariant):
    """FedOpt with Yogi on the server: v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²) (Algorithm 2, line 13).

    Args:
        server_lr: η > 0, the server learning rate.
        beta1: β1 ∈ [0, 1), the server momentum (0.9 in the paper).
        beta2: β2 ∈ [0, 1), the decay of the second moment (0.99 in the paper).
        tau: τ > 0, the degree of adaptivity; v starts at τ².
        weighting: ``uniform`` (Algorithm 2's mean) or ``samples`` (∝ n_k).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    fixed_variant = "yogi"


class FedAdam(_FixedVariant):
    """FedOpt with Adam on the server: v_t = β2 v_{t−1} + (1 − β2) Δ_t² (Algorithm 2, line 14), no bias correction.

    Args:
        server_lr: η > 0, the server learning rate.
        beta1: β1 ∈ [0, 1), the server momentum (0.9 in the paper).
        beta2: β2 ∈ [0, 1), the decay of the second moment (0.99 in the paper).
        tau: τ > 0, the degree of adaptivity; v starts at τ².
        weighting: ``uniform`` (Algorithm 2's mean) or ``samples`` (∝ n_k).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in the paper.
    """

    fixed_variant = "adam"
