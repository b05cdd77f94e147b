import csv
import pickle
import re
from functools import partial

import pytest
import torch

from fedlight import checkpoint as ckpt_io
from fedlight.callbacks import RoundCallback
from fedlight.clients import ClassificationClient
from fedlight.data import Digits, FederatedDataModule, Synthetic
from fedlight.data.partition import PowerLaw
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies import FedAvg
from fedlight.testing import Kill, KillAfterRound, ScalarClient, ScalarDataset

# trainers built without a default_root_dir write into the test's own runs/
pytestmark = pytest.mark.usefixtures("runs_in_tmp")


def synthetic_data():
    return FederatedDataModule(Synthetic(num_clients=8, dim=12, seed=1), batch_size=10)


def make_trainer(tmp_path, rounds=4, callbacks=None, **kwargs):
    settings = {"clients_per_round": 4, "local_epochs": 2, "straggler_fraction": 0.5, "checkpoint_every": 2}
    settings.update({"logger": "csv", "enable_progress_bar": False, **kwargs})
    return FederatedTrainer(rounds=rounds, default_root_dir=tmp_path, callbacks=callbacks, **settings)


def make_model(seed=0):
    torch.manual_seed(seed)
    return ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [16]})


def read_metrics(run_dir):
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row.pop("round/time_s")
    return rows


class KillInsideRound(FedAvg):
    """Stops the run in the middle of round ``round_idx``, after one client trained."""

    def __init__(self, round_idx):
        super().__init__()
        self.round_idx = round_idx
        self.round = -1

    def on_round_start(self, trainer, round_idx, plans):
        self.round = round_idx

    def on_client_fit_end(self, trainer, module, update):
        if self.round == self.round_idx:
            raise Kill


@pytest.mark.parametrize("killer", ["after_round_2", "inside_round_3"])
def test_killed_and_resumed_run_ends_with_the_same_metrics(tmp_path, killer):
    reference = make_trainer(tmp_path / "reference")
    reference.fit(make_model(), synthetic_data(), FedAvg())

    if killer == "after_round_2":
        callbacks, strategy, resumed_strategy = [KillAfterRound(2)], FedAvg(), FedAvg()
    else:
        callbacks, strategy, resumed_strategy = [], KillInsideRound(3), KillInsideRound(-1)
    killed = make_trainer(tmp_path / "killed", callbacks=callbacks)
    with pytest.raises(Kill):
        killed.fit(make_model(), synthetic_data(), strategy)
    # The resumed process starts from another initial model: everything must come from the checkpoint.
    resumed = make_trainer(tmp_path / "killed")
    resumed.fit(
        make_model(seed=123),
        synthetic_data(),
        resumed_strategy,
        ckpt_path=killed.run_dir / "checkpoints" / "last.ckpt",
    )

    assert resumed.run_dir == killed.run_dir
    assert read_metrics(resumed.run_dir) == read_metrics(reference.run_dir)
    torch.testing.assert_close(resumed.global_state, reference.global_state, rtol=0, atol=0)


def test_a_killed_batched_run_resumes_to_the_uninterrupted_one(tmp_path):
    reference = make_trainer(tmp_path / "reference", client_batching=16)
    reference.fit(make_model(), synthetic_data(), FedAvg())
    killed = make_trainer(tmp_path / "killed", callbacks=[KillAfterRound(2)], client_batching=16)
    with pytest.raises(Kill):
        killed.fit(make_model(), synthetic_data(), FedAvg())
    resumed = make_trainer(tmp_path / "killed", client_batching=16)
    resumed.fit(
        make_model(seed=123), synthetic_data(), FedAvg(), ckpt_path=killed.run_dir / "checkpoints" / "last.ckpt"
    )
    assert not isinstance(resumed.run.pieces.fits.vectorised, str)  # it did run vectorised
    assert read_metrics(resumed.run_dir) == read_metrics(reference.run_dir)
    torch.testing.assert_close(resumed.global_state, reference.global_state, rtol=0, atol=0)


