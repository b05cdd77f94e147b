"""Per-FedAvg through the engine against Algorithm 1 of Fallah et al. (NeurIPS 2020) written out in plain Python
floats, and its Hessian-free direction against an exact Hessian-vector product.

ScalarClient's loss is f_k(w) = ½(w − y_k)² on every batch, so ∇f_k(w) = w − y_k and ∇²f_k = 1 whatever the batches
D, D', D'' hold: a local step is temp = w − α(w − y), g = temp − y, and w ← w − β g (FO) or w ← w − β(1 − α) g
(the Hessian term, exact); each client's own model is w − α(w − y_k).
"""

import pytest
import torch
from torch import nn

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.per_fedavg import PerFedAvg
from fedlight.strategies.personal_functional import maml_direction
from fedlight.testing import ScalarClient, ScalarDataset

SIZES, VALUES = [4, 8, 6, 10], [1.0, -2.0, 3.0, 0.5]


class Recorded(PerFedAvg):
    """PerFedAvg that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def fit(root, strategy, rounds, lr, epochs, clients_per_round=2, sizes=SIZES, values=VALUES, batch_size=10_000):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=batch_size, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=lr), data, strategy)
    return trainer


def algorithm_1(rounds, sizes, steps, alpha, beta, hessian_free, weighting="uniform", w=0.0):
    """w after the rounds, each a list of the drawn clients, from w^0 = ``w``; ``steps[k]``: client k's local steps."""
    for clients in rounds:
        local_models, weights = [], []
        for k in clients:
            y, local = VALUES[k], w
            for _ in range(steps[k]):
                temp = local - alpha * (local - y)  # one step of α on D
                g = temp - y  # ∇f(temp; D')
                hessian_vector = 1.0 * g  # ∇²f(w; D'') g, ∇²f = 1
                local -= beta * (g - alpha * hessian_vector if hessian_free else g)
            local_models.append(local)
            weights.append(1.0 if weighting == "uniform" else sizes[k])
        w = sum(a * b for a, b in zip(weights, local_models, strict=True)) / sum(weights)
    return w


def personal_loss(w, sizes, alpha):
    """The held-out loss of the clients' own models w − α(w − y_k)."""
    held_out = [n_all - n for n_all, n in zip(SIZES, sizes, strict=True)]
    own = [w - alpha * (w - y) for y in VALUES]
    return sum(m * 0.5 * (v - y) ** 2 for m, v, y in zip(held_out, own, VALUES, strict=True)) / sum(held_out)


@pytest.mark.parametrize(
    ("variant", "weighting", "batch_size"),
    [("hessian_free", "uniform", 10_000), ("first_order", "uniform", 10_000), ("hessian_free", "samples", 2)],
)
def test_three_rounds_of_partial_participation_follow_algorithm_1(tmp_path, variant, weighting, batch_size):
    lr, epochs, alpha = 0.3, 2, 0.4
    # δ = ¼: the central difference is exact on a quadratic whatever δ, and a large one keeps fp32's digits
    strategy = Recorded(variant=variant, alpha=alpha, delta=0.25, weighting=weighting)
    trainer = fit(tmp_path, strategy, rounds=3, lr=lr, epochs=epochs, batch_size=batch_size)
    assert len(strategy.rounds) == 3 and all(len(clients) == 2 for clients in strategy.rounds)
    sizes = trainer.run.datamodule.num_samples.tolist()
    steps = [epochs * trainer.run.datamodule.num_batches(k) for k in range(len(VALUES))]
    w = algorithm_1(strategy.rounds, sizes, steps, alpha, lr, variant == "hessian_free", weighting)
    assert trainer.global_state.item() == pytest.approx(w, rel=1e-5)
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(personal_loss(w, sizes, alpha), rel=1e-5)
    assert trainer.history[-1]["clients/loss"] != pytest.approx(personal_loss(w, sizes, alpha), rel=1e-3)
    # the variants differ: the other one ends elsewhere
    other = algorithm_1(strategy.rounds, sizes, steps, alpha, lr, variant != "hessian_free", weighting)
    assert w != pytest.approx(other, rel=1e-3)


