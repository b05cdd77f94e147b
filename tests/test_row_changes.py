"""A command that changes a paper row's experiment says so, on the console and in the run's config.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedlight import cli, row_changes

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = ROOT / "conf/fedproto/synthetic/fedavg_delta0.yaml"


def _fit(tmp_path: Path, *flags: str, config: Path = SYNTHETIC) -> Path:
    """One short round of ``config`` into ``tmp_path``; its run folder."""
    cli.run([
        "fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path), "--trainer.logger=csv",
        "--trainer.enable_progress_bar=false", *flags,
    ])  # fmt: skip
    (run_dir,) = (tmp_path / config.stem).glob("version_*")
    return run_dir


def test_a_changed_row_says_which_settings_it_changes(tmp_path: Path, capsys) -> None:
    run_dir = _fit(tmp_path, "--trainer.rounds=1", "--trainer.local_epochs=1", "--trainer.clients_per_round=2")

    expected = (
        f"Not the paper's setting: this run changes {SYNTHETIC}'s trainer.rounds (200 → 1), trainer.clients_per_round "
        "(10 → 2), trainer.local_epochs (20 → 1)."
    )
    assert f"fedlight: {expected}" in capsys.readouterr().out.splitlines()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["wandb_notes"] == expected


@pytest.fixture
def no_run(monkeypatch):
    """``cli.run`` up to the point where the run would start; returns the subcommand's parsed settings."""
    seen = {}

    def stop(self, model, datamodule, strategy, ckpt_path=None, config=None):
        seen["config"] = config
        return {}

    monkeypatch.setattr(cli.FederatedTrainer, "fit", stop)
    return seen


def test_user_notes_are_kept_and_the_note_is_added_once(tmp_path: Path, capsys, no_run) -> None:
    flags = ["--trainer.default_root_dir", str(tmp_path), "--model.init_args.optimizer.init_args.lr=0.5"]
    cli.run(["fit", "--config", str(SYNTHETIC), "--trainer.wandb_notes=lr probe", *flags])
    notes = no_run["config"]["trainer"]["wandb_notes"]
    assert notes.startswith("lr probe Not the paper's setting: ") and notes.endswith("model.optimizer.lr (0.01 → 0.5).")

    # the run's own config.yaml given after the row carries the note already: it is not repeated
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump({"trainer": {"wandb_notes": notes}}))
    cli.run(["fit", "--config", str(SYNTHETIC), "--config", str(again), *flags])
    assert no_run["config"]["trainer"]["wandb_notes"] == notes


def test_a_run_of_the_row_as_it_is_says_nothing(tmp_path: Path, capsys, no_run) -> None:
    # where the run goes, its name, seed, loggers and devices place the same experiment
    flags = ["--seed_everything=3", "--trainer.name=mine", "--trainer.rounds=200", "--trainer.logger=csv"]
    cli.run(["fit", "--config", str(SYNTHETIC), "--trainer.default_root_dir", str(tmp_path), *flags])

    assert "setting" not in capsys.readouterr().out
    assert no_run["config"]["trainer"].get("wandb_notes") is None


def test_a_twin_and_a_file_outside_the_rows(tmp_path: Path, capsys, no_run) -> None:
    twin = ROOT / "conf/fedproto/scenes/fedavg_alpha1.yaml"
    cli.run(["fit", "--config", str(twin), "--trainer.default_root_dir", str(tmp_path), "--trainer.rounds=7"])
    assert "Not the twin's setting" in no_run["config"]["trainer"]["wandb_notes"]
    capsys.readouterr()

    own = tmp_path / "own.yaml"
    own.write_text(SYNTHETIC.read_text().replace("config: base.yaml", f"config: {SYNTHETIC.parent / 'base.yaml'}"))
    cli.run(["fit", "--config", str(own), "--trainer.default_root_dir", str(tmp_path), "--trainer.rounds=7"])
    assert no_run["config"]["trainer"].get("wandb_notes") is None
    assert "setting" not in capsys.readouterr().out


def test_changed_settings_leave_out_placement_and_count_removed_entries() -> None:
    row = {
        "trainer": {"rounds": 5, "devices": 1, "default_root_dir": "runs"},
        "data": {"dataset": {"class_path": "D", "init_args": {"root": "data/x", "size": 512}}},
        "model": {"init_args": {"model_kwargs": {"pretrained": True, "pretrained_file": None}}},
    }
    run = {
        "trainer": {"rounds": 5, "devices": 2, "default_root_dir": "/scratch"},
        "data": {"dataset": {"class_path": "D", "init_args": {"root": "/mnt/x", "size": 256}}},
        "model": {"init_args": {"model_kwargs": {"pretrained_file": "w.pth"}}},
    }
    assert row_changes.changed_settings(row, run) == [
        ("data.dataset.size", 512, 256),
        ("model.model_kwargs.pretrained", True, None),
    ]
    many = [(f"k{i}", i, i + 1) for i in range(row_changes.SHOWN + 3)]
    assert row_changes.note("r.yaml", "paper", many).endswith(
        f"k{row_changes.SHOWN - 1} ({row_changes.SHOWN - 1} → {row_changes.SHOWN}), and 3 more."
    )
