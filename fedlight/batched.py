"""Training a round's clients together: stacked copies of the model, one vectorised step for all of them.

Sequential simulation runs one client after another, one small kernel at a time, with Python overhead on
every step. For small models that overhead dominates. Here the K clients of a round keep their own copy of
every parameter in one stacked tensor ``[K, *shape]``, and each local step computes all their gradients
with one ``torch.func.vmap`` of ``grad`` over the client's own ``training_step`` (run through
``functional_call`` with that client's parameters), then takes one optimizer step on the stacked tensors.

What stays exactly as in the sequential loop:

- every client draws the batches it would draw alone (its own generator, its own epochs, each batch passed
  through the strategy's ``transform_batch``), and its ``training_step`` averages over its own batch: clients
  whose batches differ in size at a step (an epoch's short last batch) are vectorised in separate groups;
- each client's optimizer state is its own slice of the stacked state, created fresh every round; the
  optimizers allowed (SGD, Adam, AdamW) update element by element, and all clients still training at a
  step have taken the same number of steps, so one stacked step is K independent steps;
- a client that has run all its steps stops: its final state is taken then, and later steps of the others
  do not touch it.

What differs: float rounding. A batched matrix product may sum in another order than K separate ones, so
the global model agrees with the sequential one to float tolerance, not bit for bit.

Rounds that cannot be vectorised run sequentially, with one log line saying why: modules with BatchNorm
(running statistics are updated in place) or active dropout (its draws would not come from each client's
own stream), frozen parts or buffers, schedulers or other optimizers, and strategies whose clients run
hooks on the module (a proximal term, MOON, teachers).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedlight.state import FlatState
from fedlight.strategies.base import Strategy

#: Optimizers whose update is element-wise, so one step on stacked tensors is one step per client.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
#: Strategy hooks that run on the client's module during its fit: a strategy overriding one is not batched.
#: (``transform_batch`` is not one: it rewrites the batches before they are stacked.)
_CLIENT_HOOKS = ("client_teachers", "on_client_fit_start", "training_loss", "on_client_fit_end")


def batching_blocker(module: nn.Module, layout: FlatState, strategy: Strategy, configured: Any) -> str | None:
    """Why a round of this module, layout and strategy cannot be vectorised, or ``None`` when it can.

    Args:
        module: the client module, in train mode.
        layout: its federated layout.
        strategy: the round's rule.
        configured: what ``module.configure_optimizers()`` returned.
    """
    for hook in _CLIENT_HOOKS:
        if getattr(type(strategy), hook) is not getattr(Strategy, hook):
            return f"{type(strategy).__name__} overrides {hook}, which runs on each client's module"
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm):
            return f"{name} is a BatchNorm, whose running statistics are updated in place"
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
            return f"{name} is an active dropout, whose draws would not come from each client's own stream"
    if layout.frozen_names or layout.integer_names or any(True for _ in module.buffers()):
        return "the module has frozen parts or buffers"
    if not isinstance(configured, ELEMENTWISE_OPTIMIZERS) or len(configured.param_groups) != 1:
        return (
            f"configure_optimizers returned {type(configured).__name__}; batching takes one SGD, Adam or AdamW "
            "optimizer with one parameter group and no scheduler"
        )
    return None


class _TrainingStep(nn.Module):
    """``training_step``'s task loss as a module call, so that ``functional_call`` can swap its parameters."""

    def __init__(self, client: nn.Module) -> None:
        super().__init__()
        self.client = client

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.client.training_step((x, y), 0)["loss"]


