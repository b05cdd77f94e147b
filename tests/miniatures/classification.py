"""Miniatures of the image-classification datasets, in the layouts their downloads unpack to.

* MNIST: the four uncompressed IDX files torchvision keeps in ``<root>/MNIST/raw/``.
* FEMNIST: EMNIST "byclass" (62 classes: digits, upper-case, lower-case letters) as IDX files in
  ``<root>/EMNIST/raw/``, each image stored transposed as NIST stores it.
* CelebA: torchvision's ``<root>/celeba/`` with the aligned 178×218 JPEGs and all six text files.
* CIFAR10 / CIFAR100: torchvision's pickled batches in ``cifar-10-batches-py/`` and ``cifar-100-python/``, with a
  list of their MD5 sums (``<root>/MD5SUMS``) that the reader's ``checksums`` option names.
* CINIC10: ``{train,valid,test}/<class>/*.png`` with CINIC-10's two kinds of file names.
* TinyImageNet: the ``tiny-imagenet-200/`` tree with ``wnids.txt``, ``words.txt``, the training boxes, the
  annotated validation images and unlabelled test images.

Images are deterministic (a fixed seed per dataset), smooth enough to keep the JPEGs small, in each dataset's real
size. The lower-level writers (``write_mnist_files`` …) take the content as arrays, for tests that need particular
images or labels.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from miniatures import Miniature

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR100_CLASSES = tuple(
    [
        "apple",
        "aquarium_fish",
        "baby",
        "bear",
        "beaver",
        "bed",
        "bee",
        "beetle",
        "bicycle",
        "bottle",
        "bowl",
        "boy",
        "bridge",
        "bus",
        "butterfly",
        "camel",
        "can",
        "castle",
        "caterpillar",
        "cattle",
        "chair",
        "chimpanzee",
        "clock",
        "cloud",
        "cockroach",
        "couch",
        "crab",
        "crocodile",
        "cup",
        "dinosaur",
        "dolphin",
        "elephant",
        "flatfish",
        "forest",
        "fox",
        "girl",
        "hamster",
        "house",
        "kangaroo",
        "keyboard",
        "lamp",
        "lawn_mower",
        "leopard",
        "lion",
        "lizard",
        "lobster",
        "man",
        "maple_tree",
        "motorcycle",
        "mountain",
        "mouse",
        "mushroom",
        "oak_tree",
        "orange",
        "orchid",
        "otter",
        "palm_tree",
        "pear",
        "pickup_truck",
        "pine_tree",
        "plain",
        "plate",
        "poppy",
        "porcupine",
        "possum",
        "rabbit",
        "raccoon",
        "ray",
        "road",
        "rocket",
        "rose",
        "sea",
        "seal",
        "shark",
        "shrew",
        "skunk",
        "skyscraper",
        "snail",
        "snake",
        "spider",
        "squirrel",
        "streetcar",
        "sunflower",
        "sweet_pepper",
        "table",
        "tank",
        "telephone",
        "television",
        "tiger",
        "tractor",
        "train",
        "trout",
        "tulip",
        "turtle",
        "wardrobe",
        "whale",
        "willow_tree",
        "wolf",
        "woman",
        "worm",
    ]
)
CIFAR100_SUPERCLASSES = tuple(
    [
        "aquatic_mammals",
        "fish",
        "flowers",
        "food_containers",
        "fruit_and_vegetables",
        "household_electrical_devices",
        "household_furniture",
        "insects",
        "large_carnivores",
        "large_man-made_outdoor_things",
        "large_natural_outdoor_scenes",
        "large_omnivores_and_herbivores",
        "medium_mammals",
        "non-insect_invertebrates",
        "people",
        "reptiles",
        "small_mammals",
        "trees",
        "vehicles_1",
        "vehicles_2",
    ]
)
# the ImageNet synsets CINIC-10 drew each class's added images from (its files are named <wnid>_<n>.png)
CINIC10_SYNSETS = (
    "n02691156",
    "n02958343",
    "n01503061",
    "n02121808",
    "n02430045",
    "n02084071",
    "n01639765",
    "n02374451",
    "n04194289",
    "n04490091",
)
CELEBA_ATTRIBUTES = tuple(
    [
        "5_o_Clock_Shadow",
        "Arched_Eyebrows",
        "Attractive",
        "Bags_Under_Eyes",
        "Bald",
        "Bangs",
        "Big_Lips",
        "Big_Nose",
        "Black_Hair",
        "Blond_Hair",
        "Blurry",
        "Brown_Hair",
        "Bushy_Eyebrows",
        "Chubby",
        "Double_Chin",
        "Eyeglasses",
        "Goatee",
        "Gray_Hair",
        "Heavy_Makeup",
        "High_Cheekbones",
        "Male",
        "Mouth_Slightly_Open",
        "Mustache",
        "Narrow_Eyes",
        "No_Beard",
        "Oval_Face",
        "Pale_Skin",
        "Pointy_Nose",
        "Receding_Hairline",
        "Rosy_Cheeks",
        "Sideburns",
        "Smiling",
        "Straight_Hair",
        "Wavy_Hair",
        "Wearing_Earrings",
        "Wearing_Hat",
        "Wearing_Lipstick",
        "Wearing_Necklace",
        "Wearing_Necktie",
        "Young",
    ]
)
CHECKSUMS = "MD5SUMS"  # the list of sums the CIFAR miniatures write into their root


def smooth_image(rng: np.random.Generator, height: int, width: int, channels: int = 3) -> np.ndarray:
    """A ``[height, width, channels]`` uint8 image of random colours blended over a coarse grid.

    Smooth content keeps JPEGs small and fast to write, and close to their pixels after compression.
    """
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), channels), dtype=np.uint8)
    mode = "RGB" if channels == 3 else "L"
    image = Image.fromarray(coarse.squeeze(-1) if channels == 1 else coarse, mode).resize(
        (width, height), Image.Resampling.BILINEAR
    )
    return np.asarray(image).reshape(height, width, channels)


# --- MNIST and EMNIST: IDX files ---------------------------------------------------------------------------------


def idx_bytes(array: np.ndarray) -> bytes:
    """A uint8 array as an IDX file: bytes 0, 0, 8 (uint8) and ndim, big-endian sizes, then the data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def write_idx(path: Path, array: np.ndarray) -> None:
    """Writes ``array`` as the uncompressed IDX file ``path``."""
    path.write_bytes(idx_bytes(array))


