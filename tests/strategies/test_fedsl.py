"""FedSL: R_k from vanilla latents, computed independently with numpy."""

import numpy as np
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedSL
from fedlight.testing import ClientImages


def test_weights_are_summed_norms_of_downsampled_channel_means(tmp_path):
    dataset = ClientImages([6, 9], [1, 2])
    data = FederatedDataModule(dataset, batch_size=4, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=2, local_epochs=1, logger=None, enable_progress_bar=False, default_root_dir=tmp_path
    )
    model = ClassificationClient(num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8})
    trainer.fit(model, data, FedSL(factor=4))
    for client in range(2):
        images = data.pool.inputs[data.client_train[client]].numpy()  # [n, 1, 8, 8]
        pooled = images.reshape(-1, 1, 2, 4, 2, 4).mean(axis=(3, 5)).mean(axis=1)  # [n, 2, 2]
        expected = np.sqrt((pooled**2).sum(axis=(1, 2))).sum()
        np.testing.assert_allclose(trainer.run.strategy.saliency[client].item(), expected, rtol=1e-5)
    assert trainer.run.strategy.saliency.dtype == torch.float64