def test_one_round_by_hand(tmp_path):
    # Clients y = 1, −2 from w = 0, α = ½, β = ½, one local step. FO: temp = ½, −1; g = −½, 1; w_k = ¼, −½;
    # w = −⅛. HF: (1 − α)g = −¼, ½; w_k = ⅛, −¼; w = −1/16.
    first_order = fit(tmp_path, PerFedAvg("first_order", alpha=0.5), 1, 0.5, 1, sizes=[4, 6], values=[1.0, -2.0])
    assert first_order.global_state.item() == pytest.approx(-0.125, abs=1e-6)
    hessian_free = fit(
        tmp_path, PerFedAvg("hessian_free", alpha=0.5, delta=0.25), 1, 0.5, 1, sizes=[4, 6], values=[1.0, -2.0]
    )
    assert hessian_free.global_state.item() == pytest.approx(-0.0625, abs=1e-6)
    # own models after FO: −⅛ − ½(−⅛ − 1) = 7/16 and −⅛ − ½(−⅛ + 2) = −17/16, each on its 2 and 3 held-out samples
    expected = (2 * 0.5 * (7 / 16 - 1) ** 2 + 3 * 0.5 * (-17 / 16 + 2) ** 2) / 5
    assert first_order.history[-1]["clients/personal/loss"] == pytest.approx(expected, rel=1e-5)


class _Tanh(nn.Module):
    """A small non-quadratic model whose Hessian is not constant: softmax regression over a tanh layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()

    def training_step(self, batch, batch_idx):
        return {"loss": nn.functional.cross_entropy(self.net(batch[0]), batch[1])}


def test_the_hessian_free_direction_matches_the_exact_hessian_vector_product():
    module, alpha = _Tanh(), 0.3
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 3, generator=generator, dtype=torch.float64), torch.randint(2, (6,))) for _ in range(3)]
    names = [name for name, _ in module.named_parameters()]
    w = tuple(p.detach().clone() for p in module.parameters())

    def loss(batch):  # the model's loss written out in its parameters
        x, y = batch
        return lambda w1, b1, w2, b2: nn.functional.cross_entropy(torch.tanh(x @ w1.T + b1) @ w2.T + b2, y)

    grad_w = torch.autograd.functional.vjp(loss(batches[0]), w)[1]  # ∇f(w; D)
    temp = tuple(p - alpha * g for p, g in zip(w, grad_w, strict=True))
    g = torch.autograd.functional.vjp(loss(batches[1]), temp)[1]  # ∇f(temp; D')
    hvp = torch.autograd.functional.hvp(loss(batches[2]), w, g)[1]  # ∇²f(w; D'') g, exact
    exact = [a - alpha * b for a, b in zip(g, hvp, strict=True)]

    direction = maml_direction(module, names, w, grad_w, batches[1], alpha, batches[2], delta=1e-5)
    for d, e in zip(direction, exact, strict=True):
        torch.testing.assert_close(d, e, rtol=1e-6, atol=1e-8)
    first_order = maml_direction(module, names, w, grad_w, batches[1], alpha)
    for d, e in zip(first_order, g, strict=True):
        torch.testing.assert_close(d, e)
    assert not all(torch.allclose(d, e) for d, e in zip(direction, first_order, strict=True))  # the Hessian term counts


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        PerFedAvg(variant="exact", alpha=-1.0, delta=0.0, weighting="median")
    message = str(err.value)
    for flag in ("variant", "alpha (α) ≥ 0", "delta (δ) > 0", "weighting"):
        assert f"--strategy.init_args.{flag}" in message


def test_a_client_that_steps_its_own_optimizers_is_refused():
    client = ScalarClient()
    client.automatic_optimization = False
    (problem,) = PerFedAvg().check(client, None)
    assert "automatic optimization" in problem
