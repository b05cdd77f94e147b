"""``Strategy.transform_batch`` rewrites a client's local batches as they are drawn: a client whose labels a strategy
permutes trains exactly as a clean client on data whose labels were permuted by hand, in the sequential and in the
vectorised loop."""

import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.data.base import LabelledTensors
from fedlight.engine.batched import BatchedLocalFit
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import Attack, FedAvg
from fedlight.testing import ClientImages

# trainers built without a default_root_dir write into the test's own runs/
pytestmark = pytest.mark.usefixtures("runs_in_tmp")

PERMUTATION = torch.tensor([2, 0, 1])  # y ← π(y), C = 3
SIZES, SEEDS = [12, 17, 9], [3, 4, 5]


class PermutedImages(ClientImages):
    """ClientImages whose labels were permuted by hand, on every client."""

    def load_train(self) -> LabelledTensors:
        clean = super().load_train()
        return LabelledTensors(clean.inputs, PERMUTATION[clean.targets], clean.groups)


class PermutedLabels(FedAvg):
    """FedAvg whose clients train on permuted labels; it overrides no hook that runs on the module, so the
    vectorised loop stays on."""

    def transform_batch(self, context, client, batch):
        inputs, targets = batch
        return inputs, PERMUTATION.to(targets.device)[targets]


def fit(dataset, strategy, batching=None, local_steps=None):
    data = FederatedDataModule(dataset, batch_size=5, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=2, clients_per_round=len(SIZES), local_epochs=2, local_steps=local_steps, logger=None,
        enable_progress_bar=False, client_batching=batching,
    )  # fmt: skip
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [16]},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )  # fmt: skip
    trainer.fit(client, data, strategy)
    return trainer


@pytest.mark.parametrize(("batching", "local_steps"), [(None, None), (None, 3), (3, None)])
def test_transformed_batches_train_as_hand_permuted_data(batching, local_steps):
    transformed = fit(ClientImages(SIZES, SEEDS), PermutedLabels(), batching, local_steps)
    by_hand = fit(PermutedImages(SIZES, SEEDS), FedAvg(), batching, local_steps)
    clean = fit(ClientImages(SIZES, SEEDS), FedAvg(), batching, local_steps)
    if batching is not None:
        assert isinstance(transformed.run.pieces.fits.vectorised, BatchedLocalFit)  # the vectorised loop ran
    torch.testing.assert_close(transformed.global_state, by_hand.global_state, rtol=0, atol=0)
    assert not torch.equal(transformed.global_state, clean.global_state)


class FlippedImages(ClientImages):
    """ClientImages with every label y replaced by 2 − y (C = 3), by hand."""

    def load_train(self) -> LabelledTensors:
        clean = super().load_train()
        return LabelledTensors(clean.inputs, 2 - clean.targets, clean.groups)


def test_a_label_flip_attacker_trains_as_a_clean_client_on_hand_flipped_labels():
    # every client attacks (fraction 0.9 of 3 → 3): the attacked run is FedAvg on flipped data
    attacked = fit(ClientImages(SIZES, SEEDS), Attack(kind="label_flip", fraction=0.9))
    assert attacked.run.strategy.malicious == {0, 1, 2}
    by_hand = fit(FlippedImages(SIZES, SEEDS), FedAvg())
    torch.testing.assert_close(attacked.global_state, by_hand.global_state, rtol=0, atol=0)
    assert "training_step" not in vars(attacked.model.module)  # the client's own method ran, not a stand-in
