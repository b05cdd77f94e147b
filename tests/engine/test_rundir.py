"""The run folder: concurrent starts, one writer per folder, resumes that never rewind a run by mistake."""

import csv
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedlight import checkpoint as ckpt_io
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.rundir import LOCK_NAME, RunLock, new_version_dir
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg
from fedlight.testing import Kill, KillAfterRound

REPO = Path(__file__).resolve().parents[2]


def make_trainer(root, rounds, **kwargs):
    settings = {"clients_per_round": 3, "local_epochs": 1, "checkpoint_every": 2, "logger": "csv", **kwargs}
    return FederatedTrainer(rounds=rounds, enable_progress_bar=False, default_root_dir=root, name="run", **settings)


def make_model():
    torch.manual_seed(0)
    return ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [8]})


def make_data():
    return FederatedDataModule(Synthetic(num_clients=6, dim=12, seed=1), batch_size=10)


def metric_rounds(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return [row["round"] for row in csv.DictReader(f)]


def _claim(parent, barrier, queue):
    barrier.wait()
    try:
        queue.put(new_version_dir(parent).name)
    except Exception as err:  # reported to the test, which expects none
        queue.put(repr(err))


def test_simultaneous_starts_each_get_their_own_version(tmp_path):
    context = multiprocessing.get_context("fork")
    count = 24
    barrier, queue = context.Barrier(count), context.Queue()
    workers = [context.Process(target=_claim, args=(tmp_path / "run", barrier, queue)) for _ in range(count)]
    for worker in workers:
        worker.start()
    names = [queue.get(timeout=30) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    assert sorted(names) == sorted(f"version_{n}" for n in range(count))


def _hold_lock(run_dir):
    """A second process that locks ``run_dir`` and waits; returns it once the lock is held."""
    code = (
        "import sys, time; from pathlib import Path; from fedlight.engine.rundir import RunLock; "
        "RunLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(60)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_locked_folder_is_refused_and_a_dead_owners_lock_is_taken_over(tmp_path):
    holder = _hold_lock(tmp_path)
    try:
        with pytest.raises(ConfigError, match=rf"in use by process {holder.pid} on "):
            RunLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # as an out-of-memory killer would: no chance to clean up
        holder.wait(timeout=10)
    assert (tmp_path / LOCK_NAME).exists()  # left behind by the dead process
    lock = RunLock(tmp_path)
    lock.acquire()
    assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_NAME).read_text()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_second_resume_of_a_running_folder_is_refused_and_changes_nothing(tmp_path):
    first = make_trainer(tmp_path, rounds=2)
    first.fit(make_model(), make_data(), FedAvg())
    checkpoint = first.run_dir / "checkpoints" / "last.ckpt"
    before = (first.run_dir / "metrics.csv").read_text(), checkpoint.read_bytes()
    holder = _hold_lock(first.run_dir)  # a first resume, still running
    try:
        with pytest.raises(ConfigError, match=rf"{first.run_dir} is in use by process {holder.pid}"):
            make_trainer(tmp_path, rounds=4).fit(make_model(), make_data(), FedAvg(), ckpt_path=checkpoint)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert ((first.run_dir / "metrics.csv").read_text(), checkpoint.read_bytes()) == before


def test_resuming_an_older_copy_never_rewinds_the_run_unless_asked(tmp_path):
    run = make_trainer(tmp_path, rounds=4)
    run.fit(make_model(), make_data(), FedAvg())
    backup = run.run_dir / "backup" / "last.ckpt"
    backup.parent.mkdir()
    shutil.copy(run.run_dir / "checkpoints" / "last.ckpt", backup)  # round 4
    make_trainer(tmp_path, rounds=6).fit(
        make_model(), make_data(), FedAvg(), ckpt_path=run.run_dir / "checkpoints" / "last.ckpt"
    )
    assert ckpt_io.load(run.run_dir / "checkpoints" / "last.ckpt")["round"] == 6

    with pytest.raises(ConfigError) as err:
        make_trainer(tmp_path, rounds=6).fit(make_model(), make_data(), FedAvg(), ckpt_path=backup)
    assert f"its run folder {run.run_dir} has already reached round 6" in str(err.value)
    assert "--trainer.rewind=true" in str(err.value)
    assert ckpt_io.load(run.run_dir / "checkpoints" / "last.ckpt")["round"] == 6
    assert metric_rounds(run.run_dir) == [str(r) for r in range(1, 7)]

    rewound = make_trainer(tmp_path, rounds=5, rewind=True)
    rewound.fit(make_model(), make_data(), FedAvg(), ckpt_path=backup)
    assert rewound.run_dir == run.run_dir  # the run the checkpoint belongs to, not the backup's parent
    assert not (run.run_dir / "backup" / "metrics.csv").exists()
    assert metric_rounds(run.run_dir) == [str(r) for r in range(1, 6)]


def test_a_moved_run_folder_resumes_where_it_now_is_and_a_loose_copy_in_a_new_one(tmp_path):
    run = make_trainer(tmp_path / "old", rounds=2)
    run.fit(make_model(), make_data(), FedAvg())
    moved = tmp_path / "moved"
    shutil.move(run.run_dir, moved)
    resumed = make_trainer(tmp_path / "old", rounds=3)
    resumed.fit(make_model(), make_data(), FedAvg(), ckpt_path=moved / "checkpoints" / "last.ckpt")
    assert resumed.run_dir == moved.resolve() and metric_rounds(moved) == ["1", "2", "3"]

    loose = tmp_path / "loose.ckpt"
    shutil.copy(moved / "checkpoints" / "previous.ckpt", loose)  # round 2
    shutil.rmtree(moved)
    again = make_trainer(tmp_path / "new", rounds=3)
    again.fit(make_model(), make_data(), FedAvg(), ckpt_path=loose)
    assert again.run_dir == tmp_path / "new" / "run" / "version_0" and metric_rounds(again.run_dir)[-1] == "3"


def test_leftovers_of_a_killed_write_are_removed_on_resume(tmp_path):
    run = make_trainer(tmp_path, rounds=2)
    run.fit(make_model(), make_data(), FedAvg())
    leftovers = [run.run_dir / "checkpoints" / ".last.ckpt.4242.abcd.tmp", run.run_dir / "metrics.csv.tmp"]
    for path in leftovers:
        path.write_bytes(b"half a file")
    make_trainer(tmp_path, rounds=3).fit(
        make_model(), make_data(), FedAvg(), ckpt_path=run.run_dir / "checkpoints" / "last.ckpt"
    )
    assert not any(path.exists() for path in leftovers)
    assert sorted(p.name for p in (run.run_dir / "checkpoints").iterdir()) == ["last.ckpt", "previous.ckpt"]


@pytest.mark.parametrize(
    ("root", "name", "message"),
    [
        ("file", "run", "is a file, not a folder"),
        (".", "../../outside", "--trainer.name='../../outside' leads outside --trainer.default_root_dir"),
        (".", "/abs", "--trainer.name='/abs' leads outside"),
    ],
)
def test_a_root_or_name_that_cannot_hold_runs_is_refused_before_anything_is_written(tmp_path, root, name, message):
    (tmp_path / "file").write_text("not a folder")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=message):
        FederatedTrainer(default_root_dir=tmp_path / root / "runs", name=name)
    assert sorted(tmp_path.rglob("*")) == before


def test_an_unwritable_root_is_one_message(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for a read-only folder (root ignores modes)
    with pytest.raises(ConfigError, match=rf"--trainer.default_root_dir={tmp_path}/runs: {tmp_path} is not writable"):
        FederatedTrainer(default_root_dir=tmp_path / "runs")


def test_the_lock_is_released_when_the_run_ends_or_fails(tmp_path):
    run = make_trainer(tmp_path, rounds=1)
    run.fit(make_model(), make_data(), FedAvg())
    assert not (run.run_dir / LOCK_NAME).exists()
    failing = make_trainer(tmp_path, rounds=3, callbacks=[KillAfterRound(1)])
    with pytest.raises(Kill):
        failing.fit(make_model(), make_data(), FedAvg(), ckpt_path=run.run_dir / "checkpoints" / "last.ckpt")
    assert not (run.run_dir / LOCK_NAME).exists()
    RunLock(run.run_dir).acquire()  # free
