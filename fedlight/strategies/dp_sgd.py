"""Sample-level DP-SGD inside every client: Abadi et al., *Deep Learning with Differential Privacy*, CCS 2016.

Every local step of client k on a batch of B samples (Algorithm 1) clips each sample's gradient of the task loss
(``training_step``'s) to L2 norm C over all trainable parameters, sums, adds Gaussian noise and averages:

    g_i = ∇_θ ℓ(θ; x_i),    g̃ = (Σ_i g_i · min(1, C/‖g_i‖₂) + N(0, z² C² I)) / B,

and the client's optimizer steps with g̃, plus the gradient of the rule's data-independent term (FedProx's
(μ/2)‖θ − W^t‖²), which needs no clipping: it does not depend on any sample.

**Guarantee.** Each step is the subsampled Gaussian mechanism of noise multiplier z with respect to one sample of
client k's data (add/remove). Per client, its S_k noisy steps over all the rounds it took part in compose; its
ε(δ) is accounted with ``dp-accounting``'s RDP or PLD accountant (:func:`fedlight.strategies.dp.dp_epsilon`) as
S_k Poisson-subsampled Gaussian mechanisms with rate q_k = min(B, n_k)/n_k, and reported per client
(:class:`~fedlight.strategies.client_privacy.ClientPrivacy`); a round recomputes it for each client whose
(q_k, S_k) is new, about half a second each with RDP on a CPU. The engine draws shuffled batches of fixed size;
accounting them as Poisson sampling with the same q is the customary approximation (Abadi et al.'s experiments,
Opacus without its Poisson loader), not a proven bound for shuffling, which can be weaker (Chua et al., *How
Private are DP-SGD Implementations?*, ICML 2024). Everything the client sends is computed from the noisy steps,
its received state and data-independent terms, so the state is covered; not covered: what the engine reports
besides it (n_k as the aggregation weight, the mean training loss) and float buffers changed by the forward pass.

**Rules.** The rule's local step must be SGD on the task loss, possibly plus a data-independent term: FedAvg,
FedProx, and rules that change only the server (FedAvgM, FedAdam, FedYogi…). Rules that change a client's hooks
otherwise (MOON's contrastive loss, SCAFFOLD's correction, Ditto's personal epochs, teachers, per-client state)
would use the data outside the noisy steps and are refused; a wrapper (DPFedAvg, LocalDP) goes around DPSGD.

**Why not Opacus.** Opacus privatises a training loop by wrapping its module, its optimizer (``DPOptimizer``) and
its data loader (``PrivacyEngine.make_private``). In fedlight all three belong to the engine's local fit (a fresh
optimizer per client from ``configure_optimizers``, batches from the client's stream), which a rule does not
replace. What a rule owns is each step's loss (``training_loss``): there the per-sample gradients are computed
with ``torch.func`` (``vmap`` of ``grad`` over ``training_step`` on one sample, through ``functional_call``, as
the engine's vectorised clients do), clipped and noised, and the loss returned is Σ_p ⟨θ_p, g̃_p⟩ plus the rule's
term, whose gradient is g̃ plus the term's: the engine's backward pass and optimizer then take the DP step
(any optimizer: it post-processes g̃). The per-sample pass comes on top of the engine's forward pass (which gives
the reported task loss), and the per-sample gradients take [B, *shape] of memory per parameter.
``tests/strategies/test_dp_sgd.py`` checks the clipped, noised gradient against Opacus's ``GradSampleModule`` and
``DPOptimizer`` on the same model and batch.

The noise is secret, or seeded with ``insecure_seeded_noise``, as in DPFedAvg: client k draws the noise of all its
steps of round t from one generator seeded from (secret, t, k).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map

from fedlight.errors import ConfigError, error_line
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.client_privacy import Accountant, ClientPrivacy
from fedlight.strategies.dp import dp_epsilon
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.fedprox import FedProx
from fedlight.strategies.wrapper import RuleWrapper

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext

#: Hooks through which a rule acts on a client's training; DPSGD wraps rules that keep FedAvg's or FedProx's.
_CLIENT_HOOKS = ("client_teachers", "client_state_slots", "on_client_fit_start", "training_loss", "on_client_fit_end")


def unprivatised_hook(rule: Strategy) -> str | None:
    """The first hook by which ``rule`` (or a wrapper inside it) acts on a client's training other than by FedAvg's
    or FedProx's local step, as ``Class.hook``; ``None`` when it has none."""
    while isinstance(rule, RuleWrapper):
        for hook in _CLIENT_HOOKS:
            if getattr(type(rule), hook) is not getattr(RuleWrapper, hook):
                return f"{type(rule).__name__}.{hook}"
        rule = rule.rule
    for hook in _CLIENT_HOOKS:
        if getattr(type(rule), hook) not in (getattr(Strategy, hook), getattr(FedProx, hook)):
            return f"{type(rule).__name__}.{hook}"
    return None


