"""Every classification reader on its miniature in the dataset's real layout.

The intact miniature loads as its files say, checked against the files read back here with numpy, pickle and
Pillow; a file renamed, missing or damaged is refused with one ConfigError that names the file and what to do.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from miniatures import registry
from miniatures.classification import CIFAR10_CLASSES, TINY_IMAGENET_GREY
from PIL import Image

import fedlight.data
from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.errors import ConfigError

# each dataset's root as its configs name it (TinyImageNet's download needs the archive's folder name)
ROOTS = {
    "MNIST": "mnist",
    "FEMNIST": "emnist",
    "CelebA": "celeba",
    "CIFAR10": "cifar10",
    "CIFAR100": "cifar100",
    "CINIC10": "cinic10",
    "TinyImageNet": "tiny-imagenet-200",
}
OPTION = "--data.dataset.init_args."


def build(name: str, root: Path, **options) -> FederatedDataset:
    """Writes the miniature into ``root`` and returns its reader, with the options its flags give."""
    miniature = registry()[name]
    flags = [*miniature.write(root), *miniature.flags]
    given = dict(flag.removeprefix(OPTION).split("=", 1) for flag in flags if flag.startswith(OPTION))
    kwargs = {key: yaml.safe_load(value) for key, value in given.items()}
    return getattr(fedlight.data, name)(root=str(root), **{**kwargs, **options})


def load(dataset: FederatedDataset) -> tuple[LabelledTensors, LabelledTensors | None]:
    return dataset.load_train(), dataset.load_test()


def read_idx(path: Path) -> np.ndarray:
    """An IDX file read with numpy: 4 magic bytes, the big-endian sizes, the values."""
    data = path.read_bytes()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def unpickle(path: Path) -> dict:
    with open(path, "rb") as file:
        return pickle.load(file, encoding="latin1")


def pixels(path: Path) -> torch.Tensor:
    """The ``[3, H, W]`` uint8 RGB pixels Pillow decodes from ``path``."""
    with Image.open(path) as image:
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


# --- the intact miniatures ---------------------------------------------------------------------------------------


def test_mnist_pools_both_idx_splits(tmp_path) -> None:
    pool, test = load(build("MNIST", tmp_path / "mnist", standardize=False, download=True))
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    images = np.concatenate([read_idx(raw / f"{s}-images-idx3-ubyte") for s in ("train", "t10k")])
    labels = np.concatenate([read_idx(raw / f"{s}-labels-idx1-ubyte") for s in ("train", "t10k")])
    assert test is None and pool.inputs.shape == (len(labels), 1, 28, 28) and pool.inputs.dtype == torch.float32
    torch.testing.assert_close(pool.inputs[:, 0], torch.from_numpy(images.astype(np.float32) / 255))
    assert pool.targets.dtype == torch.int64 and pool.targets.tolist() == labels.tolist()
    assert np.bincount(labels).min() >= 10, "PowerLaw's 10 clients take 5 of each class twice"


def test_femnist_samples_upright_letters_of_emnist_byclass(tmp_path) -> None:
    pool, test = load(build("FEMNIST", tmp_path / "emnist", download=True))
    raw = tmp_path / "emnist" / "EMNIST" / "raw"
    stored = np.concatenate([read_idx(raw / f"emnist-byclass-{s}-images-idx3-ubyte") for s in ("train", "test")])
    labels = np.concatenate([read_idx(raw / f"emnist-byclass-{s}-labels-idx1-ubyte") for s in ("train", "test")])
    assert test is None and pool.inputs.shape == (120, 1, 28, 28) and pool.targets.dtype == torch.int64
    assert np.bincount(pool.targets.numpy()).tolist() == [12] * 10, "images_per_class=12 of each of a–j"
    upright = torch.from_numpy(stored.transpose(0, 2, 1).astype(np.float32) / 255)
    found = []
    for image, target in zip(pool.inputs[:, 0], pool.targets.tolist(), strict=True):
        matches = [i for i in np.flatnonzero(labels == 36 + target) if torch.equal(upright[i], image)]
        assert len(matches) == 1, "every sample is one upright image of its letter"
        found += matches
    assert len(set(found)) == 120, "drawn without replacement"


def test_celeba_keeps_celebrities_of_five_images_labelled_by_smiling(tmp_path) -> None:
    pool, test = load(build("CelebA", tmp_path / "celeba", download=True))
    folder = tmp_path / "celeba" / "celeba"
    rows = [line.split() for line in (folder / "identity_CelebA.txt").read_text().splitlines()]
    lines = (folder / "list_attr_celeba.txt").read_text().splitlines()
    column = lines[1].split().index("Smiling") + 1
    smiling = {fields[0]: int(fields[column]) for fields in map(str.split, lines[2:])}
    counts = {identity: sum(row[1] == identity for row in rows) for _, identity in rows}
    kept = [(name, int(identity)) for name, identity in rows if counts[identity] >= 5]
    celebrities = sorted({identity for _, identity in kept})
    assert test is None and 0 < len(kept) < len(rows), "one celebrity has fewer than 5 images"
    assert pool.inputs.shape == (len(kept), 3, 84, 84) and pool.inputs.dtype == torch.float32
    assert pool.targets.tolist() == [(smiling[name] + 1) // 2 for name, _ in kept]
    assert pool.groups.tolist() == [celebrities.index(identity) for _, identity in kept]
    with Image.open(folder / "img_align_celeba" / kept[3][0]) as image:
        assert image.size == (178, 218)
        resized = np.array(image.convert("RGB").resize((84, 84), Image.Resampling.BICUBIC))
    torch.testing.assert_close(pool.inputs[3], torch.from_numpy(resized).permute(2, 0, 1).float() / 255)


@pytest.mark.parametrize(
    ("name", "folder", "train_files", "test_files", "label_key"),
    [
        ("CIFAR10", "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], "labels"),
        ("CIFAR100", "cifar-100-python", ["train"], ["test"], "fine_labels"),
    ],
)
def test_cifar_reads_the_pickled_batches_verified_by_their_sums(
    tmp_path, name, folder, train_files, test_files, label_key
) -> None:
    dataset = build(name, tmp_path / ROOTS[name], download=True)
    assert dataset.checksums == str(tmp_path / ROOTS[name] / "MD5SUMS")
    for split, files in zip(load(dataset), (train_files, test_files), strict=True):
        entries = [unpickle(tmp_path / ROOTS[name] / folder / file) for file in files]
        data = np.concatenate([entry["data"] for entry in entries]).reshape(-1, 3, 32, 32)
        assert split.inputs.dtype == torch.uint8 and torch.equal(split.inputs, torch.from_numpy(data))
        assert split.targets.tolist() == [label for entry in entries for label in entry[label_key]]
    assert split.targets.unique().numel() == dataset.num_classes, "the test set holds every class"


def test_cinic10_reads_class_folders_in_cifar_order(tmp_path) -> None:
    pool, test = load(build("CINIC10", tmp_path / "cinic10", download=True))
    for split, loaded in (("train", pool), ("test", test)):
        files = [
            (label, path)
            for label, name in enumerate(CIFAR10_CLASSES)
            for path in sorted((tmp_path / "cinic10" / split / name).glob("*.png"))
        ]
        assert loaded.targets.tolist() == [label for label, _ in files]
        assert loaded.inputs.dtype == torch.uint8 and torch.equal(
            loaded.inputs, torch.stack([pixels(p) for _, p in files])
        )
    assert {path.name[:8] for path in (tmp_path / "cinic10" / "train").rglob("*.png")} >= {"cifar10-", "n0212180"}


def test_tiny_imagenet_reads_train_folders_and_the_annotated_validation_set(tmp_path) -> None:
    root = tmp_path / "tiny-imagenet-200"
    pool, test = load(build("TinyImageNet", root, download=True))
    wnids = sorted((root / "wnids.txt").read_text().split())
    assert len(wnids) == 200 and (root / "words.txt").is_file() and (root / "test" / "images").is_dir()
    files = [
        (label, path)
        for label, wnid in enumerate(wnids)
        for path in sorted((root / "train" / wnid / "images").glob("*.JPEG"))
    ]
    assert pool.inputs.shape == (len(files), 3, 64, 64) and pool.inputs.dtype == torch.uint8
    assert pool.targets.tolist() == [label for label, _ in files]
    assert torch.equal(pool.inputs, torch.stack([pixels(path) for _, path in files]))
    grey = pool.inputs[[label for label, _ in files].index(TINY_IMAGENET_GREY)]
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[0], grey[2]), "a greyscale JPEG expanded to RGB"
    annotations = [line.split("\t") for line in (root / "val" / "val_annotations.txt").read_text().splitlines()]
    assert test.targets.tolist() == [wnids.index(fields[1]) for fields in annotations]
    assert torch.equal(
        test.inputs, torch.stack([pixels(root / "val" / "images" / fields[0]) for fields in annotations])
    )


# --- a file renamed, missing or damaged ------------------------------------------------------------------------


def rename(path: Path) -> None:
    path.rename(path.with_name(path.name + "~"))  # an editor's backup name: the reader no longer finds the file


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())


def first_kept_celeba_image(root: Path) -> str:
    """The first image of a celebrity the reader keeps (one of at least 5 images), so that the reader opens it."""
    rows = [line.split() for line in (root / "celeba" / "identity_CelebA.txt").read_text().splitlines()]
    counts = {identity: sum(row[1] == identity for row in rows) for _, identity in rows}
    return "celeba/img_align_celeba/" + next(name for name, identity in rows if counts[identity] >= 5)


def first_train_image(root: Path) -> str:
    wnid = sorted((root / "wnids.txt").read_text().split())[3]
    return f"train/{wnid}/images/{wnid}_0.JPEG"


def first_cinic10_image(root: Path) -> str:
    return sorted((root / "test" / "ship").iterdir())[0].relative_to(root).as_posix()


ALL = (rename, remove, truncate, garble)
CASES = [
    ("MNIST", "MNIST/raw/train-images-idx3-ubyte", ALL),
    ("MNIST", "MNIST/raw/t10k-labels-idx1-ubyte", ALL),
    ("FEMNIST", "EMNIST/raw/emnist-byclass-train-labels-idx1-ubyte", ALL),
    ("FEMNIST", "EMNIST/raw/emnist-byclass-test-images-idx3-ubyte", ALL),
    ("CelebA", "celeba/identity_CelebA.txt", ALL),
    ("CelebA", "celeba/list_attr_celeba.txt", ALL),
    ("CelebA", first_kept_celeba_image, ALL),
    ("CIFAR10", "cifar-10-batches-py/data_batch_3", ALL),
    ("CIFAR10", "cifar-10-batches-py/test_batch", ALL),
    ("CIFAR10", "cifar-10-batches-py/batches.meta", ALL),
    ("CIFAR100", "cifar-100-python/train", ALL),
    ("CIFAR100", "cifar-100-python/meta", ALL),
    ("CIFAR10", "MD5SUMS", (rename, remove, garble)),
    # CINIC-10 lists no file names, so a missing image cannot be told from a smaller copy; a class folder can
    ("CINIC10", first_cinic10_image, (rename, truncate, garble)),
    ("CINIC10", "train/cat", (remove,)),
    ("TinyImageNet", "wnids.txt", ALL),
    # a line cut at its end leaves a shorter, valid listing: garbage stands for the damage
    ("TinyImageNet", "val/val_annotations.txt", (rename, remove, garble)),
    ("TinyImageNet", "val/images/val_3.JPEG", ALL),
    ("TinyImageNet", first_train_image, (rename, truncate, garble)),
]


@pytest.mark.parametrize(
    ("name", "file", "damage"),
    [
        pytest.param(
            name, file, damage, id=f"{name}-{file if isinstance(file, str) else file.__name__}-{damage.__name__}"
        )
        for name, file, damages in CASES
        for damage in damages
    ],
)
def test_a_broken_file_is_named_with_what_to_do(tmp_path, name, file, damage) -> None:
    root = tmp_path / ROOTS[name]
    dataset = build(name, root)
    path = root / (file if isinstance(file, str) else file(root))
    damage(path)
    with pytest.raises(ConfigError) as error:
        load(dataset)
    message = str(error.value)
    assert str(path) in message, message
    fixes = ("again", "rename", "replace", "restore", "extract", "download", "md5sum")
    assert any(fix in message.lower() for fix in fixes), f"no fix in: {message}"
    assert "Traceback" not in message and len(message) < 2000


def test_a_missing_training_image_of_tiny_imagenet_names_its_class_folder(tmp_path) -> None:
    root = tmp_path / "tiny-imagenet-200"
    dataset = build("TinyImageNet", root)
    path = root / first_train_image(root)
    path.unlink()  # its class's only image in the miniature
    with pytest.raises(ConfigError, match=rf"{path.parent} holds no \.JPEG images"):
        dataset.load_train()


def test_writing_a_miniature_twice_leaves_the_same_files(tmp_path) -> None:
    for name, miniature in registry().items():
        if name not in ROOTS:
            continue
        first, second = tmp_path / "first" / name, tmp_path / "second" / name
        miniature.write(first)
        flags = miniature.write(second)
        miniature.write(second)
        files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
        assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)
        assert all(flag.startswith(OPTION) for flag in flags)


@pytest.mark.parametrize(
    ("name", "folder", "published"),
    [("CINIC10", "train/airplane", "9,000"), ("TinyImageNet", "train/{first}/images", "500")],
)
def test_a_folder_short_of_its_published_count_is_refused_unless_declared_a_subset(tmp_path, name, folder, published):
    """An archive unpacked part-way leaves every folder present and images missing: read as the full dataset, it is
    refused naming the folder and the counts; declared a subset, it is read as it is."""
    root = tmp_path / ROOTS[name]
    subset = build(name, root)  # the miniature's own flags declare it a subset
    assert subset.subset and len(subset.load_train()) > 0
    full = build(name, root, subset=False)
    with pytest.raises(ConfigError) as error:
        full.load_train()
    message = str(error.value)
    if name == "TinyImageNet":  # the first class in label order (sorted wnids)
        folder = folder.format(first=sorted((root / "wnids.txt").read_text().split())[0])
    assert str(root / folder) in message and f"not {'CINIC-10' if name == 'CINIC10' else name}'s {published}" in message
    assert "subset=true" in message
