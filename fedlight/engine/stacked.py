"""The state of a stack of clients (``batched.py``): their optimizer over stacked tensors, its state carried when the
stack shrinks or a client steps alone, and the optimizer's update computed inside a compiled step.

``torch.optim``'s SGD, Adam and AdamW update element by element, so one optimizer over tensors ``[K, *shape]`` is K
clients' optimizers, each with its slice of the state. The compiled update here writes that same state (the
momentum buffer; Adam's step count and moments) in ``torch.optim``'s own keys, creating it as ``torch.optim`` does
on a first step, so that an eager ``optimizer.step()`` can follow a compiled one on the same stack and the reverse.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from fedlight.engine.whole_step import adam_update, sgd_update, update_rule, update_settings


class InGraphUpdate:
    """The stacked clients' gradients and their optimizer's update as one compiled function.

    Args:
        grads: ``vmap``'d ``grad_and_value`` of the task loss: ``(params, x, y) → (grads, losses)`` over the stack.
        names: the parameters' names in ``grads``' dictionaries, in the stack's order.
    """

    def __init__(self, grads: Callable, names: list[str]) -> None:
        self.grads = grads
        self.names = names
        self.compiled = torch.compile(self._step)
        self.compiled_steps = torch.compile(self._steps)
        self.steps = 0  # stacked steps run with the update in the graph
        self._counts: dict[tuple[bool, torch.device], torch.Tensor] = {}

    def __call__(
        self, stacked: list[torch.Tensor], optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """One step of every stacked client on its batch of ``x``, ``y`` (``[K, batch, …]``), updating ``stacked``
        and ``optimizer``'s state in place. Returns each client's task loss."""
        rule, settings, slots, counts = self._state(stacked, optimizer)
        losses = self.compiled([p.detach() for p in stacked], slots, settings, counts, x, y, rule)
        self.steps += 1
        return losses

    def several(
        self, stacked: list[torch.Tensor], optimizer: torch.optim.Optimizer, xs: torch.Tensor, ys: torch.Tensor
    ) -> torch.Tensor:
        """``len(xs)`` steps in one compiled call, step t on ``xs[t]``, ``ys[t]`` (``[steps, K, batch, …]``), as
        that many calls would run them; only after a first step (:meth:`takes_several`). Returns each client's
        task-loss sum over the steps."""
        rule, settings, slots, counts = self._state(stacked, optimizer)
        losses = self.compiled_steps([p.detach() for p in stacked], slots, settings, counts, xs, ys, rule, len(xs))
        self.steps += len(xs)
        return losses

    @staticmethod
    def takes_several(optimizer: torch.optim.Optimizer) -> bool:
        """Whether the next steps may run several to a call: not SGD's first step, whose momentum buffer starts as d
        itself, which the count passed for the call's first step would give to every step of it."""
        if update_rule(optimizer) == "adam":
            return True
        states = [optimizer.state.get(p, {}) for group in optimizer.param_groups for p in group["params"]]
        return all(state.get("momentum_buffer") is not None for state in states)

    def _state(
        self, stacked: list[torch.Tensor], optimizer: torch.optim.Optimizer
    ) -> tuple[str, torch.Tensor, list[list[torch.Tensor]], list[torch.Tensor]]:
        """The update rule, the settings and each stacked tensor's state and step count, created on a first step as
        ``torch.optim`` would."""
        rule = update_rule(optimizer)
        settings = update_settings(optimizer, optimizer.param_groups[0], stacked[0].device)
        slots, counts = [], []
        for p in stacked:
            state = optimizer.state[p]
            if rule == "adam":
                if not state:  # Adam's first step, initialised as torch.optim does
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                slots.append([state["exp_avg"], state["exp_avg_sq"]])
                counts.append(state["step"])
            else:
                first = state.get("momentum_buffer") is None
                if first:
                    state["momentum_buffer"] = torch.zeros_like(p)
                slots.append([state["momentum_buffer"]])
                counts.append(self._sgd_count(first, p.device))
        return rule, settings, slots, counts

    def _sgd_count(self, first: bool, device: torch.device) -> torch.Tensor:
        """The step count SGD's update reads: 1 on a first step (the momentum buffer starts as d itself), 2 on any
        later one (it reads nothing else of it); one tensor per value and device, so every call passes the same."""
        key = (first, device)
        if key not in self._counts:
            self._counts[key] = torch.full((), 1.0 if first else 2.0, dtype=torch.float64, device=device)
        return self._counts[key]

    def _step(
        self,
        params: list[torch.Tensor],
        slots: list[list[torch.Tensor]],
        settings: torch.Tensor,
        counts: list[torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        rule: str,
    ) -> torch.Tensor:
        grads, losses = self.grads(dict(zip(self.names, params, strict=True)), x, y)
        if rule == "adam":
            for count in counts:
                count.add_(1)
        update = adam_update if rule == "adam" else sgd_update
        for name, p, state, count in zip(self.names, params, slots, counts, strict=True):
            update(p, grads[name].to(p.dtype), state, settings, count, nesterov=rule == "sgd-nesterov")
        return losses

    def _steps(self, params, slots, settings, counts, xs, ys, rule: str, num_steps: int) -> torch.Tensor:
        losses = self._step(params, slots, settings, counts, xs[0], ys[0], rule)
        for t in range(1, num_steps):
            losses = losses + self._step(params, slots, settings, counts, xs[t], ys[t], rule)
        return losses


def restore(stacked: list[torch.Tensor], optimizer: torch.optim.Optimizer, stepped: dict) -> None:
    """Writes each plainly stepped position's parameters and optimizer state back into the stack, over whatever
    the stacked optimizer step did to them. Shared scalars (Adam's step count) are the same for every client
    still training, so they are taken from the plain step."""
    with torch.no_grad():
        for position, (params, states) in stepped.items():
            for values, param, state in zip(stacked, params, states, strict=True):
                values[position] = param
                shared = optimizer.state[values]
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        shared[key][position] = value
                    else:
                        shared[key] = value.clone() if torch.is_tensor(value) else value


def compact(
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
    if "foreach" in accepted and settings.get("foreach") is None:
        settings["foreach"] = True  # torch picks the per-tensor loop on the CPU; the same update, in fewer calls
    return lambda params: type(configured)(params, **settings)
