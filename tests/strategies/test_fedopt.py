"""FedAdagrad, FedYogi, FedAdam: two rounds through the engine against Algorithm 2 of Reddi et al. written out in
plain Python floats, and the update maths against Flower's own strategies on identical client updates.

ScalarClient's full-batch SGD step with lr 1 lands on its target, so the round's average is known in advance.
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.plans import ClientUpdate
from fedlight.state import FlatState
from fedlight.strategies import FedAdagrad, FedAdam, FedOpt, FedYogi
from fedlight.strategies.functional import adaptive_server_step, weighted_average
from fedlight.testing import ScalarClient, ScalarDataset

RULES = {"adagrad": FedAdagrad, "yogi": FedYogi, "adam": FedAdam}
SETTINGS = {"server_lr": 2.0, "beta1": 0.5, "beta2": 0.75, "tau": 3.0}


def algorithm_2(variant, averages, server_lr, beta1, beta2, tau, x=0.0):
    """x after one round per entry of ``averages`` (the clients' average state), from Algorithm 2's lines 10–15."""
    m, v = 0.0, tau**2
    for average in averages:
        delta = average - x
        m = beta1 * m + (1 - beta1) * delta
        if variant == "adagrad":
            v = v + delta**2
        elif variant == "yogi":
            v = v - (1 - beta2) * delta**2 * math.copysign(1.0, v - delta**2) if v != delta**2 else v
        else:
            v = beta2 * v + (1 - beta2) * delta**2
        x = x + server_lr * m / (math.sqrt(v) + tau)
    return x


def fit(root, sizes, values, strategy, rounds):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=len(sizes), local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=1.0), data, strategy)
    return trainer.global_state.item()


@pytest.mark.parametrize(
    ("variant", "after_one"),
    [
        # Δ = 4, m = 2; v = 9 + 16 = 25 (Adagrad), 9 + ¼·16 = 13 (Yogi), ¾·9 + ¼·16 = 10.75 (Adam); x = 2m / (√v + 3)
        ("adagrad", 0.5),
        ("yogi", 4 / (math.sqrt(13) + 3)),
        ("adam", 4 / (math.sqrt(10.75) + 3)),
    ],
)
def test_two_rounds_follow_algorithm_2(tmp_path, variant, after_one):
    # two clients landing on 2 and 6: Algorithm 2's uniform mean is 4 whatever their sizes
    sizes, values = [4, 12], [2.0, 6.0]
    assert fit(tmp_path, sizes, values, RULES[variant](**SETTINGS), rounds=1) == pytest.approx(after_one, rel=1e-6)
    expected = algorithm_2(variant, [4.0, 4.0], **SETTINGS)
    assert fit(tmp_path, sizes, values, RULES[variant](**SETTINGS), rounds=2) == pytest.approx(expected, rel=1e-6)


def test_adagrad_second_round_by_hand(tmp_path):
    # round 2 from x = 0.5: Δ = 3.5, m = ½·2 + ½·3.5 = 2.75, v = 25 + 12.25 = 37.25, x = 0.5 + 5.5 / (√37.25 + 3)
    w = fit(tmp_path, [4, 12], [2.0, 6.0], FedAdagrad(**SETTINGS), rounds=2)
    assert w == pytest.approx(0.5 + 5.5 / (6.103278 + 3), rel=1e-6)


@pytest.mark.parametrize("variant", list(RULES))
def test_weighting_by_samples_averages_as_fedavg(tmp_path, variant):
    # 2 and 6 training samples (half of each client's data is held out): the n_k-weighted mean is (2·2 + 6·6)/8 = 5
    rule = RULES[variant](**SETTINGS, weighting="samples")
    expected = algorithm_2(variant, [5.0, 5.0], **SETTINGS)
    assert fit(tmp_path, [4, 12], [2.0, 6.0], rule, rounds=2) == pytest.approx(expected, rel=1e-6)


def test_fedopt_with_a_variant_is_the_named_rule(tmp_path):
    sizes, values = [4, 12], [2.0, 6.0]
    for variant, rule in RULES.items():
        named = fit(tmp_path, sizes, values, rule(**SETTINGS), rounds=2)
        assert fit(tmp_path, sizes, values, FedOpt(variant, **SETTINGS), rounds=2) == named


def test_batchnorm_statistics_take_the_average_not_the_adaptive_step():
    norm = nn.BatchNorm1d(1)  # weight, bias, running_mean, running_var
    strategy = FedAdagrad(**SETTINGS)
    strategy.on_fit_start(SimpleNamespace(layout=FlatState(norm), module=norm, global_state=torch.zeros(4)))
    update = [ClientUpdate(client=0, num_samples=1, epochs=1, num_steps=1, train_loss=0.0)]
    w = strategy.server_update(torch.zeros(4), torch.full((4,), 4.0), update)
    assert w.tolist() == [0.5, 0.5, 4.0, 4.0]
    # buffers keep m = 0 and v = τ²: no step accumulates there
    assert strategy.first_moment.tolist() == [2.0, 2.0, 0.0, 0.0]
    assert strategy.second_moment.tolist() == [25.0, 25.0, 9.0, 9.0]


def test_moments_round_trip():
    strategy, clone = FedYogi(), FedYogi()
    assert strategy.state_dict() == {}
    strategy.first_moment, strategy.second_moment = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])
    clone.load_state_dict(strategy.state_dict())
    assert torch.equal(clone.first_moment, strategy.first_moment)
    assert torch.equal(clone.second_moment, strategy.second_moment)


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        FedAdam(server_lr=0.0, beta1=1.0, beta2=-0.1, tau=0.0)
    message = str(err.value)
    for part in ("server_lr (η) > 0, got 0.0", "beta1 in [0, 1), got 1.0", "beta2 in [0, 1), got -0.1", "tau (τ) > 0"):
        assert part in message
    with pytest.raises(ConfigError, match="variant in adagrad, yogi, adam, got 'sgd'"):
        FedOpt("sgd")


def test_defaults_are_the_papers():
    rule = FedYogi()
    assert (rule.beta1, rule.beta2, rule.sampling, rule.weighting) == (0.9, 0.99, "uniform", "uniform")


# -- Flower's strategies on identical inputs -----------------------------------------------------------------------


def _flower_rounds(strategy, clients, num_examples):
    """Flower's global arrays after each round of ``clients`` (one [R][K] list of [P] arrays)."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    history = []
    for server_round, states in enumerate(clients, start=1):
        results = [
            (None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([state]), n, {}))
            for state, n in zip(states, num_examples, strict=True)
        ]
        parameters, _ = strategy.aggregate_fit(server_round, results, [])
        history.append(parameters_to_ndarrays(parameters)[0])
    return history


