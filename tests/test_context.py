"""The helpers hooks use to read every client's data once: map over clients, sum over clients."""

from types import SimpleNamespace

import torch

from fedlight.context import RunContext


def context(rank=0, world_size=1):
    return RunContext(SimpleNamespace(fabric=SimpleNamespace(global_rank=rank, world_size=world_size)))


def test_map_clients_returns_every_clients_result_in_order():
    assert context().map_clients(lambda k: k * k, [3, 1, 2]) == [9, 1, 4]


def test_each_process_computes_only_its_share():
    seen = []
    ctx = context(rank=1, world_size=2)
    ctx.all_gather_objects = lambda mine: [{0: "a", 2: "c"}, mine]  # what rank 0 would send
    assert ctx.map_clients(lambda k: seen.append(k) or str(k), [10, 11, 12, 13]) == ["a", "11", "c", "13"]
    assert seen == [11, 13]


def test_sum_over_clients_adds_into_the_given_tensor():
    total = context().sum_over_clients(lambda k: torch.tensor([k, 1.0]), range(4), torch.zeros(2))
    assert total.tolist() == [0 + 1 + 2 + 3, 4]
