"""A client's whole step — forward pass, loss, backward pass and optimizer update — compiled as one function.

Compiling only the forward pass and loss leaves the autograd engine and the optimizer eager, and on a small
network those are most of a step: a batch-10 step of the 60→128→256→10 MLP spends about 200 µs in the
backward pass and 70 µs in the SGD update against 60 µs in the forward pass (``benchmarks/speed/step_parts.py``).
Here the gradient comes from ``torch.func.grad_and_value`` over the client's ``training_step`` and the rule's
loss, run through ``functional_call`` on the resident module's own parameters, and the update is tensor
arithmetic on them, so the compiler sees forward, backward and update as one graph. The parameters are updated
in place, so the module holds the client's weights after every step, as in the eager loop.

The update is written here rather than taken from ``torch.optim``'s functional API because that API takes the
learning rate and the other settings as Python numbers, which the compiler specialises on: every client's fresh
optimizer, or a round-dependent learning rate, would compile again. Here every setting is a 0-d tensor read from
the optimizer's parameter group at the start of the fit, and the optimizer state (momentum buffers, Adam's
moments, the step count) lives in buffers allocated once per run and zeroed for each client, as a fresh
optimizer's would be. The arithmetic follows ``torch.optim``'s documented algorithms — SGD with momentum,
dampening, Nesterov momentum and L2 weight decay; Adam with L2 or decoupled weight decay; AdamW — and the tests
check it step by step against ``torch.optim``.

What runs this way: one SGD, Adam or AdamW optimizer over exactly the module's trainable parameters, without a
scheduler, AMSGrad or ``maximize``, under any precision but fp16 mixed (its gradient scaler steps outside the
graph), with a rule whose loss reads the parameters through the module at the call
(``Strategy.loss_is_traceable``: a loss using parameter objects it kept would not be differentiated in them).
A loss that no gradient transform can run (one that asks for a tensor's memory address, say) fails on the
first step, before any update, and the run goes on with the forward pass and loss compiled. Anything else keeps
the eager backward pass and optimizer (with the forward pass and loss compiled), and the console says why once
per run.

With ``steps_per_call`` k > 1, k consecutive batches of one shape are stacked and their k steps run inside one
compiled call, so the per-call cost of entering the compiled code (guards, argument checks, the graph's launch) is
paid once per k steps rather than once per step: on an overhead-bound network that cost is a large share of a
step. The steps inside the call are the same steps in the same order. A run of equal-shape batches that does
not fill a call (the full batches before an epoch's short last batch, on a client with fewer than k of them)
runs in calls of the largest powers of two that fit (5 batches: a call of 4, then one of 1), so a small client
still takes several steps per call while the number of compiled graphs stays at most log₂ k + 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.func import functional_call, grad_and_value
from torch.utils._pytree import tree_flatten, tree_map

#: the optimizers whose update the whole step computes itself
WHOLE_STEP_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def allow_recompiles() -> None:
    """Raises dynamo's limit of graphs per function (8) for the rounds' compiled steps, which compile one graph per
    batch shape, per rule branch and for the batch index once it varies."""
    import torch._dynamo as dynamo

    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)


def update_blocker(optimizer: torch.optim.Optimizer, precision: Any) -> str | None:
    """Why this optimizer's update cannot be computed inside a compiled step (:func:`sgd_update`,
    :func:`adam_update`), or ``None`` when it can."""
    if getattr(precision, "scaler", None) is not None:
        return "fp16 mixed precision scales the loss through a gradient scaler, which steps outside the graph"
    if type(optimizer) not in WHOLE_STEP_OPTIMIZERS:
        return f"configure_optimizers returned {type(optimizer).__name__}; the whole step takes SGD, Adam or AdamW"
    for group in optimizer.param_groups:
        for option in ("maximize", "amsgrad", "differentiable"):
            if group.get(option):
                return f"the optimizer sets {option}=True, which the whole step does not compute"
    if len({bool(group.get("nesterov")) for group in optimizer.param_groups}) > 1:
        return "the optimizer's parameter groups differ in nesterov"
    return None


def update_rule(optimizer: torch.optim.Optimizer) -> str:
    """The update :class:`WholeStep` computes for ``optimizer``: ``sgd``, ``sgd-nesterov`` or ``adam``."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return "adam"
    return "sgd-nesterov" if optimizer.param_groups[0]["nesterov"] else "sgd"


def update_settings(optimizer: torch.optim.Optimizer, group: dict, device: torch.device) -> torch.Tensor:
    """A parameter group's settings as the vector :func:`sgd_update` or :func:`adam_update` reads, in fp64 on
    ``device``: tensors rather than Python numbers, so that a new learning rate does not compile again."""
    if update_rule(optimizer) == "adam":
        beta1, beta2 = group["betas"]
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
        values = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"], float(decoupled))
    else:
        values = (group["lr"], group["momentum"], group["dampening"], group["weight_decay"], 0.0, 0.0)
    return torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)


