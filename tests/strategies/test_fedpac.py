"""FedPAC through the engine against Algorithm 1 of Xu, Tong & Huang (ICLR 2023) written out in plain torch, and its
combination QP against independent solutions.

A small CNN over ClientImages, full batches, two of three clients per round: each client starts from the global body
with its own head, measures E[z yᵀ] and the trace of the covariance of z yᵀ with that body, trains its head with the
body fixed, then its body on cross-entropy plus λ times the distance of its features to the global centroids. The
server averages the models by n_k, takes the count-weighted centroids, and gives each client the head of weights
argmin_α ‖h_i − Σ_j α_j h_j‖² + Σ_j α_j² V_j / n_j over the simplex, which for two clients is a clipped ratio.
"""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.fedpac import FedPAC, collaboration_matrices, simplex_qp
from fedlight.testing import ClientImages, ScalarClient

SIZES, SEEDS = [12, 16, 10], [1, 2, 3]
LR, EPOCHS, HEAD_EPOCHS, ROUNDS, LAM = 0.1, 2, 2, 3, 0.5
HEAD = ("head.weight", "head.bias")


class Recorded(FedPAC):
    """FedPAC that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def make_client():
    torch.manual_seed(0)
    return ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    )  # fmt: skip


def fit(root, rule):
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=1000, test_fraction=0.25)
    trainer = FederatedTrainer(
        rounds=ROUNDS, clients_per_round=2, local_epochs=EPOCHS, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(make_client(), data, rule)
    return trainer


def features(net, params, x):
    """f(x): the CNN's encoder with ``params``."""
    encoder = {n.removeprefix("encoder."): t for n, t in params.items() if n.startswith("encoder.")}
    return functional_call(net.encoder, encoder, (x,))


def sgd(params, names, loss_fn, steps):
    """``steps`` full-batch SGD steps of ``loss_fn(params)`` on the entries ``names`` only."""
    for _ in range(steps):
        params = {n: t.detach().requires_grad_(n in names) for n, t in params.items()}
        grads = torch.autograd.grad(loss_fn(params), [params[n] for n in names])
        params = {
            **{n: t.detach() for n, t in params.items()},
            **{n: (params[n] - LR * g).detach() for n, g in zip(names, grads, strict=True)},
        }
    return params


def algorithm_1(rounds, data, net, lam, distance, collaborate):
    """The global model, every client's head and the global centroids ``{class: [D]}`` after ``rounds``, and the
    combination weights of each round."""
    w = {name: p.detach().clone() for name, p in net.named_parameters()}
    body = [n for n in w if n not in HEAD]
    heads, centroids, weights = {}, {}, []
    for clients in rounds:
        sent = []
        for k in clients:
            index = data.client_train[k]
            x, y = data.pool.inputs[index], data.pool.targets[index]
            params = {**w, **heads.get(k, {})}
            with torch.no_grad():  # E[z yᵀ] and tr Cov(z yᵀ) with the received body, from their definitions
                outer = features(net, params, x).double()[:, :, None] * F.one_hot(y, 3).double()[:, None, :]
                h = outer.mean(0)  # [D, C]
                variance = (outer - h).square().sum(dim=(1, 2)).mean()

            def task(p, x=x, y=y):
                return F.cross_entropy(functional_call(net, p, (x,)), y)

            def aligned(p, x=x, y=y):
                z = features(net, p, x)
                pulls = [
                    (f - centroids[int(c)]).square().sum() / (1 if distance == "squared_l2" else f.numel())
                    for f, c in zip(z, y, strict=True) if int(c) in centroids
                ]  # fmt: skip
                return task(p) + lam * sum(pulls) / len(y)

            params = sgd(params, HEAD, task, HEAD_EPOCHS)  # the head, body fixed
            params = sgd(params, body, aligned, EPOCHS)  # then the body, head fixed
            with torch.no_grad():
                z = features(net, params, x)
            classes = sorted(set(y.tolist()))
            local = {c: (int((y == c).sum()), z[y == c].mean(0)) for c in classes}
            sent.append((len(y), params, local, h, float(variance)))

        total = sum(n for n, *_ in sent)
        w = {name: sum(n * p[name] for n, p, *_ in sent) / total for name in w}
        for c in {c for *_, local, _, _ in sent for c in local}:  # classes nobody sent keep their centroid
            count = sum(local[c][0] for _, _, local, _, _ in sent if c in local)
            centroids[c] = sum(local[c][0] * local[c][1] for _, _, local, _, _ in sent if c in local) / count
        alphas = []
        for i in range(len(sent)):
            h_i = sent[i][3]
            q = torch.tensor([
                [float(((h_i - sent[j][3]) * (h_i - sent[m][3])).sum()) + (j == m) * sent[j][4] / sent[j][0]
                 for m in range(2)] for j in range(2)
            ], dtype=torch.float64)  # fmt: skip
            # two clients: minimise a² q00 + 2a(1 − a) q01 + (1 − a)² q11 over a ∈ [0, 1]
            a = min(max(float((q[1, 1] - q[0, 1]) / (q[0, 0] - 2 * q[0, 1] + q[1, 1])), 0.0), 1.0)
            alphas.append((a, 1 - a) if collaborate else (1.0 - i, float(i)))
        for k, (a0, a1) in zip(clients, alphas, strict=True):
            heads[k] = {n: a0 * sent[0][1][n] + a1 * sent[1][1][n] for n in HEAD}
        weights.append(alphas)
    return w, heads, centroids, weights


