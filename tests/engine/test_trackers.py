"""Lightning loggers as trackers (``fedlight.engine.trackers``): TensorBoard and MLflow end to end, the round as the
step, the configuration as hyper-parameters, a resumed run continuing the same tracker run."""

import csv
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine import trackers
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedAvg

REPO = Path(__file__).resolve().parents[2]


def _fit(root: Path, logger, rounds: int, ckpt_path=None) -> FederatedTrainer:
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=2, local_epochs=1, default_root_dir=root, logger=["csv", logger],
        enable_progress_bar=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [8]})
    data = FederatedDataModule(Synthetic(num_clients=4, dim=12, seed=1), batch_size=10)
    config = {"trainer": {"rounds": rounds}, "seed_everything": 0}
    trainer.fit(model, data, FedAvg(), ckpt_path=ckpt_path, config=config)
    return trainer


def _csv_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv") as f:
        return {int(row["round"]): float(row["train/loss"]) for row in csv.DictReader(f)}


def test_tensorboard_gets_every_round_as_its_step_and_a_resume_continues_its_folder(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is the optional extra fedlight[tensorboard]")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    first = _fit(tmp_path / "runs", TensorBoardLogger(save_dir=tmp_path / "tb"), rounds=1)
    last = first.run_dir / "checkpoints" / "last.ckpt"
    resumed = _fit(tmp_path / "runs", TensorBoardLogger(save_dir=tmp_path / "tb"), rounds=3, ckpt_path=last)
    assert resumed.run_dir == first.run_dir

    # the events are named after the fedlight run ("fedlight", the trainer's default name), not lightning_logs
    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["fedlight"]
    folders = sorted(p.name for p in (tmp_path / "tb" / "fedlight").iterdir())
    assert folders == ["version_0"]  # the resumed run wrote into the first run's folder, not version_1
    events = EventAccumulator(str(tmp_path / "tb" / "fedlight" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    logged = {event.step: event.value for event in events.Scalars("train/loss")}
    expected = _csv_losses(first.run_dir)
    assert sorted(logged) == [1, 2, 3] == sorted(expected)
    assert logged == pytest.approx(expected, rel=1e-6)

    # hyper-parameters once, from the run that created the folder (trainer.rounds was 1 then)
    starts = [
        plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
        for tag, content in events.PluginTagToContent("hparams").items()
        if tag.endswith("session_start_info")
    ]
    assert len(starts) == 1
    assert starts[0].hparams["trainer.rounds"].number_value == 1
    assert starts[0].hparams["seed_everything"].number_value == 0


def test_a_tensorboard_version_given_in_the_config_is_kept_on_resume(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is the optional extra fedlight[tensorboard]")
    from lightning.pytorch.loggers import TensorBoardLogger

    first = _fit(tmp_path / "runs", TensorBoardLogger(save_dir=tmp_path / "tb", version="a"), rounds=1)
    last = first.run_dir / "checkpoints" / "last.ckpt"
    _fit(tmp_path / "runs", TensorBoardLogger(save_dir=tmp_path / "tb", version="b"), rounds=2, ckpt_path=last)
    assert sorted(p.name for p in (tmp_path / "tb" / "fedlight").iterdir()) == ["a", "b"]


def test_a_tensorboard_name_given_in_the_config_is_kept(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is the optional extra fedlight[tensorboard]")
    from lightning.pytorch.loggers import TensorBoardLogger

    _fit(tmp_path / "runs", TensorBoardLogger(save_dir=tmp_path / "tb", name="mine"), rounds=1)
    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["mine"]


def test_mlflow_file_store_gets_every_round_as_its_step_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="MLflow is the optional extra fedlight[mlflow]")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    first = _fit(tmp_path / "runs", MLFlowLogger(experiment_name="fl", tracking_uri=uri), rounds=1)
    last = first.run_dir / "checkpoints" / "last.ckpt"
    _fit(tmp_path / "runs", MLFlowLogger(experiment_name="fl", tracking_uri=uri), rounds=3, ckpt_path=last)

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("fl")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the resume continued the run instead of starting a second one
    run = runs[0]
    assert run.info.run_name == first.run.name  # named after the fedlight run
    assert run.data.params["trainer.rounds"] == "1"  # logged when the run was created
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    expected = _csv_losses(first.run_dir)
    assert sorted(history) == [1, 2, 3]
    assert history == pytest.approx(expected, rel=1e-6)


def test_a_missing_mlflow_is_one_message_naming_the_extra(tmp_path, monkeypatch, capsys):
    from fedlight.cli import main

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as an environment without mlflow looks to importlib
    config = tmp_path / "mlflow.yaml"
    config.write_text(
        yaml.safe_dump({"trainer": {"logger": ["csv", {"class_path": "lightning.pytorch.loggers.MLFlowLogger"}]}})
    )
    root = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["fit", "--config", str(REPO / "conf/digits/fedavg.yaml"), "--config", str(config),
             f"--trainer.default_root_dir={root}"]
        )  # fmt: skip
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("fedlight: error: --trainer.logger lightning.pytorch.loggers.MLFlowLogger needs")
    assert "pip install 'fedlight[mlflow]'" in message and len(message.splitlines()) == 1
    assert not root.exists()


def test_the_command_line_takes_names_and_class_paths_in_one_list(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is the optional extra fedlight[tensorboard]")
    from lightning.pytorch.loggers import TensorBoardLogger

    from fedlight.cli import build_parser

    config = tmp_path / "loggers.yaml"
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(tmp_path)}}
    config.write_text(yaml.safe_dump({"trainer": {"logger": ["csv", logger]}}))
    parser = build_parser()
    cfg = parser.parse_args(["fit", "--config", str(REPO / "conf/digits/fedavg.yaml"), "--config", str(config)])
    trainer = parser.instantiate(cfg).fit.trainer
    names = [logger for logger in trainer.run.settings.logging.loggers if isinstance(logger, str)]
    built = [logger for logger in trainer.run.settings.logging.loggers if not isinstance(logger, str)]
    assert names == ["csv"]
    assert len(built) == 1 and isinstance(built[0], TensorBoardLogger) and built[0].save_dir == str(tmp_path)


def test_hyperparameters_are_the_flattened_configuration():
    flat = trackers.hyperparameters({"a": {"b": 1, "c": None, "d": [1, 2], "e": {}}, "f": "x"})
    assert flat == {"a.b": 1, "a.c": "null", "a.d": "[1, 2]", "a.e": "{}", "f": "x"}


def test_a_recorded_run_of_another_kind_of_logger_is_not_continued(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is the optional extra fedlight[tensorboard]")
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(save_dir=tmp_path)
    assert not trackers.continue_run(logger, {"class": "MLFlowLogger", "run": "abc"})
    assert trackers.continue_run(logger, {"class": "TensorBoardLogger", "run": 4})
    assert logger.version == 4


def test_a_tracker_folder_below_a_regular_file_is_refused_before_the_first_round(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    from fedlight.errors import ConfigError

    (tmp_path / "file").write_text("not a folder")
    logger = TensorBoardLogger(save_dir=str(tmp_path / "file" / "tb"))
    with pytest.raises(ConfigError, match=r"TensorBoardLogger's save_dir=.*file/tb: .*file is a file, not a folder"):
        _fit(tmp_path / "runs", logger, rounds=1)
    assert not (tmp_path / "runs").exists(), "refused at set-up, before the run folder and the first round"
