"""Federated data: datasets, partitioners and the ``FederatedDataModule``."""

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datamodule import FederatedDataModule
from fedlight.data.datasets.celeba import CelebA
from fedlight.data.datasets.cifar import CIFAR10, CIFAR100
from fedlight.data.datasets.cinic10 import CINIC10
from fedlight.data.datasets.cityscapes import CityscapesFUSS
from fedlight.data.datasets.cocostuff import CocoStuff27
from fedlight.data.datasets.digits import Digits
from fedlight.data.datasets.femnist import FEMNIST
from fedlight.data.datasets.hf import HFDataset
from fedlight.data.datasets.ladd_splits import GTA5, CityscapesFFREEDA, CrossCity, Mapillary
from fedlight.data.datasets.mnist import MNIST
from fedlight.data.datasets.npz import NpzDataset
from fedlight.data.datasets.synthetic import Synthetic
from fedlight.data.datasets.tiny_imagenet import TinyImageNet
from fedlight.data.datasets.torch_dataset import TorchDataset
from fedlight.data.datasets.voc import PascalVOC
from fedlight.data.style.style_augment import StyleAugment
from fedlight.data.twins.scenes import Scenes
from fedlight.data.twins.street_scenes import StreetScenes
from fedlight.data.twins.style_cities import StyleCities

__all__ = [
    "CIFAR10",
    "CIFAR100",
    "CINIC10",
    "FEMNIST",
    "GTA5",
    "MNIST",
    "CelebA",
    "CityscapesFFREEDA",
    "CityscapesFUSS",
    "CocoStuff27",
    "CrossCity",
    "Digits",
    "FederatedDataModule",
    "FederatedDataset",
    "HFDataset",
    "LabelledTensors",
    "Mapillary",
    "NpzDataset",
    "PascalVOC",
    "Scenes",
    "StreetScenes",
    "StyleAugment",
    "StyleCities",
    "Synthetic",
    "TinyImageNet",
    "TorchDataset",
]
