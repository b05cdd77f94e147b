"""Label sets and class names: Pascal VOC's (and MO-FedProto's macro classes), Cityscapes', CrossCity's and
CocoStuff's.

Pascal VOC's are shared by :class:`~fedlight.data.PascalVOC` and the procedural :class:`~fedlight.data.Scenes`,
whose classes carry the VOC names, so that one macro map, one colour map and one partition protocol serve both.
The street datasets (Cityscapes, CrossCity, Mapillary, GTA5 and their twin) share Cityscapes' names. A dataset
gives its classes' names as ``class_names``; metrics and figures name the classes after them.

The macro variant (MO-FedProto, supplementary) groups the 20 classes into 4:
person → 1, vehicles → 2, household objects → 3, animals → 4; background stays 0 and the void label 255
stays 255.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

LabelSet = Literal["fine", "macro"]

#: Index 0 is the background, 1–20 the VOC object classes in the official order.
VOC_CLASSES = (
    "background",
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)

MACRO_CLASSES = ("background", "person", "vehicle", "household", "animal")

#: Cityscapes' 27 classes of FUSS and STEGO: labelIds 7…33 in order, renumbered 0…26.
CITYSCAPES_27 = (
    "road", "sidewalk", "parking", "rail track", "building", "wall", "fence", "guard rail", "bridge",
    "tunnel", "pole", "polegroup", "traffic light", "traffic sign", "vegetation", "terrain", "sky", "person",
    "rider", "car", "truck", "bus", "caravan", "trailer", "train", "motorcycle", "bicycle",
)  # fmt: skip
#: Cityscapes' 19 evaluated classes (its trainIds 0…18), LADD's for Cityscapes, Mapillary and GTA5.
CITYSCAPES_19_CLASSES = (
    "road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign", "vegetation",
    "terrain", "sky", "person", "rider", "car", "truck", "bus", "train", "motorcycle", "bicycle",
)  # fmt: skip
#: CrossCity's 13 classes, those of Cityscapes' 19 that its labels hold.
CROSSCITY_13_CLASSES = (
    "road", "sidewalk", "building", "traffic light", "traffic sign", "vegetation", "sky", "person", "rider", "car",
    "bus", "motorcycle", "bicycle",
)  # fmt: skip
#: CocoStuff's 27 coarse classes in STEGO's order: 12 thing and 15 stuff supercategories. STEGO calls classes 14
#: and 15 "food" and "furniture" like the things 2 and 3; they take COCO-Stuff's stuff names so that every
#: class has its own.
COCOSTUFF_27_CLASSES = (
    "electronic", "appliance", "food", "furniture", "indoor", "kitchen", "accessory", "animal", "outdoor", "person",
    "sports", "vehicle", "ceiling", "floor", "food-stuff", "furniture-stuff", "rawmaterial", "textile", "wall",
    "window", "building", "ground", "plant", "sky", "solid", "structural", "water",
)  # fmt: skip

_MACRO_GROUPS = {
    "person": ("person",),
    "vehicle": ("aeroplane", "bicycle", "boat", "bus", "car", "motorbike", "train"),
    "household": ("bottle", "chair", "diningtable", "pottedplant", "sofa", "tvmonitor"),
    "animal": ("bird", "cat", "cow", "dog", "horse", "sheep"),
}

#: Void pixels (object borders, unlabelled regions): no loss, no metric.
IGNORE_INDEX = 255


def lookup_table(mapping: dict[int, int]) -> torch.Tensor:
    """``[256]`` int64: label id → train id, void elsewhere.

    >>> lookup_table({7: 0, 8: 1})[[0, 7, 8]].tolist()
    [255, 0, 1]
    """
    table = torch.full((256,), IGNORE_INDEX, dtype=torch.int64)
    for label_id, train_id in mapping.items():
        table[label_id] = train_id
    return table


def macro_lookup() -> torch.Tensor:
    """A ``[256]`` int64 table mapping a fine VOC label to its macro label (255 stays 255).

    >>> table = macro_lookup()
    >>> [MACRO_CLASSES[table[VOC_CLASSES.index(name)]] for name in ("background", "person", "train", "sofa", "cat")]
    ['background', 'person', 'vehicle', 'household', 'animal']
    >>> int(table[255])
    255
    """
    table = torch.full((256,), IGNORE_INDEX, dtype=torch.int64)
    table[0] = 0
    for macro, members in _MACRO_GROUPS.items():
        for name in members:
            table[VOC_CLASSES.index(name)] = MACRO_CLASSES.index(macro)
    assert (table[: len(VOC_CLASSES)] != IGNORE_INDEX).all(), "every VOC class needs a macro class"
    return table


def class_names(label_set: LabelSet) -> tuple[str, ...]:
    """The class names of a label set, background first."""
    return VOC_CLASSES if label_set == "fine" else MACRO_CLASSES


def voc_colormap(num_colors: int = 256) -> np.ndarray:
    """VOC's palette: ``[num_colors, 3]`` uint8, class c's colour from the bits of c (255 is near-white).

    >>> voc_colormap()[[0, 1, 2, 15]].tolist()
    [[0, 0, 0], [128, 0, 0], [0, 128, 0], [192, 128, 128]]
    """
    colors = np.zeros((num_colors, 3), dtype=np.uint8)
    for index in range(num_colors):
        value, r, g, b = index, 0, 0, 0
        for shift in range(7, -1, -1):  # the 3 lowest bits of c go to the highest bits of (r, g, b)
            r |= (value & 1) << shift
            g |= ((value >> 1) & 1) << shift
            b |= ((value >> 2) & 1) << shift
            value >>= 3
        colors[index] = (r, g, b)
    return colors
