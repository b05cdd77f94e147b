import numpy as np
import pytest
import torch
from fuss_run import one_round
from miniatures.segmentation import write_cityscapes
from PIL import Image

from fedlight.data.datasets.cityscapes import CityscapesFUSS
from fedlight.data.readers.stego_files import IMAGENET_MEAN, IMAGENET_STD
from fedlight.errors import ConfigError


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data") / "cityscapes"
    write_cityscapes(root)  # one 64×128 frame in each training and validation city
    return root


@pytest.mark.parametrize(("num_clients", "cities_per_client"), [(3, 6), (6, 3), (18, 1)])
def test_clients_are_consecutive_runs_of_cities_with_five_crops_each(root, num_clients, cities_per_client):
    pool = CityscapesFUSS(str(root), num_clients=num_clients, image_size=16).load_train()
    assert len(pool) == 18 * 5
    assert pool.groups.tolist() == [c for c in range(num_clients) for _ in range(cities_per_client * 5)]


def test_a_crop_is_the_centre_of_its_five_crop_box_with_labels_7_to_33_renumbered(root):
    pool = CityscapesFUSS(str(root), image_size=32).load_train()
    stem = root / "leftImg8bit" / "train" / "bochum" / "bochum_000000_000019_leftImg8bit.png"
    image = np.array(Image.open(stem))
    ids = np.array(Image.open(root / "gtFine/train/bochum/bochum_000000_000019_gtFine_labelIds.png")).astype(np.int64)
    assert image.shape == (64, 128, 3) and ids.shape == (64, 128)
    index = 5 * 1 + 1  # bochum's image, top-right crop: rows 0–32, columns 64–128, whose centre is columns 80–112
    expected_labels = np.where((ids >= 7) & (ids <= 33), ids - 7, 255)[0:32, 80:112]
    assert pool.targets[torch.tensor([index])][0].tolist() == expected_labels.tolist()
    mean, std = np.array(IMAGENET_MEAN), np.array(IMAGENET_STD)
    expected_image = ((image[0:32, 80:112] / 255.0 - mean) / std).transpose(2, 0, 1)
    torch.testing.assert_close(pool.inputs[torch.tensor([index])][0], torch.from_numpy(expected_image).float())


def test_a_federated_round_on_three_city_clients(tmp_path, root):
    data, metrics = one_round(tmp_path, CityscapesFUSS(str(root), num_clients=3, image_size=16, test_size=24), 3)
    assert data.num_samples.tolist() == [30, 30, 30]
    assert len(data.test) == 3 and data.test.inputs.shape == (3, 3, 24, 24)  # frankfurt, lindau, munster
    assert 0.0 <= metrics["test/miou"] <= 1.0 and "test/linear/miou" in metrics
    assert {"test/iou_road", "test/iou_traffic_light", "test/iou_bicycle"} <= set(metrics)  # Cityscapes' names
    assert "test/iou_0" not in metrics


def test_a_missing_root_says_what_to_download_and_where(tmp_path):
    with pytest.raises(ConfigError, match=r"leftImg8bit_trainvaltest\.zip and gtFine_trainvaltest\.zip") as err:
        CityscapesFUSS(str(tmp_path / "nowhere")).load_train()
    assert "nowhere/leftImg8bit/train/aachen" in str(err.value)
