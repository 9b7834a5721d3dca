"""HetSeq's / NVIDIA's BERT pretraining shards (``*.hdf5``, static masks), read lazily with h5py.

Each shard holds, per sample, the datasets that NVIDIA's ``create_pretraining_data.py`` writes:
``input_ids``, ``input_mask`` and ``segment_ids`` (``[n, seq_len]``), ``masked_lm_positions``
and ``masked_lm_ids`` (``[n, max_predictions]``, padded with position 0, which is ``[CLS]``
and never masked) and ``next_sentence_labels`` (``[n]``: 0 is-next, 1 random next). A split is
every shard whose file name contains the split's name (as in HetSeq: ``train`` matches
``..._training_0.hdf5``), in sorted order. Shards are opened lazily in each process, so
DataLoader workers each hold their own file handles.
"""

from __future__ import annotations

import bisect
import glob
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hetfair.bert.masking import IGNORE_INDEX
from hetfair.errors import ConfigError, DataError

HDF5_DATASETS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
                 "next_sentence_labels")


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise ConfigError("reading .hdf5 shards needs h5py: pip install 'hetfair[hdf5]'") from None
    return h5py


def hdf5_shards(directory: str) -> list[str]:
    """Every ``*.hdf5`` file in ``directory``, sorted."""
    return sorted(glob.glob(os.path.join(directory, "*.hdf5")))


def split_shards(directory: str, split: str) -> list[str]:
    """The shards of ``split``: file names containing it."""
    return [path for path in hdf5_shards(directory) if split in os.path.basename(path)]


class Hdf5Shard:
    """One shard's sample count and sequence length, checked against NVIDIA's schema."""

    def __init__(self, path: str) -> None:
        h5py = _h5py()
        self.path = path
        try:
            with h5py.File(path, "r") as f:
                missing = [name for name in HDF5_DATASETS if name not in f]
                if missing:
                    raise DataError(f"{path} lacks the dataset(s) {', '.join(missing)} of a BERT pretraining shard")
                lengths = {name: f[name].shape[0] for name in HDF5_DATASETS}
                self.seq_length = int(f["input_ids"].shape[1])
                widths = {name: f[name].shape[1] for name in ("input_mask", "segment_ids")}
                predictions = {name: f[name].shape[1] for name in ("masked_lm_positions", "masked_lm_ids")}
        except OSError as exc:
            raise DataError(f"{path} is not a readable HDF5 file: {exc}") from exc
        if len(set(lengths.values())) != 1:
            raise DataError(f"{path}: datasets have different sample counts "
                            f"({', '.join(f'{k} {v}' for k, v in lengths.items())})")
        if set(widths.values()) != {self.seq_length}:
            raise DataError(f"{path}: input_mask/segment_ids are not as wide as input_ids ({self.seq_length})")
        if len(set(predictions.values())) != 1:
            raise DataError(f"{path}: masked_lm_positions and masked_lm_ids differ in width")
        self.num_samples = lengths["input_ids"]


class Hdf5BertDataset(Dataset):
    """The samples of several shards, as the dicts :func:`~hetfair.bert.dataset.collate_bert` takes."""

    def __init__(self, paths: list[str], with_nsp: bool) -> None:
        self.shards = [Hdf5Shard(path) for path in paths]
        self.with_nsp = with_nsp
        self.ends = np.cumsum([shard.num_samples for shard in self.shards]).tolist()
        self.seq_length = max(shard.seq_length for shard in self.shards)
        self._files: dict[int, Any] = {}  # opened on first use, per process

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = bisect.bisect_right(self.ends, index)
        row = index - (self.ends[shard - 1] if shard else 0)
        data = self._file(shard)
        length = int(np.asarray(data["input_mask"][row]).sum())
        input_ids = torch.from_numpy(np.asarray(data["input_ids"][row][:length], dtype=np.int64))
        positions = np.asarray(data["masked_lm_positions"][row], dtype=np.int64)
        count = int(np.count_nonzero(positions))
        labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
        labels[torch.from_numpy(positions[:count])] = torch.from_numpy(
            np.asarray(data["masked_lm_ids"][row][:count], dtype=np.int64))
        sample = {"input_ids": input_ids,
                  "token_type_ids": torch.from_numpy(np.asarray(data["segment_ids"][row][:length], dtype=np.int64)),
                  "labels": labels}
        if self.with_nsp:
            sample["nsp_label"] = torch.tensor(int(data["next_sentence_labels"][row]))
        return sample

    def _file(self, shard: int) -> Any:
        if shard not in self._files:
            self._files[shard] = _h5py().File(self.shards[shard].path, "r")
        return self._files[shard]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}}  # DataLoader workers open their own handles

    def set_epoch(self, epoch: int) -> None:
        """Masks are static in these shards: nothing changes between epochs."""
