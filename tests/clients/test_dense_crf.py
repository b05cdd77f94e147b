"""The dense CRF's wiring: what fedlight hands to pydensecrf and what it makes of the answer.

pydensecrf is an optional extension (``pip install pydensecrf2``), so the inference is replaced here by a
stand-in module that records its inputs; what is checked is fedlight's side of the exchange.
"""

import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedlight.clients.dense_crf import to_rgb_bytes
from fedlight.clients.unsupervised import UnsupervisedSegmentationClient
from fedlight.errors import ConfigError

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.1)


def make_client(**kwargs):
    torch.manual_seed(0)
    return UnsupervisedSegmentationClient(
        num_classes=4, input_shape=(3, 16, 16), backbone="conv_patch8",
        backbone_kwargs={"out_channels": 4, "width": 4}, dim=3, **kwargs,
    )  # fmt: skip


@pytest.fixture
def fake_pydensecrf(monkeypatch):
    """A pydensecrf whose inference returns the label-reversed softmax, recording every call."""
    calls = []

    class DenseCRF2D:
        def __init__(self, width, height, labels):
            self.call = {"shape": (width, height, labels)}
            calls.append(self.call)

        def setUnaryEnergy(self, unary):
            self.call["unary"] = unary

        def addPairwiseGaussian(self, **kwargs):
            self.call["gaussian"] = kwargs

        def addPairwiseBilateral(self, rgbim, **kwargs):
            self.call["rgb"], self.call["bilateral"] = rgbim, kwargs

        def inference(self, iterations):
            self.call["iterations"] = iterations
            return np.exp(-self.call["unary"])[::-1].copy()  # [n, H·W], labels in reverse order

    densecrf = types.ModuleType("pydensecrf.densecrf")
    densecrf.DenseCRF2D = DenseCRF2D
    utils = types.ModuleType("pydensecrf.utils")
    utils.unary_from_softmax = lambda p: -np.log(np.clip(p, 1e-5, 1.0)).reshape(p.shape[0], -1).astype(np.float32)
    package = types.ModuleType("pydensecrf")
    package.densecrf, package.utils = densecrf, utils
    monkeypatch.setitem(sys.modules, "pydensecrf", package)
    monkeypatch.setitem(sys.modules, "pydensecrf.densecrf", densecrf)
    monkeypatch.setitem(sys.modules, "pydensecrf.utils", utils)
    return calls


def test_crf_without_pydensecrf_is_refused_at_set_up_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydensecrf", None)  # import fails
    monkeypatch.setitem(sys.modules, "pydensecrf.densecrf", None)
    with pytest.raises(ConfigError, match=r"--model.init_args.crf=true.*pip install pydensecrf2"):
        make_client(crf=True)
    make_client(crf=False)  # without the flag nothing is needed


def test_the_crf_sees_the_original_colours():
    image = torch.tensor([[[0.0, 2.0], [-2.0, -4.0]]] * 3)  # standardised values
    rgb = to_rgb_bytes(image, MEAN, STD)  # [2, 2, 3]
    assert rgb.dtype == np.uint8 and rgb.flags["C_CONTIGUOUS"] and rgb.shape == (2, 2, 3)
    # channel 0: 0.5 + 0.25·v → 0.5, 1.0, 0.0, −0.5 (clamped) → 128, 255, 0, 0
    assert rgb[..., 0].tolist() == [[128, 255], [0, 0]]
    # channel 2: 0.3 + 0.1·v → 0.3, 0.5, 0.1, −0.1 → 76.5 → 76 (round half to even), 127.5 → 128, 25.5 → 26, 0
    assert rgb[..., 2].tolist() == [[76, 128], [26, 0]]


def test_evaluation_with_crf_takes_the_crfs_labels(fake_pydensecrf):
    client = make_client(crf=True, image_mean=MEAN, image_std=STD).eval()
    images, labels = torch.randn(2, 3, 16, 16), torch.randint(0, 4, (2, 16, 16))
    with torch.no_grad():
        out = client.validation_step((images, labels, torch.zeros(2)), 0)
        codes = F.interpolate(client(images), size=(16, 16), mode="bilinear", align_corners=False)
        cosine = F.normalize(codes, dim=1).permute(0, 2, 3, 1) @ F.normalize(client.centroids.clusters, dim=1).T
        probs = torch.softmax(2 * cosine, dim=-1).permute(0, 3, 1, 2)  # [2, 4, 16, 16], STEGO's α = 2
    # the stand-in reverses the labels, so the most likely cluster k comes back as 3 − k; the probe likewise
    assert torch.equal(out["clusters"], 3 - probs.argmax(dim=1))
    assert torch.equal(out["linear"], 3 - client.linear_probe(codes).argmax(dim=1))
    assert len(fake_pydensecrf) == 4  # two images × (clusters, probe)
    first = fake_pydensecrf[0]
    assert first["shape"] == (16, 16, 4) and first["iterations"] == 10
    assert first["gaussian"] == {"sxy": 1.0, "compat": 3.0}
    assert first["bilateral"] == {"sxy": 67.0, "srgb": 3.0, "compat": 4.0}
    expected_rgb = (images[0] * torch.tensor(STD).view(3, 1, 1) + torch.tensor(MEAN).view(3, 1, 1)).clamp(0, 1) * 255
    rgb = expected_rgb.round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.array_equal(first["rgb"], rgb[:, :, ::-1])  # as BGR, like STEGO
    np.testing.assert_allclose(first["unary"], -np.log(np.clip(probs[0].reshape(4, -1).numpy(), 1e-5, 1)), rtol=1e-5)
