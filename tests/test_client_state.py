"""The per-client store: slots start from their init, local slots go into and out of a flat state, memory stays
within its budget while every state stays readable from its file, and only committed states count."""

import re

import pytest
import torch

from fedlight.client_state import ClientStateStore, Slot
from fedlight.errors import ConfigError

MASK = torch.tensor([False, True, True, False])  # a local slot of entries 1 and 2 of a 4-entry state


def store(tmp_path, budget_bytes=1 << 20, num_clients=100):
    slots = {"head": Slot.local(MASK), "c": Slot.vector(3)}
    return ClientStateStore(slots, tmp_path / "client_state", budget_bytes, num_clients)


def test_a_new_client_starts_from_what_it_receives_and_zeros(tmp_path):
    start = torch.tensor([1.0, 2.0, 3.0, 4.0])
    values = store(tmp_path).values(7, start)
    assert values["head"].tolist() == [2.0, 3.0] and values["c"].tolist() == [0.0, 0.0, 0.0]
    received = Slot.vector(4, init="received").initial(start)
    assert received.tolist() == start.tolist() and received.data_ptr() != start.data_ptr()


def test_local_slots_are_written_over_the_start_and_taken_back_from_the_trained_state(tmp_path):
    s = store(tmp_path)
    start = torch.tensor([1.0, 2.0, 3.0, 4.0])
    own = {"head": torch.tensor([20.0, 30.0]), "c": torch.zeros(3)}
    assert s.load_into(own, start).tolist() == [1.0, 20.0, 30.0, 4.0]
    assert start.tolist() == [1.0, 2.0, 3.0, 4.0]  # the received state is not modified
    s.take_back(own, torch.tensor([5.0, 6.0, 7.0, 8.0]))
    assert own["head"].tolist() == [6.0, 7.0]


def test_a_state_counts_once_committed(tmp_path):
    s = store(tmp_path)
    s.put(3, 1, {"head": torch.tensor([1.0, 1.0]), "c": torch.ones(3)})
    assert s.get(3) is None  # written, not committed: the client's fit was left out of the round
    s.commit([3], 1)
    s.put(3, 2, {"head": torch.tensor([2.0, 2.0]), "c": torch.ones(3)})
    assert s.get(3)["head"].tolist() == [1.0, 1.0]
    s.commit([3], 2)
    assert s.get(3)["head"].tolist() == [2.0, 2.0]


def test_memory_stays_within_the_budget_and_evicted_states_are_read_back(tmp_path):
    per_client = 4 * (2 + 3)
    s = store(tmp_path, budget_bytes=2 * per_client)
    for client in range(6):
        s.put(client, 1, {"head": torch.full((2,), float(client)), "c": torch.full((3,), -float(client))})
        assert s.cache_nbytes <= 2 * per_client
    s.commit(range(6), 1)
    assert s.peak_cache_nbytes == 2 * per_client
    for client in range(6):  # the four oldest come from their files
        assert s.get(client)["head"].tolist() == [client, client] and s.get(client)["c"].tolist() == [-client] * 3
        assert s.cache_nbytes <= 2 * per_client
    nothing = store(tmp_path / "none", budget_bytes=0)
    nothing.put(1, 1, {"head": torch.ones(2), "c": torch.ones(3)})
    nothing.commit([1], 1)
    assert nothing.get(1)["c"].tolist() == [1.0, 1.0, 1.0] and nothing.peak_cache_nbytes == 0


def test_the_index_round_trips_and_names_the_files_a_resumed_store_reads(tmp_path):
    s = store(tmp_path)
    s.put(4, 2, {"head": torch.tensor([4.0, 2.0]), "c": torch.arange(3.0)})
    s.commit([4], 2)
    resumed = store(tmp_path, budget_bytes=0)
    resumed.load_state_dict(s.state_dict())
    assert resumed.index == {4: 2} and resumed.get(4)["c"].tolist() == [0.0, 1.0, 2.0]


