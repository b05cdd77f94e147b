"""The trainer's settings, grouped by the piece of the engine that reads them, each checking its own values.

``FederatedTrainer``'s signature stays flat (one documented argument per ``--trainer.*`` flag); these typed
groups are what it builds from them, so that every piece receives only its own settings and every bad value
is reported, together with the others, before anything is built.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fedlight.context import due

if TYPE_CHECKING:
    from lightning.fabric.loggers import Logger

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true"]
LoggerName = Literal["csv", "wandb"]
StartMethod = Literal["popen", "fork"]
WandbMode = Literal["offline", "online", "disabled"]
#: ``torch.compile`` of the sequential client step: off, or on with one of its modes (``true`` is ``default``)
CompileMode = bool | Literal["auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclass(frozen=True, kw_only=True)
class RoundSettings:
    """What one round does and how often the loop evaluates and checkpoints."""

    rounds: int
    clients_per_round: int
    local_epochs: int
    local_steps: int | None
    straggler_fraction: float
    eval_every: int
    checkpoint_every: int

    def problems(self) -> list[str]:
        problems = [
            f"Expected --trainer.{flag} ≥ 1, got {value}."
            for flag, value in [
                ("rounds", self.rounds),
                ("clients_per_round", self.clients_per_round),
                ("local_epochs", self.local_epochs),
                ("eval_every", self.eval_every),
                ("checkpoint_every", self.checkpoint_every),
            ]
            if value < 1
        ]
        if self.local_steps is not None and self.local_steps < 1:
            problems.append(f"Expected --trainer.local_steps ≥ 1 (or null for epochs), got {self.local_steps}.")
        if self.local_steps is not None and self.straggler_fraction > 0:
            problems.append(
                f"--trainer.local_steps={self.local_steps} gives every client the same workload, so it cannot be "
                f"combined with --trainer.straggler_fraction={self.straggler_fraction}; set one of them to its "
                "default."
            )
        if not 0.0 <= self.straggler_fraction <= 1.0:
            problems.append(
                f"Expected --trainer.straggler_fraction (δ) in [0, 1], got {self.straggler_fraction}. "
                "It is a share of each round's clients: 0.5 means half of them are stragglers."
            )
        return problems

    def evaluates_after(self, round_idx: int) -> bool:
        """Whether round ``round_idx`` (from 0) ends with an evaluation: every ``eval_every`` rounds and the last."""
        return due(round_idx, self.eval_every, self.rounds)


@dataclass(frozen=True, kw_only=True)
class EvaluationSettings:
    """How many clients' held-out splits an evaluation scores, and how often it scores all of them."""

    eval_clients: int | float | Literal["all"] = "all"
    full_eval_every: int = 0

    def problems(self) -> list[str]:
        problems = []
        count = self.eval_clients
        if isinstance(count, bool) or (count != "all" and not isinstance(count, (int, float))):
            problems.append(f"Expected --trainer.eval_clients to be an integer, a fraction or 'all', got {count!r}.")
        elif isinstance(count, int) and count < 1:
            problems.append(f"Expected --trainer.eval_clients ≥ 1 clients (a fraction in (0, 1], 'all'), got {count}.")
        elif isinstance(count, float) and not 0.0 < count <= 1.0:
            problems.append(
                f"Expected --trainer.eval_clients as a fraction in (0, 1] of the clients, got {count}; write a whole "
                "number (e.g. 100) for a count of clients, or 'all'."
            )
        if self.full_eval_every < 0:
            problems.append(
                f"Expected --trainer.full_eval_every ≥ 0 (0: every client only after the last round), got "
                f"{self.full_eval_every}."
            )
        return problems

    def sampled(self, round_idx: int, rounds: int) -> bool:
        """Whether the evaluation after round ``round_idx`` (from 0) scores a sample of the clients rather than
        all of them: never with ``eval_clients='all'``, nor after every ``full_eval_every``-th round and the last."""
        return self.eval_clients != "all" and not due(round_idx, self.full_eval_every, rounds)

    def count(self, num_clients: int) -> int:
        """How many of ``num_clients`` clients a sampled evaluation scores (a fraction rounds up)."""
        if self.eval_clients == "all":
            return num_clients
        if isinstance(self.eval_clients, float):
            return min(num_clients, max(1, math.ceil(self.eval_clients * num_clients)))
        return min(num_clients, self.eval_clients)


