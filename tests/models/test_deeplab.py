import pytest
import torch

from fedlight.errors import ConfigError
from fedlight.models import create_model


def _model(**kwargs):
    torch.manual_seed(0)
    return create_model("deeplabv3plus", input_shape=(3, 32, 32), num_classes=5, encoder_weights=None, **kwargs)


def test_split_reproduces_the_library_forward_and_cuts_before_the_classifier():
    model = _model().eval()
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(x), model.model(x))  # smp's own forward: encoder, decoder, head
    features = model.forward_features(x)
    assert features.shape == (2, 256, 8, 8) and features.min() >= 0  # decoder output, after its ReLU
    classifier = model.model.segmentation_head[0]
    assert isinstance(classifier, torch.nn.Conv2d) and classifier.kernel_size == (1, 1)
    logits_low = classifier(features)  # the 1×1 classifier on the features, before upsampling
    upsampled = torch.nn.functional.interpolate(logits_low, scale_factor=4, mode="bilinear", align_corners=True)
    torch.testing.assert_close(model.forward_head(features), upsampled)


def test_output_stride_16_by_default():
    model = _model()
    deepest = model.model.encoder(torch.zeros(1, 3, 64, 64))[-1]
    assert deepest.shape[-2:] == (4, 4)
    assert _model(output_stride=8).model.encoder(torch.zeros(1, 3, 64, 64))[-1].shape[-2:] == (8, 8)


def test_pretrained_weights_load_later_into_the_encoder(monkeypatch, tmp_path):
    """The encoder's ImageNet weights are read from the hub cache as a machine without network has it copied."""
    import huggingface_hub.constants
    from miniatures.weights import write_smp_encoder
    from safetensors.torch import load_file

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = create_model("deeplabv3plus", input_shape=(3, 32, 32), num_classes=5)  # imagenet: nothing read yet
    write_smp_encoder(tmp_path, "mobilenet_v2")
    (written,) = tmp_path.glob("models--smp-hub--mobilenet_v2.imagenet/snapshots/*/model.safetensors")
    reference = load_file(written)
    assert not torch.equal(model.model.encoder.state_dict()["features.0.0.weight"], reference["features.0.0.weight"])
    model.load_pretrained()
    for name, value in reference.items():
        torch.testing.assert_close(model.model.encoder.state_dict()[name], value)


def test_missing_pretrained_weights_say_how_to_get_them(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = create_model("deeplabv3plus", input_shape=(3, 32, 32), num_classes=5)
    with pytest.raises(ConfigError, match="encoder_weights=null"):
        model.load_pretrained()


def test_input_sides_must_fit_the_output_stride():
    with pytest.raises(ConfigError, match="divisible by output_stride=16"):
        create_model("deeplabv3plus", input_shape=(3, 40, 40), num_classes=5)
