"""A seconds-long twin of FUSS's centroid aggregation: FedAvg vs FedCC when clients' centroids are misaligned.

FUSS (§4.2.2, Eqs. 14–16) argues that averaging centroid matrices index by index mixes unrelated
prototypes once clients have learnt their clusters in different orders, and that clustering the pooled
centroids (FedCC-kMeans) or selecting far-apart ones (FedCC-Maximin) does not. This script isolates that
step from everything else (no images, no backbone, no head):

1. n class prototypes are random unit directions in D = 70 dimensions; a sample of class c is the
   normalised prototype plus Gaussian noise (per-coordinate std ``noise / √D``).
2. Every client draws class proportions from Dir(α) and its samples from them, so it sees a few classes.
3. Every client's centroids start from one shared standard-normal matrix with its rows in a client-specific
   order (the misalignment; ``--aligned`` keeps one order for all, the paper's aligned case, Eqs. 19–20).
   They are trained with FUSS's centroid loss (Eq. 5 as the official code has it: cosine, hard assignment,
   only the centroids learn; :class:`fedlight.clients.stego.ClusterLookup`) by Adam at lr 5e-3 on
   mini-batches of the client's samples.
4. The server aggregates the clients' final centroids with FedAvg (weighted by sample counts, index by
   index), FedCC-kMeans and FedCC-Maximin, on raw rows as the official code does and, as a variant, on
   L2-normalised rows. With ``--rounds`` > 1 the clients restart from the aggregate and train again.
5. Every aggregate, and each client's own centroids after the first round ("local", averaged over
   clients), labels a balanced held-out set by nearest centroid (cosine); the score is the
   Hungarian-matched mIoU of those labels.

    python benchmarks/fuss/centroid_twin.py              # 27 classes, 6 clients, 5 seeds: seconds after imports
    python benchmarks/fuss/centroid_twin.py --reduced    # CI size
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedlight.clients.stego import ClusterLookup
from fedlight.metrics.functional.unsupervised import cluster_histogram, matched_scores
from fedlight.strategies.functional import kmeans_centroids, maximin_select, weighted_average


@dataclass
class Twin:
    """Sizes and training settings of one twin run."""

    classes: int = 27
    dim: int = 70
    clients: int = 6
    alpha: float = 0.3
    samples_per_client: int = 600
    test_per_class: int = 100
    noise: float = 0.8
    steps: int = 300
    batch_size: int = 64
    lr: float = 5e-3
    rounds: int = 1
    aligned: bool = False


def draw(prototypes: torch.Tensor, labels: torch.Tensor, noise: float, generator: torch.Generator) -> torch.Tensor:
    """Samples ``[N, D]`` of classes ``labels`` ``[N]``: unit prototype plus noise of norm ≈ ``noise``."""
    dim = prototypes.shape[1]
    return prototypes[labels] + noise / dim**0.5 * torch.randn(len(labels), dim, generator=generator)


def centroid_loss(centroids: torch.Tensor, batches: torch.Tensor) -> torch.Tensor:
    """Σ over clients of FUSS's centroid loss, all clients at once: ``[K, n, D]`` centroids, ``[K, B, D]`` samples.

    Client k's term is −mean_b max_n ⟨ẑ_kb, M̂_kn⟩, :meth:`ClusterLookup.loss` of its own batch; the terms
    share no parameter, so one Adam on the stack steps every client exactly as its own Adam would.
    """
    similarities = torch.einsum("kbd,knd->kbn", F.normalize(batches, dim=2), F.normalize(centroids, dim=2))
    return -similarities.max(dim=2).values.mean(dim=1).sum()


def train_centroids(starts: torch.Tensor, data: torch.Tensor, twin: Twin, generator: torch.Generator) -> torch.Tensor:
    """Every client's centroids ``[K, n, D]`` after ``twin.steps`` Adam steps of the centroid loss from ``starts``.

    Args:
        starts: ``[K, n, D]`` the clients' centroids before the round.
        data: ``[K, N, D]`` the clients' samples.
        twin: sizes and settings.
        generator: source of the mini-batches.
    """
    centroids = starts.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([centroids], lr=twin.lr)  # re-created every round, as FUSS does
    clients = torch.arange(data.shape[0])[:, None]  # [K, 1]
    for _ in range(twin.steps):
        batches = data[clients, torch.randint(data.shape[1], (data.shape[0], twin.batch_size), generator=generator)]
        loss = centroid_loss(centroids, batches)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return centroids.detach()


def check_centroid_loss(generator: torch.Generator) -> None:
    """The batched loss is the sum of :class:`ClusterLookup`'s, client by client."""
    centroids, batches = torch.randn(3, 5, 7, generator=generator), torch.randn(3, 11, 7, generator=generator)
    expected = 0.0
    for m, z in zip(centroids, batches, strict=True):
        lookup = ClusterLookup(*m.shape)
        lookup.clusters.data.copy_(m)
        expected += lookup.loss(z[:, :, None, None]).item()  # codes as [B, D, 1, 1] maps
    actual = centroid_loss(centroids, batches).item()
    assert abs(actual - expected) < 1e-5, f"batched centroid loss {actual} differs from ClusterLookup's {expected}"