@dataclass(frozen=True, kw_only=True)
class ProcessSettings:
    """Where and how the rounds compute: devices, processes, precision, threads."""

    accelerator: str
    devices: int
    num_nodes: int
    start_method: StartMethod
    precision: Precision
    threads: int | Literal["auto"]
    channels_last: bool
    rendezvous_timeout: float

    def problems(self) -> list[str]:
        problems = [
            f"Expected --trainer.{flag} ≥ 1, got {value}."
            for flag, value in [("devices", self.devices), ("num_nodes", self.num_nodes)]
            if value < 1
        ]
        if self.start_method == "fork" and self.num_nodes > 1:
            problems.append(
                "--trainer.start_method=fork starts the processes of one machine; with "
                f"--trainer.num_nodes={self.num_nodes}, torchrun or SLURM starts them. Use "
                "--trainer.start_method=popen."
            )
        if self.threads != "auto" and self.threads < 1:
            problems.append(f"Expected --trainer.threads ≥ 1 or 'auto', got {self.threads}.")
        if not self.rendezvous_timeout > 0:
            problems.append(f"Expected --trainer.rendezvous_timeout > 0 seconds, got {self.rendezvous_timeout}.")
        return problems + accelerator_problems(self.accelerator)


#: What ``--trainer.accelerator`` may name (Lightning's names); ``gpu`` is CUDA or Apple's MPS, whichever is there.
ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps", "tpu")


def accelerator_problems(accelerator: str) -> list[str]:
    """An accelerator that Lightning does not know, or that this machine does not have, named with the fix;
    Fabric would otherwise stop with its own traceback."""
    if not isinstance(accelerator, str):  # an Accelerator instance from Python: Fabric checks it
        return []
    if accelerator not in ACCELERATORS:
        return [f"Expected --trainer.accelerator to be one of {', '.join(ACCELERATORS)}, got {accelerator!r}."]
    import torch

    mps = torch.backends.mps.is_available()
    cuda = torch.cuda.is_available()
    if accelerator in ("cuda", "gpu") and not cuda and not (accelerator == "gpu" and mps):
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return [
            f"--trainer.accelerator={accelerator}, but this machine has no usable CUDA GPU (torch {torch.__version__}, "
            f"{built}, sees none). Use --trainer.accelerator=auto (a GPU when one is visible, else the CPU) or cpu."
        ]
    if accelerator == "mps" and not mps:
        return ["--trainer.accelerator=mps, but Apple's MPS is not available here. Use auto or cpu."]
    if accelerator == "tpu":
        from lightning.fabric.accelerators import XLAAccelerator

        if not XLAAccelerator.is_available():
            return [
                "--trainer.accelerator=tpu, but no TPU is reachable here (it needs torch_xla on a TPU machine). Use "
                "auto or cpu."
            ]
    return []


