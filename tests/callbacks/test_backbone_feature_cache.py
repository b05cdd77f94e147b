import types

import pytest
import torch

from fedlight.callbacks.backbone_feature_cache import BackboneFeatureCache
from fedlight.clients.unsupervised import UnsupervisedSegmentationClient
from fedlight.data import FederatedDataModule, cache_files
from fedlight.data.twins.street_scenes import StreetScenes
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg


def test_a_federated_round_trains_from_the_cache_and_sums_only_head_centroids_and_probe(tmp_path):
    data = FederatedDataModule(
        StreetScenes(num_classes=12, num_cities=3, images_per_city=8, num_test_samples=4, image_size=16),
        batch_size=4,
        test_fraction=0.0,
        return_index=True,
    )
    torch.manual_seed(0)
    model = UnsupervisedSegmentationClient(
        num_classes=12, input_shape=(3, 16, 16), backbone="vit_tiny_patch8", backbone_kwargs={"embed_dim": 16},
        dim=4, feature_samples=2, num_negatives=2,
    )  # fmt: skip
    backbone_before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    cache = BackboneFeatureCache(k=4)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=3, local_steps=2, default_root_dir=tmp_path, logger="csv",
        enable_progress_bar=False, callbacks=[cache],
    )  # fmt: skip
    metrics = trainer.fit(model, data, FedAvg())
    assert {"test/miou", "test/acc", "test/linear/miou", "test/linear/acc"} <= set(metrics)
    assert metrics["features/cache_mib"] * 2**20 == 24 * 16 * 2 * 2 * 2  # 24 images × [16, 2, 2] fp16
    assert model.feature_cache is cache.cache
    assert (trainer.run_dir / "features").is_dir()
    federated = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("backbone"))
    assert trainer.model.layout.numel == federated
    assert (
        trainer.run.pieces.fits.aggregation_nbytes == federated * (4 + 8) + 8
    )  # W^t in fp32, its fp64 sum, one fp64 weight total
    assert all(torch.equal(v, model.backbone.state_dict()[k]) for k, v in backbone_before.items())


def small_run(tmp_path, directory):
    data = FederatedDataModule(
        StreetScenes(num_classes=12, num_cities=2, images_per_city=4, num_test_samples=2, image_size=16),
        batch_size=4, test_fraction=0.0, return_index=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = UnsupervisedSegmentationClient(
        num_classes=12, input_shape=(3, 16, 16), backbone="vit_tiny_patch8", backbone_kwargs={"embed_dim": 16},
        dim=4, feature_samples=2, num_negatives=2,
    )  # fmt: skip
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=2, local_steps=1, default_root_dir=tmp_path / "runs", logger="csv",
        enable_progress_bar=False, callbacks=[BackboneFeatureCache(directory=str(directory), k=2)],
    )  # fmt: skip
    return trainer, model, data


def test_an_unwritable_cache_directory_stops_the_run_before_its_folder_exists(tmp_path):
    (tmp_path / "taken").write_text("")
    trainer, model, data = small_run(tmp_path, tmp_path / "taken" / "features")
    with pytest.raises(ConfigError, match=r"init_args.directory=.*taken/features: .*taken is a file, not a folder"):
        trainer.fit(model, data, FedAvg())
    assert not (tmp_path / "runs").exists()


def test_a_disk_too_small_for_the_cache_is_one_error_naming_its_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_files.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=100))
    trainer, model, data = small_run(tmp_path, tmp_path / "features")
    with pytest.raises(ConfigError, match=rf"Not enough free space for the feature cache in {tmp_path}/features/"):
        trainer.fit(model, data, FedAvg())
