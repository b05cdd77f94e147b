"""What the hooks of strategies and round callbacks see of a run.

Hooks receive a :class:`RunContext` as their first argument instead of the trainer: a small, documented
surface (the round, the resident module and its layout, the global state or bank, the data, the random
streams, the process group and two helpers) that the engine keeps up to date. A hook that needs more than
this is a sign that the work belongs in the engine.

========================  ====================================================================
``rounds``, ``round``     T, and the round in progress (or the next one, between rounds)
``plans``                 the round's :class:`~fedlight.strategies.base.ClientPlan` list
``module``                the resident client module (one per process, reused by every client)
``layout``                its federated :class:`~fedlight.state.FlatState`
``bank``                  the :class:`~fedlight.bank.ModelBank`; ``global_state`` is its W^t
``global_module()``       the resident module with W^t loaded, in eval mode
``datamodule``            the federated data (``client_batches``, ``num_samples``, …)
``client_state``          during a client's fit, its own slots (rules that keep per-client state)
``precision``             Fabric's precision plugin (``convert_input``, ``forward_context``)
``rank``, ``world_size``  this process and the number of processes; ``device``
``round_rng``, …          the derived random streams (``strategy_rng``, ``client_seed``)
``due(t, every)``         whether work done every ``every`` rounds is due after round t (and after the last)
``map_clients(fn, ks)``   runs ``fn(k)`` for this process's share of ``ks``; every process gets all results
``local_train(...)``      the engine's own local training loop, for warm-ups outside the rounds
``all_reduce``            sums a tensor over processes
``run_dir``, ``name``…    where the run writes; ``log_images`` sends pictures to W&B
========================  ====================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from lightning import LightningModule
    from lightning.fabric.plugins import Precision

    from fedlight.bank import ModelBank
    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.plans import ClientPlan
    from fedlight.state import FlatState

T = TypeVar("T")


class RunContext:
    """A run as its hooks see it; built by the trainer, read-only for hooks.

    Args:
        run: the trainer's :class:`~fedlight.engine.run.Run`. It is held privately: hooks use the names below.
    """

    def __init__(self, run: Any) -> None:
        self._run = run

    # -- the run ---------------------------------------------------------------------------------------
    def due(self, round_idx: int, every: int) -> bool:
        """Whether work done every ``every`` rounds (0: only after the last) is due after round ``round_idx``."""
        return due(round_idx, every, self.rounds)

    @property
    def rounds(self) -> int:
        return self._run.rounds

    @property
    def round(self) -> int:
        return self._run.round

    @property
    def plans(self) -> list[ClientPlan]:
        return self._run.plans

    @property
    def seed(self) -> int:
        return self._run.seed

    @property
    def name(self) -> str:
        return self._run.name

    @property
    def run_dir(self) -> Path | None:
        return self._run.run_dir

    @property
    def config(self) -> dict[str, Any] | None:
        return self._run.config

    @property
    def callbacks(self) -> list[Any]:
        return self._run.callbacks

    # -- models and data -------------------------------------------------------------------------------
    @property
    def module(self) -> LightningModule:
        return self._run.model.module

    @property
    def layout(self) -> FlatState:
        return self._run.model.layout

    @property
    def bank(self) -> ModelBank:
        return self._run.model.bank

    @property
    def global_state(self) -> torch.Tensor:
        return self._run.model.global_state

    @property
    def global_integers(self) -> dict[str, torch.Tensor]:
        return self._run.model.integers

    def global_module(self) -> LightningModule:
        """The resident module with W^t loaded, in eval mode; the next local fit loads its own state into it."""
        return self._run.model.evaluation_module()

    @property
    def datamodule(self) -> FederatedDataModule:
        return self._run.datamodule

    @property
    def client_state(self) -> dict[str, torch.Tensor]:
        """The slots of the client in training (``Strategy.client_state_slots``), by name, on the training device.

        Valid from ``on_client_fit_start`` to ``on_client_fit_end``: a rule reads its vector slots and replaces
        them with new tensors of the same size; the engine keeps what the dict holds when the fit ends (and the
        local slots' entries of the trained state).
        """
        store = self._run.model.client_states
        if store is None or store.current is None:
            raise RuntimeError("context.client_state is read outside a local fit, or the rule declares no slots")
        return store.current

    @property
    def precision(self) -> Precision:
        return self._run.fabric.strategy.precision

    # -- processes -------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._run.fabric.global_rank

    @property
    def world_size(self) -> int:
        return self._run.fabric.world_size

    @property
    def device(self) -> torch.device:
        return self._run.fabric.device

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over processes (itself with one process)."""
        if self.world_size == 1:
            return tensor
        return self._run.fabric.all_reduce(tensor, reduce_op="sum")

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        return all_gather_objects(obj, self.world_size)

    def map_clients(self, fn: Callable[[int], T], clients: Sequence[int]) -> list[T]:
        """``[fn(k) for k in clients]``, each computed by one process and handed to all of them.

        Process r computes the clients at positions r, r + world_size, …; results (tensors, numbers,
        containers of them) travel once, in one gather. Every process must call it with the same clients.
        """
        clients = list(clients)
        mine = {i: fn(clients[i]) for i in range(self.rank, len(clients), self.world_size)}
        if self.world_size > 1:
            for shard in self.all_gather_objects(mine):
                mine.update(shard)
        return [mine[i] for i in range(len(clients))]

    def sum_over_clients(self, fn: Callable[[int], torch.Tensor], clients: Sequence[int], out: torch.Tensor):
        """``Σ_k fn(k)`` over ``clients``, added into ``out`` (zeros of the result's shape) and returned.

        Process r adds the clients at positions r, r + world_size, …, and one all-reduce adds the processes'
        sums, so every process returns the same tensor. Sufficient statistics (feature sums, counts,
        gradients) of all clients cost one pass over each client's data and one collective.
        """
        clients = list(clients)
        for i in range(self.rank, len(clients), self.world_size):
            out += fn(clients[i])
        return self.all_reduce(out)

    def local_train(
        self,
        client: int,
        epochs: int,
        seed: int,
        module: LightningModule | None = None,
        full_batches: bool = True,
        loss: Callable[[LightningModule, Any, dict[str, torch.Tensor]], torch.Tensor] | None = None,
    ) -> int:
        """Trains ``module`` (the resident one by default) on a client's data with the engine's loop.

        A fresh optimizer from ``configure_optimizers``, ``epochs`` epochs of the client's batches shuffled
        from ``seed`` (which also seeds dropout), the task loss of ``training_step`` or ``loss(module, batch,
        outputs)``. With ``full_batches`` an epoch's short last batch is skipped, unless it is all the client
        has. For warm-ups before the first round (FedSLS's static weights) and for a second training inside a
        client's fit (FedRep's head epochs, Ditto's personal model); returns the number of steps.
        """
        training = self._run.pieces.training
        return training.train_outside_rounds(module or self.module, client, epochs, seed, full_batches, loss)

    # -- randomness ------------------------------------------------------------------------------------
    def round_rng(self, round_idx: int) -> np.random.Generator:
        """The generator of round ``round_idx``'s server-side draws (sampling, stragglers)."""
        return self._run.streams.round_rng(round_idx)

    def strategy_rng(self, round_idx: int) -> np.random.Generator:
        """A generator for a strategy's own server-side draws in round ``round_idx``."""
        return self._run.streams.strategy_rng(round_idx)

    def client_seed(self, round_idx: int, client: int) -> int:
        """The seed of client ``client``'s stream in round ``round_idx``."""
        return self._run.streams.client_seed(round_idx, client)

    # -- output ----------------------------------------------------------------------------------------
    def log_images(self, images: dict[str, list[Any]], step: int) -> None:
        """Sends images (file paths, arrays or PIL images) to W&B under their keys, from rank 0."""
        self._run.pieces.loggers.log_images(images, step)


def all_gather_objects(obj: Any, world_size: int) -> list[Any]:
    """``obj`` of every process, in rank order (pickled; for small objects)."""
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


def due(round_idx: int, every: int, rounds: int) -> bool:
    """Whether work done every ``every`` rounds (0: only after the last) is due after round ``round_idx`` (from 0)
    of ``rounds``: after rounds ``every``, ``2·every``, … counted from 1, and always after the last.

    >>> [r for r in range(7) if due(r, 3, 7)], [r for r in range(7) if due(r, 0, 7)]
    ([2, 5, 6], [6])
    """
    return (every > 0 and (round_idx + 1) % every == 0) or round_idx == rounds - 1
