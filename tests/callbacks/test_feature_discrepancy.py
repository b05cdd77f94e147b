"""FeatureDiscrepancy against maximum_mean_discrepancy applied here to both models' features."""

import pytest
import small_run
import torch
from small_run import make_model, make_trainer

from fedlight.callbacks import FeatureDiscrepancy, RoundCallback
from fedlight.callbacks.feature_discrepancy import feature_discrepancy_gain
from fedlight.errors import ConfigError
from fedlight.metrics.functional import maximum_mean_discrepancy
from fedlight.strategies import FedAvg


def make_data():
    # held-out batches of 5: the first max_samples inputs span several batches
    return small_run.make_data(eval_batch_size=5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A two-round run of another initial model: its last.ckpt stands in for the centralized model."""
    root = tmp_path_factory.mktemp("reference")
    trainer = make_trainer(root)
    trainer.fit(make_model(seed=7), make_data(), FedAvg())
    return trainer.run_dir / "checkpoints" / "last.ckpt"


class RoundRecord(RoundCallback):
    """Keeps each round's sampled clients, W^{t+1} and the metrics the callbacks before it added."""

    def __init__(self):
        self.rounds = {}

    def on_round_end(self, context, round_idx, metrics):
        self.rounds[round_idx] = ([p.client for p in context.plans], context.global_state.clone(), dict(metrics))


def features(model, data, client, max_samples):
    indices = data.held_out_index[data.held_out_group == client][:max_samples]
    with torch.no_grad():
        return model.eval().net.forward_features(data.pool.inputs[indices])


def test_mmd_is_the_mean_over_sampled_clients_of_mmd_between_the_models_features(tmp_path, reference):
    record = RoundRecord()
    callback = FeatureDiscrepancy(str(reference), max_samples=8, bandwidth_multipliers=[0.5, 1.0, 2.0])
    trainer = make_trainer(tmp_path, callbacks=[callback, record])
    trainer.fit(make_model(), make_data(), FedAvg())

    reference_model = make_model()
    trainer.model.layout.load(
        reference_model, *trainer.model.layout.from_state_dict(torch.load(reference)["global_state"])
    )
    data = trainer.run.datamodule
    dropped = 0
    for round_idx, row in enumerate(trainer.history):
        clients, state, metrics = record.rounds[round_idx]
        dropped += int(row["round/clients_dropped"])
        model = make_model()
        trainer.model.layout.load(model, state)
        values = []
        for client in clients:
            p, q = features(model, data, client, 8), features(reference_model, data, client, 8)
            assert len(p) == 8
            values.append(maximum_mean_discrepancy(p, q, bandwidth_multipliers=[0.5, 1.0, 2.0]).item())
        assert len(values) == 3  # every sampled client, dropped stragglers included
        assert row["analysis/mmd"] == pytest.approx(sum(values) / len(values), rel=1e-5)
        torch.testing.assert_close(metrics["analysis/mmd_clients"], torch.tensor(values), rtol=1e-5, atol=1e-7)
    assert dropped > 0


def test_reference_equal_to_the_global_model_gives_the_estimate_of_identical_samples(tmp_path, reference):
    # the same run as the reference's: its last global model is the reference, feature for feature
    callback = FeatureDiscrepancy(str(reference), every_n_rounds=2, max_samples=1000)
    record = RoundRecord()
    trainer = make_trainer(tmp_path, callbacks=[callback, record])
    trainer.fit(make_model(seed=7), make_data(), FedAvg())
    assert "analysis/mmd" not in trainer.history[0]  # due after round 1 only
    clients, state, _ = record.rounds[1]
    model = make_model()
    trainer.model.layout.load(model, state)
    expected = [
        maximum_mean_discrepancy(p, p).item()
        for p in (features(model, trainer.run.datamodule, c, 1000) for c in clients)
    ]
    assert trainer.history[1]["analysis/mmd"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    assert -0.1 < trainer.history[1]["analysis/mmd"] <= 0  # unbiased: slightly below 0 for P = Q


def test_missing_reference_names_the_flag(tmp_path):
    callback = FeatureDiscrepancy(str(tmp_path / "nope.ckpt"))
    with pytest.raises(ConfigError, match=r"init_args.reference=.*nope.ckpt does not exist"):
        make_trainer(tmp_path, callbacks=[callback]).fit(make_model(), make_data(), FedAvg())


def test_reference_of_another_model_is_refused(tmp_path, reference):
    callback = FeatureDiscrepancy(str(reference))
    with pytest.raises(ConfigError, match=r"init_args.reference=.* other parameters"):
        make_trainer(tmp_path, callbacks=[callback]).fit(make_model(hidden=32), make_data(), FedAvg())


def test_bad_arguments_are_reported_together():
    with pytest.raises(ConfigError) as err:
        FeatureDiscrepancy("x.ckpt", every_n_rounds=0, max_samples=1, bandwidth_multipliers=[0.0])
    assert str(err.value).count("FeatureDiscrepancy") == 3


def test_gain_of_an_equal_baseline_is_undefined():
    assert feature_discrepancy_gain(0.0, 0.5) == 100.0
    with pytest.raises(ValueError, match="baseline"):
        feature_discrepancy_gain(0.1, 0.0)


def test_reference_trained_on_other_data_is_warned_about(tmp_path):
    other = make_trainer(tmp_path / "other", rounds=1)
    other.fit(make_model(), make_data(), FedAvg(), config={"data": {"seed": 1, "centralized": True}})
    callback = FeatureDiscrepancy(str(other.run_dir / "checkpoints" / "last.ckpt"))
    with pytest.warns(UserWarning, match=r"other data than this run \(data.seed: 1 there, 0 here\)"):
        make_trainer(tmp_path, rounds=1, callbacks=[callback]).fit(
            make_model(), make_data(), FedAvg(), config={"data": {"seed": 0, "centralized": False}}
        )
