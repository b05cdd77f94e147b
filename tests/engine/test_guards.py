"""A client whose local fit raises is left out of its round, counted and recorded; the run goes on."""

import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg
from fedlight.testing import ScalarClient, ScalarDataset


class FlakyClient(ScalarClient):
    """Raises in the local fit of the clients whose targets are in ``failing``."""

    def __init__(self, failing=(3.0,), error=RuntimeError):
        super().__init__(lr=1.0)
        self.failing, self.error = failing, error

    def training_step(self, batch, batch_idx):
        if float(batch[1][0]) in self.failing:
            raise self.error(f"bad batch of target {float(batch[1][0])}")
        return super().training_step(batch, batch_idx)


def run(tmp_path, model, **kwargs):
    # three clients with 4 training samples each and targets 2, 3, 4: one full-batch step with lr 1 lands on y
    data = FederatedDataModule(ScalarDataset([8, 8, 8], [2.0, 3.0, 4.0]), batch_size=100, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=2, clients_per_round=3, local_epochs=1, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path, **kwargs,
    )  # fmt: skip
    return trainer, trainer.fit(model, data, FedAvg())


def test_a_failing_client_is_left_out_counted_and_its_traceback_kept(tmp_path):
    warning = r"1 of 3 clients failed their local fit in round \d .* client 1 \(RuntimeError: bad batch of target 3.0\)"
    with pytest.warns(UserWarning, match=warning):
        trainer, metrics = run(tmp_path, FlakyClient())
    assert trainer.global_state.item() == pytest.approx((2.0 + 4.0) / 2)  # clients 0 and 2, equal sizes
    assert [row["round/clients_failed"] for row in trainer.history] == [1.0, 1.0]
    assert (metrics["round/clients_aggregated"], metrics["round/clients_nonfinite"]) == (2.0, 0.0)
    for round_number in (1, 2):  # counted from 1, as every round a user reads
        text = (trainer.run_dir / "client_errors" / f"round{round_number}_client1.txt").read_text()
        assert "in training_step" in text and text.strip().endswith("RuntimeError: bad batch of target 3.0")
    assert sorted(p.name for p in (trainer.run_dir / "client_errors").iterdir()) == [
        "round1_client1.txt", "round2_client1.txt",
    ]  # fmt: skip


def test_fail_fast_reraises_the_clients_exception(tmp_path):
    with pytest.raises(RuntimeError, match=r"bad batch of target 3\.0"):
        run(tmp_path, FlakyClient(), fail_fast=True)


def test_a_round_where_every_client_fails_stops_the_run(tmp_path):
    with pytest.raises(ConfigError, match="Every one of the 3 clients of round 1 failed its local fit") as err:
        run(tmp_path, FlakyClient(failing=(2.0, 3.0, 4.0)))
    assert "--trainer.fail_fast=true" in str(err.value) and "client_errors" in str(err.value)


@pytest.mark.parametrize("error", [ConfigError, KeyboardInterrupt])
def test_config_errors_and_interrupts_are_not_client_failures(tmp_path, error):
    with pytest.raises(error):  # a KeyboardInterrupt comes out as the RunInterrupted that subclasses it
        run(tmp_path, FlakyClient(error=error))
    assert not list(tmp_path.glob("*/*/client_errors"))


class FailFirstClient(FedAvg):
    """FedAvg whose first client of every round fails as its local fit starts."""

    def on_client_fit_start(self, context, module, plan):
        if plan.client == context.plans[0].client:
            raise RuntimeError(f"client {plan.client} broke")


def test_two_processes_gather_the_failures_and_agree_with_one(tmp_path):
    def fit(devices):
        torch.manual_seed(0)
        model = ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [8]})
        trainer = FederatedTrainer(
            rounds=2, clients_per_round=3, local_epochs=1, logger="csv", enable_progress_bar=False,
            default_root_dir=tmp_path / str(devices), devices=devices, start_method="fork",
        )  # fmt: skip
        data = FederatedDataModule(Synthetic(num_clients=6, dim=12, seed=1), batch_size=10)
        trainer.fit(model, data, FailFirstClient())
        return trainer

    with pytest.warns(UserWarning, match=r"1 of 3 clients failed their local fit in round [12]"):
        one = fit(1)
    two = fit(2)
    assert [row["round/clients_failed"] for row in two.history] == [1.0, 1.0]
    assert [row["round/clients_aggregated"] for row in two.history] == [2.0, 2.0]
    assert torch.allclose(two.global_state, one.global_state, atol=1e-6)
    assert sorted(p.name for p in (two.run_dir / "client_errors").iterdir()) == sorted(
        p.name for p in (one.run_dir / "client_errors").iterdir()
    )
    assert len(list((two.run_dir / "client_errors").iterdir())) == 2


def test_a_client_state_budget_beyond_the_machines_memory_is_refused_at_set_up():
    from fedlight.engine.config import MemorySettings

    problems = MemorySettings(gather_budget_mb=1024.0, client_state_budget_mb=1e12).problems()
    assert (
        len(problems) == 1
        and "--trainer.client_state_budget_mb=1e+12 is more than this machine's memory" in problems[0]
    )
    assert MemorySettings(gather_budget_mb=1024.0, client_state_budget_mb=64.0).problems() == []
