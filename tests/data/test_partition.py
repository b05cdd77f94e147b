import numpy as np
import pytest

from fedlight.data.partition import (
    Dirichlet,
    DirichletPowerLaw,
    KClasses,
    Natural,
    Partitioner,
    PowerLaw,
    validate_partition,
)
from fedlight.data.partition.dirichlet_power_law import draw_class_counts, pareto_sizes

NUM_CLASSES = 10


def balanced_targets(per_class: int = 180, num_classes: int = NUM_CLASSES) -> np.ndarray:
    """Labels shaped like scikit-learn's digits (about 180 per class), interleaved as a real pool is."""
    return np.tile(np.arange(num_classes), per_class)


def skewed_targets(num_samples: int = 4000, seed: int = 1) -> np.ndarray:
    """Unequal class sizes, so that priors and class exhaustion matter."""
    prior = np.arange(1, NUM_CLASSES + 1) / np.arange(1, NUM_CLASSES + 1).sum()
    return np.random.default_rng(seed).choice(NUM_CLASSES, size=num_samples, p=prior)


def mean_distinct_classes(parts: list[np.ndarray], targets: np.ndarray) -> float:
    return float(np.mean([np.unique(targets[part]).size for part in parts]))


# (partitioner, covers the whole pool)
PARTITIONERS = [
    (PowerLaw(num_clients=100, base_samples=2), False),
    (KClasses(num_clients=20, classes_per_client=2), True),
    (KClasses(num_clients=17, classes_per_client=3, assignment="random"), False),
    (Dirichlet(num_clients=20, alpha=0.5), True),
    (DirichletPowerLaw(num_clients=20, alpha=0.5), True),
]