def test_files_are_deleted_once_no_checkpoint_names_them(tmp_path):
    s = store(tmp_path)
    files = lambda: sorted(p.name for p in s.directory.iterdir())  # noqa: E731
    values = {"head": torch.zeros(2), "c": torch.zeros(3)}
    for version in (1, 2, 3, 4):
        s.put(0, version, values)
        s.commit([0], version)
        if version != 3:  # a round without a checkpoint
            s.saved()
    # version 1 is no checkpoint's any more, version 3 was replaced before a checkpoint named it
    assert files() == ["0-2.pt", "0-4.pt"]  # previous.ckpt's and last.ckpt's
    s.put(1, 5, values)  # written in a round that was left unfinished: never committed
    s.saved()  # a checkpoint of the same index: last.ckpt and previous.ckpt both name version 4
    assert files() == ["0-4.pt"]
    s.put(0, 6, values)
    s.commit([0], 6)
    s.saved()
    assert files() == ["0-4.pt", "0-6.pt"]


def test_the_buffer_holds_no_more_states_than_there_are_clients(tmp_path):
    """A budget far above what the clients can fill allocates one row per client, not the budget."""
    huge = store(tmp_path, budget_bytes=10**18, num_clients=3)
    for client in range(3):
        huge.put(client, 1, {"head": torch.full((2,), float(client)), "c": torch.zeros(3)})
    huge.commit(range(3), 1)
    assert huge._buffer.shape[0] == 6  # a current and a just-written state per client
    assert huge.get(2)["head"].tolist() == [2.0, 2.0]


def _resumed(tmp_path, written):
    """A store of a resumed run: what the checkpoint recorded of ``written``, over the same folder."""
    resumed = store(tmp_path)
    resumed.load_state_dict(written.state_dict())
    return resumed


def _written(tmp_path, clients=(0, 1)):
    first = store(tmp_path)
    for client in clients:
        first.put(client, 1, {"head": torch.full((2,), float(client)), "c": torch.ones(3)})
    first.commit(clients, 1)
    return first


def test_a_resume_whose_states_are_gone_is_refused_at_set_up_naming_them(tmp_path):
    """A checkpoint copied aside and resumed after the run deleted the states it names (it keeps those of its last
    two checkpoints) is refused when it is loaded, before any client trains."""
    first = _written(tmp_path)
    (tmp_path / "client_state" / "1-1.pt").unlink()
    with pytest.raises(ConfigError, match=r"names 1 client states that are not in .*client_state: .*1-1\.pt"):
        _resumed(tmp_path, first)


@pytest.mark.parametrize("fault", ["truncated", "flipped", "another run's"])
def test_a_state_file_that_is_not_the_one_the_checkpoint_recorded_is_refused_by_name(tmp_path, fault):
    first = _written(tmp_path)
    resumed = _resumed(tmp_path, first)
    path = tmp_path / "client_state" / "1-1.pt"
    data = path.read_bytes()
    if fault == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif fault == "flipped":
        path.write_bytes(data[:-9] + bytes([data[-9] ^ 0xFF]) + data[-8:])
    else:  # the same client's state of another run, a valid file of the same size
        other = store(tmp_path / "other")
        other.put(1, 1, {"head": torch.full((2,), 7.0), "c": torch.ones(3)})
        path.write_bytes((tmp_path / "other" / "client_state" / "1-1.pt").read_bytes())
    with pytest.raises(ConfigError, match=rf"client 1 after round 1, {re.escape(str(path))}"):
        resumed.get(1)
    assert resumed.get(0)["head"].tolist() == [0.0, 0.0]  # the intact file is read as ever


def test_the_digests_a_checkpoint_records_are_those_of_the_files(tmp_path):
    import hashlib

    state = _written(tmp_path).state_dict()
    data = (tmp_path / "client_state" / "0-1.pt").read_bytes()
    assert state["files"]["0-1"] == [len(data), hashlib.blake2b(data, digest_size=16).hexdigest()]
    assert _resumed(tmp_path, _written(tmp_path)).get(1)["head"].tolist() == [1.0, 1.0]
