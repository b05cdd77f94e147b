"""Ditto against a step-by-step reference on ScalarClient (loss ½(w − y_k)², full-batch SGD): the global model is
FedAvg's, and each client's personal model v_k takes steps on ½(v − y_k)² + (λ/2)(v − w^t)² from where it was."""

import pytest

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import Ditto, FedAvg
from fedlight.testing import ScalarClient, ScalarDataset

SIZES, VALUES = [6, 10, 8], [1.0, -2.0, 4.0]
LR, EPOCHS, ROUNDS, LAM = 0.3, 2, 3, 0.5


def fit(tmp_path, rule):
    data = FederatedDataModule(ScalarDataset(SIZES, VALUES), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=ROUNDS, clients_per_round=3, local_epochs=EPOCHS, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=LR), data, rule)
    return trainer


def reference(sizes, personal_epochs):
    w, personal = 0.0, [None] * len(VALUES)
    for _ in range(ROUNDS):
        trained = []
        for k, y in enumerate(VALUES):
            w_k = w
            for _ in range(EPOCHS):
                w_k -= LR * (w_k - y)
            v = w if personal[k] is None else personal[k]  # v_k starts from the first model it received
            for _ in range(personal_epochs):
                v -= LR * ((v - y) + LAM * (v - w))
            personal[k] = v
            trained.append(w_k)
        w = sum(n * t for n, t in zip(sizes, trained, strict=True)) / sum(sizes)
    return w, personal


@pytest.mark.parametrize("personal_epochs", [None, 4])
def test_three_rounds_match_algorithm_1(tmp_path, personal_epochs):
    trainer = fit(tmp_path, Ditto(lam=LAM, personal_epochs=personal_epochs))
    sizes = trainer.run.datamodule.num_samples.tolist()
    w, personal = reference(sizes, personal_epochs or EPOCHS)
    assert trainer.global_state.item() == pytest.approx(w, abs=1e-6)
    fedavg = fit(tmp_path, FedAvg())  # the global model is FedAvg's, whatever the personal models do
    assert trainer.global_state.item() == fedavg.global_state.item()
    store = trainer.model.client_states
    assert [store.get(k)["personal"].item() for k in range(3)] == pytest.approx(personal, abs=1e-6)
    held_out = [n_all - n for n_all, n in zip(SIZES, sizes, strict=True)]
    loss = sum(m * 0.5 * (v - y) ** 2 for m, v, y in zip(held_out, personal, VALUES, strict=True)) / sum(held_out)
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(loss, rel=1e-5)
    assert trainer.history[-1]["clients/loss"] != pytest.approx(loss)  # the global model scores otherwise


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="lam"):
        Ditto(lam=-1.0)
    with pytest.raises(ConfigError, match="personal_epochs"):
        Ditto(personal_epochs=0)
