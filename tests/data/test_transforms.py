import pytest
import torch
import torch.nn.functional as F

from fedlight.data.transforms import RandomScaleCropFlip
from fedlight.errors import ConfigError


def _batch(size: int = 16, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, 21, (batch, size // 4, size // 4), generator=torch.Generator().manual_seed(0))
    labels = labels.repeat_interleave(4, 1).repeat_interleave(4, 2)  # 4×4 blocks, [B, S, S]
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1)), labels


def test_unit_scale_without_flip_is_the_identity() -> None:
    x, y = _batch()
    out_x, out_y = RandomScaleCropFlip(scale=(1.0, 1.0), flip=False)(x, y, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out_x, x)
    assert torch.equal(out_y, y)


def test_flip_mirrors_image_and_labels_together() -> None:
    x, y = _batch(batch=32)
    out_x, out_y = RandomScaleCropFlip(scale=(1.0, 1.0), flip=True)(x, y, torch.Generator().manual_seed(0))
    flipped = torch.tensor([torch.equal(o, t.flip(-1)) for o, t in zip(out_y, y, strict=True)])
    kept = torch.tensor([torch.equal(o, t) for o, t in zip(out_y, y, strict=True)])
    assert (flipped | kept).all() and 5 < flipped.sum() < 27
    torch.testing.assert_close(out_x[flipped], x[flipped].flip(-1))
    torch.testing.assert_close(out_x[~flipped], x[~flipped])


def test_crop_keeps_images_aligned_with_labels() -> None:
    _, y = _batch(size=32, batch=8)
    x = y[:, None].float().expand(-1, 3, -1, -1).contiguous()  # the image shows its own labels
    out_x, out_y = RandomScaleCropFlip(crop_size=20, scale=(1.0, 1.0))(x, y, torch.Generator().manual_seed(2))
    assert out_x.shape == (8, 3, 20, 20) and out_y.shape == (8, 20, 20)
    assert torch.equal(out_x[:, 0].round().long(), out_y)
    # every crop is a window of its (possibly mirrored) source
    for source, crop in zip(y, out_y, strict=True):
        windows = [source[i : i + 20, j : j + 20] for i in range(13) for j in range(13)]
        windows += [w.flip(-1) for w in windows]
        assert any(torch.equal(crop, w) for w in windows)


def test_a_rectangular_crop_is_a_window_of_that_shape() -> None:
    labels = torch.arange(12 * 24).view(1, 12, 24).repeat(5, 1, 1)  # every pixel its own label
    x = labels[:, None].float().expand(-1, 3, -1, -1).contiguous()
    out_x, out_y = RandomScaleCropFlip(crop_size=(4, 16), scale=(1.0, 1.0), flip=False)(
        x, labels, torch.Generator().manual_seed(7)
    )
    assert out_x.shape == (5, 3, 4, 16) and out_y.shape == (5, 4, 16)
    for crop in out_y:  # the window's top-left label gives its offset; the rest follows row-major
        top, left = divmod(int(crop[0, 0]), 24)
        assert 0 <= top <= 8 and 0 <= left <= 8 and torch.equal(crop, labels[0, top : top + 4, left : left + 16])
    assert torch.equal(out_x[:, 0].round().long(), out_y)
    transform = RandomScaleCropFlip(crop_size=(4, 16))
    assert transform.output_size((12, 24)) == (4, 16) == tuple(transform(x, labels, torch.Generator())[1].shape[1:])
    assert RandomScaleCropFlip(crop_size=None).output_size((12, 24)) == (12, 24)


def test_doubling_is_a_window_of_the_nearest_upsampled_map() -> None:
    _, y = _batch(size=16, batch=6)
    _, out_y = RandomScaleCropFlip(crop_size=16, scale=(2.0, 2.0), flip=False)(
        torch.zeros(6, 3, 16, 16), y, torch.Generator().manual_seed(3)
    )
    upsampled = F.interpolate(y[:, None].float(), scale_factor=2, mode="nearest")[:, 0].long()  # [B, 32, 32]
    for big, crop in zip(upsampled, out_y, strict=True):
        assert any(torch.equal(crop, big[i : i + 16, j : j + 16]) for i in range(17) for j in range(17))


def test_halving_pads_with_void_and_keeps_the_image_whole() -> None:
    x, y = _batch(size=16, batch=6)
    out_x, out_y = RandomScaleCropFlip(crop_size=16, scale=(0.5, 0.5))(x, y, torch.Generator().manual_seed(4))
    assert ((out_y != 255).sum(dim=(1, 2)) == 8 * 8).all()  # the whole 8×8 image, surrounded by void
    assert (out_x[(out_y == 255)[:, None].expand_as(out_x)] == 0).all()


def test_same_generator_same_augmentation() -> None:
    x, y = _batch()
    transform = RandomScaleCropFlip(crop_size=12)
    first = transform(x, y, torch.Generator().manual_seed(5))
    again = transform(x, y, torch.Generator().manual_seed(5))
    other = transform(x, y, torch.Generator().manual_seed(6))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[1], other[1])


def test_bad_settings_name_the_flags() -> None:
    with pytest.raises(ConfigError) as info:
        RandomScaleCropFlip(crop_size=0, scale=(2.0, 0.5))
    assert "crop_size ≥ 1" in str(info.value) and "low ≤ high" in str(info.value)
    with pytest.raises(ConfigError, match="crop_size ≥ 1"):
        RandomScaleCropFlip(crop_size=(512, 0))
