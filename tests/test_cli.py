"""The ``fedlight`` command, run in-process (importing the package once is the slow part)."""

import csv
from pathlib import Path

import pytest
import yaml

from fedlight.cli import build_parser, main, run

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "conf").rglob("*.yaml"))
SYNTHETIC = str(REPO / "conf/fedproto/synthetic/fedavg_delta0.yaml")
QUICK = ["--trainer.local_epochs=1", "--trainer.clients_per_round=3", "--trainer.enable_progress_bar=false"]


@pytest.mark.parametrize(
    "path", [p for p in CONFIGS if "sweeps" not in p.parts], ids=lambda p: str(p.relative_to(REPO))
)
def test_every_config_parses_and_instantiates(path):
    parser = build_parser()
    # A file without a model (e.g. conf/fedproto/analysis.yaml) is an add-on stacked after a row config.
    keys = yaml.safe_load(path.read_text()).keys()
    stack = [] if {"model", "config"} & keys else ["--config", SYNTHETIC]
    cfg = parser.parse_args(["fit", *stack, "--config", str(path)])
    objects = parser.instantiate(cfg).fit
    assert objects.trainer.rounds >= 1
    assert objects.model.net is not None


def test_print_config_applies_overrides_after_the_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", SYNTHETIC, "--trainer.rounds=7", "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["rounds"] == 7
    assert printed["trainer"]["local_epochs"] == 20  # from the base file
    assert printed["strategy"]["class_path"] == "fedlight.strategies.FedAvg"


def test_later_config_files_override_earlier_ones(tmp_path, capsys):
    override = tmp_path / "override.yaml"
    override.write_text("trainer:\n  local_epochs: 3\n")
    with pytest.raises(SystemExit):
        run(["fit", "--config", SYNTHETIC, "--config", str(override), "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["local_epochs"] == 3


@pytest.mark.parametrize(("rule", "tolerates"), [("FedProx", True), ("FedProto", True), ("FedAtt", False)])
def test_switching_the_rule_keeps_the_new_rules_own_defaults(rule, tolerates):
    # The base file names FedAvg (drops stragglers); jsonargparse carries init_args over a class_path
    # change, so a concrete default there would override the new rule's paper setting.
    parser = build_parser()
    cfg = parser.parse_args(["fit", "--config", SYNTHETIC, f"--strategy=fedlight.strategies.{rule}"])
    assert parser.instantiate(cfg).fit.strategy.tolerate_stragglers is tolerates


def test_help_documents_every_trainer_argument(capsys):
    with pytest.raises(SystemExit):
        run(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # undo the line wrapping
    for flag, doc in [
        ("--trainer.clients_per_round", "clients sampled each round"),
        ("--trainer.straggler_fraction", "the share of each round's clients"),
        ("--data.test_fraction", "held out"),
        ("--ckpt_path", "resumes"),
    ]:
        assert flag in text and doc in text


def test_fit_then_validate_and_test_a_checkpoint(tmp_path, capsys):
    root = str(tmp_path)
    metrics = run(
        [
            "fit",
            "--config",
            SYNTHETIC,
            "--trainer.rounds=2",
            "--trainer.logger=csv",
            f"--trainer.default_root_dir={root}",
            *QUICK,
        ]
    )
    run_dir = tmp_path / "fedavg_delta0" / "version_0"
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and float(rows[-1]["test/acc"]) == pytest.approx(metrics["test/acc"])
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["rounds"] == 2 and saved["seed_everything"] == 0

    ckpt = str(run_dir / "checkpoints" / "last.ckpt")
    validated = run(["validate", "--config", SYNTHETIC, "--ckpt_path", ckpt, *QUICK])
    tested = run(["test", "--config", SYNTHETIC, "--ckpt_path", ckpt, *QUICK])
    assert validated["clients/acc"] == pytest.approx(metrics["clients/acc"])
    assert tested["test/acc"] == pytest.approx(metrics["test/acc"])
    assert "clients/acc" in capsys.readouterr().out


def test_same_seed_same_numbers_other_seed_other_numbers(tmp_path):
    args = ["fit", "--config", SYNTHETIC, "--trainer.rounds=1", "--trainer.logger=csv", *QUICK]
    first = run([*args, f"--trainer.default_root_dir={tmp_path / 'a'}"])
    again = run([*args, f"--trainer.default_root_dir={tmp_path / 'b'}"])
    other = run([*args, f"--trainer.default_root_dir={tmp_path / 'c'}", "--seed_everything=1"])
    assert first["train/loss"] == again["train/loss"] != other["train/loss"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--trainer.local_epochs=0"], "--trainer.local_epochs ≥ 1, got 0"),
        (["--trainer.straggler_fraction=1.5"], "--trainer.straggler_fraction (δ) in [0, 1], got 1.5"),
        (["--trainer.clients_per_round=31"], "--trainer.clients_per_round=31 exceeds the 30 clients"),
        (["--model.init_args.model=resnet999"], "Unknown model 'resnet999' (--model.init_args.model)"),
        (
            ["--data.dataset=fedlight.data.NpzDataset", "--data.dataset.init_args.path=/nonexistent/x.npz"],
            "--data.dataset.init_args.path=/nonexistent/x.npz does not exist",
        ),
        (
            ["--data.partitioner=fedlight.data.partition.Dirichlet", "--data.partitioner.init_args.alpha=0"],
            "--data.partitioner.init_args.alpha",
        ),
        (["--ckpt_path=/nonexistent/last.ckpt"], "--ckpt_path /nonexistent/last.ckpt does not exist"),
        (  # more clients than samples
            [
                "--data.partitioner=fedlight.data.partition.Dirichlet",
                "--data.partitioner.init_args.num_clients=9000",
                "--data.partitioner.init_args.min_size=0",
            ],
            "of 9000 clients empty: there are more clients than samples can fill",
        ),
        (["--seed_everything=-1"], "Expected --seed_everything in [0, 4294967295] (numpy's seed range), got -1"),
        (["--trainer.name=../../x"], "--trainer.name='../../x' leads outside --trainer.default_root_dir"),
        (
            ["--model.init_args.optimizer.init_args.lr=-0.1"],
            "--model.init_args.optimizer refuses its settings: Invalid learning rate: -0.1",
        ),
        (["--trainer.max_update_ratio=0"], "Expected --trainer.max_update_ratio > 0"),
    ],
)
def test_bad_input_ends_in_one_message_naming_the_flag(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                SYNTHETIC,
                "--trainer.logger=csv",
                f"--trainer.default_root_dir={tmp_path}",
                "--trainer.rounds=1",
                *QUICK,
                *flags,
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not list(tmp_path.rglob("version_*"))  # found before a run folder was created


def test_a_root_that_is_a_file_is_one_message(tmp_path, capsys):
    (tmp_path / "runs").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", SYNTHETIC, f"--trainer.default_root_dir={tmp_path / 'runs'}"])
    assert exit_info.value.code == 2
    assert f"--trainer.default_root_dir={tmp_path / 'runs'}: {tmp_path / 'runs'} is a file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty: give it at least one setting"),
        ("# only a comment\n", "is empty"),
        ("trainer:\n  rounds: 3\n  local_epochs: [1,\n", "is not valid YAML at line 4, column 1"),
        ("trainer:\n\trounds: 3\n", "is not valid YAML at line 2, column 1"),
        ("- rounds\n", "holds a list, not 'key: value' settings"),
    ],
)
def test_an_empty_or_broken_config_file_is_named_with_its_line(tmp_path, capsys, text, message):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", SYNTHETIC, "--config", str(path)])
    assert exit_info.value.code == 2
    assert f"--config {path} {message}" in capsys.readouterr().err


