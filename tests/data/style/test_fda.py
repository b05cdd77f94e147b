import math

import numpy as np
import pytest
import torch
from PIL import Image

from fedlight.data.style.fda import apply_style, client_style, extract_style, window_half_width
from fedlight.errors import ConfigError


def _smooth_image(height: int, width: int, seed: int, low: int = 40, high: int = 215) -> torch.Tensor:
    """``[1, 3, H, W]`` uint8: a few random low-frequency waves, values inside [low, high]."""
    rng = np.random.default_rng(seed)
    rows, cols = np.meshgrid(np.arange(height) / height, np.arange(width) / width, indexing="ij")
    image = np.zeros((3, height, width))
    for channel in range(3):
        for _ in range(3):
            fy, fx, phase = rng.integers(0, 3), rng.integers(0, 3), rng.uniform(0, 2 * np.pi)
            image[channel] += np.cos(2 * np.pi * (fy * rows + fx * cols) + phase)
    image = (image - image.min()) / (image.max() - image.min())
    return torch.from_numpy(np.round(low + (high - low) * image).astype(np.uint8))[None]


def _numpy_style(image_rgb: np.ndarray, b: int) -> np.ndarray:
    """The style of one ``[3, H, W]`` RGB 0–255 image, straight from numpy (no resize)."""
    amplitude = np.fft.fftshift(np.abs(np.fft.fft2(image_rgb[::-1].astype(np.float64))), axes=(-2, -1))
    ch, cw = image_rgb.shape[1] // 2, image_rgb.shape[2] // 2
    return amplitude[:, ch - b : ch + b + 1, cw - b : cw + b + 1].reshape(-1)


def _numpy_fda(source_rgb: np.ndarray, style: np.ndarray, b: int) -> np.ndarray:
    """FDA on one ``[3, H, W]`` RGB 0–255 image, straight from numpy (no resize)."""
    spectrum = np.fft.fft2(source_rgb[::-1].astype(np.float64))
    amplitude, phase = np.fft.fftshift(np.abs(spectrum), axes=(-2, -1)), np.angle(spectrum)
    ch, cw = source_rgb.shape[1] // 2, source_rgb.shape[2] // 2
    amplitude[:, ch - b : ch + b + 1, cw - b : cw + b + 1] = style.reshape(3, 2 * b + 1, 2 * b + 1)
    image = np.real(np.fft.ifft2(np.fft.ifftshift(amplitude, axes=(-2, -1)) * np.exp(1j * phase)))
    return np.clip(np.round(image), 0, 255)[::-1]


