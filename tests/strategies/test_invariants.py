"""Invariants every aggregation rule that runs on :class:`ScalarClient` must satisfy, through the engine.

Each client minimises ½(w − y_k)² from the global w; the rules differ in how they combine the results,
but none may move identical clients, change a lone client's result, depend on the order of the
clients or lose anything across a checkpoint.
"""

import pytest
import torch

from fedlight.data import FederatedDataModule
from fedlight.strategies import Fairness, FedAtt, FedAvg, FedProx
from fedlight.testing import ScalarClient, ScalarDataset
from fedlight.trainer import FederatedTrainer

STRATEGIES = {
    "fedavg": FedAvg,
    "fedprox": lambda: FedProx(mu=0.5),
    "fedatt": lambda: FedAtt(sigma=0.0),
    "fairness": Fairness,
}


@pytest.fixture(params=list(STRATEGIES), ids=list(STRATEGIES))
def make_strategy(request):
    return STRATEGIES[request.param]


def fit(root, sizes, values, strategy, rounds=1, lr=1.0, init=0.0, ckpt_path=None, **trainer_kwargs):
    """Returns the trainer after ``rounds`` rounds from w = ``init``.

    Client k trains on int(0.5·sizes[k]) samples of target values[k], in one full batch per epoch.
    """
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer_kwargs = {"clients_per_round": len(sizes), "local_epochs": 1, **trainer_kwargs}
    trainer = FederatedTrainer(
        rounds=rounds, logger=None, enable_progress_bar=False, default_root_dir=root, **trainer_kwargs
    )
    client = ScalarClient(lr=lr)
    with torch.no_grad():
        client.w.fill_(init)
    trainer.fit(client, data, strategy, ckpt_path=ckpt_path)
    return trainer


def test_identical_clients_are_a_fixed_point(make_strategy, tmp_path):
    trainer = fit(tmp_path, [6, 8, 12], [1.5, 1.5, 1.5], make_strategy(), rounds=3, lr=0.5, init=1.5, local_epochs=2)
    assert trainer.global_state.item() == pytest.approx(1.5, abs=1e-7)
    # From elsewhere, identical clients end where any one of them would alone.
    many = fit(tmp_path, [6, 8, 12], [1.5, 1.5, 1.5], make_strategy(), lr=0.5, local_epochs=2)
    alone = fit(tmp_path, [8], [1.5], make_strategy(), lr=0.5, local_epochs=2)
    assert many.global_state.item() == pytest.approx(alone.global_state.item(), abs=1e-7)


def test_one_client_reproduces_itself(make_strategy, tmp_path):
    # Two half steps of SGD on ½(w − 3)² (plus FedProx's term): whatever the client reaches is the new model.
    one = fit(tmp_path, [7], [3.0], make_strategy(), lr=0.5, local_epochs=2)
    client = ScalarClient(lr=0.5)
    strategy = make_strategy()
    optimizer = client.configure_optimizers()
    strategy.on_client_fit_start(None, client, None)
    for _ in range(2):
        loss = strategy.training_loss(client, None, client.training_step((None, torch.full((3,), 3.0)), 0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert one.global_state.item() == pytest.approx(client.w.item())


def test_result_does_not_depend_on_client_order(make_strategy, tmp_path):
    sizes, values = [4, 6, 10, 8], [1.0, -2.0, 4.0, 0.5]
    order = [2, 0, 3, 1]
    kwargs = {"rounds": 2, "lr": 0.5, "local_epochs": 2}
    w = fit(tmp_path, sizes, values, make_strategy(), **kwargs).global_state
    w_permuted = fit(tmp_path, [sizes[i] for i in order], [values[i] for i in order], make_strategy(), **kwargs)
    torch.testing.assert_close(w_permuted.global_state, w)


def test_state_round_trips(make_strategy, tmp_path):
    strategy, clone = make_strategy(), make_strategy()
    clone.load_state_dict(strategy.state_dict())
    assert clone.state_dict() == strategy.state_dict()
    # Through a checkpoint: 1 round, then resume for a second, equals 2 rounds in one go.
    sizes, values = [4, 6, 10], [1.0, -2.0, 4.0]
    straight = fit(tmp_path, sizes, values, make_strategy(), rounds=2, lr=0.5, local_epochs=2)
    first = fit(tmp_path, sizes, values, make_strategy(), rounds=1, lr=0.5, local_epochs=2)
    ckpt = first.run_dir / "checkpoints" / "last.ckpt"
    resumed = fit(tmp_path, sizes, values, make_strategy(), rounds=2, lr=0.5, local_epochs=2, ckpt_path=ckpt)
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)
