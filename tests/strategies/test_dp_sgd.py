"""DPSGD through the engine: per-sample clipping by hand on ScalarClient (loss ½(w − y)², so a sample's gradient is
w − y_k), the noise's spread on a CNN's 54k parameters and its exact draw, each client's ε against dp-accounting
over its steps, and the noisy gradient against Opacus's on the same model and batch."""

import math

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlight import checkpoint as ckpt_io
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies import MOON, SCAFFOLD, DPFedAvg, FedAvg, FedAvgM, FedProx, RobustAggregation
from fedlight.strategies.dp_sgd import DPSGD, noisy_clipped_mean, per_sample_gradients
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

SIZES, VALUES = [4, 6, 8, 10, 6, 12], [10.0, -20.0, 0.5, 3.0, -4.0, 8.0]
BATCH = 2
# a full batch per epoch: q = 1, whose ε dp-accounting computes in closed form (subsampled orders take ~0.5 s each)
FULL_BATCH = 10_000

pytestmark = pytest.mark.filterwarnings("ignore:DPSGD draws its noise")


class Recorded(FedAvg):
    """FedAvg that notes each round's training clients, for the references to replay."""

    def __init__(self):
        super().__init__()
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def scalar_data(sizes=SIZES, batch_size=BATCH):
    return FederatedDataModule(ScalarDataset(sizes, VALUES), batch_size=batch_size, test_fraction=0.5)


def fit(root, strategy, rounds=2, clients_per_round=3, epochs=2, lr=0.5, data=None, ckpt_path=None, **kwargs):
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root, **kwargs,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=lr), data or scalar_data(), strategy, ckpt_path=ckpt_path)
    return trainer


def cnn_client():
    torch.manual_seed(0)
    return ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )  # fmt: skip


def cnn_fit(strategy, rounds=1, clients_per_round=1, batch_size=1000):
    data = FederatedDataModule(ClientImages([10, 10, 10], [1, 2, 3]), batch_size=batch_size, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=1, logger=None, enable_progress_bar=False
    )
    client = cnn_client()
    w0 = FlatState(client).flatten(client).double()
    trainer.fit(client, data, strategy)
    return trainer, w0


def test_with_a_clip_never_reached_and_no_noise_it_is_fedprox(tmp_path):
    wrapped = fit(tmp_path, DPSGD(FedProx(mu=0.1), max_grad_norm=1e6, noise_multiplier=0.0))
    plain = fit(tmp_path, FedProx(mu=0.1))
    assert wrapped.global_state.item() == pytest.approx(plain.global_state.item(), abs=1e-5)
    assert plain.global_state.item() != pytest.approx(0.0)


@pytest.mark.usefixtures("runs_in_tmp")
def test_with_a_clip_never_reached_and_no_noise_a_cnn_trains_as_with_fedavg():
    wrapped, _ = cnn_fit(DPSGD(max_grad_norm=1e6, noise_multiplier=0.0), rounds=2, clients_per_round=2, batch_size=4)
    plain, _ = cnn_fit(FedAvg(), rounds=2, clients_per_round=2, batch_size=4)
    torch.testing.assert_close(wrapped.global_state, plain.global_state, rtol=1e-4, atol=1e-5)


def test_every_samples_gradient_is_clipped_to_c(tmp_path):
    rule, data = Recorded(), scalar_data()
    trainer = fit(tmp_path, DPSGD(rule, max_grad_norm=1.0, noise_multiplier=0.0), rounds=3, data=data)
    w, lr = 0.0, 0.5
    for clients in rule.rounds:  # every sample of client k has target y_k: its gradient w − y_k, clipped to [−1, 1]
        trained = []
        for k in clients:
            local = w
            for _ in range(2 * data.num_batches(k)):  # two epochs
                local -= lr * max(-1.0, min(1.0, local - VALUES[k]))
            trained.append(local)
        n = [float(data.num_samples[k]) for k in clients]
        w = sum(n_k * t for n_k, t in zip(n, trained, strict=True)) / sum(n)
    assert trainer.global_state.item() == pytest.approx(w, abs=1e-5)