@pytest.mark.parametrize("variant", ["adagrad", "yogi", "adam"])
def test_the_update_maths_matches_flowers_strategy(variant):
    pytest.importorskip("flwr", reason="the comparison with Flower's strategies needs flwr (pip install flwr)")
    from flwr.common import ndarrays_to_parameters
    from flwr.server.strategy import FedAdagrad as FlowerAdagrad
    from flwr.server.strategy import FedAdam as FlowerAdam
    from flwr.server.strategy import FedYogi as FlowerYogi

    rng = np.random.default_rng(0)
    initial = rng.normal(size=6)
    num_examples = [3, 7, 5]
    # three rounds of three clients whose states scatter around a drifting point
    clients = [[initial + 0.3 * (r + 1) + rng.normal(scale=0.5, size=6) for _ in num_examples] for r in range(3)]
    eta, tau, beta1, beta2 = 0.1, 1e-2, 0.9, 0.99
    kwargs = {"initial_parameters": ndarrays_to_parameters([initial]), "eta": eta, "tau": tau}
    if variant == "adagrad":
        flower = FlowerAdagrad(**kwargs)
    else:
        flower = {"yogi": FlowerYogi, "adam": FlowerAdam}[variant](**kwargs, beta_1=beta1, beta_2=beta2)
    expected = _flower_rounds(flower, clients, num_examples)

    # Ours, with Flower's three departures from Algorithm 2 (docs/decisions.md, O1–O3): v starts at 0 instead of
    # τ², FedAdagrad has no momentum (β1 = 0), and FedAdam's η is bias-corrected with round t + 1 for round t.
    x = torch.tensor(initial)
    m, v = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    b1 = 0.0 if variant == "adagrad" else beta1
    for server_round, (states, flower_x) in enumerate(zip(clients, expected, strict=True), start=1):
        average = weighted_average(torch.tensor(np.stack(states)), num_examples)
        lr = eta
        if variant == "adam":
            lr = eta * math.sqrt(1 - beta2 ** (server_round + 1)) / (1 - beta1 ** (server_round + 1))
        x, m, v = adaptive_server_step(x, average, m, v, variant, lr, b1, beta2, tau)
        np.testing.assert_allclose(x.numpy(), flower_x, rtol=1e-10, atol=1e-12)
