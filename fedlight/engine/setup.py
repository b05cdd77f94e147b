"""Set-up checks and preparation of a run's data and checkpoint, before any run folder exists.

What a run needs from outside (the data, ``--trainer.init_from``, ``--ckpt_path``) is looked at here, so that a
bad value stops the run with one message before anything is written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlight import checkpoint as ckpt_io
from fedlight.engine.console import counted
from fedlight.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from fedlight.data.datamodule import FederatedDataModule

log = logging.getLogger(__name__)


def check_init_from(init_from: Path | None, ckpt_path: str | Path | None) -> None:
    """``--trainer.init_from`` must exist when a run starts from it. Checked when the run starts, not when the
    trainer is built: a stage's config is valid before its source run exists."""
    if ckpt_path is None and init_from is not None and not init_from.is_file():
        raise ConfigError(
            f"--trainer.init_from {init_from} does not exist. Pass a checkpoint of an earlier run "
            "(<run_dir>/checkpoints/last.ckpt) or a file holding a state_dict; run the stage that writes it first."
        )


def prepare_data(
    datamodule: FederatedDataModule, clients_per_round: int, device: torch.device
) -> tuple[FederatedDataModule, dict[str, str]]:
    """The partitioned data on ``device`` and the digests of the partition and the samples, taken before the move
    (``checkpoint.data_fingerprint``, checked on resume)."""
    datamodule.setup()
    if clients_per_round > datamodule.num_clients:
        raise ConfigError(
            f"--trainer.clients_per_round={clients_per_round} exceeds the {datamodule.num_clients} clients of the "
            "partition. Lower it, or raise the number of clients of --data."
        )
    fingerprint = ckpt_io.data_fingerprint(datamodule)
    if datamodule.test is not None and len(datamodule.held_out_index) == 0:
        log.info("--data.test_fraction=0 holds nothing out: only the global test set is evaluated.")
    return datamodule.to(device), fingerprint


def check_round_size(strategy: Any, clients_per_round: int, straggler_fraction: float) -> None:
    """The rule's own bounds on the clients that train each round (Krum's K > 2f + 2, Bulyan's K ≥ 4f + 3):
    ``clients_per_round``, less the ``round(K·δ)`` stragglers a rule that does not tolerate them drops."""
    trained = clients_per_round
    if not strategy.tolerate_stragglers:
        trained = round(clients_per_round * (1.0 - straggler_fraction))  # as straggler_plan draws them
    problems = strategy.check_round_size(clients_per_round, trained)
    if trained == 0:
        problems.append(
            f"--trainer.straggler_fraction={straggler_fraction} makes all {clients_per_round} clients of a round "
            f"stragglers, which {type(strategy).__name__} drops: no client would ever be aggregated. Lower it, or set "
            "--strategy.init_args.tolerate_stragglers=true."
        )
    if problems:
        raise ConfigError(*problems)


def rounds_left(ckpt_path: str | Path, state: dict[str, Any], rounds: int) -> bool:
    """Whether a resume from ``state`` has rounds to run under ``--trainer.rounds``; refuses one whose checkpoint
    holds more rounds than that."""
    done = int(state["round"])
    if done > rounds:
        raise ConfigError(
            f"--ckpt_path {ckpt_path} holds {counted(done, 'round')}, more than --trainer.rounds={rounds}: there "
            f"is nothing to resume. Pass --trainer.rounds above {done} to continue the run, or score it with "
            "fedlight validate / test."
        )
    return done < rounds


def planned_rounds(state: dict[str, Any]) -> int | None:
    """``trainer.rounds`` of the configuration a checkpoint was written with, if it holds one."""
    return ((state.get("config") or {}).get("trainer") or {}).get("rounds")
