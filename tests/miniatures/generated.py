"""Datasets that fedlight generates or that a package ships: nothing to write, only flags that shrink their rows."""

from miniatures import Miniature


def _nothing(root) -> list[str]:
    return []


def _street_flags(config: dict) -> tuple[str, ...]:
    """72 scenes; a row that splits them by label over many clients (the CocoStuff twin's 18, at least 10 images
    each) over 3 of them."""
    flags = ("--data.dataset.init_args.images_per_city=12",)
    if "num_clients" in (config["data"]["partitioner"].get("init_args") or {}):
        flags += ("--data.partitioner.init_args.num_clients=3",)
    return flags


MINIATURES = [
    # the prototype paper's Pascal twin: 6,665 scenes over 100 Pareto clients
    Miniature(
        "Scenes",
        _nothing,
        (
            "--data.dataset.init_args.num_samples=240",
            "--data.dataset.init_args.image_size=32",
            "--data.train_transform.init_args.crop_size=32",
            "--data.partitioner.init_args.num_clients=6",
        ),
    ),
    Miniature("StreetScenes", _nothing, _street_flags),
    # LADD's twin keeps its 40 clients: its style clustering tries k = 4…19, which needs 20 clients or more
    Miniature("StyleCities", _nothing, ("--data.dataset.init_args.num_test_per_city=4",)),
    Miniature("Synthetic", _nothing),
    Miniature("Digits", _nothing),
    Miniature("MNISTSubset", _nothing),
]
