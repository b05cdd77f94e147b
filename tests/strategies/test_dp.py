"""DP-FedAvg through the engine: clipping, noise and adaptive C by hand on ScalarClient (one full-batch SGD step
with lr 1 from w = 0 lands on the client's target, so client k's update is y_k), ε against dp-accounting."""

import logging
import math

import dp_accounting
import numpy as np
import pytest
import torch

from fedlight import checkpoint as ckpt_io
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies import DPFedAvg, FedProx
from fedlight.strategies.dp import dp_epsilon
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

# trainers built without a default_root_dir write into the test's own runs/
pytestmark = pytest.mark.usefixtures("runs_in_tmp")

SIZES, VALUES = [4, 6, 8], [10.0, -20.0, 0.5]


def fit(root, strategy, sizes=SIZES, values=VALUES, rounds=1, clients_per_round=None, ckpt_path=None, **kwargs):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    config = kwargs.pop("config", None)
    kwargs = {"logger": None, **kwargs}
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round or len(sizes), local_epochs=1, enable_progress_bar=False,
        default_root_dir=root, **kwargs,
    )  # fmt: skip
    trainer.fit(ScalarClient(), data, strategy, ckpt_path=ckpt_path, config=config)
    return trainer


def test_clipped_updates_are_averaged_uniformly_without_noise(tmp_path):
    trainer = fit(tmp_path, DPFedAvg(clip_norm=1.0, noise_multiplier=0.0))
    # updates 10, −20, 0.5 clipped to 1, −1, 0.5; uniform weights over K' = 3
    assert trainer.global_state.item() == pytest.approx((1.0 - 1.0 + 0.5) / 3)
    row = trainer.history[-1]
    assert row["dp/unclipped_fraction"] == pytest.approx(1 / 3) and row["dp/update_norm_median"] == 10.0
    assert math.isinf(row["dp/epsilon"])


def test_clipping_bounds_the_update_norm_of_a_cnn():
    data = FederatedDataModule(ClientImages([10, 14, 8], [1, 2, 3]), batch_size=1000, test_fraction=0.0)
    trainer = FederatedTrainer(rounds=1, clients_per_round=3, local_epochs=2, logger=None, enable_progress_bar=False)
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )  # fmt: skip
    w0 = FlatState(client).flatten(client)
    trainer.fit(client, data, DPFedAvg(clip_norm=0.05, noise_multiplier=0.0))
    assert trainer.history[-1]["dp/unclipped_fraction"] == 0  # every raw update is longer than C
    # the average of updates of norm ≤ C has norm ≤ C
    assert float(torch.linalg.vector_norm(trainer.global_state - w0)) <= 0.05 + 1e-6


def test_noise_is_z_c_over_k_times_the_rounds_draw(tmp_path):
    trainer = fit(tmp_path, DPFedAvg(clip_norm=1.0, noise_multiplier=2.0))
    # the round's draw: the secret's child (0,) seeds a torch generator; ξ is its first normal
    secret = ckpt_io.load(trainer.run_dir / "checkpoints" / "last.ckpt")["strategy"]["state"]["noise_secret"]
    seed = int(np.random.SeedSequence(secret, spawn_key=(0,)).generate_state(1, np.uint64)[0])
    xi = torch.randn(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).item()
    assert trainer.global_state.item() == pytest.approx((1.0 - 1.0 + 0.5 + 2.0 * 1.0 * xi) / 3, rel=1e-6)
    assert trainer.history[-1]["dp/noise_std"] == pytest.approx(2.0 / 3)


def test_insecure_seeded_noise_is_the_rounds_draw_from_the_run_seed(tmp_path):
    with pytest.warns(UserWarning, match="protects nothing"):
        trainer = fit(tmp_path, DPFedAvg(clip_norm=1.0, noise_multiplier=2.0, insecure_seeded_noise=True))
    # child 1 of strategy stream 0 seeds a torch generator; ξ is its first normal
    seed = int(trainer.run.streams.strategy_rng(0).spawn(2)[1].integers(2**62))
    xi = torch.randn(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).item()
    assert trainer.global_state.item() == pytest.approx((1.0 - 1.0 + 0.5 + 2.0 * 1.0 * xi) / 3, rel=1e-6)


