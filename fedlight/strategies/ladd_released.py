"""What LADD's released code does beyond its paper: the test loop, the client listing and their pure maths.

LADD (Shenaj et al., WACV 2023) reports numbers from its released code (github.com/Erosinho13/LADD), which in
a few places does something its paper does not describe. fedlight follows the paper by default; these helpers
let :class:`~fedlight.strategies.ladd.LADD` run as the code runs (``docs/ladd.md`` has the whole table):

- **Test-time routing.** The code gives every test image a cluster by its own style, in dataset order
  (``LADDClient.find_test_images_cluster``), but scores the images through a loader whose
  ``DistributedSampler`` shuffles them (seed 0, its epoch never advanced, one image a batch): the i-th image
  it scores is scored by the cluster of the i-th image of the dataset (:func:`released_routes`), which is an
  unrelated image's cluster, so the routing agrees with the image's own cluster only by chance.
- **The "global" score of clustered runs.** The test loop keeps the global weights as the model's
  ``state_dict()``, whose tensors are the model's own; loading a cluster model overwrites them, so from the
  second image on the "global" model is the previous image's cluster model (:func:`released_global_members`).
- **The last client of the listing.** The code loads each client's cluster model into one shared model, in
  the order the clients were listed, so every client's pseudo-label teacher is the cluster model of the last
  client listed (:func:`last_listed_client`).

The functions take the own-style cluster of every test image in dataset order (``own``) and the order the
code's loader visits them (``order``, :func:`sampler_order`), and return, per dataset index, the bank member
that scores the image (−1 for the global model).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedlight.metrics.scalars import scalar_metrics

if TYPE_CHECKING:
    from fedlight.context import RunContext
    from fedlight.data.datamodule import FederatedDataModule

GLOBAL = -1  # the member index of the global model


def sampler_order(n: int, seed: int = 0) -> torch.Tensor:
    """``[n]`` the order in which a shuffling ``DistributedSampler`` (one process, ``seed``, epoch 0) reads n samples.

    >>> from torch.utils.data.distributed import DistributedSampler
    >>> sampler_order(6).tolist() == list(DistributedSampler(range(6), num_replicas=1, rank=0, seed=0))
    True
    """
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def released_routes(own: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``[N]`` the cluster that scores each test image (by dataset index) in the code's test loop.

    The image visited i-th, ``order[i]``, is scored by the cluster of dataset image i, ``own[i]``.

    >>> released_routes(torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1])).tolist()
    [1, 2, 0]
    """
    routes = torch.empty_like(own)
    routes[order] = own
    return routes


def released_global_members(own: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``[N]`` the member behind the code's "global" score of each test image (by dataset index), −1: the global model.

    The first image visited is scored by the global model; each later one by the cluster model of the image
    visited before it, ``own[i − 1]``, which the test loop left in the weights it keeps as the global ones.

    >>> released_global_members(torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1])).tolist()
    [0, 1, -1]
    """
    members = torch.empty_like(own)
    members[order[0]] = GLOBAL
    members[order[1:]] = own[:-1]
    return members


def last_listed_client(datamodule: FederatedDataModule) -> int:
    """The index of the client the dataset lists last: for natural clients the one whose first sample comes last
    in the pool (the order of the split files), otherwise the last client."""
    groups = datamodule.pool.groups
    if groups is None:
        return datamodule.num_clients - 1
    ids, first = np.unique(groups, return_index=True)  # ids sorted: fedlight's client order
    if len(ids) != datamodule.num_clients:  # not a natural partition: the clients have no listing of their own
        return datamodule.num_clients - 1
    return int(np.argmax(first))


def image_digests(x: torch.Tensor) -> list[str]:
    """A digest of each image of a ``[B, ...]`` batch, to find it again in the test set."""
    pixels = x.detach().float().cpu().contiguous().numpy()
    return [hashlib.blake2b(image.tobytes(), digest_size=16).hexdigest() for image in pixels]


def chance_agreement(own: torch.Tensor) -> float:
    """Σ_c p_c², the share of images a random reassignment of the clusters leaves on their own cluster in expectation.

    >>> chance_agreement(torch.tensor([0, 0, 1, 1]))
    0.5
    """
    shares = torch.bincount(own).double() / len(own)
    return float((shares**2).sum())


@torch.no_grad()
def score_test_set(context: RunContext, members: torch.Tensor) -> dict[str, Any]:
    """The test metrics of the resident module when each test image (by dataset index) is scored by the bank
    member ``members[i]`` (−1: the global model); one pass of each member over its images.

    Batches are shared over processes as in the engine's evaluation, and the metric's states are summed.
    The module is left holding the global model.
    """
    module, layout, data, precision = context.module, context.layout, context.datamodule, context.precision
    metric = module.evaluation_metric(1).to(context.device)
    batches, start = [], 0
    for batch_idx, batch in enumerate(data.test_batches()):
        size = len(batch[0])
        if batch_idx % context.world_size == context.rank:
            batches.append((batch_idx, batch, members[start : start + size].to(batch[0].device)))
        start += size
    module.eval()
    for member in members.unique().tolist():
        state = context.global_state if member == GLOBAL else context.bank.member(member)
        layout.load(module, state, context.global_integers)
        for batch_idx, batch, chosen in batches:
            chosen = chosen == member
            if bool(chosen.any()):
                part = precision.convert_input(tuple(t[chosen] for t in batch))
                with precision.forward_context():
                    metric.update(**module.validation_step(part, batch_idx))
    layout.load(module, context.global_state, context.global_integers)
    return {k: v for k, v in scalar_metrics(metric.compute()).items() if k in module.test_metrics}