def write_mnist_files(root: Path, images: np.ndarray, labels: np.ndarray, num_train: int) -> None:
    """Writes ``[N, 28, 28]`` images and ``[N]`` labels as MNIST's raw files, the first ``num_train`` the
    training split, the rest ``t10k``."""
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, part in (("train", slice(0, num_train)), ("t10k", slice(num_train, None))):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images[part])
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels[part])


def write_mnist(root: Path) -> list[str]:
    """MNIST: 100 training and 20 test digits, 12 of each class over both."""
    rng = np.random.default_rng(1998)
    labels = rng.permutation(np.arange(120) % 10).astype(np.uint8)
    images = rng.integers(0, 256, (120, 28, 28), dtype=np.uint8)
    images[:, :4] = 0  # a blank top margin, as every MNIST digit has
    write_mnist_files(root, images, labels, num_train=100)
    return []


def write_emnist_files(root: Path, stored: np.ndarray, labels: np.ndarray, is_test: np.ndarray) -> None:
    """Writes EMNIST byclass's four raw files from ``[N, 28, 28]`` images *as stored* (transposed, as NIST stores
    them), their byclass labels and which of them are in the test split."""
    raw = Path(root) / "EMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, members in (("train", ~is_test), ("test", is_test)):
        write_idx(raw / f"emnist-byclass-{split}-images-idx3-ubyte", stored[members])
        write_idx(raw / f"emnist-byclass-{split}-labels-idx1-ubyte", labels[members])


def write_emnist(root: Path) -> list[str]:
    """EMNIST byclass: 14 images of each letter a–j (labels 36–45) and 2 of each other class, 1 in 7 in the test
    split."""
    rng = np.random.default_rng(2017)
    labels = rng.permutation(np.concatenate([np.repeat(np.arange(36, 46), 14), np.repeat(np.arange(62), 2)]))
    upright = rng.integers(0, 256, (labels.size, 28, 28), dtype=np.uint8)
    upright[:, :, :3] = 0  # a blank left margin: upright and stored orientations differ
    write_emnist_files(root, upright.transpose(0, 2, 1), labels.astype(np.uint8), np.arange(labels.size) % 7 == 6)
    return []