@pytest.mark.parametrize(
    ("partitioner", "covers"), PARTITIONERS, ids=["PowerLaw", "KClasses", "KClassesRandom", "Dirichlet", "DirPL"]
)
def test_partition_is_valid_and_deterministic(partitioner: Partitioner, covers: bool) -> None:
    targets = balanced_targets()
    parts = partitioner(targets, NUM_CLASSES, np.random.default_rng(0))
    validate_partition(parts, len(targets), cover=covers)
    assert len(parts) == partitioner.num_clients
    assert all(part.dtype == np.int64 and part.size > 0 for part in parts)
    assert sum(part.size for part in parts) <= len(targets)

    again = partitioner(targets, NUM_CLASSES, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partitioner(targets, NUM_CLASSES, np.random.default_rng(1))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_validate_partition_reports_overlap_gaps_and_dtype() -> None:
    with pytest.raises(ValueError, match="more than one client"):
        validate_partition([np.array([0, 1]), np.array([1, 2])], num_samples=3)
    with pytest.raises(ValueError, match="1 of 3 samples belong to no client"):
        validate_partition([np.array([0]), np.array([2])], num_samples=3, cover=True)
    with pytest.raises(ValueError, match=r"not 1-d int64.*outside"):
        validate_partition([np.array([0, 5], dtype=np.int32)], num_samples=3)
    with pytest.raises(ValueError, match="not sorted"):
        validate_partition([np.array([1, 0])], num_samples=3)


# PowerLaw


def test_power_law_gives_each_client_its_consecutive_classes_and_is_skewed() -> None:
    targets = balanced_targets()
    parts = PowerLaw(num_clients=100, base_samples=2)(targets, NUM_CLASSES, np.random.default_rng(0))
    for u, part in enumerate(parts):
        classes, counts = np.unique(targets[part], return_counts=True)
        assert classes.tolist() == sorted({u % 10, (u + 1) % 10})
        assert counts.min() >= 2
    sizes = np.array([part.size for part in parts])
    assert sizes.max() / sizes.min() >= 5
    # the power-law phase hands out most of what the base phase leaves (FedProx: ~61-69k of 70k)
    assert sizes.sum() > 0.7 * len(targets)


def test_power_law_base_phase_reads_each_class_sequentially() -> None:
    # with sigma = 0 every readable entry of props is equal, so the amounts are computable by hand:
    # 20 clients, classes 0..3 each held by 10 clients; base 2 leaves 50 - 20 = 30 per class,
    # spread over 10 entries → 3 more each, all fitting
    targets = np.repeat(np.arange(4), 50)
    parts = PowerLaw(num_clients=20, classes_per_client=2, base_samples=2, sigma=0.0)(
        targets, 4, np.random.default_rng(0)
    )
    assert [part.size for part in parts] == [10] * 20
    # client 0 is the first reader of class 0: its first two samples come first in pool order
    assert parts[0][:2].tolist() == [0, 1]
    validate_partition(parts, len(targets), cover=True)


def test_power_law_handles_clients_not_a_multiple_of_classes() -> None:
    targets = balanced_targets(per_class=60)
    parts = PowerLaw(num_clients=25, base_samples=2)(targets, NUM_CLASSES, np.random.default_rng(0))
    validate_partition(parts, len(targets))
    assert len(parts) == 25
    assert all(np.unique(targets[part]).size == 2 for part in parts)


def test_power_law_too_small_pool_names_the_flags() -> None:
    with pytest.raises(ValueError, match=r"--data\.partitioner\.init_args\.num_clients.*base_samples"):
        PowerLaw(num_clients=1000, base_samples=5)(balanced_targets(), NUM_CLASSES, np.random.default_rng(0))


# KClasses


@pytest.mark.parametrize("assignment", ["consecutive", "random"])
@pytest.mark.parametrize("k", [1, 3, 10])
def test_k_classes_gives_exactly_k_classes(assignment: str, k: int) -> None:
    targets = skewed_targets()
    parts = KClasses(num_clients=23, classes_per_client=k, assignment=assignment)(
        targets, NUM_CLASSES, np.random.default_rng(0)
    )
    validate_partition(parts, len(targets))
    assert all(np.unique(targets[part]).size == k for part in parts)


def test_k_classes_splits_each_class_evenly_among_holders() -> None:
    # 4 clients over 4 classes of 9, 2 holders each: shares of a class differ by at most one
    targets = np.repeat(np.arange(4), 9)
    parts = KClasses(num_clients=4, classes_per_client=2)(targets, 4, np.random.default_rng(0))
    shares = np.array([np.bincount(targets[part], minlength=4) for part in parts])
    assert shares.tolist() == [[5, 5, 0, 0], [0, 4, 5, 0], [0, 0, 4, 5], [4, 0, 0, 4]]


def test_k_classes_bad_inputs_name_the_flags() -> None:
    with pytest.raises(ValueError, match=r"--data\.partitioner\.init_args\.classes_per_client <= 10"):
        KClasses(num_clients=5, classes_per_client=11)(balanced_targets(), NUM_CLASSES, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"class 0: 2 samples for 4 clients.*num_clients"):
        KClasses(num_clients=4, classes_per_client=1)(np.array([0, 0]), 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"init_args\.num_clients >= 1"):
        KClasses(num_clients=0)


# Dirichlet


def test_dirichlet_respects_min_size_and_covers_the_pool() -> None:
    targets = skewed_targets()
    parts = Dirichlet(num_clients=20, alpha=0.1, min_size=50)(targets, NUM_CLASSES, np.random.default_rng(0))
    sizes = np.array([part.size for part in parts])
    assert sizes.min() >= 50
    assert sizes.sum() == len(targets)


@pytest.mark.parametrize("partitioner", [Dirichlet, DirichletPowerLaw])
def test_lower_alpha_gives_fewer_classes_per_client(partitioner: type[Partitioner]) -> None:
    targets = skewed_targets()
    distinct = {
        alpha: np.mean(
            [
                mean_distinct_classes(
                    partitioner(num_clients=20, alpha=alpha)(targets, NUM_CLASSES, np.random.default_rng(s)),
                    targets,
                )
                for s in range(3)
            ]
        )
        for alpha in (0.05, 100.0)
    }
    assert distinct[0.05] < 4 and distinct[100.0] > 8


def test_dirichlet_bad_inputs_name_the_flags() -> None:
    with pytest.raises(
        ValueError,
        match=r"Expected --data\.partitioner\.init_args\.alpha > 0, got 0\.0\. Lower alpha means more",
    ):
        Dirichlet(alpha=0.0)
    with pytest.raises(ValueError, match=r"lower --data\.partitioner\.init_args\.min_size"):
        Dirichlet(num_clients=100, min_size=50)(balanced_targets(), NUM_CLASSES, np.random.default_rng(0))
    # feasible in total, but α this small leaves some of 100 clients almost empty in every draw
    with pytest.raises(ValueError, match=r"No Dirichlet.*in 3.*lower --data\.partitioner\.init_args\.min_size"):
        Dirichlet(num_clients=100, alpha=0.01, min_size=15, max_retries=3)(
            balanced_targets(), NUM_CLASSES, np.random.default_rng(0)
        )


# DirichletPowerLaw


def test_pareto_sizes_sum_exactly_and_are_unequal() -> None:
    sizes = pareto_sizes(6665, 100, gamma=3.0, rng=np.random.default_rng(0))
    assert sizes.sum() == 6665 and sizes.min() >= 1 and sizes.dtype == np.int64
    # MO-FedProto's sizes have a coefficient of variation of 0.39, which 100 draws of
    # 1 + Pareto(3) typically give (median ≈ 0.45; np.random.power(3) would give 0.26)
    cvs = [(s := pareto_sizes(10_000, 100, 3.0, np.random.default_rng(seed))).std() / s.mean() for seed in range(20)]
    assert 0.3 < np.median(cvs) < 0.6
    # more clients than quota: those rounding to 0 still get one sample
    assert pareto_sizes(12, 10, gamma=0.5, rng=np.random.default_rng(0)).min() == 1


def test_draw_class_counts_redraws_from_classes_still_open() -> None:
    rng = np.random.default_rng(0)
    counts = draw_class_counts(10, np.array([1.0, 0.0, 0.0]), np.array([3, 4, 5]), rng)
    # class 0 runs out after 3; the other 7 come from classes 1 and 2 although q gives them no mass
    assert counts[0] == 3 and counts.sum() == 10 and np.all(counts <= [3, 4, 5])
    counts = draw_class_counts(5, np.array([0.5, 0.5, 0.0]), np.array([10, 10, 10]), rng)
    assert counts[2] == 0 and counts.sum() == 5


def test_dirichlet_power_law_follows_pareto_sizes() -> None:
    targets = skewed_targets()
    parts = DirichletPowerLaw(num_clients=40, alpha=1.0)(targets, NUM_CLASSES, np.random.default_rng(0))
    sizes = np.array([part.size for part in parts])
    assert sizes.sum() == len(targets)
    # the first draws of the partition's rng are the sizes
    assert sizes.tolist() == pareto_sizes(len(targets), 40, 3.0, np.random.default_rng(0)).tolist()


def test_dirichlet_power_law_bad_inputs_name_the_flags() -> None:
    with pytest.raises(ValueError, match=r"(?s)init_args\.alpha > 0, got -1.*init_args\.gamma > 0, got 0"):
        DirichletPowerLaw(alpha=-1, gamma=0)
    with pytest.raises(ValueError, match=r"lower --data\.partitioner\.init_args\.num_clients"):
        DirichletPowerLaw(num_clients=10)(np.zeros(5, np.int64), 1, np.random.default_rng(0))


# Natural


def test_natural_gives_one_client_per_group_in_sorted_order() -> None:
    groups = np.array([3, 1, 3, 2, 1, 1])
    parts = Natural()(np.zeros(6, np.int64), 1, np.random.default_rng(0), groups)
    assert [part.tolist() for part in parts] == [[1, 4, 5], [3], [0, 2]]
    validate_partition(parts, 6, cover=True)


def test_natural_without_groups_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"groups=None.*--data\.partitioner"):
        Natural()(np.zeros(3, np.int64), 1, np.random.default_rng(0))
