"""``download: true`` without a network: miniature archives served from 127.0.0.1 with their checksums.

Each test writes a small archive in the dataset's official layout, serves it over HTTP on the loopback
interface, points the reader's source (torchvision's class attribute or fedlight's URL constant) at it and
checks that the downloaded, unpacked files are read back as written. A refused connection and a checksum that
does not match give the one error that names the URL and the folder.
"""

import functools
import gzip
import hashlib
import io
import pickle
import tarfile
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from miniatures.classification import idx_bytes
from PIL import Image
from scipy.io import savemat
from torchvision.datasets import CIFAR10 as TorchvisionCIFAR10
from torchvision.datasets import EMNIST as TorchvisionEMNIST
from torchvision.datasets import MNIST as TorchvisionMNIST

import fedlight.data.datasets.cinic10 as cinic10_module
import fedlight.data.datasets.voc_download as voc_download
from fedlight.data import CIFAR10, CINIC10, FEMNIST, MNIST, PascalVOC, TinyImageNet
from fedlight.data.datasets.cinic10 import CLASSES
from fedlight.data.datasets.download import LOCK_FILE, fetch_archive
from fedlight.errors import ConfigError


class _QuietHandler(SimpleHTTPRequestHandler):
    requests: ClassVar[list[str]] = []  # the paths asked for with GET, in order

    def log_message(self, format, *args):
        pass

    def do_GET(self):
        _QuietHandler.requests.append(self.path)
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    """Serves ``tmp_path/served`` on a free loopback port; yields the folder and its base URL."""
    folder = tmp_path / "served"
    folder.mkdir()
    _QuietHandler.requests.clear()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def closed_port():
    """A loopback URL nothing listens on: connections are refused, as offline."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    port = httpd.server_address[1]
    httpd.server_close()
    return f"http://127.0.0.1:{port}/"


def md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def serve_mnist(folder) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """Writes MNIST's four gzipped IDX files (12 training, 8 test images); returns the images and the resources."""
    images = np.random.default_rng(0).integers(0, 256, (20, 28, 28), dtype=np.uint8)
    labels = np.arange(20, dtype=np.uint8) % 10
    resources = []
    for prefix, part in (("train", slice(0, 12)), ("t10k", slice(12, None))):
        for kind, array in (("images-idx3", images[part]), ("labels-idx1", labels[part])):
            name = f"{prefix}-{kind}-ubyte.gz"
            (folder / name).write_bytes(gzip.compress(idx_bytes(array)))
            resources.append((name, md5(folder / name)))
    return images, resources


