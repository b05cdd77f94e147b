"""Ctrl-C and SIGTERM: the run stops once the client in training finishes, drops the unfinished round, writes the
checkpoint of the state that round started from and prints the resume command."""

import csv
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from processes import communicate_within

from fedlight import checkpoint as ckpt_io
from fedlight.callbacks import RoundCallback
from fedlight.cli import main
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import RunInterrupted
from fedlight.strategies import FedAvg
from fedlight.testing import SignalAtRound

REPO = Path(__file__).resolve().parents[2]
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
def test_a_signal_drops_the_round_and_checkpoints_its_start_which_resumes_exactly(tmp_path, name):
    reference = make_trainer(tmp_path / "reference")
    reference.fit(make_model(), make_data(), FedAvg())

    stopped = make_trainer(tmp_path / "stopped", callbacks=[SignalAtRound(1, name)])
    # Python's default, or SIG_IGN where the shell started the tests in the background
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunInterrupted) as err:
        stopped.fit(make_model(), make_data(), FedAvg())
    checkpoint = stopped.run_dir / "checkpoints" / "last.ckpt"
    stop = err.value
    # the signal came as round 1 started: no client of it trained, and the checkpoint holds round 1's start
    assert (stop.signal_name, stop.checkpoint, stop.round, stop.saved, stop.dropped) == (
        name,
        checkpoint,
        1,
        True,
        True,
    )
    assert ckpt_io.load(checkpoint)["round"] == 1  # although checkpoint_every is 10
    assert stopped.run.round == 1 and len(stopped.history) == 1
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # put back

    resumed = make_trainer(tmp_path / "stopped")
    resumed.fit(make_model(), make_data(), FedAvg(), ckpt_path=checkpoint)
    assert read_metrics(resumed.run_dir) == read_metrics(reference.run_dir)
    assert torch.equal(resumed.global_state, reference.global_state)


class SignalTwice(RoundCallback):
    """Ctrl-C twice when round 2 starts: the user does not want to wait."""

    def on_round_start(self, context, round_idx):
        if round_idx == 2:
            os.kill(os.getpid(), signal.SIGINT)
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
    assert f"stopped by SIGTERM during round 2, whose unfinished work is dropped; the checkpoint {checkpoint}" in err
    command = err.split("Resume with:\n")[1].strip()
    assert command == shlex.join(["fedlight", *args, "--ckpt_path", str(checkpoint)])

    resume = shlex.split(command)[1:]
    at = resume.index(str(extra))
    main(resume[: at - 1] + resume[at + 1 :])  # without the signal, which would come again in round 1
    assert ckpt_io.load(checkpoint)["round"] == 3
    assert [row["round"] for row in read_metrics(checkpoint.parent.parent)] == ["1", "2", "3"]


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
    message = (tmp_path / "stderr.txt").read_text()  # between clients, or after the clients of a round
    assert f"stopped by SIGTERM during round {saved['round'] + 1}" in message or (
        f"stopped by SIGTERM after round {saved['round']};" in message
    )


def test_forked_ranks_stop_together_and_the_stop_reaches_the_launching_process(tmp_path):
    trainer = FederatedTrainer(
        rounds=4, clients_per_round=3, local_epochs=1, checkpoint_every=10, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path, callbacks=[SignalAtRound(1, "SIGTERM")], devices=2, start_method="fork",
    )  # fmt: skip
    with pytest.raises(RunInterrupted) as err:
        trainer.fit(make_model(), make_data(), FedAvg())
    assert (err.value.signal_name, err.value.round, err.value.exit_code) == ("SIGTERM", 1, 143)
    assert trainer.run.round == 1 and ckpt_io.load(trainer.run_dir / "checkpoints" / "last.ckpt")["round"] == 1


SLOW_STRATEGY = '''
import os, time
from fedlight.strategies import FedAvg


class SlowFedAvg(FedAvg):
    """FedAvg whose clients log "<round> <client>" to $SLOW_LOG as they start, then take $SLOW_PAUSE seconds."""

    def on_client_fit_start(self, context, module, plan):
        super().on_client_fit_start(context, module, plan)
        log = os.environ.get("SLOW_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{module.local_fit.round_idx} {plan.client}\\n")
            time.sleep(float(os.environ.get("SLOW_PAUSE", "0")))
'''


