import numpy as np
import torch

from fedlight.callbacks.fedcc_figures import centroid_figure, centroid_maps, plot_centroid_maps


def test_distances_are_cosine_distances_of_the_pooled_rows_in_raw_order():
    torch.manual_seed(0)
    base = torch.randn(5, 4)
    permutation = torch.tensor([3, 0, 4, 1, 2])
    clients = {2: base[permutation] + 0.01 * torch.randn(5, 4), 0: base.clone()}
    server = base.mean(dim=0, keepdim=True).expand(5, 4) + torch.randn(5, 4)
    maps = centroid_maps(clients, server)
    rows = torch.cat([clients[0], clients[2], server]).double()
    unit = torch.nn.functional.normalize(rows, dim=1)
    np.testing.assert_allclose(maps["distances"], (1 - unit @ unit.T).numpy(), atol=1e-12)
    assert maps["owners"].tolist() == [0] * 5 + [2] * 5 + [-1] * 5
    # client 2's row j is client 0's row permutation[j]: the off-diagonal block shows the misalignment
    block = maps["distances"][5:10, :5]
    assert block.argmin(axis=1).tolist() == permutation.tolist()
    assert maps["embedding"].shape == (15, 2) and np.isfinite(maps["embedding"]).all()


def test_the_picture_is_written(tmp_path):
    maps = centroid_maps({0: torch.randn(4, 3), 1: torch.randn(4, 3)}, torch.randn(4, 3))
    path = plot_centroid_maps(maps, tmp_path / "centroids.png", "test")
    assert path.is_file() and path.stat().st_size > 1000


def test_every_client_has_a_colour_of_its_own():
    # FUSS's Cityscapes runs have 18 clients: colours must not repeat after ten
    torch.manual_seed(0)
    maps = centroid_maps({k: torch.randn(2, 3) for k in range(12)}, torch.randn(2, 3))
    clients = centroid_figure(maps).axes[0].collections[:-1]  # the server's crosses come last
    assert [c.get_label() for c in clients] == [f"client {k}" for k in range(12)]
    colours = np.array([c.get_facecolor()[0] for c in clients])
    assert len(np.unique(colours.round(4), axis=0)) == 12