def test_a_broken_base_file_is_named(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text("trainer: {rounds: 3\n")
    (tmp_path / "row.yaml").write_text("config: base.yaml\ntrainer.rounds: 2\n")
    with pytest.raises(SystemExit):
        main(["fit", f"--config={tmp_path / 'row.yaml'}"])
    assert f"--config {tmp_path / 'base.yaml'} is not valid YAML at line 2" in capsys.readouterr().err


def test_unknown_strategy_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", SYNTHETIC, "--strategy=fedlight.strategies.NoSuchRule"])
    assert exit_info.value.code == 2
    assert "strategy" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((REPO / "conf" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_sweeps_override_their_config_with_valid_flags(path):
    sweep = yaml.safe_load(path.read_text())
    command = sweep["command"]
    assert command[-1] == "${args}", "swept values must come last to override the config"
    subcommand, config = command[2], command[command.index("--config") + 1]
    fixed = [arg for arg in command[command.index("--config") + 2 : -1]]
    swept = [f"--{name}={spec['values'][-1]}" for name, spec in sweep["parameters"].items()]
    cfg = build_parser().parse_args([subcommand, "--config", str(REPO / config), *fixed, *swept])
    for name, spec in sweep["parameters"].items():
        assert cfg[subcommand][name] == spec["values"][-1]


def _leaves(config: dict, prefix: str = "") -> dict[str, object]:
    """``config`` as dotted paths to its leaves; a dotted key (``trainer.rounds: 3``) is a path already."""
    leaves = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            leaves |= _leaves(value, f"{path}.")
        else:
            leaves[path] = value
    return leaves


ROWS = [p for p in CONFIGS if "config" in (yaml.safe_load(p.read_text()) or {})]


@pytest.mark.parametrize("path", ROWS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_row_config_is_its_base_file_plus_its_own_values(path):
    # A nested section in a row file replaces the whole section of the file it names under `config:`,
    # with every other value back at its default; rows must change single values only.
    parser = build_parser()
    row = yaml.safe_load(path.read_text())
    base_path = path.parent / row.pop("config")

    def resolved(*files):
        stack = [arg for f in files for arg in ("--config", str(f))]
        return _leaves(yaml.safe_load(parser.dump(parser.parse_args(["fit", *stack]))).get("fit"))

    got, base, changes = resolved(path), resolved(base_path), _leaves(row)
    for key, value in changes.items():
        assert got[key] == value, key
    # A changed class_path brings the new class's own init_args; everything else stays the base file's.
    replaced = {key.rsplit(".", 1)[0] for key in changes if key.endswith("class_path")}
    for key, value in base.items():
        if key not in changes and not any(key.startswith(f"{section}.") for section in replaced):
            assert got.get(key) == value, f"{key}: base {value!r}, row {got.get(key)!r}"
