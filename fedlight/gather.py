"""The round's client states for rules that gather them, read in column blocks within a memory budget.

Each process keeps the flat states of its own aggregated clients on its CPU (``ClientStates.own``), nothing
more. A rule reads the ``[K, P]`` matrix of all clients' states in blocks of ``c`` columns
(:class:`StateChunks`); reading one block sends every process's rows of those columns
to all processes (one broadcast per process that holds rows) and lays them out in the order of the round's
aggregated clients. With K rows of 4 bytes, ``c`` is the largest width whose block ``K × c × 4`` bytes fits the
budget: all P columns, one block, when the whole matrix does.

A process therefore holds its own clients' states and one gathered block at a time (plus a copy of its largest
sender's rows while they arrive), instead of every client's whole state and the pickled copies of an
all-gather of objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch


class StateChunks:
    """The round's ``[K, P]`` client states, one row per aggregated client (in the order of ``updates``), read in
    blocks of ``width`` columns.

    Only the block being read is in memory; the engine gathers it from the processes that hold its rows.
    :attr:`peak_nbytes` is the size of the largest block read so far.

    Args:
        read: returns the ``[K, stop − start]`` columns ``columns`` of the states.
        num_clients: K.
        numel: P.
        width: columns per block (clipped to [1, P]).

    >>> chunks = StateChunks.of(torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 9.0]]), width=2)
    >>> [columns for columns, _ in chunks]
    [slice(0, 2, None), slice(2, 3, None)]
    >>> chunks.apply(lambda block: block.mean(dim=0)).tolist(), chunks.peak_nbytes
    ([2.0, 3.0, 6.0], 16)
    """

    def __init__(self, read: Callable[[slice], torch.Tensor], num_clients: int, numel: int, width: int) -> None:
        self._read = read
        self.num_clients = num_clients
        self.numel = numel
        self.width = max(1, min(width, numel))
        self.peak_nbytes = 0

    @classmethod
    def of(cls, states: torch.Tensor, width: int | None = None) -> StateChunks:
        """The chunks of states already in memory (``[K, P]``); one block unless ``width`` is given."""
        return cls(lambda columns: states[:, columns], states.shape[0], states.shape[1], width or states.shape[1])

    def read(self, columns: slice) -> torch.Tensor:
        """``[K, c]``: the columns ``columns`` of every client's state."""
        block = self._read(columns)
        self.peak_nbytes = max(self.peak_nbytes, block.nbytes)
        return block

    def __iter__(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(columns, [K, c] block)`` for consecutive blocks of ``width`` columns, left to right."""
        for start in range(0, self.numel, self.width):
            columns = slice(start, min(start + self.width, self.numel))
            yield columns, self.read(columns)

    def full(self) -> torch.Tensor:
        """All ``[K, P]`` states at once, whatever the budget (for rules that cannot work by blocks)."""
        return self.read(slice(0, self.numel))

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``[P]``: a coordinate-wise ``fn`` (``[K, c] → [c]``) applied to every block, the results laid end to end."""
        return torch.cat([fn(block) for _, block in self])

    def map(self, fn: Callable[[slice, torch.Tensor], torch.Tensor]) -> StateChunks:
        """The states with every block replaced by ``fn(columns, block)`` (same shape) as it is read."""
        return StateChunks(lambda columns: fn(columns, self.read(columns)), self.num_clients, self.numel, self.width)

    def rows(self, index: Sequence[int] | torch.Tensor) -> StateChunks:
        """The states of the rows ``index`` only (e.g. the clients Krum selected), in that order."""
        index = torch.as_tensor(index, dtype=torch.long)

        def read(columns: slice) -> torch.Tensor:
            block = self.read(columns)
            return block[index.to(block.device)]

        return StateChunks(read, len(index), self.numel, self.width)


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
