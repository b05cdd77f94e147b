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

import sys
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

from fedlight.clients.base import FederatedClient
from fedlight.data.datamodule import FederatedDataModule
from fedlight.errors import ConfigError
from fedlight.strategies.base import Strategy
from fedlight.trainer import FederatedTrainer

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

    parser = build_parser()
    cfg = parser.parse_args(args)
    name = cfg.subcommand
    sub_cfg: Namespace = cfg[name]
    if sub_cfg.trainer.name == "fedlight" and sub_cfg.config:
        sub_cfg.trainer.name = Path(str(sub_cfg.config[-1])).stem
    resolved = _resolved_config(parser, cfg, name)
    lightning.seed_everything(sub_cfg.seed_everything, verbose=False)
    try:
        objects = parser.instantiate(cfg)[name]
    except ValueError as err:
        # jsonargparse wraps errors raised by constructors; surface ours as they were written.
        raise _config_error_in(err) or err from None
    method = getattr(objects.trainer, name)
    return method(objects.model, objects.data, objects.strategy, ckpt_path=sub_cfg.ckpt_path, config=resolved)


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
    try:
        run(args)
    except ConfigError as err:
        print(f"fedlight: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("fedlight: interrupted; resume with --ckpt_path <run_dir>/checkpoints/last.ckpt", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