def test_the_noise_of_a_step_is_z_c_over_b_times_the_clients_draw(tmp_path):
    rule = Recorded()
    data = scalar_data(batch_size=FULL_BATCH)
    strategy = DPSGD(rule, max_grad_norm=1.0, noise_multiplier=2.0)
    trainer = fit(tmp_path, strategy, rounds=1, clients_per_round=1, epochs=1, lr=1.0, data=data)
    (client,) = rule.rounds[0]
    secret = ckpt_io.load(trainer.run_dir / "checkpoints" / "last.ckpt")["strategy"]["state"]["noise_secret"]
    seed = int(np.random.SeedSequence(secret, spawn_key=(0, client)).generate_state(1, np.uint64)[0])
    xi = torch.randn((), generator=torch.Generator().manual_seed(seed)).item()
    batch = int(data.num_samples[client])  # one full batch
    clipped = max(-1.0, min(1.0, -VALUES[client]))  # w − y at w = 0
    assert trainer.global_state.item() == pytest.approx(-(clipped + 2.0 * 1.0 * xi / batch), rel=1e-5)


def test_the_noise_spreads_as_z_c_over_b_over_many_draws():
    zeros = [torch.zeros(4, 100_000), torch.zeros(4, 3)]  # B = 4 samples with no gradient: all is noise
    noisy = noisy_clipped_mean(zeros, 0.5, 1.5, torch.Generator().manual_seed(0))
    assert noisy[0].std().item() == pytest.approx(1.5 * 0.5 / 4, rel=0.01)
    assert abs(noisy[0].mean().item()) < 4 * 1.5 * 0.5 / 4 / math.sqrt(100_000)


@pytest.mark.usefixtures("runs_in_tmp")
def test_one_noisy_step_of_a_cnn_spreads_as_z_c_over_b():
    # one step on the client's 10 samples; C = 1e-3 bounds the clipped mean by 1e-3, the noise is z C ξ / 10
    trainer, w0 = cnn_fit(DPSGD(max_grad_norm=1e-3, noise_multiplier=1.0, insecure_seeded_noise=True))
    step = (trainer.global_state.double() - w0) / 0.5  # −g̃ (SGD with lr 0.5)
    assert step.numel() == 54179
    assert step.std().item() == pytest.approx(1e-3 / 10, rel=0.02)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_each_clients_epsilon_composes_its_own_steps(tmp_path, accountant):
    # n_k = 2 (q = 1, one step an epoch) or 4 (q = 1/2, two steps an epoch)
    rule, data = Recorded(), scalar_data(sizes=[4, 8, 4, 8, 4, 8])
    strategy = DPSGD(rule, noise_multiplier=1.2, delta=1e-5, accountant=accountant)
    trainer = fit(tmp_path, strategy, rounds=3, clients_per_round=2, epochs=1, data=data)
    steps = [sum(k in clients for clients in rule.rounds) * data.num_batches(k) for k in range(len(SIZES))]
    rates = [min(BATCH, int(n)) / int(n) for n in data.num_samples]
    assert 0 in steps and {0.5, 1.0} <= {q for q, s in zip(rates, steps, strict=True) if s}

    def reference(k):  # S_k Poisson-subsampled Gaussian steps at q_k = B/n_k, composed by dp-accounting directly
        if steps[k] == 0:
            return 0.0
        if accountant == "rdp":
            account = dp_accounting.rdp.RdpAccountant()
        else:
            account = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
        account.compose(dp_accounting.PoissonSampledDpEvent(rates[k], dp_accounting.GaussianDpEvent(1.2)), steps[k])
        return account.get_epsilon(1e-5)

    expected = [reference(k) for k in range(len(SIZES))]
    assert strategy.counts.tolist() == steps
    assert strategy.epsilons.tolist() == pytest.approx(expected, rel=1e-6)
    assert trainer.history[-1]["dp_sgd/epsilon_max"] == pytest.approx(max(expected), rel=1e-6)
    assert trainer.history[-1]["dp_sgd/epsilon_mean"] == pytest.approx(np.mean([e for e in expected if e]), rel=1e-6)


def test_a_resumed_run_draws_the_noise_of_its_secret_and_keeps_every_clients_epsilon(tmp_path):
    def make():
        return DPSGD(FedProx(mu=0.1), max_grad_norm=1.0, noise_multiplier=1.0)

    kwargs = {"data": scalar_data(batch_size=FULL_BATCH), "epochs": 3}
    straight = fit(tmp_path, make(), rounds=3, checkpoint_every=1, **kwargs)
    round_two = straight.run_dir / "checkpoints" / "previous.ckpt"
    resumed = fit(tmp_path, make(), rounds=3, ckpt_path=round_two, rewind=True, **kwargs)
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)
    state, expected = resumed.run.strategy.state_dict(), straight.run.strategy.state_dict()
    assert state["noise_secret"] == expected["noise_secret"]
    assert torch.equal(state["counts"], expected["counts"]) and torch.equal(state["epsilons"], expected["epsilons"])


