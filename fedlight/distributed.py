"""Spreading a round's clients over processes.

Ranks train *different* clients, so nothing is wrapped in ``DistributedDataParallel`` (its gradient
all-reduces would never pair up across ranks): each rank trains its share sequentially on one
resident module, adds the resulting states into a local weighted sum, and one all-reduce of that flat
buffer per round combines the ranks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from lightning.fabric.strategies import DDPStrategy


class ClientParallelStrategy(DDPStrategy):
    """Fabric's DDP process group and launcher, without wrapping the module.

    fedlight never calls ``fabric.setup(module)``; this subclass makes that explicit, so a module that
    is set up by accident is not wrapped in DDP.
    """

    def setup_module(self, module):
        return module


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
