"""Client class counts: over each client's training split only, every class counted, and data without one integer
class per sample refused with a sentence naming the rule."""

import pytest
import torch

from fedlight.data import FederatedDataModule
from fedlight.errors import ConfigError
from fedlight.label_counts import client_class_counts, label_count_problems
from fedlight.testing import ClientImages, ScalarDataset


def test_counts_cover_the_training_splits_only():
    data = FederatedDataModule(ClientImages([8, 12, 6], [8, 3, 15]), test_fraction=0.25)
    data.setup()
    counts = client_class_counts(data)
    assert counts.shape == (3, 3) and counts.dtype == torch.int64
    assert counts.sum(dim=1).tolist() == data.num_samples.tolist()  # 6, 9, 4: the held-out quarter is not counted
    for k, indices in enumerate(data.client_train):
        labels = data.pool.targets[indices].tolist()
        assert counts[k].tolist() == [labels.count(c) for c in range(3)]
    assert (counts == 0).any()  # a class absent from a client is counted as 0, not left out


def test_data_without_classes_is_refused():
    data = FederatedDataModule(ScalarDataset([4, 6], [1.0, 2.0]))
    data.setup()
    (problem,) = label_count_problems("FedLC", data)
    assert problem.startswith("FedLC calibrates each client's loss with its class counts")
    assert "torch.float32 [1-d]" in problem
    with pytest.raises(ConfigError, match="one integer class per training sample"):
        client_class_counts(data)
