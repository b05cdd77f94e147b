import numpy as np
import pytest
import torch

from fedlight.clients.self_training import (
    hard_negative_mining_ce,
    kd_loss,
    pseudo_label_mask,
    self_training_loss,
)

#: two 2×4 images as (class, max probability) per pixel, and the labels LADD's rule keeps, worked by hand
#: image 0: class 0 has 4 pixels → ⌊0.66·4⌋ = 2 kept (0.95, 0.6); classes 1 and 2 have 2 → 1 kept each
#: image 1: class 2 has 6 pixels → 3 kept (0.8, 0.7, 0.6); class 0's single 0.91 only by the threshold;
#: class 1's single 0.34 by neither
PIXELS = [
    [[(0, 0.95), (0, 0.5), (0, 0.6), (0, 0.4)], [(1, 0.8), (1, 0.7), (2, 0.5), (2, 0.45)]],
    [[(2, 0.3), (2, 0.4), (2, 0.5), (2, 0.6)], [(2, 0.7), (2, 0.8), (0, 0.91), (1, 0.34)]],
]
EXPECTED = [[[0, 255, 0, 255], [1, 255, 2, 255]], [[255, 255, 255, 2], [2, 2, 0, 255]]]
NUM_CLASSES = 4


def _probs(pixels=PIXELS) -> torch.Tensor:
    """``[B, Q, H, W]``: each pixel's class gets its probability, the other classes share the rest."""
    probs = torch.zeros(len(pixels), NUM_CLASSES, len(pixels[0]), len(pixels[0][0]), dtype=torch.float64)
    for b, image in enumerate(pixels):
        for i, row in enumerate(image):
            for j, (label, p) in enumerate(row):
                probs[b, :, i, j] = (1 - p) / (NUM_CLASSES - 1)
                probs[b, label, i, j] = p
    return probs


def _loop_reference(probs: np.ndarray, conf_th: float, fraction: float) -> np.ndarray:
    """LADD's rule pixel by pixel: threshold, or top ⌊fraction·n_c⌋ of the class in the image."""
    labels = probs.argmax(1)
    confidence = probs.max(1)
    out = np.full(labels.shape, 255)
    for b in range(labels.shape[0]):
        for c in np.unique(labels[b]):
            where = np.argwhere(labels[b] == c)
            ranked = sorted(where.tolist(), key=lambda ij: -confidence[b][tuple(ij)])
            for i, j in ranked[: int(len(ranked) * fraction)]:
                out[b, i, j] = c
        keep = confidence[b] > conf_th
        out[b][keep] = labels[b][keep]
    return out


def test_pseudo_labels_on_a_hand_built_probability_map():
    assert pseudo_label_mask(_probs()).tolist() == EXPECTED


def test_each_rule_alone():
    by_threshold = pseudo_label_mask(_probs(), fraction=0.0)
    assert by_threshold.tolist() == [[[0, 255, 255, 255], [255] * 4], [[255] * 4, [255, 255, 0, 255]]]
    by_rank = pseudo_label_mask(_probs(), conf_th=1.0)
    assert by_rank.tolist() == [[[0, 255, 0, 255], [1, 255, 2, 255]], [[255, 255, 255, 2], [2, 2, 255, 255]]]


