"""The segmentation readers on miniatures of their datasets' real layouts: intact, and with one file broken."""

import filecmp
from pathlib import Path

import numpy as np
import pytest
import torch
from miniatures import registry
from miniatures import segmentation as mini
from PIL import Image
from scipy.io import loadmat

from fedlight.data import CityscapesFUSS, CocoStuff27, PascalVOC
from fedlight.data.labels import COCOSTUFF_27_CLASSES
from fedlight.errors import ConfigError

MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])  # ImageNet's


def standardised(path: Path) -> np.ndarray:
    """An image file as ImageNet-standardised ``[3, h, w]`` floats, computed here from its pixels."""
    return ((np.array(Image.open(path).convert("RGB")) / 255.0 - MEAN) / STD).transpose(2, 0, 1)


def listed(path: Path) -> set[str]:
    """The ids of a split list."""
    return set(path.read_text().split())


def read_everything(dataset) -> None:
    """Sets the dataset up and decodes every sample of its pools, as a run eventually does."""
    for pool in (dataset.load_train(), dataset.load_test()):
        if pool is not None:
            index = torch.arange(len(pool))
            pool.inputs[index], pool.targets[index]


def test_every_segmentation_miniature_is_registered_and_writes_the_same_files_twice(tmp_path):
    found = registry()
    for name, write in (
        ("PascalVOC", mini.write_voc),
        ("CityscapesFUSS", mini.write_cityscapes),
        ("CocoStuff27", mini.write_cocostuff),
    ):
        assert found[name].write is write
        assert write(tmp_path / name / "a") == [] and write(tmp_path / name / "b") == []
        write(tmp_path / name / "b")  # again into the same root
        files = sorted(p.relative_to(tmp_path / name / "a") for p in (tmp_path / name / "a").rglob("*") if p.is_file())
        assert files == sorted(
            p.relative_to(tmp_path / name / "b") for p in (tmp_path / name / "b").rglob("*") if p.is_file()
        )
        assert all(filecmp.cmp(tmp_path / name / "a" / f, tmp_path / name / "b" / f, shallow=False) for f in files)


# -- Pascal VOC 2012 + SBD ------------------------------------------------------------------------------------


@pytest.fixture
def voc_root(tmp_path):
    root = tmp_path / "data" / "VOCdevkit"
    mini.write_voc(root)
    return root


def test_voc_train_aug_is_built_from_sbd_and_keeps_the_single_class_images(voc_root):
    sbd = voc_root / "SBD" / "benchmark_RELEASE" / "dataset"
    dataset = PascalVOC(root=str(voc_root), canvas_size=32, num_workers=1, test_split="val")
    pool = dataset.load_train()
    # train_aug by its definition: SBD's train and val lists, plus VOC's train, minus VOC's val
    lists = voc_root / "VOC2012" / "ImageSets" / "Segmentation"
    sbd_ids = listed(sbd / "train.txt") | listed(sbd / "val.txt")
    expected_ids = sorted((sbd_ids | listed(lists / "train.txt")) - listed(lists / "val.txt"))
    written = (lists / "train_aug.txt").read_text().split()
    assert written == expected_ids and len(written) == 24
    classes = mini.voc_all_ids()
    single = [i for i in expected_ids if len(classes[i]) == 1]
    assert pool.labels.tolist() == [classes[i][0] for i in single]
    assert len(pool) == 21 and pool.inputs.shape == (21, 3, 32, 32) and pool.targets.shape == (21, 32, 32)

    # an image that VOC and SBD both annotate takes SBD's mask (no void border), read here from the .mat
    both = sorted(mini.VOC_TRAIN_AND_SBD)[0]
    sbd_mask = loadmat(sbd / "cls" / f"{both}.mat")["GTcls"]["Segmentation"][0, 0]
    aug = np.array(Image.open(voc_root / "VOC2012" / "SegmentationClassAug" / f"{both}.png"))
    assert np.array_equal(aug, sbd_mask) and 255 not in aug
    assert 255 in np.array(Image.open(voc_root / "VOC2012" / "SegmentationClass" / f"{both}.png"))

    # a VOC-only image keeps VOC's palette mask, void border included, top-left on a void canvas
    only = next(i for i in single if i in mini.VOC_TRAIN_ONLY)
    k = single.index(only)
    palette_png = Image.open(voc_root / "VOC2012" / "SegmentationClass" / f"{only}.png")
    assert palette_png.mode == "P"
    indices = np.array(palette_png).astype(np.int64)
    target, image = pool.targets[torch.tensor([k])][0], pool.inputs[torch.tensor([k])][0]
    assert target.dtype == torch.int64 and image.dtype == torch.float32
    h, w = indices.shape
    assert target[:h, :w].tolist() == indices.tolist() and set(np.unique(indices)) == {0, 255, classes[only][0]}
    assert (target[h:] == 255).all() and (target[:, w:] == 255).all()
    jpeg = standardised(voc_root / "VOC2012" / "JPEGImages" / f"{only}.jpg")
    np.testing.assert_allclose(image[:, :h, :w].numpy(), jpeg, atol=1e-5)
    assert (image[:, h:] == 0).all() and (image[:, :, w:] == 0).all()

    test = dataset.load_test()
    assert len(test) == len(mini.VOC_VAL) and test.targets[torch.arange(len(test))].shape == (6, 32, 32)