def test_sigint_while_slow_clients_train_stops_after_the_client_and_resumes_bit_exact(tmp_path):
    (tmp_path / "slow_strategy.py").write_text(SLOW_STRATEGY)
    log = tmp_path / "clients.log"
    common = [*QUICK, "--trainer.rounds=3", "--trainer.logger=csv", "--trainer.checkpoint_every=10",
              "--strategy=slow_strategy.SlowFedAvg"]  # fmt: skip
    args = ["fit", "--config", SYNTHETIC, *common, f"--trainer.default_root_dir={tmp_path}", "--trainer.name=stopped"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}", "OMP_NUM_THREADS": "1",
           "SLOW_LOG": str(log), "SLOW_PAUSE": "2"}  # fmt: skip
    run = subprocess.Popen([sys.executable, "-m", "fedlight", *args], cwd=tmp_path, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (log.exists() and "\n1 " in "\n" + log.read_text()):
            time.sleep(0.05)
        os.kill(run.pid, signal.SIGINT)  # while round 1's first client trains
        _, err = communicate_within(run, cpu_budget=240)
    finally:
        run.kill()
    err = err.decode()
    assert run.returncode == 128 + signal.SIGINT, err[-3000:]
    started = [line.split() for line in log.read_text().splitlines()]
    assert [r for r, _ in started].count("1") == 1  # the other two clients of round 1 never started
    checkpoint = tmp_path / "stopped" / "version_0" / "checkpoints" / "last.ckpt"
    assert ckpt_io.load(checkpoint)["round"] == 1  # round 0 only: written although checkpoint_every is 10
    assert "SIGINT received: stopping once the client in training finishes" in err
    assert f"stopped by SIGINT during round 2, whose unfinished work is dropped; the checkpoint {checkpoint}" in err
    command = err.split("Resume with:\n")[1].strip()

    os.environ.pop("SLOW_LOG", None)
    sys.path.insert(0, str(tmp_path))
    try:
        main(shlex.split(command)[1:])
        reference = ["fit", "--config", SYNTHETIC, *common, f"--trainer.default_root_dir={tmp_path}"]
        main([*reference, "--trainer.name=reference"])
    finally:
        sys.path.remove(str(tmp_path))
    resumed = ckpt_io.load(checkpoint)
    uninterrupted = ckpt_io.load(tmp_path / "reference" / "version_0" / "checkpoints" / "last.ckpt")
    assert resumed["round"] == uninterrupted["round"] == 3
    for key, value in uninterrupted["global_state"].items():
        assert torch.equal(resumed["global_state"][key], value), key
    assert read_metrics(checkpoint.parent.parent) == read_metrics(tmp_path / "reference" / "version_0")


class SignalOneRank(RoundCallback):
    """SIGTERM to rank 1 alone as round 1 starts, as a scheduler that signals one process would."""

    def on_round_start(self, context, round_idx):
        if round_idx == 1 and torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_to_one_of_two_processes_drops_the_round_on_both_and_resumes_exactly(tmp_path):
    def trainer(root, callbacks=None):
        return FederatedTrainer(
            rounds=3, clients_per_round=4, local_epochs=1, checkpoint_every=10, logger="csv",
            enable_progress_bar=False, default_root_dir=root, callbacks=callbacks, devices=2, start_method="fork",
        )  # fmt: skip

    reference = trainer(tmp_path / "reference")
    reference.fit(make_model(), make_data(), FedAvg())
    stopped = trainer(tmp_path / "stopped", callbacks=[SignalOneRank()])
    with pytest.raises(RunInterrupted) as err:
        stopped.fit(make_model(), make_data(), FedAvg())
    assert (err.value.round, err.value.dropped) == (1, True)
    checkpoint = stopped.run_dir / "checkpoints" / "last.ckpt"
    assert ckpt_io.load(checkpoint)["round"] == 1
    resumed = trainer(tmp_path / "stopped")
    resumed.fit(make_model(), make_data(), FedAvg(), ckpt_path=checkpoint)
    assert torch.equal(resumed.global_state, reference.global_state)
    assert read_metrics(resumed.run_dir) == read_metrics(reference.run_dir)
