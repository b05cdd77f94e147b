"""CIFAR-10/100, CINIC-10 and TinyImageNet loaders on tiny fakes written in the official layouts."""

import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import CIFAR10 as TorchvisionCIFAR10

from fedlight.data import CIFAR10, CIFAR100, CINIC10, TinyImageNet
from fedlight.data.datasets.cinic10 import CLASSES
from fedlight.errors import ConfigError


def fake_cifar(root, folder, train_files, test_file, label_key, per_file=4, seed=0):
    """Writes torchvision's pickled batches; returns {split: (images [N, 32, 32, 3], labels)}."""
    rng = np.random.default_rng(seed)
    (root / folder).mkdir(parents=True)
    written = {}
    for split, files in (("train", train_files), ("test", [test_file])):
        images, labels = [], []
        for name in files:
            data = rng.integers(0, 256, (per_file, 3072), dtype=np.uint8)  # rows: R plane, G plane, B plane
            batch_labels = rng.integers(0, 10, per_file).tolist()
            with open(root / folder / name, "wb") as f:
                pickle.dump({"data": data, label_key: batch_labels}, f)
            images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            labels += batch_labels
        written[split] = (np.concatenate(images), labels)
    return written


@pytest.fixture
def no_checksums(monkeypatch):
    # torchvision checks the official archives' md5 sums, which tiny fakes cannot match
    monkeypatch.setattr(TorchvisionCIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(TorchvisionCIFAR10, "_load_meta", lambda self: None)


def test_cifar10_reads_both_splits_as_uint8_channels_first(tmp_path, no_checksums):
    train_files = [f"data_batch_{i}" for i in range(1, 6)]
    written = fake_cifar(tmp_path, "cifar-10-batches-py", train_files, "test_batch", "labels")
    dataset = CIFAR10(root=str(tmp_path))
    pool, test = dataset.load_train(), dataset.load_test()
    assert dataset.num_classes == 10 and dataset.input_shape == (3, 32, 32)
    assert pool.inputs.shape == (20, 3, 32, 32) and pool.inputs.dtype == torch.uint8 and len(test) == 4
    images, labels = written["train"]
    np.testing.assert_array_equal(pool.inputs.permute(0, 2, 3, 1).numpy(), images)
    assert pool.targets.tolist() == labels and pool.targets.dtype == torch.int64


def test_cifar100_reads_the_fine_labels(tmp_path, no_checksums):
    written = fake_cifar(tmp_path, "cifar-100-python", ["train"], "test", "fine_labels")
    dataset = CIFAR100(root=str(tmp_path))
    assert dataset.num_classes == 100
    assert dataset.load_test().targets.tolist() == written["test"][1]


def test_missing_cifar_names_the_flag_and_the_download(tmp_path):
    with pytest.raises(ConfigError, match=r"(?s)--data.dataset.init_args.root=.*download=true.*cifar-10-python.tar.gz"):
        CIFAR10(root=str(tmp_path)).load_train()


def test_cinic10_reads_class_folders_in_cifar_order_and_caches(tmp_path):
    rng = np.random.default_rng(0)
    expected = {}
    for split in ("train", "valid", "test"):
        images, labels = [], []
        for label, name in enumerate(CLASSES):
            folder = tmp_path / split / name
            folder.mkdir(parents=True)
            for i in range(2 if label % 3 else 1):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{split}-{i}.png")
                images.append(torch.from_numpy(pixels).permute(2, 0, 1))
                labels.append(label)
        expected[split] = (torch.stack(images), labels)
    dataset = CINIC10(root=str(tmp_path))
    pool = dataset.load_train()
    assert torch.equal(pool.inputs, expected["train"][0]) and pool.targets.tolist() == expected["train"][1]
    assert (tmp_path / ".fedlight_cache" / "train.pt").exists()
    assert torch.equal(CINIC10(root=str(tmp_path)).load_train().inputs, pool.inputs)  # from the cache
    assert torch.equal(dataset.load_test().inputs, expected["test"][0])
    both = CINIC10(root=str(tmp_path), train_splits=("train", "valid")).load_train()
    assert len(both) == len(expected["train"][1]) + len(expected["valid"][1])


def test_missing_cinic10_says_where_the_folders_go(tmp_path):
    with pytest.raises(ConfigError, match=r"CINIC-10.*CINIC-10.tar.gz.*<class>/\*.png"):
        CINIC10(root=str(tmp_path)).load_train()


def test_tiny_imagenet_reads_train_folders_and_the_annotated_validation_set(tmp_path):
    rng = np.random.default_rng(0)
    wnids = [f"n{index:08d}" for index in range(200)]
    (tmp_path / "wnids.txt").write_text("\n".join(reversed(wnids)))  # the file's order is not the class order
    train = []
    for wnid in (wnids[3], wnids[0]):
        folder = tmp_path / "train" / wnid / "images"
        folder.mkdir(parents=True)
        pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{wnid}_0.JPEG", format="PNG")  # lossless; read by content
        train.append((wnids.index(wnid), torch.from_numpy(pixels).permute(2, 0, 1)))
    (tmp_path / "val" / "images").mkdir(parents=True)
    Image.fromarray(np.full((64, 64), 200, dtype=np.uint8)).save(tmp_path / "val" / "images" / "val_0.JPEG")
    (tmp_path / "val" / "val_annotations.txt").write_text(f"val_0.JPEG\t{wnids[5]}\t0\t0\t63\t63\n")

    dataset = TinyImageNet(root=str(tmp_path), cache=False)
    pool, test = dataset.load_train(), dataset.load_test()
    assert dataset.input_shape == (3, 64, 64) and dataset.num_classes == 200
    assert pool.targets.tolist() == [0, 3]  # sorted wnids: class 0's folder first
    assert torch.equal(pool.inputs[1], train[0][1])
    assert test.targets.tolist() == [5] and test.inputs.shape == (1, 3, 64, 64)
    assert (test.inputs[0].float() - 200).abs().max() <= 2  # a greyscale JPEG, expanded to RGB
    assert not (tmp_path / ".fedlight_cache").exists()


def test_missing_tiny_imagenet_names_the_archive(tmp_path):
    with pytest.raises(ConfigError, match=r"tiny-imagenet-200.zip"):
        TinyImageNet(root=str(tmp_path)).load_train()