def test_resume_with_more_rounds_continues_the_run(tmp_path):
    short = make_trainer(tmp_path, rounds=2)
    short.fit(make_model(), synthetic_data(), FedAvg())
    longer = make_trainer(tmp_path, rounds=4)
    longer.fit(make_model(), synthetic_data(), FedAvg(), ckpt_path=short.run_dir / "checkpoints" / "last.ckpt")
    reference = make_trainer(tmp_path / "ref", rounds=4)
    reference.fit(make_model(), synthetic_data(), FedAvg())
    assert [r["round"] for r in read_metrics(longer.run_dir)] == ["1", "2", "3", "4"]
    torch.testing.assert_close(longer.global_state, reference.global_state, rtol=0, atol=0)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    trainer = make_trainer(tmp_path, rounds=1)
    trainer.fit(make_model(), synthetic_data(), FedAvg())
    other = ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [32]})
    with pytest.raises(ConfigError, match="different parameters"):
        make_trainer(tmp_path, rounds=2).fit(
            other, synthetic_data(), FedAvg(), ckpt_path=trainer.run_dir / "checkpoints" / "last.ckpt"
        )


def test_checkpoint_of_another_config_names_the_differences(tmp_path):
    config = {"trainer": {"rounds": 1, "local_epochs": 2}, "data": {"batch_size": 10}}
    trainer = make_trainer(tmp_path, rounds=1)
    trainer.fit(make_model(), synthetic_data(), FedAvg(), config=config)
    changed = {"trainer": {"rounds": 5, "local_epochs": 3}, "data": {"batch_size": 10}}
    with pytest.raises(ConfigError, match=r"trainer.local_epochs: 2 in the checkpoint, 3 now") as err:
        make_trainer(tmp_path, rounds=5).fit(
            make_model(),
            synthetic_data(),
            FedAvg(),
            ckpt_path=trainer.run_dir / "checkpoints" / "last.ckpt",
            config=changed,
        )
    assert "trainer.rounds:" not in str(err.value)


def test_missing_checkpoint_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"--ckpt_path .*does not exist"):
        make_trainer(tmp_path).fit(make_model(), synthetic_data(), FedAvg(), ckpt_path=tmp_path / "nope.ckpt")


class _Payload:
    def __reduce__(self):
        return (open, ("/tmp/fedlight-pwned", "w"))


def test_loading_a_checkpoint_never_executes_code_from_it(tmp_path):
    path = tmp_path / "evil.ckpt"
    with open(path, "wb") as f:
        pickle.dump({"format": ckpt_io.FORMAT, "x": _Payload()}, f, protocol=2)  # torch.save's protocol
    with pytest.raises(ConfigError, match="not a readable fedlight checkpoint"):
        ckpt_io.load(path)
    assert not (tmp_path / "fedlight-pwned").exists()


def test_checkpoints_are_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    ckpt_io.save_atomic({"format": ckpt_io.FORMAT, "round": 1}, path)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        ckpt_io.save_atomic({"format": ckpt_io.FORMAT, "round": 2}, path)
    assert ckpt_io.load(path)["round"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


class DtypeRecorder(ClassificationClient):
    def training_step(self, batch, batch_idx):
        outputs = super().training_step(batch, batch_idx)
        self.seen = (outputs["logits"].dtype, self.net.head.weight.dtype)
        return outputs


@pytest.mark.parametrize(("precision", "compute"), [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_precision_applies_inside_the_client_step(tmp_path, precision, compute):
    torch.manual_seed(0)
    model = DtypeRecorder(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [16]})
    trainer = make_trainer(tmp_path, rounds=1, precision=precision, straggler_fraction=0.0)
    trainer.fit(model, synthetic_data(), FedAvg())
    assert model.seen == (compute, torch.float32)  # autocast compute, fp32 master weights
    assert trainer.global_state.dtype == torch.float32  # the server keeps fp32


class LayoutRecorder(ClassificationClient):
    def training_step(self, batch, batch_idx):
        weight = self.net.encoder[3].weight  # the second convolution, [64, 32, 5, 5]
        self.seen = (weight.is_contiguous(), weight.is_contiguous(memory_format=torch.channels_last))
        return super().training_step(batch, batch_idx)


def digits_cnn_run(tmp_path, channels_last):
    torch.manual_seed(0)
    model = LayoutRecorder(num_classes=10, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 32})
    data = FederatedDataModule(Digits(), PowerLaw(num_clients=20, classes_per_client=2), batch_size=10)
    trainer = make_trainer(
        tmp_path / f"channels_last_{channels_last}", rounds=2, straggler_fraction=0.0, channels_last=channels_last
    )
    trainer.fit(model, data, FedAvg())
    return trainer, model


def test_channels_last_trains_in_nhwc_and_ends_at_the_same_model(tmp_path):
    default, default_model = digits_cnn_run(tmp_path, channels_last=False)
    nhwc, nhwc_model = digits_cnn_run(tmp_path, channels_last=True)
    assert default_model.seen == (True, False)
    assert nhwc_model.seen == (False, True)
    # the same arithmetic in another memory order: equal up to float rounding, which 40 SGD steps amplify to
    # ~1e-5; weights read or written in the wrong order would differ by the size of the weights (~0.1)
    torch.testing.assert_close(nhwc.global_state, default.global_state, rtol=0, atol=1e-4)
    # the checkpoint holds ordinary contiguous tensors in logical order: a default-layout model reads W^T
    state = ckpt_io.load(nhwc.run_dir / "checkpoints" / "last.ckpt")["global_state"]
    assert all(t.is_contiguous() for t in state.values())
    reference = LayoutRecorder(num_classes=10, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 32})
    reference.load_state_dict(state)
    assert torch.equal(FlatState(reference).flatten(reference), nhwc.global_state)


