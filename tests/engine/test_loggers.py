"""W&B conventions of ``fedlight.engine.loggers.wandb_logger``: environment variables, run fields, offline runs."""

import os
from pathlib import Path

import lightning.pytorch.loggers  # noqa: F401  (imported once for the module: seconds, not what is tested)
import pytest
import wandb

from fedlight.engine.loggers import resolve_wandb_mode, wandb_logger


@pytest.mark.parametrize(
    ("env", "configured", "expected"),
    [
        ("disabled", "offline", "disabled"),  # W&B's off switch wins over the config
        ("disabled", "online", "disabled"),
        ("online", None, "online"),  # the environment fills in an unset mode
        ("dryrun", None, "offline"),  # W&B's older spelling
        ("online", "offline", "offline"),  # an explicit setting wins over the environment
        (None, None, "offline"),  # no account or network needed by default
    ],
)
def test_wandb_mode_follows_the_environment_as_wandb_does(monkeypatch, env, configured, expected):
    if env is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env)
    assert resolve_wandb_mode(configured) == expected


def test_disabled_wandb_gives_no_logger_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_logger(tmp_path, "run", "abc", {"a": 1}, mode="offline") is None
    assert list(tmp_path.iterdir()) == []


def _run_fields(tmp_path, **kwargs):
    logger = wandb_logger(tmp_path, "row", "fields1", None, **kwargs)
    run = logger.experiment
    try:
        return {
            "project": run.project,
            "entity": run.entity,
            "tags": tuple(run.tags),
            "group": run.group,
            "notes": run.notes,
            "name": run.name,
            "id": run.id,
        }
    finally:
        wandb.finish()


def test_project_and_entity_from_the_environment_win_over_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "from_env")
    monkeypatch.setenv("WANDB_ENTITY", "team_env")
    fields = _run_fields(tmp_path, tags=["fedavg", "delta50"], group="seeds", notes="three seeds")
    assert fields == {
        "project": "from_env",
        "entity": "team_env",
        "tags": ("fedavg", "delta50"),
        "group": "seeds",
        "notes": "three seeds",
        "name": "row",
        "id": "fields1",
    }


def test_an_explicit_project_and_entity_win_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "from_env")
    monkeypatch.setenv("WANDB_ENTITY", "team_env")
    fields = _run_fields(tmp_path, project="mine", entity="my_team")
    assert (fields["project"], fields["entity"]) == ("mine", "my_team")


def test_without_project_anywhere_runs_go_to_the_fedlight_project(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert _run_fields(tmp_path)["project"] == "fedlight"


def test_an_offline_logger_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    # Lightning's `offline=True` would set WANDB_MODE for the rest of the process.
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _run_fields(tmp_path, mode="offline")
    assert "WANDB_MODE" not in os.environ


@pytest.mark.parametrize("env_mode", [None, "offline"])
def test_an_offline_run_starts_without_a_wandb_warning(tmp_path, monkeypatch, capfd, env_mode):
    if env_mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env_mode)
    monkeypatch.setattr(wandb.errors.term, "_printed_messages", set())  # W&B prints a warning once per process
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    capfd.readouterr()
    _run_fields(tmp_path)
    out = capfd.readouterr()
    assert "WARNING" not in out.err + out.out


def test_a_second_run_in_one_process_reads_a_changed_entity(tmp_path, monkeypatch):
    # W&B reads its environment once per process; a sweep in a notebook changes WANDB_ENTITY between runs.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ENTITY", "first_team")
    assert _run_fields(tmp_path / "a")["entity"] == "first_team"
    monkeypatch.setenv("WANDB_ENTITY", "second_team")
    assert _run_fields(tmp_path / "b")["entity"] == "second_team"


def test_online_wandb_without_credentials_is_refused_before_a_run_folder_exists(tmp_path, monkeypatch, capsys):
    from fedlight.cli import main

    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings file
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    config = str(Path(__file__).resolve().parents[2] / "conf/digits/fedavg.yaml")
    root = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", config, "--trainer.wandb_mode=online", f"--trainer.default_root_dir={root}"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("fedlight: error: --trainer.wandb_mode=online") and "wandb login" in message
    assert len(message.splitlines()) == 1
    assert not root.exists()


def test_online_wandb_with_a_key_passes_the_check(tmp_path, monkeypatch):
    from fedlight.engine.loggers import wandb_login_problems

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_login_problems(["csv", "wandb"], "online") == []
    assert wandb_login_problems(["csv"], "online") == []  # W&B not used
