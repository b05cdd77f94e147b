"""The ``fedlight`` command, run in-process (importing the package once is the slow part)."""

import copy
import csv
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import wandb
import yaml

from fedlight import checkpoint as ckpt_io
from fedlight import cli
from fedlight.cli import build_parser, main, run
from fedlight.errors import ConfigError
from fedlight.models import list_models, registry

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "conf").rglob("*.yaml"))
SYNTHETIC = str(REPO / "conf/fedproto/synthetic/fedavg_delta0.yaml")
QUICK = ["--trainer.local_epochs=1", "--trainer.clients_per_round=3", "--trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def parser():
    """One parser for the tests of every config: building it costs more than parsing a config, and parsing or
    instantiating leaves it as it was (``test_a_shared_parser_parses_as_a_fresh_one``)."""
    return build_parser()


@pytest.fixture(scope="module")
def parsed(parser):
    """``parser.parse_args(["fit", *args])``, each command line parsed once per module; callers get a copy."""
    parse = functools.cache(lambda *args: parser.parse_args(["fit", *args]))
    return lambda *args: parse(*args).clone()


@pytest.fixture(scope="module")
def resolved(parser, parsed):
    """The leaves of the configuration a stack of files resolves to (read, never changed, by the tests)."""
    return functools.cache(lambda *files: _leaves(yaml.safe_load(parser.dump(parsed(*_stack(files)))).get("fit")))


def _stack(files) -> list[str]:
    return [arg for f in files for arg in ("--config", str(f))]


@pytest.fixture(scope="module")
def networks_built_once():
    """Each distinct network (registered name, input shape, classes, options) is built once and copied for every
    other config that asks for the same: drawing a network's initial weights is most of what instantiating a
    config costs, and a copy of a constructor's output for the same arguments is that constructor's network.
    Every config's client, trainer, data module and rule are still built from the config itself."""
    built = {}
    build = registry._build

    def once(name, factory, input_shape, num_classes, kwargs):
        key = (name, input_shape, num_classes, repr(sorted(kwargs.items())))
        if key not in built:
            built[key] = build(name, factory, input_shape, num_classes, kwargs)
        return copy.deepcopy(built[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_build", once)
        yield


@pytest.mark.parametrize(
    "path", [p for p in CONFIGS if "sweeps" not in p.parts], ids=lambda p: str(p.relative_to(REPO))
)
def test_every_config_parses_and_instantiates(parser, parsed, networks_built_once, path):
    # A file without a model (e.g. conf/fedproto/analysis.yaml) is an add-on stacked after a row config.
    keys = yaml.safe_load(path.read_text()).keys()
    stack = [] if {"model", "config"} & keys else [SYNTHETIC]
    cfg = parsed(*_stack([*stack, path]))
    if cfg.fit.model.init_args.get("crf") and importlib.util.find_spec("pydensecrf") is None:
        # The dense CRF is an optional extra: without it the config must be refused by name at set-up, and
        # everything else in it must still build.
        with pytest.raises(ValueError, match=r"--model\.init_args\.crf=true .* pip install pydensecrf2"):
            parser.instantiate(cfg)
        cfg.fit.model.init_args.crf = False
    objects = parser.instantiate(cfg).fit
    assert objects.trainer.run.rounds >= 1
    assert objects.model.net is not None


def test_a_shared_parser_parses_as_a_fresh_one(parser):
    """What the config tests' shared parser relies on: parsing and instantiating other configs (other clients,
    rules, datasets) leaves the parser giving what a fresh one gives."""
    args = ["fit", "--config", SYNTHETIC, "--config", str(REPO / "conf/fedproto/analysis.yaml")]
    fresh = build_parser()
    expected = fresh.dump(fresh.parse_args(args))
    rooms = [(REPO / "conf" / room).rglob("*.yaml") for room in ("digits", "fedsls", "ladd", "robust")]
    # a row of each room, not an add-on stacked after one
    others = [next(p for p in room if {"model", "config"} & yaml.safe_load(p.read_text()).keys()) for room in rooms]
    for other in others:
        parser.instantiate(parser.parse_args(["fit", "--config", str(other)]))
    assert parser.dump(parser.parse_args(args)) == expected


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

    # the checkpoint alone: its stored configuration is used; training settings may differ from it
    alone = run(["test", "--ckpt_path", ckpt])
    other_training = run(["test", "--config", SYNTHETIC, "--trainer.local_epochs=7", "--ckpt_path", ckpt, *QUICK])
    assert alone["test/acc"] == other_training["test/acc"] == pytest.approx(metrics["test/acc"])
    last = ["--config", SYNTHETIC, f"--trainer.default_root_dir={root}", "--ckpt_path", "last", *QUICK]
    assert run(["validate", *last])["clients/acc"] == pytest.approx(metrics["clients/acc"])

    # outside fedlight: the client module takes the checkpoint's weights with one call
    from fedlight.clients import ClassificationClient
    from fedlight.data import FederatedDataModule, Synthetic

    module = ClassificationClient(num_classes=10, input_shape=(60,), model="mlp", model_kwargs={"hidden": [128, 256]})
    module.load_state_dict(ckpt_io.read_weights(ckpt))
    data = FederatedDataModule(Synthetic(alpha=1.0, beta=1.0), batch_size=10)
    data.setup()
    correct = total = 0
    for x, y, _ in data.held_out_batches():
        correct += int((module.eval()(x).argmax(1) == y).sum())
        total += len(y)
    assert correct / total == pytest.approx(validated["clients/acc"])  # the same model, outside fedlight


def test_last_means_the_newest_finished_run_and_evaluation_says_what_it_scored(tmp_path, capsys):
    root = f"--trainer.default_root_dir={tmp_path}"
    fit = ["fit", "--config", SYNTHETIC, root, "--trainer.logger=csv", *QUICK]
    run([*fit, "--trainer.rounds=2"])  # version_0: the finished run of this command
    run([*fit, "--trainer.rounds=1"])  # version_1: a newer, shorter probe under the same name
    capsys.readouterr()
    finished = tmp_path / "fedavg_delta0" / "version_0" / "checkpoints" / "last.ckpt"
    run(["test", "--config", SYNTHETIC, root, "--trainer.rounds=2", "--ckpt_path", "last", *QUICK])
    captured = capsys.readouterr()
    assert f"--ckpt_path last is {finished} (round 2 of 2)" in captured.err
    assert f"fedlight: scoring {finished}, the global model of round 2 of 2 on the global test set" in captured.out
    # without --config: the newest checkpoint under the root that finished its own rounds, the probe
    run(["validate", "--ckpt_path", "last", root])
    probe = tmp_path / "fedavg_delta0" / "version_1" / "checkpoints" / "last.ckpt"
    scored = f"scoring {probe}, the global model of round 1 of 1 on the clients' held-out splits"
    assert scored in capsys.readouterr().out
    # fit --ckpt_path last resumes an unfinished run: none is, until more rounds are asked for
    with pytest.raises(ConfigError, match="found no unfinished run"):
        run(["fit", "--ckpt_path", "last", root])
    run(["fit", "--config", SYNTHETIC, root, "--trainer.rounds=3", "--ckpt_path", "last", *QUICK])
    assert (ckpt_io.load(probe)["round"], ckpt_io.load(finished)["round"]) == (3, 2)  # the newest one went on


def test_fit_resumes_from_the_checkpoint_alone(tmp_path):
    args = ["--config", SYNTHETIC, f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=csv", *QUICK]
    run(["fit", *args, "--trainer.rounds=1"])
    ckpt = tmp_path / "fedavg_delta0" / "version_0" / "checkpoints" / "last.ckpt"
    resumed = run(["fit", "--ckpt_path", str(ckpt), "--trainer.rounds=2"])  # its stored config, two rounds now
    straight = run(["fit", *args, "--trainer.rounds=2", "--trainer.name=straight"])
    assert ckpt_io.load(ckpt)["round"] == 2 and resumed["train/loss"] == straight["train/loss"]


def test_last_without_a_run_names_where_it_looked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["test", "--config", SYNTHETIC, f"--trainer.default_root_dir={tmp_path}", "--ckpt_path", "last"])
    assert f"--ckpt_path last found no checkpoints/last.ckpt under {tmp_path}/fedavg_delta0" in capsys.readouterr().err


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


def test_an_add_on_file_alone_names_the_command_that_stacks_it_on_a_row(capsys):
    add_on = REPO / "conf/fedproto/mnist_subset.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(add_on)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"No client module: --config {add_on} and the flags set no 'model'" in err
    assert "As its header shows: fedlight fit --config conf/fedproto/mnist/fedproto_delta50.yaml --config " in err
    assert len(err.strip().splitlines()) == 1


def test_a_lightning_logger_by_its_bare_name_is_lightning_pytorch_s(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run(["fit", "--config", SYNTHETIC, "--trainer.logger+=TensorBoardLogger",
             f"--trainer.logger.save_dir={tmp_path}", "--print_config"])  # fmt: skip
    loggers = yaml.safe_load(capsys.readouterr().out)["trainer"]["logger"]
    assert loggers[-1]["class_path"] == "lightning.pytorch.loggers.TensorBoardLogger"
    assert loggers[-1]["init_args"]["save_dir"] == str(tmp_path)


def test_a_usage_error_is_short(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", SYNTHETIC, "--trainer.rounds=many"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fedlight") and "--trainer.clients_per_round" not in err
    assert 'Parser key "trainer.rounds"' in err and len(err.splitlines()) < 12


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
def test_a_row_config_is_its_base_file_plus_its_own_values(resolved, path):
    row = yaml.safe_load(path.read_text())
    base_path = (path.parent / row.pop("config")).resolve()
    got, base, changes = resolved(path), resolved(base_path), _leaves(row)  # each base is parsed once
    for key, value in changes.items():
        assert got.get(key) == value, key  # a null leaves no entry in the dumped config
    # A changed class_path brings the new class's own init_args; everything else stays the base file's.
    replaced = {key.rsplit(".", 1)[0] for key in changes if key.endswith("class_path")}
    for key, value in base.items():
        if key == "trainer.name":  # each file names its own runs
            continue
        if key not in changes and not any(key.startswith(f"{section}.") for section in replaced):
            assert got.get(key) == value, f"{key}: base {value!r}, row {got.get(key)!r}"


def _printed_config(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", *args, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


ANALYSIS = str(REPO / "conf/fedproto/analysis.yaml")


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--config", SYNTHETIC, "--config", ANALYSIS], "fedavg_delta0"),
        (["--config", SYNTHETIC, "--config", ANALYSIS, "--trainer.name=mine"], "mine"),
        (["--config", SYNTHETIC, "--trainer.name=mine", "--config", ANALYSIS], "mine"),
    ],
)
def test_print_config_shows_the_name_of_the_first_config_file_or_the_flag(capsys, flags, name):
    assert _printed_config(capsys, *flags)["trainer"]["name"] == name


def test_a_name_written_in_a_later_file_wins_over_the_first_files_name(tmp_path, capsys):
    named = tmp_path / "named.yaml"
    named.write_text("trainer.name: from_file\n")
    assert _printed_config(capsys, "--config", SYNTHETIC, "--config", str(named))["trainer"]["name"] == "from_file"


def test_a_stacked_run_writes_under_the_first_config_files_name(tmp_path):
    addon = tmp_path / "addon.yaml"
    addon.write_text("trainer:\n  rounds: 1\n")
    args = ["fit", "--config", SYNTHETIC, "--config", str(addon), "--trainer.logger=csv", *QUICK]
    run([*args, f"--trainer.default_root_dir={tmp_path}"])
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["fedavg_delta0"]
    saved = yaml.safe_load((tmp_path / "fedavg_delta0" / "version_0" / "config.yaml").read_text())
    assert saved["trainer"]["name"] == "fedavg_delta0" and saved["trainer"]["rounds"] == 1


DELTA50 = REPO / "conf/fedproto/synthetic/fedavg_delta50.yaml"


def _dump(*flags: str) -> dict:
    parser = build_parser()
    dumped = yaml.safe_load(parser.dump(parser.parse_args(["fit", *flags])))["fit"]
    dumped["trainer"].pop("name")  # each file names its own runs
    return dumped


def test_a_nested_section_beside_config_keeps_the_base_files_other_values(tmp_path):
    row = tmp_path / "row.yaml"
    # Relative to the file's own folder, not to the working directory.
    row.write_text(f"config: {os.path.relpath(DELTA50, tmp_path)}\ntrainer:\n  rounds: 3\n")
    addon = tmp_path / "addon.yaml"
    addon.write_text("trainer:\n  rounds: 3\n")
    got = _dump("--config", str(row))
    assert got["trainer"]["rounds"] == 3
    assert got["trainer"]["straggler_fraction"] == 0.5  # from fedavg_delta50.yaml
    assert got["trainer"]["local_epochs"] == 20  # from its own base, base.yaml
    assert got == _dump("--config", str(DELTA50), "--config", str(addon))


def test_config_may_name_several_base_files_applied_in_order(tmp_path):
    (tmp_path / "a.yaml").write_text("trainer:\n  rounds: 5\n  eval_every: 5\n")
    (tmp_path / "b.yaml").write_text("trainer.rounds: 7\n")
    row = tmp_path / "row.yaml"
    row.write_text(f"config: [{DELTA50}, a.yaml, b.yaml]\ntrainer:\n  checkpoint_every: 7\n")
    trainer = _dump("--config", str(row))["trainer"]
    assert (trainer["rounds"], trainer["eval_every"], trainer["checkpoint_every"]) == (7, 5, 7)
    assert trainer["straggler_fraction"] == 0.5


def test_a_dotted_key_into_a_dict_value_of_an_earlier_file_updates_that_dict(tmp_path):
    addon = tmp_path / "addon.yaml"
    addon.write_text("model.init_args.model_kwargs.encoder_weights: null\n")
    stacked = _dump("--config", str(REPO / "conf/fedproto/pascal/base.yaml"), "--config", str(addon))
    kwargs = stacked["model"]["init_args"]["model_kwargs"]
    assert kwargs == {"encoder_name": "mobilenet_v2", "encoder_weights": None, "output_stride": 16}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"row.yaml": "config: row.yaml\n"}, "builds on itself through 'config:' keys"),
        ({"row.yaml": "config: missing.yaml\n"}, "has 'config: missing.yaml', but"),
    ],
)
def test_a_bad_config_key_ends_in_one_message_naming_the_file(tmp_path, capsys, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(tmp_path / "row.yaml")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "row.yaml" in err and "Traceback" not in err


def test_wandb_mode_disabled_in_the_environment_writes_no_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    args = ["fit", "--config", SYNTHETIC, "--trainer.rounds=1", "--trainer.logger=[csv,wandb]", *QUICK]
    run([*args, "--trainer.wandb_mode=offline", f"--trainer.default_root_dir={tmp_path}"])
    run_dir = tmp_path / "fedavg_delta0" / "version_0"
    assert (run_dir / "metrics.csv").is_file()
    assert not (run_dir / "wandb").exists()


def _logged_rounds(offline_run: Path) -> list[int]:
    """The rounds an offline W&B run logged: the values of ``trainer/global_step`` in its history records
    (protobuf items: the key, then field 16, ``value_json``, as one length byte and the JSON text)."""
    data = next(offline_run.glob("run-*.wandb")).read_bytes()
    rounds = set()
    for match in re.finditer(rb"trainer/global_step\x82\x01(.)", data, flags=re.DOTALL):
        rounds.add(int(data[match.end() : match.end() + match.group(1)[0]]))
    return sorted(rounds)


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = ["fit", "--config", SYNTHETIC, "--trainer.logger=[csv,wandb]", *QUICK, "--trainer.checkpoint_every=1"]
    run([*args, "--trainer.rounds=2", f"--trainer.default_root_dir={tmp_path}"])
    run_dir = tmp_path / "fedavg_delta0" / "version_0"
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    run([*args, "--trainer.rounds=3", f"--ckpt_path={ckpt}"])
    wandb.teardown()  # W&B's service writes a finished run's file in the background; this waits for it
    first, resumed = sorted((run_dir / "wandb").glob("offline-run-*"))  # by start time
    run_id = first.name.rsplit("-", 1)[1]
    # the same W&B run, in a second offline folder (W&B appends "-1" when both folders start in the same second)
    assert re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", resumed.name), resumed.name
    assert (_logged_rounds(first), _logged_rounds(resumed)) == ([1, 2], [3])


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit):
        run(["fit", *args])
    return " ".join(capsys.readouterr().out.split())  # undo the line wrapping


