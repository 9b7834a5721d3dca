"""MNIST-style image/label pairs: find the IDX files, check them, serve tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from hetfair.errors import DataError

from .idx import read_idx

IMAGE_SIZE = 28
NUM_CLASSES = 10


def idx_file_names(prefix: str, kind: str) -> list[str]:
    """Accepted names of one file, e.g. ``("train", "images")`` -> ``train-images-idx3-ubyte.gz``, ...

    Both the original naming (``train-images-idx3-ubyte``) and the one of some
    re-distributions (``train-images.idx3-ubyte``) are accepted, gzipped or not.
    """
    idx = "idx3" if kind == "images" else "idx1"
    stems = [f"{prefix}-{kind}-{idx}-ubyte", f"{prefix}-{kind}.{idx}-ubyte"]
    return [stem + suffix for stem in stems for suffix in (".gz", "")]


def find_idx_file(data_dir: Path, prefix: str, kind: str) -> Path:
    """The first existing file of :func:`idx_file_names` in ``data_dir``."""
    names = idx_file_names(prefix, kind)
    for name in names:
        if (data_dir / name).is_file():
            return data_dir / name
    raise DataError(f"--data {data_dir}: no {prefix} {kind} file; looked for {', '.join(names)}")


def load_images(path: Path) -> np.ndarray:
    """``[N, 28, 28]`` uint8 images from an IDX file, checked."""
    images = read_idx(path)
    if images.dtype != np.uint8:
        raise DataError(f"{path}: images must be unsigned bytes (IDX type 0x08), found {images.dtype.name}")
    if images.ndim != 3 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise DataError(
            f"{path}: expected images of shape N x {IMAGE_SIZE} x {IMAGE_SIZE}, "
            f"found {' x '.join(map(str, images.shape))}"
        )
    return images


def load_labels(path: Path) -> np.ndarray:
    """``[N]`` uint8 labels in ``0..9`` from an IDX file, checked."""
    labels = read_idx(path)
    if labels.dtype != np.uint8:
        raise DataError(f"{path}: labels must be unsigned bytes (IDX type 0x08), found {labels.dtype.name}")
    if labels.ndim != 1:
        raise DataError(f"{path}: labels must be one-dimensional, found {labels.ndim} dims")
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        raise DataError(
            f"{path}: label {labels[bad[0]]} at index {bad[0]} is outside 0..{NUM_CLASSES - 1} "
            f"({bad.size} bad labels in all)"
        )
    return labels


def load_pair(data_dir: Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of ``prefix`` (``train`` or ``t10k``) in ``data_dir``, counts checked."""
    images_path = find_idx_file(data_dir, prefix, "images")
    labels_path = find_idx_file(data_dir, prefix, "labels")
    images, labels = load_images(images_path), load_labels(labels_path)
    if len(images) != len(labels):
        raise DataError(
            f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels"
        )
    return images, labels


def pixel_stats(images: np.ndarray) -> tuple[float, float]:
    """``(mean, std)`` of all pixels of uint8 ``images``, from their 256-bin histogram.

    The histogram is exact and one pass over the bytes: 0.1 s for 60k images,
    where ``images.std(dtype=float64)`` converts every pixel and takes seconds.
    """
    counts = torch.from_numpy(np.ascontiguousarray(images)).reshape(-1).bincount(minlength=256).double()
    values = torch.arange(256, dtype=torch.float64)
    total = counts.sum()
    mean = (counts * values).sum() / total
    variance = (counts * (values - mean) ** 2).sum() / total
    return float(mean), float(variance.sqrt())


class ImageClassificationDataset(Dataset):
    """``(image float32 [1, 28, 28], label int)`` items standardised as ``(pixel - mean) / std``.

    All images are converted once into one float tensor (188 MB for 60k): a
    DataLoader epoch then takes 0.2 s instead of 0.9 s converting uint8 per item.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, mean: float, std: float) -> None:
        pixels = torch.from_numpy(np.ascontiguousarray(images)).unsqueeze(1).to(torch.float32)
        self.images = pixels.sub_(mean).div_(std)
        self.labels = labels.astype(np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])
