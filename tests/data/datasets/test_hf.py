"""``HFDataset`` on datasets saved locally (``save_to_disk``, parquet), offline, and without the library."""

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedlight.data import FederatedDataModule, HFDataset
from fedlight.data.partition import Dirichlet, Natural
from fedlight.errors import ConfigError


def hf_library():
    """Hugging Face's datasets library, or a skip where the hf extra is not installed.

    ``datasets.arrow_dataset`` rather than ``datasets``: this folder, tests/data/datasets/, is itself importable as a
    namespace package called ``datasets`` once tests/data is on the path.
    """
    pytest.importorskip("datasets.arrow_dataset", reason="the hf extra (pip install datasets)")
    import datasets

    return datasets


REPO = Path(__file__).resolve().parents[3]


def test_without_the_library_the_error_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # what find_spec sees when it is not installed
    with pytest.raises(ConfigError, match=r"datasets library, which is not installed: pip install -e \"\.\[hf\]\""):
        HFDataset("flwrlabs/femnist", num_classes=62, input_shape=(1, 28, 28))


def test_a_folder_named_datasets_on_the_path_is_not_taken_for_the_library(tmp_path, monkeypatch) -> None:
    (tmp_path / "datasets").mkdir()  # a project's data folder: importable as a namespace package, not the library
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "datasets", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(  # the library itself hidden, as on a machine without the hf extra
        importlib.util, "find_spec", lambda name, *a: real(name, *a) if name != "datasets" else _namespace(tmp_path)
    )
    with pytest.raises(ConfigError, match=r"datasets library, which is not installed"):
        HFDataset("flwrlabs/femnist", num_classes=62, input_shape=(1, 28, 28))


def _namespace(folder: Path) -> importlib.machinery.ModuleSpec:
    """The spec Python's path finder gives a folder without ``__init__.py``."""
    return importlib.machinery.PathFinder.find_spec("datasets", [str(folder)])


@pytest.fixture
def saved(tmp_path):
    """A DatasetDict like flwrlabs/femnist's columns: 12 grey 6×5 images, 3 letters, 3 writers; a 4-image test."""
    datasets = hf_library()
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (16, 6, 5), dtype=np.uint8)
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "character": datasets.ClassLabel(names=["a", "b", "c"]),
            "writer_id": datasets.Value("string"),
        }
    )

    def split(rows):
        return datasets.Dataset.from_dict(
            {
                "image": [Image.fromarray(pixels[i], mode="L") for i in rows],
                "character": [i % 3 for i in rows],
                "writer_id": [f"w{i % 4 // 2}" if i < 12 else "t" for i in rows],
            },
            features=features,
        )

    folder = tmp_path / "femnist_like"
    datasets.DatasetDict({"train": split(range(12)), "test": split(range(12, 16))}).save_to_disk(str(folder))
    return folder, pixels


def test_a_saved_dataset_gives_images_labels_classes_and_natural_clients(saved) -> None:
    folder, pixels = saved
    dataset = HFDataset(str(folder), label_column="character", client_column="writer_id", test_split="test")
    assert dataset.num_classes == 3 and dataset.class_names == ("a", "b", "c") and dataset.input_shape == (1, 6, 5)
    pool = dataset.load_train()
    torch.testing.assert_close(pool.inputs[:, 0], torch.from_numpy(pixels[:12]).float() / 255)
    assert pool.targets.tolist() == [i % 3 for i in range(12)]
    data = FederatedDataModule(dataset, Natural(), test_fraction=0.0)
    data.setup()
    writers = [[i for i in range(12) if i % 4 // 2 == w] for w in (0, 1)]
    assert [ix.tolist() for ix in data.client_train] == writers
    assert data.test.targets.tolist() == [0, 1, 2, 0] and data.test.groups is None


def test_a_client_column_under_another_partitioner_is_refused(saved) -> None:
    folder, _ = saved
    with pytest.raises(ConfigError, match=r"client_column=writer_id.*Natural.*client_column=null"):
        FederatedDataModule(HFDataset(str(folder), label_column="character", client_column="writer_id"), Dirichlet())
    two = Dirichlet(num_clients=2, alpha=1.0, min_size=1)
    data = FederatedDataModule(HFDataset(str(folder), label_column="character"), two, test_fraction=0.0)
    data.setup()
    assert data.num_clients == 2 and sum(len(ix) for ix in data.client_train) == 12


def test_images_are_converted_and_resized_and_a_wrong_column_is_named(saved) -> None:
    folder, _ = saved
    dataset = HFDataset(str(folder), label_column="character", image_mode="RGB", image_size=4)
    assert dataset.input_shape == (3, 4, 4) and dataset.load_train().inputs.shape == (12, 3, 4, 4)
    with pytest.raises(ConfigError, match=r"no column 'label'.*'character'"):
        HFDataset(str(folder), num_classes=3, input_shape=(1, 6, 5)).load_train()
    with pytest.raises(ConfigError, match=r"splits \['test', 'train'\], not 'validation'"):
        HFDataset(str(folder), split="validation", label_column="character")


def test_a_local_parquet_file_with_array_inputs(tmp_path) -> None:
    datasets = hf_library()
    inputs = np.arange(30, dtype=np.float32).reshape(10, 3)
    table = datasets.Dataset.from_dict({"x": inputs.tolist(), "y": [0, 1] * 5})
    table.to_parquet(str(tmp_path / "mine.parquet"))
    dataset = HFDataset(str(tmp_path / "mine.parquet"), image_column="x", label_column="y")
    assert dataset.num_classes == 2 and dataset.input_shape == (3,)
    torch.testing.assert_close(dataset.load_train().inputs, torch.from_numpy(inputs))


OFFLINE_CHILD = """
import sys
from fedlight.data import HFDataset
from fedlight.errors import ConfigError

local = HFDataset(sys.argv[1], image_column="x", label_column="y")
print("local", len(local.load_train()))
try:
    HFDataset("someone/not-in-the-cache", num_classes=2, input_shape=(3,)).load_train()
except ConfigError as error:
    print("error", " ".join(str(error).split()))
"""


def test_offline_a_local_file_reads_and_an_uncached_hub_dataset_names_the_cache(tmp_path) -> None:
    datasets = hf_library()
    datasets.Dataset.from_dict({"x": [[1.0, 2.0, 3.0]] * 4, "y": [0, 1, 0, 1]}).to_parquet(str(tmp_path / "m.parquet"))
    cache = tmp_path / "cache"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)}
    env["PYTHONPATH"] = str(REPO)
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(OFFLINE_CHILD))
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "m.parquet")], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert "local 4" in lines
    error = next(line for line in lines if line.startswith("error "))
    assert "someone/not-in-the-cache" in error and "HF_DATASETS_OFFLINE is set" in error and str(cache) in error
