"""The Flower Datasets bridge against flwr-datasets run directly on the same labels, and its partitions' statistics."""

import datasets
import numpy as np
import pytest
from flwr_datasets import partitioner as flower

from fedlight.data.partition import FlowerPartitioner, validate_partition
from fedlight.data.partition.summary import partition_statistics
from fedlight.errors import ConfigError

NUM_CLASSES = 10


def skewed_targets(num_samples: int = 3000, seed: int = 3) -> np.ndarray:
    prior = np.arange(1, NUM_CLASSES + 1) / np.arange(1, NUM_CLASSES + 1).sum()
    return np.random.default_rng(seed).choice(NUM_CLASSES, size=num_samples, p=prior)


def direct(flower_partitioner, targets: np.ndarray, groups: np.ndarray | None = None) -> list[np.ndarray]:
    """The partition flwr-datasets itself gives, as sorted row numbers of a dataset of the same labels."""
    columns = {"label": targets, "row": np.arange(len(targets))}
    if groups is not None:
        columns["client_id"] = groups
    flower_partitioner.dataset = datasets.Dataset.from_dict(columns)
    return [
        np.sort(np.asarray(flower_partitioner.load_partition(k)["row"]))
        for k in range(flower_partitioner.num_partitions)
    ]


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("DirichletPartitioner", {"num_partitions": 12, "partition_by": "label", "alpha": 0.3}),
        ("PathologicalPartitioner", {"num_partitions": 8, "partition_by": "label", "num_classes_per_partition": 2}),
        ("ShardPartitioner", {"num_partitions": 10, "partition_by": "label", "num_shards_per_partition": 2}),
        ("IidPartitioner", {"num_partitions": 9}),
    ],
)
def test_the_bridge_gives_flower_s_own_partition(name, kwargs):
    targets = skewed_targets()
    seeded = {} if name == "IidPartitioner" else {"seed": 11}  # Flower's IID split draws nothing
    ours = FlowerPartitioner(name, {**kwargs, **seeded})(targets, NUM_CLASSES, np.random.default_rng(0))
    theirs = direct(getattr(flower, name)(**kwargs, **seeded), targets)
    assert len(ours) == len(theirs) == kwargs["num_partitions"]
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    validate_partition(ours, len(targets))


def test_pathological_clients_hold_exactly_their_number_of_classes():
    targets = skewed_targets()
    parts = FlowerPartitioner(
        "PathologicalPartitioner", {"num_partitions": 15, "partition_by": "label", "num_classes_per_partition": 3}
    )(targets, NUM_CLASSES, np.random.default_rng(0))
    stats = partition_statistics(targets, parts, NUM_CLASSES)
    assert stats.classes_per_client.tolist() == [3] * 15


def test_natural_ids_follow_the_groups():
    targets = skewed_targets(num_samples=600)
    groups = np.random.default_rng(5).integers(0, 6, size=600)
    parts = FlowerPartitioner("NaturalIdPartitioner", {"partition_by": "client_id"})(
        targets, NUM_CLASSES, np.random.default_rng(0), groups
    )
    assert sorted(tuple(np.unique(groups[part])) for part in parts) == [(g,) for g in range(6)]
    validate_partition(parts, len(targets), cover=True)


def test_the_seed_comes_from_the_run_unless_given():
    targets = skewed_targets()
    bridge = FlowerPartitioner("DirichletPartitioner", {"num_partitions": 6, "partition_by": "label", "alpha": 0.5})

    def run(seed):
        return bridge(targets, NUM_CLASSES, np.random.default_rng(seed))

    same, other = run(0), run(1)
    assert all(np.array_equal(a, b) for a, b in zip(run(0), same, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(same, other, strict=True))


def test_bad_settings_name_the_flag():
    with pytest.raises(ConfigError, match=r"partitioner=NoSuchPartitioner is not a Flower Datasets partitioner"):
        FlowerPartitioner("NoSuchPartitioner")
    with pytest.raises(ConfigError, match=r"kwargs does not fit DirichletPartitioner"):
        FlowerPartitioner("DirichletPartitioner", {"num_partitions": 3, "alfa": 0.5})
    bridge = FlowerPartitioner("NaturalIdPartitioner", {"partition_by": "client_id"})
    with pytest.raises(ConfigError, match=r"no natural client ids; partition by label"):
        bridge(skewed_targets(100), NUM_CLASSES, np.random.default_rng(0))
    with pytest.raises(ConfigError, match=r"partition_by to be label .* got 'fine_label'"):
        FlowerPartitioner("ShardPartitioner", {"num_partitions": 2, "partition_by": "fine_label", "shard_size": 5})(
            skewed_targets(100), NUM_CLASSES, np.random.default_rng(0)
        )
