"""Callbacks and strategies that cannot run say so at set-up; a callback that fails mid-run loses no round."""

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fedlight import checkpoint as ckpt_io
from fedlight.callbacks import AggregateMeanMargin, EntropyMaps, FeatureTSNE, PartitionSummary
from fedlight.callbacks.base import CallbackFailed, RoundCallback
from fedlight.cli import main
from fedlight.clients.base import FederatedClient
from fedlight.clients.classification import ClassificationClient
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.metrics.classification import GroupedClassification
from fedlight.strategies import MOON, FedCCMOON, FedProto, RobustAggregation
from tests.callbacks.small_run import make_data, make_trainer

REPO = Path(__file__).resolve().parents[2]
DIGITS = str(REPO / "conf/digits/fedavg.yaml")
QUICK = [
    "--trainer.local_epochs=1",
    "--trainer.clients_per_round=3",
    "--trainer.enable_progress_bar=false",
    "--trainer.logger=csv",
]


def test_entropy_maps_on_a_classification_run_is_refused_before_the_run_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                DIGITS,
                "--trainer.callbacks+=fedlight.callbacks.EntropyMaps",
                f"--trainer.default_root_dir={tmp_path}",
                "--trainer.rounds=2",
                *QUICK,
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fedlight.callbacks.EntropyMaps draws per-pixel entropy maps of a segmentation model" in err
    assert "--model is ClassificationClient" in err and "remove EntropyMaps from --trainer.callbacks" in err
    assert "Traceback" not in err
    assert not list(tmp_path.rglob("version_*"))  # no run folder, no round trained


class PlainClient(FederatedClient):
    """A client whose network has no forward_features: fine for FedAvg, not for feature-based rules."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(12, 10)

    def training_step(self, batch, batch_idx):
        return {"loss": nn.functional.cross_entropy(self.net(batch[0]), batch[1])}

    def validation_step(self, batch, batch_idx):
        x, y, group = batch
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, y, reduction="none"), "preds": logits.argmax(1),
                "target": y, "group": group}  # fmt: skip

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def evaluation_metric(self, num_groups):
        return GroupedClassification(num_groups)


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (FedProto(), "--strategy FedProto computes class prototypes from the penultimate features"),
        (MOON(), "MOON runs copies of the client's network"),
        (RobustAggregation(FedProto()), "--strategy FedProto computes class prototypes"),  # a wrapper asks its rule
        (FedCCMOON(), "--strategy FedCCMOON contrasts the submodule --strategy.init_args.branch='head.nonlinear'"),
    ],
)
def test_a_rule_that_needs_features_is_refused_at_set_up(tmp_path, strategy, message):
    with pytest.raises(ConfigError, match=message) as err:
        make_trainer(tmp_path).fit(PlainClient(), make_data(10), strategy)
    assert "PlainClient" in str(err.value)
    assert not list(tmp_path.rglob("version_*"))


def test_every_callback_problem_is_reported_together(tmp_path):
    callbacks = [AggregateMeanMargin(), FeatureTSNE(), EntropyMaps()]
    with pytest.raises(ConfigError) as err:
        make_trainer(tmp_path, callbacks=callbacks).fit(PlainClient(), make_data(10), FedProto())
    problems = err.value.problems
    assert len(problems) == 4  # the rule's, then one per callback
    for name, problem in zip(["FedProto", "AggregateMeanMargin", "FeatureTSNE", "EntropyMaps"], problems, strict=True):
        assert name in problem
    assert not list(tmp_path.rglob("version_*"))


def test_callbacks_that_can_run_pass_the_check():
    model = ClassificationClient(num_classes=10, input_shape=(12,), model="mlp")
    data = make_data(10)
    for callback in (AggregateMeanMargin(), FeatureTSNE(), PartitionSummary()):
        assert callback.check(model, data) == []
    assert FedProto().check(model, data) == [] and MOON().check(model, data) == []


def test_missing_matplotlib_is_a_set_up_error_naming_the_plots_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` then raises ImportError
    model = ClassificationClient(num_classes=10, input_shape=(12,), model="mlp")
    with pytest.raises(ConfigError) as err:
        make_trainer(tmp_path, callbacks=[FeatureTSNE(), PartitionSummary()]).fit(model, make_data(10), FedProto())
    assert [p.split(" draws")[0] for p in err.value.problems] == [
        "fedlight.callbacks.FeatureTSNE",
        "fedlight.callbacks.PartitionSummary",
    ]
    assert all('pip install -e ".[plots]"' in p for p in err.value.problems)
    assert not list(tmp_path.rglob("version_*"))


class FailsInRound(RoundCallback):
    def __init__(self, round_idx: int = 1, error: type[Exception] = RuntimeError) -> None:
        self.round_idx, self.error = round_idx, error

    def on_round_end(self, context, round_idx, metrics):
        metrics["analysis/seen"] = float(round_idx)
        if round_idx == self.round_idx:
            raise self.error("the analysis broke")


def test_a_callback_failing_in_round_two_leaves_that_round_checkpointed(tmp_path):
    trainer = FederatedTrainer(
        rounds=4, clients_per_round=3, local_epochs=1, checkpoint_every=10, default_root_dir=tmp_path,
        logger="csv", enable_progress_bar=False, callbacks=[FailsInRound(round_idx=1)],
    )  # fmt: skip
    model = ClassificationClient(num_classes=10, input_shape=(12,), model="mlp")
    with pytest.raises(CallbackFailed) as err:
        trainer.fit(model, make_data(10), FedProto())
    last = trainer.run_dir / "checkpoints" / ckpt_io.LAST
    state = ckpt_io.load(last)
    assert state["round"] == 2  # checkpoint_every=10 would have saved nothing before round 4
    assert [row["round"] for row in state["history"]] == [1.0, 2.0]  # the failed round is logged, too
    message = str(err.value)
    assert message.startswith("FailsInRound.on_round_end failed with RuntimeError: the analysis broke")
    assert f"--ckpt_path {last.absolute()}" in message and "2 round(s)" in message
    assert isinstance(err.value.__cause__, RuntimeError)
    rows = (trainer.run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3  # header and both rounds


def test_a_resume_after_the_failure_continues_from_the_saved_round(tmp_path, monkeypatch, capsys):
    """Through the command line: the callback (by import path) fails in round 2, the message says how to go on."""
    (tmp_path / "brittle.py").write_text(
        "from fedlight.callbacks import RoundCallback\n\n\n"
        "class Brittle(RoundCallback):\n"
        "    def on_round_end(self, context, round_idx, metrics):\n"
        "        if round_idx == 1:\n"
        "            raise ValueError('no pixels here')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["fit", "--config", DIGITS, "--trainer.rounds=3", "--trainer.default_root_dir=runs", *QUICK]
    with pytest.raises(CallbackFailed) as err:
        main([*args, "--trainer.callbacks+=brittle.Brittle"])
    last = (tmp_path / "runs/fedavg/version_0/checkpoints/last.ckpt").absolute()
    assert str(err.value).startswith("Brittle.on_round_end failed with ValueError: no pixels here")
    assert f"resume with --ckpt_path {last}" in str(err.value)
    assert ckpt_io.saved_round(last) == 2
    main([*args, f"--ckpt_path={last}"])  # without the callback
    assert ckpt_io.saved_round(last) == 3
    assert os.path.samefile(last.parent.parent, tmp_path / "runs/fedavg/version_0")