# --- CelebA ------------------------------------------------------------------------------------------------------


def write_celeba_files(
    root: Path, rows: Sequence[tuple[str, int, int]], image: Callable[[int], Image.Image], seed: int = 0
) -> None:
    """Writes torchvision's CelebA layout under ``root/celeba``: ``rows`` are (file name, identity id, Smiling ±1)
    in file order, ``image(i)`` the aligned image of row ``i``; the other 39 attributes, the boxes, landmarks and
    the evaluation split are drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "celeba"
    (folder / "img_align_celeba").mkdir(parents=True, exist_ok=True)
    for index, (name, _, _) in enumerate(rows):
        picture = image(index)
        picture.save(folder / "img_align_celeba" / name, quality=90)
    (folder / "identity_CelebA.txt").write_text("".join(f"{name} {identity}\n" for name, identity, _ in rows))
    smiling = CELEBA_ATTRIBUTES.index("Smiling")
    lines = [f"{len(rows)}", " ".join(CELEBA_ATTRIBUTES) + " "]  # the real header ends in a space
    for name, _, smile in rows:
        values = rng.choice([-1, 1], len(CELEBA_ATTRIBUTES))
        values[smiling] = smile
        lines.append(name + "".join(f" {value:2d}" for value in values))  # values right-aligned in 2 columns
    (folder / "list_attr_celeba.txt").write_text("\n".join(lines) + "\n")
    # the first 80 % of the images train, then 10 % validate, 10 % test, in file order as the real split
    split = np.digitize(np.arange(len(rows)) / max(len(rows), 1), [0.8, 0.9])
    (folder / "list_eval_partition.txt").write_text(
        "".join(f"{name} {part}\n" for (name, _, _), part in zip(rows, split, strict=True))
    )
    boxes = [f"{len(rows)}", "image_id x_1 y_1 width height"]
    boxes += [f"{name:<10} {' '.join(f'{v:5d}' for v in rng.integers(20, 400, 4))}" for name, _, _ in rows]
    (folder / "list_bbox_celeba.txt").write_text("\n".join(boxes) + "\n")
    marks = [f"{len(rows)}", "lefteye_x lefteye_y righteye_x righteye_y nose_x nose_y leftmouth_x leftmouth_y "]
    marks[1] += "rightmouth_x rightmouth_y"
    marks += [f"{name:<10} {' '.join(f'{v:4d}' for v in rng.integers(60, 160, 10))}" for name, _, _ in rows]
    (folder / "list_landmarks_align_celeba.txt").write_text("\n".join(marks) + "\n")


# celebrities by identity id and their number of images; 9256 has fewer than LEAF's 5 and is dropped
CELEBA_CELEBRITIES = {2880: 6, 2937: 5, 3227: 7, 4153: 6, 5805: 5, 8692: 8, 9256: 3}


def write_celeba(root: Path) -> list[str]:
    """CelebA: 40 aligned 178×218 JPEGs of 7 celebrities (6 with at least 5 images), shuffled in file order."""
    rng = np.random.default_rng(2015)
    identities = rng.permutation([identity for identity, count in CELEBA_CELEBRITIES.items() for _ in range(count)])
    smiles = rng.choice([-1, 1], identities.size)
    pairs = zip(identities.tolist(), smiles.tolist(), strict=True)
    rows = [(f"{i + 1:06d}.jpg", identity, smile) for i, (identity, smile) in enumerate(pairs)]
    pixels = [smooth_image(rng, 218, 178) for _ in rows]
    write_celeba_files(root, rows, lambda index: Image.fromarray(pixels[index]), seed=2015)
    return []


# --- CIFAR-10 and CIFAR-100: pickled batches with a list of sums ---------------------------------------------------


def _pickle(path: Path, entry: dict) -> None:
    # protocol 2, as the Python 2 pickles of the real archives
    path.write_bytes(pickle.dumps(entry, protocol=2))


def write_checksums(root: Path, paths: Sequence[Path]) -> Path:
    """Writes ``root/MD5SUMS`` in ``md5sum``'s format for ``paths`` (relative to ``root``); returns it."""
    lines = [f"{hashlib.md5(path.read_bytes()).hexdigest()}  {path.relative_to(root).as_posix()}\n" for path in paths]
    (Path(root) / CHECKSUMS).write_text("".join(lines))
    return Path(root) / CHECKSUMS