def as_net_state(layout, flat):
    return {name.removeprefix("net."): value for name, value in layout.to_state_dict(flat, {}).items()}


@pytest.mark.parametrize(("distance", "collaborate"), [("squared_l2", True), ("mse", False)])
def test_rounds_of_partial_participation_follow_algorithm_1(tmp_path, distance, collaborate):
    rule = Recorded(lam=LAM, head_epochs=HEAD_EPOCHS, distance=distance, collaborate=collaborate)
    trainer = fit(tmp_path, rule)
    rounds, data, layout = rule.rounds, trainer.run.datamodule, trainer.model.layout
    assert all(len(clients) == 2 for clients in rounds) and {k for c in rounds for k in c} == {0, 1, 2}
    w, heads, centroids, weights = algorithm_1(rounds, data, make_client().net, LAM, distance, collaborate)
    if collaborate:  # the heads were mixed, not only kept or swapped
        assert any(0.01 < a < 0.99 for alphas in weights[1:] for a, _ in alphas), weights

    tolerance = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(as_net_state(layout, trainer.global_state), w, **tolerance)
    head_entries = layout.mask([f"net.{n}" for n in HEAD])
    for k in range(3):
        expected = torch.cat([heads[k][n].reshape(-1) for n in HEAD])  # the layout's order: weight, bias
        torch.testing.assert_close(rule.heads[k], expected, **tolerance)
    assert bool(rule.known.all())
    torch.testing.assert_close(rule.centroids, torch.stack([centroids[c] for c in range(3)]), **tolerance)

    # every client is scored with the global body and its own head on its held-out samples
    net, held_out = make_client().net, data.held_out_index
    own = [held_out[data.held_out_group == k] for k in range(3)]
    loss_sum = sum(
        F.cross_entropy(functional_call(net, {**w, **heads[k]}, (data.pool.inputs[own[k]],)), data.pool.targets[own[k]],
                        reduction="sum").item()
        for k in range(3)
    )  # fmt: skip
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(loss_sum / len(held_out), rel=1e-4)
    assert int(head_entries.sum()) == 8 * 3 + 3


def test_one_round_of_the_server_by_hand():
    # one class, D = 1: client 0 has n = 2, μ = 2, V = 4; client 1 has n = 1, μ = 0, V = 1, so h = 2, 0 and
    # V / n = 2, 1. Client 0: Q = [[2, 0], [0, 4 + 1]], α ∝ (1/2, 1/5) = (5/7, 2/7); client 1: Q = [[4 + 2, 0],
    # [0, 1]], α = (1/7, 6/7).
    rule = FedPAC()
    rule._head_entries = torch.tensor([False, True, True])

    def update(client, head, centroid, count, mean, variance):
        payload = {"head": torch.tensor(head), "centroids": torch.tensor([[centroid]]), "counts": torch.tensor([count]),
                   "means": torch.tensor([[mean]]), "variance": variance}  # fmt: skip
        return SimpleNamespace(client=client, payload=payload)

    metrics = rule.on_round_end(
        None, 0, [update(4, [1.0, 0.0], 3.0, 2, 2.0, 4.0), update(7, [0.0, 1.0], 0.0, 1, 0.0, 1.0)]
    )
    torch.testing.assert_close(rule.heads[4], torch.tensor([5 / 7, 2 / 7]), rtol=0, atol=1e-6)
    torch.testing.assert_close(rule.heads[7], torch.tensor([1 / 7, 6 / 7]), rtol=0, atol=1e-6)
    assert rule.centroids.tolist() == [[2.0]] and rule.known.tolist() == [True]  # (2·3 + 1·0) / 3
    assert metrics["fedpac/alpha_self"] == pytest.approx((5 / 7 + 6 / 7) / 2, abs=1e-6)
    assert metrics["fedpac/heads_mixed"] == 2.0 and metrics["fedpac/qp_unconverged"] == 0.0
    # client 4's own model: the state with its head; a client that never trained keeps the state's
    state = torch.tensor([9.0, 9.0, 9.0])
    assert rule.personal_state(None, 4, {}, state).tolist() == pytest.approx([9.0, 5 / 7, 2 / 7])
    assert rule.initial_state(None, SimpleNamespace(client=5), state) is state
    clone = FedPAC()
    clone.load_state_dict(rule.state_dict())
    assert clone.heads.keys() == rule.heads.keys() and torch.equal(clone.heads[7], rule.heads[7])
    assert torch.equal(clone.centroids, rule.centroids) and torch.equal(clone.known, rule.known)