def test_seeded_noise_round_trips_through_a_checkpoint(tmp_path):
    def make():
        return DPSGD(max_grad_norm=1.0, noise_multiplier=1.0, insecure_seeded_noise=True)

    kwargs = {"data": scalar_data(batch_size=FULL_BATCH), "epochs": 3}
    straight = fit(tmp_path, make(), rounds=2, **kwargs)
    first = fit(tmp_path, make(), rounds=1, **kwargs)
    resumed = fit(tmp_path, make(), rounds=2, ckpt_path=first.run_dir / "checkpoints" / "last.ckpt", **kwargs)
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)
    assert torch.equal(resumed.run.strategy.epsilons, straight.run.strategy.epsilons)


def test_rules_that_keep_the_plain_local_step_are_wrapped():
    DPSGD(FedAvgM())  # a server step of its own
    DPSGD(RobustAggregation(FedProx(), aggregator="median"))  # a wrapper that changes no client hook
    DPFedAvg(DPSGD(FedProx()))  # client-level DP around sample-level DP


@pytest.mark.parametrize("rule", [MOON(), SCAFFOLD(), DPFedAvg()], ids=["moon", "scaffold", "dpfedavg_inside"])
def test_rules_that_change_the_local_step_are_refused_naming_the_flag(rule):
    with pytest.raises(ConfigError, match=r"--strategy DPSGD cannot wrap --strategy\.init_args\.rule"):
        DPSGD(rule)


def test_bad_settings_are_reported_together_naming_their_flags():
    with pytest.raises(ConfigError) as error:
        DPSGD(max_grad_norm=0.0, noise_multiplier=-1.0, delta=1.0)
    for flag in ("max_grad_norm", "noise_multiplier", "delta"):
        assert f"--strategy.init_args.{flag}" in str(error.value)


@pytest.mark.usefixtures("runs_in_tmp")
def test_a_model_with_batchnorm_is_refused_at_set_up():
    data = FederatedDataModule(ClientImages([10, 14], [1, 2]), batch_size=4, test_fraction=0.0)
    trainer = FederatedTrainer(rounds=1, clients_per_round=2, logger=None, enable_progress_bar=False)
    client = ClassificationClient(num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"batch_norm": True})
    with pytest.raises(ConfigError, match=r"--strategy DPSGD cannot train.*BatchNorm2d.*GroupNorm"):
        trainer.fit(client, data, DPSGD())
    assert trainer.run_dir is None  # before the run folder exists


class _Client(nn.Module):
    """A small convolutional client with GroupNorm, as DP-SGD wants it."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.cross_entropy(self.net(x), y)}


class _SampleLoss(nn.Module):
    def __init__(self, client):
        super().__init__()
        self.client = client

    def forward(self, sample):
        return self.client.training_step(tuple(part.unsqueeze(0) for part in sample), 0)["loss"]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_the_noisy_clipped_gradient_is_opacus_s():
    opacus = pytest.importorskip("opacus", reason="the comparison with Opacus needs opacus (pip install opacus)")
    from opacus.optimizers import DPOptimizer

    torch.manual_seed(0)
    client, batch = _Client(), (torch.randn(8, 1, 8, 8), torch.randint(3, (8,)))
    params = {f"client.{name}": p.detach() for name, p in client.named_parameters()}
    grads = per_sample_gradients(_SampleLoss(client), params, batch)
    ours = noisy_clipped_mean(list(grads.values()), 0.5, 1.3, torch.Generator().manual_seed(7))

    model = opacus.GradSampleModule(client.net)
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.3, max_grad_norm=0.5, expected_batch_size=8,
        generator=torch.Generator().manual_seed(7),  # the same draws, one parameter after another
    )  # fmt: skip
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    optimizer.pre_step()  # clip per sample, add noise, divide by B
    for mine, p in zip(ours, model.parameters(), strict=True):
        torch.testing.assert_close(mine, p.grad, rtol=1e-5, atol=1e-6)  # Opacus divides by ‖g_i‖ + 1e-6