def test_help_is_plain_text_without_docstring_markup(capsys):
    text = _help(capsys, "--help")
    assert ":class:" not in text and "``" not in text
    assert "round callbacks (RoundCallback): analyses" in text
    assert "write checkpoints/last.ckpt every this many rounds" in text


def test_help_marks_model_as_required_without_a_default(capsys):
    text = _help(capsys, "--help")
    start = text.index("The client task module")  # the help of --model, not the usage line
    model = text[start : text.index("known subclasses", start)]
    assert "(required, type:" in model and "default: null" not in model


def test_help_documents_the_wandb_options(capsys):
    text = _help(capsys, "--help")
    for flag, doc in [
        ("--trainer.wandb_tags", "W&B tags of the run"),
        ("--trainer.wandb_group", "W&B group"),
        ("--trainer.wandb_entity", "WANDB_ENTITY"),
        ("--trainer.wandb_notes", "shown in W&B"),
        ("--trainer.wandb_project", "WANDB_PROJECT"),
    ]:
        assert flag in text and doc in text


@pytest.mark.parametrize("client", ["ClassificationClient", "SegmentationClient"])
def test_model_help_lists_the_registered_networks(capsys, client):
    text = _help(capsys, f"--model.help={client}")
    entry = " ".join(text[text.index("--model.model MODEL") :].split())
    assert f"Registered: {', '.join(list_models())}; or an import path" in entry


