"""Federated data: datasets, partitioners and the ``FederatedDataModule``."""

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.celeba import CelebA
from fedlight.data.cifar import CIFAR10, CIFAR100
from fedlight.data.cinic10 import CINIC10
from fedlight.data.cityscapes import CityscapesFUSS
from fedlight.data.cocostuff import CocoStuff27
from fedlight.data.datamodule import FederatedDataModule
from fedlight.data.digits import Digits
from fedlight.data.femnist import FEMNIST
from fedlight.data.ladd_splits import GTA5, CityscapesFFREEDA, CrossCity, Mapillary
from fedlight.data.mnist import MNIST
from fedlight.data.npz import NpzDataset
from fedlight.data.scenes import Scenes
from fedlight.data.street_scenes import StreetScenes
from fedlight.data.style_augment import StyleAugment
from fedlight.data.style_cities import StyleCities
from fedlight.data.synthetic import Synthetic
from fedlight.data.tiny_imagenet import TinyImageNet
from fedlight.data.voc import PascalVOC

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
]
