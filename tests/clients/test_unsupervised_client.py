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
    with pytest.raises(ConfigError, match=r"tag vit_base_patch8_224\.dino, or the file dino_vitbase8_pretrain\.pth"):
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


# -- dropout as STEGO's DinoFeaturizer applies it ------------------------------------------------------------
# With ``dropout: true`` STEGO's featurizer returns code = L(drop(f)) + N(drop(f)) and hands the loss drop(f):
# three independent Dropout2d masks over the same undropped features f. The statistics below run the client's
# training step with a head set to identity on positive cached features, where the ratio code / f of a channel
# reads which masks dropped it.

P, C_FEAT, POOL = 0.1, 32, 64


class PositiveFeatures:
    """A stand-in feature cache: fixed positive features per pool image; image i's neighbour is i + 1."""

    def __init__(self) -> None:
        self.pool = torch.rand(POOL, C_FEAT, 4, 4, generator=torch.Generator().manual_seed(0)) + 0.5

    def features(self, index, device="cpu"):
        return self.pool[index.long()].to(device)

    def sample_neighbours(self, index, num_neighbors=2, generator=None):
        return (index.long() + 1) % POOL


def identity_head_client(linear: bool, nonlinear: bool) -> UnsupervisedSegmentationClient:
    """A client whose branch L and/or N is the identity (C = D = 32) and the other branch 0."""
    client = make_client(backbone_kwargs={"embed_dim": C_FEAT}, dim=C_FEAT, dropout=P)
    eye = torch.eye(C_FEAT).view(C_FEAT, C_FEAT, 1, 1)
    with torch.no_grad():
        for conv, on in (
            (client.head.linear, linear),
            (client.head.nonlinear[0], True),
            (client.head.nonlinear[2], nonlinear),
        ):
            conv.weight.copy_(eye if on else torch.zeros_like(eye))
            conv.bias.zero_()
    client.attach_feature_cache(PositiveFeatures())
    return client.train()


def dropout_ratios(monkeypatch, client, steps: int = 10) -> dict[str, torch.Tensor]:
    """Per channel and sample, ``code / f`` and ``loss features / f`` for the anchors and their neighbours over
    ``steps`` training steps of a batch of 64: ``[steps · 64 · 32]`` values each."""
    import fedlight.clients.unsupervised as unsupervised

    seen = []
    real = unsupervised.correspondence_loss

    def spy(feats, codes, feats_knn, codes_knn, *args, **kwargs):
        seen.append((feats, codes, feats_knn, codes_knn))
        return real(feats, codes, feats_knn, codes_knn, *args, **kwargs)

    monkeypatch.setattr(unsupervised, "correspondence_loss", spy)
    pool, index = client.feature_cache.pool, torch.arange(POOL)
    torch.manual_seed(0)
    for _ in range(steps):
        client.training_step((torch.zeros(POOL, 3, 32, 32), torch.zeros(POOL, 32, 32, dtype=torch.long), index), 0)
    f, f_knn = pool[index], pool[(index + 1) % POOL]

    def per_channel(anchor: int, neighbour: int) -> torch.Tensor:  # one value per channel and sample (Dropout2d)
        ratios = [r for s in seen for r in (s[anchor].detach() / f, s[neighbour].detach() / f_knn)]
        return torch.cat([r[..., 0, 0].reshape(-1) for r in ratios])

    return {"code": per_channel(1, 3), "loss": per_channel(0, 2)}


def test_each_branch_reads_the_undropped_features_with_its_own_mask(monkeypatch):
    # 10 steps × (64 anchors + 64 neighbours) × 32 channels = 40,960 channel draws per branch. A share p = 0.1
    # then has a binomial standard error of 0.0015; the tolerance 0.01 is 6.7 of them, while reading dropped
    # features (a second mask in front of each branch) drops 1 − 0.9² = 19 % of the channels, 60 of them away.
    scale = 1 / (1 - P)
    for linear, nonlinear in ((True, False), (False, True)):
        code = dropout_ratios(monkeypatch, identity_head_client(linear, nonlinear))["code"]
        kept = code[code != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, scale))  # one 1/0.9, not 1/0.81
        assert abs((code == 0).float().mean().item() - P) < 0.01
    # both branches: each channel's code sums two independent masks, 0, 1/0.9 or 2/0.9 times f
    code = dropout_ratios(monkeypatch, identity_head_client(True, True))["code"]
    levels = torch.tensor([0.0, scale, 2 * scale])
    nearest = (code[:, None] - levels).abs().argmin(dim=1)
    torch.testing.assert_close(code, levels[nearest])
    shares = torch.bincount(nearest, minlength=3).float() / len(code)
    expected = torch.tensor([P * P, 2 * P * (1 - P), (1 - P) ** 2])  # 0.01, 0.18, 0.81
    assert (shares - expected).abs().max().item() < 0.01, shares.tolist()


def test_the_loss_reads_a_separately_dropped_copy(monkeypatch):
    ratios = dropout_ratios(monkeypatch, identity_head_client(True, False))
    code_dropped, loss_dropped = ratios["code"] == 0, ratios["loss"] == 0
    kept = ratios["loss"][~loss_dropped]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - P)))
    assert abs(loss_dropped.float().mean().item() - P) < 0.01
    # independence: among the ~4,100 channels the loss's mask dropped, the code's mask dropped a share P too
    # (standard error 0.0047; tolerance 0.025), not all of them as when the head read the loss's copy
    assert abs(code_dropped[loss_dropped].float().mean().item() - P) < 0.025
    assert abs(code_dropped[~loss_dropped].float().mean().item() - P) < 0.01