def test_mnist_downloads_from_its_mirror_and_checks_every_file(tmp_path, server, monkeypatch) -> None:
    folder, url = server
    images, resources = serve_mnist(folder)
    monkeypatch.setattr(TorchvisionMNIST, "mirrors", [url])
    monkeypatch.setattr(TorchvisionMNIST, "resources", resources)
    root = tmp_path / "data"
    pool = MNIST(root=str(root), standardize=False, download=True).load_train()
    torch.testing.assert_close(pool.inputs[:, 0], torch.from_numpy(images).float() / 255)
    assert pool.targets.tolist() == [i % 10 for i in range(20)]
    assert (root / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file()
    # a second load finds the files and needs no server
    monkeypatch.setattr(TorchvisionMNIST, "mirrors", ["http://127.0.0.1:9/"])
    assert len(MNIST(root=str(root), download=True).load_train()) == 20


def test_processes_of_one_run_download_each_file_once(tmp_path, server, monkeypatch) -> None:
    folder, url = server
    images, resources = serve_mnist(folder)
    monkeypatch.setattr(TorchvisionMNIST, "mirrors", [url])
    monkeypatch.setattr(TorchvisionMNIST, "resources", resources)
    MNIST(root=str(tmp_path / "alone"), download=True).load_train()
    alone = sorted(_QuietHandler.requests)  # what one process asks the server for
    _QuietHandler.requests.clear()

    def load(_):
        return MNIST(root=str(tmp_path / "together"), standardize=False, download=True).load_train().inputs

    with ThreadPoolExecutor(max_workers=3) as pool:  # the lock is per open file, so threads contend like processes
        pools = list(pool.map(load, range(3)))
    assert sorted(_QuietHandler.requests) == alone, "three at once ask for what one alone does"
    assert not list((tmp_path / "together").rglob(LOCK_FILE)), "the last one out removes the lock"
    for inputs in pools:
        torch.testing.assert_close(inputs[:, 0], torch.from_numpy(images).float() / 255)


def test_mnist_download_failure_names_the_mirror_and_the_folder(tmp_path, closed_port, monkeypatch) -> None:
    monkeypatch.setattr(TorchvisionMNIST, "mirrors", [closed_port])
    root = tmp_path / "data"
    with pytest.raises(ConfigError) as error:
        MNIST(root=str(root), download=True).load_train()
    message = str(error.value)
    assert "Could not download MNIST" in message and closed_port in message
    assert str(root / "MNIST" / "raw") in message and "download=false" in message
    assert not list(root.rglob(LOCK_FILE)), "a failed download leaves no lock file behind"


def test_each_mirror_tried_is_named_with_its_own_error(tmp_path, closed_port, server, monkeypatch) -> None:
    _, empty = server  # answers 404: it serves nothing
    monkeypatch.setattr(TorchvisionMNIST, "mirrors", [closed_port, empty])
    with pytest.raises(ConfigError) as error:
        MNIST(root=str(tmp_path / "data"), download=True).load_train()
    first = str(error.value).splitlines()[0]
    tried = first.split("Tried ")[1:]
    assert [part.split(",")[0] for part in tried] == [closed_port, empty]
    for part in tried:  # every "got:" says something
        assert part.split("got:")[1].strip(" ;).")


def test_a_wrong_checksum_is_a_failed_download(tmp_path, server, monkeypatch) -> None:
    folder, url = server
    _, resources = serve_mnist(folder)
    monkeypatch.setattr(TorchvisionMNIST, "mirrors", [url])
    monkeypatch.setattr(TorchvisionMNIST, "resources", [(name, "0" * 32) for name, _ in resources])
    with pytest.raises(ConfigError, match=rf"Could not download MNIST from {url}.*corrupted"):
        MNIST(root=str(tmp_path / "data"), download=True).load_train()


def test_without_download_a_missing_dataset_says_how_to_fetch_it(tmp_path) -> None:
    with pytest.raises(ConfigError) as error:
        MNIST(root=str(tmp_path / "nowhere")).load_train()
    message = str(error.value)
    assert f"--data.dataset.init_args.root={tmp_path / 'nowhere'}" in message
    assert "download=true" in message and TorchvisionMNIST.mirrors[0] in message


def test_emnist_downloads_nist_zip_and_unpacks_its_gzip_folder(tmp_path, server, monkeypatch) -> None:
    folder, url = server
    labels = np.repeat(np.arange(36, 46, dtype=np.uint8), 2)  # the letters a–j, two images each
    images = np.random.default_rng(1).integers(0, 256, (20, 28, 28), dtype=np.uint8)
    with zipfile.ZipFile(folder / "gzip.zip", "w") as archive:
        for split, part in (("train", slice(0, 12)), ("test", slice(12, None))):
            for kind, array in (("images-idx3", images[part]), ("labels-idx1", labels[part])):
                archive.writestr(f"gzip/emnist-byclass-{split}-{kind}-ubyte.gz", gzip.compress(idx_bytes(array)))
    monkeypatch.setattr(TorchvisionEMNIST, "url", f"{url}gzip.zip")
    monkeypatch.setattr(TorchvisionEMNIST, "md5", md5(folder / "gzip.zip"))
    pool = FEMNIST(root=str(tmp_path / "data"), images_per_class=2, download=True).load_train()
    assert len(pool) == 20 and sorted(pool.targets.tolist()) == sorted((labels - 36).tolist())


def cifar_archive(folder) -> tuple[np.ndarray, dict]:
    """Writes a ``cifar-10-python.tar.gz`` of 2 images per batch; returns the training images and the md5s."""
    rng = np.random.default_rng(2)
    sums, train_images = {}, []
    with tarfile.open(folder / "cifar-10-python.tar.gz", "w:gz") as archive:
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
        for name in names:
            if name == "batches.meta":
                payload = pickle.dumps({"label_names": [f"class{k}" for k in range(10)]})
            else:
                data = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
                payload = pickle.dumps({"data": data, "labels": [1, 2]})
                if name != "test_batch":
                    train_images.append(data.reshape(-1, 3, 32, 32))
            sums[name] = hashlib.md5(payload).hexdigest()
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    return np.concatenate(train_images), sums


def test_cifar10_downloads_through_torchvision_with_its_checksums(tmp_path, server, monkeypatch) -> None:
    folder, url = server
    train_images, sums = cifar_archive(folder)
    monkeypatch.setattr(TorchvisionCIFAR10, "url", f"{url}cifar-10-python.tar.gz")
    monkeypatch.setattr(TorchvisionCIFAR10, "tgz_md5", md5(folder / "cifar-10-python.tar.gz"))
    # the archive's files are verified against their own sums, as a mirror's would be
    checksums = tmp_path / "cifar-10.md5"
    checksums.write_text("".join(f"{sum_}  cifar-10-batches-py/{name}\n" for name, sum_ in sums.items()))
    dataset = CIFAR10(root=str(tmp_path / "data"), download=True, checksums=str(checksums))
    pool, test = dataset.load_train(), dataset.load_test()
    np.testing.assert_array_equal(pool.inputs.numpy(), train_images)
    assert len(test) == 2 and test.targets.tolist() == [1, 2]


def test_cinic10_downloads_its_archive_into_root(tmp_path, server, monkeypatch) -> None:
    folder, url = server
    rng = np.random.default_rng(3)
    with tarfile.open(folder / "CINIC-10.tar.gz", "w:gz") as archive:
        for split in ("train", "valid", "test"):
            for name in CLASSES:
                buffer = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, format="PNG")
                info = tarfile.TarInfo(f"{split}/{name}/{split}_{name}.png")
                info.size = buffer.tell()
                archive.addfile(info, io.BytesIO(buffer.getvalue()))
    monkeypatch.setattr(cinic10_module, "_URL", f"{url}CINIC-10.tar.gz")
    monkeypatch.setattr(cinic10_module, "_MD5", md5(folder / "CINIC-10.tar.gz"))
    root = tmp_path / "cinic10"
    pool = CINIC10(root=str(root), subset=True, cache=False, download=True).load_train()
    assert pool.targets.tolist() == list(range(10)) and (root / "test" / "truck").is_dir()


