"""IID, shards, label quantity, quantity skew and Flower's size schemes, each against what its definition implies."""

import itertools

import numpy as np
import pytest

from fedlight.data.partition import (
    IID,
    DirichletSizes,
    ExponentialSizes,
    InnerDirichlet,
    KClasses,
    LinearSizes,
    Partitioner,
    Shards,
    SquareSizes,
    validate_partition,
)
from fedlight.data.partition.summary import partition_statistics

NUM_CLASSES = 10


def balanced_targets(per_class: int = 180) -> np.ndarray:
    return np.tile(np.arange(NUM_CLASSES), per_class)


def skewed_targets(num_samples: int = 4000, seed: int = 1) -> np.ndarray:
    prior = np.arange(1, NUM_CLASSES + 1) / np.arange(1, NUM_CLASSES + 1).sum()
    return np.random.default_rng(seed).choice(NUM_CLASSES, size=num_samples, p=prior)


def split(partitioner: Partitioner, targets: np.ndarray, seed: int = 0) -> list[np.ndarray]:
    return partitioner(targets, NUM_CLASSES, np.random.default_rng(seed))


def sizes_of(parts: list[np.ndarray]) -> list[int]:
    return [int(part.size) for part in parts]


# (partitioner, covers the whole pool of 1,800 balanced labels)
PARTITIONERS = {
    "IID": (IID(num_clients=7), True),
    "Shards": (Shards(num_clients=30, shards_per_client=2), True),
    "KClassesNIIDBench": (KClasses(num_clients=20, classes_per_client=3, assignment="niid_bench"), True),
    "DirichletSizes": (DirichletSizes(num_clients=10, beta=0.5), True),
    "LinearSizes": (LinearSizes(num_clients=6), True),
    "SquareSizes": (SquareSizes(num_clients=6), True),
    "ExponentialSizes": (ExponentialSizes(num_clients=6), True),
    "InnerDirichlet": (InnerDirichlet(partition_sizes=[100, 300, 500, 400], alpha=0.3), False),
}


@pytest.mark.parametrize(("partitioner", "covers"), PARTITIONERS.values(), ids=PARTITIONERS.keys())
def test_partition_is_valid_and_reproducible(partitioner: Partitioner, covers: bool) -> None:
    targets = balanced_targets()
    parts = split(partitioner, targets)
    validate_partition(parts, len(targets), cover=covers)
    assert len(parts) == partitioner.num_clients and min(sizes_of(parts)) > 0
    assert all(np.array_equal(a, b) for a, b in zip(parts, split(partitioner, targets), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, split(partitioner, targets, seed=1), strict=True))


# IID


def test_iid_sizes_differ_by_at_most_one_and_follow_the_pool_label_mix() -> None:
    targets = skewed_targets(num_samples=20003)
    parts = split(IID(num_clients=10), targets)
    assert sorted(set(sizes_of(parts))) == [2000, 2001]
    stats = partition_statistics(targets, parts, NUM_CLASSES)
    pool_mix = np.bincount(targets, minlength=NUM_CLASSES) / len(targets)
    client_mix = stats.counts / stats.sizes[:, None]
    # total variation from the pool's mix; about 0.03 for 2,000 uniform draws, 0.5 for a two-class client
    assert np.abs(client_mix - pool_mix).sum(axis=1).max() / 2 < 0.06


def test_iid_more_clients_than_samples_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--data\.partitioner\.init_args\.num_clients <= 5 .*lower num_clients"):
        split(IID(num_clients=6), np.arange(5) % 2)


# Shards


def test_shards_give_equal_sizes_and_at_most_two_classes_when_shards_do_not_straddle() -> None:
    # 1,800 labels in 60 shards of 30; every class is 6 whole shards
    targets = balanced_targets()
    parts = split(Shards(num_clients=30, shards_per_client=2), targets)
    assert sizes_of(parts) == [60] * 30
    stats = partition_statistics(targets, parts, NUM_CLASSES)
    assert stats.classes_per_client.max() <= 2
    assert np.all(stats.counts % 30 == 0)


def test_shards_are_contiguous_runs_of_the_sorted_labels() -> None:
    # unequal classes: 40 shards of 100, some straddling two classes
    targets = skewed_targets()
    parts = split(Shards(num_clients=20, shards_per_client=2), targets)
    shard_histograms = [np.bincount(run, minlength=NUM_CLASSES) for run in np.sort(targets).reshape(40, 100)]
    for part in parts:
        histogram = np.bincount(targets[part], minlength=NUM_CLASSES)
        pairs = [
            (a, b)
            for a, b in itertools.combinations(range(40), 2)
            if np.array_equal(shard_histograms[a] + shard_histograms[b], histogram)
        ]
        assert pairs, f"client's class counts {histogram.tolist()} are not two shards of the sorted labels"
    # every client's two runs hold at most two classes per run
    assert partition_statistics(targets, parts, NUM_CLASSES).classes_per_client.max() <= 4


def test_shards_refuse_a_shard_count_that_does_not_divide_the_pool() -> None:
    targets = np.arange(1797) % NUM_CLASSES  # scikit-learn digits' size
    with pytest.raises(ValueError, match=r"num_clients × shards_per_client = 20 .*17 over.*drop_remainder=true"):
        split(Shards(num_clients=10), targets)
    parts = split(Shards(num_clients=10, drop_remainder=True), targets)
    validate_partition(parts, len(targets))
    assert sizes_of(parts) == [178] * 10  # 1,780 kept, 20 shards of 89
    with pytest.raises(ValueError, match=r"= 12 exceeds the pool's 10 samples"):
        split(Shards(num_clients=6), np.arange(10) % 2)


