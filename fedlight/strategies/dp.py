"""Client-level differential privacy around any averaging rule: DP-FedAvg with fixed or adaptive clipping.

McMahan, Ramage, Talwar & Zhang, *Learning Differentially Private Recurrent Language Models*, ICLR 2018
(DP-FedAvg, Alg. 1 with the flat clipping estimator): every client's update Δ_k = θ_k − W^t is clipped to
norm C, the clipped updates are summed, Gaussian noise N(0, (z_Δ C)² I) is added to the sum, and the sum is
divided by the expected number of clients qN = K' (fixed denominator). The wrapped rule's clients train as
usual and its server update (FedAvgM's momentum gives DP-FedAvgM, as in the paper) takes the noisy average:

    Δ̃ = (Σ_k Δ_k · min(1, C/‖Δ_k‖) + N(0, z_Δ² C² I)) / K',    W^{t+1} = rule.server_update(W^t, W^t + Δ̃).

Adaptive clipping: Andrew, Thakkar, McMahan & Ramaswamy, *Differentially Private Learning with Adaptive
Clipping*, NeurIPS 2021 (Alg. 1, geometric update). Each client also reports b_k = 1[‖Δ_k‖ ≤ C]; the server
estimates the unclipped fraction privately, b̄ = (Σ_k b_k + N(0, σ_b²)) / K', and moves C towards the
γ-quantile of the update norms, C ← C·exp(−η_C (b̄ − γ)). The two releases share the privacy budget: for
an overall noise multiplier z, the update's is z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (their Thm. 1), so σ_b > z/2.

Privacy is accounted with Google's ``dp-accounting`` (RDP and/or PLD accountants) as T compositions of a
Poisson-subsampled Gaussian mechanism with rate q = K'/N and noise multiplier z, the analysis of McMahan et
al. 2018. With ``poisson_sampling`` every client takes part in a round independently with probability q, as
that analysis assumes (the round's number of clients varies around K'); otherwise exactly K' clients are drawn
uniformly without replacement, and accounting them as Poisson sampling with the same q is the customary
approximation. ε(δ) is logged
every round; the checkpoint holds the number of noisy rounds (and C), from which a resumed run rebuilds the
same accountant and reports the same ε.

Clipping covers every federated entry (parameters and floating-point buffers): that is what a client sends.
The logged update norms and unclipped fraction are diagnostics for tuning C and are not privatised.

The noise is secret. Anyone who can regenerate it subtracts it and holds the noise-free average, which no ε
protects, so it is not drawn from the run's seed (which ``config.yaml`` and W&B record): a fresh run draws a
128-bit secret from the operating system (``secrets``), and round t's noise from a seed derived from (secret, t).
The secret lives only in the strategy's state, hence in the checkpoint, so that a resumed run draws the same
noise; it is never in the configuration, the metrics or the logs, and the checkpoint must be kept as private as
the clients' updates. ``insecure_seeded_noise`` draws the noise from the run's seed instead, for simulations
that must be reproducible from their configuration alone; ε then describes the mechanism, not a protection
against anyone who has the configuration.
"""

from __future__ import annotations

import logging
import math
import secrets
import warnings
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.errors import ConfigError
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.functional import sample_clients
from fedlight.strategies.wrapper import RuleWrapper

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext

Accountant = Literal["rdp", "pld", "both"]
#: Which child of the round's strategy stream seeds the noise (child 0 is the attackers' draw).
_NOISE_CHILD = 1


def clip_update(update: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, float]:
    """Returns ``(Δ · min(1, C/‖Δ‖), ‖Δ‖)``.

    >>> clip_update(torch.tensor([3.0, 4.0]), 1.0)
    (tensor([0.6000, 0.8000]), 5.0)
    """
    norm = float(torch.linalg.vector_norm(update.double()))
    return update * min(1.0, clip_norm / norm) if norm > 0 else update, norm


