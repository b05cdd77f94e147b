import errno
import json
import logging
import os
import shutil
import subprocess
import types

import numpy as np
import pytest
import torch

from fedlight.callbacks.backbone_feature_cache import BackboneFeatureCache
from fedlight.data import cache_files
from fedlight.data.cache_files import file_digest
from fedlight.data.features import feature_cache
from fedlight.data.features.feature_cache import MANIFEST, FeatureCache, reuse_problems
from fedlight.errors import ConfigError
from fedlight.models.patch_features import build_patch_backbone


def setup(tmp_path, max_bytes=float("inf"), k=4):
    torch.manual_seed(0)
    backbone = build_patch_backbone("conv_patch8", image_size=16, out_channels=8).eval()
    pool = torch.randn(20, 3, 16, 16)
    clients = [torch.tensor([0, 3, 5, 7, 8, 11, 12]), torch.tensor([1, 2, 4, 6, 9, 10, 13, 14, 15])]
    cache = FeatureCache.build(
        backbone, lambda ix: pool[ix], clients, len(pool), tmp_path, k=k, max_bytes=max_bytes, batch_size=3
    )
    return backbone, pool, clients, cache


def test_cached_features_are_bit_identical_to_recomputed_ones(tmp_path):
    backbone, pool, _clients, cache = setup(tmp_path)
    index = torch.tensor([12, 1, 3, 15])  # from both clients, out of order
    with torch.no_grad():
        recomputed = backbone(pool[index]).half().float()
    assert torch.equal(cache.features(index), recomputed)
    assert cache.nbytes == 16 * 8 * 2 * 2 * 2  # 16 training images × [8, 2, 2] × fp16


def test_knn_lists_rank_a_clients_own_images_by_cosine_of_pooled_features(tmp_path):
    backbone, pool, clients, cache = setup(tmp_path)
    for indices in clients:
        with torch.no_grad():
            pooled = backbone(pool[indices]).mean(dim=(2, 3)).numpy()
        normed = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        cosine = normed @ normed.T
        for i, image in enumerate(indices.tolist()):
            others = np.argsort(-np.where(np.arange(len(indices)) == i, -np.inf, cosine[i]), kind="stable")[:3]
            assert cache.knn[image].tolist() == [image, *indices[others].tolist()]
    outside = torch.tensor([16, 17, 18, 19])
    assert (cache.owner[outside] == -1).all()


def test_partners_come_from_ranks_one_and_two_of_the_own_client(tmp_path):
    _, _, clients, cache = setup(tmp_path)
    index = clients[1].repeat(50)
    partners = cache.sample_neighbours(index, num_neighbors=2, generator=torch.Generator().manual_seed(0))
    for image, partner in zip(index.tolist(), partners.tolist(), strict=True):
        assert partner in cache.knn[image, 1:3].tolist()


def test_clients_past_the_budget_are_computed_on_demand(tmp_path):
    per_image = 8 * 2 * 2 * 2
    backbone, pool, _clients, cache = setup(tmp_path, max_bytes=7 * per_image)  # client 0 exactly fits
    assert cache.client_nbytes(0) == 7 * per_image and cache.client_nbytes(1) == 0
    index = torch.tensor([3, 4])  # one of each
    with torch.no_grad():
        expected = backbone(pool[index])
    torch.testing.assert_close(cache.features(index)[0], expected[0].half().float(), rtol=0, atol=0)
    torch.testing.assert_close(cache.features(index)[1], expected[1])  # fp32, never stored
    assert cache.knn[4, 0] == 4  # every client still has its lists


def test_a_second_build_of_the_same_setting_reuses_the_files(tmp_path):
    backbone, pool, clients, _ = setup(tmp_path)
    calls = []

    def images(ix):
        calls.append(ix)
        return pool[ix]

    FeatureCache.build(backbone, images, clients, len(pool), tmp_path, k=4)
    assert len(calls) == 1  # one image to learn the feature shape, no recomputation
    backbone.net[0].bias.data += 1  # other weights: another folder
    FeatureCache.build(backbone, images, clients, len(pool), tmp_path, k=4)
    assert len(calls) > 2
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


# -- a cache trusts only what it can check -------------------------------------------------------------


def folder_of(tmp_path):
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != "disk"]
    return folder


