import math

import numpy as np
import pytest
import torch
from matplotlib import colormaps
from PIL import Image

from fedlight.callbacks import EntropyMaps, FeatureTSNE
from fedlight.callbacks.entropy_maps import entropy_figure
from fedlight.callbacks.tsne import tsne_figure
from fedlight.clients import SegmentationClient
from fedlight.data import FederatedDataModule, Scenes
from fedlight.data.labels import MACRO_CLASSES, VOC_CLASSES
from fedlight.data.partition import DirichletPowerLaw
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedAvg


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
    figures = sorted((trainer.run_dir / "entropy_maps").glob("round_*.png"))
    assert [p.name for p in figures] == ["round_0001.png", "round_0002.png"]
    width, height = Image.open(figures[-1]).size
    assert width >= 1000 and height >= 3 * 150  # at 100 dpi: 2.2 inches per 32-pixel map, not 32 pixels
    for row in trainer.history:
        assert 0 <= row["analysis/entropy_softmax"] <= math.log(5)
        assert 0 <= row["analysis/entropy_features"] <= math.log(8)
    saved = np.load(trainer.run_dir / "tsne.npz")
    assert saved["embedding"].shape == (len(saved["labels"]), 2) and len(saved["labels"]) == 30
    assert set(np.unique(saved["labels"])) <= {1, 2, 3, 4}  # no background, no void
    assert (trainer.run_dir / "tsne.png").stat().st_size > 5_000


def test_figure_titles_its_columns_and_scales_the_entropies():
    x = torch.zeros(2, 3, 4, 4)
    x[0, 0] = 1.0  # a red first image once min–max scaled
    y = torch.tensor([[[0, 4, 255, 1]] * 4, [[2] * 4] * 4])
    preds = torch.ones(2, 4, 4, dtype=torch.long)
    low, high = torch.zeros(2, 4, 4), torch.full((2, 4, 4), 9.0)
    bounds = torch.tensor([math.log(5), math.log(8)])
    figure = entropy_figure(x, y, preds, low, high, bounds, MACRO_CLASSES, title="run, round 3")
    axes = figure.axes
    assert len(axes) == 2 * 5 + 2  # five maps per image, then one colour bar for each entropy column
    assert [a.get_title() for a in axes[:5]] == [
        "input",
        "ground truth",
        "prediction",
        "softmax entropy $H_S$",
        "feature entropy $H_E$",
    ]
    assert all(a.get_title() == "" for a in axes[5:10])  # titles on the top row only
    assert figure.get_suptitle() == "run, round 3"
    cell = [a.images[0].get_array() for a in axes[:10]]
    assert np.allclose(cell[0][..., 0], 1) and np.allclose(cell[0][..., 1:], 0)  # input: red
    tab10 = np.array([colormaps["tab10"](c) for c in range(5)])  # the 5 macro classes' colours
    assert np.array_equal(cell[1][0], [tab10[0], tab10[4], (0, 0, 0, 1), tab10[1]])  # ground truth, void black
    assert np.array_equal(cell[2], np.broadcast_to(tab10[1], (4, 4, 4)))
    h_s, h_e = axes[3].images[0], axes[4].images[0]
    assert h_s.get_cmap().name == h_e.get_cmap().name == "viridis"
    assert h_s.get_clim() == pytest.approx((0, math.log(5))) and h_e.get_clim() == pytest.approx((0, math.log(8)))
    colour_bars = axes[10:]
    assert [bar.get_ylim() for bar in colour_bars] == [pytest.approx((0, math.log(5))), pytest.approx((0, math.log(8)))]
    assert "log C" in colour_bars[0].get_ylabel() and "log D" in colour_bars[1].get_ylabel()
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert legend == ["background", "person", "vehicle", "animal", "void"]  # 0, 1, 2, 4 and 255 appear
    assert figure.get_size_inches()[0] * 100 >= 1000  # readable at 100 dpi


def test_tsne_colours_are_distinct_and_named():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 6)  # the digits' 64-point case: a few points per class
    figure = tsne_figure(rng.normal(size=(60, 2)), labels, [str(c) for c in range(10)], title="digits")
    (axis,) = figure.axes
    colours = np.array([collection.get_facecolor()[0][:3] for collection in axis.collections])
    assert np.allclose(colours, [colormaps["tab10"](c)[:3] for c in range(10)])  # matplotlib's qualitative map
    distances = np.linalg.norm(colours[:, None] - colours[None], axis=-1)
    assert distances[~np.eye(10, dtype=bool)].min() > 0.15  # no two classes share a look-alike colour
    assert [t.get_text() for t in axis.get_legend().get_texts()] == [str(c) for c in range(10)]
    assert all(collection.get_sizes()[0] >= 20 for collection in axis.collections)  # few points: large markers
    twenty = tsne_figure(rng.normal(size=(40, 2)), np.repeat(np.arange(1, 21), 2), VOC_CLASSES)
    fine = np.array([c.get_facecolor()[0][:3] for c in twenty.axes[0].collections])
    assert len(np.unique(fine.round(4), axis=0)) == 20