def test_fit_help_names_the_registered_networks_under_model(capsys):
    text = _help(capsys, "--help")
    start = text.index("The client task module")
    names = ", ".join(list_models())
    assert f"--model.init_args.model, is one of {names}" in " ".join(text[start : start + 600].split())


def _readme_section(title: str) -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index(f"### {title}\n")
    return readme[start : readme.find("\n#", start + 4)]


def test_the_readmes_own_network_trains_by_import_path_from_the_working_directory(tmp_path, monkeypatch):
    section = _readme_section("Your own network")
    code = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL).group(1)
    module, name = re.search(r"--model\.init_args\.model=(\w+)\.(\w+)", section).groups()
    (tmp_path / f"{module}.py").write_text(code)
    # As the console script starts: its own folder on sys.path, not the working directory.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            "--config",
            str(REPO / "conf/digits/fedavg.yaml"),
            f"--model.init_args.model={module}.{name}",
            "--model.init_args.model_kwargs={width: 32}",
            "--trainer.rounds=1",
            "--trainer.logger=csv",
            *QUICK,
        ]
    )
    monkeypatch.delitem(sys.modules, module)
    state = ckpt_io.load(tmp_path / "runs" / "fedavg" / "version_0" / "checkpoints" / "last.ckpt")["global_state"]
    shapes = {key: tuple(value.shape) for key, value in state.items()}
    # 8×8 digits flattened into the README's encoder of width 32, then 10 logits
    assert shapes == {
        "net.encoder.1.weight": (32, 64),
        "net.encoder.1.bias": (32,),
        "net.head.weight": (10, 32),
        "net.head.bias": (10,),
    }


