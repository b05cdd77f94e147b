import json
import logging

import numpy as np
import pytest
import torch
from miniatures.segmentation import write_voc
from PIL import Image

from fedlight.data import FederatedDataModule, PascalVOC
from fedlight.data.datasets.voc import IMAGENET_MEAN, IMAGENET_STD
from fedlight.data.labels import VOC_CLASSES, voc_colormap
from fedlight.data.partition import DirichletPowerLaw
from fedlight.errors import ConfigError

PERSON, CAT, BUS, SOFA = (VOC_CLASSES.index(n) for n in ("person", "cat", "bus", "sofa"))
# image id → the object classes its mask holds; only single-class images are kept
MASKS = {
    "a": [PERSON],
    "b": [CAT],
    "c": [PERSON, CAT],  # two objects: filtered out
    "d": [],  # background only: filtered out
    "e": [BUS],
    "f": [SOFA],
    "g": [CAT],
    "h": [BUS, SOFA],  # filtered out
}


def _mask(classes, height=30, width=40):
    mask = np.zeros((height, width), dtype=np.uint8)
    for k, c in enumerate(classes):
        mask[5 + 10 * k : 12 + 10 * k, 5:20] = c
        mask[4 + 10 * k, 5:20] = 255  # a void border line
    return mask


def _write_voc(root, augmented=True):
    voc = root / "VOC2012"
    (voc / "JPEGImages").mkdir(parents=True)
    (voc / "SegmentationClass").mkdir()
    (voc / "ImageSets" / "Segmentation").mkdir(parents=True)
    if augmented:
        (voc / "SegmentationClassAug").mkdir()
    rng = np.random.default_rng(0)
    palette = voc_colormap().reshape(-1).tolist()
    for image_id, classes in MASKS.items():
        Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(voc / "JPEGImages" / f"{image_id}.jpg")
        paletted = Image.fromarray(_mask(classes), mode="P")
        paletted.putpalette(palette)
        paletted.save(voc / "SegmentationClass" / f"{image_id}.png")
        if augmented:
            Image.fromarray(_mask(classes)).save(voc / "SegmentationClassAug" / f"{image_id}.png")  # grey PNGs
    (voc / "ImageSets" / "Segmentation" / "train_aug.txt").write_text("\n".join(MASKS) + "\n")
    (voc / "ImageSets" / "Segmentation" / "train.txt").write_text("a\nb\nc\ne\n")
    (voc / "ImageSets" / "Segmentation" / "val.txt").write_text("c\nh\n")
    return voc


def test_single_class_filter_and_partition_labels(tmp_path):
    _write_voc(tmp_path)
    pool = PascalVOC(root=str(tmp_path), canvas_size=48).load_train()
    assert len(pool) == 5
    assert pool.labels.tolist() == [PERSON, CAT, BUS, SOFA, CAT]  # a, b, e, f, g
    masks = pool.targets[torch.arange(5)]
    assert masks.shape == (5, 48, 48) and masks.dtype == torch.int64
    for mask, label in zip(masks, pool.labels, strict=True):
        assert torch.equal(mask[:30, :40], torch.from_numpy(_mask([label]).astype(np.int64)))
        assert (mask[30:] == 255).all() and (mask[:, 40:] == 255).all()  # canvas padding is void
    train = PascalVOC(root=str(tmp_path), split="train", canvas_size=48).load_train()
    assert train.labels.tolist() == [PERSON, CAT, BUS]  # a, b, e of the official masks (palette PNGs)


