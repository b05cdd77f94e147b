"""The ``fedlight`` command: ``fit``, ``validate`` and ``test`` with LightningCLI's conventions.

A config has the top-level keys ``seed_everything``, ``trainer``, ``model``, ``data``, ``strategy``
and ``ckpt_path``. ``model``, ``strategy`` and the dataset/partitioner inside ``data`` are chosen with
``class_path``/``init_args``. Later ``--config`` files override earlier ones and dotted flags after
them override both::

    fedlight fit --config conf/fedproto/synthetic/fedavg_delta0.yaml --trainer.rounds=20
    fedlight fit --config conf/fedproto/synthetic/fedavg_delta0.yaml --print_config
    fedlight validate --config conf/fedproto/synthetic/fedavg_delta0.yaml --ckpt_path runs/.../last.ckpt

The command is a plain jsonargparse parser rather than ``LightningCLI``: the trainer is not a
Lightning ``Trainer`` subclass, and importing ``lightning.pytorch.cli`` costs seconds per process.
"""

from __future__ import annotations

import itertools
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

from fedlight.clients.base import FederatedClient
from fedlight.data.datamodule import FederatedDataModule
from fedlight.errors import ConfigError, RunInterrupted
from fedlight.strategies.base import Strategy
from fedlight.trainer import FederatedTrainer

MAX_SEED = 2**32 - 1

SUBCOMMANDS = {
    "fit": "Train the global model for --trainer.rounds rounds (or resume with --ckpt_path).",
    "validate": "Evaluate a checkpoint's global model on every client's held-out split.",
    "test": "Evaluate a checkpoint's global model on the global test set.",
}


def _subcommand_parser(description: str) -> ArgumentParser:
    parser = ArgumentParser(description=description)
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="A YAML config; may be given several times.")
    parser.add_argument(
        "--seed_everything",
        type=int,
        default=0,
        help="Seed of the initial model and of every client's random stream; set before anything is built.",
    )
    # The seed is the top-level seed_everything.
    parser.add_class_arguments(FederatedTrainer, "trainer", skip={"seed"})
    parser.add_subclass_arguments(FederatedClient, "model", required=True)
    parser.add_class_arguments(FederatedDataModule, "data")
    # The data decide the model's output and input sizes, as LightningCLI's examples link them.
    parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
    parser.link_arguments("data.input_shape", "model.init_args.input_shape", apply_on="instantiate")
    parser.add_subclass_arguments(Strategy, "strategy", default={"class_path": "fedlight.strategies.FedAvg"})
    parser.add_argument(
        "--ckpt_path",
        type=str | None,
        default=None,
        help="A checkpoint (<run_dir>/checkpoints/last.ckpt): fit resumes it, validate/test evaluate its model.",
    )
    return parser


def build_parser() -> ArgumentParser:
    """The ``fedlight`` parser with its three subcommands."""
    parser = ArgumentParser(
        prog="fedlight",
        description="Federated learning of vision models on Lightning Fabric. "
        "Run 'fedlight fit --help' for every option.",
    )
    subcommands = parser.add_subcommands(required=True, dest="subcommand")
    for name, description in SUBCOMMANDS.items():
        subcommands.add_subcommand(name, _subcommand_parser(description), help=description)
    return parser


def run(args: list[str] | None = None) -> dict[str, float]:
    """Parses ``args``, builds everything after seeding, and runs the subcommand. Used by tests in-process."""
    import lightning

    check_config_files(sys.argv[1:] if args is None else args)
    parser = build_parser()
    cfg = parser.parse_args(args)
    name = cfg.subcommand
    sub_cfg: Namespace = cfg[name]
    if sub_cfg.trainer.name == "fedlight" and sub_cfg.config:
        sub_cfg.trainer.name = Path(str(sub_cfg.config[-1])).stem
    if not 0 <= sub_cfg.seed_everything <= MAX_SEED:
        raise ConfigError(
            f"Expected --seed_everything in [0, {MAX_SEED}] (numpy's seed range), got {sub_cfg.seed_everything}."
        )
    resolved = _resolved_config(parser, cfg, name)
    lightning.seed_everything(sub_cfg.seed_everything, verbose=False)
    try:
        objects = parser.instantiate(cfg)[name]
    except ValueError as err:
        # jsonargparse wraps errors raised by constructors; surface ours as they were written.
        raise _config_error_in(err) or err from None
    method = getattr(objects.trainer, name)
    return method(objects.model, objects.data, objects.strategy, ckpt_path=sub_cfg.ckpt_path, config=resolved)


def check_config_files(args: list[str]) -> None:
    """Refuses a ``--config`` file (or a file it builds on with ``config:``) that is missing, empty, not valid
    YAML or not a mapping, naming the file and the line, before the parser reports it without either."""
    files = [Path(a.split("=", 1)[1]) for a in args if a.startswith("--config=")]
    files += [Path(b) for a, b in itertools.pairwise(args) if a in ("--config", "-c")]
    problems, seen = [], set()
    while files:
        path = files.pop()
        if path in seen:
            continue
        seen.add(path)
        if not path.is_file():
            problems.append(f"--config {path} does not exist.")
            continue
        try:
            content = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problems.append(f"--config {path} is not valid YAML{where}: {getattr(err, 'problem', None) or err}.")
            continue
        if content is None:
            problems.append(f"--config {path} is empty: give it at least one setting, or leave it out.")
        elif not isinstance(content, dict):
            problems.append(f"--config {path} holds a {type(content).__name__}, not 'key: value' settings.")
        elif isinstance(content.get("config"), str):
            files.append(path.parent / content["config"])
    if problems:
        raise ConfigError(*problems)


def resume_command(args: list[str], checkpoint: Path) -> str:
    """The command line ``args`` with ``--ckpt_path`` set to ``checkpoint``, as a shell would take it.

    >>> resume_command(["fit", "--config", "a.yaml", "--ckpt_path=old.ckpt"], Path("/runs/v0/checkpoints/last.ckpt"))
    'fedlight fit --config a.yaml --ckpt_path /runs/v0/checkpoints/last.ckpt'
    """
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return shlex.join(["fedlight", *kept, "--ckpt_path", str(checkpoint)])


def _resolved_config(parser: ArgumentParser, cfg: Namespace, name: str) -> dict[str, Any]:
    dumped = yaml.safe_load(parser.dump(cfg))[name]
    dumped.pop("config", None)
    return dumped


def _config_error_in(err: BaseException) -> ConfigError | None:
    """The first :class:`ConfigError` in an exception's chain of causes, if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, ConfigError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def main(args: list[str] | None = None) -> None:
    """Console entry point: errors a user can fix are printed as one message, without a traceback."""
    args = sys.argv[1:] if args is None else args
    try:
        run(args)
    except ConfigError as err:
        print(f"fedlight: error: {err}", file=sys.stderr)
        sys.exit(2)
    except RunInterrupted as err:
        message = f"fedlight: {err}."
        if err.checkpoint is not None and args and args[0] == "fit":
            message += f" Resume with:\n  {resume_command(args, err.checkpoint.resolve())}"
        print(message, file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print("fedlight: interrupted before the first round; nothing was written to resume from.", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