class BatchedLocalFit:
    """Runs the local fits of several clients as one vectorised model.

    Args:
        module: the resident client module (its parameters are read for names and shapes only).
        layout: its federated layout (every entry a parameter: see :func:`batching_blocker`).
        precision: Fabric's precision plugin (``convert_input``, ``forward_context``).
    """

    def __init__(self, module: nn.Module, layout: FlatState, precision: Any) -> None:
        self.layout = layout
        self.precision = precision
        self.dtype = next(module.parameters()).dtype  # the module's weights (fp64 under 64-true)
        self.step = _TrainingStep(module)
        step_fn = grad_and_value(self._loss)
        self._grads = vmap(step_fn, in_dims=(0, 0, 0))

    def _loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return functional_call(self.step, params, (x, y))

    def run(
        self,
        starts: Sequence[torch.Tensor],
        batches: Sequence[list[tuple[torch.Tensor, torch.Tensor]]],
        make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    ) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """Trains client i from ``starts[i]`` (``[P]``) on ``batches[i]``.

        Args:
            starts: each client's initial flat state.
            batches: each client's batches of the round, in order.
            make_optimizer: builds the optimizer for a list of stacked parameters.

        Returns:
            For each client: the sum of its task losses, its step count and its final ``[P]`` state.
        """
        k = len(starts)
        entries = self.layout.entries
        start = torch.stack(list(starts)).to(self.dtype)  # [K, P]
        stacked = [
            start[:, e.offset : e.offset + e.numel].reshape(k, *e.shape).clone().requires_grad_(True) for e in entries
        ]
        optimizer = make_optimizer(stacked)
        names = [f"client.{e.name}" for e in entries]
        slots = list(range(k))  # stack position → client: the clients still training
        loss_sums = torch.zeros(k, dtype=torch.float32, device=start.device)
        finals: list[torch.Tensor | None] = [start[i].float() if not batches[i] else None for i in range(k)]
        for j in range(max((len(b) for b in batches), default=0)):
            active = [i for i in slots if j < len(batches[i])]
            if len(active) < len(slots):  # drop the finished clients from the stack once, not at every step
                stacked, optimizer = _compact(stacked, optimizer, [slots.index(i) for i in active], make_optimizer)
                slots = active
            by_size: dict[int, list[int]] = {}  # clients whose batches have one size are vectorised together
            for position, i in enumerate(slots):
                by_size.setdefault(len(batches[i][j][1]), []).append(position)
            whole = len(by_size) == 1  # the usual case: every client in one group, no gather or scatter
            grads = None if whole else [torch.zeros_like(p) for p in stacked]
            for positions in by_size.values():
                index = torch.tensor(positions, device=start.device)
                params = {n: p.detach() if whole else p.detach()[index] for n, p in zip(names, stacked, strict=True)}
                clients = [slots[position] for position in positions]
                x, y = self.precision.convert_input(
                    (torch.stack([batches[i][j][0] for i in clients]), torch.stack([batches[i][j][1] for i in clients]))
                )
                with self.precision.forward_context():
                    group_grads, losses = self._grads(params, x, y)
                if whole:
                    grads = [group_grads[n].to(p.dtype) for n, p in zip(names, stacked, strict=True)]
                else:
                    for grad, name in zip(grads, names, strict=True):
                        grad[index] = group_grads[name].to(grad.dtype)
                loss_sums[torch.tensor(clients, device=start.device)] += losses.detach().float()
            for p, grad in zip(stacked, grads, strict=True):
                p.grad = grad
            optimizer.step()
            for position, i in enumerate(slots):
                if j == len(batches[i]) - 1:  # its last step: its state is final
                    finals[i] = torch.cat([p.detach()[position].reshape(-1).float() for p in stacked])
        return [(loss_sums[i], len(batches[i]), finals[i]) for i in range(k)]


def _compact(
    stacked: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    keep: list[int],
    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """The stacked parameters and optimizer state of the positions ``keep`` only.

    Per-client optimizer state (momentum, Adam's moments) has the stack's leading axis and is sliced with
    the parameters; shared entries (Adam's step count, equal for every client still training) are kept.
    """
    index = torch.tensor(keep, device=stacked[0].device)
    kept = [p.detach()[index].clone().requires_grad_(True) for p in stacked]
    compacted = make_optimizer(kept)
    for old, new in zip(stacked, kept, strict=True):
        compacted.state[new] = {
            key: value[index].clone() if torch.is_tensor(value) and value.dim() > 0 else value
            for key, value in optimizer.state.get(old, {}).items()
        }
    return kept, compacted


def optimizer_factory(configured: torch.optim.Optimizer) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """An optimizer of ``configured``'s class and settings over new (stacked) parameters.

    >>> sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    >>> optimizer_factory(sgd)([torch.zeros(4, 1, requires_grad=True)]).param_groups[0]["momentum"]
    0.9
    """
    accepted = inspect.signature(type(configured)).parameters
    settings = {key: value for key, value in configured.param_groups[0].items() if key in accepted and key != "params"}
    return lambda params: type(configured)(params, **settings)
