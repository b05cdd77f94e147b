"""CIFAR-10/100, CINIC-10 and TinyImageNet loaders on miniatures written in the official layouts."""

import hashlib

import numpy as np
import pytest
import torch
from miniatures.classification import (
    CHECKSUMS,
    CINIC10_SIZES,
    TINY_IMAGENET_GREY,
    write_cifar10_files,
    write_cifar100_files,
    write_cinic10,
    write_tiny_imagenet,
)
from PIL import Image

from fedlight.data import CIFAR10, CIFAR100, CINIC10, TinyImageNet
from fedlight.data.datasets.cinic10 import CLASSES
from fedlight.errors import ConfigError


def batches(count, per_file=4, seed=0):
    """``count`` batches of random ``[per_file, 3072]`` rows (R, G then B planes) and labels."""
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, 256, (per_file, 3072), dtype=np.uint8), rng.integers(0, 10, per_file).tolist())
        for _ in range(count)
    ]


def hwc(data):
    """Rows of R, G and B planes as ``[N, 32, 32, 3]`` images."""
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


def checksums_of(flags):
    (flag,) = flags
    return flag.removeprefix("--data.dataset.init_args.checksums=")


def test_cifar10_reads_both_splits_as_uint8_channels_first(tmp_path):
    written = batches(6)  # five training batches, then the test batch
    checksums = checksums_of(write_cifar10_files(tmp_path, written))
    dataset = CIFAR10(root=str(tmp_path), checksums=checksums)
    pool, test = dataset.load_train(), dataset.load_test()
    assert dataset.num_classes == 10 and dataset.input_shape == (3, 32, 32)
    assert pool.inputs.shape == (20, 3, 32, 32) and pool.inputs.dtype == torch.uint8 and len(test) == 4
    images = np.concatenate([hwc(data) for data, _ in written[:5]])
    np.testing.assert_array_equal(pool.inputs.permute(0, 2, 3, 1).numpy(), images)
    assert pool.targets.tolist() == [label for _, labels in written[:5] for label in labels]
    assert pool.targets.dtype == torch.int64 and test.targets.tolist() == written[5][1]


def test_cifar100_reads_the_fine_labels(tmp_path):
    train, test = batches(2, seed=1)
    dataset = CIFAR100(root=str(tmp_path), checksums=checksums_of(write_cifar100_files(tmp_path, train, test)))
    assert dataset.num_classes == 100
    assert dataset.load_test().targets.tolist() == test[1]


def test_without_checksums_a_copy_that_differs_from_the_published_sums_is_refused(tmp_path):
    write_cifar10_files(tmp_path, batches(6))
    with pytest.raises(ConfigError) as error:
        CIFAR10(root=str(tmp_path)).load_train()
    message = str(error.value)
    assert f"{tmp_path / 'cifar-10-batches-py' / 'data_batch_1'} does not match its MD5 sum" in message
    assert "the dataset's published sums" in message and "--data.dataset.init_args.checksums" in message


def test_a_wrong_sum_in_the_checksums_file_is_refused_naming_both_files(tmp_path):
    checksums = checksums_of(write_cifar10_files(tmp_path, batches(6)))
    lines = (tmp_path / CHECKSUMS).read_text().splitlines()
    wrong = [("0" * 32 + line[32:]) if line.endswith("/data_batch_2") else line for line in lines]
    (tmp_path / CHECKSUMS).write_text("\n".join(wrong) + "\n")
    with pytest.raises(ConfigError) as error:
        CIFAR10(root=str(tmp_path), checksums=checksums).load_train()
    message = str(error.value)
    assert f"{tmp_path / 'cifar-10-batches-py' / 'data_batch_2'} does not match its MD5 sum {'0' * 32}" in message
    assert f"--data.dataset.init_args.checksums={checksums}" in message and "data_batch_1" not in message


def test_the_checksums_file_must_list_every_file_in_md5sums_format(tmp_path):
    checksums = checksums_of(write_cifar10_files(tmp_path, batches(6)))
    lines = (tmp_path / CHECKSUMS).read_text().splitlines()
    # md5sum's binary mode ('*') and paths written with ./ are the same files
    (tmp_path / CHECKSUMS).write_text("\n".join(line.replace("  ", " *./") for line in lines) + "\n")
    assert len(CIFAR10(root=str(tmp_path), checksums=checksums).load_train()) == 20

    (tmp_path / CHECKSUMS).write_text("\n".join(line for line in lines if "meta" not in line))
    with pytest.raises(ConfigError, match=rf"{checksums} lists no MD5 sum for cifar-10-batches-py/batches\.meta"):
        CIFAR10(root=str(tmp_path), checksums=checksums).load_train()
    (tmp_path / CHECKSUMS).write_text(lines[0] + "\nnot a sum  cifar-10-batches-py/test_batch\n")
    with pytest.raises(ConfigError, match=rf"Line 2 of --data.dataset.init_args.checksums={checksums} is not"):
        CIFAR10(root=str(tmp_path), checksums=checksums).load_train()


