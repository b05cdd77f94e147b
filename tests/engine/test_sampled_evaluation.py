"""Evaluation of a sample of the clients: drawn from the seed, the same after a resume, statistics of those clients."""

import csv

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.config import EvaluationSettings
from fedlight.engine.streams import RandomStreams
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg
from fedlight.testing import ClientImages, Kill, KillAfterRound

SIZES = [5, 9, 6, 12, 1, 8, 10, 7, 5, 11, 6, 9]  # client 4 holds out nothing (one sample, kept for training)


def make_data():
    # eval batches of 7 samples span several clients each
    return FederatedDataModule(ClientImages(SIZES, list(range(len(SIZES)))), batch_size=5, eval_batch_size=7)


def make_model(seed=0):
    torch.manual_seed(seed)
    return ClassificationClient(num_classes=3, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [8]})


def make_trainer(root, seed=0, rounds=4, callbacks=None, **kwargs):
    options = {"eval_clients": 3, "full_eval_every": 0, **kwargs}
    return FederatedTrainer(
        rounds=rounds, clients_per_round=4, local_epochs=1, default_root_dir=root, logger="csv", seed=seed,
        enable_progress_bar=False, callbacks=callbacks, **options,
    )  # fmt: skip


def rows(trainer):
    with (trainer.run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def clients_columns(row):
    return {k: v for k, v in row.items() if k.startswith("clients/")}


def test_the_samples_statistics_are_those_of_its_clients_computed_by_hand(tmp_path):
    trainer = make_trainer(tmp_path, rounds=3, eval_clients=0.3)  # ⌈0.3 · 11⌉ = 4 of the 11 clients with data
    data = make_data()
    trainer.fit(make_model(), data, FedAvg())
    sample = trainer.run.pieces.evaluator.sample(
        1, trainer.run.rounds
    )  # after the second round; W^3 is the model at hand
    scorable = [k for k in range(len(SIZES)) if k != 4]
    assert sample is not None and len(sample) == 4 and set(sample.tolist()) <= set(scorable)
    assert sample.tolist() == sorted(sample.tolist())

    # the final model scored on those clients' held-out samples, one client at a time, by hand
    model = trainer.model.evaluation_module()
    correct, losses, accuracies = 0, [], []
    with torch.no_grad():
        for client in sample.tolist():
            x, y = map(torch.cat, zip(*data.client_batches(client, split="held_out"), strict=True))
            logits = model(x)
            correct += int((logits.argmax(1) == y).sum())
            losses.append(F.cross_entropy(logits, y, reduction="none"))
            accuracies.append(float((logits.argmax(1) == y).double().mean()))
    losses = torch.cat(losses)
    metrics = trainer.run.pieces.evaluator.evaluate(clients=True, test=False, sample=sample)
    assert metrics["clients/evaluated"] == 4
    assert np.isclose(metrics["clients/acc"], correct / len(losses))
    assert np.isclose(metrics["clients/loss"], float(losses.mean()), rtol=1e-6)
    assert np.isclose(metrics["clients/acc_mean"], np.mean(accuracies))
    assert np.isclose(metrics["clients/acc_std"], np.std(accuracies))
    per_client = metrics["clients/acc_per_client"]
    assert per_client.shape == (len(SIZES),)
    assert (~per_client.isnan()).nonzero().flatten().tolist() == sample.tolist()  # the others are not scored
    np.testing.assert_allclose(per_client[sample].numpy(), accuracies, rtol=1e-6)


def test_a_sample_is_drawn_from_the_seed_and_the_round_and_the_last_round_scores_every_client(tmp_path):
    first, again, other = (make_trainer(tmp_path / name, seed=seed) for name, seed in [("a", 5), ("b", 5), ("c", 6)])
    for trainer in (first, again, other):
        trainer.fit(make_model(), make_data(), FedAvg())
    assert [clients_columns(r) for r in rows(first)] == [clients_columns(r) for r in rows(again)]
    for run in (first, other):
        assert [float(r["clients/evaluated"]) for r in rows(run)] == [3, 3, 3, 11]  # the last round: all with data
    scorable = np.array([k for k in range(len(SIZES)) if k != 4])
    samples = {}
    for trainer in (first, other):
        samples[trainer.run.seed] = [
            trainer.run.pieces.evaluator.sample(r, trainer.run.rounds).tolist() for r in range(3)
        ]
        for round_idx, sample in enumerate(samples[trainer.run.seed]):  # the round's stream, uniform, no replacement
            drawn = RandomStreams(trainer.run.seed).evaluation_rng(round_idx).choice(scorable, size=3, replace=False)
            assert sample == sorted(drawn.tolist())
        assert trainer.run.pieces.evaluator.sample(3, trainer.run.rounds) is None  # the last round scores every client
    assert samples[5] != samples[6]


def test_a_resumed_run_scores_the_same_clients_with_the_same_numbers(tmp_path):
    whole = make_trainer(tmp_path / "whole", rounds=5, full_eval_every=2)
    whole.fit(make_model(), make_data(), FedAvg())
    killed = make_trainer(tmp_path / "killed", rounds=5, full_eval_every=2, checkpoint_every=1,
                          callbacks=[KillAfterRound(2)])  # fmt: skip
    with pytest.raises(Kill):
        killed.fit(make_model(), make_data(), FedAvg())
    resumed = make_trainer(tmp_path / "killed", rounds=5, full_eval_every=2)
    resumed.fit(make_model(seed=123), make_data(), FedAvg(), ckpt_path=killed.run_dir / "checkpoints" / "last.ckpt")
    assert [clients_columns(r) for r in rows(resumed)] == [clients_columns(r) for r in rows(whole)]
    assert [float(r["clients/evaluated"]) for r in rows(whole)] == [3, 11, 3, 11, 11]  # every 2nd round and the last


def test_all_is_todays_evaluation_and_a_fraction_of_one_scores_everyone(tmp_path):
    plain = make_trainer(tmp_path / "all", rounds=2, eval_clients="all")
    plain.fit(make_model(), make_data(), FedAvg())
    whole = make_trainer(tmp_path / "one", rounds=2, eval_clients=1.0)
    whole.fit(make_model(), make_data(), FedAvg())
    assert "clients/evaluated" not in rows(plain)[0]
    for a, b in zip(rows(plain), rows(whole), strict=True):
        assert {k: v for k, v in clients_columns(b).items() if k != "clients/evaluated"} == clients_columns(a)
        assert float(b["clients/evaluated"]) == 11


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"eval_clients": 0}, "--trainer.eval_clients ≥ 1"),
        ({"eval_clients": 1.5}, "fraction in (0, 1]"),
        ({"eval_clients": "some"}, "an integer, a fraction or 'all'"),
        ({"full_eval_every": -1}, "--trainer.full_eval_every ≥ 0"),
    ],
)
def test_bad_settings_name_the_flag(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        FederatedTrainer(default_root_dir=tmp_path, logger=None, **options)


def test_counts_round_fractions_up_and_never_exceed_the_clients():
    assert EvaluationSettings(eval_clients=0.3).count(11) == 4 and EvaluationSettings(eval_clients=0.01).count(11) == 1
    assert EvaluationSettings(eval_clients=50).count(11) == 11 and EvaluationSettings().count(11) == 11
    every_third = EvaluationSettings(eval_clients=5, full_eval_every=3)
    assert [every_third.sampled(r, 7) for r in range(7)] == [True, True, False, True, True, False, False]
    assert not any(EvaluationSettings(eval_clients="all").sampled(r, 7) for r in range(7))


def test_without_a_test_set_every_client_is_scored_and_the_run_says_so(tmp_path):
    from fedlight.data import Synthetic

    data = FederatedDataModule(Synthetic(num_clients=6, dim=12, seed=1), batch_size=10)
    torch.manual_seed(0)
    model = ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [8]})
    trainer = make_trainer(tmp_path, rounds=2, eval_clients=2)
    with pytest.warns(UserWarning, match="samples nothing: this dataset has no separate test set"):
        trainer.fit(model, data, FedAvg())
    assert [float(r["clients/evaluated"]) for r in rows(trainer)] == [6, 6]
