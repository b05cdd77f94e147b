"""CCVR: Luo, Chen, Hu, Zhang, Liang & Feng, *No Fear of Heterogeneity: Classifier Calibration for Federated
Learning with Non-IID Data*, NeurIPS 2021 (arXiv 2106.05001), Section 4 and Algorithm 1.

Classifier Calibration with Virtual Representations leaves federated training alone (FedAvg here) and, once it is
over, re-trains the classifier head g_φ of the global model on features drawn from a Gaussian mixture that stands
for every client's data, without any raw sample leaving a client:

1. with the global feature extractor f_θ̂, client k sends, for every class c it holds, the count N_{c,k}, the mean
   μ_{c,k} and the unbiased covariance Σ_{c,k} of its features z = f_θ̂(x), the head's input (Eq. 2);
2. the server combines them exactly into the statistics of the pooled features (Eqs. 3–4):
       μ_c = Σ_k (N_{c,k}/N_c) μ_{c,k},
       Σ_c = Σ_k (N_{c,k}−1)/(N_c−1) Σ_{c,k} + Σ_k N_{c,k}/(N_c−1) μ_{c,k}μ_{c,k}ᵀ − N_c/(N_c−1) μ_c μ_cᵀ;
3. it draws M_c virtual features of every class from N(μ_c, Σ_c) and re-trains the head, starting from the global
   model's φ̂, with cross-entropy on them (Eq. 5); the result replaces the head of W^T.

Here the calibration runs in ``server_update``, on the round's aggregate, after the last round (the paper) or also
after every ``calibrate_every``-th round, in which case the next rounds train from the calibrated head. Every client
of the federation sends statistics, as in Algorithm 1, not only the round's; its features are read in eval mode
through the client's ``net.forward_features``. Σ_{c,k} of a class a client holds once is undefined (N_{c,k} − 1 = 0)
and enters Eq. 4 with weight 0; a class no client holds gets no virtual features, one held once in all gets M_c
copies of its single feature. The virtual features are drawn from the round's strategy stream
(``context.strategy_rng``, class by class with NumPy's eigendecomposition sampler, which accepts the singular Σ_c of
features wider than a class's count), then the head takes ``calib_steps`` SGD steps on mini-batches of
``calib_batch_size`` from a fresh permutation of them, epoch after epoch, drawn from the same stream.

No code was released with the paper; nothing here follows a reimplementation. The paper does not fix the head's
optimiser in what this module relies on, so ``calib_lr``, ``calib_steps`` and ``calib_batch_size`` are settings of
fedlight's, and M_c = 2000 is the default.

Each client's message is summed into the server's totals as Eq. 4's three terms (N_{c,k}, N_{c,k} μ_{c,k},
(N_{c,k}−1)Σ_{c,k} + N_{c,k} μ_{c,k}μ_{c,k}ᵀ), in fp64 and with one all-reduce across processes, so the server never
holds more than one [C, D, D] sum however many clients there are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedlight.bank import GROUPS, cluster_entry_names
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientUpdate


class CCVR(FedAvg):
    """FedAvg whose global head is re-trained on virtual features drawn from the clients' feature statistics.

    Args:
        calibrate_every: 0 calibrates after the last round only (the paper's post-hoc calibration); n > 0 also after
            rounds n, 2n, …, and the following rounds train from the calibrated head.
        virtual_per_class: M_c, the virtual features drawn for every class the clients hold.
        calib_lr: the learning rate of the head's SGD on the virtual features.
        calib_steps: SGD steps of the head per calibration.
        calib_batch_size: virtual features per step.
        head: the classifier's entries, re-trained on the virtual features: ``classifier`` (the layers of
            ``net.forward_head`` in fedlight's models) or glob patterns over the model's state-dict keys.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``proportional`` (p_k ∝ n_k), as FedAvg here.
    """

    def __init__(
        self,
        calibrate_every: int = 0,
        virtual_per_class: int = 2000,
        calib_lr: float = 0.1,
        calib_steps: int = 1000,
        calib_batch_size: int = 64,
        head: str | Sequence[str] = "classifier",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not calibrate_every >= 0:
            problems.append(
                f"Expected --strategy.init_args.calibrate_every ≥ 0, got {calibrate_every}; 0 calibrates after the "
                "last round only, as the paper does."
            )
        for flag, value in [
            ("virtual_per_class", virtual_per_class),
            ("calib_steps", calib_steps),
            ("calib_batch_size", calib_batch_size),
        ]:
            if not value >= 1:
                problems.append(f"Expected --strategy.init_args.{flag} ≥ 1, got {value}.")
        if not calib_lr > 0:
            problems.append(f"Expected --strategy.init_args.calib_lr > 0, got {calib_lr}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.calibrate_every, self.virtual_per_class = calibrate_every, virtual_per_class
        self.calib_lr, self.calib_steps, self.calib_batch_size = calib_lr, calib_steps, calib_batch_size
        self.head = [head] if isinstance(head, str) else list(head)
        # server_update receives no context: the run's, kept from on_fit_start
        self._context: RunContext | None = None
        self._head_names: list[str] = []  # the head's entries
        self._head_mask: Tensor | None = None  # [P] bool, the same
        self._num_features = 0  # D, the width of the head's input
        self._metrics: dict[str, float] = {}  # the last calibration's losses, logged by on_round_end

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        """CCVR reads ``net.forward_features`` and re-trains ``net.forward_head``'s parameters named by ``head``."""
        net = getattr(module, "net", None)
        if net is None or not (hasattr(net, "forward_features") and hasattr(net, "forward_head")):
            return [
                "--strategy CCVR re-trains the classifier on features, through module.net.forward_features and "
                f"module.net.forward_head, which --model {type(module).__name__} lacks. Use "
                "fedlight.clients.ClassificationClient with a registered network."
            ]
        layout = FlatState(module, getattr(module, "frozen_modules", ()))
        try:
            names = set(cluster_entry_names(module, layout, self.head))
        except ConfigError:
            names = set()
        if not names & {name for name, p in module.named_parameters() if p.requires_grad}:
            return [
                f"--strategy.init_args.head {self.head} names no trainable parameter of {type(module).__name__}'s "
                f"federated entries. Use {', '.join(GROUPS)} or glob patterns over its state-dict keys, e.g. "
                f"{layout.names[-1]!r}."
            ]
        return []

    def on_fit_start(self, context: RunContext) -> None:
        """Finds the head's entries and the width D of the features, from one batch of the first client."""
        module = context.module
        self._context = context
        self._head_names = cluster_entry_names(module, context.layout, self.head)
        self._head_mask = context.layout.mask(self._head_names)
        with _eval_mode(module), torch.no_grad():
            x, _ = context.precision.convert_input(next(context.datamodule.client_batches(0, split="train")))
            with context.precision.forward_context():
                features = module.net.forward_features(x)
        if features.ndim != 2:
            raise ConfigError(
                f"--strategy CCVR models a class's features as one Gaussian vector [B, D], but --model's "
                f"forward_features gives {tuple(features.shape)}. Use a classification network."
            )
        self._num_features = features.shape[1]

    def server_update(self, global_state: Tensor, aggregate: Tensor, updates: list[ClientUpdate]) -> Tensor:
        """W^{t+1}: the average, with its head calibrated (Algorithm 1) after the rounds that are due."""
        context = self._context
        assert context is not None and self._head_mask is not None, "CCVR.server_update ran before on_fit_start"
        if not context.due(context.round, self.calibrate_every):
            return aggregate
        module = context.module
        with _eval_mode(module):
            context.layout.load(module, aggregate, context.global_integers)
            statistics = [t.cpu() for t in self.global_statistics(context, module)]  # N_c, μ_c, Σ_c
            rng = context.strategy_rng(context.round)
            features, labels = virtual_features(rng, *statistics, self.virtual_per_class)
            self._retrain_head(context, module, features, labels, rng)
            calibrated = context.layout.flatten(module).to(aggregate.device)
        return torch.where(self._head_mask.to(aggregate.device), calibrated, aggregate)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The head's cross-entropy on the virtual features before and after a calibration of this round."""
        metrics, self._metrics = self._metrics, {}
        return metrics

    # -- Algorithm 1 -----------------------------------------------------------------------------------
    def global_statistics(self, context: RunContext, module: LightningModule) -> tuple[Tensor, Tensor, Tensor]:
        """N_c [C], μ_c [C, D] and Σ_c [C, D, D] of every client's features under ``module`` (Eqs. 2–4), fp64."""
        num_classes, width = context.datamodule.num_classes, self._num_features
        device = torch.device("cpu") if context.device.type == "mps" else context.device  # MPS has no fp64
        sizes = [num_classes, num_classes * width, num_classes * width * width]

        def terms(client: int) -> Tensor:  # client k's message (Eq. 2) as Eq. 4's three terms, flat
            message = _client_statistics(context, module, client, device)
            return torch.cat([t.reshape(-1) for t in eq4_terms(*message)])

        totals = context.sum_over_clients(
            terms, range(context.datamodule.num_clients), torch.zeros(sum(sizes), dtype=torch.float64, device=device)
        )
        counts, first, second = totals.split(sizes)
        return pooled_statistics(counts, first.view(num_classes, width), second.view(num_classes, width, width))

    def _retrain_head(
        self,
        context: RunContext,
        module: LightningModule,
        features: np.ndarray,
        labels: np.ndarray,
        rng: np.random.Generator,
    ) -> None:
        """Eq. 5: SGD on the cross-entropy of the head on the virtual features, from the global model's head."""
        names = set(self._head_names)
        params = [p for name, p in module.named_parameters() if name in names and p.requires_grad]
        device, precision = context.device, context.precision
        z = precision.convert_input(torch.from_numpy(features).float().to(device))  # [Σ M_c, D]
        y = torch.from_numpy(labels).to(device)  # [Σ M_c]

        def loss_on(index: Tensor | slice) -> Tensor:
            with precision.forward_context():
                return F.cross_entropy(module.net.forward_head(z[index]).float(), y[index])

        with torch.no_grad():
            before = float(loss_on(slice(None)))
        optimizer = torch.optim.SGD(params, lr=self.calib_lr)
        with torch.enable_grad():
            for _, index in zip(range(self.calib_steps), _batches(rng, len(y), self.calib_batch_size), strict=False):
                loss = loss_on(torch.from_numpy(index).to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        for p in module.parameters():  # no gradient left on the resident module
            p.grad = None
        with torch.no_grad():
            after = float(loss_on(slice(None)))
        self._metrics = {"ccvr/virtual_loss_before": before, "ccvr/virtual_loss_after": after}


# -- the maths ---------------------------------------------------------------------------------------------


def class_moments(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-class counts ``[C]``, feature sums ``[C, D]`` and sums of zzᵀ ``[C, D, D]`` of ``[B, D]`` features.

    They add up over batches; :func:`class_statistics` turns them into a client's message.
    """
    num, width = num_classes, features.shape[1]
    counts = torch.zeros(num, dtype=features.dtype, device=features.device)
    sums = torch.zeros(num, width, dtype=features.dtype, device=features.device)
    outers = torch.zeros(num, width, width, dtype=features.dtype, device=features.device)
    for c in labels.unique().tolist():
        z = features[labels == c]  # [N, D]
        counts[c], sums[c], outers[c] = len(z), z.sum(dim=0), z.T @ z
    return counts, sums, outers


def class_statistics(counts: Tensor, sums: Tensor, outers: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. 2: N_{c,k} ``[C]``, μ_{c,k} ``[C, D]`` and the unbiased Σ_{c,k} ``[C, D, D]`` from a client's moments.

    μ is 0 for a class the client lacks, Σ is 0 where N_{c,k} ≤ 1 (undefined; Eq. 4 weighs it by N_{c,k} − 1 = 0).

    >>> z, y = torch.tensor([[0.0], [2.0], [5.0]], dtype=torch.float64), torch.tensor([0, 0, 1])
    >>> n, mu, sigma = class_statistics(*class_moments(z, y, 3))
    >>> n.tolist(), mu.flatten().tolist(), sigma.flatten().tolist()
    ([2.0, 1.0, 0.0], [1.0, 5.0, 0.0], [2.0, 0.0, 0.0])
    """
    means = sums / counts.clamp(min=1)[:, None]
    scatter = outers - counts[:, None, None] * means[:, :, None] * means[:, None, :]  # Σ_j (z − μ)(z − μ)ᵀ
    covariances = scatter / (counts - 1).clamp(min=1)[:, None, None]
    return counts, means, torch.where((counts > 1)[:, None, None], covariances, 0.0)


def eq4_terms(counts: Tensor, means: Tensor, covariances: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What client k adds to the server's sums in Eqs. 3–4: N_{c,k}, N_{c,k} μ_{c,k} and
    (N_{c,k} − 1) Σ_{c,k} + N_{c,k} μ_{c,k} μ_{c,k}ᵀ (leading dimensions kept)."""
    n = counts[..., None]
    outer = means[..., :, None] * means[..., None, :]
    return counts, n * means, (n - 1).clamp(min=0)[..., None] * covariances + n[..., None] * outer


def pooled_statistics(counts: Tensor, first: Tensor, second: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """N_c, μ_c (Eq. 3) and Σ_c (Eq. 4) from the clients' summed :func:`eq4_terms`; Σ_c is 0 where N_c ≤ 1."""
    means = first / counts.clamp(min=1)[:, None]  # μ_c = Σ_k N_{c,k} μ_{c,k} / N_c
    outer = means[:, :, None] * means[:, None, :]
    covariances = (second - counts[:, None, None] * outer) / (counts - 1).clamp(min=1)[:, None, None]
    covariances = (covariances + covariances.transpose(1, 2)) / 2  # symmetric up to rounding
    return counts, means, torch.where((counts > 1)[:, None, None], covariances, 0.0)


def combine_class_statistics(counts: Tensor, means: Tensor, covariances: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Eqs. 3–4: the clients' N_{c,k} ``[K, C]``, μ_{c,k} ``[K, C, D]``, Σ_{c,k} ``[K, C, D, D]`` → the pooled
    N_c ``[C]``, μ_c ``[C, D]``, Σ_c ``[C, D, D]``.

    >>> n, mu, sigma = combine_class_statistics(  # client 1 holds {0, 2}, client 2 holds {4}
    ...     torch.tensor([[2.0], [1.0]]), torch.tensor([[[1.0]], [[4.0]]]), torch.tensor([[[[2.0]]], [[[0.0]]]]))
    >>> n.item(), mu.item(), sigma.item()  # the mean and unbiased variance of {0, 2, 4}
    (3.0, 2.0, 4.0)
    """
    return pooled_statistics(*(t.sum(dim=0) for t in eq4_terms(counts, means, covariances)))


def virtual_features(
    rng: np.random.Generator, counts: Tensor, means: Tensor, covariances: Tensor, per_class: int
) -> tuple[np.ndarray, np.ndarray]:
    """``per_class`` draws from N(μ_c, Σ_c) for every class with N_c ≥ 1, in class order: ``[Σ M_c, D]`` features
    and their ``[Σ M_c]`` labels."""
    features, labels = [], []
    for c in np.flatnonzero(counts.numpy() > 0):
        features.append(rng.multivariate_normal(means[c].numpy(), covariances[c].numpy(), per_class, method="eigh"))
        labels.append(np.full(per_class, c))
    return np.concatenate(features), np.concatenate(labels)


# -- helpers -----------------------------------------------------------------------------------------------


@torch.no_grad()
def _client_statistics(
    context: RunContext, module: LightningModule, client: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Client ``client``'s message (Eq. 2) of its training split under ``module``, fp64 on ``device``."""
    precision, num_classes, moments = context.precision, context.datamodule.num_classes, None
    for batch in context.datamodule.client_batches(client, split="train"):
        x, y = precision.convert_input(batch)
        with precision.forward_context():
            features = module.net.forward_features(x)  # [B, D]
        batch_moments = class_moments(features.to(device, torch.float64), y.to(device), num_classes)
        moments = batch_moments if moments is None else [a + b for a, b in zip(moments, batch_moments, strict=True)]
    assert moments is not None, f"client {client} has no training samples"
    return class_statistics(*moments)


def _batches(rng: np.random.Generator, total: int, batch_size: int) -> Iterator[np.ndarray]:
    """Mini-batches of indices, epoch after epoch, each epoch a fresh permutation (its last batch may be short)."""
    while True:
        order = rng.permutation(total)
        for start in range(0, total, batch_size):
            yield order[start : start + batch_size]


@contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Eval mode for the block, then every submodule's own mode back."""
    modes = {child: child.training for child in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for child, training in modes.items():
            child.train(training)