def test_an_archive_with_another_checksum_is_refused(tmp_path, server) -> None:
    folder, url = server
    (folder / "archive.zip").write_bytes(b"not the archive")
    with pytest.raises(ConfigError) as error:
        fetch_archive("TinyImageNet", f"{url}archive.zip", "0" * 32, tmp_path / "data")
    message = str(error.value)
    assert f"{url}archive.zip" in message and str(tmp_path / "data") in message and "corrupted" in message


def test_an_unreachable_source_names_the_url_and_the_folder(tmp_path, closed_port) -> None:
    with pytest.raises(ConfigError) as error:
        fetch_archive("CINIC-10", f"{closed_port}CINIC-10.tar.gz", None, tmp_path / "cinic10")
    message = str(error.value)
    assert f"Could not download CINIC-10 from {closed_port}CINIC-10.tar.gz into {tmp_path / 'cinic10'}" in message


def test_tiny_imagenet_download_needs_the_archives_folder_name(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"root=.*/data names another: set root to .*/data/tiny-imagenet-200"):
        TinyImageNet(root=str(tmp_path / "data"), subset=True, download=True)
    TinyImageNet(root=str(tmp_path / "data"), subset=True)  # without download any folder name is fine


def _sbd_mask(image_id: str) -> np.ndarray:
    mask = np.zeros((30, 40), dtype=np.uint8)
    mask[5:15, 5:20] = {"s1": 15, "s2": 8, "v1": 3}.get(image_id, 1)  # person, cat, bird
    return mask


def test_pascal_voc_downloads_voc_and_builds_train_aug_from_sbd(tmp_path, server, monkeypatch) -> None:
    folder, url = server
    # VOC: t1 and v1 have VOC masks, t1 in train, v1 in val; SBD annotates s1, s2 and v1
    staging = tmp_path / "staging"
    voc = staging / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (voc / sub).mkdir(parents=True)
    rng = np.random.default_rng(4)
    for image_id in ("t1", "v1", "s1", "s2"):
        Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(voc / "JPEGImages" / f"{image_id}.jpg")
    for image_id, cls in (("t1", 12), ("v1", 3)):  # dog, bird
        mask = np.zeros((30, 40), dtype=np.uint8)
        mask[2:9, 2:9], mask[1, 2:9] = cls, 255
        Image.fromarray(mask).save(voc / "SegmentationClass" / f"{image_id}.png")
    (voc / "ImageSets" / "Segmentation" / "train.txt").write_text("t1\n")
    (voc / "ImageSets" / "Segmentation" / "val.txt").write_text("v1\n")
    with tarfile.open(folder / "voc.tar", "w") as archive:
        archive.add(staging / "VOCdevkit", arcname="VOCdevkit")
    sbd = tmp_path / "sbd" / "benchmark_RELEASE" / "dataset"
    (sbd / "cls").mkdir(parents=True)
    for image_id in ("s1", "s2", "v1"):
        savemat(sbd / "cls" / f"{image_id}.mat", {"GTcls": {"Segmentation": _sbd_mask(image_id)}})
    (sbd / "train.txt").write_text("s1\nv1\n")
    (sbd / "val.txt").write_text("s2\n")
    with tarfile.open(folder / "benchmark.tgz", "w:gz") as archive:
        archive.add(tmp_path / "sbd" / "benchmark_RELEASE", arcname="benchmark_RELEASE")
    monkeypatch.setattr(voc_download, "VOC_URL", f"{url}voc.tar")
    monkeypatch.setattr(voc_download, "VOC_MD5", md5(folder / "voc.tar"))
    monkeypatch.setattr(voc_download, "SBD_URL", f"{url}benchmark.tgz")
    monkeypatch.setattr(voc_download, "SBD_MD5", md5(folder / "benchmark.tgz"))

    root = tmp_path / "data" / "VOCdevkit"
    pool = PascalVOC(root=str(root), canvas_size=48, num_workers=1, download=True).load_train()
    listing = (root / "VOC2012" / "ImageSets" / "Segmentation" / "train_aug.txt").read_text().split()
    assert listing == ["s1", "s2", "t1"], "SBD's and VOC's training images, VOC's validation image v1 left out"
    assert pool.labels.tolist() == [15, 8, 12]  # person and cat from SBD's masks, dog from VOC's own
    masks = pool.targets[torch.arange(3)]
    assert masks[0, 5:15, 5:20].eq(15).all() and masks[2, 1, 2:9].eq(255).all()
    with pytest.raises(ConfigError, match=r"set root to .*/VOCdevkit"):
        PascalVOC(root=str(tmp_path / "voc"), download=True)