def _brute_force(q, step=0.001):
    """The best point of a grid over the three-client simplex, and its value."""
    a, b = np.meshgrid(np.arange(0.0, 1.0 + step / 2, step), np.arange(0.0, 1.0 + step / 2, step))
    points = np.stack([a.ravel(), b.ravel(), 1.0 - a.ravel() - b.ravel()], axis=1)
    points = points[points[:, 2] >= -1e-12].clip(min=0.0)  # [N, 3] on the simplex
    values = np.einsum("ni,ij,nj->n", points, q, points)
    return points[values.argmin()], values.min()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_qp_against_a_grid_over_the_simplex(seed):
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(3, 4, 5, generator=generator) * torch.tensor([1.0, 1.5, 0.3])[:, None, None]
    counts = torch.randint(0, 6, (3, 4), generator=generator) + torch.tensor([[1, 0, 0, 0]])
    variances = torch.rand(3, generator=generator) * 3
    for q in collaboration_matrices(means, counts, variances).numpy():
        alpha, converged = simplex_qp(q)
        grid_alpha, grid_value = _brute_force(q)
        assert converged and alpha.min() >= 0 and alpha.sum() == pytest.approx(1.0)
        assert alpha @ q @ alpha <= grid_value + 1e-9  # no grid point does better
        np.testing.assert_allclose(alpha, grid_alpha, atol=5e-3)


@pytest.mark.parametrize("seed", [3, 4])
def test_the_qp_meets_the_kkt_conditions(seed):
    # for min αᵀQα on the simplex: 2Qα = ν on the support, ≥ ν off it
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(6, 4))
    q = a @ a.T + np.diag(rng.uniform(0.0, 0.5, 6))
    alpha, converged = simplex_qp(q)
    gradient = 2 * q @ alpha
    support = alpha > 1e-6
    nu = gradient[support].mean()
    assert converged and 0 < support.sum() < 6  # some client left out, so the bounds are tested too
    np.testing.assert_allclose(gradient[support], nu, atol=1e-5)
    assert (gradient[~support] >= nu - 1e-6).all()


def test_collaboration_matrices_are_the_bias_and_variance_terms():
    means, counts = torch.tensor([[[1.0, 2.0], [0.0, 9.0]], [[3.0, 0.0], [1.0, 1.0]]]), torch.tensor([[3, 0], [1, 1]])
    q = collaboration_matrices(means, counts, torch.tensor([2.0, 4.0]))
    h = [torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([[1.5, 0.0], [0.5, 0.5]])]  # p_k μ_k; class 1 absent
    for i, j, m in itertools.product(range(2), repeat=3):
        bias = ((h[i] - h[j]) * (h[i] - h[m])).sum().item()
        assert q[i, j, m].item() == pytest.approx(bias + (j == m) * [2.0 / 3, 4.0 / 2][j])


def test_bad_settings_are_reported():
    with pytest.raises(ConfigError) as err:
        FedPAC(lam=-1.0, head_epochs=0, distance="l1", qp_tol=0.0, qp_max_iter=0)
    for flag in ("lam", "head_epochs", "distance", "qp_tol", "qp_max_iter"):
        assert f"--strategy.init_args.{flag}" in str(err.value)
    problems = FedPAC().check(ScalarClient(), None)
    assert any("forward_features" in p and "ClassificationClient" in p for p in problems)
    assert FedPAC().check(make_client(), None) == []
