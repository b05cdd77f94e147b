"""The data module's dense-target, augmentation and lazy-pool paths (classification is covered by the trainer tests)."""

import numpy as np
import pytest
import torch

from fedlight.data import Digits, FederatedDataModule, Scenes, StyleCities
from fedlight.data.base import FederatedDataset, LabelledTensors, LazySamples
from fedlight.data.partition import DirichletPowerLaw
from fedlight.data.transforms import RandomScaleCropFlip
from fedlight.errors import ConfigError


class Lazy(LazySamples):
    """Reads from a tensor batch by batch, counting the reads, as a pool on disk would."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data, self.shape, self.reads = data, tuple(data.shape), 0

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        assert index.device.type == "cpu"
        self.reads += 1
        return torch.stack([self.data[i] for i in index.tolist()])


class LazyScenes(FederatedDataset):
    def __init__(self, scenes: Scenes) -> None:
        self.scenes, self.num_classes, self.input_shape = scenes, scenes.num_classes, scenes.input_shape

    def load_train(self) -> LabelledTensors:
        pool = self.scenes.load_train()
        return LabelledTensors(Lazy(pool.inputs), Lazy(pool.targets), labels=pool.labels)

    def load_test(self) -> LabelledTensors:
        test = self.scenes.load_test()
        return LabelledTensors(Lazy(test.inputs), Lazy(test.targets), labels=test.labels)


def _scenes(**kwargs) -> Scenes:
    return Scenes(num_samples=120, num_test_samples=10, image_size=16, seed=1, **kwargs)


def _datamodule(dataset, **kwargs) -> FederatedDataModule:
    data = FederatedDataModule(dataset, DirichletPowerLaw(num_clients=6, alpha=0.5), batch_size=4, **kwargs)
    data.setup()
    return data


def test_label_maps_are_partitioned_by_their_image_labels() -> None:
    data = _datamodule(_scenes())
    labels = data.pool.labels
    # the same partition as the partitioner applied to the image labels directly
    rng = np.random.default_rng(0)
    parts = DirichletPowerLaw(num_clients=6, alpha=0.5)(labels, 21, rng)
    for client, part in enumerate(parts):
        held_out = data.held_out_index[data.held_out_group == client].numpy()
        assert np.array_equal(np.sort(np.concatenate([data.client_train[client].numpy(), held_out])), part)
    x, y = next(data.train_batches(0, torch.Generator().manual_seed(0)))
    assert x.shape == (4, 3, 16, 16) and y.shape == (4, 16, 16)
    x, y, group = next(data.test_batches())
    assert y.shape == (10, 16, 16) and group.shape == (10,) and (group == 0).all()


def test_macro_labels_share_the_fine_partition() -> None:
    fine, macro = _datamodule(_scenes()), _datamodule(_scenes(label_set="macro"))
    assert macro.num_classes == 5
    assert all(torch.equal(a, b) for a, b in zip(fine.client_train, macro.client_train, strict=True))


def test_train_transform_draws_from_the_clients_generator() -> None:
    data = _datamodule(_scenes(), train_transform=RandomScaleCropFlip(crop_size=8))
    plain = _datamodule(_scenes())

    def epoch(module, seed):
        return list(module.train_batches(2, torch.Generator().manual_seed(seed)))

    first, again, other = epoch(data, 0), epoch(data, 0), epoch(data, 1)
    assert all(x.shape[-2:] == (8, 8) and y.shape[-2:] == (8, 8) for x, y in first)
    # the model is built for what it trains on: the crop, not the dataset's 16×16 images
    assert data.input_shape == (3, 8, 8) and plain.input_shape == (3, 16, 16)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(first, other, strict=True))
    # evaluation passes are never augmented
    for (x, y), (px, py) in zip(data.client_batches(2), plain.client_batches(2), strict=True):
        assert torch.equal(x, px) and torch.equal(y, py)


def test_a_lazy_pool_serves_the_same_batches() -> None:
    resident, lazy = _datamodule(_scenes()), _datamodule(LazyScenes(_scenes()))
    lazy.to("cpu")
    assert isinstance(lazy.pool.inputs, Lazy)
    batches = [
        (lambda m: m.train_batches(3, torch.Generator().manual_seed(7))),
        (lambda m: m.client_batches(3, "held_out")),
        (lambda m: ((x, y) for x, y, _ in m.held_out_batches())),
        (lambda m: ((x, y) for x, y, _ in m.test_batches())),
    ]
    for make in batches:
        for (x, y), (lx, ly) in zip(make(resident), make(lazy), strict=True):
            assert torch.equal(x, lx) and torch.equal(y, ly)
    assert lazy.pool.inputs.reads > 0


def test_drop_last_leaves_out_the_short_batch() -> None:
    data = _datamodule(_scenes(), drop_last=True)
    keep = _datamodule(_scenes())
    for client in range(6):
        size = len(data.client_train[client])
        sizes = [len(x) for x, _ in data.train_batches(client, torch.Generator().manual_seed(0))]
        assert sizes == [4] * (size // 4) and data.num_batches(client) == size // 4
        full = [len(x) for x, _ in keep.train_batches(client, torch.Generator().manual_seed(0))]
        assert sum(full) == size and keep.num_batches(client) == len(full) == -(-size // 4)


def test_return_index_names_each_training_image_in_the_pool() -> None:
    data = _datamodule(_scenes(), return_index=True)
    plain = _datamodule(_scenes())
    for client in range(6):
        seen = []
        batches = zip(
            data.train_batches(client, torch.Generator().manual_seed(3)),
            plain.train_batches(client, torch.Generator().manual_seed(3)),
            strict=True,
        )
        for (x, y, index), (px, py) in batches:
            assert torch.equal(x, data.pool.inputs[index]) and torch.equal(y, data.pool.targets[index])
            assert torch.equal(x, px) and torch.equal(y, py)  # the same batches, only named
            seen += index.tolist()
        assert sorted(seen) == data.client_train[client].tolist()


def test_the_data_name_their_classes_in_label_order() -> None:
    fine = FederatedDataModule(Scenes(num_object_classes=4, num_samples=8, image_size=16))
    assert fine.class_names == ("background", "aeroplane", "bicycle", "bird", "boat")
    macro = FederatedDataModule(Scenes(label_set="macro", num_samples=8, image_size=16))
    assert macro.class_names == ("background", "person", "vehicle", "household", "animal")
    objects = FederatedDataModule(Scenes(mode="classification", num_object_classes=3, num_samples=8, image_size=16))
    assert objects.class_names == ("aeroplane", "bicycle", "bird")  # no background to classify
    cities = FederatedDataModule(StyleCities(num_object_classes=2, num_clients_per_city=1, num_source_samples=4))
    assert cities.class_names == ("background", "aeroplane", "bicycle")
    assert FederatedDataModule(Digits()).class_names is None  # known by number only


def test_a_fixed_order_is_the_one_a_distributed_sampler_replays_every_round() -> None:
    from torch.utils.data.distributed import DistributedSampler

    data = _datamodule(_scenes(), return_index=True, shuffle="fixed", drop_last=True)
    for client in range(6):
        indices = data.client_train[client]
        # LADD's client loader: a shuffling DistributedSampler, one process, seed 0, its epoch never advanced
        sampler = DistributedSampler(range(len(indices)), num_replicas=1, rank=0, shuffle=True, seed=0)
        expected = indices[list(sampler)][: data.num_batches(client) * 4].tolist()
        for round_seed in (3, 4):  # two rounds' client streams
            seen = [
                i
                for _, _, index in data.train_batches(client, torch.Generator().manual_seed(round_seed))
                for i in index.tolist()
            ]
            assert seen == expected
    every_round = _datamodule(_scenes(), return_index=True)
    orders = [
        [i for _, _, index in every_round.train_batches(0, torch.Generator().manual_seed(s)) for i in index.tolist()]
        for s in (3, 4)
    ]
    assert orders[0] != orders[1]


def test_test_groups_index_the_test_sets_groups_and_need_a_test_set_that_has_them() -> None:
    cities = StyleCities(num_clients_per_city=1, client_size=(4, 6), num_test_per_city=2, image_size=16, seed=0)
    data = FederatedDataModule(cities, batch_size=4, test_fraction=0.0, eval_batch_size=3, test_groups=True)
    data.setup()
    assert data.test_group_names == ("cool", "dim", "grey", "warm") and data.num_test_groups == 4
    grouped = torch.cat([group for _, _, group in data.test_batches(by_group=True)])
    assert [data.test_group_names[g] for g in grouped.tolist()] == data.test.groups.tolist()
    assert all((group == 0).all() for _, _, group in data.test_batches())  # other passes see one group
    with pytest.raises(ConfigError, match=r"--data\.test_groups=true"):
        _datamodule(_scenes(), test_groups=True)  # Scenes' test set carries no groups