def test_voc_with_download_uses_the_unpacked_sbd_without_fetching_it(voc_root, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("nothing may be downloaded: VOC and SBD are unpacked")

    monkeypatch.setattr("torchvision.datasets.utils.download_and_extract_archive", no_network)
    pool = PascalVOC(root=str(voc_root), canvas_size=32, num_workers=1, download=True).load_train()
    assert len(pool) == 21


def test_voc_train_split_reads_vocs_own_list(voc_root):
    pool = PascalVOC(root=str(voc_root), split="train", canvas_size=32, num_workers=1).load_train()
    train = sorted(mini.VOC_TRAIN_ONLY | mini.VOC_TRAIN_AND_SBD)
    classes = mini.voc_all_ids()
    assert pool.labels.tolist() == [classes[i][0] for i in train if len(classes[i]) == 1]


SBD = Path("SBD/benchmark_RELEASE/dataset")
VOC_FILES = {
    "image": Path("VOC2012/JPEGImages/2008_000002.jpg"),  # an SBD image of train_aug
    "voc mask": Path("VOC2012/SegmentationClass/2007_000032.png"),  # train_aug takes VOC's own mask
    "val mask": Path("VOC2012/SegmentationClass/2007_000042.png"),  # read for the test set only
    "sbd mask": SBD / "cls" / "2008_000006.mat",
    "sbd list": SBD / "train.txt",
    "voc list": Path("VOC2012/ImageSets/Segmentation/val.txt"),
}


# -- Cityscapes -------------------------------------------------------------------------------------------------


@pytest.fixture
def cityscapes_root(tmp_path):
    root = tmp_path / "data" / "cityscapes"
    mini.write_cityscapes(root)
    return root


def by_label_id(ids: np.ndarray) -> np.ndarray:
    """Cityscapes' labelIds as STEGO's 27 classes: 7…33 are classes 0…26, the rest void."""
    return np.where((ids >= 7) & (ids <= 33), ids.astype(np.int64) - 7, 255)


def test_cityscapes_clients_are_cities_and_a_crop_holds_its_label_ids(cityscapes_root):
    pool = CityscapesFUSS(str(cityscapes_root), num_clients=6, image_size=32, num_workers=1).load_train()
    assert len(pool) == 18 * 5 and pool.groups.tolist() == [c for c in range(6) for _ in range(15)]
    image_path, label_path = mini.cityscapes_frames(cityscapes_root, "train")[17]  # zurich, the last city
    ids = np.array(Image.open(label_path))
    assert ids.shape == (64, 128) and ids.max() <= 33
    # the centre crop (k = 4) of zurich's frame is rows 16–48, columns 32–96; its central 32×32 square is
    # rows 16–48, columns 48–80
    index = torch.tensor([5 * 17 + 4])
    target, image = pool.targets[index][0], pool.inputs[index][0]
    assert target.dtype == torch.int64 and target.shape == (32, 32)
    assert target.tolist() == by_label_id(ids[16:48, 48:80]).tolist()
    torch.testing.assert_close(image, torch.from_numpy(standardised(image_path)[:, 16:48, 48:80]).float())
    test = CityscapesFUSS(str(cityscapes_root), test_size=32, num_workers=1).load_test()
    assert len(test) == 3 and test.inputs[torch.arange(3)].shape == (3, 3, 32, 32)
    assert set(test.targets[torch.arange(3)].unique().tolist()) <= set(range(27)) | {255}


CITYSCAPES_FILES = {
    "image": Path("leftImg8bit/train/bremen/bremen_000000_000019_leftImg8bit.png"),
    "labels": Path("gtFine/train/bremen/bremen_000000_000019_gtFine_labelIds.png"),
    "val image": Path("leftImg8bit/val/lindau/lindau_000000_000019_leftImg8bit.png"),
}


# -- CocoStuff ------------------------------------------------------------------------------------------------


@pytest.fixture
def coco_root(tmp_path):
    root = tmp_path / "data" / "cocostuff"
    mini.write_cocostuff(root)
    return root


#: the coarse class of each fine label the miniature uses, by name (STEGO's 27-class map)
COARSE_OF = {
    "person": "person", "car": "vehicle", "dog": "animal", "bottle": "kitchen", "grass": "plant", "road": "ground",
    "sea": "water", "sky-other": "sky", "tree": "plant", "wall-concrete": "wall",
}  # fmt: skip


def coarse_table() -> np.ndarray:
    table = np.full(256, 255, dtype=np.int64)
    for name, fine in mini.COCO_FINE.items():
        table[fine] = COCOSTUFF_27_CLASSES.index(COARSE_OF[name])
    return table


def test_cocostuff_dominant_labels_and_coarse_targets(coco_root):
    pool = CocoStuff27(str(coco_root), image_size=32, test_size=32, num_workers=1).load_train()
    listed = (coco_root / "curated" / "train2017" / "Coco164kFull_Stuff_Coarse.txt").read_text().split()
    assert len(pool) == len(listed) == 24  # the unlisted images on disk are not read
    table = coarse_table()
    masks = [np.array(Image.open(coco_root / "annotations" / "train2017" / f"{i}.png")) for i in listed]
    dominant = [int(np.bincount(table[m][table[m] != 255], minlength=27).argmax()) for m in masks]
    assert pool.labels.tolist() == dominant
    by_design = [COCOSTUFF_27_CLASSES.index(COARSE_OF[mini.COCO_DOMINANT[n % 6]]) for n in range(24)]
    assert dominant == by_design and len(set(dominant)) == 6
    # image 0 is 32×40: the shorter side is already 32, the central square is columns 4–36
    assert masks[0].shape == (32, 40)
    target, image = pool.targets[torch.tensor([0])][0], pool.inputs[torch.tensor([0])][0]
    assert target.dtype == torch.int64 and target.tolist() == table[masks[0][:, 4:36]].tolist()
    jpeg = standardised(coco_root / "images" / "train2017" / f"{listed[0]}.jpg")[:, :, 4:36]
    torch.testing.assert_close(image, torch.from_numpy(jpeg).float())
    test = CocoStuff27(str(coco_root), test_size=32, num_workers=1).load_test()
    assert len(test) == 3 and test.targets[torch.arange(3)].shape == (3, 32, 32)


COCO_FILES = {
    "image": Path("images/train2017/000000000025.jpg"),
    "labels": Path("annotations/train2017/000000000041.png"),  # read at set-up, for the dominant labels
    "val labels": Path("annotations/val2017/000000000285.png"),
    "curated list": Path("curated/train2017/Coco164kFull_Stuff_Coarse.txt"),
}


# -- one broken file ------------------------------------------------------------------------------------------

READERS = {
    "PascalVOC": (
        "data/VOCdevkit",
        mini.write_voc,
        lambda root: PascalVOC(str(root), canvas_size=32, num_workers=1, test_split="val"),
    ),
    "CityscapesFUSS": (
        "data/cityscapes",
        mini.write_cityscapes,
        lambda root: CityscapesFUSS(str(root), image_size=32, test_size=32, num_workers=1),
    ),
    "CocoStuff27": (
        "data/cocostuff",
        mini.write_cocostuff,
        lambda root: CocoStuff27(str(root), image_size=32, test_size=32, num_workers=1),
    ),
}
FILES = {"PascalVOC": VOC_FILES, "CityscapesFUSS": CITYSCAPES_FILES, "CocoStuff27": COCO_FILES}


def break_file(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "renamed":
        path.rename(path.with_name(f"{path.stem} (copy){path.suffix}"))
    elif how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":  # 0xff never starts a UTF-8 character nor an image or MAT signature
        path.write_bytes(b"\xff" + np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8).tobytes())


CASES = [
    pytest.param(dataset, name, how, id=f"{dataset}-{name}-{how}")
    for dataset, files in FILES.items()
    for name, path in files.items()
    # a list cut short is still a list; images and masks cut short no longer decode
    for how in ("renamed", "missing", "garbage") + (() if path.suffix == ".txt" else ("truncated",))
]


@pytest.mark.parametrize(("dataset", "name", "how"), CASES)
def test_a_broken_file_is_one_config_error_naming_it(tmp_path, dataset, name, how):
    folder, write, reader = READERS[dataset]
    root = tmp_path / folder
    write(root)
    path = root / FILES[dataset][name]
    assert path.is_file()
    break_file(path, how)
    with pytest.raises(ConfigError) as info:
        read_everything(reader(root))
    message = str(info.value)
    assert type(info.value) is ConfigError
    assert str(path) in message, message
    assert any(fix in message for fix in ("Restore", "Replace", "restore", "unpack", "Unpack", "Download")), message
    assert "Traceback" not in message
