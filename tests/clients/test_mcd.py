import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fedlight.clients import ManualSteps, MCDClient
from fedlight.clients.mcd import classifier_discrepancy
from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.errors import ConfigError

NUM_CLASSES = 3
SHAPE = (3, 16, 16)
LR = 0.05


class TinySource(FederatedDataset):
    """Six labelled 16×16 images with random pixels and label maps."""

    num_classes = NUM_CLASSES
    input_shape = SHAPE

    def load_train(self) -> LabelledTensors:
        generator = torch.Generator().manual_seed(1)
        inputs = torch.randn(6, *SHAPE, generator=generator)
        targets = torch.randint(NUM_CLASSES, (6, *SHAPE[1:]), generator=generator)
        return LabelledTensors(inputs, targets)

    def load_test(self) -> None:
        return None


def _client(**kwargs) -> MCDClient:
    torch.manual_seed(0)
    client = MCDClient(
        NUM_CLASSES, SHAPE, TinySource(), model="mini_deeplab", model_kwargs={"width": 8}, poly_power=0.0, **kwargs
    )
    return client.train()


def _plain_sgd(client: MCDClient) -> ManualSteps:
    """Momentum-free SGD, so that a step is exactly θ ← θ − lr·∇."""
    heads = [p for head in client.heads for p in head.parameters()]
    optimizers = [torch.optim.SGD(client.generator.parameters(), lr=LR), torch.optim.SGD(heads, lr=LR)]
    return ManualSteps(optimizers, backward=lambda loss: loss.backward(), step=lambda optimizer: optimizer.step())


def _batches():
    generator = torch.Generator().manual_seed(2)
    source_x = torch.randn(2, *SHAPE, generator=generator)
    source_y = torch.randint(NUM_CLASSES, (2, *SHAPE[1:]), generator=generator)
    target_x = 0.5 + 2.0 * torch.randn(2, *SHAPE, generator=generator)  # another domain: shifted and wider
    return source_x, source_y, target_x


# -- by hand, on a copy of the network -------------------------------------------------------------
def _logits(net, head, x):
    return F.interpolate(head(net.backbone(x)), size=x.shape[-2:], mode="bilinear", align_corners=False)


def _ce(net, head2, x, y):
    """CE_1 + CE_2, plain means over pixels (hnm_ratio = 1, no void pixel)."""
    return F.cross_entropy(_logits(net, net.classifier, x), y) + F.cross_entropy(_logits(net, head2, x), y)


def _d(net, head2, x):
    p1 = _logits(net, net.classifier, x).softmax(1)
    p2 = _logits(net, head2, x).softmax(1)
    return (p1 - p2).abs().mean()


def _objectives(client):
    source_x, source_y, target_x = _batches()
    net, head2 = client.net, client.classifier2
    return {
        "a": lambda: _ce(net, head2, source_x, source_y),
        "b": lambda: _ce(net, head2, source_x, source_y) - _d(net, head2, target_x),
        "c": lambda: _d(net, head2, target_x),
    }


def _params(client) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in client.named_parameters()}


def _is_generator(name: str) -> bool:
    return name.startswith("net.backbone.")


#: which parameters each step trains: A all, B the heads (G fixed), C the generator (F1, F2 fixed)
TRAINS = {"a": lambda name: True, "b": lambda name: not _is_generator(name), "c": _is_generator}


def _run_step(client, step):
    source_x, source_y, target_x = _batches()
    if step == "a":
        return client.step_a(source_x, source_y)
    if step == "b":
        return client.step_b(source_x, source_y, target_x)
    return client.step_c(target_x)


# -- tests ---------------------------------------------------------------------------------------
def test_discrepancy_of_hand_computed_softmaxes():
    # pixel 1: softmax(0, 0) = (½, ½) against softmax(log 3, 0) = (¾, ¼): |·| = ¼, ¼
    # pixel 2: softmax(log 4, 0) = (⅘, ⅕) against softmax(0, 0) = (½, ½): |·| = 0.3, 0.3
    logits1 = torch.tensor([[[[0.0, math.log(4.0)]], [[0.0, 0.0]]]])  # [B=1, Q=2, 1, 2]
    logits2 = torch.tensor([[[[math.log(3.0), 0.0]], [[0.0, 0.0]]]])
    assert classifier_discrepancy(logits1, logits2).item() == pytest.approx((0.25 + 0.25 + 0.3 + 0.3) / 4)
    assert classifier_discrepancy(logits2, logits1).item() == pytest.approx(0.275)
    assert classifier_discrepancy(logits1, logits1 + 7.0).item() == 0.0  # softmax ignores a shift


