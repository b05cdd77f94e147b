"""The decoded-image cache is read only when it lists the same files and its images match their digest."""

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from fedlight.data.readers.image_files import cached_images


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (3, 4, 5, 3), dtype=np.uint8)  # three 4×5 RGB images
    (tmp_path / "train").mkdir()
    paths = []
    for i, image in enumerate(pixels):
        paths.append(tmp_path / "train" / f"{i}.png")
        Image.fromarray(image).save(paths[-1])
    return tmp_path, paths, torch.from_numpy(pixels).permute(0, 3, 1, 2)


def reorder(file):
    stored = torch.load(file, weights_only=True)
    torch.save({**stored, "images": stored["images"].flip(0)}, file)  # the names and the digest kept


def truncate(file):
    file.write_bytes(file.read_bytes()[:300])


def without_digest(file):
    stored = torch.load(file, weights_only=True)
    torch.save({"names": stored["names"], "images": stored["images"]}, file)  # a cache written before digests


def other_shape(file):
    stored = torch.load(file, weights_only=True)
    torch.save({**stored, "images": stored["images"][:, :, :2]}, file)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (reorder, "changed since they were written"),
        (truncate, "cannot be read"),
        (without_digest, "records no digest"),
        (other_shape, "another shape"),
    ],
)
def test_a_damaged_cache_is_decoded_again_with_a_warning_naming_it(folder, caplog, damage, why):
    root, paths, expected = folder
    assert torch.equal(cached_images(root, "train", paths, (4, 5), cache=True), expected)
    file = root / ".fedlight_cache" / "train.pt"
    damage(file)
    with caplog.at_level(logging.WARNING, logger="fedlight.data.readers.image_files"):
        assert torch.equal(cached_images(root, "train", paths, (4, 5), cache=True), expected)
    assert str(file) in caplog.text and why in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # rewritten whole: read from the cache without a word
        assert torch.equal(cached_images(root, "train", paths, (4, 5), cache=True), expected)
    assert caplog.text == ""


def test_a_cache_folder_that_cannot_be_written_costs_only_the_decoding(folder, caplog):
    root, paths, expected = folder
    (root / ".fedlight_cache").write_text("")  # a file where the folder would go
    with caplog.at_level(logging.WARNING):
        assert torch.equal(cached_images(root, "train", paths, (4, 5), cache=True), expected)
    assert "could not cache the decoded images" in caplog.text
