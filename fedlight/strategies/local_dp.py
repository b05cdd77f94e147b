"""Local differential privacy around any rule: every client clips its update and adds noise before sending it.

The mechanism of Flower's ``LocalDpMod(clipping_norm, sensitivity, epsilon, delta)``: client k's update
Δ_k = θ_k − W_k (trained minus received, over every floating-point entry it sends: parameters and float buffers
such as BatchNorm statistics) is clipped to L2 norm C, and noise is added to what it sends:

    θ̃_k = W_k + Δ_k · min(1, C/‖Δ_k‖₂) + ξ_k,

- ``gaussian``: ξ_k ~ N(0, σ² I), σ = Δ₂ √(2 ln(1.25/δ)) / ε, the classic Gaussian mechanism (Dwork & Roth, *The
  Algorithmic Foundations of Differential Privacy*, 2014, Thm. A.1), (ε, δ)-DP for ε < 1 only: larger ε are
  refused rather than given noise that does not bound them;
- ``laplace``: ξ_k ~ Laplace(0, b) per coordinate, b = Δ₁ / ε, the Laplace mechanism (ibid., Thm. 3.6), ε-DP.

The server, and everyone after it, sees only θ̃_k: per round that a client takes part in, its state is an (ε, δ)-
(or ε-) DP release of *all* its local data (local DP: any two datasets of the client are neighbours). The
sensitivity is therefore, by default, the most two clipped updates can differ by: Δ₂ = 2C, and Δ₁ = 2C√P for the
Laplace mechanism (P entries; an L2 ball of radius C reaches L1 norm C√P). ``sensitivity`` sets it instead, as
``LocalDpMod`` requires; below those bounds the guarantee holds only for datasets whose updates differ by less,
which is warned about.

Over the rounds a client takes part in, its guarantees compose, accounted with ``dp-accounting``
(:func:`local_dp_epsilon`): r Gaussian mechanisms of noise multiplier z = σ/Δ₂ by the RDP or PLD accountant;
r Laplace mechanisms as min(rε, the accountant's ε(δ) of r Laplace mechanisms of parameter 1/ε), basic
composition alone for δ = 0. Each client's ε(δ) is reported (:class:`~fedlight.strategies.client_privacy.
ClientPrivacy`) and kept across a resume.

Not covered: what the engine reports besides the state (n_k as the aggregation weight, the mean training loss,
integer buffers such as BatchNorm's step count) and the wrapped rule's payloads. Departures from ``LocalDpMod``:
``mechanism`` and an accountant are added; σ is refused for ε ≥ 1 and δ ∉ (0, 1); the sensitivity has a default;
the noise comes from a secret or seeded generator, not NumPy's global one; clipping and noise cover the float
entries only (integer buffers are sent as they are).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.client_privacy import Accountant, ClientPrivacy
from fedlight.strategies.dp import clip_update, dp_epsilon
from fedlight.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext

Mechanism = Literal["gaussian", "laplace"]


def gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """σ = Δ₂ √(2 ln(1.25/δ)) / ε of the classic Gaussian mechanism, (ε, δ)-DP for ε < 1.

    >>> round(gaussian_sigma(2.0, 0.5, 1e-5), 4)  # 2 · 4.8448 / 0.5
    19.3792
    """
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def laplace_noise(shape: tuple[int, ...], scale: float, generator: torch.Generator) -> torch.Tensor:
    """fp64 Laplace(0, b) draws, as b(E₁ − E₂) of two standard exponential draws (torch's Laplace takes no generator).

    >>> noise = laplace_noise((100_000,), 2.0, torch.Generator().manual_seed(0))
    >>> round(noise.abs().mean().item(), 1)  # E|ξ| = b
    2.0
    """
    first = torch.empty(shape, dtype=torch.float64).exponential_(generator=generator)
    second = torch.empty(shape, dtype=torch.float64).exponential_(generator=generator)
    return scale * (first - second)


def local_dp_epsilon(
    mechanism: Mechanism, epsilon: float, delta: float, rounds: int, accountant: Accountant = "rdp"
) -> float:
    """ε(δ) of a client after ``rounds`` releases, each (ε, δ)-DP by the mechanism's calibration.

    Args:
        mechanism: ``gaussian``: each release is the Gaussian mechanism of noise multiplier √(2 ln(1.25/δ)) / ε;
            ``laplace``: the Laplace mechanism of parameter 1/ε (scale over L1 sensitivity).
        epsilon: ε of one release.
        delta: δ of one Gaussian release and of the reported ε(δ).
        rounds: r, the releases composed.
        accountant: ``rdp`` or ``pld`` (``dp-accounting``).

    >>> local_dp_epsilon("laplace", 0.5, 0.0, 3)  # basic composition: rε
    1.5
    """
    if rounds == 0:
        return 0.0
    if mechanism == "gaussian":
        return dp_epsilon(1.0, gaussian_sigma(1.0, epsilon, delta), rounds, delta, accountant)
    basic = rounds * epsilon
    if delta == 0:
        return basic
    import dp_accounting

    if accountant == "rdp":
        account = dp_accounting.rdp.RdpAccountant()
    else:
        account = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        account.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.LaplaceDpEvent(1.0 / epsilon), rounds))
        return min(basic, float(account.get_epsilon(delta)))
    finally:
        absl.setLevel(level)


class LocalDP(ClientPrivacy):
    """Every client clips its update to norm C and adds Gaussian or Laplace noise before sending it.

    Args:
        rule: the wrapped rule (every hook, weights and server update stay its own); ``null`` is FedAvg.
        clip_norm: C > 0, the L2 norm every client's update is clipped to.
        epsilon: ε > 0 of one release (a client's state in one round); below 1 for ``gaussian``.
        delta: δ of one Gaussian release, in (0, 1), and of the reported cumulative ε(δ); ``laplace`` takes 0
            (then ε is composed by rε alone).
        mechanism: ``gaussian`` (σ = Δ₂ √(2 ln(1.25/δ)) / ε) or ``laplace`` (b = Δ₁ / ε).
        sensitivity: Δ, the L2 (``gaussian``) or L1 (``laplace``) sensitivity the noise is calibrated to;
            ``null`` is the most two clipped updates differ by: 2C, or 2C√P for ``laplace`` (P float entries).
        accountant: ``rdp`` or ``pld``, composing a client's rounds (``dp-accounting``).
        insecure_seeded_noise: draw the noise from ``--seed_everything`` rather than from a secret, so that a run
            is reproducible from its configuration alone (simulation only: whoever has the configuration can
            subtract the noise). False: a secret drawn from the operating system, kept only in the checkpoint.
    """

    metric_prefix = "local_dp"
    noise_stream = 5  # apart from the streams other rules draw from the client's round seed (1–4)

    def __init__(
        self,
        rule: Strategy | None = None,
        clip_norm: float = 1.0,
        epsilon: float = 0.5,
        delta: float = 1e-5,
        mechanism: Mechanism = "gaussian",
        sensitivity: float | None = None,
        accountant: Accountant = "rdp",
        insecure_seeded_noise: bool = False,
    ) -> None:
        problems = []
        if mechanism not in ("gaussian", "laplace"):
            problems.append(f"Expected --strategy.init_args.mechanism gaussian or laplace, got {mechanism!r}.")
        if not clip_norm > 0:
            problems.append(f"Expected --strategy.init_args.clip_norm (C) > 0, got {clip_norm}.")
        if not epsilon > 0:
            problems.append(f"Expected --strategy.init_args.epsilon (ε) > 0, got {epsilon}.")
        elif mechanism == "gaussian" and not epsilon < 1:
            problems.append(
                f"--strategy.init_args.epsilon (ε) = {epsilon}: the Gaussian mechanism's σ = Δ√(2 ln(1.25/δ))/ε is "
                "(ε, δ)-DP only for ε < 1 (Dwork & Roth 2014, Thm. A.1). Choose ε < 1, or "
                "--strategy.init_args.mechanism=laplace."
            )
        delta_ok = 0 < delta < 1 if mechanism == "gaussian" else 0 <= delta < 1
        if not delta_ok:
            low = "(0, 1)" if mechanism == "gaussian" else "[0, 1)"
            problems.append(f"Expected --strategy.init_args.delta (δ) in {low} for {mechanism}, got {delta}.")
        if sensitivity is not None and not sensitivity > 0:
            problems.append(f"Expected --strategy.init_args.sensitivity (Δ) > 0 or null, got {sensitivity}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(FedAvg() if rule is None else rule, delta, accountant, insecure_seeded_noise)
        self.clip_norm = clip_norm
        self.epsilon = epsilon
        self.mechanism = mechanism
        self.sensitivity = sensitivity
        self._scale = 0.0  # σ or b, once the number of entries is known
        self._start: torch.Tensor | None = None  # the state the client received
        self._epsilon_after: dict[int, float] = {}  # ε(δ) by number of rounds, the same for every client

    def worst_sensitivity(self, num_entries: int) -> float:
        """The most two updates clipped to C differ by: 2C in L2, 2C√P in L1."""
        l2 = 2 * self.clip_norm
        return l2 if self.mechanism == "gaussian" else l2 * math.sqrt(num_entries)

    def on_fit_start(self, context: RunContext) -> None:
        super().on_fit_start(context)
        worst = self.worst_sensitivity(context.layout.numel)
        sensitivity = worst if self.sensitivity is None else self.sensitivity
        if sensitivity < worst and context.rank == 0:
            norm = "L2" if self.mechanism == "gaussian" else "L1"
            warnings.warn(
                f"LocalDP's sensitivity {sensitivity:g} is below {worst:g}, the {norm} distance two updates clipped "
                f"to C = {self.clip_norm:g} can have: ε = {self.epsilon:g} then holds only for pairs of a client's "
                "datasets whose updates differ by at most the sensitivity. Leave --strategy.init_args.sensitivity "
                "unset for the bound.",
                stacklevel=2,
            )
        if self.mechanism == "gaussian":
            self._scale = gaussian_sigma(sensitivity, self.epsilon, self.delta)
        else:
            self._scale = sensitivity / self.epsilon

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        self.rule.on_client_fit_start(context, module, plan)
        self._start = context.layout.flatten(module)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """The rule's own end of the fit, then the clipped update and the client's noise in what it sends."""
        self.rule.on_client_fit_end(context, module, update)
        layout, start = context.layout, self._start
        assert start is not None, "LocalDP.on_client_fit_end ran without the state the client started from"
        clipped, _ = clip_update(layout.flatten(module) - start, self.clip_norm)  # its norm is not sent
        generator = self.noise_generator(context, update.client)
        if self.mechanism == "gaussian":
            noise = self._scale * torch.randn(start.shape, generator=generator, dtype=torch.float64)
        else:
            noise = laplace_noise(tuple(start.shape), self._scale, generator)
        sent = start.double() + clipped.double() + noise.to(start.device)  # θ̃_k
        layout.load(module, sent.to(start.dtype), layout.integers(module))
        self.release(update.client, 1)
        self._start = None

    def client_epsilon(self, client: int, count: int) -> float:
        if count not in self._epsilon_after:
            self._epsilon_after[count] = local_dp_epsilon(
                self.mechanism, self.epsilon, self.delta, count, self.accountant
            )
        return self._epsilon_after[count]

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The rule's metrics, each client's ε(δ) and the noise's standard deviation per coordinate."""
        metrics = super().on_round_end(context, round_idx, updates)
        metrics["local_dp/noise_std"] = self._scale * (1.0 if self.mechanism == "gaussian" else math.sqrt(2.0))
        return metrics
