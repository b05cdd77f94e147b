"""MOON: the contrastive loss against its formula, and the buffer of previous local models in a run."""

import copy
import math

import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies import MOON, FedAvg
from fedlight.strategies.moon import model_contrastive_loss
from fedlight.testing import ClientImages


def test_loss_is_the_cross_entropy_of_cosine_logits():
    generator = torch.Generator().manual_seed(0)
    z, z_glob, z_prev = (torch.randn(5, 4, dtype=torch.float64, generator=generator) for _ in range(3))
    tau = 0.3
    cos = lambda a, b: (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))  # noqa: E731
    positive, negative = torch.exp(cos(z, z_glob) / tau), torch.exp(cos(z, z_prev) / tau)
    expected = -torch.log(positive / (positive + negative)).mean()
    assert model_contrastive_loss(z, z_glob, [z_prev], tau).item() == pytest.approx(expected.item())


def test_loss_prefers_the_global_representation():
    z = torch.tensor([[1.0, 0.0]])
    close = model_contrastive_loss(z, z, [-z], 0.5).item()  # cos = 1 with the global, −1 with the previous
    far = model_contrastive_loss(z, -z, [z], 0.5).item()
    assert close == pytest.approx(math.log(1 + math.exp(-4)), rel=1e-5)  # fp32 logits
    assert far == pytest.approx(math.log(1 + math.exp(4)), rel=1e-5)


class RecordingMOON(MOON):
    """Keeps the trained local networks and the contrastive term of every client's first step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.nets, self.starts, self.first_terms, self.round = {}, {}, {}, 0

    def on_round_start(self, trainer, round_idx, plans):
        super().on_round_start(trainer, round_idx, plans)
        self.round = round_idx

    def on_client_fit_start(self, trainer, module, plan):
        super().on_client_fit_start(trainer, module, plan)
        self.client = plan.client
        self.starts[(self.round, plan.client)] = copy.deepcopy(module.net)

    def training_loss(self, module, batch, outputs):
        loss = super().training_loss(module, batch, outputs)
        self.first_terms.setdefault((self.round, self.client), (loss - outputs["loss"]).item() / self.mu)
        return loss

    def on_client_fit_end(self, trainer, module, update):
        self.nets[(self.round, update.client)] = copy.deepcopy(module.net)
        super().on_client_fit_end(trainer, module, update)


def fit(root, strategy, rounds=2):
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
    )  # fmt: skip
    data = FederatedDataModule(ClientImages([6, 9], [1, 2]), batch_size=1000, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=2, local_epochs=2, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(client, data, strategy)
    return trainer


def test_zero_mu_is_fedavg(tmp_path):
    torch.testing.assert_close(
        fit(tmp_path, MOON(mu=0.0)).global_state, fit(tmp_path, FedAvg(sampling="uniform")).global_state
    )


def test_first_participation_has_no_contrastive_term(tmp_path):
    one_round = fit(tmp_path, MOON(mu=5.0), rounds=1).global_state
    torch.testing.assert_close(one_round, fit(tmp_path, FedAvg(sampling="uniform"), rounds=1).global_state)
    two_rounds = fit(tmp_path, MOON(mu=5.0)).global_state
    assert not torch.allclose(two_rounds, fit(tmp_path, FedAvg(sampling="uniform")).global_state)


def test_previous_models_are_the_last_trained_local_models(tmp_path):
    strategy = RecordingMOON(mu=1.0)
    trainer = fit(tmp_path, strategy)
    for client in (0, 1):
        net = strategy.nets[(1, client)]
        torch.testing.assert_close(strategy.previous[client], FlatState(net).flatten(net), rtol=0, atol=0)
    # Round 1's first (full-batch) step contrasts the model it starts from, W^1, with W^1 itself (the global
    # model) and with the client's round-0 local model. The CNN has no BatchNorm or dropout, so train and
    # eval mode give the same features.
    data = trainer.run.datamodule
    for client in (0, 1):
        x = data.pool.inputs[data.client_train[client]]
        with torch.no_grad():
            z = strategy.starts[(1, client)].forward_features(x)
            z_prev = strategy.nets[(0, client)].forward_features(x)
        expected = model_contrastive_loss(z, z, [z_prev], 0.5).item()
        assert strategy.first_terms[(1, client)] == pytest.approx(expected, rel=1e-5)
    assert strategy.first_terms[(0, 0)] == 0.0  # no previous model in round 0


def test_state_holds_every_participant_and_round_trips(tmp_path):
    strategy = fit(tmp_path, MOON(mu=1.0), rounds=1).run.strategy
    state = strategy.state_dict()
    assert sorted(state["previous"]) == [0, 1]
    clone = MOON()
    clone.load_state_dict(state)
    for client, tensor in state["previous"].items():
        assert torch.equal(clone.previous[client], tensor) and tensor.dtype == torch.float32
        assert tensor.device.type == "cpu"


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        MOON(mu=-1.0, temperature=0.0)
    assert len(err.value.problems) == 2