def test_bad_trainer_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        FederatedTrainer(rounds=0, local_epochs=0, straggler_fraction=1.5)
    message = str(err.value)
    assert "--trainer.rounds ≥ 1, got 0" in message
    assert "--trainer.local_epochs ≥ 1, got 0" in message
    assert "--trainer.straggler_fraction (δ) in [0, 1], got 1.5" in message


def test_more_clients_per_round_than_clients_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--trainer.clients_per_round=9 exceeds the 8 clients"):
        make_trainer(tmp_path, clients_per_round=9).fit(make_model(), synthetic_data(), FedAvg())


def test_metrics_csv_has_one_row_per_round_with_the_documented_columns(tmp_path):
    trainer = make_trainer(tmp_path, rounds=3, eval_every=2)
    trainer.fit(make_model(), synthetic_data(), FedAvg())
    rows = read_metrics(trainer.run_dir)
    assert [r["round"] for r in rows] == ["1", "2", "3"]
    for key in ["train/loss", "round/clients_aggregated", "round/clients_dropped", "round/clients_nonfinite"]:
        assert all(r[key] != "" for r in rows)
    # evaluated at round 1 (every 2) and at the last round only
    assert [r["test/acc"] != "" for r in rows] == [False, True, True]
    assert float(rows[-1]["clients/acc"]) == pytest.approx(float(rows[-1]["test/acc"]))
    assert (trainer.run_dir / "checkpoints" / "last.ckpt").is_file()


def test_wandb_logs_offline_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    first = make_trainer(tmp_path, rounds=1, logger=["csv", "wandb"])
    first.fit(make_model(), synthetic_data(), FedAvg())
    run_id = first.run.progress.wandb_id

    # each offline run folder holds run-<id>.wandb; W&B suffixes the folder's name ("-1") when two runs
    # start within the same second, so the id is read from the file, not from the folder's name
    def run_ids():
        return [
            sorted(f.name for f in d.glob("run-*.wandb"))
            for d in sorted((first.run_dir / "wandb").glob("offline-run-*"))
        ]

    assert run_ids() == [[f"run-{run_id}.wandb"]]

    resumed = make_trainer(tmp_path, rounds=2, logger=["csv", "wandb"])
    resumed.fit(make_model(), synthetic_data(), FedAvg(), ckpt_path=first.run_dir / "checkpoints" / "last.ckpt")
    assert resumed.run.progress.wandb_id == run_id
    assert run_ids() == [[f"run-{run_id}.wandb"]] * 2


