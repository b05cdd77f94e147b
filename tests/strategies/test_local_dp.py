"""LocalDP through the engine: clipping and the clients' noise by hand on ScalarClient (one full-batch SGD step with
lr 1 lands on the client's target, so client k's update from W^t is y_k − W^t), the noise's spread on a CNN's
54k parameters, and each client's ε against dp-accounting over the rounds it took part in."""

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
from fedlight.strategies import FedAvg, FedProx
from fedlight.strategies.local_dp import LocalDP, gaussian_sigma, local_dp_epsilon
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

SIZES, VALUES = [4, 6, 8, 10, 6, 12], [10.0, -20.0, 0.5, 3.0, -4.0, 8.0]
# next to no noise: Laplace with b = 2C/ε
QUIET = {"mechanism": "laplace", "epsilon": 1e12, "delta": 0.0}

pytestmark = pytest.mark.filterwarnings("ignore:LocalDP draws its noise")


class Recorded(FedAvg):
    """FedAvg that notes each round's training clients, for the references to replay."""

    def __init__(self):
        super().__init__()
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def scalar_data():
    return FederatedDataModule(ScalarDataset(SIZES, VALUES), batch_size=10_000, test_fraction=0.5)


def fit(root, strategy, rounds=2, clients_per_round=3, data=None, ckpt_path=None, **kwargs):
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=root, **kwargs,
    )  # fmt: skip
    trainer.fit(ScalarClient(), data or scalar_data(), strategy, ckpt_path=ckpt_path)
    return trainer


def test_with_a_clip_never_reached_and_next_to_no_noise_it_is_the_rule(tmp_path):
    wrapped = fit(tmp_path, LocalDP(FedProx(mu=0.1), clip_norm=1e3, **QUIET), rounds=3)
    plain = fit(tmp_path, FedProx(mu=0.1), rounds=3)
    assert wrapped.global_state.item() == pytest.approx(plain.global_state.item(), abs=1e-6)
    assert plain.global_state.item() != pytest.approx(0.0)


def test_every_update_is_clipped_to_c_before_the_rules_average(tmp_path):
    rule, data = Recorded(), scalar_data()
    trainer = fit(tmp_path, LocalDP(rule, clip_norm=1.0, **QUIET), rounds=3, data=data)
    w = 0.0
    for clients in rule.rounds:  # FedAvg's n_k-weighted mean of W^t + clip(y_k − W^t)
        n = [float(data.num_samples[k]) for k in clients]
        sent = [w + max(-1.0, min(1.0, VALUES[k] - w)) for k in clients]
        w = sum(n_k * s for n_k, s in zip(n, sent, strict=True)) / sum(n)
    assert len(rule.rounds) == 3 and all(len(clients) == 3 for clients in rule.rounds)
    assert trainer.global_state.item() == pytest.approx(w, abs=1e-6)


def test_the_noise_is_the_clients_draw_from_the_secret(tmp_path):
    rule = Recorded()
    trainer = fit(tmp_path, LocalDP(rule, clip_norm=1.0, epsilon=0.5, delta=1e-5), rounds=1, clients_per_round=1)
    (client,) = rule.rounds[0]
    secret = ckpt_io.load(trainer.run_dir / "checkpoints" / "last.ckpt")["strategy"]["state"]["noise_secret"]
    seed = int(np.random.SeedSequence(secret, spawn_key=(0, client)).generate_state(1, np.uint64)[0])
    xi = torch.randn(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).item()
    sigma = gaussian_sigma(2.0, 0.5, 1e-5)  # Δ₂ = 2C
    clipped = max(-1.0, min(1.0, VALUES[client]))
    assert trainer.global_state.item() == pytest.approx(clipped + sigma * xi, rel=1e-6)
    assert trainer.history[-1]["local_dp/noise_std"] == pytest.approx(sigma)


def cnn_step(strategy):
    """W^1 − W^0 of one round with one CNN client: its clipped update plus its noise, over 54,179 entries."""
    data = FederatedDataModule(ClientImages([10, 14], [1, 2]), batch_size=1000, test_fraction=0.0)
    trainer = FederatedTrainer(rounds=1, clients_per_round=1, local_epochs=1, logger=None, enable_progress_bar=False)
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )  # fmt: skip
    w0 = FlatState(client).flatten(client).double()
    trainer.fit(client, data, strategy)
    return trainer.global_state.double() - w0


@pytest.mark.usefixtures("runs_in_tmp")
@pytest.mark.parametrize("mechanism", ["gaussian", "laplace"])
def test_the_noise_spreads_as_its_formula_says(mechanism):
    # C = 1e-6 leaves the update ≤ 1e-6 in norm: what moved is the noise, one draw per entry (seeded: no flake)
    if mechanism == "gaussian":
        strategy = LocalDP(clip_norm=1e-6, epsilon=0.5, delta=1e-5, sensitivity=1.0, insecure_seeded_noise=True)
        std = gaussian_sigma(1.0, 0.5, 1e-5)
    else:
        strategy = LocalDP(
            clip_norm=1e-6, epsilon=2.0, mechanism="laplace", sensitivity=1.0, insecure_seeded_noise=True
        )
        std = math.sqrt(2) * 0.5  # b = Δ₁/ε = 0.5
    noise = cnn_step(strategy)
    assert noise.numel() == 54179
    assert noise.std().item() == pytest.approx(std, rel=0.02)
    assert abs(noise.mean().item()) < 4 * std / math.sqrt(noise.numel())
    if mechanism == "laplace":
        assert noise.abs().mean().item() == pytest.approx(0.5, rel=0.02)  # E|ξ| = b