class _SampleLoss(nn.Module):
    """The task loss of one sample as a module call, so that ``functional_call`` can swap the parameters."""

    def __init__(self, client: nn.Module) -> None:
        super().__init__()
        self.client = client

    def forward(self, sample: Any) -> torch.Tensor:
        batch = tree_map(lambda part: part.unsqueeze(0), sample)  # a batch of one
        return self.client.training_step(batch, 0)["loss"]


# runs eagerly under --trainer.compile_steps: tracing vmap of grad for every batch shape cost more than it saved
@torch.compiler.disable
def per_sample_gradients(
    sample_loss: nn.Module, params: dict[str, torch.Tensor], batch: Any
) -> dict[str, torch.Tensor]:
    """``{name: [B, *shape]}``: the gradient of every sample's loss, one ``vmap`` of ``grad`` over the batch.

    Args:
        sample_loss: a module whose call on one sample (the batch's tensors without their first dimension) is its
            loss.
        params: the parameters to differentiate, by their names in ``sample_loss``.
        batch: tensors (or a tuple of them) whose first dimension is the batch's.

    >>> class Square(nn.Module):  # ½(wx)², whose gradient in w is w x²
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = nn.Parameter(torch.ones(()))
    ...
    ...     def forward(self, x):
    ...         return 0.5 * (self.w * x) ** 2
    >>> square = Square()
    >>> per_sample_gradients(square, {"w": square.w.detach()}, torch.tensor([1.0, 2.0, 3.0]))["w"].tolist()
    [1.0, 4.0, 9.0]
    """
    loss = grad(lambda p, sample: functional_call(sample_loss, p, (sample,)))
    return vmap(loss, in_dims=(None, 0), randomness="different")(params, batch)


def noisy_clipped_mean(
    per_sample: Sequence[torch.Tensor], max_grad_norm: float, noise_multiplier: float, generator: torch.Generator
) -> list[torch.Tensor]:
    """g̃ = (Σ_i g_i · min(1, C/‖g_i‖) + z C ξ) / B of ``[B, *shape]`` per-sample gradients, ‖g_i‖ over all of them.

    ξ ~ N(0, I) is drawn from ``generator`` on the CPU, one parameter after another.

    >>> noisy_clipped_mean([torch.tensor([[3.0, 4.0], [0.3, 0.4]])], 1.0, 0.0, torch.Generator())
    [tensor([0.4500, 0.6000])]
    """
    batch = per_sample[0].shape[0]
    norms = torch.stack([g.reshape(batch, -1).double().square().sum(dim=1) for g in per_sample]).sum(0).sqrt()  # [B]
    factors = (max_grad_norm / norms).clamp(max=1.0)  # C/0 = inf: a zero gradient stays as it is
    out = []
    for g in per_sample:
        total = torch.tensordot(factors.to(g.dtype), g, dims=1)  # Σ_i clipped g_i, [*shape]
        if noise_multiplier > 0:
            noise = torch.randn(total.shape, generator=generator, dtype=total.dtype)
            total = total + noise_multiplier * max_grad_norm * noise.to(total.device)
        out.append(total / batch)
    return out