def test_resuming_a_finished_run_runs_nothing_and_touches_none_of_its_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    first = make_trainer(tmp_path, rounds=2, logger=["csv", "wandb"])
    first.fit(make_model(), synthetic_data(), FedAvg())

    def files():  # W&B's service may still be closing its own logs, so its folder is compared by its parts
        return {p: p.stat().st_mtime_ns for p in first.run_dir.rglob("*") if p.is_file() and "wandb" not in p.parts}

    before = files()
    parts = sorted((first.run_dir / "wandb").glob("offline-run-*"))
    last = first.run_dir / "checkpoints" / "last.ckpt"

    again = make_trainer(tmp_path, rounds=2, logger=["csv", "wandb"])
    metrics = again.fit(make_model(), synthetic_data(), FedAvg(), ckpt_path=last)
    assert metrics == first.history[-1]
    assert f"{last} holds all 2 rounds; nothing to resume" in capsys.readouterr().out
    assert sorted((first.run_dir / "wandb").glob("offline-run-*")) == parts  # no empty W&B part
    assert files() == before

    with pytest.raises(ConfigError, match=r"holds 2 rounds, more than --trainer.rounds=1: there is nothing to resume"):
        make_trainer(tmp_path, rounds=1).fit(make_model(), synthetic_data(), FedAvg(), ckpt_path=last)


