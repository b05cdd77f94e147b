"""Computes the clients' frozen-backbone features and kNN lists once, before the first round (FUSS, STEGO).

Add it to ``--trainer.callbacks`` with a client that has a frozen ``backbone`` and
``attach_feature_cache`` (:class:`~fedlight.clients.unsupervised.UnsupervisedSegmentationClient`), and set
``--data.return_index=true`` so that training batches name their images. See
:mod:`fedlight.data.features.feature_cache` for the files and the budget.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.callbacks.base import RoundCallback
from fedlight.data.cache_files import DigestMode, folder_problems
from fedlight.data.features.feature_cache import FeatureCache
from fedlight.errors import ConfigError

if TYPE_CHECKING:
    from fedlight.context import RunContext

log = logging.getLogger(__name__)
_FLAG = "--trainer.callbacks (fedlight.callbacks.BackboneFeatureCache) init_args"


class BackboneFeatureCache(RoundCallback):
    """Builds a :class:`~fedlight.data.features.feature_cache.FeatureCache` and hands it to the client module.

    Args:
        directory: where the feature files go; ``null``: ``<run_dir>/features``. Files are fingerprinted
            by backbone weights and partition, so a shared folder is reused across runs of one setting.
        max_gib: disk budget of the feature files in GiB; clients beyond it get their features computed
            per batch (DINO ViT-B/8 at 224: 1.2 MB per image in fp16).
        dtype: storage type of the features.
        k: nearest-neighbour list length, self included (30 in STEGO's and FUSS's code).
        batch_size: images per backbone pass while building.
        verify: how the files of a completed folder are checked before reuse: ``sampled`` reads 16 MiB of each
            feature file (any rewrite or reordering of it is caught), ``full`` reads every byte (and has the build
            record that digest too). A folder whose files fail is rebuilt, with a warning naming them.
    """

    def __init__(
        self,
        directory: str | None = None,
        max_gib: float = 64.0,
        dtype: Literal["float16", "float32"] = "float16",
        k: int = 30,
        batch_size: int = 64,
        verify: DigestMode = "sampled",
    ) -> None:
        if max_gib < 0 or k < 2:
            raise ConfigError(f"Expected max_gib ≥ 0 and k ≥ 2 for BackboneFeatureCache, got {max_gib} and {k}.")
        if verify not in ("sampled", "full"):
            raise ConfigError(f"Expected {_FLAG}.verify to be 'sampled' or 'full', got {verify!r}.")
        self.directory, self.max_gib, self.dtype, self.k, self.batch_size = directory, max_gib, dtype, k, batch_size
        self.verify = verify
        self.cache: FeatureCache | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def check(self, module, datamodule) -> list[str]:
        problems = []
        if not hasattr(module, "attach_feature_cache"):
            problems.append(
                f"fedlight.callbacks.BackboneFeatureCache needs a client with a frozen backbone and "
                f"attach_feature_cache; --model is {type(module).__name__}, which has none. Use "
                "fedlight.clients.UnsupervisedSegmentationClient, or remove the callback from --trainer.callbacks."
            )
        if not getattr(datamodule, "return_index", False):
            problems.append(
                "fedlight.callbacks.BackboneFeatureCache serves features by image index: set --data.return_index=true."
            )
        if self.directory is not None:  # the run folder's own is checked with --trainer.default_root_dir
            problems += folder_problems(self.directory, f"{_FLAG}.directory")
        return problems

    def on_fit_start(self, context: RunContext) -> None:
        module, data = context.module, context.datamodule
        directory = self.directory
        if directory is None:
            if context.run_dir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="fedlight-features-")
                directory = self._tmp.name
            else:
                directory = str(Path(context.run_dir) / "features")
        device = context.device
        pool = data.pool.inputs

        def images(index: torch.Tensor) -> torch.Tensor:
            if isinstance(pool, torch.Tensor):
                return pool[index.to(pool.device)]
            return pool[index.cpu()]

        def barrier() -> None:
            context.all_reduce(torch.zeros(1, device=device))

        self.cache = FeatureCache.build(
            module.backbone,
            images,
            data.client_train,
            len(data.pool),
            directory,
            k=self.k,
            max_bytes=self.max_gib * 2**30,
            dtype=self.dtype,
            batch_size=self.batch_size,
            device=device,
            rank=context.rank,
            world_size=context.world_size,
            barrier=barrier,
            verify=self.verify,
        )
        module.attach_feature_cache(self.cache)
        log.info("backbone features of %d clients cached: %.1f MiB", data.num_clients, self.cache.nbytes / 2**20)

    def on_round_end(self, context: RunContext, round_idx: int, metrics: dict[str, Any]) -> None:
        if round_idx == 0 and self.cache is not None:
            metrics["features/cache_mib"] = self.cache.nbytes / 2**20
