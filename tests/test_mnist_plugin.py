"""The MNIST example plugin (``plugins/``): IDX reading, download, task, models.

Everything here is fast and offline. Training it end to end, to a test accuracy bound, is
``make demo`` in ``test_first_run.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import importlib
import logging
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import FASHION_MNIST, needs_fashion_mnist
from hetfair.errors import DataError
from hetfair.options import parse_train_args
from hetfair.plugins import import_user_dir
from hetfair_cli.train import main as train_main

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "plugins"
UNREACHABLE = "http://127.0.0.1:9/"  # the discard port: connections are refused at once

import_user_dir(PLUGIN_DIR)
idx = importlib.import_module("plugins.idx")
mnist_data = importlib.import_module("plugins.mnist_data")
mnist_download = importlib.import_module("plugins.mnist_download")
mnist_sources = importlib.import_module("plugins.mnist_sources")
MnistTask = importlib.import_module("plugins.mnist_task").MnistTask

TYPE_CODES = {"u1": 0x08, "i1": 0x09, "i2": 0x0B, "i4": 0x0C, "f4": 0x0D, "f8": 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    """``array`` encoded as an IDX file, written independently of the reader under test."""
    kind = array.dtype.str[1:]
    header = bytes([0, 0, TYPE_CODES[kind], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(">" + kind).tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool | None = None) -> Path:
    """Write ``array`` to ``path``; gzipped when ``gz`` is true (default: when the name ends in .gz)."""
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if (path.suffix == ".gz" if gz is None else gz) else data)
    return path


def write_mnist_dir(directory: Path, n_train: int = 12, n_test: int = 5, seed: int = 0) -> Path:
    """A small, valid MNIST-style data directory with random images and labels."""
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, n, dtype=np.uint8))
    return directory


def mnist_args(*extra: str) -> argparse.Namespace:
    return parse_train_args(["--user-dir", str(PLUGIN_DIR), "--task", "mnist", *extra])


def assert_one_line_naming(exc_info: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(exc_info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# -- IDX reader ------------------------------------------------------------------


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzipped"])
@pytest.mark.parametrize("kind", list(TYPE_CODES))
def test_read_idx_round_trips_every_idx_type(tmp_path: Path, kind: str, gz: bool) -> None:
    low = 0 if kind == "u1" else -100  # negative values check the sign of signed types
    array = np.random.default_rng(1).uniform(low, 100, (3, 4, 5)).astype(kind)
    result = idx.read_idx(write_idx(tmp_path / "data", array, gz=gz))
    assert result.dtype == np.dtype(kind).newbyteorder("=")
    np.testing.assert_array_equal(result, array)


def test_gzip_is_detected_by_content_not_by_name(tmp_path: Path) -> None:
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    gzipped_without_suffix = write_idx(tmp_path / "train-images-idx3-ubyte", array, gz=True)
    plain_with_gz_suffix = write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", array, gz=False)
    np.testing.assert_array_equal(idx.read_idx(gzipped_without_suffix), array)
    np.testing.assert_array_equal(idx.read_idx(plain_with_gz_suffix), array)


VALID_LABELS = idx_bytes(np.arange(10, dtype=np.uint8))
CORRUPT_IDX = {
    "wrong magic": (b"\x08\x01\x00\x00" + VALID_LABELS[4:], "not an IDX file"),
    "empty file": (b"", "not an IDX file (magic number missing"),
    "unknown type code": (b"\x00\x00\x0a\x01" + VALID_LABELS[4:], "unknown IDX data type code 0x0a"),
    "truncated header": (b"\x00\x00\x08\x03\x00\x00\x00\x02", "truncated IDX header"),
    "truncated data": (VALID_LABELS[:-1], "truncated: shape 10 of uint8 needs 10 data bytes, found 9"),
    "trailing bytes": (VALID_LABELS + b"\x00", "trailing bytes"),
    "corrupt gzip": (b"\x1f\x8b" + b"not deflate data", "corrupt gzip data"),
    "truncated gzip": (gzip.compress(VALID_LABELS)[:-6], "corrupt gzip data"),
}


@pytest.mark.parametrize("content, expected", CORRUPT_IDX.values(), ids=CORRUPT_IDX.keys())
def test_corrupt_idx_file_is_one_data_error_naming_the_file(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "labels-idx1-ubyte"
    path.write_bytes(content)
    with pytest.raises(DataError) as exc_info:
        idx.read_idx(path)
    assert_one_line_naming(exc_info, str(path), expected)


def test_missing_idx_file_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc_info:
        idx.read_idx(tmp_path / "absent")
    assert_one_line_naming(exc_info, str(tmp_path / "absent"), "cannot read")


# -- MNIST files -------------------------------------------------------------------


def test_images_of_wrong_type_are_rejected(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "images", np.zeros((2, 28, 28), dtype=np.float32))
    with pytest.raises(DataError) as exc_info:
        mnist_data.load_images(path)
    assert_one_line_naming(exc_info, str(path), "images must be unsigned bytes", "float32")


def test_images_of_wrong_shape_are_rejected(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "images", np.zeros((2, 32, 32), dtype=np.uint8))
    with pytest.raises(DataError) as exc_info:
        mnist_data.load_images(path)
    assert_one_line_naming(exc_info, str(path), "N x 28 x 28", "found 2 x 32 x 32")


def test_labels_out_of_range_are_rejected(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "labels", np.array([0, 9, 3, 12, 10], dtype=np.uint8))
    with pytest.raises(DataError) as exc_info:
        mnist_data.load_labels(path)
    assert_one_line_naming(exc_info, str(path), "label 12 at index 3 is outside 0..9", "2 bad labels")


def test_labels_of_wrong_type_or_rank_are_rejected(tmp_path: Path) -> None:
    wide = write_idx(tmp_path / "wide", np.zeros(3, dtype=np.int32))
    square = write_idx(tmp_path / "square", np.zeros((3, 3), dtype=np.uint8))
    with pytest.raises(DataError, match="labels must be unsigned bytes"):
        mnist_data.load_labels(wide)
    with pytest.raises(DataError, match="labels must be one-dimensional"):
        mnist_data.load_labels(square)


def test_image_and_label_counts_must_match(tmp_path: Path) -> None:
    write_mnist_dir(tmp_path, n_train=5)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(4, dtype=np.uint8))
    with pytest.raises(DataError) as exc_info:
        mnist_data.load_pair(tmp_path, "train")
    assert_one_line_naming(exc_info, "train-images-idx3-ubyte.gz holds 5 images", "holds 4 labels")


@pytest.mark.parametrize(
    "name",
    ["train-labels-idx1-ubyte.gz", "train-labels-idx1-ubyte", "train-labels.idx1-ubyte", "train-labels.idx1-ubyte.gz"],
)
def test_both_file_namings_are_found_gzipped_or_not(tmp_path: Path, name: str) -> None:
    write_idx(tmp_path / name, np.zeros(1, dtype=np.uint8))
    assert mnist_data.find_idx_file(tmp_path, "train", "labels") == tmp_path / name


def test_missing_file_error_lists_the_names_looked_for(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc_info:
        mnist_data.find_idx_file(tmp_path, "t10k", "images")
    assert_one_line_naming(exc_info, f"--data {tmp_path}: no t10k images file", "t10k-images.idx3-ubyte")


@needs_fashion_mnist
def test_reads_the_real_fashion_mnist_files() -> None:
    train_images, train_labels = mnist_data.load_pair(FASHION_MNIST, "train")
    test_images, test_labels = mnist_data.load_pair(FASHION_MNIST, "t10k")
    assert train_images.shape == (60000, 28, 28) and test_images.shape == (10000, 28, 28)
    # Fashion-MNIST is balanced: 6000 train and 1000 test images per class.
    assert np.bincount(train_labels).tolist() == [6000] * 10
    assert np.bincount(test_labels).tolist() == [1000] * 10
    assert train_images.min() == 0 and train_images.max() == 255


# -- the task ------------------------------------------------------------------------


def test_dataset_items_are_normalised_float_images_and_int_labels(tmp_path: Path) -> None:
    task = MnistTask.setup_task(mnist_args("--data", str(write_mnist_dir(tmp_path))))
    train = task.dataset("train")
    image, label = train[0]
    assert image.dtype == torch.float32 and image.shape == (1, 28, 28)
    assert isinstance(label, int) and 0 <= label < 10
    all_pixels = torch.stack([train[i][0] for i in range(len(train))])
    assert abs(all_pixels.mean().item()) < 1e-4 and abs(all_pixels.std(unbiased=False).item() - 1) < 1e-4


def test_pixel_stats_from_the_histogram_are_numpys_mean_and_std() -> None:
    images = np.random.default_rng(0).integers(0, 256, size=(50, 28, 28), dtype=np.uint8)
    images[:5] = 255  # a skewed histogram
    mean, std = mnist_data.pixel_stats(images)
    assert mean == pytest.approx(images.mean(dtype=np.float64), rel=1e-12)
    assert std == pytest.approx(images.std(dtype=np.float64), rel=1e-12)


def test_every_split_is_standardised_with_the_training_statistics(tmp_path: Path) -> None:
    data_dir = write_mnist_dir(tmp_path)
    task = MnistTask.setup_task(mnist_args("--data", str(data_dir), "--valid-size", "0"))  # train: all train files
    train_pixels = idx.read_idx(data_dir / "train-images-idx3-ubyte.gz").astype(np.float64)
    test_pixels = idx.read_idx(data_dir / "t10k-images-idx3-ubyte.gz").astype(np.float64)
    expected = (test_pixels[1] - train_pixels.mean()) / train_pixels.std()
    torch.testing.assert_close(task.dataset("test")[1][0][0], torch.from_numpy(expected).float())


def test_no_normalize_scales_pixels_to_unit_range(tmp_path: Path) -> None:
    data_dir = write_mnist_dir(tmp_path)
    task = MnistTask.setup_task(mnist_args("--data", str(data_dir), "--no-normalize"))
    raw = idx.read_idx(data_dir / "t10k-images-idx3-ubyte.gz")
    image, _ = task.dataset("test")[2]
    torch.testing.assert_close(image[0], torch.from_numpy(raw[2]).float() / 255)


def split_images(task: MnistTask, split: str) -> list[bytes]:
    """The raw pixels of each image of ``split``, undoing the task's standardisation."""
    mean, std = task._normalisation()
    dataset = task.dataset(split)
    return [(dataset[i][0][0] * std + mean).round().to(torch.uint8).numpy().tobytes() for i in range(len(dataset))]


