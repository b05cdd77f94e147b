"""The round's client states for rules that gather them, read in column blocks within a memory budget.

Each process keeps the flat states of its own aggregated clients on its CPU (``ClientStates.own``), nothing
more. A rule reads the ``[K, P]`` matrix of all clients' states in blocks of ``c`` columns
(:class:`~fedlight.strategies.base.StateChunks`); reading one block sends every process's rows of those columns
to all processes (one broadcast per process that holds rows) and lays them out in the order of the round's
aggregated clients. With K rows of 4 bytes, ``c`` is the largest width whose block ``K × c × 4`` bytes fits the
budget: all P columns, one block, when the whole matrix does.

A process therefore holds its own clients' states and one gathered block at a time (plus a copy of its largest
sender's rows while they arrive), instead of every client's whole state and the pickled copies of an
all-gather of objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedlight.strategies.base import StateChunks


def block_width(num_clients: int, numel: int, element_size: int, budget_bytes: float) -> int:
    """Columns per block: all ``numel`` when ``num_clients × numel`` elements fit the budget, else the most that do
    (at least one).

    >>> block_width(10, 1000, 4, 1 << 20), block_width(10, 1000, 4, 4000), block_width(10, 1000, 4, 1)
    (1000, 100, 1)
    """
    return max(1, min(numel, int(budget_bytes // (num_clients * element_size))))


@dataclass
class ClientStates:
    """A process's share of the round's gathered states.

    Attributes:
        own: this process's aggregated clients' flat states (CPU), by client.
        owners: for every process (rank order), the clients whose states it holds; all processes know all of it.
    """

    own: dict[int, torch.Tensor] = field(default_factory=dict)
    owners: list[list[int]] = field(default_factory=list)

    def chunks(self, clients: list[int], like: torch.Tensor, budget_bytes: float, rank: int = 0) -> StateChunks:
        """The ``[K, P]`` states of ``clients`` (rows in that order) as blocks that fit ``budget_bytes``, with the
        dtype and on the device of ``like`` (W^t, ``[P]``).

        Every process must read the same blocks in the same order: with several processes, each read is a
        collective operation.
        """
        owners = self.owners or [sorted(self.own)]
        position = {client: row for row, client in enumerate(clients)}
        numel, dtype, device = like.numel(), like.dtype, like.device
        width = block_width(len(clients), numel, dtype.itemsize, budget_bytes)

        def read(columns: slice) -> torch.Tensor:
            if len(owners) == 1:
                return torch.stack([self.own[client][columns] for client in clients]).to(device, dtype)
            block = torch.empty(len(clients), columns.stop - columns.start, dtype=dtype, device=device)
            for sender, held in enumerate(owners):
                if not held:
                    continue
                if sender == rank:
                    rows = torch.stack([self.own[client][columns] for client in held]).to(device, dtype)
                else:
                    rows = torch.empty(len(held), block.shape[1], dtype=dtype, device=device)
                torch.distributed.broadcast(rows, src=sender)
                block[torch.tensor([position[client] for client in held], device=device)] = rows
            return block

        return StateChunks(read, len(clients), numel, width)
