"""Staged runs: ``init_from`` seeds a run's W^0 from another run's weights."""

import pytest
import torch

from fedlight import checkpoint as ckpt_io
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg
from fedlight.trainer import FederatedTrainer


def make_model(seed=0, hidden=16):
    torch.manual_seed(seed)
    return ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [hidden]})


def make_data(centralized=False):
    return FederatedDataModule(Synthetic(num_clients=6, dim=12, seed=1), batch_size=10, centralized=centralized)


def trainer(tmp_path, name, rounds=2, **kwargs):
    return FederatedTrainer(
        rounds=rounds, clients_per_round=1 if "centralized" in name else 3, local_epochs=1, logger="csv",
        enable_progress_bar=False, default_root_dir=tmp_path, name=name, **kwargs,
    )  # fmt: skip


class FirstState(FedAvg):
    """Keeps the state the first client of the run started from: W^0."""

    def __init__(self):
        super().__init__()
        self.first = None

    def initial_state(self, context, plan, state):
        if self.first is None:
            self.first = context.layout.to_state_dict(state, context.global_integers)
        return state


def test_a_federated_run_starts_from_a_centralized_runs_last_checkpoint(tmp_path):
    source = trainer(tmp_path, "centralized")
    source.fit(make_model(seed=0), make_data(centralized=True), FedAvg())
    pretrained = source.layout.to_state_dict(source.global_state, source.global_integers)

    strategy = FirstState()
    checkpoint = source.run_dir / "checkpoints" / "last.ckpt"
    trainer(tmp_path, "federated", rounds=1, init_from=checkpoint).fit(make_model(seed=1), make_data(), strategy)
    assert strategy.first.keys() == pretrained.keys()
    for name, value in pretrained.items():
        assert torch.equal(strategy.first[name], value), name
    assert not torch.equal(make_model(seed=1).net.head.weight, pretrained["net.head.weight"])  # not its own init


@pytest.mark.parametrize("layout", ["state_dict", "lightning"])
def test_init_from_takes_a_plain_or_lightning_state_dict(tmp_path, layout):
    weights = make_model(seed=3).state_dict()
    path = tmp_path / "weights.pt"
    torch.save(weights if layout == "state_dict" else {"state_dict": weights, "epoch": 3}, path)
    strategy = FirstState()
    trainer(tmp_path, "run", rounds=1, init_from=path).fit(make_model(seed=1), make_data(), strategy)
    for name, value in weights.items():
        assert torch.equal(strategy.first[name], value), name


def test_init_from_another_model_lists_the_keys(tmp_path):
    path = tmp_path / "other.pt"
    other = make_model(hidden=8).state_dict()
    other["net.extra"] = torch.zeros(1)
    del other["net.head.bias"]
    torch.save(other, path)
    with pytest.raises(ConfigError) as err:
        trainer(tmp_path, "run", init_from=path).fit(make_model(), make_data(), FedAvg())
    message = str(err.value)
    assert "keys missing: net.head.bias" in message
    assert "keys unexpected: net.extra" in message
    assert "net.encoder.1.weight (8, 12) in the file, (16, 12) in the model" in message


def test_a_missing_init_from_file_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"--trainer.init_from .*nowhere.ckpt does not exist"):
        FederatedTrainer(init_from=tmp_path / "nowhere.ckpt")


def test_read_weights_refuses_a_file_without_tensors(tmp_path):
    path = tmp_path / "numbers.pt"
    torch.save({"lr": 0.1}, path)
    with pytest.raises(ConfigError, match="holds no model weights"):
        ckpt_io.read_weights(path)