@pytest.mark.parametrize("step", ["a", "b", "c"])
def test_each_step_is_one_sgd_step_of_its_own_objective_on_its_own_parameters(step):
    client = _client(hnm_ratio=1.0)
    by_hand = copy.deepcopy(client)
    loss = _objectives(by_hand)[step]()
    names = [name for name, _ in by_hand.named_parameters()]
    grads = torch.autograd.grad(loss, list(by_hand.parameters()), allow_unused=True)
    before = _params(client)
    client.manual_steps = _plain_sgd(client)
    reported = _run_step(client, step)
    after = _params(client)

    assert reported.item() == pytest.approx(loss.item(), rel=1e-6)
    trained = [name for name in names if TRAINS[step](name)]
    assert trained and (step == "a" or len(trained) < len(names))
    for name, grad in zip(names, grads, strict=True):
        if TRAINS[step](name):
            expected = before[name] - LR * (torch.zeros_like(before[name]) if grad is None else grad)
            torch.testing.assert_close(after[name], expected, rtol=1e-5, atol=1e-7, msg=name)
        else:
            assert torch.equal(after[name], before[name]), f"step {step} moved {name}, which it keeps fixed"
    assert all(p.grad is None for p in client.parameters()), "a step leaves no gradient behind"


@pytest.mark.parametrize("step", ["a", "b", "c"])
def test_each_step_lowers_its_objective(step):
    client = _client(hnm_ratio=1.0)
    objective = _objectives(client)[step]
    with torch.no_grad():
        before = objective().item()
    client.manual_steps = _plain_sgd(client)
    _run_step(client, step)
    with torch.no_grad():
        after = objective().item()
    assert after < before, (step, before, after)


def test_step_b_raises_the_discrepancy_and_step_c_lowers_it():
    client = _client(hnm_ratio=1.0)
    discrepancy = _objectives(client)["c"]
    client.manual_steps = _plain_sgd(client)
    with torch.no_grad():
        start = discrepancy().item()
    _run_step(client, "b")
    with torch.no_grad():
        after_b = discrepancy().item()
    _run_step(client, "c")
    with torch.no_grad():
        after_c = discrepancy().item()
    assert after_b > start and after_c < after_b, (start, after_b, after_c)


def test_a_training_step_reads_the_target_only_where_the_discrepancy_is_measured():
    nan_target = torch.full((2, *SHAPE), float("nan"))
    labels = torch.zeros(2, *SHAPE[1:], dtype=torch.long)
    for images, finite in (("source", True), ("target", False)):
        client = _client(discrepancy_images=images, num_generator_steps=2)
        client.manual_steps = _plain_sgd(client)
        outputs = client.training_step((nan_target, labels), 0)
        assert math.isfinite(outputs["loss"].item())  # step A reads the source only
        params_finite = all(torch.isfinite(p).all() for p in client.parameters())
        assert params_finite is finite, images


def test_source_batches_come_from_the_source_pool_at_the_target_batch_size():
    client = _client()
    pool = client.source_pool
    x, y = client.source_batch(4)
    assert x.shape == (4, *SHAPE) and y.shape == (4, *SHAPE[1:])
    rows = [int(torch.nonzero((pool.inputs == image).flatten(1).all(1))[0]) for image in x]
    assert len(set(rows)) == 4, "drawn without replacement"
    assert all(torch.equal(pool.targets[row], labels) for row, labels in zip(rows, y, strict=True))


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        MCDClient(4, SHAPE, TinySource(), model="mini_deeplab", num_generator_steps=0, hnm_ratio=0.0)
    message = str(err.value)
    assert "num_generator_steps" in message and "hnm_ratio" in message and "3 classes" in message
