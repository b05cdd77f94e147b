"""FedBN against an independently written federation of copies: every client keeps its BatchNorm entries (weights,
biases, running statistics), everything else is averaged by n_k (full-batch SGD, every client every round)."""

import copy

import pytest
import torch
from torch import nn

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedBN

ROUNDS = 3


def client(batch_norm=True):
    torch.manual_seed(0)
    return ClassificationClient(
        num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [16], "batch_norm": batch_norm},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )  # fmt: skip


def data():
    return FederatedDataModule(Synthetic(num_clients=3, dim=12, seed=1), batch_size=10_000)


def reference(module, data_module):
    """``ROUNDS`` rounds of FedBN on copies of ``module``; returns the global state and each client's BN entries."""
    bn = [f"{name}.{key}" for name, sub in module.named_modules() if isinstance(sub, nn.BatchNorm1d)
          for key in sub.state_dict()]  # fmt: skip
    global_state = copy.deepcopy(module.state_dict())
    own: dict[int, dict[str, torch.Tensor]] = {}
    sizes = data_module.num_samples.tolist()
    for _ in range(ROUNDS):
        trained = []
        for k in range(data_module.num_clients):
            local = copy.deepcopy(module)
            local.load_state_dict(global_state)
            local.load_state_dict(own.get(k, {}), strict=False)
            local.train()
            optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
            x, y = (torch.cat(parts) for parts in zip(*data_module.client_batches(k, "train"), strict=True))
            optimizer.zero_grad()
            local.training_step((x, y), 0)["loss"].backward()
            optimizer.step()
            state = local.state_dict()
            own[k] = {name: state[name].clone() for name in bn}
            trained.append(state)
        for name, value in global_state.items():
            if value.is_floating_point():
                global_state[name] = sum(n * s[name] for n, s in zip(sizes, trained, strict=True)) / sum(sizes)
            else:
                global_state[name] = max(s[name] for s in trained)
    return global_state, own


def test_three_rounds_match_a_federation_of_copies(tmp_path):
    trainer = FederatedTrainer(
        rounds=ROUNDS, clients_per_round=3, local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    module = client()
    initial = copy.deepcopy(module)
    trainer.fit(module, data(), FedBN())
    expected, own = reference(initial, trainer.run.datamodule)
    layout, store = trainer.model.layout, trainer.model.client_states
    got = layout.to_state_dict(trainer.global_state, trainer.model.integers)
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    names = [n for n in layout.names if n in own[0]]
    assert names and len(names) < len(layout.names)
    for k in range(3):
        local = layout.to_state_dict(store.load_into(store.get(k), trainer.global_state), {})
        for name in names:
            torch.testing.assert_close(local[name], own[k][name], rtol=1e-5, atol=1e-6, msg=f"client {k} {name}")
    assert "clients/personal/acc" in trainer.history[-1]


def test_a_model_without_batch_norm_is_refused_at_set_up(tmp_path):
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=3, logger=None, enable_progress_bar=False, default_root_dir=tmp_path
    )
    with pytest.raises(ConfigError, match="batch_norm=true"):
        trainer.fit(client(batch_norm=False), data(), FedBN())
