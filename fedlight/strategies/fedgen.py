"""FedGen: Zhu, Hong & Zhou, *Data-Free Knowledge Distillation for Heterogeneous Federated Learning*, ICML 2021
(arXiv 2105.10056), Algorithm 1.

The server learns a lightweight conditional generator G_w(ε, y) that maps noise ε ~ N(0, I) and a label y to a
feature z, the input of the classifier head h(·; θ_p), so that the round's clients' heads, ensembled, recognise y in
z (Eq. 4, with the label prior p̂(y) from the clients' label counters):

    min_w J(w) = E_{y∼p̂(y)} E_{ε} [ ℓ( Σ_k α_{k,y} g(G_w(ε, y); θ_p^k), y ) ] + η L_div,
    α_{k,y} = c_{k,y} / Σ_{j∈A} c_{j,y},      p̂(y) ∝ Σ_{k∈A} c_{k,y}

where g is a head's logits, ℓ the softmax cross-entropy and c_k the label counter of client k over its local steps.
The weights α_{k,y} ∝ c_{k,y} are those of the released code; Eq. 4 as we recall it mixes the K heads evenly (1/K),
which clients with equal label counts give. Equation numbers are those of the arXiv version as we recall them, not
checked against its text.
G is sent to the next round's clients, which add the regulariser of Eq. 5 to their loss at every local step:

    J(θ_k) = L̂_k(θ_k) + α_t E_{ŷ∼p̂(y), ε} [ ℓ( h(G_w(ε, ŷ); θ_p^k), ŷ ) ],

and the server averages the models as FedAvg does (n_k-weighted). Here the generator is an MLP on
[ε, onehot(y)] (Linear → BatchNorm → ReLU → Linear to the head's input width D), trained after every round for
``generator_steps`` Adam steps of ``generated_batch_size`` draws, in ``on_round_end``, and run in eval mode by the
clients. p̂ is uniform until the first round ends, so the first round's clients are regularised by the untrained
generator, as Algorithm 1 reads.

What the engine lacks: a server-side model trained on the clients' models. The hooks after aggregation see the
weighted sum and the updates' payloads, never a client's own state, and the engine owns no server module or
optimiser. So the rule owns the generator and its Adam state (checkpointed in :meth:`FedGen.state_dict`), each
client sends its head's entries and its label counter in ``ClientUpdate.payload``, and the generator trains on
those in ``on_round_end``, on every process alike.

Randomness: round t's strategy stream (``context.strategy_rng(t)``) gives three seeds: the regulariser's draws of
round t (every client of the round draws the same ŷ, ε sequence, so the result does not depend on which client holds
which data), the generator's draws after round t, and, in round 0, the generator's initial weights.

The released code (``zhuangdizhu/FedGen``) differs from the paper in ways offered as options or left out:
``ensemble="losses"`` weighs the clients' cross-entropies by α_{k,y} instead of their logits; ``beta`` adds the
code's second client term, β_t KL(softmax h(G(ε, y_i)) ‖ softmax f(x_i)) on the real batch's labels; ``decay`` is
its per-round factor of α and β (the code: α = β = 10, decay 0.98, floored at 10⁻⁴, which is not done here); and
``diversity`` is its term L_div = exp(−mean_{i,j} ‖ε_i − ε_j‖²/d · ‖z_i − z_j‖₁/D) (η = 1 in the code). Not followed:
the code draws ε uniformly on [0, 1) (Gaussian here, as the paper), draws labels uniformly among those held (p̂
here), skips the regulariser in the first round, scales it by the ratio of generated to real batch sizes, and runs
Adam with weight decay 10⁻² and a per-round learning-rate decay of 0.98.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedlight.errors import ConfigError
from fedlight.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate

_FLAG = "--strategy.init_args"
# indices of the seeds that round t's strategy stream gives
_CLIENT_DRAWS, _SERVER_DRAWS, _INITIAL_WEIGHTS = 0, 1, 2


class FeatureGenerator(nn.Module):
    """G_w(ε, y): noise and a one-hot label through Linear → BatchNorm → ReLU → Linear to a ``[B, D]`` feature.

    As the released code's generator, except that its first Linear has no bias (see below)."""

    def __init__(self, num_classes: int, noise_dim: int, hidden: int, feature_dim: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        # no bias before the BatchNorm, whose shift replaces it: it would get only rounding noise as a gradient
        layers = [nn.Linear(noise_dim + num_classes, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.out = nn.Linear(hidden, feature_dim)

    def forward(self, noise: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(labels, self.num_classes).to(noise.dtype)  # [B, C]
        return self.out(self.body(torch.cat([noise, onehot], dim=1)))  # [B, D]


def ensemble_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, mode: Literal["logits", "losses"] = "logits"
) -> torch.Tensor:
    """Eq. 4's term: ℓ(Σ_k α_{k,y} g_k, y) (``logits``), or Σ_k α_{k,y} ℓ(g_k, y) (``losses``, the released code).

    Args:
        logits: ``[K, B, C]`` the K heads' logits of the generated features.
        labels: ``[B]`` the labels y they were generated for.
        weights: ``[K, C]`` α_{k,y}, each column summing to 1 over the clients (or 0 for a class none holds).
        mode: what the weights mix.

    Two heads that agree give their common loss, whatever the weights; log 2 for logits (0, 0):

    >>> g = torch.zeros(2, 1, 2)
    >>> round(ensemble_loss(g, torch.tensor([0]), torch.tensor([[0.3, 0.5], [0.7, 0.5]])).item(), 6)
    0.693147
    """
    alpha = weights[:, labels].unsqueeze(-1)  # [K, B, 1] α_{k, y_i}
    if mode == "logits":
        return F.cross_entropy((alpha * logits).sum(dim=0).float(), labels)
    losses = torch.stack([F.cross_entropy(g.float(), labels, reduction="none") for g in logits])  # [K, B]
    return (alpha.squeeze(-1) * losses).sum(dim=0).mean()


def diversity_loss(noise: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """exp(−mean_{i,j} d_ε(i, j) d_z(i, j)), d_ε the mean squared and d_z the mean absolute difference of rows:
    small when draws of distant noise give distant features.

    >>> round(diversity_loss(torch.tensor([[0.0], [1.0]]), torch.tensor([[0.0, 0.0], [2.0, 2.0]])).item(), 6)
    0.367879
    """
    noise_gap = (noise[:, None] - noise[None]).pow(2).mean(dim=-1)  # [B, B]
    feature_gap = (features[:, None] - features[None]).abs().mean(dim=-1)  # [B, B]
    return torch.exp(-(noise_gap * feature_gap).mean())


class FedGen(FedAvg):
    """FedAvg whose clients are regularised on features a server-trained generator draws for the clients' labels.

    Args:
        generator_hidden: width of the generator's hidden layer (the released code: 256 on MNIST and EMNIST, 512
            on CIFAR-10).
        noise_dim: d, the width of the noise ε (the code: 32 on MNIST, 64 on CIFAR-10).
        generator_steps: the generator's Adam steps after every round (the code: 50).
        generator_lr: the generator's Adam learning rate (the code: 3·10⁻⁴ on MNIST, 10⁻⁴ on EMNIST).
        generated_batch_size: features drawn per generator step and per client step (the code: 32); at least 2,
            for the generator's BatchNorm and the diversity term.
        alpha: α ≥ 0, the weight of the clients' regulariser (Eq. 5 weighs it 1; the code 10); 0 with ``beta`` 0
            is FedAvg.
        beta: β ≥ 0, the weight of the released code's KL term between the heads' outputs on generated and real
            features of the batch's labels; 0 as the paper.
        decay: α_t = α·decay^t and β_t = β·decay^t in round t (1: constant, as Eq. 5; the code: 0.98).
        diversity: η ≥ 0, the weight of the diversity term in the generator's loss (the code: 1; 0 is Eq. 4 alone).
        ensemble: ``logits`` mixes the heads' logits by α_{k,y} inside the cross-entropy (Eq. 4); ``losses`` mixes
            their cross-entropies (the released code).
        head: the module path of the classifier head, which maps the features to the logits (``net.head`` for
            fedlight's networks).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as Algorithm 1.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        generator_hidden: int = 256,
        noise_dim: int = 32,
        generator_steps: int = 50,
        generator_lr: float = 3e-4,
        generated_batch_size: int = 32,
        alpha: float = 1.0,
        beta: float = 0.0,
        decay: float = 1.0,
        diversity: float = 1.0,
        ensemble: Literal["logits", "losses"] = "logits",
        head: str = "net.head",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        least = {
            "generator_hidden": (generator_hidden, 1), "noise_dim": (noise_dim, 1),
            "generator_steps": (generator_steps, 0), "alpha": (alpha, 0), "beta": (beta, 0),
            "diversity": (diversity, 0),
        }  # fmt: skip
        problems = [
            f"Expected {_FLAG}.{flag} ≥ {bound}, got {value}."
            for flag, (value, bound) in least.items()
            if not value >= bound
        ]
        if not generated_batch_size >= 2:
            problems.append(
                f"Expected {_FLAG}.generated_batch_size ≥ 2, got {generated_batch_size}: the generator's BatchNorm "
                "and its diversity term need two draws (the released code draws 32)."
            )
        if not generator_lr > 0:
            problems.append(f"Expected {_FLAG}.generator_lr > 0, got {generator_lr} (the released code: 3e-4).")
        if not 0 < decay <= 1:
            problems.append(f"Expected {_FLAG}.decay in (0, 1], got {decay}; 1 keeps α and β constant.")
        if ensemble not in ("logits", "losses"):
            problems.append(f"Expected {_FLAG}.ensemble logits (Eq. 4) or losses (the released code), got {ensemble}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.generator_hidden, self.noise_dim = generator_hidden, noise_dim
        self.generator_steps, self.generator_lr = generator_steps, generator_lr
        self.generated_batch_size = generated_batch_size
        self.alpha, self.beta, self.decay, self.diversity = alpha, beta, decay, diversity
        self.ensemble, self.head = ensemble, head
        self.generator: FeatureGenerator | None = None  # G_w, built in on_fit_start
        self._optimizer: torch.optim.Optimizer | None = None  # G_w's Adam
        self._prior: torch.Tensor | None = None  # [C] fp64 CPU p̂(y)
        self._pending: dict[str, Any] | None = None  # a checkpoint loaded before the generator was built
        self._server_head: nn.Module | None = None  # frozen copy of the head, run with each client's entries
        self._client_seed = 0  # the round's regulariser draws
        self._draws: torch.Generator | None = None  # of the client in its fit
        self._weights = (0.0, 0.0)  # α_t, β_t of the round
        self._counts: torch.Tensor | None = None  # [C] c_k, the label counter of the client in its fit

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        problems = []
        try:
            module.get_submodule(self.head)
        except AttributeError:
            problems.append(
                f"FedGen regularises and ensembles the classifier head {_FLAG}.head={self.head!r}, which is no "
                f"submodule of {type(module).__name__}: name the module that maps the features to the logits "
                "(fedlight's networks: 'net.head')."
            )
        if not hasattr(getattr(module, "net", None), "forward_features"):
            problems.append(
                f"FedGen's generator draws features of the width module.net.forward_features gives, which --model "
                f"{type(module).__name__} lacks. Use fedlight.clients.ClassificationClient with a registered network."
            )
        targets = getattr(getattr(datamodule, "pool", None), "targets", None)
        if not (isinstance(targets, torch.Tensor) and targets.ndim == 1 and not targets.is_floating_point()):
            problems.append(
                "FedGen generates features for class labels and counts each client's labels, which needs one "
                "integer class per training sample: choose a classification --data, or another rule."
            )
        return problems

    def on_fit_start(self, context: RunContext) -> None:
        """Builds G_w for the head's input width D (from one batch of client 0) and its optimizer; p̂ uniform."""
        module, precision, num_classes = context.module, context.precision, context.datamodule.num_classes
        head = module.get_submodule(self.head)
        modes = {child: child.training for child in module.modules()}
        module.eval()  # no BatchNorm statistics move
        try:
            with torch.no_grad():
                x, _ = precision.convert_input(next(context.datamodule.client_batches(0, split="train")))
                with precision.forward_context():
                    features = module.net.forward_features(x[:2])  # [2, D]
                    logits = head(features)  # [2, C]
        finally:
            for child, training in modes.items():
                child.train(training)
        if features.ndim != 2 or tuple(logits.shape) != (features.shape[0], num_classes):
            raise ConfigError(
                f"FedGen generates [B, D] features for the head {_FLAG}.head={self.head!r}, but --model's "
                f"forward_features gives {tuple(features.shape)} and the head {tuple(logits.shape)} from them, not "
                f"[B, {num_classes}] logits. Use a classification network and name its last layer."
            )
        seed = int(context.strategy_rng(0).integers(2**62, size=3)[_INITIAL_WEIGHTS])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            generator = FeatureGenerator(num_classes, self.noise_dim, self.generator_hidden, features.shape[1])
        self.generator = generator.to(context.device).eval()
        self._optimizer = torch.optim.Adam(self.generator.parameters(), lr=self.generator_lr)
        self._prior = torch.full((num_classes,), 1.0 / num_classes, dtype=torch.float64)
        self._server_head = copy.deepcopy(head).requires_grad_(False).eval()
        if self._pending is not None:
            self._load(self._pending)
            self._pending = None

    # -- client side: Eq. 5 ------------------------------------------------------------------------------
    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        self._client_seed = int(context.strategy_rng(round_idx).integers(2**62, size=3)[_CLIENT_DRAWS])
        self._weights = (self.alpha * self.decay**round_idx, self.beta * self.decay**round_idx)

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        assert self.generator is not None, "FedGen.on_client_fit_start ran before on_fit_start"
        self.generator.eval()
        self._draws = torch.Generator().manual_seed(self._client_seed)
        self._counts = torch.zeros(context.datamodule.num_classes, dtype=torch.long, device=context.device)

    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The task loss + α_t ℓ(h(G(ε, ŷ)), ŷ) on ``generated_batch_size`` draws ŷ ~ p̂ (Eq. 5) [+ the code's β_t
        term]; counts the batch's labels (c_k)."""
        assert self._draws is not None and self._counts is not None, "FedGen.training_loss ran outside a local fit"
        labels = batch[1]
        self._counts += torch.bincount(labels, minlength=len(self._counts))
        alpha, beta = self._weights
        loss = outputs["loss"]
        if alpha == 0 and beta == 0:
            return loss
        head = module.get_submodule(self.head)
        drawn, noise = self._draw(self._draws, self.generated_batch_size)
        with torch.no_grad():
            generated = self.generator(noise.to(labels.device), drawn.to(labels.device))  # [B_g, D]
        loss = loss + alpha * F.cross_entropy(head(generated).float(), drawn.to(labels.device))
        if beta > 0:
            if "logits" not in outputs:
                raise ConfigError(
                    f"FedGen's {_FLAG}.beta compares the outputs on real and generated features, but "
                    f"{type(module).__name__}.training_step returns only {sorted(outputs)}. Use a client that "
                    "returns 'logits' (ClassificationClient), or set beta to 0."
                )
            noise = torch.randn(len(labels), self.noise_dim, generator=self._draws).to(labels.device)
            with torch.no_grad():
                target = F.softmax(head(self.generator(noise, labels)).float(), dim=1)  # [B, C]
            log_probs = F.log_softmax(outputs["logits"].float(), dim=1)
            loss = loss + beta * F.kl_div(log_probs, target, reduction="batchmean")
        return loss

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Sends the label counter c_k and the head's entries θ_p^k, which the server's ensemble runs."""
        assert self._counts is not None, "FedGen.on_client_fit_end ran outside a local fit"
        head = module.get_submodule(self.head).state_dict()
        update.payload.update(
            label_counts=self._counts.cpu(), head={name: t.detach().cpu().clone() for name, t in head.items()}
        )
        self._draws = self._counts = None

    # -- server side: Eq. 4 ------------------------------------------------------------------------------
    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """p̂(y) and α_{k,y} from the round's label counters, then ``generator_steps`` Adam steps of G_w on Eq. 4."""
        updates = [u for u in updates if "head" in u.payload]
        assert self.generator is not None and self._optimizer is not None, "FedGen.on_round_end before on_fit_start"
        if not updates:
            return {}
        device = context.device
        counts = torch.stack([u.payload["label_counts"] for u in updates]).double()  # [K, C] c_{k,y}
        self._prior = counts.sum(dim=0) / counts.sum()  # p̂(y)
        weights = (counts / counts.sum(dim=0).clamp(min=1)).float().to(device)  # [K, C] α_{k,y}
        heads = [{name: t.to(device) for name, t in u.payload["head"].items()} for u in updates]
        seed = int(context.strategy_rng(round_idx).integers(2**62, size=3)[_SERVER_DRAWS])
        draws = torch.Generator().manual_seed(seed)
        totals = torch.zeros(2, dtype=torch.float64)
        self.generator.train()
        with torch.enable_grad():
            for _ in range(self.generator_steps):
                labels, noise = (t.to(device) for t in self._draw(draws, self.generated_batch_size))
                features = self.generator(noise, labels)  # [B, D]
                logits = torch.stack([functional_call(self._server_head, entries, (features,)) for entries in heads])
                teacher = ensemble_loss(logits, labels, weights, self.ensemble)
                spread = diversity_loss(noise, features) if self.diversity > 0 else features.new_zeros(())
                self._optimizer.zero_grad(set_to_none=True)
                (teacher + self.diversity * spread).backward()
                self._optimizer.step()
                totals += torch.tensor([teacher.item(), spread.item()], dtype=torch.float64)
        self.generator.eval()
        steps = max(self.generator_steps, 1)
        return {"fedgen/ensemble_loss": float(totals[0]) / steps, "fedgen/diversity_loss": float(totals[1]) / steps}

    def _draw(self, draws: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``size`` labels ŷ ~ p̂(y) and noise ε ~ N(0, I) ``[size, d]``, on the CPU, in that order."""
        assert self._prior is not None, "FedGen drew before on_fit_start"
        labels = torch.multinomial(self._prior, size, replacement=True, generator=draws)
        return labels, torch.randn(size, self.noise_dim, generator=draws)

    # -- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """G_w's weights and BatchNorm statistics, its Adam state and p̂(y), on the CPU."""
        if self.generator is None:
            return copy.deepcopy(self._pending) if self._pending is not None else {}
        assert self._optimizer is not None and self._prior is not None
        return _to_cpu(
            {"generator": self.generator.state_dict(), "optimizer": self._optimizer.state_dict(), "prior": self._prior}
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self.generator is None:  # a resumed run loads its checkpoint before on_fit_start builds G_w
            self._pending = copy.deepcopy(state)
        else:
            self._load(state)

    def _load(self, state: dict[str, Any]) -> None:
        assert self.generator is not None and self._optimizer is not None
        self.generator.load_state_dict(state["generator"])
        self._optimizer.load_state_dict(state["optimizer"])
        self._prior = state["prior"].clone()


def _to_cpu(value: Any) -> Any:
    """Copies of the tensors in nested dicts and lists, on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(item) for item in value)
    return value