def test_by_default_a_tenth_of_the_training_images_is_valid_and_test_is_the_t10k_files(tmp_path: Path) -> None:
    data_dir = write_mnist_dir(tmp_path, n_train=20, n_test=5)
    task = MnistTask.setup_task(mnist_args("--data", str(data_dir)))
    train_files = [image.tobytes() for image in idx.read_idx(data_dir / "train-images-idx3-ubyte.gz")]
    train, valid = split_images(task, "train"), split_images(task, "valid")
    assert len(valid) == 2 and len(train) == 18
    assert sorted(train + valid) == sorted(train_files)  # each training image in exactly one of them
    assert [task.dataset("test")[i][1] for i in range(5)] == idx.read_idx(data_dir / "t10k-labels-idx1-ubyte.gz").tolist()


def test_valid_size_holds_out_that_many_training_images_the_same_in_every_run(tmp_path: Path) -> None:
    data_dir = write_mnist_dir(tmp_path, n_train=12)
    first = MnistTask.setup_task(mnist_args("--data", str(data_dir), "--valid-size", "3"))
    other_seed = MnistTask.setup_task(mnist_args("--data", str(data_dir), "--valid-size", "3", "--seed", "7"))
    assert len(split_images(first, "valid")) == 3 and len(split_images(first, "train")) == 9
    assert split_images(first, "valid") == split_images(other_seed, "valid")
    assert split_images(first, "train") == split_images(other_seed, "train")


