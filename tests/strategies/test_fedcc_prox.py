from types import SimpleNamespace

import torch

from fedlight.clients.unsupervised import UnsupervisedSegmentationClient
from fedlight.plans import ClientPlan
from fedlight.state import FlatState
from fedlight.strategies import FedCCProx


def test_only_the_nonlinear_branch_is_pulled_back():
    torch.manual_seed(0)
    module = UnsupervisedSegmentationClient(
        num_classes=2, input_shape=(3, 8, 8), backbone="conv_patch8", backbone_kwargs={"out_channels": 4}, dim=2
    )
    context = SimpleNamespace(layout=FlatState(module, module.frozen_modules), datamodule=SimpleNamespace(batch_size=8))
    strategy = FedCCProx(mu=0.5)
    strategy.on_fit_start(context)
    strategy.on_client_fit_start(context, module, ClientPlan(0, 1))
    outputs = {"loss": torch.tensor(1.0)}
    with torch.no_grad():
        module.head.linear.weight.add_(3.0)
        module.centroids.clusters.add_(3.0)
        module.linear_probe.bias.add_(3.0)
    assert strategy.training_loss(module, None, outputs).item() == 1.0  # nothing outside N counts
    with torch.no_grad():
        module.head.nonlinear[0].bias[:2] += torch.tensor([1.0, 2.0])  # ‖Δ‖² = 5
        module.head.nonlinear[2].weight[0, 0] -= 1.0  # ‖Δ‖² = 1
    loss = strategy.training_loss(module, None, outputs)
    assert abs(loss.item() - (1.0 + 0.5 * 0.5 * 6.0)) < 1e-6
    loss.backward()
    assert module.head.nonlinear[2].weight.grad[0, 0].item() == -0.5  # μ(θ − θ^t)
