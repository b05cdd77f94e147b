import numpy as np
import torch

from fedlight.data.features.feature_cache import FeatureCache
from fedlight.models.patch_features import build_patch_backbone


def setup(tmp_path, max_bytes=float("inf"), k=4):
    torch.manual_seed(0)
    backbone = build_patch_backbone("conv_patch8", image_size=16, out_channels=8).eval()
    pool = torch.randn(20, 3, 16, 16)
    clients = [torch.tensor([0, 3, 5, 7, 8, 11, 12]), torch.tensor([1, 2, 4, 6, 9, 10, 13, 14, 15])]
    cache = FeatureCache.build(
        backbone, lambda ix: pool[ix], clients, len(pool), tmp_path, k=k, max_bytes=max_bytes, batch_size=3
    )
    return backbone, pool, clients, cache


def test_cached_features_are_bit_identical_to_recomputed_ones(tmp_path):
    backbone, pool, _clients, cache = setup(tmp_path)
    index = torch.tensor([12, 1, 3, 15])  # from both clients, out of order
    with torch.no_grad():
        recomputed = backbone(pool[index]).half().float()
    assert torch.equal(cache.features(index), recomputed)
    assert cache.nbytes == 16 * 8 * 2 * 2 * 2  # 16 training images × [8, 2, 2] × fp16


def test_knn_lists_rank_a_clients_own_images_by_cosine_of_pooled_features(tmp_path):
    backbone, pool, clients, cache = setup(tmp_path)
    for indices in clients:
        with torch.no_grad():
            pooled = backbone(pool[indices]).mean(dim=(2, 3)).numpy()
        normed = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        cosine = normed @ normed.T
        for i, image in enumerate(indices.tolist()):
            others = np.argsort(-np.where(np.arange(len(indices)) == i, -np.inf, cosine[i]), kind="stable")[:3]
            assert cache.knn[image].tolist() == [image, *indices[others].tolist()]
    outside = torch.tensor([16, 17, 18, 19])
    assert (cache.owner[outside] == -1).all()


def test_partners_come_from_ranks_one_and_two_of_the_own_client(tmp_path):
    _, _, clients, cache = setup(tmp_path)
    index = clients[1].repeat(50)
    partners = cache.sample_neighbours(index, num_neighbors=2, generator=torch.Generator().manual_seed(0))
    for image, partner in zip(index.tolist(), partners.tolist(), strict=True):
        assert partner in cache.knn[image, 1:3].tolist()


def test_clients_past_the_budget_are_computed_on_demand(tmp_path):
    per_image = 8 * 2 * 2 * 2
    backbone, pool, _clients, cache = setup(tmp_path, max_bytes=7 * per_image)  # client 0 exactly fits
    assert cache.client_nbytes(0) == 7 * per_image and cache.client_nbytes(1) == 0
    index = torch.tensor([3, 4])  # one of each
    with torch.no_grad():
        expected = backbone(pool[index])
    torch.testing.assert_close(cache.features(index)[0], expected[0].half().float(), rtol=0, atol=0)
    torch.testing.assert_close(cache.features(index)[1], expected[1])  # fp32, never stored
    assert cache.knn[4, 0] == 4  # every client still has its lists


def test_a_second_build_of_the_same_setting_reuses_the_files(tmp_path):
    backbone, pool, clients, _ = setup(tmp_path)
    calls = []

    def images(ix):
        calls.append(ix)
        return pool[ix]

    FeatureCache.build(backbone, images, clients, len(pool), tmp_path, k=4)
    assert len(calls) == 1  # one image to learn the feature shape, no recomputation
    backbone.net[0].bias.data += 1  # other weights: another folder
    FeatureCache.build(backbone, images, clients, len(pool), tmp_path, k=4)
    assert len(calls) > 2
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2