def whole_step_blocker(
    module: nn.Module, optimizers: list[torch.optim.Optimizer], schedulers: list[Any], precision: Any
) -> str | None:
    """Why a fit with these optimizers cannot run as one compiled step, or ``None`` when it can."""
    if len(optimizers) != 1:
        return f"configure_optimizers returned {len(optimizers)} optimizers; the whole step takes one"
    if schedulers:
        return "configure_optimizers returned a learning-rate scheduler; the whole step takes none"
    optimizer = optimizers[0]
    blocker = update_blocker(optimizer, precision)
    if blocker is not None:
        return blocker
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    optimized = [id(p) for group in optimizer.param_groups for p in group["params"]]
    if set(optimized) != trainable or len(optimized) != len(trainable):
        return "the optimizer does not train exactly the module's trainable parameters"
    return None


class _Step(nn.Module):
    """The client's ``training_step`` and the rule's loss as one module call, for ``functional_call``."""

    def __init__(self, client: nn.Module, loss_fn: Callable, precision: Any) -> None:
        super().__init__()
        self.client = client
        self.loss_fn = loss_fn
        self.precision = precision

    def forward(self, batch: Any, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.precision.forward_context():
            outputs = self.client.training_step(batch, batch_idx)
            loss = self.loss_fn(self.client, batch, outputs)
        return loss, outputs["loss"].detach().float()


class StepState(NamedTuple):
    """What every compiled step of a fit reads and updates, besides its batch."""

    #: the module's trainable parameters, updated in place
    trainable: dict[str, torch.Tensor]
    #: its other tensors (frozen parameters, buffers)
    fixed: dict[str, torch.Tensor]
    #: each trainable parameter's optimizer state (momentum buffer; Adam's two moments)
    slots: dict[str, list[torch.Tensor]]
    #: each trainable parameter's optimizer settings, as a vector
    settings: dict[str, torch.Tensor]
    #: the step count t
    count: torch.Tensor
    #: the fit's task-loss sum
    loss_sum: torch.Tensor
    #: the update rule: ``sgd``, ``sgd-nesterov`` or ``adam``
    rule: str


class WholeStep:
    """One compiled function for the forward pass, loss, backward pass and update of every client of a run.

    Args:
        module: the resident client module every client trains.
        loss_fn: the rule's loss of the client's ``training_step`` outputs.
        precision: Fabric's precision plugin (its forward context and input conversion).
        mode: ``torch.compile``'s mode, or ``None`` for its default.
        steps_per_call: consecutive steps of equal-shape batches run in one compiled call.
    """

    def __init__(
        self, module: nn.Module, loss_fn: Callable, precision: Any, mode: str | None = None, steps_per_call: int = 1
    ) -> None:
        self.step = _Step(module, loss_fn, precision)
        self.precision = precision
        allow_recompiles()
        self.compiled = torch.compile(self._step, mode=mode)
        self.steps_per_call = steps_per_call
        self.compiled_steps = torch.compile(self._steps, mode=mode) if steps_per_call > 1 else None
        # CUDA graphs replay fixed addresses: every tensor the step updates in place is marked as one that stays
        self.static = mode in ("reduce-overhead", "max-autotune")
        self._views: tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self._slots: dict[str, list[torch.Tensor]] = {}  # the optimizer state, allocated once and zeroed per fit
        self._count: torch.Tensor | None = None  # the step count t of the current fit
        self._loss_sum: torch.Tensor | None = None  # the fit's task-loss sum
        self.steps_run = 0  # steps this object has run, over the run's fits

    def run(self, optimizer: torch.optim.Optimizer, batches: Any) -> tuple[torch.Tensor, int]:
        """A client's local training loop: one update per batch. Returns the task-loss sum and the steps."""
        trainable, fixed = self._tensors()
        rule, settings = self._settings(optimizer)
        slots = self._fresh_slots(trainable, rule)
        state = StepState(trainable, fixed, slots, settings, self._count, self._loss_sum, rule)
        steps = 0
        pending: list[Any] = []  # batches of one shape waiting to fill a call of several steps
        pending_shape = None  # their shapes (_shapes)
        for batch in batches:
            batch = self.precision.convert_input(batch)
            if self.compiled_steps is None:
                self.compiled(state, batch, steps)
                steps += 1
                self.steps_run += 1
                continue
            shape = _shapes(batch)  # flattened once per batch
            if pending and shape != pending_shape:
                steps = self._flush(state, pending, steps)
            if shape is None:  # a batch with other leaves than tensors cannot be stacked
                steps = self._flush(state, [batch], steps)
                continue
            pending.append(batch)
            pending_shape = shape
            if len(pending) == self.steps_per_call:
                steps = self._flush(state, pending, steps)
        steps = self._flush(state, pending, steps)
        return state.loss_sum.clone(), steps

    def _flush(self, state: StepState, batches: list[Any], steps: int) -> int:
        """Runs ``batches`` (of one shape) in order: a full call of ``steps_per_call`` steps, or calls of the largest
        powers of two that fit, a lone batch by the single-step function. Returns the steps done so far, and
        empties ``batches``."""
        done = 0
        while done < len(batches):
            left = len(batches) - done
            size = left if left == self.steps_per_call else 1 << (left.bit_length() - 1)
            if size == 1:
                self.compiled(state, batches[done], steps)
            else:
                stacked = tree_map(lambda *leaves: torch.stack(leaves), *batches[done : done + size])
                self.compiled_steps(state, stacked, steps, size)
            steps += size
            done += size
            self.steps_run += size
        batches.clear()
        return steps

    def _tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The module's trainable parameters and its other tensors (frozen parameters, buffers), as detached views
        of the module's own storage, kept while the module keeps its tensors."""
        params = dict(self.step.named_parameters())
        buffers = dict(self.step.named_buffers())
        key = tuple((name, p.data_ptr(), p.requires_grad) for name, p in params.items())
        key += tuple((name, b.data_ptr()) for name, b in buffers.items())
        if self._views is None or self._views[0] != key:
            trainable = {name: p.detach() for name, p in params.items() if p.requires_grad}
            fixed = {name: p.detach() for name, p in params.items() if not p.requires_grad} | buffers
            if self.static:
                for tensor in [*trainable.values(), *fixed.values()]:
                    torch._dynamo.mark_static_address(tensor)
            self._views = key, trainable, fixed
        return self._views[1], self._views[2]

    def _settings(self, optimizer: torch.optim.Optimizer) -> tuple[str, dict[str, torch.Tensor]]:
        """The update rule's name and each trainable parameter's settings, as a vector on its device."""
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        settings = {
            name: update_settings(optimizer, group_of[id(p)], p.device)
            for name, p in self.step.named_parameters()
            if p.requires_grad
        }
        return update_rule(optimizer), settings

    def _fresh_slots(self, trainable: dict[str, torch.Tensor], rule: str) -> dict[str, list[torch.Tensor]]:
        """The optimizer state of a fresh optimizer: zeros, in buffers kept across the run's fits."""
        count = 2 if rule == "adam" else 1
        fresh = []
        for name, p in trainable.items():
            slots = self._slots.get(name)
            if (
                slots is None
                or len(slots) != count
                or slots[0].shape != p.shape
                or slots[0].dtype != p.dtype
                or slots[0].device != p.device
            ):
                slots = self._slots[name] = [torch.zeros_like(p) for _ in range(count)]
                fresh += slots
            else:
                torch._foreach_zero_(slots)
        device = next(iter(trainable.values())).device
        if self._count is None or self._count.device != device:
            self._count = torch.zeros((), dtype=torch.float64, device=device)
            self._loss_sum = torch.zeros((), device=device)
            fresh += [self._count, self._loss_sum]
        else:
            self._count.zero_()
            self._loss_sum.zero_()
        if self.static:
            for tensor in fresh:
                torch._dynamo.mark_static_address(tensor)
        return {name: self._slots[name] for name in trainable}

    def _step(self, state: StepState, batch: Any, batch_idx: int) -> None:
        trainable, fixed, slots, settings, count, loss_sum, rule = state
        grads, (_, task_loss) = grad_and_value(self._loss, has_aux=True)(trainable, fixed, batch, batch_idx)
        count.add_(1)
        for name, p in trainable.items():
            update = adam_update if rule == "adam" else sgd_update
            update(p, grads[name], slots[name], settings[name], count, nesterov=rule == "sgd-nesterov")
        loss_sum.add_(task_loss)

    def _steps(self, state: StepState, stacked: Any, first_idx: int, num_steps: int) -> None:
        """``num_steps`` steps, one per batch of ``stacked`` (the batches stacked along a new first dimension), as
        :meth:`_step` runs them one by one."""
        for i in range(num_steps):
            self._step(state, tree_map(lambda leaf, i=i: leaf[i], stacked), first_idx + i)

    def _loss(self, trainable, fixed, batch, batch_idx):
        loss, task_loss = functional_call(self.step, (trainable, fixed), (batch, batch_idx))
        return loss, task_loss


def _shapes(batch: Any) -> tuple | None:
    """The structure, shapes, dtypes and devices of a batch's tensors (``None`` when it holds anything else): batches
    of equal ``_shapes`` stack into one call."""
    leaves, spec = tree_flatten(batch)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return None
    return spec, tuple((leaf.shape, leaf.dtype, leaf.device) for leaf in leaves)


def sgd_update(
    p: torch.Tensor, grad: torch.Tensor, slots: list[torch.Tensor], settings: torch.Tensor, count: torch.Tensor,
    nesterov: bool = False,
) -> None:  # fmt: skip
    """``torch.optim.SGD``'s update of ``p`` in place: L2 weight decay, momentum buffer ``b`` (the first step's
    gradient, then ``μ b + (1 − dampening) g``), Nesterov's look-ahead, then ``p ← p − lr · d``.

    ``settings`` = (lr, μ, dampening, weight decay); ``count`` the step t, already counting this step.
    """
    lr, momentum, dampening, weight_decay = (s.to(p.dtype) for s in settings[:4])
    d = grad + weight_decay * p
    buffer = slots[0]
    buffer.copy_(torch.where(count == 1, d, buffer * momentum + (1 - dampening) * d))
    d = torch.where(momentum == 0, d, d + momentum * buffer if nesterov else buffer)
    p.sub_(lr * d)


def adam_update(
    p: torch.Tensor, grad: torch.Tensor, slots: list[torch.Tensor], settings: torch.Tensor, count: torch.Tensor,
    nesterov: bool = False,
) -> None:  # fmt: skip
    """``torch.optim.Adam``'s (and AdamW's) update of ``p`` in place, AMSGrad off.

    ``settings`` = (lr, β1, β2, ε, weight decay, decoupled): decoupled decay scales ``p`` by ``1 − lr · λ`` first
    (AdamW), L2 decay adds ``λ p`` to the gradient (Adam); then the moments ``m ← β1 m + (1 − β1) g`` and
    ``v ← β2 v + (1 − β2) g²`` and ``p ← p − lr / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε)``.
    """
    lr, beta1, beta2, eps, weight_decay, decoupled = (s.to(p.dtype) for s in settings)
    p.mul_(1 - decoupled * lr * weight_decay)
    grad = grad + (1 - decoupled) * weight_decay * p
    m, v = slots
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).add_((1 - beta2) * grad * grad)
    t = count.to(p.dtype)
    step_size = lr / (1 - beta1**t)
    denom = v.sqrt() / (1 - beta2**t).sqrt() + eps
    p.sub_(step_size * m / denom)