@pytest.mark.usefixtures("runs_in_tmp")
def test_a_sent_update_has_norm_c_when_the_noise_is_negligible():
    update = cnn_step(LocalDP(clip_norm=0.05, **QUIET))
    assert float(torch.linalg.vector_norm(update)) == pytest.approx(0.05, rel=1e-4)  # the raw update was longer


@pytest.mark.parametrize(
    ("mechanism", "epsilon", "accountant"),
    [("gaussian", 0.5, "rdp"), ("gaussian", 0.5, "pld"), ("laplace", 2.0, "pld")],
)
def test_each_clients_epsilon_composes_the_rounds_it_took_part_in(tmp_path, mechanism, epsilon, accountant):
    rule = Recorded()
    strategy = LocalDP(rule, epsilon=epsilon, mechanism=mechanism, accountant=accountant)
    trainer = fit(tmp_path, strategy, rounds=4, clients_per_round=2)
    rounds_of = [sum(k in clients for clients in rule.rounds) for k in range(len(SIZES))]
    assert 0 in rounds_of and max(rounds_of) >= 2  # some clients never took part, some twice or more

    def reference(r):  # r releases, composed by dp-accounting directly
        if r == 0:
            return 0.0
        if accountant == "rdp":
            account = dp_accounting.rdp.RdpAccountant()
        else:
            account = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
        if mechanism == "gaussian":
            account.compose(dp_accounting.GaussianDpEvent(math.sqrt(2 * math.log(1.25 / 1e-5)) / epsilon), r)
            return account.get_epsilon(1e-5)
        account.compose(dp_accounting.LaplaceDpEvent(1 / epsilon), r)
        return min(r * epsilon, account.get_epsilon(1e-5))

    expected = [reference(r) for r in rounds_of]
    assert strategy.counts.tolist() == rounds_of
    assert strategy.epsilons.tolist() == pytest.approx(expected, rel=1e-4)
    row = trainer.history[-1]
    assert row["local_dp/epsilon_max"] == pytest.approx(max(expected), rel=1e-4)
    assert row["local_dp/epsilon_mean"] == pytest.approx(np.mean([e for e in expected if e > 0]), rel=1e-4)


def test_laplace_without_delta_composes_by_the_sum():
    assert local_dp_epsilon("laplace", 0.3, 0.0, 4) == pytest.approx(1.2)
    assert local_dp_epsilon("laplace", 0.3, 1e-5, 4) <= 1.2


def test_a_resumed_run_draws_the_noise_of_its_secret_and_keeps_every_clients_epsilon(tmp_path):
    def make():
        return LocalDP(FedProx(mu=0.1), clip_norm=2.0, epsilon=0.5)

    straight = fit(tmp_path, make(), rounds=3, checkpoint_every=1)
    round_two = straight.run_dir / "checkpoints" / "previous.ckpt"
    assert ckpt_io.load(round_two)["round"] == 2
    resumed = fit(tmp_path, make(), rounds=3, ckpt_path=round_two, rewind=True)
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)
    state, expected = resumed.run.strategy.state_dict(), straight.run.strategy.state_dict()
    assert state["noise_secret"] == expected["noise_secret"]
    assert torch.equal(state["counts"], expected["counts"]) and torch.equal(state["epsilons"], expected["epsilons"])
    assert resumed.history[-1]["local_dp/epsilon_max"] == straight.history[-1]["local_dp/epsilon_max"]


def test_seeded_noise_round_trips_through_a_checkpoint(tmp_path):
    def make():
        return LocalDP(clip_norm=2.0, epsilon=0.5, insecure_seeded_noise=True)

    straight = fit(tmp_path, make(), rounds=2)
    first = fit(tmp_path, make(), rounds=1)
    resumed = fit(tmp_path, make(), rounds=2, ckpt_path=first.run_dir / "checkpoints" / "last.ckpt")
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)
    assert torch.equal(resumed.run.strategy.epsilons, straight.run.strategy.epsilons)
    clone = make()
    clone.load_state_dict(resumed.run.strategy.state_dict())
    assert torch.equal(clone.counts, resumed.run.strategy.counts)


def test_bad_settings_are_reported_together_naming_their_flags():
    with pytest.raises(ConfigError) as error:
        LocalDP(clip_norm=0.0, epsilon=1.5, delta=0.0, sensitivity=-1.0)
    message = str(error.value)
    for flag in ("clip_norm", "epsilon", "delta", "sensitivity"):
        assert f"--strategy.init_args.{flag}" in message
    assert "mechanism=laplace" in message  # the way out of ε ≥ 1
    with pytest.raises(ConfigError, match=r"--strategy\.init_args\.mechanism"):
        LocalDP(mechanism="exponential")
    LocalDP(epsilon=1.5, delta=0.0, mechanism="laplace")  # pure ε-DP: any ε, δ = 0


def test_a_sensitivity_below_the_clipping_bound_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="below 2"):
        fit(tmp_path, LocalDP(clip_norm=1.0, epsilon=0.5, sensitivity=1.0), rounds=1)