def write_cifar10_files(root: Path, batches: Sequence[tuple[np.ndarray, Sequence[int]]]) -> list[str]:
    """Writes ``cifar-10-batches-py/`` from six (``[n, 3072]`` uint8 rows of R, G then B planes, labels) batches, the
    last the test batch, with ``batches.meta``, ``readme.html`` and the list of sums; returns the checksums flag."""
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, len(batches))] + ["test_batch"]
    offset = 0
    for number, (name, (data, labels)) in enumerate(zip(names, batches, strict=True), start=1):
        title = "testing batch 1 of 1" if name == "test_batch" else f"training batch {number} of {len(names) - 1}"
        files = [f"{CIFAR10_CLASSES[label]}_s_{offset + i:06d}.png" for i, label in enumerate(labels)]
        _pickle(folder / name, {"batch_label": title, "labels": list(labels), "data": data, "filenames": files})
        offset += len(labels)
    meta = {"num_cases_per_batch": len(batches[0][1]), "label_names": list(CIFAR10_CLASSES), "num_vis": 3072}
    _pickle(folder / "batches.meta", meta)
    (folder / "readme.html").write_text(
        '<meta HTTP-EQUIV="REFRESH" content="0; url=http://www.cs.toronto.edu/~kriz/cifar.html">\n'
    )
    listed = write_checksums(root, [folder / name for name in [*names, "batches.meta"]])
    return [f"--data.dataset.init_args.checksums={listed}"]


def write_cifar10(root: Path) -> list[str]:
    """CIFAR-10: five training batches of 20 images and a test batch of 20, every class twice per batch."""
    rng = np.random.default_rng(2009)
    batches = []
    for _ in range(6):
        labels = rng.permutation(np.arange(20) % 10).tolist()
        data = np.stack([smooth_image(rng, 32, 32).transpose(2, 0, 1).reshape(3072) for _ in labels])
        batches.append((data, labels))
    return write_cifar10_files(root, batches)


def write_cifar100_files(
    root: Path, train: tuple[np.ndarray, Sequence[int]], test: tuple[np.ndarray, Sequence[int]]
) -> list[str]:
    """Writes ``cifar-100-python/{train,test,meta}`` from (``[n, 3072]`` uint8 rows, fine labels) and the list of
    sums; returns the checksums flag. Coarse labels follow the fine ones by a fixed table."""
    folder = Path(root) / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    for name, (data, fine) in (("train", train), ("test", test)):
        entry = {
            "filenames": [f"{CIFAR100_CLASSES[label]}_s_{i:06d}.png" for i, label in enumerate(fine)],
            "batch_label": f"{'training' if name == 'train' else 'testing'} batch 1 of 1",
            "fine_labels": list(fine),
            "coarse_labels": [label % len(CIFAR100_SUPERCLASSES) for label in fine],
            "data": data,
        }
        _pickle(folder / name, entry)
    _pickle(
        folder / "meta",
        {"fine_label_names": list(CIFAR100_CLASSES), "coarse_label_names": list(CIFAR100_SUPERCLASSES)},
    )
    listed = write_checksums(root, [folder / name for name in ("train", "test", "meta")])
    return [f"--data.dataset.init_args.checksums={listed}"]


def write_cifar100(root: Path) -> list[str]:
    """CIFAR-100: 200 training images (2 per class) and 100 test images (1 per class)."""
    rng = np.random.default_rng(2010)
    splits = []
    for per_class in (2, 1):
        labels = rng.permutation(np.arange(100 * per_class) % 100).tolist()
        data = np.stack([smooth_image(rng, 32, 32).transpose(2, 0, 1).reshape(3072) for _ in labels])
        splits.append((data, labels))
    return write_cifar100_files(root, *splits)


# --- CINIC-10 and TinyImageNet: folders of image files ---------------------------------------------------------------


CINIC10_SIZES = {"train": 10, "valid": 2, "test": 2}  # images per class and split


