"""``--ckpt_path`` on the command line: ``last`` resolved to a run folder's checkpoint, a checkpoint's own
configuration stacked before the flags that change it, and the command that resumes a stopped run."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Collection
from pathlib import Path

import yaml

from fedlight import checkpoint as ckpt_io
from fedlight.errors import ConfigError


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``--flag=value`` or ``--flag value`` in ``args`` (the last one given)."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


def with_checkpoint_config(args: list[str], folder: Path, subcommands: Collection[str]) -> list[str]:
    """A subcommand with ``--ckpt_path`` and no ``--config``: the checkpoint's own configuration is stacked first,
    so later flags change only what they name (more rounds, other data to evaluate, other devices). ``last``
    without ``--config`` is the newest run under ``--trainer.default_root_dir`` (``runs``), whatever its name."""
    if not args or args[0] not in subcommands:
        return args
    if any(arg in ("-c", "--config") or arg.startswith(("--config=", "-c=")) for arg in args[1:]):
        return args
    path = flag_value(args, "--ckpt_path")
    if path is None:
        return args
    if path == "last":
        root = Path(flag_value(args, "--trainer.default_root_dir") or "runs")
        path = str(last_checkpoint(sorted(root.glob("*/version_*")), args[0], rounds=None, where=f"{root}/*"))
        args = [*without_flag(args, "--ckpt_path"), "--ckpt_path", path]
    config = ckpt_io.load(path).get("config")
    if config is None or config.get("origin") == "python":  # a description of Python objects, not a config file
        raise ConfigError(
            f"--ckpt_path {path} holds no configuration file's settings (it was written from Python): pass the run's "
            "--config too."
        )
    stored = folder / "checkpoint_config.yaml"
    stored.write_text(yaml.safe_dump({k: v for k, v in config.items() if k != "ckpt_path"}, sort_keys=False))
    return [args[0], "--config", str(stored), *args[1:]]


def without_flag(args: list[str], flag: str) -> list[str]:
    """``args`` without ``flag``, given as ``flag value`` or ``flag=value``."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(f"{flag}="):
            out.append(arg)
    return out


def last_checkpoint(versions: list[Path], subcommand: str, rounds: int | None, where: str) -> Path:
    """``--ckpt_path last``: among the run folders ``versions``, newest first, ``fit`` takes the newest run that has
    not finished its rounds (one to resume), ``validate`` and ``test`` the newest that has (else the newest of
    all, said on the console). A run has finished when its checkpoint holds ``rounds`` rounds (the command's
    ``--trainer.rounds``), or, when ``rounds`` is None, the rounds of its own configuration. Newest means the
    highest ``version_<n>`` within one name and the most recently written checkpoint across names."""

    def newest_first(folder: Path) -> tuple[float, int]:
        number = folder.name.split("_")[1]
        return (folder / "checkpoints" / ckpt_io.LAST).stat().st_mtime, int(number) if number.isdigit() else -1

    found = [v for v in versions if (v / "checkpoints" / ckpt_io.LAST).is_file() and v.name.split("_")[1].isdigit()]
    if len({v.parent for v in found}) == 1:
        found.sort(key=lambda v: int(v.name.split("_")[1]), reverse=True)
    else:
        found.sort(key=newest_first, reverse=True)
    states = []
    for version in found:
        path = version / "checkpoints" / ckpt_io.LAST
        state = ckpt_io.load(path)
        target = rounds if rounds is not None else ((state.get("config") or {}).get("trainer") or {}).get("rounds")
        done = int(state["round"])
        states.append((path, done, target))
        if (subcommand == "fit") == (target is not None and done < target):
            print(f"fedlight: --ckpt_path last is {path} (round {done} of {target})", file=sys.stderr)
            return path
    if not states:
        raise ConfigError(
            f"--ckpt_path last found no checkpoints/last.ckpt under {where}/version_*. Pass the checkpoint's path, "
            "or the --config (and --trainer.name / --trainer.default_root_dir) of the run that wrote it."
        )
    path, done, target = states[0]
    if subcommand == "fit":
        raise ConfigError(
            f"--ckpt_path last found no unfinished run under {where}/version_*: the newest, {path}, holds all "
            f"{done} of its rounds. Raise --trainer.rounds to continue it, or pass the checkpoint's path."
        )
    print(
        f"fedlight: --ckpt_path last is {path} (round {done} of {target}): no run under {where} has finished "
        "its rounds, so the newest is scored.",
        file=sys.stderr,
    )
    return path


def resume_command(args: list[str], checkpoint: Path) -> str:
    """The command line ``args`` with ``--ckpt_path`` set to ``checkpoint``, as a shell would take it.

    >>> resume_command(["fit", "--config", "a.yaml", "--ckpt_path=old.ckpt"], Path("/runs/v0/checkpoints/last.ckpt"))
    'fedlight fit --config a.yaml --ckpt_path /runs/v0/checkpoints/last.ckpt'
    """
    kept = without_flag(args, "--ckpt_path")
    return shlex.join(["fedlight", *kept, "--ckpt_path", str(checkpoint)])
