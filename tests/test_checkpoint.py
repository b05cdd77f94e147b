"""Staged runs: ``init_from`` seeds a run's W^0 from another run's weights."""

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlight import checkpoint as ckpt_io
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, NpzDataset, Synthetic
from fedlight.engine.loggers import RoundCSV
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg


def make_model(seed=0, hidden=16):
    torch.manual_seed(seed)
    return ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [hidden]})


def make_data(centralized=False):
    return FederatedDataModule(Synthetic(num_clients=6, dim=12, seed=1), batch_size=10, centralized=centralized)


def trainer(tmp_path, name, rounds=2, **kwargs):
    return FederatedTrainer(
        rounds=rounds, clients_per_round=1 if "centralized" in name else 3, local_epochs=1, logger="csv",
        enable_progress_bar=False, default_root_dir=tmp_path, name=name, **kwargs,
    )  # fmt: skip


class FirstState(FedAvg):
    """Keeps the state the first client of the run started from: W^0."""

    def __init__(self):
        super().__init__()
        self.first = None

    def initial_state(self, context, plan, state):
        if self.first is None:
            self.first = context.layout.to_state_dict(state, context.global_integers)
        return state


def test_a_federated_run_starts_from_a_centralized_runs_last_checkpoint(tmp_path):
    source = trainer(tmp_path, "centralized")
    source.fit(make_model(seed=0), make_data(centralized=True), FedAvg())
    pretrained = source.model.layout.to_state_dict(source.global_state, source.model.integers)

    strategy = FirstState()
    checkpoint = source.run_dir / "checkpoints" / "last.ckpt"
    trainer(tmp_path, "federated", rounds=1, init_from=checkpoint).fit(make_model(seed=1), make_data(), strategy)
    assert strategy.first.keys() == pretrained.keys()
    for name, value in pretrained.items():
        assert torch.equal(strategy.first[name], value), name
    assert not torch.equal(make_model(seed=1).net.head.weight, pretrained["net.head.weight"])  # not its own init


@pytest.mark.parametrize("layout", ["state_dict", "lightning"])
def test_init_from_takes_a_plain_or_lightning_state_dict(tmp_path, layout):
    weights = make_model(seed=3).state_dict()
    path = tmp_path / "weights.pt"
    torch.save(weights if layout == "state_dict" else {"state_dict": weights, "epoch": 3}, path)
    strategy = FirstState()
    trainer(tmp_path, "run", rounds=1, init_from=path).fit(make_model(seed=1), make_data(), strategy)
    for name, value in weights.items():
        assert torch.equal(strategy.first[name], value), name


def test_init_from_another_model_lists_the_keys(tmp_path):
    path = tmp_path / "other.pt"
    other = make_model(hidden=8).state_dict()
    other["net.extra"] = torch.zeros(1)
    del other["net.head.bias"]
    torch.save(other, path)
    with pytest.raises(ConfigError) as err:
        trainer(tmp_path, "run", init_from=path).fit(make_model(), make_data(), FedAvg())
    message = str(err.value)
    assert "keys missing: net.head.bias" in message
    assert "keys unexpected: net.extra" in message
    assert "net.encoder.1.weight (8, 12) in the file, (16, 12) in the model" in message


def test_a_missing_init_from_file_is_refused_before_anything_runs(tmp_path):
    stage = trainer(tmp_path, "stage", init_from=tmp_path / "nowhere.ckpt")  # a config may name a future file
    with pytest.raises(ConfigError, match=r"--trainer.init_from .*nowhere.ckpt does not exist"):
        stage.fit(make_model(), make_data(), FedAvg())
    assert not (tmp_path / "stage").exists()  # refused before a run folder was made


def test_read_weights_refuses_a_file_without_tensors(tmp_path):
    path = tmp_path / "numbers.pt"
    torch.save({"lr": 0.1}, path)
    with pytest.raises(ConfigError, match="holds no model weights"):
        ckpt_io.read_weights(path)


# -- integrity: checksums, the previous checkpoint, file modes, a full disk -------------------------------------
def four_rounds(tmp_path):
    run = trainer(tmp_path, "run", rounds=4, checkpoint_every=2)
    run.fit(make_model(), make_data(), FedAvg())
    return run, run.run_dir / "checkpoints"


def test_the_checkpoint_before_the_last_is_kept(tmp_path):
    _, folder = four_rounds(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "previous.ckpt"]
    assert (ckpt_io.load(folder / "last.ckpt")["round"], ckpt_io.load(folder / "previous.ckpt")["round"]) == (4, 2)


