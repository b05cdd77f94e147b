"""FedAtt: a hand-worked two-client example, BatchNorm statistics, and the noise through the engine."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies import ClientUpdate, FedAtt
from fedlight.testing import ScalarClient, ScalarDataset


def aggregate(strategy, module, global_state, states, sizes, seed=0):
    """Runs one aggregation outside the engine, with a stand-in for the trainer's attributes FedAtt reads."""
    trainer = SimpleNamespace(
        module=module, layout=FlatState(module), strategy_rng=lambda t: np.random.default_rng([seed, t])
    )
    strategy.on_fit_start(trainer)
    strategy.on_round_start(trainer, 0, [])
    updates = [
        ClientUpdate(client=k, num_samples=n, epochs=1, num_steps=1, train_loss=0.0) for k, n in enumerate(sizes)
    ]
    return strategy.aggregate_states(torch.tensor(global_state), torch.tensor(states), updates)


# Linear(2, 1): layout [weight (2 values), bias (1 value)].
GLOBAL = [0.0, 0.0, 1.0]
CLIENTS = [[3.0, 4.0, 2.0], [0.0, 0.0, 3.0]]
# weight: s = (‖(3, 4)‖, 0) = (5, 0), α = (e⁵, 1)/(e⁵ + 1) = (0.99330715, 0.00669285)
# bias:   s = (|1 − 2|, |1 − 3|) = (1, 2), α = (e, e²)/(e + e²) = (0.26894142, 0.73105858)
ALPHA_WEIGHT = (0.99330715, 0.00669285)
ALPHA_BIAS = (0.26894142, 0.73105858)


def test_two_clients_two_tensors_by_hand():
    new = aggregate(FedAtt(sigma=0.0), nn.Linear(2, 1), GLOBAL, CLIENTS, sizes=[5, 1])
    # ε = 1: the attention-weighted mean of the clients, tensor by tensor.
    expected = [ALPHA_WEIGHT[0] * 3.0, ALPHA_WEIGHT[0] * 4.0, ALPHA_BIAS[0] * 2.0 + ALPHA_BIAS[1] * 3.0]
    torch.testing.assert_close(new, torch.tensor(expected))


def test_epsilon_scales_the_step_from_the_server_model():
    new = aggregate(FedAtt(epsilon=0.5, sigma=0.0), nn.Linear(2, 1), GLOBAL, CLIENTS, sizes=[5, 1])
    # w − ε Σ_k α_k (w − w_k): weight 0 + 0.5·α_1·(3, 4); bias 1 − 0.5·(α_1·(1 − 2) + α_2·(1 − 3)).
    bias = 1.0 - 0.5 * (ALPHA_BIAS[0] * -1.0 + ALPHA_BIAS[1] * -2.0)
    torch.testing.assert_close(new, torch.tensor([0.5 * ALPHA_WEIGHT[0] * 3.0, 0.5 * ALPHA_WEIGHT[0] * 4.0, bias]))


def test_batchnorm_statistics_take_the_sample_weighted_mean_without_noise():
    bn = nn.BatchNorm1d(2)  # layout: weight, bias, running_mean, running_var (num_batches_tracked is an integer)
    global_state = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    states = [[1.0, 1.0, 0.0, 0.0, 2.0, 4.0, 1.0, 3.0], [1.0, 1.0, 0.0, 0.0, 6.0, 0.0, 5.0, 7.0]]
    new = aggregate(FedAtt(sigma=1.0), bn, global_state, states, sizes=[1, 3])
    # n = (1, 3): (2 + 3·6)/4 = 5, (4 + 0)/4 = 1, (1 + 15)/4 = 4, (3 + 21)/4 = 6
    torch.testing.assert_close(new[4:], torch.tensor([5.0, 1.0, 4.0, 6.0]), rtol=0, atol=0)
    assert not torch.equal(new[:4], torch.tensor(global_state[:4]))  # the parameters got σ = 1 noise


def fit(root, strategy, ckpt_path=None, **trainer_kwargs):
    """Returns the trainer and last metrics of a run of three ScalarClients (n = 2, 3, 5; y = 1, 2, 4)."""
    data = FederatedDataModule(ScalarDataset([4, 6, 10], [1.0, 2.0, 4.0]), batch_size=10_000, test_fraction=0.5)
    trainer_kwargs = {"rounds": 1, "clients_per_round": 3, "local_epochs": 1, **trainer_kwargs}
    trainer = FederatedTrainer(logger=None, enable_progress_bar=False, default_root_dir=root, **trainer_kwargs)
    metrics = trainer.fit(ScalarClient(), data, strategy, ckpt_path=ckpt_path)
    return trainer, metrics


def test_noise_is_reproducible_and_of_size_sigma(tmp_path, monkeypatch):
    sigma = 0.01
    clean = fit(tmp_path, FedAtt(sigma=0.0))[0].global_state.item()
    trainer, _ = fit(tmp_path, FedAtt(sigma=sigma))
    noisy = trainer.global_state.item()
    assert noisy == fit(tmp_path, FedAtt(sigma=sigma))[0].global_state.item()
    # One parameter, one round: the noise is σ times the first normal draw of round 0's strategy stream.
    z = trainer.run.streams.strategy_rng(0).standard_normal(1, dtype=np.float32).item()
    assert noisy - clean == pytest.approx(sigma * z, rel=1e-4)
    assert 0 < abs(noisy - clean) < 5 * sigma
    monkeypatch.setenv("PL_GLOBAL_SEED", "1")
    assert fit(tmp_path, FedAtt(sigma=sigma))[0].global_state.item() != noisy


def test_a_resumed_run_draws_the_same_noise(tmp_path):
    straight, _ = fit(tmp_path, FedAtt(sigma=0.01), rounds=3)
    first, _ = fit(tmp_path, FedAtt(sigma=0.01), rounds=2)
    ckpt = first.run_dir / "checkpoints" / "last.ckpt"
    resumed, _ = fit(tmp_path, FedAtt(sigma=0.01), rounds=3, ckpt_path=ckpt)
    assert resumed.global_state.item() == straight.global_state.item()


def test_stragglers_are_dropped_by_default(tmp_path):
    _, metrics = fit(tmp_path, FedAtt(), straggler_fraction=1 / 3, local_epochs=2)
    assert metrics["round/clients_dropped"] == 1 and metrics["round/clients_aggregated"] == 2


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as error:
        FedAtt(epsilon=0.0, sigma=-1.0)
    assert "--strategy.init_args.epsilon" in str(error.value) and "--strategy.init_args.sigma" in str(error.value)
