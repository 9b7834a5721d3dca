"""HetSeq's / NVIDIA's BERT hdf5 shards: read lazily, split-independent updates, HetSeq's command, bad shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

h5py = pytest.importorskip("h5py")

from bert_helpers import SPECIALS, write_bert_config  # noqa: E402
from helpers import final_parameters, free_port, node_commands, run_nodes  # noqa: E402
from hetfair.bert.hdf5_dataset import Hdf5BertDataset  # noqa: E402
from hetfair_cli.train import main as train_main  # noqa: E402

SEQ, PREDICTIONS, VOCAB = 32, 5, 60
CLS, SEP, MASK = SPECIALS.index("[CLS]"), SPECIALS.index("[SEP]"), SPECIALS.index("[MASK]")


def write_shard(path: Path, n: int, seed: int, drop: str | None = None, short: str | None = None) -> dict:
    """A shard with NVIDIA's exact schema (names, shapes, dtypes); returns its raw arrays."""
    rng = np.random.default_rng(seed)
    arrays = {"input_ids": np.zeros((n, SEQ), "i4"), "input_mask": np.zeros((n, SEQ), "i4"),
              "segment_ids": np.zeros((n, SEQ), "i4"), "masked_lm_positions": np.zeros((n, PREDICTIONS), "i4"),
              "masked_lm_ids": np.zeros((n, PREDICTIONS), "i4"), "next_sentence_labels": np.zeros(n, "i1")}
    for row in range(n):
        length = int(rng.integers(10, SEQ + 1))
        first = int(rng.integers(3, length - 3))
        tokens = rng.integers(len(SPECIALS), VOCAB, length)
        tokens[0], tokens[first], tokens[-1] = CLS, SEP, SEP
        positions = np.sort(rng.choice([i for i in range(1, length - 1) if i != first],
                                       int(rng.integers(1, PREDICTIONS + 1)), replace=False))
        arrays["masked_lm_ids"][row, :len(positions)] = tokens[positions]
        arrays["masked_lm_positions"][row, :len(positions)] = positions
        tokens[positions] = MASK
        arrays["input_ids"][row, :length] = tokens
        arrays["input_mask"][row, :length] = 1
        arrays["segment_ids"][row, first + 1:length] = 1
        arrays["next_sentence_labels"][row] = rng.integers(0, 2)
    with h5py.File(path, "w") as f:
        for name, values in arrays.items():
            if name == drop:
                continue
            f.create_dataset(name, data=values[:-1] if name == short else values, compression="gzip")
    return arrays


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("hdf5")
    data = tmp / "data"
    data.mkdir()
    write_shard(data / "wikicorpus_en_training_0.hdf5", 40, seed=0)
    write_shard(data / "wikicorpus_en_training_1.hdf5", 30, seed=1)
    write_shard(data / "wikicorpus_en_test_0.hdf5", 12, seed=2)
    vocab = data / "vocab.txt"
    vocab.write_text("\n".join(SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]) + "\n")
    # No dropout: every rank draws its own dropout masks, so only then are the updates comparable.
    config = write_bert_config(tmp / "bert_config.json", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return data, vocab, config


def test_samples_are_the_shards_rows_with_labels_at_the_masked_positions(shards, tmp_path):
    path = tmp_path / "x_train_0.hdf5"
    raw = write_shard(path, 6, seed=5)
    dataset = Hdf5BertDataset([str(path)], with_nsp=True)
    assert len(dataset) == 6
    for row in range(6):
        sample = dataset[row]
        length = int(raw["input_mask"][row].sum())
        assert sample["input_ids"].tolist() == raw["input_ids"][row, :length].tolist()
        assert sample["token_type_ids"].tolist() == raw["segment_ids"][row, :length].tolist()
        count = int(np.count_nonzero(raw["masked_lm_positions"][row]))
        expected = [-100] * length
        for position, token in zip(raw["masked_lm_positions"][row, :count], raw["masked_lm_ids"][row, :count]):
            expected[position] = int(token)
        assert sample["labels"].tolist() == expected
        assert int(sample["nsp_label"]) == int(raw["next_sentence_labels"][row])


def run(tmp_path: Path, shards: tuple[Path, Path, Path], batch_sizes: list[int], workers: str) -> dict:
    data, vocab, config = shards
    save_dir = tmp_path / f"ckpt_{'_'.join(map(str, batch_sizes))}"
    common = ["--task", "bert", "--data", str(data), "--dict", str(vocab), "--config_file", str(config),
              "--optimizer", "sgd", "--lr", "0.5", "--lr-scheduler", "fixed", "--max-update", "3",
              "--update-freq", "2", "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--disable-validation",
              "--log-format", "none", "--num-workers", workers, "--distributed-timeout", "120"]
    init = f"tcp://127.0.0.1:{free_port()}"
    for result in run_nodes(node_commands(common, batch_sizes, init), cwd=tmp_path, timeout=300):
        assert result.returncode == 0, result.stderr
    return final_parameters(save_dir)


def test_one_process_and_two_heterogeneous_processes_train_the_same(tmp_path, shards):
    single = run(tmp_path, shards, [16], workers="0")
    split = run(tmp_path, shards, [4, 12], workers="1")  # workers open their own file handles
    assert single.keys() == split.keys() and "nsp_head.weight" in single  # NSP on by default for hdf5
    for name in single:
        assert torch.allclose(single[name], split[name], atol=2e-6, rtol=1e-5), name


def test_hetseqs_single_gpu_command_runs_unchanged(tmp_path, shards, capsys):
    data, vocab, config = shards
    command = (f"--task bert --data {data} --dict {vocab} --config_file {config} --max-sentences 4 "
               f"--fast-stat-sync --max-update 3 --update-freq 2 --valid-subset test --num-workers 0 "
               f"--warmup-updates 1 --total-num-update 10 --lr 0.0001 --weight-decay 0.01 "
               f"--distributed-world-size 1 --device-id 0 --save-dir {tmp_path / 'sing_gpu_test'}").split()
    assert train_main(command + ["--log-format", "json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    test = [r for r in records if r["phase"] == "test"]
    assert test and "nsp_accuracy" in test[-1] and test[-1]["num_updates"] == 3


@pytest.mark.parametrize("drop, short, message", [
    ("masked_lm_ids", None, "lacks the dataset(s) masked_lm_ids"),
    (None, "segment_ids", "different sample counts"),
])
def test_a_broken_shard_is_one_line(tmp_path, shards, capsys, drop, short, message):
    _, vocab, config = shards
    data = tmp_path / "broken"
    data.mkdir()
    write_shard(data / "x_train_0.hdf5", 8, seed=3)
    write_shard(data / "x_train_1.hdf5", 8, seed=4, drop=drop, short=short)
    code = train_main(["--task", "bert", "--data", str(data), "--dict", str(vocab), "--config_file", str(config),
                       "--max-sentences", "4", "--max-update", "1", "--save-dir", str(tmp_path / "c"),
                       "--log-format", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0] and "x_train_1.hdf5" in err[0], err


def test_hdf5_data_needs_its_vocabulary(tmp_path, shards, capsys):
    data, _, config = shards
    code = train_main(["--task", "bert", "--data", str(data), "--config_file", str(config), "--max-sentences", "4",
                       "--max-update", "1", "--save-dir", str(tmp_path / "c"), "--log-format", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--dict vocab.txt" in err[0]