def test_environment_variables_fill_in_what_files_and_flags_leave_unset_as_the_readme_says(monkeypatch, capsys):
    monkeypatch.setenv("JSONARGPARSE_DEFAULT_ENV", "true")
    monkeypatch.setenv("FEDLIGHT_FIT__TRAINER__ROUNDS", "7")
    bare = ["fit", "--model=fedlight.clients.ClassificationClient", "--data.dataset=fedlight.data.Digits"]
    for args, rounds in [(bare, 7), (["fit", "--config", SYNTHETIC], 200), ([*bare, "--trainer.rounds=3"], 3)]:
        with pytest.raises(SystemExit):
            run([*args, "--print_config"])
        assert yaml.safe_load(capsys.readouterr().out)["trainer"]["rounds"] == rounds
    assert "JSONARGPARSE_DEFAULT_ENV=true" in (REPO / "README.md").read_text()


def test_the_readme_s_environment_variable_changes_the_shipped_rows(monkeypatch, capsys):
    import re

    variable, value = re.search(r"`(FEDLIGHT_FIT__\w+)=([^`\s]+)`", (REPO / "README.md").read_text()).groups()
    key = variable.removeprefix("FEDLIGHT_FIT__").lower().split("__")  # ["trainer", "wandb_project"]
    # no shipped config sets it, nested or dotted, so it shows in every row
    for path in (REPO / "conf").rglob("*.yaml"):
        content = yaml.safe_load(path.read_text()) or {}
        assert ".".join(key) not in content and key[-1] not in (content.get(key[0]) or {}), path
    monkeypatch.setenv("JSONARGPARSE_DEFAULT_ENV", "true")
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit):
        run(["fit", "--config", str(REPO / "conf/fedsls/cifar10/fedsls_alpha0.5.yaml"), "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)[key[0]][key[1]] == value


def test_a_dict_entry_set_to_null_by_a_flag_is_none(parser):
    """A flag that sets an entry of a dict option to null means None, as the same entry in YAML does."""
    from fedlight.cli import _restore_nulls

    pascal = str(REPO / "conf/fedproto/pascal/fedproto_alpha0.1.yaml")
    for null in ("null", "None"):
        args = ["fit", "--config", pascal, f"--model.init_args.model_kwargs.encoder_weights={null}"]
        cfg = parser.parse_args(args)["fit"]
        _restore_nulls(cfg, args)
        kwargs = cfg.model.init_args.model_kwargs
        assert kwargs == {"encoder_name": "mobilenet_v2", "encoder_weights": None, "output_stride": 16}
    args = ["fit", "--config", pascal, "--model.init_args.model_kwargs.encoder_weights=imagenet"]
    cfg = parser.parse_args(args)["fit"]
    _restore_nulls(cfg, args)
    assert cfg.model.init_args.model_kwargs["encoder_weights"] == "imagenet"


def test_mlflow_s_refusal_of_a_file_store_is_one_message_with_the_fix(tmp_path, monkeypatch, capsys):
    # what jsonargparse raises when MLFlowLogger's constructor refuses (MLflow 3.x's own words, abridged)
    refusal = ValueError(
        "Does not validate against any of the Union subtypes\n  - The filesystem tracking backend (e.g., './mlruns') "
        "is in maintenance mode [...] set `MLFLOW_ALLOW_FILE_STORE=true` to opt out of this exception."
    )

    def instantiate(self, cfg):
        raise refusal

    monkeypatch.setattr(cli.ArgumentParser, "instantiate", instantiate)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", SYNTHETIC, f"--trainer.default_root_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "MLFLOW_ALLOW_FILE_STORE=true" in err and "tracking_uri: sqlite:///mlruns.db" in err