def update_noise_multiplier(noise_multiplier: float, count_noise_std: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2): the update's share of the overall noise multiplier z (Andrew et al. 2021).

    >>> round(update_noise_multiplier(1.0, 5.0), 6)  # (1 − 1/100)^(−1/2)
    1.005038
    """
    return (noise_multiplier**-2 - (2.0 * count_noise_std) ** -2) ** -0.5


def dp_epsilon(
    sampling_rate: float, noise_multiplier: float, steps: int, delta: float, accountant: Literal["rdp", "pld"]
) -> float:
    """ε(δ) of ``steps`` compositions of the Poisson-subsampled Gaussian mechanism (``dp-accounting``).

    Args:
        sampling_rate: q, each client's probability of taking part in a round.
        noise_multiplier: z, the noise standard deviation over the sensitivity.
        steps: the number of noisy rounds.
        delta: δ.
        accountant: ``rdp`` (Rényi DP, Mironov 2017) or ``pld`` (privacy loss distributions).

    >>> dp_epsilon(0.1, 1.0, 0, 1e-5, "rdp")
    0.0
    """
    import dp_accounting  # imports absl and scipy parts: only DP runs need it

    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps
    )
    if accountant == "rdp":
        account = dp_accounting.rdp.RdpAccountant()
    else:
        account = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # RDP warns for every low order whose series does not converge; it drops them
    try:
        account.compose(event)
        return float(account.get_epsilon(delta))
    finally:
        absl.setLevel(level)


class DPFedAvg(RuleWrapper):
    """Client-level DP around a rule that averages states: clipped updates, Gaussian noise, an accountant.

    Args:
        rule: the wrapped rule (client hooks and server update); ``null`` is FedAvg. Its weights are replaced by
            uniform ones (n_k-weighting would raise the sensitivity), and it must not gather states.
        clip_norm: C > 0, the clipping norm of every client's update (the initial C when ``adaptive``).
        noise_multiplier: z ≥ 0, the overall noise multiplier that is accounted; 0 adds no noise (ε = ∞).
        adaptive: adapt C to the ``target_quantile`` of the update norms (Andrew et al. 2021).
        target_quantile: γ ∈ (0, 1), the quantile of the update norms that C tracks.
        clip_lr: η_C > 0 of the geometric update C ← C·exp(−η_C (b̄ − γ)) (0.2 in Andrew et al.).
        count_noise_std: σ_b of the noise on the unclipped count; ``null`` is K'/20, Andrew et al.'s choice. It
            must exceed z/2.
        delta: δ of the reported ε(δ).
        accountant: ``rdp``, ``pld`` or ``both`` (then ``dp/epsilon`` is RDP's and ``dp/epsilon_pld`` PLD's).
        poisson_sampling: every client takes part with probability q = K'/N (``--trainer.clients_per_round`` is
            then the expected K'), which the accountant assumes; false draws exactly K' clients uniformly.
        insecure_seeded_noise: draw the noise from ``--seed_everything`` rather than from a secret, so that a run
            is reproducible from its configuration alone (simulation only: whoever has the configuration can
            subtract the noise, and ε protects nothing against them). False: a secret drawn from the operating
            system when the run starts, kept only in the checkpoint.
    """

    def __init__(
        self,
        rule: Strategy | None = None,
        clip_norm: float = 1.0,
        noise_multiplier: float = 1.0,
        adaptive: bool = False,
        target_quantile: float = 0.5,
        clip_lr: float = 0.2,
        count_noise_std: float | None = None,
        delta: float = 1e-5,
        accountant: Accountant = "rdp",
        poisson_sampling: bool = False,
        insecure_seeded_noise: bool = False,
    ) -> None:
        rule = FedAvg() if rule is None else rule
        problems = []
        if rule.gather_states or rule.weight_channels != 1:
            problems.append(
                f"--strategy.init_args.rule {type(rule).__name__} does not aggregate by one weighted average; "
                "DPFedAvg clips and noises the average of FedAvg-shaped rules (FedAvg, FedProx, FedAvgM, MOON…)."
            )
        if not clip_norm > 0:
            problems.append(f"Expected --strategy.init_args.clip_norm (C) > 0, got {clip_norm}.")
        if not noise_multiplier >= 0:
            problems.append(f"Expected --strategy.init_args.noise_multiplier (z) ≥ 0, got {noise_multiplier}.")
        if not 0 < target_quantile < 1:
            problems.append(f"Expected --strategy.init_args.target_quantile (γ) in (0, 1), got {target_quantile}.")
        if not clip_lr > 0:
            problems.append(f"Expected --strategy.init_args.clip_lr (η_C) > 0, got {clip_lr}.")
        count_noise_too_small = count_noise_std is not None and not count_noise_std > noise_multiplier / 2
        if adaptive and noise_multiplier > 0 and count_noise_too_small:
            problems.append(
                f"--strategy.init_args.count_noise_std (σ_b) = {count_noise_std} must exceed noise_multiplier / 2 = "
                f"{noise_multiplier / 2}: the clipped count and the update share the noise budget."
            )
        if not 0 < delta < 1:
            problems.append(f"Expected --strategy.init_args.delta (δ) in (0, 1), got {delta}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(rule)
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.adaptive = adaptive
        self.target_quantile = target_quantile
        self.clip_lr = clip_lr
        self.count_noise_std = count_noise_std
        self.delta = delta
        self.accountant = accountant
        self.poisson_sampling = poisson_sampling
        self.insecure_seeded_noise = insecure_seeded_noise
        self._secret: int | None = None  # of the noise seeds; the checkpoint's only, never logged
        self.steps = 0  # noisy rounds so far: all the accountant needs
        self._num_clients = 0  # N
        self._expected = 0  # K', the (expected) number of clients per round: qN
        self._noise_seed = 0
        self._start: torch.Tensor | None = None  # W^t as the client received it
        self._noise_std = 0.0  # of the last round's averaged update

    # -- settings -------------------------------------------------------------------------------------
    @property
    def sampling(self) -> str:
        return "uniform"

    @property
    def weight_channels(self) -> int:
        return 1

    def sample_clients(self, num_samples: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
        """Each client with probability q = K'/N (Poisson), or K' clients uniformly without replacement; never ∝ n_k."""
        self._expected = k
        if self.poisson_sampling:
            return np.flatnonzero(rng.random(len(num_samples)) < k / len(num_samples))
        return sample_clients(num_samples, k, rng, proportional=False)

    def client_weights(self, update: ClientUpdate) -> tuple[float, ...]:
        return (1.0,)

    def channel_coefficients(self) -> tuple[float, ...]:
        return (1.0,)

    def sampling_rate(self) -> float:
        """q = K'/N."""
        return self._expected / self._num_clients

    def count_noise(self) -> float:
        """σ_b: the noise on the unclipped count of adaptive clipping."""
        return self._expected / 20 if self.count_noise_std is None else self.count_noise_std

    def update_noise_multiplier(self) -> float:
        """z_Δ: z itself with a fixed C, z's share after the count's noise with adaptive clipping."""
        if not self.adaptive or self.noise_multiplier == 0:
            return self.noise_multiplier
        return update_noise_multiplier(self.noise_multiplier, self.count_noise())

    def check_round_size(self, sampled: int, trained: int) -> list[str]:
        """Adaptive clipping's σ_b > z / 2 (Andrew et al. 2021, Thm. 1), with σ_b = K'/20 by default."""
        problems = self.rule.check_round_size(sampled, trained)
        count_noise = sampled / 20 if self.count_noise_std is None else self.count_noise_std
        if self.adaptive and self.noise_multiplier > 0 and not count_noise > self.noise_multiplier / 2:
            problems.append(
                f"Adaptive clipping's count noise σ_b = {count_noise:g} (K'/20 with --trainer.clients_per_round="
                f"{sampled} unless --strategy.init_args.count_noise_std sets it) must exceed noise_multiplier / 2 = "
                f"{self.noise_multiplier / 2:g}; set --strategy.init_args.count_noise_std above it."
            )
        return problems

    # -- round ----------------------------------------------------------------------------------------
    def on_fit_start(self, context: RunContext) -> None:
        self.rule.on_fit_start(context)
        self._num_clients = context.datamodule.num_clients
        if not self.insecure_seeded_noise and self._secret is None:  # a resumed run has its checkpoint's
            self._secret = context.all_gather_objects(secrets.randbits(128) if context.rank == 0 else None)[0]
        if self.insecure_seeded_noise and self.noise_multiplier > 0 and context.rank == 0:
            warnings.warn(
                "DPFedAvg draws its noise from --seed_everything (insecure_seeded_noise=true): whoever has this run's "
                "configuration can subtract the noise, so the reported ε protects nothing against them. Use it for "
                "simulations only.",
                stacklevel=2,
            )

    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        self.rule.on_round_start(context, round_idx, plans)
        if self.adaptive and self.noise_multiplier > 0 and not self.count_noise() > self.noise_multiplier / 2:
            raise ConfigError(
                f"Adaptive clipping's count noise σ_b = K'/20 = {self.count_noise()} must exceed noise_multiplier / 2 "
                f"= {self.noise_multiplier / 2}; set --strategy.init_args.count_noise_std above it."
            )
        self._noise_seed = self.noise_seed(context, round_idx)

    def noise_seed(self, context: RunContext, round_idx: int) -> int:
        """The seed of round ``round_idx``'s noise, the same on every process: derived from the secret, or with
        ``insecure_seeded_noise`` from the round's strategy stream (and so from the run's seed)."""
        if self.insecure_seeded_noise:
            rng = context.strategy_rng(round_idx).spawn(_NOISE_CHILD + 1)[_NOISE_CHILD]
            return int(rng.integers(2**62))
        assert self._secret is not None, "DPFedAvg drew no secret: on_fit_start did not run"
        return int(np.random.SeedSequence(self._secret, spawn_key=(round_idx,)).generate_state(1, np.uint64)[0])

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        self.rule.on_client_fit_start(context, module, plan)
        self._start = context.layout.flatten(module)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        self.rule.on_client_fit_end(context, module, update)
        layout, start = context.layout, self._start
        assert start is not None, "DPFedAvg.on_client_fit_end ran without the state the client started from"
        clipped, norm = clip_update(layout.flatten(module) - start, self.clip_norm)
        layout.load(module, start + clipped, layout.integers(module))
        update.payload["dp_update_norm"] = norm
        update.payload["dp_unclipped"] = float(norm <= self.clip_norm)  # b_k of adaptive clipping
        self._start = None

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """Noise on the sum of clipped updates, the fixed denominator K', then C's update and the rule's step."""
        generator = torch.Generator().manual_seed(self._noise_seed)
        total = (aggregate - global_state).double() * len(updates)  # Σ_k clipped Δ_k
        z_update = self.update_noise_multiplier()
        noise = torch.randn(total.shape, generator=generator, dtype=torch.float64).to(total.device)
        noisy = (total + z_update * self.clip_norm * noise) / self._expected  # Δ̃
        self._noise_std = z_update * self.clip_norm / self._expected
        if self.adaptive:
            count = sum(u.payload["dp_unclipped"] for u in updates)
            count_noise = self.count_noise() if self.noise_multiplier > 0 else 0.0
            unclipped = (count + count_noise * float(torch.randn((), generator=generator, dtype=torch.float64))) / (
                self._expected
            )  # b̄
            self.clip_norm *= math.exp(-self.clip_lr * (unclipped - self.target_quantile))
        self.steps += 1
        return self.rule.server_update(global_state, global_state + noisy.to(global_state), updates)

    def epsilon(self, accountant: Literal["rdp", "pld"] = "rdp") -> float:
        """ε(δ) after the noisy rounds so far, from a fresh accountant (so a resumed run reports the same)."""
        return dp_epsilon(self.sampling_rate(), self.noise_multiplier, self.steps, self.delta, accountant)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The rule's metrics, ε(δ), C (the next round's, when adaptive), the noise and the update norms."""
        metrics = dict(self.rule.on_round_end(context, round_idx, updates))
        metrics["dp/epsilon"] = self.epsilon("pld" if self.accountant == "pld" else "rdp")
        if self.accountant == "both":
            metrics["dp/epsilon_pld"] = self.epsilon("pld")
        metrics["dp/clip_norm"] = self.clip_norm
        metrics["dp/noise_std"] = self._noise_std
        if updates:
            norms = [u.payload["dp_update_norm"] for u in updates]
            metrics["dp/update_norm_median"] = float(np.median(norms))
            metrics["dp/unclipped_fraction"] = float(np.mean([u.payload["dp_unclipped"] for u in updates]))
        return metrics

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rule's state, the number of noisy rounds (the accountant's whole state), C and the noise's secret."""
        return {**super().state_dict(), "steps": self.steps, "clip_norm": self.clip_norm, "noise_secret": self._secret}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps = int(state.get("steps", 0))
        self.clip_norm = float(state.get("clip_norm", self.clip_norm))
        self._secret = state.get("noise_secret", self._secret)