def test_a_file_that_matches_its_listed_sum_but_is_no_batch_is_named(tmp_path):
    write_cifar10_files(tmp_path, batches(6))
    broken = tmp_path / "cifar-10-batches-py" / "data_batch_4"
    broken.write_bytes(b"not a pickle")
    lines = [
        f"{hashlib.md5(path.read_bytes()).hexdigest()}  {path.relative_to(tmp_path).as_posix()}\n"
        for path in sorted((tmp_path / "cifar-10-batches-py").iterdir())
    ]
    (tmp_path / "sums.md5").write_text("".join(lines))
    with pytest.raises(ConfigError, match=rf"{broken} cannot be read \(.*\): it matches its MD5 sum but is no CIFAR"):
        CIFAR10(root=str(tmp_path), checksums=str(tmp_path / "sums.md5")).load_train()


def test_missing_cifar_names_the_flag_and_the_download(tmp_path):
    with pytest.raises(ConfigError, match=r"(?s)--data.dataset.init_args.root=.*download=true.*cifar-10-python.tar.gz"):
        CIFAR10(root=str(tmp_path)).load_train()


def decoded(path):
    with Image.open(path) as image:
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def test_cinic10_reads_class_folders_in_cifar_order_and_caches(tmp_path):
    write_cinic10(tmp_path)
    expected = {}
    for split in ("train", "valid", "test"):
        files = [
            (label, path) for label, name in enumerate(CLASSES) for path in sorted((tmp_path / split / name).iterdir())
        ]
        expected[split] = (torch.stack([decoded(path) for _, path in files]), [label for label, _ in files])
    dataset = CINIC10(root=str(tmp_path), subset=True)
    pool = dataset.load_train()
    assert torch.equal(pool.inputs, expected["train"][0]) and pool.targets.tolist() == expected["train"][1]
    assert (tmp_path / ".fedlight_cache" / "train.pt").exists()
    assert torch.equal(CINIC10(root=str(tmp_path), subset=True).load_train().inputs, pool.inputs)  # from the cache
    assert torch.equal(dataset.load_test().inputs, expected["test"][0])
    both = CINIC10(root=str(tmp_path), subset=True, train_splits=("train", "valid")).load_train()
    assert len(both) == 10 * (CINIC10_SIZES["train"] + CINIC10_SIZES["valid"])


def test_cinic10_skips_hidden_files_and_names_a_file_that_is_no_png(tmp_path):
    write_cinic10(tmp_path)
    (tmp_path / "train" / "cat" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")  # what a desktop leaves
    assert len(CINIC10(root=str(tmp_path), subset=True, cache=False).load_train()) == 10 * CINIC10_SIZES["train"]
    (tmp_path / "train" / "cat" / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'train' / 'cat' / 'notes.txt'} is not a \.png file"):
        CINIC10(root=str(tmp_path), subset=True, cache=False).load_train()


def test_missing_cinic10_says_where_the_folders_go(tmp_path):
    with pytest.raises(ConfigError, match=r"CINIC-10.*CINIC-10.tar.gz.*<class>/\*.png"):
        CINIC10(root=str(tmp_path), subset=True).load_train()


def test_tiny_imagenet_reads_train_folders_and_the_annotated_validation_set(tmp_path):
    write_tiny_imagenet(tmp_path)
    listed = (tmp_path / "wnids.txt").read_text().split()
    wnids = sorted(listed)
    assert listed != wnids, "the file's order is not the class order"
    dataset = TinyImageNet(root=str(tmp_path), subset=True, cache=False)
    pool, test = dataset.load_train(), dataset.load_test()
    assert dataset.input_shape == (3, 64, 64) and dataset.num_classes == 200
    assert pool.targets.tolist() == list(range(200))  # one image per class, sorted wnids: class 0's folder first
    third = tmp_path / "train" / wnids[3] / "images" / f"{wnids[3]}_0.JPEG"
    assert torch.equal(pool.inputs[3], decoded(third))
    grey = pool.inputs[TINY_IMAGENET_GREY].float()
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2]), "a greyscale JPEG, expanded to RGB"
    annotations = [line.split("\t") for line in (tmp_path / "val" / "val_annotations.txt").read_text().splitlines()]
    assert test.targets.tolist() == [wnids.index(fields[1]) for fields in annotations]
    assert test.inputs.shape == (len(annotations), 3, 64, 64)
    assert not (tmp_path / ".fedlight_cache").exists()


def test_tiny_imagenet_needs_every_listed_class_and_annotated_image(tmp_path):
    write_tiny_imagenet(tmp_path)
    wnid = sorted((tmp_path / "wnids.txt").read_text().split())[5]
    (tmp_path / "train" / wnid / "images").rename(tmp_path / "train" / wnid / "pictures")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'train' / wnid / 'images'} is missing, though .* lists"):
        TinyImageNet(root=str(tmp_path), subset=True, cache=False).load_train()
    annotations = tmp_path / "val" / "val_annotations.txt"
    annotations.write_text(annotations.read_text() + "val_99.JPEG\tn99999999\t0\t0\t63\t63\n")
    with pytest.raises(ConfigError, match=r"Line 21 of .*val_annotations.txt is not .* with a wnid of .*wnids.txt"):
        TinyImageNet(root=str(tmp_path), subset=True, cache=False).load_test()


def test_missing_tiny_imagenet_names_the_archive(tmp_path):
    with pytest.raises(ConfigError, match=r"tiny-imagenet-200.zip"):
        TinyImageNet(root=str(tmp_path), subset=True).load_train()
