import numpy as np
import pytest
import torch
from miniatures.classification import write_emnist_files

from fedlight.data import FEMNIST
from fedlight.data.partition import FEMNISTPartition, validate_partition
from fedlight.errors import ConfigError

# byclass labels in the fake tree: a digit, an upper-case letter, a–j (36–45) four times each, and 'k'
LABELS = np.array([3, 12, *np.repeat(np.arange(36, 46), 4), 46])


def bright_pixel(image: int) -> tuple[int, int]:
    """The upright (row, column) of the one lit pixel of fake image ``image``: off the diagonal, unique."""
    return image // 20, 5 + image % 20


def fake_emnist(root) -> None:
    """Writes a tiny EMNIST byclass in torchvision's raw layout, each image stored transposed like EMNIST's."""
    images = np.zeros((len(LABELS), 28, 28), dtype=np.uint8)
    for image in range(len(LABELS)):
        row, col = bright_pixel(image)
        images[image, col, row] = 255  # column-major storage
    test = np.arange(len(LABELS)) % 4 == 3  # one image of every letter is in the test split
    write_emnist_files(root, images, LABELS.astype(np.uint8), test)


def image_ids(inputs: torch.Tensor) -> list[int]:
    """Recovers which fake image each upright input is, from its lit pixel."""
    lit = inputs[:, 0].flatten(1).argmax(1)
    rows, cols = lit // 28, lit % 28
    return [int(row * 20 + col - 5) for row, col in zip(rows, cols, strict=True)]


def test_femnist_keeps_letters_a_to_j_upright_from_both_splits(tmp_path) -> None:
    fake_emnist(tmp_path)
    dataset = FEMNIST(root=str(tmp_path), images_per_class=4)
    pool = dataset.load_train()
    assert dataset.num_classes == 10 and dataset.input_shape == (1, 28, 28) and dataset.load_test() is None
    assert pool.inputs.shape == (40, 1, 28, 28) and pool.inputs.dtype == torch.float32 and pool.groups is None
    assert pool.inputs.min() == 0 and pool.inputs.max() == 1 and pool.inputs.sum() == 40, "one lit pixel in [0, 1]"
    ids = image_ids(pool.inputs)  # only upright images light the expected pixel
    assert sorted(ids) == list(range(2, 42)), "every a–j image of both splits, no digit, capital or 'k'"
    np.testing.assert_array_equal(pool.targets.numpy(), LABELS[ids] - 36)


def test_femnist_samples_images_per_class_with_its_seed(tmp_path) -> None:
    fake_emnist(tmp_path)
    pools = [FEMNIST(root=str(tmp_path), images_per_class=3, seed=seed).load_train() for seed in (0, 0, 1)]
    assert np.bincount(pools[0].targets.numpy()).tolist() == [3] * 10
    assert image_ids(pools[0].inputs) == image_ids(pools[1].inputs)
    assert image_ids(pools[0].inputs) != image_ids(pools[2].inputs)


def test_femnist_keeps_every_image_of_a_short_letter_with_a_warning(tmp_path) -> None:
    fake_emnist(tmp_path)
    with pytest.warns(UserWarning, match="fewer than images_per_class=5"):
        pool = FEMNIST(root=str(tmp_path), images_per_class=5).load_train()
    assert len(pool) == 40


def test_missing_emnist_names_the_flag_and_what_to_download(tmp_path) -> None:
    dataset = FEMNIST(root=str(tmp_path))  # constructing reads nothing
    with pytest.raises(ConfigError) as error:
        dataset.load_train()
    message = str(error.value)
    assert f"--data.dataset.init_args.root={tmp_path}" in message and "download=true" in message
    assert "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip" in message
    assert "emnist-byclass-train-images-idx3-ubyte" in message and str(tmp_path / "EMNIST" / "raw") in message
    with pytest.raises(ConfigError, match="images_per_class >= 1"):
        FEMNIST(images_per_class=0)


