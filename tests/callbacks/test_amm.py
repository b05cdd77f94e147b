"""AggregateMeanMargin against pooled class means of the global model computed independently here."""

import itertools

import pytest
import small_run
import torch
from small_run import make_model, make_trainer

from fedlight.callbacks import AggregateMeanMargin, RoundCallback
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg, FedProx


def make_data():
    return small_run.make_data(eval_batch_size=32)


class GlobalStates(RoundCallback):
    """Keeps W^{t+1} of every round."""

    def __init__(self):
        self.states = {}

    def on_round_end(self, trainer, round_idx, metrics):
        self.states[round_idx] = trainer.global_state.clone()


def direct_amm(model, data):
    """Mean over present classes c of the mean distance from p[c] to the other present classes' p[c']."""
    indices = torch.cat(data.client_train)  # every client's training samples
    with torch.no_grad():
        features = model.eval().net.forward_features(data.pool.inputs[indices]).double()  # [N, D]
    targets = data.pool.targets[indices]
    present = [c for c in range(data.num_classes) if (targets == c).any()]
    means = {c: features[targets == c].mean(dim=0) for c in present}
    distances = {(a, b): (means[a] - means[b]).norm().item() for a, b in itertools.permutations(present, 2)}
    per_class = [sum(distances[c, o] for o in present if o != c) / (len(present) - 1) for c in present]
    return sum(per_class) / len(per_class), len(present) / data.num_classes


@pytest.mark.parametrize("strategy", [FedAvg, FedProx])
def test_amm_is_the_mean_distance_between_pooled_class_means(tmp_path, strategy):
    states = GlobalStates()
    trainer = make_trainer(tmp_path, callbacks=[AggregateMeanMargin(), states])
    trainer.fit(make_model(), make_data(), strategy())
    for round_idx, row in enumerate(trainer.history):
        model = make_model()
        trainer.model.layout.load(model, states.states[round_idx])
        amm, as_written = direct_amm(model, trainer.run.datamodule)
        assert row["analysis/amm"] == pytest.approx(amm, rel=1e-5)
        assert row["analysis/amm_as_written"] == pytest.approx(as_written)


def test_amm_cadence_and_untouched_training(tmp_path):
    plain = make_trainer(tmp_path / "plain", rounds=3)
    plain.fit(make_model(), make_data(), FedAvg())
    measured = make_trainer(tmp_path / "measured", rounds=3, callbacks=[AggregateMeanMargin(every_n_rounds=2)])
    measured.fit(make_model(), make_data(), FedAvg())
    # due after round 1 (every 2) and after the last round
    assert ["analysis/amm" in row for row in measured.history] == [False, True, True]
    torch.testing.assert_close(measured.global_state, plain.global_state, rtol=0, atol=0)


def test_bad_cadence_names_the_flag():
    message = r"--trainer.callbacks \(fedlight.callbacks.AggregateMeanMargin\) init_args.every_n_rounds ≥ 1, got 0"
    with pytest.raises(ConfigError, match=message):
        AggregateMeanMargin(every_n_rounds=0)
