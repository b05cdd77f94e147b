"""Processes: starting them, spreading a round's clients over them, and their threads.

Ranks train *different* clients, so nothing is wrapped in ``DistributedDataParallel`` (its gradient
all-reduces would never pair up across ranks): each rank trains its share sequentially on one
resident module, adds the resulting states into a local weighted sum, and one all-reduce of that flat
buffer per round combines the ranks. With ``--trainer.start_method=fork`` the ranks are forked from the calling
process, and rank 0 hands its outcome back to it (:func:`in_forked_processes`, :class:`Ranks`).
"""

from __future__ import annotations

import heapq
import os
import pickle
import tempfile
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.distributed.constants import default_pg_timeout

from fedlight.engine.config import ProcessSettings
from fedlight.engine.stopping import StopRequest
from fedlight.errors import ConfigError

#: environment variables by which a launcher tells a process where it stands in a multi-node run
LAUNCHER_VARIABLES = {
    "torchrun": ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "SLURM (srun)": ("SLURM_NTASKS", "SLURM_PROCID"),
    "LSF (jsrun)": ("LSB_JOBID", "JSM_NAMESPACE_RANK"),
    "Lightning's variables": ("MASTER_ADDR", "NODE_RANK"),
}


class ClientParallelStrategy(DDPStrategy):
    """Fabric's DDP process group and launcher, without wrapping the module.

    fedlight never calls ``fabric.setup(module)``; this subclass makes that explicit, so a module that
    is set up by accident is not wrapped in DDP.

    Args:
        rendezvous_timeout: seconds to wait for the other processes when the process group forms; the
            collectives of the rounds keep PyTorch's default timeout (30 minutes).
    """

    def __init__(self, *args, rendezvous_timeout: float = 300.0, **kwargs) -> None:
        super().__init__(*args, timeout=timedelta(seconds=rendezvous_timeout), **kwargs)
        self.rendezvous_timeout = rendezvous_timeout

    def setup_module(self, module):
        return module

    def setup_environment(self) -> None:
        try:
            super().setup_environment()
        except RuntimeError as err:  # torch's DistStoreError and gloo's timeouts are RuntimeErrors
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            env = self.cluster_environment
            raise ConfigError(
                f"Waited {self.rendezvous_timeout:g} s (--trainer.rendezvous_timeout) at "
                f"{env.main_address}:{env.main_port} for the {self.world_size} processes of "
                f"--trainer.num_nodes={self.num_nodes} × --trainer.devices={self.num_processes}, but not all of them "
                "came. Start the command on every node (README: Several processes and nodes), check that this "
                "address and port can be reached from each node, or raise --trainer.rendezvous_timeout."
            ) from None
        if torch.distributed.is_initialized():  # the rounds' collectives wait as long as PyTorch's default
            set_timeout = getattr(torch.distributed, "set_timeout", None)  # public in newer torch, private before
            (set_timeout or torch.distributed.distributed_c10d._set_pg_timeout)(default_pg_timeout)


def run_fabric(settings: ProcessSettings, callbacks: list[Any] | None) -> Fabric:
    """The Fabric of ``settings``: one process, or the processes of :class:`ClientParallelStrategy`."""
    parallel = None
    if settings.devices * settings.num_nodes > 1:
        parallel = ClientParallelStrategy(
            start_method=settings.start_method, rendezvous_timeout=settings.rendezvous_timeout
        )
    return Fabric(
        accelerator=settings.accelerator, devices=settings.devices, num_nodes=settings.num_nodes,
        precision=settings.precision, strategy=parallel or "auto", callbacks=callbacks,
    )  # fmt: skip