# NIID-Bench's "#C = k"


def test_k_classes_niid_bench_holds_own_class_plus_random_others_and_covers_the_pool() -> None:
    targets = skewed_targets()
    parts = split(KClasses(num_clients=23, classes_per_client=3, assignment="niid_bench"), targets)
    validate_partition(parts, len(targets), cover=True)  # client u holds u mod 10, so every class has a holder
    for u, part in enumerate(parts):
        classes = np.unique(targets[part])
        assert classes.size == 3 and u % NUM_CLASSES in classes
    assert all(np.unique(targets[p]).size == 1 for p in split(KClasses(10, 1, "niid_bench"), targets))


# Flower's size schemes and NIID-Bench's quantity skew


@pytest.mark.parametrize(
    ("scheme", "expected"),
    [
        # units i + 1 = 1, 2, 3, 4 of 10: exact
        (LinearSizes, [10, 20, 30, 40]),
        # (i + 1)² = 1, 4, 9, 16 of 30: 3.33, 13.33, 30, 53.33 → 3, 13, 30, 53, the one left over to the last
        (SquareSizes, [3, 13, 30, 54]),
        # e^(i + 1) of 84.79: 3.21, 8.71, 23.69, 64.39 → 3, 8, 23, 64, the two left over to the last
        (ExponentialSizes, [3, 8, 23, 66]),
    ],
)
def test_size_schemes_follow_flowers_formula_and_rounding(scheme: type, expected: list[int]) -> None:
    targets = np.arange(100) % NUM_CLASSES
    parts = split(scheme(num_clients=4), targets)
    validate_partition(parts, 100, cover=True)
    assert sizes_of(parts) == expected


def test_exponential_sizes_refuse_an_empty_client() -> None:
    # e^1 / Σ e^(i + 1) over 10 clients is 0.00008: client 0 would get nothing of 1,000
    with pytest.raises(ValueError, match=r"client 0 only 0 .*num_clients=10; lower num_clients"):
        split(ExponentialSizes(num_clients=10), np.arange(1000) % NUM_CLASSES)


def test_dirichlet_sizes_sum_to_the_pool_and_average_one_over_k() -> None:
    targets = balanced_targets()
    proportions = []
    for seed in range(300):
        sizes = np.array(sizes_of(split(DirichletSizes(num_clients=4, beta=0.5), targets, seed)))
        assert sizes.sum() == len(targets) and sizes.min() >= 10
        proportions.append(sizes / len(targets))
    # each q_k ~ Beta(0.5, 1.5) has sd 0.25, so the mean of 300 has sd 0.014
    np.testing.assert_allclose(np.mean(proportions, axis=0), 0.25, atol=0.05)
    spread = {beta: np.std(sizes_of(split(DirichletSizes(10, beta=beta), targets))) for beta in (0.3, 100.0)}
    assert spread[0.3] > 3 * spread[100.0]


def test_dirichlet_sizes_bad_inputs_name_the_flags() -> None:
    with pytest.raises(ValueError, match=r"init_args\.beta > 0, got 0"):
        DirichletSizes(beta=0)
    with pytest.raises(ValueError, match=r"lower --data\.partitioner\.init_args\.min_size or num_clients"):
        split(DirichletSizes(num_clients=200), balanced_targets())


def test_size_schemes_match_flwr_datasets() -> None:
    datasets = pytest.importorskip("datasets")
    partitioner = pytest.importorskip("flwr_datasets.partitioner")
    targets = skewed_targets(num_samples=1797)
    ours = {"Linear": LinearSizes, "Square": SquareSizes, "Exponential": ExponentialSizes}
    for name, scheme in ours.items():
        for num_clients in (1, 3, 7):
            flower = getattr(partitioner, f"{name}Partitioner")(num_partitions=num_clients)
            flower.dataset = datasets.Dataset.from_dict({"label": targets})
            expected = [len(flower.load_partition(i)) for i in range(num_clients)]
            assert sizes_of(split(scheme(num_clients=num_clients), targets)) == expected, (name, num_clients)


# InnerDirichlet


def test_inner_dirichlet_sizes_are_exactly_as_given() -> None:
    targets = skewed_targets()
    sizes = [700, 50, 1200, 1, 2049]  # all 4,000: some classes run out before the last clients fill
    parts = split(InnerDirichlet(partition_sizes=sizes, alpha=0.1), targets)
    validate_partition(parts, len(targets), cover=True)
    assert sizes_of(parts) == sizes


def test_inner_dirichlet_lower_alpha_gives_fewer_classes_per_client() -> None:
    targets = balanced_targets()
    classes = {
        alpha: partition_statistics(
            targets, split(InnerDirichlet([60] * 20, alpha=alpha), targets), NUM_CLASSES
        ).classes_per_client.mean()
        for alpha in (0.05, 100.0)
    }
    assert classes[0.05] < 3 and classes[100.0] > 9


def test_inner_dirichlet_bad_inputs_name_the_flags() -> None:
    with pytest.raises(ValueError, match=r"partition_sizes to list at least one size, all >= 1.*\n.*alpha > 0"):
        InnerDirichlet(partition_sizes=[3, 0], alpha=-1.0)
    with pytest.raises(ValueError, match=r"partition_sizes to sum to at most the pool's 1800 samples, got 1801"):
        split(InnerDirichlet([1800, 1]), balanced_targets())
    with pytest.raises(ValueError, match=r"alpha to be one value or 10 \(one per class\), got 3 values"):
        split(InnerDirichlet([10], alpha=[1.0, 1.0, 1.0]), balanced_targets())