def cnn_fit(noise_multiplier, **kwargs):
    data = FederatedDataModule(ClientImages([10, 14, 8], [1, 2, 3]), batch_size=1000, test_fraction=0.0)
    trainer = FederatedTrainer(rounds=1, clients_per_round=3, local_epochs=1, logger=None, enable_progress_bar=False)
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )  # fmt: skip
    trainer.fit(client, data, DPFedAvg(clip_norm=0.05, noise_multiplier=noise_multiplier, **kwargs))
    return trainer


@pytest.mark.filterwarnings("ignore:DPFedAvg draws its noise")
@pytest.mark.parametrize("insecure", [False, True])
def test_the_noise_cannot_be_regenerated_from_the_configuration(insecure):
    clean = cnn_fit(0.0).global_state  # the same clients, the same seed, no noise
    noisy = cnn_fit(2.0, insecure_seeded_noise=insecure)
    # what anyone holding config.yaml can regenerate: round 0's draw of the seed's strategy stream
    seed = int(noisy.run.streams.strategy_rng(0).spawn(2)[1].integers(2**62))
    public = torch.randn(clean.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    recovered = noisy.global_state.double() - 2.0 * 0.05 * public / 3  # W^1 − z C ξ / K'
    error = float(torch.linalg.vector_norm(recovered - clean.double()))
    noise_norm = 2.0 * 0.05 / 3 * clean.numel() ** 0.5  # ‖z C ξ / K'‖ ≈ z C √P / K'
    if insecure:
        assert error < 1e-4 * noise_norm  # the noise-free model, up to fp32 rounding
    else:  # the secret draw is independent of the public one: the error is ‖zC(ξ − ξ')/K'‖ ≈ √2 × the noise
        assert error > 0.5 * noise_norm


@pytest.mark.filterwarnings("ignore:DPFedAvg draws its noise")
def test_two_fresh_runs_of_one_configuration_draw_different_noise_unless_insecure(tmp_path):
    def final(**kwargs):
        return fit(tmp_path, DPFedAvg(clip_norm=1.0, noise_multiplier=2.0, **kwargs), rounds=2).global_state.item()

    assert final() != final()
    assert final(insecure_seeded_noise=True) == final(insecure_seeded_noise=True)


def test_a_resumed_run_draws_the_noise_of_its_secret_bit_for_bit(tmp_path):
    def make():
        return DPFedAvg(FedProx(mu=0.1), noise_multiplier=1.5, adaptive=True, count_noise_std=1.0)

    kwargs = {"sizes": [4] * 6, "values": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "clients_per_round": 3}
    straight = fit(tmp_path, make(), rounds=3, checkpoint_every=1, **kwargs)
    round_two = straight.run_dir / "checkpoints" / "previous.ckpt"
    assert ckpt_io.load(round_two)["round"] == 2
    resumed = fit(tmp_path, make(), rounds=3, ckpt_path=round_two, rewind=True, **kwargs)
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)
    assert resumed.run.strategy.state_dict()["noise_secret"] == straight.run.strategy.state_dict()["noise_secret"]


def test_the_secret_is_in_the_checkpoint_only(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "offline")
    strategy = DPFedAvg(clip_norm=1.0, noise_multiplier=2.0)
    config = {"seed_everything": 0, "strategy": {"class_path": "fedlight.strategies.DPFedAvg", "init_args": {}}}
    with caplog.at_level(logging.DEBUG):
        trainer = fit(tmp_path, strategy, rounds=2, logger=["csv", "wandb"], config=config)
    secret = ckpt_io.load(trainer.run_dir / "checkpoints" / "last.ckpt")["strategy"]["state"]["noise_secret"]
    assert secret is not None and secret.bit_length() > 64
    seeds = [int(np.random.SeedSequence(secret, spawn_key=(t,)).generate_state(1, np.uint64)[0]) for t in (0, 1)]
    words = [str(secret), f"{secret:x}", *map(str, seeds)]
    files = [p for p in trainer.run_dir.rglob("*") if p.is_file() and "checkpoints" not in p.parts]
    assert {p.name for p in files} >= {"config.yaml", "metrics.csv"}
    for path in files:
        text = path.read_bytes().decode("latin-1")
        assert not any(word in text for word in words), f"{path} holds the noise's secret"
    assert not any(word in caplog.text for word in words)