def test_a_run_stopped_before_its_first_round_ends_leaves_no_wandb_part(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    trainer = make_trainer(tmp_path, rounds=2, logger=["csv", "wandb"])
    with pytest.raises(Kill):
        trainer.fit(make_model(), synthetic_data(), KillInsideRound(0))
    assert not list((trainer.run_dir / "wandb").glob("offline-run-*"))


class RecordingCallback(RoundCallback):
    """Adds a metric and a histogram every round and counts rounds in its checkpointed state."""

    def __init__(self):
        self.rounds_seen = 0
        self.starts = []

    def on_round_start(self, trainer, round_idx):
        self.starts.append(round_idx)

    def on_round_end(self, trainer, round_idx, metrics):
        self.rounds_seen += 1
        metrics["probe/global_norm"] = trainer.global_state.norm().item()
        metrics["probe/histogram"] = torch.arange(3.0)

    def state_dict(self):
        return {"rounds_seen": self.rounds_seen}

    def load_state_dict(self, state):
        self.rounds_seen = state["rounds_seen"]


def test_callbacks_add_logged_metrics_and_are_checkpointed(tmp_path):
    callback = RecordingCallback()
    trainer = make_trainer(tmp_path, rounds=2, callbacks=[callback])
    trainer.fit(make_model(), synthetic_data(), FedAvg())
    rows = read_metrics(trainer.run_dir)
    assert float(rows[-1]["probe/global_norm"]) == pytest.approx(trainer.global_state.norm().item())
    assert "probe/histogram" not in rows[-1]  # histograms go to W&B only
    assert callback.starts == [0, 1]

    resumed_callback = RecordingCallback()
    resumed = make_trainer(tmp_path, rounds=3, callbacks=[resumed_callback])
    resumed.fit(make_model(), synthetic_data(), FedAvg(), ckpt_path=trainer.run_dir / "checkpoints" / "last.ckpt")
    assert resumed_callback.rounds_seen == 3 and resumed_callback.starts == [2]


class RecordSteps(FedAvg):
    """FedAvg that keeps every update and the size of every batch, to read the clients' steps."""

    def __init__(self):
        super().__init__()
        self.updates, self.batch_sizes = [], []

    def training_loss(self, module, batch, outputs):
        self.batch_sizes.append(len(batch[1]))
        return outputs["loss"]

    def on_round_end(self, trainer, round_idx, updates):
        self.updates += updates
        return {}


@pytest.mark.parametrize(("local_steps", "expected_steps"), [(None, 2), (3, 3), (5, 5)])
def test_local_steps_run_exactly_that_many_sgd_steps_across_epochs(tmp_path, local_steps, expected_steps):
    # 8 samples of target 2, half held out: 4 training samples in batches of 2, so an epoch is 2 steps and
    # 3 or 5 steps run into a second and third epoch. Each step is w ← w − ½(w − 2) from w = 0.
    data = FederatedDataModule(ScalarDataset([8], [2.0]), batch_size=2, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=1, local_epochs=1, local_steps=local_steps, logger=None,
        enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    strategy = RecordSteps()
    trainer.fit(ScalarClient(lr=0.5), data, strategy)
    assert [u.num_steps for u in strategy.updates] == [expected_steps]
    assert trainer.global_state.item() == pytest.approx(2.0 * (1 - 0.5**expected_steps))


@pytest.mark.parametrize(("train_samples", "sizes"), [(5, [2, 2, 2, 2, 2]), (1, [1, 1, 1, 1, 1])])
def test_local_steps_skip_short_batches_unless_the_client_has_no_other(tmp_path, train_samples, sizes):
    # 5 samples in batches of 2 give 2, 2, 1 per epoch: the 1 is skipped; a 1-sample client keeps its batch
    data = FederatedDataModule(ScalarDataset([2 * train_samples], [2.0]), batch_size=2, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=1, local_epochs=1, local_steps=5, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    strategy = RecordSteps()
    trainer.fit(ScalarClient(lr=0.5), data, strategy)
    assert strategy.batch_sizes == sizes


def test_local_steps_exclude_stragglers():
    with pytest.raises(ConfigError) as err:
        FederatedTrainer(local_steps=0, straggler_fraction=0.5)
    assert "--trainer.local_steps ≥ 1" in str(err.value)
    assert "cannot be combined with --trainer.straggler_fraction=0.5" in str(err.value)


def test_without_held_out_samples_only_the_test_set_is_evaluated(tmp_path):
    data = FederatedDataModule(Synthetic(num_clients=8, dim=12, seed=1), batch_size=10, test_fraction=0.0)
    data.dataset.load_test = lambda: data.dataset.load_train()  # a separate global test set
    metrics = make_trainer(tmp_path, rounds=1, straggler_fraction=0.0).fit(make_model(), data, FedAvg())
    assert 0.0 <= metrics["test/acc"] <= 1.0
    assert not any(key.startswith("clients/") for key in metrics)


class ScheduledClient(ClassificationClient):
    """Halves the learning rate every step and records what each fit was told and which rates it used."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [16]})
        self.fits, self.rates, self.configured = [], [], 0

    def configure_model(self):
        self.configured += 1

    def configure_optimizers(self):
        self.fits.append(self.local_fit)
        self.sgd = torch.optim.SGD(self.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(self.sgd, lambda step: 0.5**step)
        return {"optimizer": self.sgd, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        self.rates.append(self.sgd.param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)


def test_schedulers_step_per_optimizer_step_and_know_their_fit(tmp_path):
    model = ScheduledClient()
    trainer = make_trainer(tmp_path, rounds=2, straggler_fraction=0.0, local_epochs=2, clients_per_round=2)
    trainer.fit(model, synthetic_data(), FedAvg())
    assert model.configured == 1  # once, before W^0 is taken
    assert [fit.round_idx for fit in model.fits] == [0, 0, 1, 1] and {fit.rounds for fit in model.fits} == {2}
    steps = [fit.num_steps for fit in model.fits]
    assert sum(steps) == len(model.rates)  # each fit ran the steps it was announced
    assert model.rates == pytest.approx([0.5**step for num_steps in steps for step in range(num_steps)])


def test_forked_processes_hand_rank_zeros_results_back(tmp_path):
    one = make_trainer(tmp_path / "one", rounds=3)
    one.fit(make_model(), synthetic_data(), FedAvg())

    counter, model = RecordingCallback(), make_model()
    forked = make_trainer(tmp_path / "forked", rounds=3, devices=2, start_method="fork", callbacks=[counter])
    metrics = forked.fit(model, synthetic_data(), FedAvg())

    # the rounds ran in two forked processes; this one holds rank 0's outcome as if they had run here
    assert torch.equal(forked.global_state, one.global_state)  # fp64 aggregation: independent of the spread
    assert forked.run.round == 3 and [row["test/acc"] for row in forked.history] == [
        row["test/acc"] for row in one.history
    ]
    assert metrics["test/acc"] == one.history[-1]["test/acc"]
    assert counter.rounds_seen == 3
    assert torch.equal(FlatState(model).flatten(model), one.global_state)  # the caller's module holds W^T
    assert (forked.run_dir / "checkpoints" / "last.ckpt").exists()
    # and evaluation forks again from the adopted state
    assert forked.validate(model, synthetic_data(), FedAvg())["clients/acc"] == one.history[-1]["clients/acc"]


def test_fork_start_across_nodes_is_refused():
    with pytest.raises(ConfigError, match="start_method=popen"):
        FederatedTrainer(devices=2, num_nodes=2, start_method="fork")


class ThreeOptimizerClient(ScalarClient):
    """Three scalars a, b, c, each with loss ½(· − y)² and its own SGD (momentum 0.9, lr 0.1 / 0.2 / 0.3)."""

    def __init__(self):
        super().__init__()
        del self.w
        self.a, self.b, self.c = (torch.nn.Parameter(torch.zeros(())) for _ in range(3))
        self.configured = 0

    def training_step(self, batch, batch_idx):
        y = batch[1]
        return {"loss": sum(0.5 * ((w - y) ** 2).mean() for w in (self.a, self.b, self.c))}

    def validation_step(self, batch, batch_idx):
        return {"loss": 0.5 * (self.a - batch[1]) ** 2}

    def configure_optimizers(self):
        self.configured += 1
        return [torch.optim.SGD([w], lr=0.1 * (i + 1), momentum=0.9) for i, w in enumerate((self.a, self.b, self.c))]


def test_several_optimizers_each_step_per_batch_and_are_recreated_every_round():
    # one client with target 2 whose batch holds its whole split: every round is one step of each optimizer
    data = FederatedDataModule(ScalarDataset([4], [2.0]), batch_size=100, test_fraction=0.5)
    model = ThreeOptimizerClient()
    trainer = FederatedTrainer(rounds=2, clients_per_round=1, local_epochs=1, logger=None, enable_progress_bar=False)
    trainer.fit(model, data, FedAvg())
    lr = torch.tensor([0.1, 0.2, 0.3])
    after_one = lr * 2.0  # w = 0 − lr·(0 − 2)
    # a fresh optimizer: no momentum carried over, so round 2 is again a plain step from the new w
    after_two = after_one - lr * (after_one - 2.0)
    torch.testing.assert_close(trainer.global_state, after_two)
    assert model.configured == 2  # once per round


def test_a_run_in_a_log_prints_a_start_line_one_line_per_round_and_a_summary(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    trainer = make_trainer(tmp_path, rounds=3, enable_progress_bar=True, logger=["csv", "wandb"])
    trainer.fit(make_model(), synthetic_data(), FedAvg(), config={"trainer": {"rounds": 3}})
    out, err = capsys.readouterr()  # pytest's capture is no terminal: no bars
    lines = out.strip().splitlines()
    run_dir = trainer.run_dir.relative_to(tmp_path)  # the working folder here: the console shows paths from it
    assert lines[0].startswith(f"fedlight: fedlight → {run_dir} | seed 0 | FedAvg, 4 of 8 clients per round")
    rounds = [line for line in lines if line.startswith("round ")]
    assert [line.split()[1] for line in rounds] == ["1/3", "2/3", "3/3"]
    assert all("test/acc" in line and "train/loss" in line for line in rounds)
    assert "\r" not in out + err and "\x1b[" not in out + err
    summary = "\n".join(lines[lines.index(rounds[-1]) + 1 :])
    assert "fedlight: 3 rounds in" in summary
    assert f"run folder: {run_dir} (metrics.csv, config.yaml, checkpoints/last.ckpt)" in summary
    assert f"wandb sync {run_dir / 'wandb'}/offline-run-*" in summary


def test_a_long_run_prints_every_nth_round_and_the_last(tmp_path, capsys):
    trainer = make_trainer(
        tmp_path, rounds=120, local_epochs=1, clients_per_round=1, straggler_fraction=0.0, eval_every=60,
        checkpoint_every=60,
    )  # fmt: skip
    trainer.fit(make_model(), synthetic_data(), FedAvg())
    rounds = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert rounds == [f"{r}/120" for r in range(3, 121, 3)]  # ⌈120/50⌉ = 3


# -- updates and models that diverge ---------------------------------------------------------------------------
def scalar_run(tmp_path, lr, rounds=1, **kwargs):
    # two clients with targets 2 and 3; one full-batch step w ← w − lr·(w − y) from w = 0 gives w = lr·y
    data = FederatedDataModule(ScalarDataset([8, 8], [2.0, 3.0]), batch_size=100, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=2, local_epochs=1, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path, **kwargs,
    )  # fmt: skip
    return trainer, trainer.fit(ScalarClient(lr=lr), data, FedAvg())


def test_a_huge_but_finite_update_is_left_out_and_counted(tmp_path):
    with pytest.warns(UserWarning) as caught, pytest.raises(ConfigError) as err:
        scalar_run(tmp_path, lr=1e6)
    messages = [str(warning.message) for warning in caught]
    assert any(re.match(r"Client 0's update in round 1 has norm 2e\+06, more than .* = 1e\+03", m) for m in messages)
    # neither 2e6 nor 3e6 may enter W^1, and a run that aggregates nobody would end untrained: it stops
    assert "could be aggregated: of its 2 clients, 0 returned NaN/Inf and 2 moved further" in str(err.value)
    assert "no checkpoint was written yet" in str(err.value)
    data = FederatedDataModule(ScalarDataset([8, 8, 8], [2.0, 3.0, 1e9]), batch_size=100, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=3, local_epochs=1, logger=None, enable_progress_bar=False, default_root_dir=tmp_path
    )
    with pytest.warns(UserWarning, match="Client 2's update in round 1"):
        metrics = trainer.fit(ScalarClient(lr=1.0), data, FedAvg())
    assert trainer.global_state.item() == pytest.approx(2.5)  # the outsized one left out: (2 + 3) / 2
    assert (metrics["round/clients_outsized"], metrics["round/clients_nonfinite"]) == (1.0, 0.0)
    # within the bound (‖Δ‖ = 2, 3 ≤ 1000 · (0 + 1)) both count, equally weighted: (2 + 3) / 2
    trainer, metrics = scalar_run(tmp_path, lr=1.0)
    assert trainer.global_state.item() == pytest.approx(2.5) and metrics["round/clients_outsized"] == 0.0
    trainer, _ = scalar_run(tmp_path, lr=1e6, max_update_ratio=None)  # the check turned off
    assert trainer.global_state.item() == pytest.approx(2.5e6)


class NaNAtRound(FedAvg):
    def __init__(self, round_idx):
        super().__init__()
        self.round_idx, self.round = round_idx, -1

    def on_round_start(self, context, round_idx, plans):
        self.round = round_idx

    def server_update(self, global_state, aggregate, updates):
        return aggregate * float("nan") if self.round == self.round_idx else aggregate


def test_a_non_finite_global_model_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, rounds=4, checkpoint_every=1)
    with pytest.raises(ConfigError) as err:
        trainer.fit(make_model(), synthetic_data(), NaNAtRound(2))
    last = trainer.run_dir / "checkpoints" / "last.ckpt"
    assert "non-finite (NaN/Inf) in round 3, after NaNAtRound's aggregation" in str(err.value)
    assert f"the last good checkpoint, {last} (round 2), is intact" in str(err.value)
    saved = ckpt_io.load(last)
    assert saved["round"] == 2 and all(torch.isfinite(t).all() for t in saved["global_state"].values())
    assert [r["round"] for r in read_metrics(trainer.run_dir)] == ["1", "2"]


def test_optimizer_settings_and_frozen_parts_are_checked_before_a_run_folder_exists(tmp_path):
    torch.manual_seed(0)
    negative = ClassificationClient(
        num_classes=10, input_shape=(12,), model="mlp", optimizer=partial(torch.optim.SGD, lr=-0.1)
    )
    with pytest.raises(ConfigError, match=r"--model.init_args.optimizer refuses its settings: Invalid learning rate"):
        make_trainer(tmp_path).fit(negative, synthetic_data(), FedAvg())
    model = make_model()
    model.frozen_modules = ("backbone",)
    with pytest.raises(ConfigError, match=r"frozen_modules names \['backbone'\], which are not submodules"):
        make_trainer(tmp_path).fit(model, synthetic_data(), FedAvg())
    assert list(tmp_path.iterdir()) == []


class ThreadRecorder(ClassificationClient):
    def training_step(self, batch, batch_idx):
        self.threads_seen = torch.get_num_threads()
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("threads", "omp", "expected"), [("auto", None, 1), ("auto", "2", 2), (2, None, 2), (1, "2", 1)]
)
def test_local_steps_run_with_the_threads_the_setting_asks(tmp_path, monkeypatch, threads, omp, expected):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # neither the default nor what is asked
    try:
        torch.manual_seed(0)
        model = ThreadRecorder(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [16]})
        make_trainer(tmp_path, rounds=1, threads=threads).fit(model, synthetic_data(), FedAvg())
        assert model.threads_seen == expected
    finally:
        torch.set_num_threads(before)


def test_threads_below_one_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--trainer.threads ≥ 1 or 'auto', got 0"):
        FederatedTrainer(threads=0, default_root_dir=tmp_path)


def test_the_accelerator_defaults_to_lightnings_choice():
    import inspect

    from lightning.fabric import Fabric

    ours = inspect.signature(FederatedTrainer).parameters["accelerator"].default
    assert ours == inspect.signature(Fabric).parameters["accelerator"].default == "auto"


@pytest.mark.parametrize(("precision", "compute"), [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_precision_applies_inside_the_vectorised_client_step_as_in_the_sequential_one(tmp_path, precision, compute):
    torch.manual_seed(0)
    model = DtypeRecorder(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [16]})
    trainer = make_trainer(tmp_path, rounds=1, precision=precision, straggler_fraction=0.0, client_batching=16)
    trainer.fit(model, synthetic_data(), FedAvg())
    assert not isinstance(trainer.run.pieces.fits.vectorised, str)  # the round did run vectorised
    assert model.seen == (compute, torch.float32)  # autocast compute, fp32 stacked weights
    assert trainer.global_state.dtype == torch.float32


@pytest.mark.parametrize("batchnorm", [True, False])
def test_a_last_batch_of_one_sample_is_left_out_only_for_a_model_that_trains_batchnorm(tmp_path, batchnorm):
    """BatchNorm cannot normalise one sample: a client of 5 samples at batch 4 would fail its second step and be
    left out of the round. With BatchNorm, an epoch keeps its 4-sample batch only; without, both batches."""
    from fedlight.testing import ClientImages

    data = FederatedDataModule(ClientImages([5, 5], [0, 1]), batch_size=4, test_fraction=0.0)
    kwargs = {"channels": (4, 4, 4, 4), "layers": (1, 1, 1, 1), "stem_width": 4, "mean": (0.0,), "std": (1.0,)}
    model = "resnet18" if batchnorm else "mlp"
    client = ClassificationClient(3, (1, 8, 8), model=model, model_kwargs=kwargs if batchnorm else None)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=2, local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path, fail_fast=True,
    )  # fmt: skip
    metrics = trainer.fit(client, data, FedAvg())
    assert metrics["round/clients_failed"] == 0 and metrics["round/clients_aggregated"] == 2
    assert [data.num_batches(k) for k in range(2)] == ([1, 1] if batchnorm else [2, 2])


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_uint8_images_for_a_network_that_cannot_take_them_are_refused_before_the_run_folder(tmp_path, model):
    from fedlight.data.base import FederatedDataset, LabelledTensors

    class Bytes(FederatedDataset):
        num_classes, input_shape = 3, (1, 8, 8)

        def load_train(self):
            generator = torch.Generator().manual_seed(0)
            images = torch.randint(0, 256, (12, 1, 8, 8), dtype=torch.uint8, generator=generator)
            return LabelledTensors(images, torch.arange(12) % 3)

    data = FederatedDataModule(Bytes(), PowerLaw(num_clients=2, classes_per_client=2, base_samples=2), batch_size=4)
    trainer = FederatedTrainer(rounds=1, clients_per_round=2, logger=None, default_root_dir=tmp_path / "runs")
    with pytest.raises(ConfigError, match=r"--data gives uint8 images \(Bytes\).*resnet18"):
        trainer.fit(ClassificationClient(3, (1, 8, 8), model=model), data, FedAvg())
    assert not (tmp_path / "runs").exists()


def test_a_resumed_run_names_its_folder_as_the_fresh_run_did(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = {"default_root_dir": "runs", "logger": "csv", "enable_progress_bar": False, "clients_per_round": 4}
    FederatedTrainer(rounds=1, **settings).fit(make_model(), synthetic_data(), FedAvg())
    fresh = capsys.readouterr().out.splitlines()
    FederatedTrainer(rounds=2, **settings).fit(
        make_model(), synthetic_data(), FedAvg(), ckpt_path=tmp_path / "runs/fedlight/version_0/checkpoints/last.ckpt"
    )
    resumed = capsys.readouterr().out.splitlines()
    assert fresh[0].startswith("fedlight: fedlight → runs/fedlight/version_0 | ")
    assert (
        resumed[0].startswith("fedlight: fedlight → runs/fedlight/version_0 | ") and "resuming at round 2" in resumed[0]
    )
    assert any(line.startswith("  run folder: runs/fedlight/version_0 (metrics.csv") for line in resumed)
