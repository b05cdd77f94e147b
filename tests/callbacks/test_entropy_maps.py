import math

import numpy as np
import torch
from PIL import Image

from fedlight.callbacks import EntropyMaps, FeatureTSNE
from fedlight.callbacks.entropy_maps import render_grid
from fedlight.clients import SegmentationClient
from fedlight.data import FederatedDataModule, Scenes
from fedlight.data.labels import voc_colormap
from fedlight.data.partition import DirichletPowerLaw
from fedlight.strategies import FedAvg
from fedlight.trainer import FederatedTrainer


def test_grids_scalars_and_tsne_of_a_short_run(tmp_path):
    data = FederatedDataModule(
        Scenes(num_samples=40, num_test_samples=6, image_size=32, label_set="macro"),
        DirichletPowerLaw(num_clients=2, alpha=1.0),
        batch_size=8,
        eval_batch_size=4,  # the first 3 images span two test batches
    )
    torch.manual_seed(0)
    model = SegmentationClient(5, (3, 32, 32), model_kwargs={"encoder_weights": None, "decoder_channels": 8})
    maps, tsne = EntropyMaps(every_n_rounds=1, num_images=3), FeatureTSNE(max_images=6, max_points=30)
    settings = {"logger": "csv", "enable_progress_bar": False, "default_root_dir": tmp_path}
    trainer = FederatedTrainer(rounds=2, clients_per_round=1, local_epochs=1, callbacks=[maps, tsne], **settings)
    trainer.fit(model, data, FedAvg())
    grids = sorted((trainer.run_dir / "entropy_maps").glob("round_*.png"))
    assert [p.name for p in grids] == ["round_0001.png", "round_0002.png"]
    grid = np.array(Image.open(grids[-1]))
    assert grid.shape == (3 * 32, 5 * 32, 3)
    # column 2 is the ground truth in VOC colours: test images 0, 2 and 5 of 6 (linspace, rounded), pixel by pixel
    for row, index in enumerate([0, 2, 5]):
        truth = voc_colormap()[data.test.targets[index].numpy()]
        assert np.array_equal(grid[32 * row : 32 * (row + 1), 32:64], truth)
    for row in trainer.history:
        assert 0 <= row["analysis/entropy_softmax"] <= math.log(5)
        assert 0 <= row["analysis/entropy_features"] <= math.log(8)
    saved = np.load(trainer.run_dir / "tsne.npz")
    assert saved["embedding"].shape == (len(saved["labels"]), 2) and len(saved["labels"]) == 30
    assert set(np.unique(saved["labels"])) <= {1, 2, 3, 4}  # no background, no void
    assert (trainer.run_dir / "tsne.png").stat().st_size > 5_000


def test_grid_columns():
    x = torch.zeros(2, 3, 4, 4)
    x[0, 0] = 1.0  # a red first image once min–max scaled
    y = torch.tensor([[[0, 15, 255, 1]] * 4, [[2] * 4] * 4])
    preds = torch.ones(2, 4, 4, dtype=torch.long)
    low, high = torch.zeros(2, 4, 4), torch.full((2, 4, 4), 9.0)
    grid = render_grid(x, y, preds, low, high, torch.tensor([1.0, 2.0]))
    assert grid.shape == (8, 20, 3) and grid.dtype == np.uint8
    assert (grid[:4, :4] == [255, 0, 0]).all()  # input
    assert grid[:4, 4:8].reshape(-1, 3)[:4].tolist() == [[0, 0, 0], [192, 128, 128], [224, 224, 192], [128, 0, 0]]
    assert (grid[:, 8:12] == [128, 0, 0]).all()  # prediction: class 1 everywhere
    assert (grid[:, 12:16] == grid[0, 12]).all() and (grid[:, 16:20] == grid[0, 16]).all()  # flat maps
    assert not np.array_equal(grid[0, 12], grid[0, 16])  # 0 and the clipped maximum differ in colour