def test_style_of_a_hand_built_image_is_its_analytic_spectrum():
    height, width = 8, 12
    rows = torch.arange(height, dtype=torch.float64)[:, None].expand(height, width)
    cols = torch.arange(width, dtype=torch.float64)[None, :].expand(height, width)
    red = 0.4 + 0.2 * torch.cos(2 * math.pi * rows / height)  # one vertical frequency
    green = torch.full((height, width), 0.5, dtype=torch.float64)
    blue = 0.3 + 0.1 * torch.cos(2 * math.pi * cols / width)  # one horizontal frequency
    image = torch.stack([red, green, blue])[None]

    style = extract_style(image, b=1, size=(height, width)).reshape(3, 3, 3)

    n = height * width * 255.0  # a cosine of amplitude A puts A·HW/2 at ±its frequency; the DC term is mean·HW
    expected = torch.zeros(3, 3, 3, dtype=torch.float64)
    expected[0, 1, 1], expected[0, 1, 0], expected[0, 1, 2] = 0.3 * n, 0.05 * n, 0.05 * n  # blue first: BGR
    expected[1, 1, 1] = 0.5 * n
    expected[2, 1, 1], expected[2, 0, 1], expected[2, 2, 1] = 0.4 * n, 0.1 * n, 0.1 * n
    torch.testing.assert_close(style, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("b", [0, 1, 2])
def test_style_matches_numpy_on_odd_sized_images(b):
    images = torch.cat([_smooth_image(15, 22, seed) for seed in range(3)])  # odd height: ⌊H/2⌋ matters
    styles = extract_style(images, b=b, size=(15, 22))
    assert styles.shape == (3, 3 * (2 * b + 1) ** 2) and styles.dtype == torch.float64
    for image, style in zip(images, styles, strict=True):
        np.testing.assert_allclose(style.numpy(), _numpy_style(image.numpy(), b), rtol=1e-10, atol=1e-6)


def test_lad_default_is_a_27_dimensional_style():
    assert extract_style(_smooth_image(20, 30, 0), size=(16, 32)).shape == (1, 27)


def test_window_from_the_fraction_L_when_b_is_none():
    assert window_half_width((40, 60), b=None, L=0.1) == 4
    assert extract_style(_smooth_image(40, 60, 0), b=None, size=(40, 60), L=0.1).shape == (1, 3 * 9 * 9)
    assert extract_style(_smooth_image(40, 60, 0), b=None, size=(40, 60), L=0.01).shape == (1, 3)  # b = 0


def test_images_are_resized_bicubically_before_the_spectrum():
    image = _smooth_image(30, 45, 1)
    style = extract_style(image, b=1, size=(16, 24))[0].numpy()
    pil = Image.fromarray(image[0].permute(1, 2, 0).numpy()).resize((24, 16), Image.BICUBIC)  # PIL: (W, H)
    expected = _numpy_style(np.asarray(pil).transpose(2, 0, 1), 1)
    # 8-bit resizers may round a pixel differently: at most 1 per pixel, i.e. 16·24 per coefficient
    assert np.abs(style - expected).max() <= 16 * 24
    np.testing.assert_allclose(style[[4, 13, 22]], expected[[4, 13, 22]], rtol=1e-2)  # the DC terms


def test_client_style_is_the_mean_over_every_image_in_every_batch():
    images = torch.cat([_smooth_image(12, 16, seed) for seed in range(5)])
    streamed = client_style([images[:2], images[2:3], images[3:]], b=1, size=(12, 16))
    expected = np.mean([_numpy_style(image.numpy(), 1) for image in images], axis=0)
    np.testing.assert_allclose(streamed.numpy(), expected, rtol=1e-10)


def test_apply_style_matches_numpy_fda():
    source, target = _smooth_image(16, 20, 2, low=0, high=255), _smooth_image(16, 20, 3, low=0, high=255)
    style = _numpy_style(target[0].numpy(), 1) * 1.5  # a brighter style, so that clipping happens
    restyled = apply_style(source, torch.from_numpy(style), b=1, size=(16, 20))
    expected = _numpy_fda(source[0].numpy(), style, 1)
    assert restyled.dtype == torch.uint8 and restyled.shape == source.shape
    assert (expected == 255).any()  # the clipping branch is exercised
    np.testing.assert_array_equal(restyled[0].numpy(), expected.astype(np.uint8))


def test_apply_style_keeps_the_phase_and_sets_the_window_amplitude():
    height, width = 32, 40
    noise = torch.randint(-40, 41, (1, 3, height, width), generator=torch.Generator().manual_seed(0))
    source = (_smooth_image(height, width, 4, low=90, high=150).int() + noise).to(torch.uint8)  # every frequency
    style = extract_style(source, b=1, size=(height, width))[0] * 1.2
    restyled = apply_style(source, style, b=1, size=(height, width))
    assert restyled.min() > 0 and restyled.max() < 255  # no clipping: the output is the inverse FFT, rounded

    before = np.fft.fft2(source[0].numpy()[::-1].astype(np.float64))  # BGR, like the style
    after = np.fft.fft2(restyled[0].numpy()[::-1].astype(np.float64))
    # rounding the output to integers adds spectral noise of ~10 per coefficient: compare strong coefficients
    strong = np.abs(before) > 400
    assert strong.sum() > 1000
    phase_error = np.angle(after[strong] * np.conj(before[strong]))
    assert np.abs(phase_error).max() < 0.1  # a lost or shifted phase would be off by up to π
    # a smooth change rounds coherently (up to 0.5 per pixel in the same direction), so only the large DC
    # terms of the window are compared here; the exact values are compared with numpy's FDA above
    window = np.fft.fftshift(np.abs(after), axes=(-2, -1))[:, 15:18, 19:22].reshape(3, 9)
    np.testing.assert_allclose(window[:, 4], style.numpy().reshape(3, 9)[:, 4], rtol=0.5 * height * width / 150e3)
    outside = np.fft.fftshift(np.abs(after) - np.abs(before), axes=(-2, -1))
    outside[:, 15:18, 19:22] = 0
    assert np.abs(outside).max() < 0.1 * np.abs(before).mean()  # other amplitudes unchanged up to rounding


def test_an_images_own_style_gives_the_image_back():
    image = _smooth_image(24, 36, 5, low=0, high=255)
    same_size = apply_style(image, extract_style(image, b=1, size=(24, 36)), b=1, size=(24, 36))
    torch.testing.assert_close(same_size, image, atol=0, rtol=0)
    # through a smaller FFT size: the image comes back as the plain down- and up-sizing gives it
    resized = apply_style(image, extract_style(image, b=1, size=(12, 18)), b=1, size=(12, 18))
    pil_small = Image.fromarray(image[0].permute(1, 2, 0).numpy()).resize((18, 12), Image.BICUBIC)
    pil_back = np.asarray(pil_small.resize((36, 24), Image.BICUBIC)).transpose(2, 0, 1)
    assert np.abs(resized[0].numpy().astype(int) - pil_back.astype(int)).max() <= 2


def test_float_images_come_back_as_floats_in_the_unit_range():
    image = _smooth_image(16, 16, 6).double() / 255.0
    brighter = extract_style(image, b=0, size=(16, 16)) * 1.1  # the 1×1 window: the mean brightness
    out = apply_style(image, brighter, b=0, size=(16, 16))
    assert out.dtype == torch.float64 and out.shape == image.shape
    assert out.min() >= 0 and out.max() <= 1
    assert out.mean() == pytest.approx(min(1.0, image.mean().item() * 1.1), abs=2e-3)


def test_one_style_per_image_in_a_batch():
    images = torch.cat([_smooth_image(12, 12, seed) for seed in range(2)])
    styles = extract_style(images, b=1, size=(12, 12)).flip(0)  # swap the two styles
    batched = apply_style(images, styles, b=1, size=(12, 12))
    for i in range(2):
        torch.testing.assert_close(batched[i : i + 1], apply_style(images[i : i + 1], styles[i], b=1, size=(12, 12)))


def test_normalised_images_are_refused_with_advice():
    with pytest.raises(ValueError, match="before normalising"):
        extract_style(torch.randn(1, 3, 8, 8), b=0, size=(8, 8))


def test_a_window_larger_than_the_image_is_a_config_error():
    with pytest.raises(ConfigError, match="b=3"):
        extract_style(torch.zeros(1, 3, 5, 5, dtype=torch.uint8), b=3, size=(5, 5))