def missing_launcher(num_nodes: int, devices: int, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The problem of a multi-node run started without a launcher, which would wait for the others forever.

    >>> missing_launcher(2, 4, environ={"MASTER_ADDR": "n1", "RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0"})
    []
    >>> len(missing_launcher(2, 4, environ={}))
    1
    """
    if num_nodes == 1 or any(all(v in environ for v in names) for names in LAUNCHER_VARIABLES.values()):
        return []
    found = "; ".join(f"{launcher}: {', '.join(names)}" for launcher, names in LAUNCHER_VARIABLES.items())
    return [
        f"--trainer.num_nodes={num_nodes} needs a launcher that starts the command on every node, but none set "
        f"its variables ({found}), so this process would wait for the other nodes forever. On every node run:\n"
        f"  torchrun --nnodes={num_nodes} --nproc_per_node={devices} --node_rank=<this node's rank, 0…"
        f"{num_nodes - 1}> --master_addr=<node 0's address> --master_port=29500 -m fedlight fit <your flags>\n"
        f"or, under SLURM, srun with --ntasks-per-node={devices}. On one machine, use --trainer.num_nodes=1 "
        "and --trainer.devices for its processes."
    ]


def assign_clients(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Greedy longest-processing-time scheduling of clients onto ranks.

    Clients are taken from the most to the least expensive and each goes to the rank with the least
    work so far (ties: the lower rank). Every rank computes the same assignment from the same plan.

    Args:
        costs: estimated work of each client (samples × epochs).
        world_size: number of ranks.

    Returns:
        For every rank, the positions in ``costs`` it trains, in increasing order.

    >>> assign_clients([5, 1, 4, 2, 3], 2)
    [[0, 1, 3], [2, 4]]
    """
    loads = [(0.0, rank) for rank in range(world_size)]
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for position in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        shares[rank].append(position)
        heapq.heappush(loads, (load + costs[position], rank))
    return [sorted(share) for share in shares]


def forks(fabric: Fabric) -> bool:
    """Whether ``fabric`` starts its processes by forking this one (``--trainer.start_method=fork``)."""
    return isinstance(fabric.strategy.launcher, _MultiProcessingLauncher)


def in_forked_processes(
    fabric: Fabric, work: Callable[[], Any], outcome: Callable[[Any], dict[str, Any]]
) -> dict[str, Any]:
    """Runs ``work`` in processes forked from this one and returns rank 0's ``outcome(result)``, or raises the
    ``ConfigError`` that stopped it, as one process would.

    Rank 0 hands its outcome back through a file: Fabric returns it through a pipe that is read only after the
    processes exit, so anything over the pipe's buffer (~64 KiB) would never be sent. A Ctrl-C reaches the forked
    processes too, which end their round and save; this one waits for them.
    """

    def forked(fabric: Fabric, outcome_file: Path) -> None:
        try:
            result = work()
        except ConfigError as err:  # reported once, by the launching process, as a one-process run reports it
            if fabric.global_rank == 0:
                outcome_file.write_bytes(pickle.dumps({"error": err}))
            return
        if fabric.global_rank == 0:
            outcome_file.write_bytes(pickle.dumps(outcome(result)))

    with tempfile.TemporaryDirectory(prefix="fedlight-fork-") as folder, StopRequest(announce=False):
        outcome_file = Path(folder) / "outcome.pkl"
        try:
            fabric.launch(forked, outcome_file)
        except Exception:
            if not outcome_file.is_file():
                raise
        handed = pickle.loads(outcome_file.read_bytes())
    if "error" in handed:  # as the error would have come out of one process
        raise handed["error"] from None
    return handed


class Ranks:
    """Where a run's work runs on every rank: in this process (one process, or ``popen``, where this process is rank 0
    and :meth:`launch` starts the others), or in processes forked from this one, which hand rank 0's outcome back."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.forked = False  # true inside the processes that start_method=fork created

    def launch(self) -> None:
        """Starts the other processes of a ``popen`` or multi-node run (forked processes were started already)."""
        if not self.forked:
            self.fabric.launch()

    def run(
        self, work: Callable[[], Any], outcome: Callable[[Any], dict[str, Any]]
    ) -> tuple[Any, dict[str, Any] | None]:
        """``work()`` on every rank, and where the ranks were forked from this process, rank 0's ``outcome`` of it
        for this process to take over (None otherwise)."""
        if not forks(self.fabric) or self.forked:
            return work(), None

        def forked() -> Any:
            self.forked = True
            return work()

        handed = in_forked_processes(self.fabric, forked, outcome)
        return handed["result"], handed


def resolve_threads(threads: int | Literal["auto"], device: torch.device) -> int | None:
    """The intra-op threads that ``--trainer.threads`` asks of each process, or None for torch's default.

    Read before Lightning's launcher sets ``OMP_NUM_THREADS`` for the processes it starts, so that ``auto``
    follows only the user's own setting.

    >>> resolve_threads(3, torch.device("cpu")), resolve_threads("auto", torch.device("cuda"))
    (3, None)
    """
    if threads != "auto":
        return threads
    if device.type != "cpu":
        return None
    return int(os.environ.get("OMP_NUM_THREADS") or 1)