def redigest(folder):
    """Rewrites the manifest with the files' current digests: a damage that happened before it was written."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for name, record in manifest["files"].items():
        path = folder / name
        record.update(bytes=path.stat().st_size, sampled=file_digest(path))
    (folder / MANIFEST).write_text(json.dumps(manifest))


def scramble_rows(folder):
    store = np.load(folder / "client1.npy")
    np.save(folder / "client1.npy", store[::-1])  # same size, same header, the rows reversed


def truncate(folder):
    path = folder / "client0.npy"
    path.write_bytes(path.read_bytes()[:-100])


def delete_list(folder):
    (folder / "knn0.npy").unlink()


def swap_neighbours(folder):
    lists = np.load(folder / "knn1.npy")
    lists[:, 1] = 0  # image 0 belongs to client 0: client 1's images would be paired across clients
    np.save(folder / "knn1.npy", lists)


def swap_neighbours_before_the_manifest(folder):
    swap_neighbours(folder)
    redigest(folder)


def old_marker(folder):
    (folder / MANIFEST).write_text("")  # the empty marker of a cache written before digests were recorded


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (scramble_rows, "client1.npy"),
        (truncate, "client0.npy"),
        (delete_list, "knn0.npy"),
        (swap_neighbours, "knn1.npy"),
        (swap_neighbours_before_the_manifest, "knn1.npy"),
        (old_marker, MANIFEST),
    ],
)
def test_a_damaged_cache_is_rebuilt_naming_the_file_never_read(tmp_path, caplog, damage, named):
    backbone, pool, clients, cache = setup(tmp_path)
    knn = cache.knn.clone()
    folder = folder_of(tmp_path)
    damage(folder)
    assert reuse_problems(folder, clients, (8, 2, 2), "float16", k=4)  # what the build is about to find
    with caplog.at_level(logging.WARNING, logger="fedlight.data.features.feature_cache"):
        rebuilt = FeatureCache.build(backbone, lambda ix: pool[ix], clients, len(pool), tmp_path, k=4)
    assert named in caplog.text and "rebuilt" in caplog.text
    index = torch.arange(16)
    with torch.no_grad():
        expected = backbone(pool[index]).half().float()
    assert torch.equal(rebuilt.features(index), expected)
    assert torch.equal(rebuilt.knn, knn)
    assert reuse_problems(folder, clients, (8, 2, 2), "float16", k=4) == []


def test_lists_shorter_than_asked_for_are_rebuilt(tmp_path, caplog):
    backbone, pool, clients, _ = setup(tmp_path, k=3)  # k is not part of the folder's fingerprint
    with caplog.at_level(logging.WARNING):
        cache = FeatureCache.build(backbone, lambda ix: pool[ix], clients, len(pool), tmp_path, k=4)
    assert "lists 3 neighbours, 4 are asked for" in caplog.text
    assert cache.knn.shape == (20, 4) and (cache.knn[clients[0], 0] == clients[0]).all()


def test_full_verification_records_full_digests_once(tmp_path, caplog):
    backbone, pool, clients, _ = setup(tmp_path)  # sampled digests only
    folder = folder_of(tmp_path)
    assert all(set(r) == {"bytes", "sampled"} for r in json.loads((folder / MANIFEST).read_text())["files"].values())
    for _ in range(2):
        FeatureCache.build(backbone, lambda ix: pool[ix], clients, len(pool), tmp_path, k=4, verify="full")
    files = json.loads((folder / MANIFEST).read_text())["files"]
    assert all(r["full"] == file_digest(folder / name, "full") for name, r in files.items())
    assert caplog.text.count("rebuilt") == 1  # the sampled-only folder, once


def test_an_intact_cache_is_reused_without_a_warning(tmp_path, caplog):
    backbone, pool, clients, _ = setup(tmp_path)
    calls = []
    with caplog.at_level(logging.WARNING):
        FeatureCache.build(backbone, lambda ix: calls.append(ix) or pool[ix], clients, len(pool), tmp_path, k=4)
    assert len(calls) == 1 and caplog.text == ""


def test_sampled_digests_read_blocks_of_a_large_file_and_full_ones_every_byte(tmp_path):
    path = tmp_path / "large.bin"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 20 * 2**20, dtype=np.uint8).tobytes())
    path.write_bytes(data)
    sampled, full = file_digest(path), file_digest(path, "full")
    blocks = [i * (len(data) - 2**16) // 255 for i in range(256)]  # the sampled blocks' first bytes
    between = blocks[1] + 2**16 + 10  # after the second block ends, before the third begins
    assert between < blocks[2]
    data[between] ^= 1
    path.write_bytes(data)
    assert file_digest(path) == sampled and file_digest(path, "full") != full  # the documented blind spot
    data[between] ^= 1
    data[blocks[2] + 5] ^= 1
    path.write_bytes(data)
    assert file_digest(path) != sampled


def test_an_unwritable_cache_directory_is_found_at_set_up(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    callback = BackboneFeatureCache(directory=str(blocker / "features"))
    module, data = types.SimpleNamespace(attach_feature_cache=None), types.SimpleNamespace(return_index=True)
    problems = callback.check(module, data)
    assert len(problems) == 1
    assert "BackboneFeatureCache) init_args.directory" in problems[0] and "is a file, not a folder" in problems[0]
    backbone = build_patch_backbone("conv_patch8", image_size=16, out_channels=8)
    with pytest.raises(ConfigError, match="Cannot create the feature cache"):
        FeatureCache.build(backbone, lambda ix: torch.zeros(len(ix), 3, 16, 16), [torch.arange(4)], 4, blocker)


# -- a full disk -----------------------------------------------------------------------------------------


def test_too_little_free_space_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    free = 1000  # bytes; the cache needs 16 images × 64 B of features, lists and headers
    monkeypatch.setattr(cache_files.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=free))
    with pytest.raises(ConfigError) as error:
        setup(tmp_path)
    message = str(error.value)
    needed = 2 * 128 + 16 * 64 + 2 * 128 + (7 * 4 + 9 * 4) * 8 + (128 + 9 * 64)  # files, then the largest again
    assert f"needs {needed} bytes" in message and f"has {free} bytes" in message
    assert str(tmp_path) in message and "max_gib" in message
    assert not any(p.is_file() for p in folder_of(tmp_path).iterdir())


def test_a_disk_that_fills_up_while_writing_leaves_no_trusted_folder(tmp_path, monkeypatch):
    syncs = []

    def full_after_two(fd):  # client 0's features and list are written, then the disk is full
        syncs.append(fd)
        if len(syncs) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(feature_cache.os, "fsync", full_after_two)
    with pytest.raises(ConfigError, match="No space left on the disk to write the feature cache") as error:
        setup(tmp_path)
    folder = folder_of(tmp_path)
    assert str(folder) in str(error.value) and "resume" in str(error.value)
    assert sorted(p.name for p in folder.iterdir()) == ["client0.npy", "knn0.npy"]  # no temporaries, no marker
    monkeypatch.undo()
    backbone, pool, clients, cache = setup(tmp_path)  # the next run builds it whole
    with torch.no_grad():
        assert torch.equal(cache.features(torch.tensor([1, 0])), backbone(pool[[1, 0]]).half().float())
    assert reuse_problems(folder, clients, (8, 2, 2), "float16", k=4) == []


@pytest.fixture
def small_disk(tmp_path):
    """An 8 KiB tmpfs at ``tmp_path/disk``, smaller than one client's features; skipped, with the reason, where it
    cannot be mounted (the injected-ENOSPC tests above cover the same code)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8); the injected-ENOSPC tests cover this path")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); injected ENOSPC covers it")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def build_large(directory):
    torch.manual_seed(0)  # 16 training images × [64, 4, 4] fp16 = 32 KiB of features
    backbone = build_patch_backbone("conv_patch8", image_size=32, out_channels=64).eval()
    pool = torch.randn(20, 3, 32, 32)
    clients = [torch.tensor([0, 3, 5, 7, 8, 11, 12]), torch.tensor([1, 2, 4, 6, 9, 10, 13, 14, 15])]
    return FeatureCache.build(backbone, lambda ix: pool[ix], clients, len(pool), directory, k=4)


