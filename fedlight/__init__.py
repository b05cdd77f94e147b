"""fedlight: federated learning of vision models on PyTorch Lightning and Fabric."""

__version__ = "0.1.0"