@pytest.fixture
def silent_source(monkeypatch):
    """A loopback URL that takes the connection and never answers, with the download timeout at 1 s."""
    import socket

    from fedlight.data.datasets import download

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # connections complete in the backlog; nothing is ever read or sent
    monkeypatch.setattr(download, "TIMEOUT_S", 1.0)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/"
    listener.close()


def test_a_source_that_never_answers_fails_after_the_timeout_like_any_download(tmp_path, silent_source, monkeypatch):
    from fedlight.data.datasets import cinic10 as cinic10_module

    monkeypatch.setattr(TorchvisionMNIST, "mirrors", [silent_source])
    monkeypatch.setattr(cinic10_module, "_URL", f"{silent_source}CINIC-10.tar.gz")
    for name, dataset in (("MNIST", MNIST(root=str(tmp_path / "m"), download=True)),
                          ("CINIC-10", CINIC10(root=str(tmp_path / "c"), subset=True, download=True))):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"Could not download {name} from {silent_source}") as error:
            dataset.load_train()
        assert "timed out" in str(error.value)  # the socket's timeout, not a refused connection


def test_an_unpacking_that_stops_part_way_leaves_no_dataset_folder_behind(tmp_path, monkeypatch):
    import torchvision.datasets.utils as tv_utils

    from fedlight.data.datasets.download import unpack_into_place

    def stops_part_way(archive, to_path):
        (Path(to_path) / "train" / "cat").mkdir(parents=True)
        (Path(to_path) / "train" / "cat" / "1.png").write_bytes(b"png")
        raise OSError("killed while unpacking")

    monkeypatch.setattr(tv_utils, "extract_archive", stops_part_way)
    with pytest.raises(OSError, match="killed while unpacking"):
        unpack_into_place(tmp_path / "CINIC-10.tar.gz", tmp_path / "cinic10")
    assert list((tmp_path / "cinic10").iterdir()) == [], "neither a partial train/ nor the staging folder is left"


def test_unpacking_merges_into_folders_that_exist_and_replaces_what_a_partial_one_left(tmp_path):
    from fedlight.data.datasets.download import unpack_into_place

    source = tmp_path / "source" / "VOCdevkit" / "VOC2012"
    source.mkdir(parents=True)
    (source / "a.jpg").write_bytes(b"whole")
    with tarfile.open(tmp_path / "voc.tar", "w") as archive:
        archive.add(tmp_path / "source" / "VOCdevkit", arcname="VOCdevkit")
    target = tmp_path / "data"
    (target / "VOCdevkit" / "SBD").mkdir(parents=True)  # another archive's folder beside it
    (target / "VOCdevkit" / "VOC2012").mkdir()
    (target / "VOCdevkit" / "VOC2012" / "a.jpg").write_bytes(b"who")  # cut short by an earlier unpacking
    unpack_into_place(tmp_path / "voc.tar", target)
    assert (target / "VOCdevkit" / "VOC2012" / "a.jpg").read_bytes() == b"whole"
    assert (target / "VOCdevkit" / "SBD").is_dir()
    assert sorted(p.name for p in target.iterdir()) == ["VOCdevkit"]
