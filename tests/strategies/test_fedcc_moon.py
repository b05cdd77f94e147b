from types import SimpleNamespace

import torch
import torch.nn.functional as F

from fedlight.clients.unsupervised import UnsupervisedSegmentationClient
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.state import FlatState
from fedlight.strategies import FedCCMOON
from fedlight.strategies.fedcc_moon import pixel_contrastive_loss


def test_pixel_loss_is_the_two_way_softmax_of_cosines_averaged_over_pixels():
    torch.manual_seed(0)
    z, g, p = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    cos_g, cos_p = F.cosine_similarity(z, g, dim=1), F.cosine_similarity(z, p, dim=1)
    logits = torch.stack([cos_g, cos_p], dim=-1) / 0.5  # [2, 4, 5, 2]
    expected = -torch.log_softmax(logits, dim=-1)[..., 0].mean()  # the 1e-8 aside
    torch.testing.assert_close(pixel_contrastive_loss(z, g, p, 0.5), expected, rtol=1e-6, atol=1e-6)


def test_a_client_contrasts_with_its_previous_branch_from_its_second_fit_on():
    torch.manual_seed(0)
    module = UnsupervisedSegmentationClient(
        num_classes=2, input_shape=(3, 8, 8), backbone="conv_patch8", backbone_kwargs={"out_channels": 4}, dim=2
    )
    context = SimpleNamespace(
        layout=FlatState(module, module.frozen_modules),
        datamodule=SimpleNamespace(batch_size=8),
        all_gather_objects=lambda obj: [obj],
        strategy_rng=lambda t: None,
    )
    strategy = FedCCMOON()
    strategy.on_fit_start(context)
    strategy.on_round_start(context, 0, [])
    strategy.on_client_fit_start(context, module, ClientPlan(0, 1))
    feats = torch.randn(2, 4, 3, 3)
    outputs = {"loss": torch.tensor(0.25), "features": feats, "codes": module.head(feats)}
    assert strategy.training_loss(module, None, outputs).item() == 0.25  # no previous model yet
    strategy.on_client_fit_end(context, module, ClientUpdate(0, 8, 1, 1, 0.0))
    previous = {k: v.clone() for k, v in module.head.nonlinear.state_dict().items()}
    strategy.on_round_end(context, 0, [])

    with torch.no_grad():  # the next round's received model differs from the client's previous one
        for p in module.head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    received = {k: v.clone() for k, v in module.head.nonlinear.state_dict().items()}
    strategy.on_round_start(context, 1, [])
    strategy.on_client_fit_start(context, module, ClientPlan(0, 1))
    codes = module.head(feats)
    outputs = {"loss": torch.tensor(0.25), "features": feats, "codes": codes}
    nonlinear = module.head.nonlinear
    with torch.no_grad():
        nonlinear.load_state_dict(previous)
        negative = nonlinear(feats)
        nonlinear.load_state_dict(received)
        positive = nonlinear(feats)
    expected = 0.25 + pixel_contrastive_loss(codes, positive, negative, 0.5)
    torch.testing.assert_close(strategy.training_loss(module, None, outputs), expected)
    assert set(strategy.state_dict()["previous"]) == {0}


def test_the_released_moon_contrasts_with_the_received_branch_itself_and_has_no_gradient():
    # FUSS's released code averages the previous local branch with the rest of the state, so its negative is
    # N^t: every pixel's term is −log(e^a / (2e^a + 1e-8)) with a = cos(z, N^t(f))/τ, ≈ log 2, from the first fit
    torch.manual_seed(0)
    module = UnsupervisedSegmentationClient(
        num_classes=2, input_shape=(3, 8, 8), backbone="conv_patch8", backbone_kwargs={"out_channels": 4}, dim=2
    )
    context = SimpleNamespace(
        layout=FlatState(module, module.frozen_modules),
        all_gather_objects=lambda obj: [obj],
        strategy_rng=lambda t: None,
    )
    strategy = FedCCMOON(previous="averaged", mu=2.0)
    strategy.on_round_start(context, 0, [])
    strategy.on_client_fit_start(context, module, ClientPlan(0, 1))
    feats = torch.randn(2, 4, 3, 3)
    codes = module.head(feats)
    loss = strategy.training_loss(module, None, {"loss": torch.tensor(0.25), "features": feats, "codes": codes})
    with torch.no_grad():
        a = F.cosine_similarity(codes, module.head.nonlinear(feats), dim=1) / 0.5
        term = -(a - torch.log(2 * torch.exp(a) + 1e-8)).mean()
    torch.testing.assert_close(loss, 0.25 + 2.0 * term)
    assert abs(term.item() - torch.log(torch.tensor(2.0)).item()) < 1e-6
    grads = torch.autograd.grad(loss, list(module.head.parameters()), allow_unused=True)
    assert max(g.abs().max().item() for g in grads if g is not None) < 1e-7
    strategy.on_client_fit_end(context, module, ClientUpdate(0, 8, 1, 1, 0.0))
    assert strategy.state_dict()["previous"] == {}  # nothing of the client's own is kept


def test_the_papers_moon_has_a_gradient_where_the_released_one_has_none():
    torch.manual_seed(0)
    module = UnsupervisedSegmentationClient(
        num_classes=2, input_shape=(3, 8, 8), backbone="conv_patch8", backbone_kwargs={"out_channels": 4}, dim=2
    )
    context = SimpleNamespace(layout=FlatState(module, module.frozen_modules))
    strategy = FedCCMOON()
    branch = module.head.nonlinear
    strategy.previous[0] = FlatState(branch).flatten(branch) + 0.5  # a previous N unlike the received one
    strategy.on_client_fit_start(context, module, ClientPlan(0, 1))
    feats = torch.randn(2, 4, 3, 3)
    outputs = {"loss": torch.tensor(0.0), "features": feats, "codes": module.head(feats)}
    grads = torch.autograd.grad(strategy.training_loss(module, None, outputs), list(module.head.parameters()))
    assert max(g.abs().max().item() for g in grads) > 1e-3