@pytest.mark.parametrize(("conf_th", "fraction"), [(0.9, 0.66), (0.5, 0.3), (0.99, 0.9)])
def test_pseudo_labels_match_a_pixel_by_pixel_reference(conf_th, fraction):
    logits = torch.randn(3, 5, 6, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    probs = logits.softmax(1)
    expected = _loop_reference(probs.numpy(), conf_th, fraction)
    np.testing.assert_array_equal(pseudo_label_mask(probs, conf_th, fraction).numpy(), expected)


def test_self_training_loss_averages_over_all_pixels_with_untrusted_ones_as_zero():
    student = torch.randn(2, NUM_CLASSES, 2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    teacher = _probs().log().requires_grad_()  # softmax(log p) = p
    student.requires_grad_()
    loss = self_training_loss(student, teacher)

    log_probs = student.detach().numpy() - np.log(np.exp(student.detach().numpy()).sum(1, keepdims=True))
    labels = np.array(EXPECTED)
    kept = labels != 255
    picked = np.take_along_axis(log_probs, np.where(kept, labels, 0)[:, None], axis=1)[:, 0]
    expected = -(picked * kept).sum() / labels.size  # 16 pixels, 9 of them trusted
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert teacher.grad is None and student.grad is not None  # the teacher only labels


def test_without_a_teacher_the_student_labels_itself():
    student = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(self_training_loss(student), self_training_loss(student, student.clone()))


def test_kd_loss_matches_the_formula_in_numpy():
    generator = torch.Generator().manual_seed(3)
    student = torch.randn(2, 5, 3, 4, generator=generator, dtype=torch.float64)
    teacher = torch.randn(2, 5, 3, 4, generator=generator, dtype=torch.float64) * 4
    mask = torch.rand(2, 3, 4, generator=generator) > 0.4

    s, t, m = student.numpy(), teacher.numpy(), mask.numpy()
    for temperature in (2.0, 1.0):
        q = np.exp(t / temperature) / np.exp(t / temperature).sum(1, keepdims=True)
        log_p = s - np.log(np.exp(s).sum(1, keepdims=True))
        per_pixel = -(q * log_p).sum(1) / 5  # −(1/Q) Σ_c q_c log p_c
        expected = (per_pixel * m).sum() / m.size  # masked, mean over all 24 pixels
        assert kd_loss(student, teacher, mask, temperature).item() == pytest.approx(expected, rel=1e-12)
    assert kd_loss(student, teacher, temperature=1.0).item() == pytest.approx(per_pixel.mean(), rel=1e-12)  # no mask


def test_kd_loss_sends_no_gradient_to_the_teacher():
    student = torch.randn(1, 3, 2, 2, requires_grad=True)
    teacher = torch.randn(1, 3, 2, 2, requires_grad=True)
    kd_loss(student, teacher).backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0


def test_hard_negative_mining_by_hand():
    # two classes; logits (a, 0) with label 0 cost log(1 + e^-a), with label 1 cost log(1 + e^a)
    a = torch.tensor([[[2.0, -1.0], [0.0, 3.0]], [[1.0, -2.0], [0.5, 0.0]]])  # [B=2, H=2, W=2]
    logits = torch.stack([a, torch.zeros_like(a)], dim=1)  # [2, 2, 2, 2]
    labels = torch.tensor([[[0, 0], [0, 1]], [[0, 255], [255, 1]]])
    softplus = lambda x: float(np.log1p(np.exp(x)))  # noqa: E731
    image0 = sorted([softplus(-2.0), softplus(1.0), softplus(0.0), softplus(3.0)], reverse=True)
    image1 = sorted([softplus(-1.0), 0.0, 0.0, softplus(0.0)], reverse=True)  # void pixels cost 0
    # ratio 0.5: the top 2 of 4 pixels per image, then the mean over the two images
    expected = (np.mean(image0[:2]) + np.mean(image1[:2])) / 2
    assert hard_negative_mining_ce(logits, labels, ratio=0.5).item() == pytest.approx(expected, rel=1e-6)
    expected_top1 = (image0[0] + image1[0]) / 2  # LADD's 25 % of 4 pixels: the hardest one
    assert hard_negative_mining_ce(logits, labels).item() == pytest.approx(expected_top1, rel=1e-6)


# -- the client modules ----------------------------------------------------------------------------------
def _client(**kwargs):
    from fedlight.clients import SelfTrainingClient

    torch.manual_seed(0)
    return SelfTrainingClient(num_classes=3, input_shape=(3, 16, 16), model="mini_deeplab", **kwargs)


def _frozen_copy(module, seed):
    import copy

    teacher = copy.deepcopy(module)
    torch.manual_seed(seed)
    for p in teacher.parameters():
        p.data.add_(0.5 * torch.randn_like(p))
    return teacher.requires_grad_(False).eval()


def test_self_training_client_loss_is_pseudo_plus_lambda_kd_and_never_reads_labels():
    client = _client(lambda_kd=7.0)
    pseudo, kd = _frozen_copy(client, 1), _frozen_copy(client, 2)
    client.teachers = {"pseudo": pseudo, "kd": kd}
    x = torch.randn(2, 3, 16, 16)
    labels = torch.randint(3, (2, 16, 16))
    outputs = client.training_step((x, labels), 0)
    garbage = client.training_step((x, torch.full_like(labels, 255)), 0)
    with torch.no_grad():
        student, g_c, f_0 = client.net(x), pseudo(x), kd(x)
        mask = pseudo_label_mask(f_0.softmax(1)) != 255
        expected = self_training_loss(student, g_c) + 7.0 * kd_loss(student, f_0, mask, temperature=2.0)
    assert outputs["loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    assert garbage["loss"].item() == outputs["loss"].item()
    assert 0 < mask.float().mean() < 1  # the KD mask is neither empty nor everything


def test_self_training_client_without_teachers_labels_its_own_predictions():
    client = _client(lambda_kd=7.0)
    x = torch.randn(2, 3, 16, 16)
    outputs = client.training_step((x, None), 0)
    with torch.no_grad():
        logits = client.net(x)
    assert outputs["loss"].item() == pytest.approx(self_training_loss(logits, logits).item(), rel=1e-6)
    assert "loss_kd" not in outputs


def test_source_pretraining_client_uses_hard_negative_mining():
    from fedlight.clients import SourcePretrainingClient

    torch.manual_seed(0)
    client = SourcePretrainingClient(num_classes=3, input_shape=(3, 16, 16), model="mini_deeplab", hnm_ratio=0.5)
    x, y = torch.randn(2, 3, 16, 16), torch.randint(3, (2, 16, 16))
    with torch.no_grad():
        expected = hard_negative_mining_ce(client.net(x), y, ratio=0.5)
    assert client.training_step((x, y), 0)["loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    lrs = [group["lr"] for group in client.configure_optimizers().param_groups]
    assert lrs == [5e-3]


class _Fixed(torch.nn.Module):
    """A stand-in network returning the same logits for any input."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())

    def forward(self, x):
        return self.logits.expand(len(x), *self.logits.shape[1:])


def test_kd_label_weights_multiply_each_pixels_term_by_its_label_id():
    # two pixels, two classes; the student is undecided, so ℓ = ½ log 2 at each (see kd_loss); the KD teacher is
    # confident at both (softmax 0.993 > 0.9), so its mask keeps both. Labels 3 and 255 (void) weigh 3 and 255:
    # L_KD = (3 + 255) / 2 · ½ log 2, where the paper's loss is ½ log 2.
    client = _client(kd_label_weights=True)
    client.net = _Fixed(torch.zeros(1, 2, 1, 2))
    client.teachers = {"kd": _Fixed(torch.tensor([[[[5.0, 5.0]], [[0.0, 0.0]]]]))}
    labels = torch.tensor([[[3, 255]]])
    outputs = client.training_step((torch.zeros(1, 3, 1, 2), labels), 0)
    assert outputs["loss_kd"].item() == pytest.approx(129 * 0.5 * np.log(2), rel=1e-6)
    client.kd_label_weights = False
    assert client.training_step((torch.zeros(1, 3, 1, 2), labels), 0)["loss_kd"].item() == pytest.approx(
        0.5 * np.log(2), rel=1e-6
    )