def class_blocks(parts: list[np.ndarray], targets: np.ndarray, c: int) -> dict[int, set[int]]:
    """Each client's samples of class ``c``."""
    return {u: set(part[targets[part] == c].tolist()) for u, part in enumerate(parts) if np.any(targets[part] == c)}


def test_femnist_partition_gives_five_consecutive_classes_in_equal_amounts() -> None:
    targets = np.repeat(np.arange(10), 4000)
    parts = FEMNISTPartition()(targets, 10, np.random.default_rng(0))
    assert len(parts) == 200
    validate_partition(parts, len(targets))  # disjoint: no class wraps at FedProx's sizes
    sizes = []
    for u, part in enumerate(parts):
        counts = np.bincount(targets[part], minlength=10)
        held = np.flatnonzero(counts)
        assert sorted(held.tolist()) == sorted((u + j) % 10 for j in range(5))
        assert np.unique(counts[held]).size == 1 and counts[held[0]] >= 2
        sizes.append(len(part))
    assert 12_000 < sum(sizes) < 25_000, "FedProx reports 18,345 samples over its 200 users"


def test_femnist_partition_takes_the_floor_of_n_over_k_and_at_least_two() -> None:
    targets = np.repeat(np.arange(10), 1000)
    # σ = 0 makes n_u = e^4 + base exactly: ⌊(54.598 + 5) / 5⌋ = 11 and ⌊54.598 / 5⌋ = 10
    for base, expected in ((5, 11), (0, 10)):
        parts = FEMNISTPartition(num_clients=20, sigma=0.0, base=base)(targets, 10, np.random.default_rng(0))
        assert {len(part) for part in parts} == {5 * expected}
    many_classes = np.repeat(np.arange(40), 100)
    parts = FEMNISTPartition(num_clients=4, classes_per_client=30, sigma=0.0, base=0)(
        many_classes, 40, np.random.default_rng(0)
    )
    assert {len(part) for part in parts} == {60}, "⌊54.598 / 30⌋ = 1 is raised to 2 per class"


def test_femnist_partition_pointer_wraps_only_on_overrun() -> None:
    # 22 samples per class, 11 per client: class 0's holders, in order 0, 6, 7, 8, 9, read
    # [0, 11), [11, 22) (ending exactly at the class end, no wrap), then wrap: [0, 11), [11, 22), [0, 11)
    targets = np.repeat(np.arange(10), 22)
    parts = FEMNISTPartition(num_clients=10, sigma=0.0, base=5)(targets, 10, np.random.default_rng(0))
    blocks = class_blocks(parts, targets, 0)
    assert sorted(blocks) == [0, 6, 7, 8, 9] and all(len(block) == 11 for block in blocks.values())
    assert not blocks[0] & blocks[6], "FedProx's inverted test would reset here and repeat client 0's block"
    assert blocks[0] | blocks[6] == set(range(22))
    assert blocks[7] == blocks[0] and blocks[8] == blocks[6] and blocks[9] == blocks[0]


def test_femnist_partition_is_seeded() -> None:
    targets = np.repeat(np.arange(10), 500)
    first, again, other = (FEMNISTPartition()(targets, 10, np.random.default_rng(s)) for s in (3, 3, 4))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_femnist_partition_reports_bad_settings() -> None:
    with pytest.raises(ConfigError) as error:
        FEMNISTPartition(num_clients=0, sigma=-1.0, base=-2)
    assert len(error.value.problems) == 3 and "--data.partitioner.init_args.sigma" in str(error.value)
    targets = np.repeat(np.arange(10), 8)
    with pytest.raises(ConfigError, match="classes_per_client <= 10"):
        FEMNISTPartition(classes_per_client=11)(targets, 10, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="the class has only 8"):
        FEMNISTPartition(sigma=0.0)(targets, 10, np.random.default_rng(0))
