"""Where the ``mnist`` task finds MNIST or Fashion-MNIST: the cache, a system copy, or a checksummed download.

In that order. The first that holds all four IDX files is used, and one log line
says which; if none does, one error says why each failed and what fixes it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from hetfair.errors import DataError

from .mnist_data import find_idx_file
from .mnist_download import fetch_files, is_cached

logger = logging.getLogger(__name__)

FILE_PREFIXES = (("train", "images"), ("train", "labels"), ("t10k", "images"), ("t10k", "labels"))


@dataclass(frozen=True)
class ImageDataset:
    """A data set of four MNIST-style IDX files and where to get them."""

    name: str
    """The ``--dataset`` value (also the cache subdirectory)."""
    title: str
    mirrors: tuple[str, ...]
    """URLs of directories serving the four ``.gz`` files."""
    sha256: Mapping[str, str]
    """SHA-256 of each file as the mirrors serve it."""
    system_dir: Optional[Path] = None
    """Where an operating-system package installs the files."""
    system_package: Optional[str] = None
    """The Debian package that installs them there."""


MNIST = ImageDataset(
    "mnist", "MNIST",
    mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/", "https://storage.googleapis.com/cvdf-datasets/mnist/"),
    sha256={  # the files as distributed by LeCun et al. (and mirrored unchanged)
        "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
        "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
        "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
        "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
    },
)
FASHION_MNIST = ImageDataset(
    "fashion-mnist", "Fashion-MNIST",
    mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
    sha256={  # the files as Zalando Research distributes them (Debian's package recompresses them)
        "train-images-idx3-ubyte.gz": "08dc20ab1689590a0bcd66e874647b6ee8464e2d501b5a3f1f78831db19a3fdc",
        "train-labels-idx1-ubyte.gz": "b0197879cbda89f3dc7b894f9fd52b858e68ea4182b6947c9d8c2b67e5f18dcc",
        "t10k-images-idx3-ubyte.gz": "78dcbbfb5a27efaf1b6c1d616caca68560be8766c5bffcb2791df9273a534229",
        "t10k-labels-idx1-ubyte.gz": "42bd18137a62d5998cdeae52bf3a0676ac6b706f5cf8439b47bb5b151ae3dccf",
    },
    system_dir=Path("/usr/share/datasets/fashion-mnist"),
    system_package="dataset-fashion-mnist",
)
DATASETS: dict[str, ImageDataset] = {dataset.name: dataset for dataset in (MNIST, FASHION_MNIST)}
OFFLINE_DATASET = FASHION_MNIST
"""The data set an operating-system package provides: what to train on without network."""


def locate(dataset: ImageDataset, cache_root: Path, mirrors: Optional[Sequence[str]] = None) -> Path:
    """The directory holding ``dataset``'s files: the cache, else the system copy, else a fresh download.

    ``cache_root / dataset.name`` is the cache; ``mirrors`` replace the data set's own.
    """
    cache_dir = Path(cache_root).expanduser() / dataset.name
    if is_cached(cache_dir, dataset.sha256):
        logger.info(f"data | {dataset.title} from the cache {cache_dir}")
        return cache_dir
    system_problem = _system_copy_problem(dataset)
    if system_problem is None:
        assert dataset.system_dir is not None
        logger.info(f"data | {dataset.title} from the system copy {dataset.system_dir} "
                    f"(Debian package {dataset.system_package})")
        return dataset.system_dir
    cache_problem = _cache_problem(cache_dir, dataset)
    logger.info(f"data | {dataset.title} is in neither the cache nor a system copy: downloading it into {cache_dir}")
    try:
        fetch_files(cache_dir, mirrors or dataset.mirrors, dataset.sha256)
    except DataError as exc:
        raise DataError(
            f"no {dataset.title} data: (1) the cache {cache_dir} {cache_problem}; (2) {system_problem}; "
            f"(3) the download failed: {exc}. To fix it, {_fix(dataset, cache_dir)}"
        ) from exc
    logger.info(f"data | {dataset.title} downloaded into {cache_dir} (SHA-256 verified)")
    return cache_dir


def _system_copy_problem(dataset: ImageDataset) -> Optional[str]:
    """Why the system copy cannot be used (``None``: it can)."""
    if dataset.system_dir is None:
        return f"no system package provides {dataset.title}"
    try:
        for prefix, kind in FILE_PREFIXES:
            find_idx_file(dataset.system_dir, prefix, kind)
    except DataError:
        return f"there is no system copy in {dataset.system_dir} (Debian package {dataset.system_package})"
    return None


def _cache_problem(cache_dir: Path, dataset: ImageDataset) -> str:
    if not cache_dir.is_dir():
        return "does not exist"
    missing = [name for name in dataset.sha256 if not (cache_dir / name).is_file()]
    if missing:
        return f"lacks {', '.join(missing)}"
    return "holds files whose SHA-256 is not the published one"


def _fix(dataset: ImageDataset, cache_dir: Path) -> str:
    """What fixes a missing data set, as commands to run (nothing to install when the offline data set is)."""
    own_files = (f"copy the four files {', '.join(dataset.sha256)} into {cache_dir} "
                 f"(or pass --data DIR naming their directory)")
    if dataset is OFFLINE_DATASET:
        return f"{_install_command()} (or pass --data DIR naming a directory with the four IDX files)"
    if _system_copy_problem(OFFLINE_DATASET) is None:
        return (f"train with --dataset {OFFLINE_DATASET.name} instead: {OFFLINE_DATASET.title} is installed "
                f"in {OFFLINE_DATASET.system_dir}; or {own_files}")
    return f"{_install_command()} and train with --dataset {OFFLINE_DATASET.name} instead, or {own_files}"


def _install_command() -> str:
    sudo = "" if os.geteuid() == 0 else "sudo "
    return f"run `{sudo}apt-get install {OFFLINE_DATASET.system_package}`"