def test_valid_size_zero_makes_valid_the_t10k_files(tmp_path: Path) -> None:
    data_dir = write_mnist_dir(tmp_path, n_train=12, n_test=5)
    task = MnistTask.setup_task(mnist_args("--data", str(data_dir), "--valid-size", "0"))
    assert split_images(task, "valid") == split_images(task, "test")
    assert len(task.dataset("train")) == 12


def test_valid_size_must_leave_training_images(tmp_path: Path) -> None:
    task = MnistTask.setup_task(mnist_args("--data", str(write_mnist_dir(tmp_path, n_train=12)), "--valid-size", "12"))
    with pytest.raises(DataError) as exc_info:
        task.dataset("valid")
    assert_one_line_naming(exc_info, "--valid-size 12 holds out 12 of the 12 training images; it must leave some")


@pytest.mark.parametrize("text", ["-1", "1.5", "abc"])
def test_valid_size_is_a_count_or_a_fraction(text: str) -> None:
    mnist_task = importlib.import_module("plugins.mnist_task")
    assert (mnist_task.valid_size("5000"), mnist_task.valid_size("0"), mnist_task.valid_size("0.25")) == (5000, 0, 0.25)
    with pytest.raises(argparse.ArgumentTypeError, match=f"'{text}' is neither a number of images nor a fraction"):
        mnist_task.valid_size(text)