def miou(centroids: torch.Tensor, samples: torch.Tensor, labels: torch.Tensor) -> float:
    """Hungarian-matched mIoU of labelling ``samples`` by their most cosine-similar centroid."""
    clusters = (F.normalize(samples, dim=1) @ F.normalize(centroids, dim=1).T).argmax(dim=1)
    histogram = cluster_histogram(clusters, labels, len(centroids), int(labels.max()) + 1, ignore_index=None)
    return matched_scores(histogram)["miou"].item()


def aggregators(twin: Twin) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Server rules: ``(client centroids [K, n, D], sample counts [K]) → global centroids [n, D]``."""
    n = twin.classes
    return {
        "FedAvg (index-wise)": lambda m, w: weighted_average(m.flatten(1), w).view(m.shape[1:]),
        "FedCC-kMeans": lambda m, w: kmeans_centroids(m.flatten(0, 1), n),
        "FedCC-kMeans (L2-normalised)": lambda m, w: kmeans_centroids(m.flatten(0, 1), n, normalize=True),
        "FedCC-Maximin": lambda m, w: maximin_select(m.flatten(0, 1), n),
        "FedCC-Maximin (L2-normalised)": lambda m, w: maximin_select(F.normalize(m.flatten(0, 1), dim=1), n),
    }


def run_seed(twin: Twin, seed: int) -> dict[str, float]:
    """Scores of every rule (after the last round) and of the clients' own centroids, for one seed."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    prototypes = F.normalize(torch.randn(twin.classes, twin.dim, generator=generator), dim=1)  # [n, D]
    test_labels = torch.arange(twin.classes).repeat_interleave(twin.test_per_class)
    test = draw(prototypes, test_labels, twin.noise, generator)
    client_data = []
    for _ in range(twin.clients):
        shares = rng.dirichlet(np.full(twin.classes, twin.alpha))
        labels = torch.from_numpy(rng.choice(twin.classes, size=twin.samples_per_client, p=shares))
        client_data.append(draw(prototypes, labels, twin.noise, generator))
    client_data = torch.stack(client_data)  # [K, N, D]
    counts = torch.full((twin.clients,), float(twin.samples_per_client))  # FedAvg's n_k, equal here
    init = torch.randn(twin.classes, twin.dim, generator=generator)  # the broadcast initial M
    orders = [torch.randperm(twin.classes, generator=generator) for _ in range(twin.clients)]
    starts = init.expand(twin.clients, -1, -1) if twin.aligned else torch.stack([init[order] for order in orders])

    local = train_centroids(starts, client_data, twin, generator)  # [K, n, D] the first round, shared by all rules
    scores = {"local (each client's own, round 1)": float(np.mean([miou(m, test, test_labels) for m in local]))}
    for name, aggregate in aggregators(twin).items():
        round_generator = torch.Generator().manual_seed(seed + 1)  # later rounds draw the same batches for every rule
        global_centroids = aggregate(local, counts)
        for _ in range(twin.rounds - 1):
            broadcast = global_centroids.expand(twin.clients, -1, -1)
            global_centroids = aggregate(train_centroids(broadcast, client_data, twin, round_generator), counts)
        scores[name] = miou(global_centroids, test, test_labels)
    scores["prototypes (upper bound)"] = miou(prototypes, test, test_labels)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="CI size: 10 classes, 4 clients, 100 steps, 2 seeds")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 5, reduced 2)")
    parser.add_argument("--rounds", type=int, default=1, help="aggregation rounds; clients restart from the aggregate")
    parser.add_argument("--aligned", action="store_true", help="control: every client starts from the same row order")
    parser.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration of the clients' classes")
    parser.add_argument("--clients", type=int, default=None, help="number of clients (default 6, reduced 4)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    twin = Twin(classes=10, clients=4, steps=100, samples_per_client=300) if args.reduced else Twin()
    twin.rounds, twin.alpha, twin.aligned = args.rounds, args.alpha, args.aligned
    twin.clients = args.clients or twin.clients
    seeds = range(args.seeds or (2 if args.reduced else 5))

    check_centroid_loss(torch.Generator().manual_seed(0))
    start = time.perf_counter()
    runs = [run_seed(twin, seed) for seed in seeds]
    elapsed = time.perf_counter() - start
    print(
        f"{twin.classes} classes in {twin.dim}-D, {twin.clients} clients with Dir({twin.alpha}) classes, "
        f"{twin.steps} Adam steps (lr {twin.lr}) per round, {twin.rounds} round(s), "
        f"{'aligned' if twin.aligned else 'permuted'} initial centroids, seeds {list(seeds)}\n"
    )
    print("| centroids | mIoU (%) mean ± std |")
    print("|---|---|")
    for name in runs[0]:
        values = 100 * np.array([run[name] for run in runs])
        print(f"| {name} | {values.mean():.1f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.1f} |")
    print(f"\n{elapsed:.1f} s")


if __name__ == "__main__":
    main()