class DPSGD(ClientPrivacy):
    """Every client trains with DP-SGD: per-sample gradients clipped to C, Gaussian noise of z·C on their sum.

    Args:
        rule: the wrapped rule, whose local step is SGD on the task loss (FedAvg, FedProx, or a rule that changes
            only the server step); ``null`` is FedAvg.
        max_grad_norm: C > 0, the L2 norm every sample's gradient is clipped to.
        noise_multiplier: z ≥ 0, the noise's standard deviation over C; 0 adds none (ε = ∞).
        delta: δ of the reported per-client ε(δ).
        accountant: ``rdp`` or ``pld``, composing a client's noisy steps (``dp-accounting``).
        insecure_seeded_noise: draw the noise from ``--seed_everything`` rather than from a secret, so that a run
            is reproducible from its configuration alone (simulation only: whoever has the configuration can
            subtract the noise). False: a secret drawn from the operating system, kept only in the checkpoint.
    """

    metric_prefix = "dp_sgd"
    noise_stream = 6  # apart from the streams other rules draw from the client's round seed (1–5)

    def __init__(
        self,
        rule: Strategy | None = None,
        max_grad_norm: float = 1.0,
        noise_multiplier: float = 1.0,
        delta: float = 1e-5,
        accountant: Accountant = "rdp",
        insecure_seeded_noise: bool = False,
    ) -> None:
        rule = FedAvg() if rule is None else rule
        problems = []
        hook = unprivatised_hook(rule)
        if hook is not None:
            problems.append(
                f"--strategy DPSGD cannot wrap --strategy.init_args.rule {type(rule).__name__}: {hook} acts on the "
                "client's training outside its noisy steps. Wrap FedAvg, FedProx or a rule that changes only the "
                "server step (FedAvgM, FedAdam…), and put other wrappers (DPFedAvg, LocalDP) around DPSGD."
            )
        if not max_grad_norm > 0:
            problems.append(f"Expected --strategy.init_args.max_grad_norm (C) > 0, got {max_grad_norm}.")
        if not noise_multiplier >= 0:
            problems.append(f"Expected --strategy.init_args.noise_multiplier (z) ≥ 0, got {noise_multiplier}.")
        if not 0 < delta < 1:
            problems.append(f"Expected --strategy.init_args.delta (δ) in (0, 1), got {delta}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(rule, delta, accountant, insecure_seeded_noise)
        self.max_grad_norm = max_grad_norm
        self.noise_multiplier = noise_multiplier
        self._sample_loss: _SampleLoss | None = None  # during a client's fit
        self._generator: torch.Generator | None = None
        self._steps = 0  # the client's noisy steps so far
        self._sampling_rates: list[float] = []  # q_k = min(B, n_k)/n_k
        self._epsilon_after: dict[tuple[float, int], float] = {}  # ε(δ) by (q, steps)

    def adds_noise(self) -> bool:
        return self.noise_multiplier > 0

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        """Per-sample gradients need a model that treats each sample apart, and the engine's automatic steps."""
        problems = self.rule.check(module, datamodule)
        for name, sub in module.named_modules():
            # BatchNorm normalises with its batch's statistics; InstanceNorm with running ones keeps them
            running = isinstance(sub, nn.modules.instancenorm._InstanceNorm) and sub.track_running_stats
            if isinstance(sub, nn.modules.batchnorm._BatchNorm) or running:
                problems.append(
                    f"--strategy DPSGD cannot train {type(module).__name__}: {name} is a {type(sub).__name__}, which "
                    "mixes the samples of a batch (its statistics), so a sample's gradient depends on the others "
                    "and clipping it bounds nothing. Use GroupNorm or LayerNorm instead (fedlight's cnn and "
                    "mlp: --model.init_args.model_kwargs.batch_norm=false)."
                )
                break
        if not module.automatic_optimization:
            problems.append(
                f"--strategy DPSGD cannot train {type(module).__name__}: it steps its own optimizers "
                "(automatic_optimization = False), so the noisy gradient DPSGD computes in the loss would not be used."
            )
        return problems

    def on_fit_start(self, context: RunContext) -> None:
        super().on_fit_start(context)
        data = context.datamodule
        self._sampling_rates = [min(data.batch_size, int(n)) / int(n) for n in data.num_samples]

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        self.rule.on_client_fit_start(context, module, plan)
        self._sample_loss = _SampleLoss(module)
        self._generator = self.noise_generator(context, plan.client)
        self._steps = 0

    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Σ_p ⟨θ_p, g̃_p⟩ plus the rule's data-independent term: its gradient is the DP-SGD step's."""
        assert self._sample_loss is not None and self._generator is not None, "DPSGD trained outside a local fit"
        named = {f"client.{n}": p for n, p in module.named_parameters() if p.requires_grad}
        try:
            grads = per_sample_gradients(self._sample_loss, {n: p.detach() for n, p in named.items()}, batch)
        except Exception as err:
            raise ConfigError(
                f"--strategy DPSGD could not compute per-sample gradients of {type(module).__name__}.training_step "
                f"with torch.func ({error_line(err)}). Its loss must be a mean of per-sample terms, computed without "
                "in-place changes to the module's state."
            ) from err
        noisy = noisy_clipped_mean(list(grads.values()), self.max_grad_norm, self.noise_multiplier, self._generator)
        self._steps += 1
        surrogate = sum((p * g.to(p.dtype)).sum() for p, g in zip(named.values(), noisy, strict=True))
        zero = outputs["loss"].new_zeros(())  # the rule's term alone: FedProx's proximal term, FedAvg's nothing
        return surrogate + self.rule.training_loss(module, batch, {"loss": zero})

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        self.rule.on_client_fit_end(context, module, update)
        self.release(update.client, self._steps)
        self._sample_loss, self._generator = None, None

    def client_epsilon(self, client: int, count: int) -> float:
        rate = self._sampling_rates[client]
        if (rate, count) not in self._epsilon_after:
            epsilon = dp_epsilon(rate, self.noise_multiplier, count, self.delta, self.accountant)
            self._epsilon_after[rate, count] = epsilon
        return self._epsilon_after[rate, count]