def test_a_real_small_disk_is_refused_with_the_bytes_needed_and_free(small_disk):
    with pytest.raises(ConfigError, match=r"needs \d+ bytes .* has \d+ bytes .* free") as error:
        build_large(small_disk)
    assert str(small_disk) in str(error.value)


def test_a_real_small_disk_that_fills_up_is_an_error_not_a_crash(small_disk, monkeypatch):
    monkeypatch.setattr(feature_cache, "free_space_error", lambda *args: None)  # another writer took the space
    with pytest.raises(ConfigError, match="No space left on the disk to write the feature cache"):
        build_large(small_disk)
    (folder,) = small_disk.iterdir()
    assert MANIFEST not in {p.name for p in folder.iterdir()}
    assert not any(p.name.endswith(".tmp") for p in folder.iterdir())


def test_fingerprint_takes_batch_norms_and_changes_with_their_running_statistics():
    backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))  # holds a 0-d counter
    indices = [torch.arange(3)]
    before = feature_cache.fingerprint(backbone, (3, 8, 8), indices, "float16")
    backbone[1].running_mean.add_(1.0)
    assert feature_cache.fingerprint(backbone, (3, 8, 8), indices, "float16") != before
    backbone[1].running_mean.sub_(1.0)
    assert feature_cache.fingerprint(backbone, (3, 8, 8), indices, "float16") == before
