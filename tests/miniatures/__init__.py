"""Miniatures of the real datasets, written file by file in each dataset's published on-disk layout.

A miniature holds a handful of images per split, with the real folder trees, file names, formats, label
encodings and split files that fedlight's readers document, so that a reader and every paper row that uses it
run end to end on it exactly as they would on the downloaded dataset, only smaller.

Each :class:`Miniature` writes one dataset under the folder a config names as the dataset's ``root`` and says
which flags shrink a row to the miniature's size (the number of clients a partition can fill, image sizes).
Nothing here skips a check of the product: where a reader verifies checksums, the miniature writes its own list
of sums, and the flags name it through the option a user's re-packed mirror would use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Miniature:
    """How to write one dataset's miniature and run a row on it.

    Attributes:
        dataset: the reader's class name as configs name it (``CIFAR10`` for ``fedlight.data.CIFAR10``).
        write: writes the miniature under the given root (the config's ``data.dataset.init_args.root``, created
            if needed) and returns the extra command-line flags a row needs to read it (e.g. a checksum list);
            writing twice into the same root is allowed and leaves the same files.
        flags: flags that shrink a row to the miniature (sizes, partition clients), after the row's own config; or
            a function of the row's resolved configuration that returns them, where they depend on the row.
    """

    dataset: str
    write: Callable[[Path], list[str]]
    flags: tuple[str, ...] | Callable[[dict[str, Any]], tuple[str, ...]] = field(default=())

    def flags_for(self, config: dict[str, Any]) -> tuple[str, ...]:
        """The flags for a row whose resolved configuration is ``config``."""
        return self.flags(config) if callable(self.flags) else self.flags


def registry() -> dict[str, Miniature]:
    """Every miniature, by the reader's class name."""
    from miniatures import classification, generated, segmentation, street

    found: dict[str, Miniature] = {}
    for module in (classification, generated, segmentation, street):
        for miniature in module.MINIATURES:
            assert miniature.dataset not in found, f"two miniatures of {miniature.dataset}"
            found[miniature.dataset] = miniature
    return found
