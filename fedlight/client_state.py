"""Per-client state: tensors that belong to one client and live across the rounds it is sampled in.

Some rules keep something of every client between its rounds: SCAFFOLD's control variate c_k, FedDyn's
gradient correction, FedBN's BatchNorm entries, FedPer's and FedRep's head, Ditto's personal model. A rule
declares them as named :class:`Slot` s (``Strategy.client_state_slots``) and the engine keeps a
:class:`ClientStateStore` of every client that has trained:

- a **local** slot (:meth:`Slot.local`) holds the client's own values of some entries of the federated state.
  They are written into the state the client starts from before its fit, so the resident module trains them,
  and taken back from its trained state after;
- a **vector** slot (:meth:`Slot.vector`) holds values the rule reads and replaces itself during the fit, as
  ``context.client_state[name]`` (a control variate, a personal model).

A client that has never trained starts from its slots' ``init``: the values of the state it receives, or zeros.

**Storage.** Each client's state after a round is written to a file of its own in the run folder,
``client_state/<client>-<version>.pt`` (``version``: the number of rounds done once it was trained), and never
rewritten. Memory keeps the most recently used states up to ``budget_bytes``, the least recently used
dropped first, so a run of thousands of clients with model-sized states holds a bounded amount. They are rows of
one buffer of ``budget_bytes``, reused as states come and go (its pages become resident as rows are first
written): states allocated and freed one by one would let the allocator's free lists grow the process's
resident memory to several times the budget. An index
``{client: version}``, the same on every process, names each client's current file; it is all a checkpoint
holds of the store, with each named file's size and digest, so a resumed run reads the very states its checkpoint
names: a file that is missing, truncated, changed or copied in from another run is refused, naming it, and never
trained on. Files that neither the index nor the last two checkpoints name are deleted when a checkpoint is
written.

**Processes.** Every process reads and writes the same folder, so a client's state goes with the client to
whichever process trains it in a round; every process updates its index from the round's gathered updates.
The run folder must therefore be on a file system every process sees (as resuming needs already).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from fedlight.errors import ConfigError

_FILE = re.compile(r"(\d+)-(\d+)\.pt")


@dataclass(frozen=True)
class Slot:
    """One named per-client tensor, ``[numel]`` fp32.

    Attributes:
        numel: how many values it holds.
        entries: ``[P]`` bool, the entries of the federated state a local slot holds; ``None`` for a vector.
        init: what a client that has not trained yet starts from: ``received`` (the values of the state it
            receives: its entries for a local slot, the whole state for a vector of ``P`` values) or ``zeros``.
    """

    numel: int
    entries: torch.Tensor | None = None
    init: Literal["received", "zeros"] = "zeros"

    @classmethod
    def local(cls, entries: torch.Tensor) -> Slot:
        """The client's own values of the entries ``entries`` (``[P]`` bool) of the federated state."""
        return cls(int(entries.sum()), entries.detach().cpu().clone(), "received")

    @classmethod
    def vector(cls, numel: int, init: Literal["received", "zeros"] = "zeros") -> Slot:
        """``numel`` values the rule reads and replaces itself."""
        return cls(int(numel), None, init)

    @property
    def loaded(self) -> bool:
        """Whether the engine writes it into the client's starting state (a local slot)."""
        return self.entries is not None

    def initial(self, start: torch.Tensor) -> torch.Tensor:
        """Its values for a client that has not trained yet, which starts from ``start`` (``[P]``).

        >>> Slot.local(torch.tensor([True, False, True])).initial(torch.tensor([1.0, 2.0, 3.0])).tolist()
        [1.0, 3.0]
        >>> Slot.vector(2).initial(torch.ones(3)).tolist()
        [0.0, 0.0]
        """
        if self.init == "zeros":
            return torch.zeros(self.numel, device=start.device)
        if self.entries is None:
            assert self.numel == start.numel(), f"a received vector holds the state's {start.numel()} values"
            return start.detach().clone()
        return start[self.entries.to(start.device)].detach().clone()


