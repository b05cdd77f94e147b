import pytest
import torch

from fedlight.errors import ConfigError
from fedlight.models import create_model, list_models

SHAPES = {
    "mlp": (60,),
    "cnn": (1, 28, 28),
    "daformer": (3, 64, 64),
    "celeba_cnn": (3, 84, 84),
    "deeplabv3plus": (3, 32, 32),
    "deeplabv3_mobilenetv2": (3, 64, 64),
    "mini_deeplab": (3, 32, 64),
    "resnet18": (3, 32, 32),
    "resnet50": (3, 32, 32),
}
#: Dense models and their feature strides: features [B, D, H/s, W/s] and per-pixel logits [B, C, H, W].
DENSE = {"deeplabv3plus": 4, "deeplabv3_mobilenetv2": 32, "mini_deeplab": 8, "daformer": 4}


@pytest.mark.parametrize("name", list_models())
def test_every_model_splits_into_features_and_head(name):
    torch.manual_seed(0)
    model = create_model(name, input_shape=SHAPES[name], num_classes=7)
    x = torch.randn(3, *SHAPES[name])
    features = model.forward_features(x)
    spatial = tuple(side // DENSE[name] for side in SHAPES[name][1:]) if name in DENSE else ()
    assert features.shape == (3, model.num_features, *spatial)
    model.eval()  # dropout would make the two passes differ
    torch.testing.assert_close(model(x), model.forward_head(model.forward_features(x)))
    assert model(x).shape == (3, 7, *(SHAPES[name][1:] if name in DENSE else ()))


def test_cnn_matches_the_papers_layer_sizes():
    model = create_model("cnn", input_shape=(1, 28, 28), num_classes=10)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(7 * 7 * 64, 256), (256, 10)]


def test_mlp_matches_the_papers_layer_sizes():
    model = create_model("mlp", input_shape=(60,), num_classes=10)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(60, 128), (128, 256), (256, 10)]


def test_unknown_model_names_the_flag_and_the_choices():
    with pytest.raises(ConfigError, match=r"--model.init_args.model.*cnn, .*mlp"):
        create_model("resnet999", input_shape=(3, 32, 32), num_classes=10)


def test_cnn_rejects_flat_inputs_with_advice():
    with pytest.raises(ValueError, match="mlp"):
        create_model("cnn", input_shape=(60,), num_classes=10)