#: ``compile_steps=auto`` compiles when the run's remaining fits would take this many seconds or more eagerly
AUTO_MIN_EAGER_S = 600.0


def auto_choice(seconds: float, steps: int, fits_left: int, blocker: str | None) -> tuple[bool, str]:
    """Whether ``--trainer.compile_steps=auto`` compiles the rest of a run whose first fit took ``seconds`` for
    ``steps`` steps eagerly, with ``fits_left`` fits to go on this process, and the sentence that says why.

    Compiling pays back only when the eager steps it replaces take long enough: the whole step ran at 1.3–2.3× the
    eager loop on small networks on a CPU (``benchmarks/speed/README.md``), while compiling took one to two
    minutes there without a warm compiler cache. So it compiles when the whole step can run (``blocker`` None)
    and the remaining fits, timed as the first, would take :data:`AUTO_MIN_EAGER_S` seconds or more eagerly.
    """
    eager_s = seconds * fits_left
    compiles = blocker is None and eager_s >= AUTO_MIN_EAGER_S
    estimate = (
        f"the first fit took {seconds:.2f} s for {steps} steps, so the run's other {fits_left} fits on this process "
        f"would take about {eager_s / 60:.1f} min eagerly"
    )
    minutes = f"{AUTO_MIN_EAGER_S / 60:.0f} min"
    if blocker is not None:
        choice = f"steps stay eager, because the whole step cannot run: {blocker}"
    elif compiles:
        choice = f"at least {minutes}, enough to repay compiling: the steps are compiled"
    else:
        choice = f"less than the {minutes} it takes to repay compiling: the steps stay eager"
    return compiles, f"{estimate}; {choice}"


def compile_cost() -> str:
    """What compiling costs and where its work is kept, said before the first compiled step runs."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder is None:
        try:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            folder = cache_dir()
        except (ImportError, AttributeError):  # a torch that keeps it elsewhere
            folder = "torch's inductor cache"
    return (
        "The first client compiles it before round 1 moves on: seconds on a GPU, up to minutes for a CNN on a CPU "
        f"(eager steps start at once). Compiled code is kept in {folder} (TORCHINDUCTOR_CACHE_DIR), so a later run "
        "of the same model and shapes compiles faster."
    )