def test_max_images_keeps_the_first_images_of_each_split(tmp_path: Path) -> None:
    data_dir = write_mnist_dir(tmp_path, n_train=20, n_test=5)
    whole = MnistTask.setup_task(mnist_args("--data", str(data_dir), "--no-normalize"))
    few = MnistTask.setup_task(mnist_args("--data", str(data_dir), "--no-normalize", "--max-images", "3"))
    for split in ("train", "valid", "test"):
        assert split_images(few, split) == split_images(whole, split)[:3]
    with pytest.raises(DataError, match="--max-images must be at least 0"):
        MnistTask.setup_task(mnist_args("--data", str(data_dir), "--max-images", "-1")).dataset("test")


def test_unknown_split_is_a_data_error(tmp_path: Path) -> None:
    task = MnistTask.setup_task(mnist_args("--data", str(write_mnist_dir(tmp_path))))
    with pytest.raises(DataError, match="task mnist has no split 'dev'; splits: train, valid, test"):
        task.dataset("dev")


def test_task_defaults_and_architectures_reach_the_options() -> None:
    args = mnist_args()
    assert args.dataset == "mnist"
    assert (args.criterion, args.arch, args.model, args.optimizer) == ("cross_entropy", "mnist_cnn", "mnist_cnn",
                                                                        "adam")
    assert (args.max_sentences, args.lr, args.max_epoch) == (64, 1e-3, 1)
    assert (args.conv1_channels, args.conv2_channels, args.fc_dim, args.dropout) == (32, 64, 128, 0.0)
    small = mnist_args("--arch", "mnist_cnn_small", "--fc-dim", "48")
    assert (small.model, small.conv1_channels, small.conv2_channels, small.fc_dim) == ("mnist_cnn", 16, 32, 48)


def test_help_shows_the_task_and_model_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--user-dir", str(PLUGIN_DIR), "--task", "mnist", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--dataset", "--mnist-cache-dir", "--mnist-mirror", "--valid-size", "--max-images", "--no-normalize",
                 "--conv1-channels", "--conv2-channels", "--fc-dim", "--dropout"):
        assert flag in help_text
    assert "'test' is the t10k files (0: 'valid' is the t10k files too) (default: 0.1)" in " ".join(help_text.split())


