"""Aggregation rules, one per file; :class:`Strategy` documents the hooks."""

from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.apfl import APFL
from fedlight.strategies.attacks import Attack
from fedlight.strategies.base import Strategy
from fedlight.strategies.ccvr import CCVR
from fedlight.strategies.cfl import CFL
from fedlight.strategies.clustered_fedavg import ClusteredFedAvg
from fedlight.strategies.ditto import Ditto
from fedlight.strategies.dp import DPFedAvg
from fedlight.strategies.dp_sgd import DPSGD
from fedlight.strategies.elastic import ElasticAggregation
from fedlight.strategies.fairness import Fairness
from fedlight.strategies.fedadmm import FedADMM
from fedlight.strategies.fedala import FedALA
from fedlight.strategies.fedatt import FedAtt
from fedlight.strategies.fedau import FedAU
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.fedavgm import FedAvgM
from fedlight.strategies.fedbabu import FedBABU
from fedlight.strategies.fedbn import FedBN
from fedlight.strategies.fedcc import FedCC
from fedlight.strategies.fedcc_moon import FedCCMOON
from fedlight.strategies.fedcc_prox import FedCCProx
from fedlight.strategies.feddecorr import FedDecorr
from fedlight.strategies.feddyn import FedDyn
from fedlight.strategies.fedexp import FedExP
from fedlight.strategies.fedfomo import FedFomo
from fedlight.strategies.fedgen import FedGen
from fedlight.strategies.fedlc import FedLC
from fedlight.strategies.fednova import FedNova
from fedlight.strategies.fedopt import FedAdagrad, FedAdam, FedOpt, FedYogi
from fedlight.strategies.fedpac import FedPAC
from fedlight.strategies.fedper import FedPer
from fedlight.strategies.fedproto import FedProto
from fedlight.strategies.fedprox import FedProx
from fedlight.strategies.fedrep import FedRep
from fedlight.strategies.fedrod import FedRoD
from fedlight.strategies.fedsl import FedSL
from fedlight.strategies.fedsls import FedSLS
from fedlight.strategies.knn_per import KNNPer
from fedlight.strategies.ladd import LADD
from fedlight.strategies.lg_fedavg import LGFedAvg
from fedlight.strategies.local_dp import LocalDP
from fedlight.strategies.local_only import LocalOnly
from fedlight.strategies.moon import MOON
from fedlight.strategies.per_fedavg import PerFedAvg
from fedlight.strategies.pfedme import PFedMe
from fedlight.strategies.qfedavg import QFedAvg
from fedlight.strategies.robust import RobustAggregation
from fedlight.strategies.scaffold import SCAFFOLD
from fedlight.strategies.tan_fedproto import TanFedProto
from fedlight.strategies.wrapper import RuleWrapper

__all__ = [
    "APFL",
    "CCVR",
    "CFL",
    "DPSGD",
    "LADD",
    "MOON",
    "SCAFFOLD",
    "Attack",
    "ClientPlan",
    "ClientUpdate",
    "ClusteredFedAvg",
    "DPFedAvg",
    "Ditto",
    "ElasticAggregation",
    "Fairness",
    "FedADMM",
    "FedALA",
    "FedAU",
    "FedAdagrad",
    "FedAdam",
    "FedAtt",
    "FedAvg",
    "FedAvgM",
    "FedBABU",
    "FedBN",
    "FedCC",
    "FedCCMOON",
    "FedCCProx",
    "FedDecorr",
    "FedDyn",
    "FedExP",
    "FedFomo",
    "FedGen",
    "FedLC",
    "FedNova",
    "FedOpt",
    "FedPAC",
    "FedPer",
    "FedProto",
    "FedProx",
    "FedRep",
    "FedRoD",
    "FedSL",
    "FedSLS",
    "FedYogi",
    "KNNPer",
    "LGFedAvg",
    "LocalDP",
    "LocalOnly",
    "PFedMe",
    "PerFedAvg",
    "QFedAvg",
    "RobustAggregation",
    "RuleWrapper",
    "Strategy",
    "TanFedProto",
]
