"""FedPAC: Xu, Tong & Huang, *Personalized Federated Learning with Feature Alignment and Classifier Collaboration*,
ICLR 2023 (arXiv 2306.11867), Algorithm 1.

The model is a feature extractor f_θ (the body, shared) and a linear classifier φ (the head, one per client). In
its round, client i receives the global body θ^t and the global class centroids c, and

1. reads the statistics of classifier collaboration with the received body (Sec. 4.2): its class counts n_{i,k},
   class feature means μ_{i,k} and the variance term V_i = E‖z‖² − Σ_k p_{i,k}² ‖μ_{i,k}‖², the trace of the
   covariance of z yᵀ (z = f_θ(x), y one-hot, p_{i,k} = n_{i,k}/n_i);
2. trains its head for τ_h epochs with the body fixed (``head_epochs``, as FedRep);
3. trains the body for the round's local epochs with the head fixed, on the feature-aligned loss (Sec. 4.1)

       L_i = CE(φ_i(f_θ(x)), y) + λ · (1/B) Σ_b ‖f_θ(x_b) − c_{y_b}‖²,

   a sample whose class has no global centroid yet (every sample of the first round) adding no term;
4. sends its body, its head φ_i, its local centroids ĉ_{i,k} (class means of f_θ with the trained body) with
   their counts, and the statistics of step 1 (``ClientUpdate.payload``).

The server averages the bodies by n_i, takes the global centroids as count-weighted means,
c_k = Σ_i n_{i,k} ĉ_{i,k} / Σ_i n_{i,k} (a class none of the round's clients holds keeps its centroid), and gives
each of the round's clients i the head φ̂_i = Σ_j α_ij φ_j, with α_i minimising the estimated test loss of the
combination over the simplex (Sec. 4.2):

    min_α  ‖h_i − Σ_j α_j h_j‖²_F + Σ_j α_j² V_j / n_j   s.t. α ≥ 0, Σ_j α_j = 1,

where h_j = E_j[z yᵀ], the [C, D] matrix of rows p_{j,k} μ_{j,k}: the bias of borrowing the other clients' heads
against the variance of each client's estimate. With Σ_j α_j = 1 this is the quadratic form αᵀ Q^{(i)} α with
Q^{(i)}_{jl} = ⟨h_i − h_j, h_i − h_l⟩ + δ_{jl} V_j / n_j (:func:`collaboration_matrices`), solved by
:func:`simplex_qp`. Each client is scored with the global body and its own head (``clients/personal/*``).

The heads φ̂_i live in the rule (per client, [H] each, in its ``state_dict``): the engine keeps a client's slots
as its own fit leaves them, and has no way for the server to write a client's state after aggregation. The global
model averages every entry, the head too, so that it has values of its own to be scored with (``clients/*``,
``test/*``); a client that has not trained yet starts from that head.

Where the authors' code (``JianXu95/FedPAC``) differs:

- its alignment term is ``nn.MSELoss``, the squared distance averaged over the D feature dimensions too
  (``distance: mse``; its default λ = 1 goes with it), and a class without a global centroid is pulled to its
  local centroid from before training instead of adding nothing;
- its head epoch runs with a learning rate of its own (0.1), its body epochs with the run's (0.01); here both take
  the client's optimizer;
- it solves the QP with cvxpy (projecting Q onto positive semidefinite matrices where rounding made it indefinite)
  and drops the weights below 10⁻³, renormalising the rest; here the weights are SLSQP's, none dropped;
- its global centroids average only the round's clients, with no carry-over of absent classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from fedlight.client_state import Slot
from fedlight.errors import ConfigError
from fedlight.metrics.functional.prototypes import aggregate_prototypes, class_feature_sums, prototypes_from_sums
from fedlight.strategies.base import traceable_loss
from fedlight.strategies.fedrep import FedRep
from fedlight.strategies.tan_fedproto import prototype_distance

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate

#: a combination weight above this counts as a head the client borrows from (``fedpac/heads_mixed``)
_MIXED = 1e-3


def collaboration_matrices(means: Tensor, counts: Tensor, variances: Tensor) -> Tensor:
    """Q^{(i)} of every client i of a round: ``[K, K, K]``, with αᵀ Q^{(i)} α the estimated test loss of client i's
    combined head Σ_j α_j φ_j when Σ_j α_j = 1 (FedPAC, Sec. 4.2).

    Q^{(i)}_{jl} = ⟨h_i − h_j, h_i − h_l⟩ + δ_{jl} V_j / n_j, with h_j [C, D] the rows p_{j,k} μ_{j,k} (E_j[z yᵀ]).

    Args:
        means: ``[K, C, D]`` class feature means μ_{j,k} (any value where n_{j,k} = 0).
        counts: ``[K, C]`` class counts n_{j,k}.
        variances: ``[K]`` V_j = E_j‖z‖² − Σ_k p_{j,k}² ‖μ_{j,k}‖².

    Returns:
        ``[K, K, K]`` float64, Q^{(i)} at index i.

    Example:
        >>> # one class, D = 1: h = [2], [0]; V / n = 4 / 2, 1 / 1
        >>> q = collaboration_matrices(torch.tensor([[[2.0]], [[0.0]]]), torch.tensor([[2], [1]]),
        ...                            torch.tensor([4.0, 1.0]))
        >>> q[0].tolist(), q[1].tolist()  # client 0: bias (2 − h_j)(2 − h_l); client 1: (0 − h_j)(0 − h_l)
        ([[2.0, 0.0], [0.0, 5.0]], [[6.0, 0.0], [0.0, 1.0]])
    """
    counts = counts.double()
    n = counts.sum(dim=1)  # [K]
    present = (counts > 0).unsqueeze(-1)
    h = torch.where(present, (counts / n[:, None]).unsqueeze(-1) * means.double(), 0.0)  # [K, C, D]
    flat = h.flatten(1)  # [K, C·D]
    gram = flat @ flat.T  # ⟨h_j, h_l⟩, [K, K]
    own = gram.diagonal()
    # ⟨h_i − h_j, h_i − h_l⟩ = G_ii − G_ij − G_il + G_jl, [i, j, l]
    bias = own[:, None, None] - gram[:, :, None] - gram[:, None, :] + gram[None, :, :]
    return bias + torch.diag(variances.double() / n)


def simplex_qp(q: np.ndarray, tol: float = 1e-12, max_iter: int = 200) -> tuple[np.ndarray, bool]:
    """argmin_α αᵀ q α over the simplex {α ≥ 0, Σ α = 1}, and whether the solver converged.

    The problem is a small convex QP (q is positive semidefinite: a Gram matrix plus a non-negative diagonal) with
    one equality and K bounds. SciPy has no solver for QPs as such; SLSQP (``scipy.optimize.minimize``) takes the
    equality and the bounds as they are, with the exact gradient 2qα, and converges in some ten iterations on a problem
    of this size, so it needs no dependency beyond SciPy (the authors use cvxpy). q is scaled to a largest entry of
    1 first, since SLSQP's tolerance is absolute; its result is clipped to α ≥ 0 and renormalised.

    Args:
        q: ``[K, K]`` symmetric positive semidefinite.
        tol: SLSQP's ``ftol`` on the scaled problem.
        max_iter: SLSQP's ``maxiter``.

    Example:
        >>> alpha, converged = simplex_qp(np.array([[1.0, 0.0], [0.0, 3.0]]))  # minimises a² + 3(1 − a)²
        >>> np.round(alpha, 6).tolist(), converged
        ([0.75, 0.25], True)
    """
    from scipy.optimize import minimize  # seconds to import; only the server's step needs it

    k = q.shape[0]
    scale = float(np.abs(q).max()) if k else 0.0
    if k == 1 or scale == 0.0:  # one head, or every combination alike
        return np.full(k, 1.0 / k), True
    q = (q + q.T) / (2.0 * scale)
    result = minimize(
        lambda a: a @ q @ a,
        np.full(k, 1.0 / k),
        jac=lambda a: 2.0 * q @ a,
        method="SLSQP",
        bounds=[(0.0, None)] * k,  # α ≤ 1 follows from Σ α = 1; upper bounds would double the subproblem's rows
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones((1, k))}],
        options={"ftol": tol, "maxiter": max_iter},
    )
    alpha = np.clip(result.x, 0.0, None)
    return alpha / alpha.sum(), bool(result.success)


class FedPAC(FedRep):
    """FedRep's head-then-body rounds with feature alignment to global centroids, and each client's head a
    combination of the round's heads chosen by a quadratic program.

    Args:
        lam: λ ≥ 0, the weight of the feature alignment term (1 in the authors' code, with ``distance: mse``); 0
            leaves the body on cross-entropy alone (classifier collaboration without feature alignment).
        head_epochs: τ_h ≥ 1, epochs of head training with the body fixed before the body's local epochs
            (``--trainer.local_epochs``); 1 in the authors' code, with 5 epochs of the body.
        distance: ``squared_l2``, ‖f(x) − c_y‖² as in the paper; ``mse``, the same averaged over the D feature
            dimensions, as the authors' code.
        collaborate: give each client the QP's combination of the round's heads; ``false`` keeps its own trained
            head (feature alignment without classifier collaboration).
        qp_tol: SLSQP's tolerance (``ftol``) on the combination QP, scaled to a largest entry of 1.
        qp_max_iter: SLSQP's iteration limit on the combination QP.
        head: the classifier (personalisation) layers, as for :class:`~fedlight.strategies.FedRep`; a linear layer
            reading ``forward_features``.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn: ``null`` is ``uniform``, as the authors' code.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        lam: float = 1.0,
        head_epochs: int = 1,
        distance: Literal["squared_l2", "mse"] = "squared_l2",
        collaborate: bool = True,
        qp_tol: float = 1e-12,
        qp_max_iter: int = 200,
        head: str | Sequence[str] = "classifier",
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not lam >= 0:
            problems.append(f"Expected --strategy.init_args.lam (λ) ≥ 0, got {lam}; the authors' code uses 1.")
        if not head_epochs >= 1:
            problems.append(
                f"Expected --strategy.init_args.head_epochs (τ_h) ≥ 1, got {head_epochs}; the authors' code trains the "
                "head for 1 epoch before the body."
            )
        if distance not in ("squared_l2", "mse"):
            problems.append(f"Expected --strategy.init_args.distance to be 'squared_l2' or 'mse', got {distance!r}.")
        if not 0 < qp_tol < 1:
            problems.append(
                f"Expected 0 < --strategy.init_args.qp_tol < 1, got {qp_tol}; 1e-12 solves it to float precision."
            )
        if not qp_max_iter >= 1:
            problems.append(f"Expected --strategy.init_args.qp_max_iter ≥ 1, got {qp_max_iter}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(head_epochs, head, tolerate_stragglers, sampling)
        self.lam, self.distance, self.collaborate = lam, distance, collaborate
        self.qp_tol, self.qp_max_iter = qp_tol, qp_max_iter
        self.centroids: Tensor | None = None  # c [C, D] (CPU); None until a round has ended
        self.known: Tensor | None = None  # [C] bool: the classes c holds
        self.heads: dict[int, Tensor] = {}  # φ̂_i [H] (CPU) of every client that has trained
        self._head_entries: Tensor | None = None  # [P] bool
        self._targets: tuple[Tensor, Tensor] | None = None  # c and its mask on the device, during a client's fit
        self._statistics: dict[str, Any] = {}  # μ_i and V_i of the client in its fit, with the received body

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        problems = super().check(module, datamodule)
        net = getattr(module, "net", None)
        if net is None or not (hasattr(net, "forward_features") and hasattr(net, "forward_head")):
            problems.append(
                "--strategy FedPAC aligns and combines through the features the classifier reads "
                f"(module.net.forward_features, then forward_head), but --model {type(module).__name__} has "
                f"{'a net ' + type(net).__name__ + ' without them' if net is not None else 'no net'}. Use "
                "fedlight.clients.ClassificationClient with a registered network."
            )
        return problems

    def on_fit_start(self, context: RunContext) -> None:
        super().on_fit_start(context)
        self._head_entries = context.layout.mask(self.local_names(context.module, context.layout))

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return {"none": Slot.vector(0)}  # the heads φ̂_i are the server's (self.heads); this makes clients scored

    def initial_state(self, context: RunContext, plan: ClientPlan, global_state: Tensor) -> Tensor:
        """θ^t with the client's head φ̂_i (W^t's head before its first round)."""
        return self._with_head(plan.client, global_state)

    def personal_state(self, context: RunContext, client: int, values: Mapping[str, Tensor], start: Tensor) -> Tensor:
        return self._with_head(client, start)

    def _with_head(self, client: int, state: Tensor) -> Tensor:
        head = self.heads.get(client)
        if head is None:
            return state
        assert self._head_entries is not None, "FedPAC: on_fit_start did not run"
        state = state.clone()
        state[self._head_entries.to(state.device)] = head.to(state)
        return state

    # -- client side -------------------------------------------------------------------------------
    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        """Statistics with the received body, then the head epochs (FedRep's), then the body's aligned epochs."""
        sums, counts, squares = _feature_statistics(context, module, plan.client)
        n = counts.sum()
        means = prototypes_from_sums(sums, counts)  # μ_{i,k}, [C, D]
        p = counts / n  # p_{i,k}
        variance = squares.sum() / n - (p.square() * means.square().sum(dim=1)).sum()  # V_i
        self._statistics = {"means": means.float(), "variance": float(variance)}
        super().on_client_fit_start(context, module, plan)
        if self.centroids is not None and self.lam > 0:
            self._targets = (self.centroids.to(context.device), self.known.to(context.device))

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, Tensor]) -> Tensor:
        if self._targets is None:  # no global centroid yet, or λ = 0
            return outputs["loss"]
        if "features" not in outputs:
            raise ConfigError(
                f"FedPAC needs the features of each batch, but {type(module).__name__}.training_step returns only "
                f"{sorted(outputs)}. Use a client whose training_step returns 'features' (ClassificationClient)."
            )
        centroids, known = self._targets
        return outputs["loss"] + self.lam * prototype_distance(
            outputs["features"], batch[1], centroids, known, self.distance
        )

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Sends φ_i, the local centroids ĉ_i with the class counts, and the statistics μ_i, V_i."""
        super().on_client_fit_end(context, module, update)
        self._targets = None
        assert self._head_entries is not None and self._statistics, "FedPAC: on_client_fit_start did not run"
        sums, counts, _ = _feature_statistics(context, module, update.client)
        head = context.layout.flatten(module)[self._head_entries.to(context.device)]
        update.payload.update(
            head=head.detach().float().cpu(),
            centroids=prototypes_from_sums(sums, counts).float(),
            counts=counts,
            **self._statistics,
        )
        self._statistics = {}

    # -- server side -------------------------------------------------------------------------------
    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The global centroids, and each of the round's clients' head φ̂_i = Σ_j α_ij φ_j."""
        if not updates:
            return {}
        counts = torch.stack([u.payload["counts"] for u in updates])  # n_{j,k}, [K, C]
        centroids = torch.stack([u.payload["centroids"] for u in updates])  # ĉ_j, [K, C, D]
        aggregate, _, self.known = aggregate_prototypes(centroids, counts, self.centroids, self.known)
        self.centroids = aggregate.float()
        heads = torch.stack([u.payload["head"] for u in updates]).double()  # φ_j, [K, H]
        unsolved = 0
        if self.collaborate:
            means = torch.stack([u.payload["means"] for u in updates])  # μ_j, [K, C, D]
            variances = torch.tensor([u.payload["variance"] for u in updates], dtype=torch.float64)  # V_j
            rows = []
            for q in collaboration_matrices(means, counts, variances).numpy():
                alpha, converged = simplex_qp(q, self.qp_tol, self.qp_max_iter)
                rows.append(alpha)
                unsolved += not converged
            alpha = torch.from_numpy(np.stack(rows))  # α_ij, [K, K]
        else:
            alpha = torch.eye(len(updates), dtype=torch.float64)
        for update, head in zip(updates, (alpha @ heads).float(), strict=True):
            self.heads[update.client] = head
        return {
            "fedpac/alpha_self": float(alpha.diagonal().mean()),  # how much of its own head a client keeps
            "fedpac/heads_mixed": float((alpha > _MIXED).sum(dim=1).double().mean()),
            "fedpac/qp_unconverged": float(unsolved),
            "fedpac/classes_with_centroid": float(self.known.sum()),
        }

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The global centroids and the clients' heads, once a round has ended."""
        if self.centroids is None:
            return {}
        clients = sorted(self.heads)
        return {
            "centroids": self.centroids.clone(),
            "known": self.known.clone(),
            "head_clients": torch.tensor(clients, dtype=torch.int64),
            "heads": torch.stack([self.heads[k] for k in clients]).clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "centroids" not in state:
            self.centroids, self.known, self.heads = None, None, {}
            return
        self.centroids, self.known = state["centroids"].clone(), state["known"].clone()
        self.heads = {int(k): head.clone() for k, head in zip(state["head_clients"], state["heads"], strict=True)}


@torch.no_grad()
def _feature_statistics(context: RunContext, module: LightningModule, client: int) -> tuple[Tensor, Tensor, Tensor]:
    """Class feature sums ``[C, D]``, counts ``[C]`` and sums of squared norms ``[C]`` of a client's training split
    (fp64, CPU), in eval mode and drawing nothing from the random streams; the modules' modes are restored after."""
    modes = {child: child.training for child in module.modules()}
    module.eval()
    precision, num_classes = context.precision, context.datamodule.num_classes
    sums, counts, squares = 0.0, 0, 0.0
    try:
        for batch in context.datamodule.client_batches(client, split="train"):
            x, y = precision.convert_input(batch)
            with precision.forward_context():
                features = module.net.forward_features(x)
            if features.ndim != 2:
                raise ConfigError(
                    f"FedPAC needs one feature vector per sample, [B, D], but {type(module.net).__name__}."
                    f"forward_features gives {tuple(features.shape)}. Use a classification network."
                )
            features, y = features.double(), y.long()
            batch_sums, batch_counts = class_feature_sums(features, y, num_classes)
            sums, counts = sums + batch_sums, counts + batch_counts
            squares = squares + features.new_zeros(num_classes).index_add_(0, y, features.square().sum(dim=1))
    finally:
        for child, training in modes.items():
            child.train(training)
    assert not isinstance(counts, int), f"client {client} has no training samples"
    return sums.cpu(), counts.cpu(), squares.cpu()