def test_flipped_bytes_are_refused_by_name_and_the_previous_checkpoint_resumes(tmp_path):
    run, folder = four_rounds(tmp_path)
    last = folder / "last.ckpt"
    data = bytearray(last.read_bytes())
    generator = torch.Generator().manual_seed(0)
    for position in torch.randint(len(data) // 4, 3 * len(data) // 4, (64,), generator=generator).tolist():
        data[position] ^= 0xFF
    last.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as err:
        ckpt_io.load(last)
    assert f"--ckpt_path {last} is " in str(err.value)
    assert f"Resume from the checkpoint before it: --ckpt_path {folder / 'previous.ckpt'}" in str(err.value)
    # the round-2 checkpoint continues the run: the damaged round-4 file is not counted as a later round
    resumed = trainer(tmp_path, "run", rounds=4, checkpoint_every=2)
    resumed.fit(make_model(), make_data(), FedAvg(), ckpt_path=folder / "previous.ckpt")
    assert torch.equal(resumed.global_state, run.global_state)


def test_a_changed_tensor_fails_the_checksum_even_when_the_file_reads(tmp_path):
    _, folder = four_rounds(tmp_path)
    state = torch.load(folder / "last.ckpt", weights_only=True)
    name = next(iter(state["global_state"]))
    state["global_state"][name].view(-1)[0] += 1e-3  # as a flipped bit in a weight would
    torch.save(state, folder / "last.ckpt")
    with pytest.raises(ConfigError, match=r"last.ckpt is corrupted: its contents do not match the checksum"):
        ckpt_io.load(folder / "last.ckpt")


def test_a_checkpoint_written_before_checksums_still_loads(tmp_path):
    _, folder = four_rounds(tmp_path)
    state = torch.load(folder / "last.ckpt", weights_only=True)
    for key in ("checksum", "data_fingerprint", "run_dir"):
        del state[key]
    torch.save(state, folder / "last.ckpt")
    assert ckpt_io.load(folder / "last.ckpt")["round"] == 4
    resumed = trainer(tmp_path, "run", rounds=5, checkpoint_every=2)
    resumed.fit(make_model(), make_data(), FedAvg(), ckpt_path=folder / "last.ckpt")
    assert resumed.run.round == 5


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_checkpoints_and_their_temporary_files_are_the_owners_alone(tmp_path, monkeypatch, umask):
    """A checkpoint may hold DP's noise secret: no other user may read it, from its first byte on disk."""
    modes = []
    replace = os.replace

    def recording(src, dst):
        modes.append(stat.S_IMODE(os.stat(src).st_mode))
        replace(src, dst)

    monkeypatch.setattr(ckpt_io.os, "replace", recording)
    old = os.umask(umask)
    try:
        for round_idx in (1, 2):  # the second write keeps the first as previous.ckpt
            ckpt_io.save_atomic({"format": ckpt_io.FORMAT, "round": round_idx}, tmp_path / "last.ckpt")
    finally:
        os.umask(old)
    assert modes and set(modes) == {0o600}
    for name in ("last.ckpt", "previous.ckpt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600


def test_a_full_disk_is_one_message_and_the_checkpoint_before_survives(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    ckpt_io.save_atomic({"format": ckpt_io.FORMAT, "round": 1}, path)

    def full(target, data):
        Path(target).write_bytes(bytes(data)[:10])  # what fits before the disk fills up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt_io, "_write", full)
    with pytest.raises(ConfigError, match=rf"No space left on the disk to write the checkpoint {path} .* intact"):
        ckpt_io.save_atomic({"format": ckpt_io.FORMAT, "round": 2}, path)
    assert ckpt_io.load(path)["round"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


# -- resuming against other inputs ----------------------------------------------------------------------------
def npz_data(path):
    return FederatedDataModule(NpzDataset(path=str(path)), batch_size=10)


def test_a_resume_on_changed_data_of_the_same_shapes_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    inputs, targets = rng.normal(size=(60, 12)).astype(np.float32), rng.integers(0, 10, 60)
    groups = np.repeat(np.arange(6), 10)
    path = tmp_path / "mine.npz"
    np.savez(path, inputs=inputs, targets=targets, groups=groups)
    run = trainer(tmp_path, "npz", rounds=1)
    run.fit(make_model(), npz_data(path), FedAvg())
    np.savez(path, inputs=inputs + 1, targets=targets, groups=groups)  # same shapes, other contents
    with pytest.raises(ConfigError, match="the contents of the --data samples changed since it was written"):
        trainer(tmp_path, "npz", rounds=2).fit(
            make_model(), npz_data(path), FedAvg(), ckpt_path=run.run_dir / "checkpoints" / "last.ckpt"
        )


def test_settings_that_do_not_change_results_may_change_on_resume():
    saved = {"trainer": {"start_method": "popen", "enable_progress_bar": True, "local_epochs": 2}}
    current = {"trainer": {"start_method": "fork", "enable_progress_bar": False, "local_epochs": 2, "rewind": True}}
    assert ckpt_io.config_differences(saved, current) == []
    current["trainer"]["local_epochs"] = 3
    assert ckpt_io.config_differences(saved, current) == ["trainer.local_epochs: 2 in the checkpoint, 3 now"]


def test_a_full_disk_while_logging_is_one_message_naming_the_checkpoint(tmp_path, monkeypatch):
    run = trainer(tmp_path, "run", rounds=4, checkpoint_every=1)

    def full(self, row):
        if row["round"] == 3:  # the third round, counted from 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(RoundCSV, "log", full)
    with pytest.raises(ConfigError) as err:
        run.fit(make_model(), make_data(), FedAvg())
    last = run.run_dir / "checkpoints" / "last.ckpt"
    assert f"No space left on the disk while writing the run's files in {run.run_dir}" in str(err.value)
    assert f"resume with --ckpt_path {last}" in str(err.value) and ckpt_io.load(last)["round"] == 2


def test_a_damaged_checkpoint_is_refused_as_init_from(tmp_path):
    _, folder = four_rounds(tmp_path)
    state = torch.load(folder / "last.ckpt", weights_only=True)
    next(iter(state["global_state"].values())).view(-1)[0] += 1.0
    torch.save(state, folder / "last.ckpt")
    with pytest.raises(ConfigError, match=r"--trainer.init_from .*last.ckpt is corrupted"):
        ckpt_io.read_weights(folder / "last.ckpt")


# -- what a checkpoint must hold, and the configuration of a run started from Python -------------------------------
@pytest.mark.parametrize("missing", [("global_state",), ("config",), ("global_state", "history")])
def test_a_checkpoint_without_the_keys_a_resume_reads_is_refused_naming_them(tmp_path, missing):
    run = trainer(tmp_path, "run")
    run.fit(make_model(), make_data(), FedAvg())
    state = ckpt_io.load(run.run_dir / "checkpoints" / "last.ckpt")
    for key in missing:
        del state[key]
    ckpt_io.save_atomic(state, tmp_path / "bad.ckpt")  # with a matching checksum: only the keys are wrong
    with pytest.raises(ConfigError, match=f"has the fedlight marker but lacks {', '.join(missing)}: "):
        trainer(tmp_path, "run", rounds=3).fit(make_model(), make_data(), FedAvg(), ckpt_path=tmp_path / "bad.ckpt")


def test_a_checkpoint_written_from_python_keeps_its_settings_and_refuses_others_on_resume(tmp_path):
    run = trainer(tmp_path, "run")
    run.fit(make_model(), make_data(), FedAvg())
    last = run.run_dir / "checkpoints" / "last.ckpt"
    config = ckpt_io.load(last)["config"]
    assert config["origin"] == "python" and config["trainer"]["local_epochs"] == 1
    assert config["data"]["batch_size"] == 10 and config["data"]["dataset"]["init_args"]["num_clients"] == 6
    with pytest.raises(ConfigError, match=r"trainer\.straggler_fraction: 0\.0 in the checkpoint, 0\.5 now"):
        other = trainer(tmp_path, "run", rounds=3, straggler_fraction=0.5)
        other.fit(make_model(), make_data(), FedAvg(), ckpt_path=last)
    # as the command line resolves it: the data the run did not train on are named too
    resolved = {
        "trainer": {**config["trainer"], "rounds": 3},
        "data": {"batch_size": 32, "dataset": {"class_path": "fedlight.data.Synthetic", "init_args": {"seed": 1}}},
    }
    assert ckpt_io.config_differences(config, resolved) == ["data.batch_size: 10 in the checkpoint, 32 now"]
    resumed = trainer(tmp_path, "run", rounds=3)
    resumed.fit(make_model(), make_data(), FedAvg(), ckpt_path=last)  # the same settings, more rounds
    assert resumed.run.round == 3


def test_an_empty_checkpoint_file_says_it_is_empty(tmp_path):
    (tmp_path / "last.ckpt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"is not a readable fedlight checkpoint \(the file is empty\)"):
        ckpt_io.load(tmp_path / "last.ckpt")
    with pytest.raises(ConfigError, match=r"is not a readable checkpoint or state_dict \(the file is empty\)"):
        ckpt_io.read_weights(tmp_path / "last.ckpt")


def test_init_from_weights_with_nan_are_refused_naming_the_keys(tmp_path):
    weights = make_model().state_dict()
    name = next(iter(weights))
    weights[name].view(-1)[3] = float("inf")
    torch.save(weights, tmp_path / "diverged.pt")
    run = trainer(tmp_path, "run", init_from=tmp_path / "diverged.pt")
    with pytest.raises(ConfigError, match=rf"--trainer.init_from {tmp_path / 'diverged.pt'} holds NaN/Inf in {name}:"):
        run.fit(make_model(), make_data(), FedAvg())
    assert not list(tmp_path.rglob("version_*"))
