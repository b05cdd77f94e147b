"""The run's random streams, derived from its seed and never carried from round to round.

Round ``t``'s server-side draws (sampling, stragglers), a strategy's own draws in round ``t``, client ``k``'s
draws in round ``t`` (batch order, dropout) and the clients that the evaluation after round ``t`` samples each
come from a NumPy ``SeedSequence`` spawned from the run's seed under a key of its own. Results therefore do not
depend on the order in which clients run or on how many processes run them, and a resumed run needs only the
round number to continue exactly where it stopped.
"""

from __future__ import annotations

import numpy as np
import torch

# Stream tags of the seed sequences, so that round-level and client-level draws never coincide.
_ROUND_STREAM, _CLIENT_STREAM, _STRATEGY_STREAM, _EVALUATION_STREAM = 0, 1, 2, 3


class RandomStreams:
    """The streams of the run seeded with ``seed``.

    >>> streams = RandomStreams(0)
    >>> streams.client_seed(3, 7) == RandomStreams(0).client_seed(3, 7) != streams.client_seed(3, 8)
    True
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def round_rng(self, round_idx: int) -> np.random.Generator:
        """The generator of round ``round_idx``'s server-side draws (sampling, stragglers)."""
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_ROUND_STREAM, round_idx)))

    def strategy_rng(self, round_idx: int) -> np.random.Generator:
        """A generator for a strategy's own server-side draws in round ``round_idx`` (e.g. FedAtt's noise)."""
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_STRATEGY_STREAM, round_idx)))

    def evaluation_rng(self, round_idx: int) -> np.random.Generator:
        """The generator of the clients sampled for evaluation after round ``round_idx``; its own stream, so that
        evaluating more or fewer clients never changes a round's training."""
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_EVALUATION_STREAM, round_idx)))

    def client_seed(self, round_idx: int, client: int) -> int:
        """The seed of client ``client``'s stream in round ``round_idx``."""
        sequence = np.random.SeedSequence(self.seed, spawn_key=(_CLIENT_STREAM, round_idx, client))
        return int(sequence.generate_state(1, dtype=np.uint64)[0] >> 1)


def seed_torch(seed: int, device: torch.device) -> None:
    """Seeds the CPU generator and the training device's, the two a client step draws from.

    ``torch.manual_seed`` also queues seeds for every CUDA device, recording a stack trace when CUDA is not
    initialised: ~0.25 ms per call, more than a small client's model load and optimizer together.
    """
    torch.default_generator.manual_seed(seed)
    if device.type != "cpu":
        getattr(torch, device.type).manual_seed(seed)
