"""The ``mnist`` task: 10-class classification of 28x28 images in IDX files (MNIST, Fashion-MNIST)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from hetfair import register_task
from hetfair.errors import DataError
from hetfair.tasks import Task

from .mnist_data import ImageClassificationDataset, load_pair, pixel_stats
from .mnist_sources import DATASETS, locate

SPLITS = ("train", "valid", "test")
HELD_OUT_SEED = 1998
"""Seeds which training images are held out as ``valid``: fixed, so that every run (whatever its
``--seed``) and ``hetfair-validate`` hold out the same ones."""
logger = logging.getLogger(__name__)


def valid_size(text: str) -> int | float:
    """``--valid-size``: a number of images (``5000``, ``0`` for none) or a fraction of them (``0.1``)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value >= 0 and value.is_integer():
        return int(value)
    if 0 < value < 1:
        return value
    raise argparse.ArgumentTypeError(f"'{text}' is neither a number of images nor a fraction between 0 and 1")


@register_task("mnist")
class MnistTask(Task):
    """Classify MNIST-style digits or clothes: ``--valid-size`` training images are held out as ``valid``
    (at random, the same ones in every run), ``test`` is the t10k files.

    Without ``--data``, ``--dataset`` (MNIST or Fashion-MNIST) is looked up in the
    cache, then in the system copy, then downloaded (see :mod:`.mnist_sources`).
    """

    option_defaults: ClassVar[dict[str, Any]] = {
        "criterion": "cross_entropy",
        "arch": "mnist_cnn",
        "optimizer": "adam",
        "lr": 1e-3,
        "max_sentences": 64,
        "max_epoch": 1,
    }
    network_options: ClassVar[tuple[str, ...]] = ("mnist_mirror",)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dataset", choices=sorted(DATASETS), default="mnist",
                            help="which data set to train on when --data is not given: looked up in the cache, "
                                 "then the system copy (Debian's dataset-fashion-mnist has Fashion-MNIST), then "
                                 "downloaded and checked against its SHA-256 (default: %(default)s)")
        parser.add_argument("--mnist-cache-dir", default="~/.cache/hetfair", metavar="DIR",
                            help="the cache: data sets are downloaded into DIR/mnist and DIR/fashion-mnist "
                                 "(default: %(default)s)")
        parser.add_argument("--mnist-mirror", action="append", metavar="URL",
                            help="download from URL (a directory holding the four .gz files; repeatable) "
                                 "instead of the data set's own mirrors")
        parser.add_argument("--valid-size", type=valid_size, default=0.1, metavar="N",
                            help="hold out N training images (or a fraction of them, such as 0.1), chosen at random "
                                 "but the same in every run, as the 'valid' split that picks checkpoint_best.pt; "
                                 "'test' is the t10k files (0: 'valid' is the t10k files too) (default: %(default)s)")
        parser.add_argument("--max-images", type=int, default=0, metavar="N",
                            help="use only the first N images of each split, for a quick trial run "
                                 "(default 0: all of them)")
        parser.add_argument("--no-normalize", action="store_true",
                            help="scale pixels to [0, 1] only, instead of standardising them with the "
                                 "mean and std of the training images")

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._pixel_stats: tuple[float, float] | None = None
        self._dir: Path | None = None

    def load_dataset(self, split: str) -> ImageClassificationDataset:
        if split not in SPLITS:
            raise DataError(f"task mnist has no split '{split}'; splits: {', '.join(SPLITS)}")
        images, labels = self._split_arrays(split)
        mean, std = self._normalisation()
        return ImageClassificationDataset(images, labels, mean, std)

    def _split_arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """Images and labels of ``split``: its first ``--max-images`` ones, if given."""
        limit = self.args.max_images
        if limit < 0:
            raise DataError(f"--max-images must be at least 0 (0: all images), got {limit}")
        images, labels = self._whole_split(split)
        return (images[:limit], labels[:limit]) if limit else (images, labels)

    def _whole_split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """``test`` is the t10k files; ``valid`` the ``--valid-size`` held-out training images, ``train`` the rest."""
        if split == "test" or (split == "valid" and self.args.valid_size == 0):
            return self._file_pair("t10k")
        images, labels = self._file_pair("train")
        held_out = self._held_out(len(images))
        keep = held_out if split == "valid" else ~held_out
        return images[keep], labels[keep]

    def _held_out(self, count: int) -> np.ndarray:
        """Which of ``count`` training images are ``valid``: ``--valid-size`` of them, the same in every run."""
        given = self.args.valid_size
        size = round(given * count) if isinstance(given, float) else given
        if not 0 <= size < count:
            raise DataError(f"--valid-size {given} holds out {size} of the {count} training images; "
                            f"it must leave some to train on")
        mask = np.zeros(count, dtype=bool)
        mask[np.random.default_rng(HELD_OUT_SEED).permutation(count)[:size]] = True
        return mask

    def _file_pair(self, prefix: str) -> tuple[np.ndarray, np.ndarray]:
        if prefix not in self._arrays:
            self._arrays[prefix] = load_pair(self._data_dir(), prefix)
        return self._arrays[prefix]

    def _data_dir(self) -> Path:
        if self._dir is None:
            self._dir = self._find_data_dir()
        return self._dir

    def _find_data_dir(self) -> Path:
        if self.args.data:
            data_dir = Path(self.args.data).expanduser()
            if data_dir.exists() and not data_dir.is_dir():
                raise DataError(f"--data {self.args.data} is a file, not a directory; give the directory that holds "
                                f"the four IDX files")
            if not data_dir.is_dir():
                raise DataError(f"--data {self.args.data}: no such directory")
            logger.info(f"data | MNIST-style files from --data {data_dir}")
            return data_dir
        dataset = DATASETS[getattr(self.args, "dataset", "mnist")]  # checkpoints of older runs lack --dataset
        return locate(dataset, Path(self.args.mnist_cache_dir), self.args.mnist_mirror)

    def _normalisation(self) -> tuple[float, float]:
        """``(mean, std)`` in pixel units: of the training images, or ``(0, 255)`` with ``--no-normalize``."""
        if self.args.no_normalize:
            return 0.0, 255.0
        if self._pixel_stats is None:
            images = self._split_arrays("train")[0]
            self._pixel_stats = pixel_stats(images)
        return self._pixel_stats
