"""One palette per run: a class has the same colour in the partition summary, the t-SNE and the entropy maps."""

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from fedlight.callbacks import EntropyMaps, FeatureTSNE, PartitionSummary
from fedlight.callbacks.figures import class_colours
from fedlight.clients import SegmentationClient
from fedlight.data import FederatedDataModule, Scenes
from fedlight.data.partition import DirichletPowerLaw
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedAvg


def _saved_figures(monkeypatch, run):
    """The figures ``run()`` saves, by file name."""
    saved, savefig = {}, Figure.savefig

    def keep(figure, path, *args, **kwargs):
        saved[str(path).rsplit("/", 1)[-1]] = figure
        return savefig(figure, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    run()
    return saved


def _partition_colours(figure):
    left = figure.axes[0]  # clients per class: one bar per class the pool holds, named by its tick
    names = [tick.get_text() for tick in left.get_xticklabels()]
    return {name: to_rgba(bar.get_facecolor()) for name, bar in zip(names, left.patches, strict=True)}


def _tsne_colours(figure):
    return {points.get_label(): to_rgba(points.get_facecolor()[0]) for points in figure.axes[0].collections}


def _entropy_colours(figure):
    legend = figure.legends[0]
    names = [text.get_text() for text in legend.get_texts()]
    return {name: to_rgba(patch.get_facecolor()) for name, patch in zip(names, legend.legend_handles, strict=True)}


def test_a_class_has_one_colour_in_every_figure_of_a_run(tmp_path, monkeypatch):
    data = FederatedDataModule(
        Scenes(num_object_classes=4, num_samples=40, num_test_samples=8, image_size=32),
        DirichletPowerLaw(num_clients=2, alpha=1.0),
        batch_size=8,
    )
    torch.manual_seed(0)
    model = SegmentationClient(5, (3, 32, 32), model_kwargs={"encoder_weights": None, "decoder_channels": 8})
    callbacks = [PartitionSummary(), EntropyMaps(num_images=4), FeatureTSNE(max_points=200)]
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=1, local_epochs=1, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path, callbacks=callbacks,
    )  # fmt: skip
    saved = _saved_figures(monkeypatch, lambda: trainer.fit(model, data, FedAvg()))
    partition = _partition_colours(saved["partition_summary.png"])
    tsne = _tsne_colours(saved["tsne.png"])
    maps = _entropy_colours(saved["round_0001.png"])
    # background, then VOC's first four objects: matplotlib's tab10 in class order, whichever figure draws them
    names = ("background", "aeroplane", "bicycle", "bird", "boat")
    expected = {name: colormaps["tab10"](c) for c, name in enumerate(names)}
    assert set(partition) == {"aeroplane", "bicycle", "bird", "boat"}  # the pool holds every object, no background
    assert len(set(tsne) & set(partition)) >= 2 and "background" not in tsne  # the test images' objects
    assert {"background", "void"} <= set(maps) and len(set(maps) & set(partition)) >= 1
    for colours in (partition, tsne, {name: rgba for name, rgba in maps.items() if name != "void"}):
        assert colours == {name: expected[name] for name in colours}
    assert maps["void"] == (0.0, 0.0, 0.0, 1.0)


def test_beyond_twenty_classes_tab20_comes_first_and_the_rest_stay_apart():
    colours = class_colours(27)[:, :3]  # Cityscapes' 27 classes
    assert np.allclose(colours[:20], [colormaps["tab20"](c)[:3] for c in range(20)])
    distances = np.linalg.norm(colours[:, None] - colours[None], axis=-1)
    np.fill_diagonal(distances, np.inf)
    closest_in_tab20 = distances[:20, :20].min()
    assert distances[20:].min() >= closest_in_tab20  # no added colour is nearer any other than tab20's closest pair
    assert np.linalg.norm(colours[20:], axis=1).min() > 0.25  # none looks like black void
    assert np.linalg.norm(1 - colours[20:], axis=1).min() > 0.25  # nor like the white paper
    assert np.array_equal(class_colours(21), class_colours(27)[:21])  # Pascal VOC's 21: the same sequence