def test_images_are_standardised_on_a_zero_canvas(tmp_path):
    voc = _write_voc(tmp_path)
    pool = PascalVOC(root=str(tmp_path), canvas_size=48).load_train()
    images = pool.inputs[torch.tensor([0, 2])]
    assert images.shape == (2, 3, 48, 48)
    original = np.array(Image.open(voc / "JPEGImages" / "e.jpg").convert("RGB")) / 255.0  # [30, 40, 3]
    expected = (original - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    np.testing.assert_allclose(images[1, :, :30, :40].permute(1, 2, 0).numpy(), expected, atol=1e-5)
    assert (images[:, :, 30:] == 0).all() and (images[:, :, :, 40:] == 0).all()


def test_macro_map_keeps_the_partition(tmp_path):
    _write_voc(tmp_path)
    fine = PascalVOC(root=str(tmp_path), canvas_size=48)
    macro = PascalVOC(root=str(tmp_path), canvas_size=48, label_set="macro")
    assert macro.num_classes == 5 and fine.num_classes == 21
    fine_pool, macro_pool = fine.load_train(), macro.load_train()
    assert np.array_equal(fine_pool.labels, macro_pool.labels)
    masks = macro_pool.targets[torch.arange(5)]
    # person → 1, cat → 4 (animal), bus → 2 (vehicle), sofa → 3 (household); background and void stay
    for mask, expected in zip(masks, [1, 4, 2, 3, 4], strict=True):
        assert set(mask.unique().tolist()) == {0, expected, 255}
    partitions = []
    for dataset in (fine, macro):
        partitioner = DirichletPowerLaw(num_clients=2, alpha=1.0)
        data = FederatedDataModule(dataset, partitioner, batch_size=2, test_fraction=0.0)
        data.setup()
        partitions.append([ix.tolist() for ix in data.client_train])
    assert partitions[0] == partitions[1]


def test_mask_classes_are_cached(tmp_path):
    voc = _write_voc(tmp_path)
    PascalVOC(root=str(tmp_path)).load_train()
    cache = tmp_path / "fedlight_voc_classes_train_aug.json"
    cached = json.loads(cache.read_text())
    assert cached["ids"] == list(MASKS)
    assert cached["classes"][2] == [CAT, PERSON]  # equal pixel counts: by class index
    for png in (voc / "SegmentationClassAug").iterdir():  # listing no longer decodes the masks: blank them
        Image.fromarray(_mask([])).save(png)
    assert len(PascalVOC(root=str(tmp_path)).load_train()) == 5


def test_a_damaged_class_cache_is_read_again_from_the_masks(tmp_path, caplog):
    _write_voc(tmp_path)
    PascalVOC(root=str(tmp_path)).load_train()
    cache = tmp_path / "fedlight_voc_classes_train_aug.json"
    cache.write_text(cache.read_text()[:20])  # truncated
    with caplog.at_level(logging.WARNING):
        pool = PascalVOC(root=str(tmp_path)).load_train()
    assert pool.labels.tolist() == [PERSON, CAT, BUS, SOFA, CAT] and str(cache) in caplog.text
    assert json.loads(cache.read_text())["ids"] == list(MASKS)  # written again whole


def test_validation_images_form_the_test_set(tmp_path):
    _write_voc(tmp_path)
    assert PascalVOC(root=str(tmp_path)).load_test() is None
    test = PascalVOC(root=str(tmp_path), test_split="val", canvas_size=48).load_test()
    assert len(test) == 2 and test.targets[torch.tensor([1])].shape == (1, 48, 48)


def test_missing_dataset_says_what_to_download(tmp_path):
    with pytest.raises(ConfigError) as info:
        PascalVOC(root=str(tmp_path / "nowhere")).load_train()
    message = str(info.value)
    assert "--data.dataset.init_args.root" in message and "VOCtrainval_11-May-2012.tar" in message
    assert "SegmentationClassAug" in message
    _write_voc(tmp_path, augmented=False)
    with pytest.raises(ConfigError, match="split=train"):
        PascalVOC(root=str(tmp_path)).load_train()


def test_a_federated_round_reads_the_lazy_pool(tmp_path):
    from fedlight.clients import SegmentationClient
    from fedlight.data.transforms import RandomScaleCropFlip
    from fedlight.engine.trainer import FederatedTrainer
    from fedlight.strategies import FedProto

    write_voc(tmp_path / "VOCdevkit")  # VOC 2012 and SBD as unpacked: train_aug is built from them
    data = FederatedDataModule(
        PascalVOC(root=str(tmp_path / "VOCdevkit"), canvas_size=32, label_set="macro", test_split="val"),
        DirichletPowerLaw(num_clients=2, alpha=1.0),
        batch_size=2,
        drop_last=True,
        train_transform=RandomScaleCropFlip(crop_size=32),
    )
    torch.manual_seed(0)
    model = SegmentationClient(5, (3, 32, 32), model_kwargs={"encoder_weights": None, "decoder_channels": 8})
    settings = {"logger": "csv", "enable_progress_bar": False, "default_root_dir": tmp_path / "runs"}
    metrics = FederatedTrainer(rounds=1, clients_per_round=2, local_epochs=1, **settings).fit(model, data, FedProto())
    assert 0.0 <= metrics["test/miou"] <= 1.0 and 0.0 <= metrics["clients/miou"] <= 1.0