class ClientStateStore:
    """Every trained client's slots: files in ``directory``, the most recently used in memory.

    Args:
        slots: the rule's slots, by name.
        directory: where the states are written (``<run_dir>/client_state``).
        budget_bytes: the most memory the states kept in memory may take; 0 keeps none.
        num_clients: the clients of the population: at most two states each (current, just written) are kept.
        keep_all: never delete a state file (by default those no checkpoint of the last two names are deleted).

    >>> import tempfile
    >>> store = ClientStateStore({"c": Slot.vector(2)}, Path(tempfile.mkdtemp()), budget_bytes=8, num_clients=3)
    >>> values = store.values(5, torch.zeros(4))  # client 5 has not trained: zeros
    >>> values["c"] += 1.0
    >>> store.put(5, 1, values)
    >>> store.commit([5], 1)
    >>> store.get(5)["c"].tolist(), store.index
    ([1.0, 1.0], {5: 1})
    """

    def __init__(
        self, slots: Mapping[str, Slot], directory: Path, budget_bytes: int, num_clients: int, keep_all: bool = False
    ) -> None:
        self.slots = dict(slots)
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        self.keep_all = keep_all
        #: the version (rounds done when it was written) of each trained client's current state
        self.index: dict[int, int] = {}
        #: the slots of the client in training, between the start and the end of its fit
        self.current: dict[str, torch.Tensor] | None = None
        self.cache_nbytes = 0  # bytes of the states kept in memory
        self.peak_cache_nbytes = 0
        self._offsets = {}  # each slot's place in a row of the buffer
        offset = 0
        for name, slot in self.slots.items():
            self._offsets[name] = (offset, slot.numel)
            offset += slot.numel
        # states the buffer holds: the budget's worth, but never more rows than the clients can fill (a current
        # state and the one a fit has just written, each)
        self._capacity = min(self.budget_bytes // max(4 * offset, 1), 2 * num_clients)
        self._buffer: torch.Tensor | None = None  # [capacity, Σ numel] fp32, made at the first state kept
        self._rows: OrderedDict[tuple[int, int], int] = OrderedDict()  # (client, version) → row, oldest first
        self._free: list[int] = []  # rows given back
        self._used = 0  # rows handed out so far (those above were never written: not resident)
        self._saved: list[dict[int, int]] = []  # the indices of the last two checkpoints
        #: (client, version) → (bytes, BLAKE2b digest) of the files this process wrote or a checkpoint recorded
        self._digests: dict[tuple[int, int], tuple[int, str]] = {}

    @property
    def client_nbytes(self) -> int:
        """Bytes of one client's state."""
        return 4 * sum(slot.numel for slot in self.slots.values())

    def get(self, client: int) -> dict[str, torch.Tensor] | None:
        """A copy of client ``client``'s current state (CPU), or ``None`` if it has not trained."""
        version = self.index.get(client)
        if version is None:
            return None
        key = (client, version)
        if key in self._rows:
            self._rows.move_to_end(key)
            row = self._buffer[self._rows[key]]
            return {name: row[offset : offset + numel].clone() for name, (offset, numel) in self._offsets.items()}
        values = torch.load(io.BytesIO(self._read(key)), map_location="cpu", weights_only=True)
        self._remember(key, values)
        return values

    def _read(self, key: tuple[int, int]) -> bytes:
        """A state file's bytes, checked against the size and digest recorded for it (where one was)."""
        path = self._path(*key)
        recorded = self._digests.get(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = None
        if data is not None and (recorded is None or recorded == _digest(data)):
            return data
        found = "is missing" if data is None else f"holds {len(data)} bytes that are not the ones the run wrote"
        expected = f" ({recorded[0]} bytes, digest {recorded[1][:12]}…)" if recorded is not None else ""
        raise ConfigError(
            f"The state of client {key[0]} after round {key[1]}, {path}, {found}{expected}: the run folder's "
            "client_state/ was changed after the run wrote it (a file deleted, truncated, damaged or copied in from "
            "another run).",
            "Restore that file from a copy of the run folder, or resume from the checkpoint that was written with "
            "it; a client is never trained from a state other than its own.",
        )

    def values(self, client: int, start: torch.Tensor) -> dict[str, torch.Tensor]:
        """A copy of client ``client``'s slots on ``start``'s device, for a fit that starts from ``start``."""
        stored = self.get(client)
        if stored is None:
            return {name: slot.initial(start) for name, slot in self.slots.items()}
        return {name: stored[name].to(start.device) for name in self.slots}

    def load_into(self, values: Mapping[str, torch.Tensor], start: torch.Tensor) -> torch.Tensor:
        """``start`` with the local slots' entries replaced by ``values`` (a new tensor if any)."""
        out = start
        for name, slot in self.slots.items():
            if slot.loaded:
                out = out.clone() if out is start else out
                out[slot.entries.to(out.device)] = values[name].to(out)
        return out

    def take_back(self, values: dict[str, torch.Tensor], state: torch.Tensor) -> None:
        """Replaces the local slots of ``values`` with their entries of the trained ``state``."""
        for name, slot in self.slots.items():
            if slot.loaded:
                values[name] = state[slot.entries.to(state.device)].detach().clone()

    def put(self, client: int, version: int, values: Mapping[str, torch.Tensor]) -> None:
        """Writes client ``client``'s state after ``version`` rounds; it becomes current once committed."""
        for name, slot in self.slots.items():
            assert values[name].numel() == slot.numel, (
                f"slot {name} holds {slot.numel} values, got {values[name].numel()}"
            )
        cpu = {name: values[name].detach().to("cpu", torch.float32).reshape(-1) for name in self.slots}
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(client, version)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        buffer = io.BytesIO()
        torch.save(cpu, buffer)
        tmp.write_bytes(buffer.getbuffer())
        os.replace(tmp, path)  # whole or absent, whatever stops the run
        self._digests[client, version] = _digest(buffer.getbuffer())
        self._remember((client, version), cpu)

    def commit(self, clients: Iterable[int], version: int) -> None:
        """Makes the states written after ``version`` rounds current for ``clients`` (every process alike)."""
        for client in clients:
            self.index[int(client)] = version

    def saved(self) -> None:
        """Deletes the files that neither the index nor the last two checkpoints name; called (on one process)
        once a checkpoint holding :meth:`state_dict` is written."""
        self._saved = [*self._saved[-1:], dict(self.index)]
        named = {item for index in (self.index, *self._saved) for item in index.items()}
        if self.keep_all or not self.directory.is_dir():
            return
        self._digests = {key: value for key, value in self._digests.items() if key in named}
        for path in self.directory.iterdir():
            match = _FILE.fullmatch(path.name)
            if match is not None and (int(match[1]), int(match[2])) not in named:
                path.unlink(missing_ok=True)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the index, and the size and digest of each file it names (the states themselves
        are the files). A file another process wrote is read here once to take its digest."""
        files = {}
        for key in self.index.items():
            if key not in self._digests:
                self._digests[key] = _digest(self._read(key))
            files[f"{key[0]}-{key[1]}"] = list(self._digests[key])
        return {"index": dict(self.index), "files": files}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.index = {int(client): int(version) for client, version in state["index"].items()}
        for name, (size, digest) in state.get("files", {}).items():  # checkpoints before digests hold none
            client, version = name.split("-")
            self._digests[int(client), int(version)] = (int(size), str(digest))
        missing = [self._path(*key) for key in self.index.items() if not self._path(*key).is_file()]
        if missing:
            listed = ", ".join(str(path) for path in missing[:3]) + (
                f" and {len(missing) - 3} more" if missing[3:] else ""
            )
            raise ConfigError(
                f"The checkpoint names {len(missing)} client states that are not in {self.directory}: {listed}. The "
                "run keeps the states its last two checkpoints name and deletes older ones, so a checkpoint copied "
                "aside and resumed later names states that are gone.",
                "Resume from the run's own checkpoints/last.ckpt (or previous.ckpt); copy client_state/ aside together "
                "with a checkpoint, or run with --trainer.keep_client_states=true to keep every state. No client is "
                "trained or scored from a state other than its own.",
            )
        self._saved = [dict(self.index)]  # the checkpoint it came from
        self._free += self._rows.values()
        self._rows.clear()
        self.cache_nbytes = 0

    def _path(self, client: int, version: int) -> Path:
        return self.directory / f"{client}-{version}.pt"

    def _remember(self, key: tuple[int, int], values: dict[str, torch.Tensor]) -> None:
        """Copies ``values`` into a row of the buffer, giving up the least recently used state if none is free."""
        if self._capacity == 0:
            return
        if self._buffer is None:  # virtual memory: a row's pages become resident when it is first written
            self._buffer = torch.empty(self._capacity, sum(numel for _, numel in self._offsets.values()))
        if key in self._rows:
            row = self._rows[key]
            self._rows.move_to_end(key)
        elif self._free:
            row = self._rows[key] = self._free.pop()
        elif self._used < self._capacity:
            row = self._rows[key] = self._used
            self._used += 1
        else:
            _, row = self._rows.popitem(last=False)
            self._rows[key] = row
        for name, (offset, numel) in self._offsets.items():
            self._buffer[row, offset : offset + numel] = values[name]
        self.cache_nbytes = len(self._rows) * self._buffer.shape[1] * 4
        self.peak_cache_nbytes = max(self.peak_cache_nbytes, self.cache_nbytes)


def _digest(data: bytes | memoryview) -> tuple[int, str]:
    """A state file's size and BLAKE2b digest."""
    return len(data), hashlib.blake2b(data, digest_size=16).hexdigest()
