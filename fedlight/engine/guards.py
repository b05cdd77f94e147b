"""Failure guards: what the engine does with a client that fails, diverges or moves too far, and with a global
model that becomes non-finite.

A client whose local fit raises is left out of its round, counted, and its traceback kept in
``<run_dir>/client_errors/``; a round in which every client failed stops the run. A client state with NaN/Inf,
or one that moved more than ``max_update_ratio`` × (‖W^t‖ + 1) from where it started, is left out of the
aggregate with a warning. A global model that becomes non-finite stops the run, naming the last good checkpoint.
"""

from __future__ import annotations

import errno
import math
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from fedlight import checkpoint as ckpt_io
from fedlight.engine.config import GuardSettings
from fedlight.errors import ConfigError, error_line
from fedlight.plans import ClientPlan, ClientUpdate


class RoundAbandoned(Exception):
    """Raised on every rank when a stop request ends the local fits of a round before all clients trained."""


class FailureGuards:
    """Applies the guards of ``settings``; ``run_dir`` gives the run folder once it exists (None before)."""

    def __init__(self, settings: GuardSettings, run_dir: Callable[[], Path | None], rank: int) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.rank = rank

    def failed_fit(self, round_idx: int, plan: ClientPlan, num_samples: int, err: Exception) -> ClientUpdate:
        """The update of a client whose local fit raised ``err``; its traceback goes to the run folder."""
        run_dir = self.run_dir()
        if run_dir is not None:
            folder = run_dir / "client_errors"
            folder.mkdir(parents=True, exist_ok=True)
            text = "".join(traceback.format_exception(err))
            (folder / f"round{round_idx + 1}_client{plan.client}.txt").write_text(text)
        update = ClientUpdate(plan.client, num_samples, plan.epochs, 0, math.nan)
        update.finite = False
        update.payload["error"] = error_line(err)
        return update

    def check_round(self, round_idx: int, skipped: bool, failed: int, trained: int) -> None:
        """After every rank's clients (``skipped``, ``failed`` and ``trained`` summed over ranks): abandons the round
        if a rank skipped clients after a stop request, and stops the run if every client of the round failed."""
        if skipped:
            raise RoundAbandoned
        if trained and failed == trained:
            run_dir = self.run_dir()
            where = f"; the tracebacks are in {run_dir / 'client_errors'}" if run_dir is not None else ""
            last = None if run_dir is None else run_dir / "checkpoints" / ckpt_io.LAST
            kept = (
                f" The last checkpoint, {last}, is intact: resume from it once fixed."
                if last and last.is_file()
                else ""
            )
            raise ConfigError(
                f"Every one of the {trained} clients of round {round_idx + 1} failed its local fit{where}. "
                f"Nothing is left to aggregate, so the run stopped.{kept} Pass --trainer.fail_fast=true to stop at "
                "the first failure with its traceback."
            )

    def excluded(self, round_idx: int, update: ClientUpdate, state: torch.Tensor, start: torch.Tensor) -> bool:
        """Whether a client's state is left out of the aggregate: non-finite, or moved too far to be a training step.

        ‖W_k − W^t‖ > max_update_ratio · (‖W^t‖ + 1), W^t being the bank member ``start`` the client started from.
        A norm that overflows fp32 is inf, which exceeds any bound.
        """
        if not update.finite:
            warnings.warn(
                f"Client {update.client} returned a state with NaN/Inf in round {round_idx + 1}; it is left out "
                "of the aggregate. Lower the learning rate if this repeats.",
                stacklevel=1,
            )
            return True
        ratio = self.settings.max_update_ratio
        if ratio is None:
            return False
        bound = ratio * (torch.linalg.vector_norm(start).item() + 1.0)
        norm = torch.linalg.vector_norm(state - start).item()
        if norm <= bound:
            return False
        update.finite = False
        update.payload["update_norm"] = norm
        warnings.warn(
            f"Client {update.client}'s update in round {round_idx + 1} has norm {norm:.3g}, more than "
            f"--trainer.max_update_ratio={ratio:g} × (‖W^t‖ + 1) = {bound:.3g}; it is left out of the aggregate. "
            "Lower the learning rate, or raise --trainer.max_update_ratio if such steps are expected.",
            stacklevel=1,
        )
        return True

    def warn_failed(self, round_idx: int, failed: list[ClientUpdate], trained: int) -> None:
        """One warning per round (rank 0) for the clients whose local fit raised."""
        if self.rank != 0 or not failed:
            return
        listed = ", ".join(f"client {u.client} ({u.payload['error']})" for u in failed[:3])
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        run_dir = self.run_dir()
        where = "" if run_dir is None else f"; tracebacks in {run_dir / 'client_errors'}"
        warnings.warn(
            f"{len(failed)} of {trained} clients failed their local fit in round {round_idx + 1} and are left out of "
            f"the aggregate: {listed}{more}{where}. Pass --trainer.fail_fast=true to stop at the first failure.",
            stacklevel=1,
        )

    def none_aggregated(self, round_idx: int, updates: list[ClientUpdate]) -> ConfigError:
        """The error that stops a run in whose round ``round_idx`` every client was left out as non-finite or
        outsized: the global model would stay as it was, round after round, and the run would end untrained."""
        outsized = sum("update_norm" in u.payload for u in updates)
        failed = sum("error" in u.payload for u in updates)
        failures = f", {failed} failed their local fit" if failed else ""
        return ConfigError(
            f"No client of round {round_idx + 1} could be aggregated: of its {len(updates)} clients, "
            f"{len(updates) - outsized - failed} returned NaN/Inf and {outsized} moved further than "
            f"--trainer.max_update_ratio allows{failures}. The run stopped and {self._kept()} with a lower learning "
            "rate (--model.init_args.optimizer)."
        )

    def _kept(self) -> str:
        """What is left to resume from: the last good checkpoint, or nothing yet."""
        run_dir = self.run_dir()
        last = None if run_dir is None else run_dir / "checkpoints" / ckpt_io.LAST
        return (
            f"the last good checkpoint, {last} (round {ckpt_io.saved_round(last)}), is intact: resume from it"
            if last is not None and last.is_file()
            else "no checkpoint was written yet: start again"
        )

    def diverged(self, round_idx: int, strategy_name: str) -> ConfigError:
        """The error that stops a run whose global model became non-finite in round ``round_idx``."""
        kept = self._kept()
        return ConfigError(
            f"The global model became non-finite (NaN/Inf) in round {round_idx + 1}, after {strategy_name}'s "
            f"aggregation; the run stopped and {kept} with a lower learning rate (--model.init_args.optimizer) or a "
            "lower --trainer.max_update_ratio."
        )


def disk_full(err: OSError, run_dir: Path | None) -> ConfigError | None:
    """The error that replaces an ``OSError`` of a full disk or quota while the run wrote its files in ``run_dir``,
    saying whether its last checkpoint is intact to resume from; None for other errors."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT) or run_dir is None:
        return None
    last = run_dir / "checkpoints" / ckpt_io.LAST
    advice = (
        f"the last checkpoint is intact: free space and resume with --ckpt_path {last}"
        if last.is_file()
        else "no checkpoint was written yet: free space and start again"
    )
    return ConfigError(f"No space left on the disk while writing the run's files in {run_dir}; {advice}.")