@dataclass(frozen=True, kw_only=True)
class BatchingSettings:
    """How client steps run: vectorised (how many to stack, compiled or not) and compiled one client at a time."""

    client_batching: int | Literal["auto"] | None
    compile_batched: bool
    compile_steps: CompileMode = False
    steps_per_call: int = 1

    def problems(self) -> list[str]:
        problems = []
        if self.steps_per_call < 1:
            problems.append(f"Expected --trainer.steps_per_call ≥ 1, got {self.steps_per_call}.")
        elif self.steps_per_call > 1 and not (self.compile_steps or self.compile_batched):
            problems.append(
                f"--trainer.steps_per_call={self.steps_per_call} runs that many compiled steps per call, which needs "
                "--trainer.compile_steps=true (or a mode) or --trainer.compile_batched=true; set one, or drop "
                "steps_per_call."
            )
        if isinstance(self.client_batching, int) and self.client_batching < 1:
            problems.append(f"Expected --trainer.client_batching ≥ 1, 'auto' or null, got {self.client_batching}.")
        if self.compile_batched and self.client_batching is None:
            problems.append(
                "--trainer.compile_batched=true compiles the vectorised step, which only runs with "
                "--trainer.client_batching=K or auto; set that too, or drop compile_batched."
            )
        return problems


@dataclass(frozen=True, kw_only=True)
class GuardSettings:
    """What the engine does with clients that fail or diverge."""

    max_update_ratio: float | None
    fail_fast: bool

    def problems(self) -> list[str]:
        if self.max_update_ratio is not None and not self.max_update_ratio > 0:
            ratio = self.max_update_ratio
            return [f"Expected --trainer.max_update_ratio > 0 (or null to accept any update), got {ratio}."]
        return []


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """The memory a process may give to the clients' states: gathered for a round, and kept between rounds."""

    #: MiB one gathered block of the round's ``[K, P]`` states may take
    gather_budget_mb: float
    #: MiB of the clients' own states (per-client slots) kept in memory
    client_state_budget_mb: float = 1024.0
    #: keep every client state file the run writes, not only those its last two checkpoints name
    keep_client_states: bool = False

    @property
    def gather_budget_bytes(self) -> int:
        return int(self.gather_budget_mb * 2**20)

    @property
    def client_state_budget_bytes(self) -> int:
        return int(self.client_state_budget_mb * 2**20)

    def problems(self) -> list[str]:
        problems = []
        if not self.client_state_budget_mb >= 0:
            problems.append(
                f"Expected --trainer.client_state_budget_mb ≥ 0 (MiB of the clients' own states kept in memory), got "
                f"{self.client_state_budget_mb}; 0 reads every state from its file in the run folder."
            )
        elif self.client_state_budget_bytes > _physical_memory():
            problems.append(
                f"--trainer.client_state_budget_mb={self.client_state_budget_mb:g} is more than this machine's memory "
                f"({_physical_memory() / 2**20:.0f} MiB): the states could not be kept. Give at most what the run "
                "can spare; states beyond the budget are read from their files."
            )
        if not self.gather_budget_mb > 0:
            problems.append(
                f"Expected --trainer.gather_budget_mb > 0 (MiB of gathered client states per block), got "
                f"{self.gather_budget_mb}; the default 1024 holds 10 states of 26 M parameters in one block."
            )
        return problems


@dataclass(frozen=True, kw_only=True)
class LoggingSettings:
    """Where a run writes, what it tells W&B, and the other loggers (Lightning ``Logger`` instances)."""

    default_root_dir: Path
    name: str
    loggers: tuple[LoggerName | Logger, ...]
    wandb_project: str | None
    wandb_entity: str | None
    wandb_mode: WandbMode | None
    wandb_group: str | None
    wandb_tags: list[str] | None
    wandb_notes: str | None
    enable_progress_bar: bool


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """Every group of settings of one trainer, as :func:`fedlight.engine.setup.trainer_settings` builds them."""

    loop: RoundSettings
    processes: ProcessSettings
    evaluation: EvaluationSettings
    batching: BatchingSettings
    guards: GuardSettings
    memory: MemorySettings
    logging: LoggingSettings

    def problems(self) -> list[str]:
        """Every bad value of every group, in the order of the groups."""
        groups = (self.loop, self.evaluation, self.processes, self.batching, self.memory, self.guards)
        return [problem for group in groups for problem in group.problems()]


def _physical_memory() -> float:
    """Bytes of physical memory (infinite where the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return float("inf")
