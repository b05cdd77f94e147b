import shutil
import zipfile

import numpy as np
import pytest
import torch
from miniatures.classification import write_celeba_files
from PIL import Image
from torchvision.datasets import CelebA as TorchvisionCelebA

import fedlight.data.datasets.celeba as celeba_module
from fedlight.data import CelebA
from fedlight.data.partition import Natural
from fedlight.errors import ConfigError

# file, celebrity id, Smiling (±1); celebrity 11 has only 2 images and is dropped at min_images=5
ROWS = [
    ("000001.png", 7, 1),
    ("000002.png", 3, -1),
    ("000003.png", 11, 1),
    ("000004.png", 7, -1),
    ("000005.png", 3, 1),
    ("000006.png", 7, 1),
    ("000007.png", 3, -1),
    ("000008.png", 11, -1),
    ("000009.png", 7, 1),
    ("000010.png", 3, -1),
    ("000011.png", 3, 1),
    ("000012.png", 7, -1),
]
KEPT = [row for row in ROWS if row[1] != 11]


def colour(index: int) -> tuple[int, int, int]:
    return (20 * index, 255 - 20 * index, 100)


def fake_celeba(root) -> None:
    """Writes a tiny CelebA in torchvision's layout: the text files and one flat-coloured PNG per row (lossless)."""
    write_celeba_files(root, ROWS, lambda index: Image.new("RGB", (9, 11), colour(index)))


def test_celeba_keeps_celebrities_with_enough_images_labelled_by_smiling(tmp_path) -> None:
    fake_celeba(tmp_path)
    dataset = CelebA(root=str(tmp_path), image_size=6)
    pool = dataset.load_train()
    assert dataset.num_classes == 2 and dataset.input_shape == (3, 6, 6) and dataset.load_test() is None
    assert pool.inputs.shape == (10, 3, 6, 6) and pool.inputs.dtype == torch.float32
    assert pool.targets.tolist() == [(smile + 1) // 2 for _, _, smile in KEPT]
    assert pool.groups.tolist() == [0 if celeb == 3 else 1 for _, celeb, _ in KEPT], "celebrities in id order"
    kept_colours = [colour(index) for index, row in enumerate(ROWS) if row[1] != 11]
    expected = torch.tensor(kept_colours, dtype=torch.float32)[:, :, None, None].expand(-1, -1, 6, 6) / 255
    torch.testing.assert_close(pool.inputs, expected)  # a flat image stays flat when resized
    parts = Natural()(pool.targets.numpy(), 2, np.random.default_rng(0), pool.groups)
    assert [len(part) for part in parts] == [5, 5]


def test_celeba_min_and_max_users_select_celebrities(tmp_path) -> None:
    fake_celeba(tmp_path)
    assert len(CelebA(root=str(tmp_path), image_size=4, min_images=2).load_train()) == 12
    pool = CelebA(root=str(tmp_path), image_size=4, max_users=1).load_train()
    assert len(pool) == 5 and set(pool.groups.tolist()) == {0}
    assert pool.targets.tolist() == [(smile + 1) // 2 for _, celeb, smile in KEPT if celeb == 3]
    assert (tmp_path / "fedlight_cache_4px_min5_users1.pt").is_file()
    with pytest.raises(ConfigError, match="min_images=6"):
        CelebA(root=str(tmp_path), min_images=6).load_train()


def test_celeba_caches_the_decoded_images(tmp_path) -> None:
    fake_celeba(tmp_path)
    first = CelebA(root=str(tmp_path), image_size=6).load_train()
    cache = tmp_path / "fedlight_cache_6px_min5.pt"
    assert cache.is_file() and not list(tmp_path.glob("*.tmp*"))
    cached = torch.load(cache, weights_only=True)
    assert cached["images"].dtype == torch.uint8 and cached["filenames"] == [name for name, _, _ in KEPT]

    Image.new("RGB", (9, 11), (0, 0, 0)).save(tmp_path / "celeba" / "img_align_celeba" / KEPT[0][0])
    torch.testing.assert_close(CelebA(root=str(tmp_path), image_size=6).load_train().inputs, first.inputs)

    torch.save({"filenames": ["other.png"], "images": cached["images"][:1]}, cache)  # stale: decoded again
    assert CelebA(root=str(tmp_path), image_size=6).load_train().inputs[0].sum() == 0


def test_missing_celeba_names_the_flag_the_files_and_where_to_get_them(tmp_path) -> None:
    dataset = CelebA(root=str(tmp_path))  # constructing reads nothing
    assert dataset.input_shape == (3, 84, 84)
    with pytest.raises(ConfigError) as error:
        dataset.load_train()
    message = str(error.value)
    assert f"--data.dataset.init_args.root={tmp_path}" in message and str(tmp_path / "celeba") in message
    assert "identity_CelebA.txt, list_attr_celeba.txt, img_align_celeba" in message
    assert "img_align_celeba.zip" in message and "download=true" in message

    fake_celeba(tmp_path)
    (tmp_path / "celeba" / "img_align_celeba" / "000004.png").unlink()
    with pytest.raises(ConfigError, match=r"000004\.png is listed in identity_CelebA\.txt but missing"):
        dataset.load_train()


def test_celeba_rejects_bad_settings_together() -> None:
    with pytest.raises(ConfigError) as error:
        CelebA(image_size=0, min_images=0, max_users=0)
    assert len(error.value.problems) == 3 and "--data.dataset.init_args.max_users" in str(error.value)


def test_celeba_download_fetches_the_three_files_by_torchvisions_ids_and_unzips_the_images(tmp_path, monkeypatch):
    drive = tmp_path / "drive"
    fake_celeba(drive)
    folder = drive / "celeba"
    with zipfile.ZipFile(drive / "img_align_celeba.zip", "w") as archive:
        for name, _, _ in ROWS:
            archive.write(folder / "img_align_celeba" / name, f"img_align_celeba/{name}")
    by_name = {
        name: drive / "img_align_celeba.zip" if name.endswith(".zip") else folder / name
        for name in ("img_align_celeba.zip", "identity_CelebA.txt", "list_attr_celeba.txt")
    }
    ids = {file_id: name for file_id, _, name in TorchvisionCelebA.file_list}
    fetched = []

    def google_drive(file_id, root, filename, md5):  # stands in for the Drive download: same arguments
        assert ids[file_id] == filename and len(md5) == 32
        fetched.append(filename)
        shutil.copy(by_name[filename], root / filename)

    monkeypatch.setattr(celeba_module, "download_file_from_google_drive", google_drive)
    monkeypatch.setattr(celeba_module, "_gdown_installed", lambda: True)
    pool = CelebA(root=str(tmp_path / "data"), image_size=6, download=True).load_train()
    assert sorted(fetched) == sorted(by_name) and len(pool) == len(KEPT)

    monkeypatch.setattr(celeba_module, "_gdown_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"gdown, which is not installed: pip install -e \"\.\[celeba\]\""):
        CelebA(root=str(tmp_path / "empty"), download=True).load_train()
