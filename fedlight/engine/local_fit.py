"""One client's local fit on the resident module, the loop every client and warm-up trains with.

A fit loads the client's starting state (W^t, its cluster's member, or what the rule makes of them), builds a
fresh optimizer, seeds the client's own stream and runs its batches: ``F`` epochs (``F'`` for a tolerated
straggler) or exactly ``local_steps`` full batches. The rule's hooks run around it and inside the loss; the
trainer's precision applies inside every step while the global model stays fp32.

With ``--trainer.compile_steps``, a client's whole step (the client's ``training_step``, the rule's
``training_loss``, the backward pass and the SGD, Adam or AdamW update) runs as one function compiled by
``torch.compile`` (:mod:`fedlight.engine.whole_step`), once per run and reused by every client, since they all
train the same resident module. A fit whose optimizer the whole step does not compute (another optimizer, several,
a scheduler) compiles only the forward pass and loss; its backward pass runs through the compiled graph's own
backward and the optimizer stays eager. The console says once which one runs, and why.
``--trainer.compile_steps=auto`` times the run's first fit eagerly and compiles the rest only when that pays
(:func:`~fedlight.engine.whole_step.auto_choice`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch

from fedlight.clients.base import LocalFit, ManualSteps
from fedlight.engine.streams import RandomStreams, seed_torch
from fedlight.engine.whole_step import WholeStep, allow_recompiles, auto_choice, compile_cost, whole_step_blocker
from fedlight.errors import ConfigError, error_line
from fedlight.plans import ClientPlan, ClientUpdate

if TYPE_CHECKING:
    from lightning.fabric import Fabric

    from fedlight.clients.base import FederatedClient
    from fedlight.context import RunContext
    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.engine.config import CompileMode, RoundSettings
    from fedlight.engine.model import GlobalModel
    from fedlight.strategies.base import Strategy

LossFn = Callable[[Any, Any, dict[str, torch.Tensor]], torch.Tensor]


class LocalTraining:
    """Local fits of the clients a process hosts, on its resident module.

    Args:
        model: the resident module and the global model.
        datamodule: the clients' data.
        strategy: the rule whose hooks run around and inside the fit.
        context: what the rule's hooks receive.
        fabric: precision, backward pass and device.
        streams: the run's random streams.
        settings: rounds T, local epochs or ``local_steps``.
        compile_steps: compile the rounds' steps (``torch.compile``'s mode, or ``True`` for its default): the whole
            step where the fit's optimizer allows (:mod:`fedlight.engine.whole_step`), else the forward pass and
            loss; ``False`` runs them eagerly.
        steps_per_call: with the whole step, consecutive steps of equal-shape batches run in one compiled call.
    """

    def __init__(
        self,
        model: GlobalModel,
        datamodule: FederatedDataModule,
        strategy: Strategy,
        context: RunContext,
        fabric: Fabric,
        streams: RandomStreams,
        settings: RoundSettings,
        compile_steps: CompileMode = False,
        steps_per_call: int = 1,
    ) -> None:
        self.model, self.datamodule, self.strategy, self.context = model, datamodule, strategy, context
        self.fabric, self.streams, self.settings = fabric, streams, settings
        self.precision = fabric.strategy.precision
        self.compile_steps, self.steps_per_call = compile_steps, steps_per_call
        #: prints one line on the run's console (which compiled step runs, and why); the run's console sets it
        self.say: Callable[[str], None] = lambda line: None
        self._compiled: Callable | None = None  # the rounds' compiled forward and loss, built on first use
        self._whole: WholeStep | None = None  # the rounds' compiled whole step, built on first use
        self._whole_refused: str | None = None  # why this run's fits cannot take the whole step, once one could not
        #: ``compile_steps=auto``'s choice once the first fit is timed (None before, or without auto)
        self.auto_compiles: bool | None = None

    def fit(self, round_idx: int, plan: ClientPlan, start: torch.Tensor) -> tuple[ClientUpdate, torch.Tensor]:
        """Client ``plan.client``'s fit in round ``round_idx`` from the bank member ``start``; returns its update
        and flat state."""
        module, strategy, context = self.model.module, self.strategy, self.context
        seed = self.streams.client_seed(round_idx, plan.client)
        seed_torch(seed, self.fabric.device)  # dropout and any other draw inside the step
        generator = torch.Generator().manual_seed(seed)  # batch order

        store = self.model.client_states
        start = strategy.initial_state(context, plan, start)
        if store is not None:  # the client's own slots, over the state it receives
            store.current = own = store.values(plan.client, start)
            start = store.load_into(own, start)
        self.model.load(start)
        self.model.train_mode()
        num_steps = self.settings.local_steps or plan.epochs * self.datamodule.num_batches(plan.client)
        module.local_fit = self.local_fit(round_idx, num_steps)
        optimizers, schedulers = optimizers_and_schedulers(module.configure_optimizers())
        module.teachers = dict(strategy.client_teachers(context, plan))
        try:
            strategy.on_client_fit_start(context, module, plan)
            batches = self.batches(plan, generator)
            deciding = self.compile_steps == "auto" and self.auto_compiles is None
            started = time.perf_counter()
            loss_sum, steps = self.train_steps(
                module, optimizers, schedulers, batches, strategy.training_loss, compiled=self._compiles()
            )
            if deciding:
                self._decide(round_idx, time.perf_counter() - started, steps, module, optimizers, schedulers)
            update = self.update(plan, loss_sum, steps)
            strategy.on_client_fit_end(context, module, update)
        finally:
            module.teachers = {}
            if store is not None:
                store.current = None
        state = self.model.layout.flatten(module)
        update.finite = math.isfinite(update.train_loss) and all_finite(state)
        if store is not None:  # kept once the round commits it (a client left out of the aggregate keeps its old)
            store.take_back(own, state)
            store.put(plan.client, round_idx + 1, own)
        return update, state

    def local_fit(self, round_idx: int, num_steps: int) -> LocalFit:
        """Where a fit of ``num_steps`` steps in round ``round_idx`` sits in the run, for run-long schedules."""
        return LocalFit(round_idx=round_idx, rounds=self.settings.rounds, num_steps=num_steps)

    def update(self, plan: ClientPlan, loss_sum: torch.Tensor, steps: int) -> ClientUpdate:
        """What a client sends back besides its state, from its task-loss sum over ``steps`` steps."""
        return ClientUpdate(
            client=plan.client,
            num_samples=int(self.datamodule.num_samples[plan.client]),
            epochs=plan.epochs,
            num_steps=steps,
            train_loss=loss_sum.item() / max(steps, 1),
        )

    def train_steps(
        self,
        module: FederatedClient,
        optimizers: list,
        schedulers: list,
        batches: Iterable[Any],
        loss_fn: LossFn,
        compiled: bool = False,
    ) -> tuple[torch.Tensor, int]:
        """The local training loop: every optimizer steps once per batch. Returns the task-loss sum and steps.

        ``compiled``: the forward pass and loss run through :meth:`compiled_step` (the rounds' ``loss_fn`` only).
        """
        precision = self.precision
        if not module.automatic_optimization:
            return self.manual_train_steps(module, optimizers, schedulers, batches, loss_fn)
        if compiled and (whole := self.whole_step(module, loss_fn, optimizers, schedulers)) is not None:
            batches = iter(batches)
            first = next(batches, None)
            if first is None:
                return torch.zeros((), device=self.fabric.device), 0
            try:
                return whole.run(optimizers[0], chain([first], batches))
            except Exception as err:
                if whole.steps_run:  # it compiled and trained: a later failure is the step's own
                    raise
                # a loss no gradient transform can run (one that asks for a tensor's memory address, say) trains
                # with the forward pass and loss compiled instead, from the same first batch
                self._refuse_whole_step(f"compiling it failed ({error_line(err)})")
                batches = chain([first], batches)
        forward = (
            self.compiled_step(module, loss_fn) if compiled else partial(forward_and_loss, precision, module, loss_fn)
        )
        loss_sum = torch.zeros((), device=self.fabric.device)
        steps = 0
        for batch in batches:
            batch = precision.convert_input(batch)
            loss, task_loss = forward(batch, steps)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            self.fabric.strategy.backward(loss, module)
            for optimizer in optimizers:
                precision.optimizer_step(optimizer)
            for scheduler in schedulers:
                scheduler.step()  # Lightning's interval="step": once per optimizer step
            loss_sum += task_loss
            steps += 1
        return loss_sum, steps

    def manual_train_steps(
        self, module: FederatedClient, optimizers: list, schedulers: list, batches: Iterable[Any], loss_fn: LossFn
    ) -> tuple[torch.Tensor, int]:
        """The loop of a client that steps its own optimizers (``automatic_optimization = False``): its
        ``training_step`` runs its updates through ``module.manual_steps``; schedulers step once per batch.

        Such a step cannot take a rule's term in its loss (a proximal term, MOON's): a rule whose ``training_loss``
        adds one is refused at the first batch, rather than trained without it.
        """
        precision = self.precision
        strategy = type(self.strategy).__name__
        backward = partial(self.fabric.strategy.backward, module=module)
        module.manual_steps = ManualSteps(list(optimizers), backward, precision.optimizer_step)
        loss_sum = torch.zeros((), device=self.fabric.device)
        steps = 0
        try:
            for batch in batches:
                batch = precision.convert_input(batch)
                with precision.forward_context():
                    outputs = module.training_step(batch, steps)
                    if loss_fn(module, batch, outputs) is not outputs["loss"]:
                        raise ConfigError(
                            f"{strategy} adds a term to the training loss, which {type(module).__name__} cannot "
                            "apply: it runs its own optimizer steps. Choose a rule without a loss term (FedAvg)."
                        )
                for scheduler in schedulers:
                    scheduler.step()
                loss_sum += outputs["loss"].detach().float()
                steps += 1
        finally:
            module.manual_steps = None
        return loss_sum, steps

    def whole_step(
        self, module: FederatedClient, loss_fn: LossFn, optimizers: list, schedulers: list
    ) -> WholeStep | None:
        """The run's compiled whole step (forward, loss, backward and update) if this fit can take it, else ``None``.

        The first fit that cannot take it says why on the console, once per run.
        """
        if self._whole_refused is not None:
            return None
        blocker = whole_step_blocker(module, optimizers, schedulers, self.precision)
        if blocker is None and not self.strategy.loss_is_traceable():
            blocker = (
                f"{type(self.strategy).__name__}'s training_loss may use parameters it kept from before the step, "
                "which the whole step would not differentiate (see Strategy.loss_is_traceable)"
            )
        if blocker is not None:
            self._refuse_whole_step(blocker)
            return None
        if self._whole is None:
            self._whole = WholeStep(
                module, loss_fn, self.precision, mode=self._compile_mode(), steps_per_call=self.steps_per_call
            )
            update = type(optimizers[0]).__name__
            per_call = (
                f", {self.steps_per_call} steps of equal-shape batches per call" if self.steps_per_call > 1 else ""
            )
            self.say(
                "fedlight: --trainer.compile_steps: each client step (forward, loss, backward and "
                f"{update} update) runs as one compiled graph{per_call}. {compile_cost()}"
            )
        return self._whole

    def _refuse_whole_step(self, reason: str) -> None:
        self._whole_refused = reason
        self.say(
            "fedlight: --trainer.compile_steps: the forward pass and loss are compiled; the backward pass and the "
            f"optimizer stay eager, because {reason}. {compile_cost()}"
        )

    def _compile_mode(self) -> str | None:
        return None if self.compile_steps in (True, "auto") else self.compile_steps

    def _compiles(self) -> bool:
        """Whether this fit's steps run compiled (``auto``: once the first fit chose to)."""
        return bool(self.auto_compiles) if self.compile_steps == "auto" else bool(self.compile_steps)

    def _decide(
        self, round_idx: int, seconds: float, steps: int, module: FederatedClient, optimizers: list, schedulers: list
    ) -> None:
        """``compile_steps=auto``'s choice after the first fit (:func:`auto_choice`), said on the console."""
        per_process = math.ceil(self.settings.clients_per_round / self.fabric.world_size)
        fits_left = max((self.settings.rounds - round_idx) * per_process - 1, 0)
        blocker = whole_step_blocker(module, optimizers, schedulers, self.precision)
        if blocker is None and not self.strategy.loss_is_traceable():
            blocker = f"{type(self.strategy).__name__}'s training_loss may use parameters it kept (loss_is_traceable)"
        self.auto_compiles, sentence = auto_choice(seconds, steps, fits_left, blocker)
        self.say(f"fedlight: --trainer.compile_steps=auto: {sentence}.")

    def compiled_step(self, module: FederatedClient, loss_fn: LossFn) -> Callable:
        """The step's forward pass and loss compiled with ``torch.compile``, once per run.

        Every client trains the resident module with the rule's loss, so one compiled function serves them
        all; a batch of another size (an epoch's short last batch) compiles once more, with dynamic shapes.
        """
        if self._compiled is None:
            allow_recompiles()
            mode = self._compile_mode()
            precision = self.precision

            def step(batch: Any, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
                return forward_and_loss(precision, module, loss_fn, batch, batch_idx)

            self._compiled = torch.compile(step, mode=mode)
        return self._compiled

    def train_outside_rounds(
        self,
        module: FederatedClient,
        client: int,
        epochs: int,
        seed: int,
        full_batches: bool,
        loss_fn: LossFn | None = None,
    ) -> int:
        """A client's local training outside the rounds' own fit (see :meth:`RunContext.local_train`), with the task
        loss or ``loss_fn(module, batch, outputs)``; returns its steps."""
        seed_torch(seed, self.fabric.device)
        generator = torch.Generator().manual_seed(seed)
        self.model.train_mode(module)
        data = self.datamodule
        full = min(data.batch_size, int(data.num_samples[client]))

        def batches():
            for _ in range(epochs):
                for batch in data.train_batches(client, generator):
                    if not full_batches or len(batch[1]) == full:
                        yield batch

        optimizers, schedulers = optimizers_and_schedulers(module.configure_optimizers())
        loss_fn = loss_fn or (lambda m, b, out: out["loss"])
        _, steps = self.train_steps(module, optimizers, schedulers, batches(), loss_fn)
        return steps

    def batches(self, plan: ClientPlan, generator: torch.Generator) -> Iterator[Any]:
        """A client's batches of one round: ``plan.epochs`` epochs, or ``local_steps`` full batches, each passed
        through the strategy's ``transform_batch``.

        With ``local_steps``, an epoch's short last batch is skipped, as FedAU's sampler does (a batch of
        one image would also break BatchNorm), unless it is all the client has.
        """
        strategy, context, client, data = self.strategy, self.context, plan.client, self.datamodule
        local_steps = self.settings.local_steps
        if local_steps is None:
            for _ in range(plan.epochs):
                for batch in data.train_batches(client, generator):
                    yield strategy.transform_batch(context, client, batch)
            return
        batch_size = min(data.batch_size, int(data.num_samples[client]))
        steps = 0
        while True:
            for batch in data.train_batches(client, generator):
                if len(batch[1]) < batch_size:
                    continue
                yield strategy.transform_batch(context, client, batch)
                steps += 1
                if steps == local_steps:
                    return


def forward_and_loss(
    precision: Any, module: FederatedClient, loss_fn: LossFn, batch: Any, batch_idx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's forward pass under the trainer's precision: the loss to minimise (the rule's ``loss_fn`` of
    the client's ``training_step`` outputs) and the task loss alone, detached, in fp32."""
    with precision.forward_context():
        outputs = module.training_step(batch, batch_idx)
        loss = loss_fn(module, batch, outputs)
    return loss, outputs["loss"].detach().float()


def all_finite(flat: torch.Tensor) -> bool:
    """Whether a state has no NaN/Inf: its sum in fp64 cannot overflow, so it is finite exactly when all entries are.

    One reduction, several times cheaper than ``torch.isfinite(flat).all()`` on the CPU.
    """
    return math.isfinite(flat.sum(dtype=torch.float64).item())


def optimizers_and_schedulers(configured: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """The optimizers and per-step schedulers of ``configure_optimizers``'s return, in Lightning's formats.

    An optimizer; ``{"optimizer": ..., "lr_scheduler": scheduler}`` where the scheduler may be wrapped as
    ``{"scheduler": ..., "interval": "step"}``; a list or tuple of either (several optimizers, e.g. a head,
    centroids and a probe each with its own Adam); or ``([optimizers], [schedulers])``. Every optimizer
    steps once per batch. A local fit has no epochs of its own to count, so only per-step schedules are
    accepted.

    >>> sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> optimizers, schedulers = optimizers_and_schedulers([sgd, {"optimizer": sgd}])
    >>> len(optimizers), schedulers
    (2, [])
    """
    if isinstance(configured, torch.optim.Optimizer):
        return [configured], []
    if isinstance(configured, dict):
        scheduler = configured.get("lr_scheduler")
        if isinstance(scheduler, dict):
            if scheduler.get("interval", "step") != "step":
                raise ConfigError(
                    f"configure_optimizers returned a scheduler with interval={scheduler['interval']!r}; federated "
                    "local fits step schedulers once per optimizer step: use interval='step'."
                )
            scheduler = scheduler["scheduler"]
        return [configured["optimizer"]], [] if scheduler is None else [scheduler]
    if (
        isinstance(configured, tuple)
        and len(configured) == 2
        and all(isinstance(part, list | tuple) for part in configured)
        and all(isinstance(o, torch.optim.Optimizer) for o in configured[0])
    ):  # Lightning's ([optimizers], [schedulers])
        schedulers = [s["scheduler"] if isinstance(s, dict) else s for s in configured[1]]
        return list(configured[0]), schedulers
    if isinstance(configured, list | tuple) and configured:
        optimizers, schedulers = [], []
        for item in configured:
            item_optimizers, item_schedulers = optimizers_and_schedulers(item)
            optimizers += item_optimizers
            schedulers += item_schedulers
        return optimizers, schedulers
    raise ConfigError(
        f"configure_optimizers returned {type(configured).__name__}; expected an optimizer, a dict with "
        "'optimizer' (and 'lr_scheduler'), or a list of them."
    )