@pytest.mark.parametrize("arch", ["mnist_cnn", "mnist_cnn_small", "mnist_mlp"])
def test_models_map_a_collated_batch_to_ten_logits(tmp_path: Path, arch: str) -> None:
    args = mnist_args("--data", str(write_mnist_dir(tmp_path)), "--arch", arch)
    task = MnistTask.setup_task(args)
    batch = task.collater([task.dataset("train")[i] for i in range(4)])
    model = task.build_model(args)
    assert model(**batch["net_input"]).shape == (4, 10)


def test_dropout_is_off_by_default_and_on_with_the_flag() -> None:
    x = torch.randn(8, 1, 28, 28)
    for extra, same in (((), True), (("--dropout", "0.5"), False)):
        args = mnist_args(*extra)
        model = MnistTask.setup_task(args).build_model(args).train()
        assert torch.equal(model(x), model(x)) is same


@pytest.mark.parametrize("given, problem", [
    ("absent", ": no such directory"),
    ("a_file", " is a file, not a directory; give the directory that holds the four IDX files"),
])
def test_cli_reports_a_data_path_that_is_no_directory_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  given: str, problem: str) -> None:
    (tmp_path / "a_file").write_bytes(b"train-images-idx3-ubyte.gz, not its directory")
    code = train_main(["--user-dir", str(PLUGIN_DIR), "--task", "mnist", "--data", str(tmp_path / given),
                       "--save-dir", str(tmp_path / "checkpoints")])
    assert code == 2
    assert capsys.readouterr().err == f"hetfair-train: error: --data {tmp_path / given}{problem}\n"


# -- download ------------------------------------------------------------------------


def make_mirror(directory: Path, files: dict[str, bytes]) -> tuple[str, dict[str, str]]:
    """A ``file://`` mirror serving ``files``, and their SHA-256 checksums."""
    directory.mkdir()
    for name, content in files.items():
        (directory / name).write_bytes(content)
    return directory.as_uri() + "/", {name: hashlib.sha256(content).hexdigest() for name, content in files.items()}


FILES = {"a-idx1-ubyte.gz": b"first file", "b-idx1-ubyte.gz": b"second file"}


def test_download_verifies_checksums_and_then_uses_the_cache(tmp_path: Path) -> None:
    mirror, checksums = make_mirror(tmp_path / "mirror", FILES)
    cache = tmp_path / "cache"
    assert mnist_download.fetch_files(cache, [UNREACHABLE, mirror], checksums) == cache
    assert {p.name: p.read_bytes() for p in cache.iterdir()} == FILES
    # Everything is cached and verified now: no mirror is needed.
    mnist_download.fetch_files(cache, [UNREACHABLE], checksums)


def test_download_with_wrong_checksum_keeps_nothing(tmp_path: Path) -> None:
    mirror, checksums = make_mirror(tmp_path / "mirror", FILES)
    checksums["b-idx1-ubyte.gz"] = "0" * 64
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as exc_info:
        mnist_download.fetch_files(cache, [mirror], checksums)
    assert_one_line_naming(exc_info, "could not download b-idx1-ubyte.gz", "checksum mismatch")
    assert sorted(p.name for p in cache.iterdir()) == ["a-idx1-ubyte.gz"]  # no partial or temp file


def test_download_falls_back_to_the_next_mirror_on_a_bad_file(tmp_path: Path) -> None:
    bad_mirror, _ = make_mirror(tmp_path / "bad", {name: b"tampered" for name in FILES})
    good_mirror, checksums = make_mirror(tmp_path / "good", FILES)
    cache = mnist_download.fetch_files(tmp_path / "cache", [bad_mirror, good_mirror], checksums)
    assert (cache / "a-idx1-ubyte.gz").read_bytes() == FILES["a-idx1-ubyte.gz"]


def test_corrupt_cached_file_is_downloaded_again(tmp_path: Path) -> None:
    mirror, checksums = make_mirror(tmp_path / "mirror", FILES)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "a-idx1-ubyte.gz").write_bytes(b"half a fi")
    mnist_download.fetch_files(cache, [mirror], checksums)
    assert (cache / "a-idx1-ubyte.gz").read_bytes() == FILES["a-idx1-ubyte.gz"]