def test_adaptive_clipping_moves_c_towards_the_quantile(tmp_path):
    trainer = fit(tmp_path, DPFedAvg(clip_norm=1.0, noise_multiplier=0.0, adaptive=True, target_quantile=0.5))
    # norms 10, 20, 0.5 against C = 1: b = (0, 0, 1), b̄ = 1/3, C ← exp(−0.2 (1/3 − 1/2))
    expected = math.exp(-0.2 * (1 / 3 - 0.5))
    assert trainer.run.strategy.clip_norm == pytest.approx(expected)
    assert trainer.history[-1]["dp/clip_norm"] == pytest.approx(expected)


def test_epsilon_matches_dp_accounting(tmp_path):
    # ten clients, three per round: q = 0.3; z = 1.5; two rounds
    trainer = fit(
        tmp_path, DPFedAvg(noise_multiplier=1.5, delta=1e-5), [4] * 10, [1.0] * 10, rounds=2, clients_per_round=3
    )
    for steps, row in enumerate(trainer.history, start=1):
        accountant = dp_accounting.rdp.RdpAccountant()
        event = dp_accounting.PoissonSampledDpEvent(0.3, dp_accounting.GaussianDpEvent(1.5))
        accountant.compose(event, steps)
        assert row["dp/epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    pld.compose(dp_accounting.PoissonSampledDpEvent(0.3, dp_accounting.GaussianDpEvent(1.5)), 2)
    assert dp_epsilon(0.3, 1.5, 2, 1e-5, "pld") == pytest.approx(pld.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.filterwarnings("ignore:DPFedAvg draws its noise")
def test_resumed_run_reports_the_same_epsilon(tmp_path):
    def make():  # seeded noise: a separate straight run draws the same
        return DPFedAvg(FedProx(mu=0.1), noise_multiplier=1.5, adaptive=True, count_noise_std=1.0,
                        insecure_seeded_noise=True)  # fmt: skip

    kwargs = {"sizes": [4] * 6, "values": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "clients_per_round": 3}
    straight = fit(tmp_path, make(), rounds=2, **kwargs)
    first = fit(tmp_path, make(), rounds=1, **kwargs)
    resumed = fit(tmp_path, make(), rounds=2, ckpt_path=first.run_dir / "checkpoints" / "last.ckpt", **kwargs)
    assert resumed.history[-1]["dp/epsilon"] == straight.history[-1]["dp/epsilon"] > 0
    assert resumed.run.strategy.steps == 2 and resumed.run.strategy.clip_norm == straight.run.strategy.clip_norm
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError, match="clip_norm") as error:
        DPFedAvg(clip_norm=0.0, noise_multiplier=2.0, adaptive=True, count_noise_std=0.5)
    assert "count_noise_std" in str(error.value)


def test_poisson_sampling_takes_each_client_with_probability_q(tmp_path):
    strategy = DPFedAvg(poisson_sampling=True, noise_multiplier=0.0)  # no noise: no accountant to run
    trainer = fit(tmp_path, strategy, [4] * 20, [1.0] * 20, rounds=3, clients_per_round=5)
    for round_idx, row in enumerate(trainer.history):
        # the round's stream draws one uniform per client; q = 5/20
        expected = int((trainer.run.streams.round_rng(round_idx).random(20) < 0.25).sum())
        assert row["round/clients_sampled"] == expected
    assert trainer.run.strategy.sampling_rate() == 0.25