def write_cinic10(root: Path) -> list[str]:
    """CINIC-10: 10, 2 and 2 PNGs per class in train, valid and test; even ones named as CIFAR-10's images
    (``cifar10-<split>-<n>.png``), odd ones as the ImageNet ones (``<wnid>_<n>.png``)."""
    rng = np.random.default_rng(2018)
    for split, count in CINIC10_SIZES.items():
        for label, name in enumerate(CIFAR10_CLASSES):
            folder = Path(root) / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                number = 1000 * label + 37 * i
                file = f"cifar10-{split}-{number}.png" if i % 2 == 0 else f"{CINIC10_SYNSETS[label]}_{number}.png"
                Image.fromarray(smooth_image(rng, 32, 32)).save(folder / file)
    return []


def tiny_imagenet_wnids() -> list[str]:
    """The miniature's 200 WordNet ids, sorted (``n`` and eight digits, as real wnids)."""
    return [f"n{1440764 + 7919 * index:08d}" for index in range(200)]


TINY_IMAGENET_VAL = 20  # annotated validation images
TINY_IMAGENET_TEST = 4  # unlabelled test images
TINY_IMAGENET_GREY = 7  # the class whose training image is a greyscale JPEG, as some real ones are


def write_tiny_imagenet(root: Path) -> list[str]:
    """TinyImageNet: one 64×64 training JPEG per class (one of them greyscale), 20 annotated validation JPEGs and
    4 test JPEGs; ``wnids.txt`` lists the classes in a shuffled order, as the real file does not sort them."""
    rng = np.random.default_rng(2015)
    root = Path(root)
    wnids = tiny_imagenet_wnids()
    root.mkdir(parents=True, exist_ok=True)
    (root / "wnids.txt").write_text("".join(f"{wnid}\n" for wnid in rng.permutation(wnids)))
    extra = ["n00001740\tentity", "n00001930\tphysical entity"]  # words.txt covers all of WordNet
    (root / "words.txt").write_text(
        "\n".join([*extra, *(f"{w}\tthing {i}, object {i}" for i, w in enumerate(wnids))]) + "\n"
    )

    def jpeg(path: Path, grey: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = smooth_image(rng, 64, 64, channels=1 if grey else 3)
        Image.fromarray(pixels[..., 0] if grey else pixels).save(path, format="JPEG", quality=90)

    for index, wnid in enumerate(wnids):
        jpeg(root / "train" / wnid / "images" / f"{wnid}_0.JPEG", grey=index == TINY_IMAGENET_GREY)
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text(
            f"{wnid}_0.JPEG\t{index % 20}\t5\t{40 + index % 24}\t60\n"
        )
    annotations = []
    for i in range(TINY_IMAGENET_VAL):
        jpeg(root / "val" / "images" / f"val_{i}.JPEG")
        annotations.append(f"val_{i}.JPEG\t{wnids[int(rng.integers(200))]}\t{i}\t{2 * i}\t{40 + i}\t63\n")
    (root / "val" / "val_annotations.txt").write_text("".join(annotations))
    for i in range(TINY_IMAGENET_TEST):
        jpeg(root / "test" / "images" / f"test_{i}.JPEG")
    return []


DIRICHLET_CLIENTS = "--data.partitioner.init_args.num_clients=4"

MINIATURES: list[Miniature] = [
    Miniature("MNIST", write_mnist, ("--data.partitioner.init_args.num_clients=10",)),
    Miniature(
        "FEMNIST",
        write_emnist,
        (
            "--data.dataset.init_args.images_per_class=12",
            "--data.partitioner.init_args.num_clients=5",
            # σ = 0 gives every user e^4 + 5 ≈ 60 samples, 11 of each of its 5 letters: within 12 per letter
            "--data.partitioner.init_args.sigma=0.0",
        ),
    ),
    Miniature("CelebA", write_celeba),
    Miniature("CIFAR10", write_cifar10, (DIRICHLET_CLIENTS,)),
    Miniature("CIFAR100", write_cifar100, (DIRICHLET_CLIENTS,)),
    # a miniature is a subset of the published counts, and says so as a user's subset would
    Miniature("CINIC10", write_cinic10, (DIRICHLET_CLIENTS, "--data.dataset.init_args.subset=true")),
    Miniature("TinyImageNet", write_tiny_imagenet, (DIRICHLET_CLIENTS, "--data.dataset.init_args.subset=true")),
]