def test_a_failed_download_leaves_no_empty_directories(tmp_path: Path) -> None:
    with pytest.raises(DataError):
        mnist_download.fetch_files(tmp_path / "cache" / "hetfair" / "mnist", [UNREACHABLE], {"a.gz": "0" * 64})
    assert list(tmp_path.iterdir()) == []


# -- where the data comes from: cache, system copy, download ---------------------------


def mnist_files(seed: int) -> dict[str, bytes]:
    """The four files of a small MNIST-style data set, gzipped as the mirrors serve them."""
    rng = np.random.default_rng(seed)
    files = {}
    for prefix, n in (("train", 12), ("t10k", 5)):
        files[f"{prefix}-images-idx3-ubyte.gz"] = gzip.compress(
            idx_bytes(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)), mtime=0)
        files[f"{prefix}-labels-idx1-ubyte.gz"] = gzip.compress(idx_bytes(rng.integers(0, 10, n, dtype=np.uint8)),
                                                               mtime=0)
    return files


def fake_dataset(tmp_path: Path, files: dict[str, bytes], with_system_copy: bool) -> tuple:
    """An ImageDataset served by a file:// mirror, with (or without) a system copy; and its cache root."""
    mirror, checksums = make_mirror(tmp_path / "mirror", files)
    system_dir = tmp_path / "usr-share" / "fake-mnist"
    if with_system_copy:
        system_dir.mkdir(parents=True)
        for name, content in files.items():
            (system_dir / name).write_bytes(content)
    dataset = mnist_sources.ImageDataset("fake-mnist", "Fake-MNIST", (mirror,), checksums, system_dir,
                                         "dataset-fake-mnist")
    return dataset, tmp_path / "cache"


