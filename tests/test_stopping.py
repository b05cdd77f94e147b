"""Ctrl-C and SIGTERM: the round in progress ends, a checkpoint is written and the resume command printed."""

import csv
import multiprocessing
import os
import shlex
import signal
import time
from pathlib import Path

import pytest
import torch

from fedlight import checkpoint as ckpt_io
from fedlight.callbacks import RoundCallback
from fedlight.cli import main
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.errors import RunInterrupted
from fedlight.strategies import FedAvg
from fedlight.testing import SignalAtRound
from fedlight.trainer import FederatedTrainer

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = str(REPO / "conf/fedproto/synthetic/fedavg_delta0.yaml")
QUICK = ["--trainer.local_epochs=1", "--trainer.clients_per_round=3", "--trainer.enable_progress_bar=false"]


def make_trainer(root, rounds=4, callbacks=None):
    return FederatedTrainer(
        rounds=rounds, clients_per_round=3, local_epochs=1, checkpoint_every=10, logger="csv",
        enable_progress_bar=False, default_root_dir=root, callbacks=callbacks,
    )  # fmt: skip


def make_model():
    torch.manual_seed(0)
    return ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [8]})


def make_data():
    return FederatedDataModule(Synthetic(num_clients=6, dim=12, seed=1), batch_size=10)


def read_metrics(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return [{k: v for k, v in row.items() if k != "round/time_s"} for row in csv.DictReader(f)]


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_round_with_a_checkpoint_that_resumes_exactly(tmp_path, name):
    reference = make_trainer(tmp_path / "reference")
    reference.fit(make_model(), make_data(), FedAvg())

    stopped = make_trainer(tmp_path / "stopped", callbacks=[SignalAtRound(1, name)])
    with pytest.raises(RunInterrupted) as err:
        stopped.fit(make_model(), make_data(), FedAvg())
    checkpoint = stopped.run_dir / "checkpoints" / "last.ckpt"
    stop = err.value
    assert (stop.signal_name, stop.checkpoint, stop.round, stop.saved) == (name, checkpoint, 2, True)
    assert ckpt_io.load(checkpoint)["round"] == 2  # although checkpoint_every is 10
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are put back

    resumed = make_trainer(tmp_path / "stopped")
    resumed.fit(make_model(), make_data(), FedAvg(), ckpt_path=checkpoint)
    assert read_metrics(resumed.run_dir) == read_metrics(reference.run_dir)
    assert torch.equal(resumed.global_state, reference.global_state)


class SignalTwice(RoundCallback):
    """Ctrl-C when round 2 starts, and again before it ends: the user does not want to wait."""

    def on_round_start(self, context, round_idx):
        if round_idx == 2:
            os.kill(os.getpid(), signal.SIGINT)

    def on_round_end(self, context, round_idx, metrics):
        if round_idx == 2:
            os.kill(os.getpid(), signal.SIGINT)


def test_a_second_signal_stops_at_once_and_names_the_last_checkpoint(tmp_path):
    trainer = FederatedTrainer(
        rounds=5, clients_per_round=3, local_epochs=1, checkpoint_every=1, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path, callbacks=[SignalTwice()],
    )  # fmt: skip
    with pytest.raises(RunInterrupted) as err:
        trainer.fit(make_model(), make_data(), FedAvg())
    checkpoint = trainer.run_dir / "checkpoints" / "last.ckpt"
    assert (err.value.checkpoint, err.value.round, err.value.saved) == (checkpoint, 2, False)
    assert ckpt_io.load(checkpoint)["round"] == 2


def test_the_command_prints_the_exact_resume_command_and_it_resumes(tmp_path, capsys):
    extra = tmp_path / "term_at_round_1.yaml"
    extra.write_text(
        "trainer:\n  callbacks:\n    - class_path: fedlight.testing.SignalAtRound\n"
        "      init_args: {round_idx: 1, signal_name: SIGTERM}\n"
    )
    common = [*QUICK, "--trainer.rounds=3", "--trainer.logger=csv"]
    args = ["fit", "--config", SYNTHETIC, "--config", str(extra), *common, f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    checkpoint = tmp_path / "fedavg_delta0" / "version_0" / "checkpoints" / "last.ckpt"  # named by the first file
    assert f"stopped by SIGTERM after round 2; the checkpoint {checkpoint} holds it" in err
    command = err.split("Resume with:\n")[1].strip()
    assert command == shlex.join(["fedlight", *args, "--ckpt_path", str(checkpoint)])

    main(shlex.split(command)[1:])
    assert ckpt_io.load(checkpoint)["round"] == 3
    assert [row["round"] for row in read_metrics(checkpoint.parent.parent)] == ["0.0", "1.0", "2.0"]


def _train_until_stopped(root, stderr_path):
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT)
    os.dup2(fd, 2)
    try:
        make_trainer(root, rounds=10_000).fit(make_model(), make_data(), FedAvg())
    except RunInterrupted as err:
        print(err, file=os.fdopen(2, "w"), flush=True)
        os._exit(err.exit_code)
    os._exit(0)


def test_sigterm_from_another_process_writes_a_checkpoint(tmp_path):
    context = multiprocessing.get_context("fork")
    worker = context.Process(target=_train_until_stopped, args=(tmp_path, tmp_path / "stderr.txt"))
    worker.start()
    metrics = tmp_path / "fedlight" / "version_0" / "metrics.csv"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    os.kill(worker.pid, signal.SIGTERM)
    worker.join(timeout=30)
    assert worker.exitcode == 128 + signal.SIGTERM
    saved = ckpt_io.load(metrics.parent / "checkpoints" / "last.ckpt")
    assert saved["round"] >= 2 and saved["round"] == len(saved["history"])
    assert "stopped by SIGTERM after round" in (tmp_path / "stderr.txt").read_text()


def test_forked_ranks_stop_together_and_the_stop_reaches_the_launching_process(tmp_path):
    trainer = FederatedTrainer(
        rounds=4, clients_per_round=3, local_epochs=1, checkpoint_every=10, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path, callbacks=[SignalAtRound(1, "SIGTERM")], devices=2, start_method="fork",
    )  # fmt: skip
    with pytest.raises(RunInterrupted) as err:
        trainer.fit(make_model(), make_data(), FedAvg())
    assert (err.value.signal_name, err.value.round, err.value.exit_code) == ("SIGTERM", 2, 143)
    assert trainer.round == 2 and ckpt_io.load(trainer.run_dir / "checkpoints" / "last.ckpt")["round"] == 2
