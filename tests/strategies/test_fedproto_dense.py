"""MO-FedProto with a segmentation client: prototypes of decoder features (D5), checked pixel by pixel."""

import torch

from fedlight.clients import SegmentationClient
from fedlight.data import FederatedDataModule, Scenes
from fedlight.data.partition import DirichletPowerLaw
from fedlight.engine.trainer import FederatedTrainer
from fedlight.metrics.functional.prototypes import minmax_normalize
from fedlight.strategies import FedProto


def test_prototypes_come_from_decoder_pixels_with_nearest_labels(tmp_path):
    data = FederatedDataModule(
        Scenes(num_samples=40, image_size=32, label_set="macro", seed=2),
        DirichletPowerLaw(num_clients=2, alpha=1.0),
        batch_size=8,
        eval_batch_size=8,
    )
    torch.manual_seed(0)
    model = SegmentationClient(5, (3, 32, 32), model_kwargs={"encoder_weights": None, "decoder_channels": 8})
    strategy = FedProto()
    settings = {"logger": "csv", "enable_progress_bar": False, "default_root_dir": tmp_path}
    trainer = FederatedTrainer(rounds=1, clients_per_round=1, local_epochs=1, **settings)
    trainer.fit(model, data, strategy)
    # one client trained; round 0 uses FedAvg's weights, so the new global model is that client's model, and
    # p̂_agg is its normalised after-training prototypes
    client = trainer.run.plans[0].client
    net = trainer.model.evaluation_module().net
    sums, counts = torch.zeros(5, 8, dtype=torch.float64), torch.zeros(5, dtype=torch.int64)
    with torch.no_grad():
        for index in data.client_train[client].tolist():
            x, y = data.pool.inputs[index], data.pool.targets[index]  # [3, 32, 32], [32, 32]
            features = net.forward_features(x[None])[0]  # [8, 8, 8]
            for i in range(8):
                for j in range(8):
                    label = int(y[4 * i, 4 * j])
                    if label != 255:  # void left out, background (0) kept
                        sums[label] += features[:, i, j].double()
                        counts[label] += 1
    present = counts > 0
    assert present[0] and present.sum() >= 2
    expected = minmax_normalize((sums / counts.clamp(min=1)[:, None]).float())
    torch.testing.assert_close(strategy.aggregate[present].float(), expected[present], atol=1e-5, rtol=1e-4)
    assert torch.equal(strategy.seen, present)