def test_the_cache_comes_first(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dataset, cache_root = fake_dataset(tmp_path, mnist_files(0), with_system_copy=True)
    mnist_download.fetch_files(cache_root / "fake-mnist", dataset.mirrors, dataset.sha256)
    with caplog.at_level(logging.INFO):
        assert mnist_sources.locate(dataset, cache_root, [UNREACHABLE]) == cache_root / "fake-mnist"
    assert caplog.messages == [f"data | Fake-MNIST from the cache {cache_root / 'fake-mnist'}"]


def test_then_the_system_copy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dataset, cache_root = fake_dataset(tmp_path, mnist_files(0), with_system_copy=True)
    with caplog.at_level(logging.INFO):
        assert mnist_sources.locate(dataset, cache_root, [UNREACHABLE]) == dataset.system_dir
    assert caplog.messages == [f"data | Fake-MNIST from the system copy {dataset.system_dir} "
                               f"(Debian package dataset-fake-mnist)"]
    assert not cache_root.exists()


def test_then_a_checksummed_download(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = mnist_files(0)
    dataset, cache_root = fake_dataset(tmp_path, files, with_system_copy=False)
    with caplog.at_level(logging.INFO):
        data_dir = mnist_sources.locate(dataset, cache_root)
    assert data_dir == cache_root / "fake-mnist"
    assert {name: (data_dir / name).read_bytes() for name in files} == files
    assert caplog.messages == [
        f"data | Fake-MNIST is in neither the cache nor a system copy: downloading it into {data_dir}",
        f"data | Fake-MNIST downloaded into {data_dir} (SHA-256 verified)"]


def offline_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installed: bool) -> Path:
    """Make Fashion-MNIST's system copy a directory of ``tmp_path``, holding the files when ``installed``."""
    system_dir = tmp_path / "usr-share" / "fashion-mnist"
    if installed:
        system_dir.mkdir(parents=True)
        for name, content in mnist_files(1).items():
            (system_dir / name).write_bytes(content)
    monkeypatch.setattr(mnist_sources, "OFFLINE_DATASET",
                        dataclasses.replace(mnist_sources.FASHION_MNIST, system_dir=system_dir))
    return system_dir


def test_when_nothing_works_one_error_gives_every_reason_and_the_fix(tmp_path: Path, monkeypatch) -> None:
    offline_dataset(tmp_path, monkeypatch, installed=False)
    dataset, cache_root = fake_dataset(tmp_path, mnist_files(0), with_system_copy=False)
    with pytest.raises(DataError) as exc_info:
        mnist_sources.locate(dataset, cache_root, [UNREACHABLE])
    sudo = "" if os.geteuid() == 0 else "sudo "
    assert_one_line_naming(
        exc_info, f"no Fake-MNIST data: (1) the cache {cache_root / 'fake-mnist'} does not exist",
        f"(2) there is no system copy in {dataset.system_dir} (Debian package dataset-fake-mnist)",
        f"(3) the download failed: could not download train-images-idx3-ubyte.gz into {cache_root / 'fake-mnist'} "
        f"({UNREACHABLE}train-images-idx3-ubyte.gz: ",
        f"To fix it, run `{sudo}apt-get install dataset-fashion-mnist` and train with --dataset fashion-mnist")
    assert not cache_root.exists(), "no empty cache directory is left behind"


@pytest.mark.parametrize("installed", [False, True], ids=["fashion-mnist-missing", "fashion-mnist-installed"])
def test_offline_mnist_default_is_one_error_line_with_the_fix(tmp_path: Path, capsys, monkeypatch,
                                                              installed: bool) -> None:
    system_dir = offline_dataset(tmp_path, monkeypatch, installed)
    cache = tmp_path / "cache"
    code = train_main(["--user-dir", str(PLUGIN_DIR), "--task", "mnist", "--mnist-cache-dir", str(cache),
                       "--mnist-mirror", UNREACHABLE, "--save-dir", str(tmp_path / "checkpoints")])
    notice, error = capsys.readouterr().err.splitlines()
    assert code == 2
    assert notice == f"data | MNIST is in neither the cache nor a system copy: downloading it into {cache / 'mnist'}"
    assert error.startswith(f"hetfair-train: error: no MNIST data: (1) the cache {cache / 'mnist'} does not exist; "
                            f"(2) no system package provides MNIST; (3) the download failed")
    if installed:  # nothing to install: the fix is the flag
        assert f"To fix it, train with --dataset fashion-mnist instead: Fashion-MNIST is installed in {system_dir}; " \
               f"or copy the four files" in error
        assert "apt-get" not in error
    else:
        assert "apt-get install dataset-fashion-mnist` and train with --dataset fashion-mnist" in error
    assert not cache.exists()


def test_fashion_mnist_needs_only_its_package_to_be_fixed(tmp_path: Path, monkeypatch) -> None:
    dataset = dataclasses.replace(mnist_sources.FASHION_MNIST, system_dir=tmp_path / "not-installed")
    monkeypatch.setattr(mnist_sources, "OFFLINE_DATASET", dataset)
    with pytest.raises(DataError) as exc_info:
        mnist_sources.locate(dataset, tmp_path / "cache", [UNREACHABLE])
    sudo = "" if os.geteuid() == 0 else "sudo "
    assert str(exc_info.value).endswith(f"To fix it, run `{sudo}apt-get install dataset-fashion-mnist` "
                                        f"(or pass --data DIR naming a directory with the four IDX files)")


@needs_fashion_mnist
def test_dataset_fashion_mnist_uses_the_debian_copy_offline(tmp_path: Path, caplog) -> None:
    args = mnist_args("--dataset", "fashion-mnist", "--mnist-cache-dir", str(tmp_path / "cache"),
                      "--mnist-mirror", UNREACHABLE)
    with caplog.at_level(logging.INFO):
        assert len(MnistTask.setup_task(args).dataset("test")) == 10000
    assert caplog.messages == [f"data | Fashion-MNIST from the system copy {FASHION_MNIST} "
                               f"(Debian package dataset-fashion-mnist)"]
    assert not (tmp_path / "cache").exists()
