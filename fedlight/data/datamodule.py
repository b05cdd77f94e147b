"""``FederatedDataModule``: one pool of labelled data, split over clients and into train/held-out.

Data for the classification benchmarks fits in memory, so samples stay in a few tensors on the
training device and each client is an index vector into them. A local epoch is a fresh permutation
of the client's indices drawn from the client's own generator, cut into batches by slicing: no
``DataLoader`` per client and no per-sample collation, which would cost more than the small models'
steps themselves.

Dense tasks use the same path: targets may be ``[N, H, W]`` label maps (the partitioner then reads the
pool's per-image ``labels``), and a ``train_transform`` (e.g. segmentation's random scale, crop and
flip) acts on each stacked training batch with draws from the client's generator. Pools too large for
memory (Pascal VOC) are :class:`~fedlight.data.base.LazySamples`: indexing them reads a stacked batch,
which is moved to the training device as it is served; the index logic is the same. A pool whose images
differ in size (Mapillary) gives a :class:`~fedlight.data.base.PairedSamples` reader for training batches,
which crops each image and its labels alike as they are read, with the same generator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import Dataset

from fedlight.data.base import FederatedDataset, LabelledTensors, LazySamples
from fedlight.data.checks import SampleChecks
from fedlight.data.datasets.torch_dataset import TorchDataset
from fedlight.data.partition import Natural, Partitioner
from fedlight.data.transforms import BatchTransform
from fedlight.errors import ConfigError

#: prefixes of other ``test/`` metrics, which no test group may be named
RESERVED_GROUP_NAMES = frozenset({"routed", "released_global", "personal", "group_mean"})


class FederatedDataModule:
    """Partitions a dataset over clients and serves their batches.

    Args:
        dataset: the labelled pool: a :class:`~fedlight.data.base.FederatedDataset` by ``class_path``, or your
            own map-style ``torch.utils.data.Dataset`` or ``LightningDataModule`` (``--data.dataset=mypkg.MyData``),
            read through :class:`~fedlight.data.datasets.torch_dataset.TorchDataset`.
        partitioner: how the pool is split over clients. Default: the dataset's natural split
            (``Natural``), which needs per-sample client ids such as Synthetic's users.
        batch_size: local mini-batch size (10 in the prototype-margin paper's classification runs).
        test_fraction: share of every client's samples held out for evaluation (0.2: the papers'
            80/20 split).
        eval_batch_size: batch size of evaluation passes; evaluation runs without gradients, so it can
            be large.
        seed: seed of the dataset generation, partition and train/held-out split. It is separate from
            the run's seed so that seeds of a table row share one federation.
        centralized: train one model on the union of the clients' training splits, with the same
            held-out splits: the reference model of the FFD analysis. The partition and the 80/20 splits
            are drawn as in the federated run, then the training splits become one client; evaluation
            still reports per-client numbers over the original clients' held-out splits. Run it with
            ``--trainer.clients_per_round=1 --trainer.local_epochs=1``, one round per epoch.
        train_transform: augmentation applied to every training batch, drawn from the client's own
            generator (e.g. :class:`~fedlight.data.transforms.RandomScaleCropFlip` for segmentation);
            evaluation batches are never transformed.
        drop_last: drop each local epoch's last batch when it is smaller than ``batch_size``, as a
            ``DataLoader`` does. DeepLab-V3+'s image-pooling BatchNorm cannot train on one image, so the
            segmentation configs set it; a client with fewer training samples than one batch then
            trains no step. Without it, a model that trains BatchNorm still leaves out a last batch of one
            sample (a different one each epoch), which BatchNorm cannot normalise.
        return_index: training batches are ``(x, y, index)`` with each sample's position in the pool, for
            losses that look up other data of a sample (STEGO's nearest neighbours, cached backbone
            features); evaluation batches are unchanged.
        shuffle: the order a client reads its training samples in: ``every_round``, drawn afresh from the
            client's stream of each round, or ``fixed``, one order for every round, the one a shuffling
            ``DistributedSampler`` (seed 0) gives when its epoch is never advanced, as LADD's released code
            trains (the same for every client of a size; the epoch's short last batch is then always the same
            samples). Augmentations still draw from the round's stream.
        test_groups: score the global test set also group by group, its groups being the natural ones its
            samples carry (``LabelledTensors.groups`` of the dataset's ``load_test``: the city of every CrossCity or
            style-cities test image). Each evaluation then adds ``test/<group>/<metric>`` for every per-group
            metric of the module (segmentation: ``miou``) and ``test/group_mean/<metric>``, their unweighted mean
            over the groups; the pooled ``test/<metric>`` stays one score over every test sample.
    """

    def __init__(
        self,
        dataset: FederatedDataset | Dataset | LightningDataModule,
        partitioner: Partitioner | None = None,
        batch_size: int = 10,
        test_fraction: float = 0.2,
        eval_batch_size: int = 1024,
        seed: int = 0,
        centralized: bool = False,
        train_transform: BatchTransform | None = None,
        drop_last: bool = False,
        return_index: bool = False,
        shuffle: Literal["every_round", "fixed"] = "every_round",
        test_groups: bool = False,
    ) -> None:
        if not isinstance(dataset, FederatedDataset):
            dataset = TorchDataset(dataset)
        problems = []
        if batch_size < 1:
            problems.append(f"Expected --data.batch_size ≥ 1, got {batch_size}.")
        if not 0.0 <= test_fraction < 1.0:
            problems.append(f"Expected --data.test_fraction in [0, 1), got {test_fraction}.")
        if eval_batch_size < 1:
            problems.append(f"Expected --data.eval_batch_size ≥ 1, got {eval_batch_size}.")
        partitioner = partitioner if partitioner is not None else Natural()
        check = getattr(dataset, "partition_problems", None)  # a dataset whose own split a partitioner would drop
        if check is not None:
            problems += check(partitioner)
        if shuffle not in ("every_round", "fixed"):
            problems.append(f"Expected --data.shuffle to be 'every_round' or 'fixed', got {shuffle!r}.")
        if problems:
            raise ConfigError(*problems)
        self.dataset = dataset
        self.partitioner = partitioner
        self.batch_size = batch_size
        self.test_fraction = test_fraction
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self.centralized = centralized
        self.train_transform = train_transform
        self.drop_last = drop_last
        #: the smallest last batch an epoch keeps; the engine raises it to 2 for a model that trains BatchNorm,
        #: which cannot normalise one sample (its client would fail that step and be left out of the round)
        self.min_last_batch = 1
        self.return_index = return_index
        self.shuffle = shuffle
        self.test_groups = test_groups
        #: the test set's groups, in the order of their indices in ``test_batches(by_group=True)``; empty unless
        #: ``test_groups``
        self.test_group_names: tuple[str, ...] = ()
        self.device = torch.device("cpu")
        self._is_setup = False

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def class_names(self) -> tuple[str, ...] | None:
        """The dataset's names of classes 0…C−1, or None when it knows its classes by number only."""
        names = getattr(self.dataset, "class_names", None)
        if names is None:
            return None
        assert len(names) == self.num_classes, f"{len(names)} class names for the dataset's {self.num_classes} classes"
        return tuple(names)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One training sample's shape as the model receives it: the dataset's, cropped by ``train_transform``."""
        shape = tuple(self.dataset.input_shape)
        if self.train_transform is None or len(shape) != 3:
            return shape
        return (shape[0], *self.train_transform.output_size(shape[1:]))

    def setup(self) -> None:
        """Loads the pool, partitions it and splits every client 80/20 (idempotent)."""
        if self._is_setup:
            return
        rng = np.random.default_rng(self.seed)
        pool = self.dataset.load_train()
        targets = pool.partition_labels()  # [N], one class per sample even when targets are label maps
        # a coarsened label set still partitions by its fine classes, which may outnumber num_classes
        num_label_classes = max(self.num_classes, int(targets.max(initial=-1)) + 1)
        clients = self.partitioner(targets, num_label_classes, rng, groups=pool.groups)
        if not clients or any(len(c) == 0 for c in clients):
            empty = sum(len(c) == 0 for c in clients)
            raise ConfigError(
                f"The partition of {len(pool)} samples left {empty} of {len(clients)} clients empty: there are "
                "more clients than samples can fill. Lower --data.partitioner.init_args.num_clients."
            )
        train, held_out = [], []
        for indices in clients:
            indices = rng.permutation(indices)
            num_train = max(1, int((1.0 - self.test_fraction) * len(indices)))
            train.append(np.sort(indices[:num_train]))
            held_out.append(np.sort(indices[num_train:]))
        test = self.dataset.load_test()
        if self.test_groups:
            self.test_group_names, self.test_group = self._test_groups(test)
        # labels in range, integer, finite inputs: here, not in the round that first reads a bad sample
        self.checks = SampleChecks(self.dataset, self.num_classes, list(zip(train, held_out, strict=True)), len(pool))
        problems = self.checks.problems(pool, test)
        if problems:
            raise ConfigError(*problems)
        if self.centralized:  # drawn as above, so the held-out splits are those of the federated run
            train = [np.sort(np.concatenate(train))]
        self.pool = pool
        self.client_train = [torch.from_numpy(ix).long() for ix in train]
        self.num_samples = np.array([len(ix) for ix in train], dtype=np.int64)  # n_k
        # The clients' held-out splits as one set with each sample's client index, evaluated in one pass.
        self.held_out_index = torch.from_numpy(np.concatenate(held_out)).long()
        self.held_out_group = torch.from_numpy(np.repeat(np.arange(len(held_out)), [len(h) for h in held_out]))
        self.num_eval_groups = len(held_out)  # the original clients, also when training is centralized
        self.test: LabelledTensors | None = test
        if self.train_transform is not None:  # its files are read and checked now, not in the first local fit
            self.train_transform.setup()
        self._is_setup = True

    def _test_groups(self, test: LabelledTensors | None) -> tuple[tuple[str, ...], torch.Tensor]:
        """The names of the test set's groups (sorted) and ``[N_test]`` the group index of every test sample."""
        if test is None or test.groups is None:
            what = "no separate test set" if test is None else "a test set without groups"
            raise ConfigError(
                f"--data.test_groups=true scores the global test set group by group, but "
                f"{type(self.dataset).__name__} gives {what}. Use a dataset whose test samples carry their group "
                "(CrossCity, StyleCities) or set --data.test_groups=false."
            )
        names, index = np.unique(np.asarray(test.groups).astype(str), return_inverse=True)
        clashing = sorted(set(names) & RESERVED_GROUP_NAMES) + [n for n in names if "/" in n]
        if clashing:
            raise ConfigError(
                f"The test set's groups {clashing} would clash with other test metrics' keys (test/<group>/<metric>; "
                f"reserved: {sorted(RESERVED_GROUP_NAMES)}, and no '/'). Rename them in the dataset's load_test."
            )
        return tuple(str(n) for n in names), torch.from_numpy(index.reshape(-1)).long()

    @property
    def num_test_groups(self) -> int:
        """The groups the test set is scored by: its groups' count with ``test_groups``, else one."""
        return max(1, len(self.test_group_names))

    @property
    def num_clients(self) -> int:
        return len(self.client_train)

    def to(self, device: torch.device | str) -> FederatedDataModule:
        """Moves the in-memory tensors to the training device once, before the first round.

        Lazy pools stay where they are read from; their batches move as they are served.
        """
        self.device = torch.device(device)
        self.pool = self.pool.to(device)
        self.client_train = [ix.to(device) for ix in self.client_train]
        self.held_out_index = self.held_out_index.to(device)
        self.held_out_group = self.held_out_group.to(device)
        if self.test is not None:
            self.test = self.test.to(device)
        if self.test_group_names:
            self.test_group = self.test_group.to(device)
        return self

    def num_batches(self, client: int) -> int:
        """Training batches in one local epoch of client ``client``."""
        full, last = divmod(len(self.client_train[client]), self.batch_size)
        return full + int(not self.drop_last and last >= self.min_last_batch)

    def train_batches(self, client: int, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, ...]]:
        """Yields one shuffled epoch of client ``client``'s training batches (the last may be smaller).

        Batches are ``(x, y)``, or ``(x, y, pool index)`` with ``return_index``.
        """
        indices = self.client_train[client]
        if self.shuffle == "fixed":  # a DistributedSampler's epoch-0 order, seed 0, one process
            permutation = torch.randperm(len(indices), generator=torch.Generator().manual_seed(0))
        else:
            permutation = torch.randperm(len(indices), generator=generator)
        order = indices[permutation.to(indices.device)]
        for start in range(0, self.num_batches(client) * self.batch_size, self.batch_size):
            batch = order[start : start + self.batch_size]
            if self.pool.train_reader is not None:
                x, y = (part.to(self.device) for part in self.pool.train_reader.read(batch.cpu(), generator))
                self.checks.check_read(y, batch, "pool")
            else:
                x, y = _take(self.pool.inputs, batch, self.device), self._targets(self.pool, batch)
            if self.train_transform is not None:
                x, y = self.train_transform(x, y, generator)
            yield (x, y, batch) if self.return_index else (x, y)

    def client_batches(
        self, client: int, split: Literal["train", "held_out"] = "train"
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yields client ``client``'s samples of one split in a fixed order, in evaluation-sized batches.

        For passes that read a client's data without training on it: prototypes, saliency weights,
        gradient dissimilarity.
        """
        if split == "train":
            indices = self.client_train[client]
        else:
            indices = self.held_out_index[self.held_out_group == client]
        for start in range(0, len(indices), self.eval_batch_size):
            batch = indices[start : start + self.eval_batch_size]
            yield _take(self.pool.inputs, batch, self.device), self._targets(self.pool, batch)

    def held_out_batches(
        self, clients: torch.Tensor | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yields ``(x, y, client index)`` batches over every client's held-out split, or over those of
        ``clients`` only (sorted client indices), batched across clients all the same.

        The split is ordered by client, so a client's samples are one slice of it and choosing ``clients``
        costs in proportion to their samples, not to the population.
        """
        index, group = self.held_out_index, self.held_out_group
        if clients is not None:
            clients = clients.to(group.device)
            starts = torch.searchsorted(group, clients)
            lengths = torch.searchsorted(group, clients, right=True) - starts
            # positions of the chosen samples: each client's start, plus 0…n_k−1 within its slice
            offsets = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths)
            positions = offsets + torch.arange(len(offsets), device=group.device)
            index, group = index[positions], group[positions]
        for start in range(0, len(index), self.eval_batch_size):
            batch = index[start : start + self.eval_batch_size]
            yield (
                _take(self.pool.inputs, batch, self.device),
                self._targets(self.pool, batch),
                group[start : start + len(batch)],
            )

    def test_batches(self, by_group: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yields ``(x, y, 0)`` batches over the global test set; with ``by_group`` and ``test_groups``, ``(x, y,
        group index)``, the index into :attr:`test_group_names`.

        Without a separate test set, the global test set is the union of the clients' held-out splits,
        as in FedProx's and the prototype-margin paper's evaluation.
        """
        if self.test is None:
            for x, y, group in self.held_out_batches():
                yield x, y, torch.zeros_like(group)
            return
        grouped = by_group and bool(self.test_group_names)
        for start in range(0, len(self.test), self.eval_batch_size):
            batch = slice(start, min(start + self.eval_batch_size, len(self.test)))
            x, y = _take(self.test.inputs, batch, self.device), self._targets(self.test, batch)
            if grouped:
                yield x, y, self.test_group[batch].to(self.device)
            else:
                yield x, y, torch.zeros(len(x), dtype=torch.int64, device=self.device)

    def _targets(self, data: LabelledTensors, index: torch.Tensor | slice) -> torch.Tensor:
        """``data.targets[index]`` on the device; lazily read label maps are checked as they are read (resident
        ones were checked at set-up)."""
        targets = _take(data.targets, index, self.device)
        if not isinstance(data.targets, torch.Tensor):
            self.checks.check_read(targets, index, "pool" if data is self.pool else "test")
        return targets


def _take(source: torch.Tensor | LazySamples, index: torch.Tensor | slice, device: torch.device) -> torch.Tensor:
    """``source[index]`` on ``device``: part of a resident tensor, or a batch read from a lazy pool."""
    if isinstance(source, torch.Tensor):
        return source[index]
    if isinstance(index, slice):
        index = torch.arange(index.start, index.stop)
    return source[index.cpu()].to(device, non_blocking=True)
