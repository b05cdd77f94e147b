"""FeatureTSNE on the digits: which test samples become points of the saved map."""

import numpy as np
import pytest
import torch

from fedlight.callbacks import FeatureTSNE
from fedlight.clients import ClassificationClient
from fedlight.data import Digits, FederatedDataModule
from fedlight.data.partition import Dirichlet
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg


def digits_tsne(tmp_path, tsne):
    data = FederatedDataModule(Digits(), Dirichlet(num_clients=4, alpha=1.0), batch_size=10, eval_batch_size=100)
    torch.manual_seed(0)
    model = ClassificationClient(num_classes=10, input_shape=(1, 8, 8), model="cnn")
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=1, local_steps=2, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path, callbacks=[tsne],
    )  # fmt: skip
    trainer.fit(model, data, FedAvg())
    held_out = data.pool.targets[data.held_out_index].numpy()  # the digits have no test set of their own
    return np.load(trainer.run_dir / "tsne.npz"), held_out


def test_the_digits_map_shows_every_held_out_sample(tmp_path):
    saved, held_out = digits_tsne(tmp_path, FeatureTSNE())
    assert len(held_out) > 300  # a fifth of the 1,797 digits, read over several evaluation batches
    assert saved["embedding"].shape == (len(held_out), 2)
    assert np.bincount(saved["labels"], minlength=10).tolist() == np.bincount(held_out, minlength=10).tolist()


def test_beyond_max_points_a_seeded_draw_of_the_whole_set_is_kept(tmp_path):
    saved, held_out = digits_tsne(tmp_path / "a", FeatureTSNE(max_points=120))
    again, _ = digits_tsne(tmp_path / "b", FeatureTSNE(max_points=120))
    assert saved["embedding"].shape == (120, 2) and np.array_equal(saved["labels"], again["labels"])
    # drawn from all held-out samples, not the first 120: client after client, those hold only some digits
    assert len(np.unique(saved["labels"])) == 10 and not np.array_equal(saved["labels"], held_out[:120])


def test_max_images_bounds_the_samples_read(tmp_path):
    saved, held_out = digits_tsne(tmp_path, FeatureTSNE(max_images=150))
    assert saved["labels"].tolist() == held_out[:150].tolist()  # under max_points every read sample is a point


def test_bad_limits_are_refused_together():
    with pytest.raises(ConfigError) as err:
        FeatureTSNE(max_images=0, max_points=2)
    assert err.value.problems == [
        "Expected FeatureTSNE max_images ≥ 1 or null (the whole test set), got 0.",
        "Expected FeatureTSNE max_points ≥ 3, got 2.",
    ]
