import pytest
import torch
import torch.nn.functional as F

from fedlight.clients.unsupervised import UnsupervisedSegmentationClient
from fedlight.errors import ConfigError


def make_client(**kwargs):
    torch.manual_seed(0)
    options = {"backbone": "vit_tiny_patch8", "backbone_kwargs": {"embed_dim": 32}, "dim": 6} | kwargs
    return UnsupervisedSegmentationClient(num_classes=5, input_shape=(3, 32, 32), **options)


def test_an_image_size_the_patch_does_not_divide_is_refused_at_set_up():
    with pytest.raises(ConfigError, match="divisible by 8"):
        UnsupervisedSegmentationClient(num_classes=5, input_shape=(3, 36, 36), backbone="conv_patch8")


def test_a_missing_weights_file_says_where_to_put_the_dino_weights(tmp_path):
    client = UnsupervisedSegmentationClient(
        num_classes=5, input_shape=(3, 32, 32), backbone="conv_patch8", pretrained=str(tmp_path / "dino.pth")
    )
    with pytest.raises(ConfigError, match=r"DINO ViT-B/8 weights, dino_vitbase8_pretrain\.pth"):
        client.configure_model()


def test_three_adams_over_head_centroids_and_probe_with_the_papers_rates():
    client = make_client()
    optimizers = client.configure_optimizers()
    assert [type(o) for o in optimizers] == [torch.optim.Adam] * 3
    assert [o.param_groups[0]["lr"] for o in optimizers] == [5e-4, 5e-3, 5e-3]
    groups = [{id(p) for p in o.param_groups[0]["params"]} for o in optimizers]
    assert groups == [
        {id(p) for p in client.head.parameters()},
        {id(client.centroids.clusters)},
        {id(p) for p in client.linear_probe.parameters()},
    ]
    assert client.frozen_modules == ("backbone",)


def grads_after_step(client, labels):
    client.zero_grad()
    torch.manual_seed(1)  # the same dropout, sampled points and partners in both calls
    images = torch.randn(4, 3, 32, 32)
    client.train()
    outputs = client.training_step((images, labels), 0)
    outputs["loss"].backward()
    return {name: p.grad.clone() for name, p in client.named_parameters() if p.grad is not None}


def test_the_labels_reach_the_probe_and_nothing_else():
    client = make_client(preset="cityscapes")
    client.weights = type(client.weights)(1.0, 0.0, 0.9, 0.45, 0.17, 0.31)  # no kNN pairing: no cache needed
    a = grads_after_step(client, torch.zeros(4, 32, 32, dtype=torch.long))
    b = grads_after_step(client, torch.randint(0, 5, (4, 32, 32)))
    assert not any(name.startswith("backbone") for name in a)  # frozen: no gradient at all
    for name in a:
        if name.startswith("linear_probe"):
            assert not torch.equal(a[name], b[name]), name
        else:
            assert torch.equal(a[name], b[name]), name


def test_knn_pairing_without_a_feature_cache_names_the_fix():
    client = make_client()
    with pytest.raises(ConfigError, match="BackboneFeatureCache"):
        client.training_step((torch.randn(2, 3, 32, 32), torch.zeros(2, 32, 32, dtype=torch.long)), 0)


@pytest.mark.parametrize("flip_tta", [False, True])
def test_evaluation_assigns_each_pixel_to_the_most_cosine_similar_centroid(flip_tta):
    client = make_client(flip_tta=flip_tta).eval()
    images, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 5, (2, 32, 32))
    with torch.no_grad():
        out = client.validation_step((images, labels, torch.zeros(2)), 0)
        codes = client.head(client.backbone(images))
        if flip_tta:
            codes = (codes + client.head(client.backbone(images.flip(-1))).flip(-1)) / 2
        codes = F.interpolate(codes, size=(32, 32), mode="bilinear", align_corners=False)  # [2, D, 32, 32]
        z = codes / codes.norm(dim=1, keepdim=True)
        m = client.centroids.clusters / client.centroids.clusters.norm(dim=1, keepdim=True)
        expected = torch.einsum("bdhw,nd->bnhw", z, m).argmax(dim=1)  # softmax and ×2 keep the argmax
        probe = client.linear_probe(codes).argmax(dim=1)
    assert torch.equal(out["clusters"], expected)
    assert torch.equal(out["linear"], probe)
    assert torch.equal(out["target"], labels)
