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

Once no more than ``sequential_below`` clients are still training (by default one: the round's largest
client, alone for the end of the round), vectorising no longer pays: a ``vmap``'d step costs several plain
steps in fixed overhead. Those clients finish on the resident module itself, one after another, each from
its slice of the stacked parameters and optimizer state.

What differs: float rounding. A batched matrix product may sum in another order than K separate ones, so
the global model agrees with the sequential one to float tolerance, not bit for bit.

Rounds that cannot be vectorised run sequentially, with one log line saying why: modules with BatchNorm
(running statistics are updated in place) or active dropout (its draws would not come from each client's
own stream), frozen parts or buffers, schedulers or other optimizers, and strategies whose clients run
hooks on the module (a proximal term, MOON, teachers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedlight.engine.stacked import InGraphUpdate, compact, restore
from fedlight.engine.whole_step import allow_recompiles
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


#: Σ steps / max steps over a round's clients below which ``client_batching=auto`` keeps a CPU run sequential:
#: on these CPUs an uncompiled stacked step of 10 MLP clients cost about 7 plain steps and a compiled one about 3
#: (benchmarks/speed/README.md: (m) at a bound of 10 gained 1.45× uncompiled and 3.5× compiled, (a) at 3.7
#: lost uncompiled, 0.76×, and gained compiled, 2.16×).
PAYING_BOUND = {False: 8.0, True: 2.0}


def vectorising_pays(module: nn.Module, device: torch.device, compiled: bool, bound: float) -> tuple[bool, str]:
    """Whether ``client_batching=auto`` vectorises a run, and why, from what the speed benchmarks measured.

    A cost model rather than a timed probe, so that the choice, and with it the run's float rounding, is the same
    on every machine of a kind.

    Args:
        module: the client module.
        device: where the run trains.
        compiled: whether the vectorised step is compiled (``compile_batched``).
        bound: Σ steps / max steps over the first round's clients, the most a lockstep stack can gain.

    >>> net = nn.Sequential(nn.Linear(4, 4))
    >>> vectorising_pays(net, torch.device("cpu"), compiled=True, bound=3.7)[0]
    True
    >>> vectorising_pays(net, torch.device("cpu"), compiled=False, bound=3.7)[0]
    False
    >>> vectorising_pays(nn.Sequential(nn.Conv2d(1, 4, 3)), torch.device("cpu"), compiled=True, bound=50)[0]
    False
    """
    if device.type == "cuda":
        return True, "on a GPU a stacked step costs little more than one client's (10–16× measured on 50 clients)"
    convolution = next((name for name, sub in module.named_modules() if isinstance(sub, nn.modules.conv._ConvNd)), None)
    if convolution is not None:
        return False, (
            f"on a CPU stacked convolutions ({convolution}) run slower than one client's after another "
            "(0.67–0.83× measured); set client_batching=K to vectorise anyway"
        )
    needed = PAYING_BOUND[compiled]
    if bound < needed:
        return False, (
            f"the first round's Σ steps / max steps over its clients is {bound:.1f}, and on a CPU a "
            f"{'compiled' if compiled else 'uncompiled'} stack needs ≥ {needed:g} to pay; set client_batching=K to "
            "vectorise anyway"
        )
    return True, f"the first round's Σ steps / max steps is {bound:.1f} (≥ {needed:g} pays on a CPU)"


class BatchedLocalFit:
    """Runs the local fits of several clients as one vectorised model.

    Args:
        module: the resident client module (its parameters are read for names and shapes only).
        layout: its federated layout (every entry a parameter: see :func:`batching_blocker`).
        precision: Fabric's precision plugin (``convert_input``, ``forward_context``).
        compile: compile the vectorised step (``compile_batched``).
        whole_step: compiled, compute the optimizer's update in the same graph (``fedlight/engine/stacked.py``).
        steps_per_call: with the update in the graph, stacked steps of full batches per compiled call.
    """

    #: Clients still training when they finish on the resident module instead (see the module's docstring).
    sequential_below: int = 1

    def __init__(
        self,
        module: nn.Module,
        layout: FlatState,
        precision: Any,
        compile: bool = False,
        whole_step: bool = False,
        steps_per_call: int = 1,
    ) -> None:
        self.layout = layout
        self.precision = precision
        named = dict(module.named_parameters())
        self._params = [named[e.name] for e in layout.entries]  # the resident module's, in the stack's order
        self._names = [f"client.{e.name}" for e in layout.entries]  # the same, as _TrainingStep names them
        self.dtype = next(module.parameters()).dtype  # the module's weights (fp64 under 64-true)
        self.step = _TrainingStep(module)
        self._grads = vmap(grad_and_value(self._loss), in_dims=(0, 0, 0))
        self._compiled = self._whole = None
        if compile:
            # one graph per (stack size, batch size): stacks are padded to powers of two and only full batches
            # are compiled, so a run compiles a handful of graphs; dynamo's default limit of 8 is raised for them
            allow_recompiles()
            self._compiled = torch.compile(self._grads)
            if whole_step:  # the optimizer's update inside the graph too
                self._whole = InGraphUpdate(self._grads, self._names)
        self.steps_per_call = steps_per_call if self._whole is not None else 1

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
        # stack position → client still training, or None for a spare position: a compiled stack keeps its size
        # (k, then powers of two) while clients finish, so that its graphs are few and need no gather
        slots: list[int | None] = list(range(k))
        loss_sums = torch.zeros(k, dtype=torch.float32, device=start.device)
        finals: list[torch.Tensor | None] = [start[i].float() if not batches[i] else None for i in range(k)]
        full_size = max((len(batch[1]) for client in batches for batch in client), default=0)
        j, num_steps = 0, max((len(b) for b in batches), default=0)
        while j < num_steps:
            active = [i for i in slots if i is not None and j < len(batches[i])]
            # too few left for a vectorised step to pay (a compiled one pays even for one client)
            if len(active) <= (0 if self._compiled else self.sequential_below):
                for i in active:
                    loss_sum, _ = self._steps_alone(stacked, optimizer, slots.index(i), batches[i][j:], make_optimizer)
                    finals[i] = torch.cat([param.detach().reshape(-1).float() for param in self._params])
                    loss_sums[i] += loss_sum
                break
            size = self._stack_size(len(active), k)
            if size < len(slots):
                keep = [slots.index(i) for i in active]
                keep += keep[:1] * (size - len(keep))  # spare positions: copies, trained on copies, never read
                stacked, optimizer = compact(stacked, optimizer, keep, make_optimizer)
                slots = active + [None] * (size - len(active))
            slots = [i if i is not None and j < len(batches[i]) else None for i in slots]
            calls = self._steps_in_call(slots, batches, j, full_size, optimizer)
            if calls > 1:  # several steps of full batches, every client of the stack training through all of them
                positions = [q for q, i in enumerate(slots) if i is not None]
                xs, ys = zip(*(self._whole_stack(positions, [None if i is None else batches[i][t] for i in slots],
                                                  len(slots)) for t in range(j, j + calls)), strict=True)  # fmt: skip
                with self.precision.forward_context():
                    group_losses = self._whole.several(stacked, optimizer, torch.stack(xs), torch.stack(ys))
                loss_sums[torch.tensor([slots[q] for q in positions], device=start.device)] += (
                    group_losses.detach().float()[positions]
                )
                j += calls
                self._take_finals(stacked, slots, batches, j - 1, finals)
                continue
            by_size: dict[int, list[int]] = {}  # clients whose batches have one size are vectorised together
            for position, i in enumerate(slots):
                if i is not None:
                    by_size.setdefault(len(batches[i][j][1]), []).append(position)
            vectorised, plain = [], []
            for batch_size, positions in by_size.items():
                compiled = self._compiled is not None and batch_size == full_size
                if len(positions) > self.sequential_below or j == 0 or compiled:
                    vectorised.append(positions)
                else:
                    plain += positions
            stepped = {}  # position → its parameters and optimizer state after a plain step
            for position in plain:
                i = slots[position]
                loss_sum, alone = self._steps_alone(stacked, optimizer, position, [batches[i][j]], make_optimizer)
                params = [param.detach().clone() for param in self._params]
                stepped[position] = (params, [alone.state[param] for param in self._params])
                loss_sums[i] += loss_sum
            if vectorised:
                step_batches = [None if i is None else batches[i][j] for i in slots]
                group = vectorised[0]
                if self._whole is not None and len(vectorised) == 1 and self._full(group, step_batches, full_size):
                    x, y = self._whole_stack(group, step_batches, len(slots))
                    with self.precision.forward_context():
                        group_losses = self._whole(stacked, optimizer, x, y)
                    losses = [(group, group_losses.detach().float()[group])]
                else:
                    grads, losses = self._vectorised_grads(stacked, vectorised, step_batches, full_size)
                    for p, grad in zip(stacked, grads, strict=True):
                        p.grad = grad
                    optimizer.step()
                for positions, group_losses in losses:
                    loss_sums[torch.tensor([slots[q] for q in positions], device=start.device)] += group_losses
            restore(stacked, optimizer, stepped)
            self._take_finals(stacked, slots, batches, j, finals)
            j += 1
        return [(loss_sums[i], len(batches[i]), finals[i]) for i in range(k)]

    @staticmethod
    def _take_finals(stacked: list[torch.Tensor], slots: list, batches: Sequence, j: int, finals: list) -> None:
        """The final state of each client whose last step was step ``j``."""
        for position, i in enumerate(slots):
            if i is not None and j == len(batches[i]) - 1:
                finals[i] = torch.cat([p.detach()[position].reshape(-1).float() for p in stacked])

    def _steps_in_call(
        self, slots: list, batches: Sequence, j: int, full_size: int, optimizer: torch.optim.Optimizer
    ) -> int:
        """How many steps from step ``j`` on run in one compiled call: up to ``steps_per_call``, while every client
        of the stack has full batches and none finishes before the last of them; ``steps_per_call`` or the largest
        power of two that fits, so that the graphs stay few. 1 for a step that runs alone."""
        if self.steps_per_call < 2 or not self._whole.takes_several(optimizer):
            return 1
        run = self.steps_per_call
        for i in slots:
            if i is None:
                continue
            client, length = batches[i], 0
            while length < run and j + length < len(client) and len(client[j + length][1]) == full_size:
                length += 1
            run = length
            if run < 2:
                return 1
        return run if run == self.steps_per_call else 1 << (run.bit_length() - 1)

    def _stack_size(self, active: int, k: int) -> int:
        """Positions of the stack for ``active`` clients still training out of ``k``: exactly ``active`` when
        uncompiled; compiled, ``k`` or the smallest power of two below it that holds them."""
        if self._compiled is None:
            return active
        size = k
        while size > 1:
            lower = 1 << ((size - 1).bit_length() - 1)  # the largest power of two below size
            if lower < active:
                break
            size = lower
        return size

    def _full(self, positions: list[int], step_batches: list, full_size: int) -> bool:
        """Whether the group at ``positions`` runs compiled over the whole stack: its batches are full."""
        return self._compiled is not None and len(step_batches[positions[0]][1]) == full_size

    def _whole_stack(
        self, positions: list[int], step_batches: list, stack_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs ``[stack, batch, …]`` of a compiled group: its members' batches at their positions, a copy of
        its first batch at every other position (their results are thrown away)."""
        members, first = set(positions), step_batches[positions[0]]
        chosen = [step_batches[q] if q in members else first for q in range(stack_size)]
        return self.precision.convert_input((torch.stack([b[0] for b in chosen]), torch.stack([b[1] for b in chosen])))

    def _vectorised_grads(
        self,
        stacked: list[torch.Tensor],
        groups: list[list[int]],
        step_batches: list[tuple[torch.Tensor, torch.Tensor] | None],
        full_size: int,
    ) -> tuple[list[torch.Tensor], list[tuple[list[int], torch.Tensor]]]:
        """Gradients ``[K, *shape]`` of every stacked entry at ``groups``' positions (anything elsewhere), and
        each group's positions with their task losses.

        Compiled, the group of full batches runs over the whole stack: positions outside it (spare ones, and
        those of other groups, whose gradients are overwritten) train on a copy of its first batch. Other
        groups are gathered, run uncompiled and scattered back."""
        names = self._names
        stack_size = len(stacked[0])
        grads: list[torch.Tensor] | None = None
        losses = []
        for positions in groups:
            if self._full(positions, step_batches, full_size):
                x, y = self._whole_stack(positions, step_batches, stack_size)
                params = {n: p.detach() for n, p in zip(names, stacked, strict=True)}
                with self.precision.forward_context():
                    group_grads, group_losses = self._compiled(params, x, y)
                whole = [group_grads[n].to(p.dtype) for n, p in zip(names, stacked, strict=True)]
                if grads is None:
                    grads = whole
                else:
                    index = torch.tensor(positions, device=stacked[0].device)
                    for grad, values in zip(grads, whole, strict=True):
                        grad[index] = values[index]
                losses.append((positions, group_losses.detach().float()[positions]))
                continue
            everyone = len(positions) == stack_size
            index = torch.tensor(positions, device=stacked[0].device)
            params = {n: p.detach() if everyone else p.detach()[index] for n, p in zip(names, stacked, strict=True)}
            x, y = self.precision.convert_input(
                (
                    torch.stack([step_batches[q][0] for q in positions]),
                    torch.stack([step_batches[q][1] for q in positions]),
                )
            )
            with self.precision.forward_context():
                group_grads, group_losses = self._grads(params, x, y)
            if everyone:
                grads = [group_grads[n].to(p.dtype) for n, p in zip(names, stacked, strict=True)]
            else:
                if grads is None:
                    grads = [torch.zeros_like(p) for p in stacked]
                for grad, name in zip(grads, names, strict=True):
                    grad[index] = group_grads[name].to(grad.dtype)
            losses.append((positions, group_losses.detach().float()))
        return grads, losses

    def _steps_alone(
        self,
        stacked: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        position: int,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    ) -> tuple[torch.Tensor, torch.optim.Optimizer]:
        """``batches`` of the client at stack ``position`` on the resident module, loaded with its slice of the
        parameters and optimizer state. Returns the sum of its task losses and its optimizer."""
        params = self._params
        with torch.no_grad():
            for param, values in zip(params, stacked, strict=True):
                param.copy_(values[position])
        alone = make_optimizer(params)
        for param, values in zip(params, stacked, strict=True):  # its slice of the optimizer state, copied
            alone.state[param] = {
                key: (value[position] if value.dim() > 0 else value).clone() if torch.is_tensor(value) else value
                for key, value in optimizer.state.get(values, {}).items()
            }
        loss_sum = torch.zeros((), dtype=torch.float32, device=stacked[0].device)
        for batch in batches:
            x, y = self.precision.convert_input((batch[0], batch[1]))
            with self.precision.forward_context():
                loss = self.step(x, y)
            alone.zero_grad(set_to_none=True)
            loss.backward()
            alone.step()
            loss_sum += loss.detach().float()
        return loss_sum, alone
