"""The bert task: HetSeq's command line, vocabulary checks, epochs, and a few real updates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bert_helpers import (
    corpus_lines,
    documents,
    make_data_dir,
    reference_wordpiece,
    write_bert_config,
)

from hetfair.errors import ConfigError, DataError
from hetfair.optim import LR_SCHEDULER_REGISTRY
from hetfair.options import parse_train_args
from hetfair.tasks import TASK_REGISTRY
from hetfair.run.config import DataConfig
from hetfair.run.training import local_capacity
from hetfair_cli.train import main as train_main


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    data_dir, vocab, _ = make_data_dir(tmp_path_factory.mktemp("task"), n_docs=400)  # 400 blocks: 3 updates of 128
    return data_dir, vocab


def hetseq_command(data_dir: Path, vocab: Path, config: Path, save_dir: Path) -> list[str]:
    """HetSeq's BERT command (docs/bert.md), scaled down only in --max-update and --num-workers."""
    return ["--task", "bert", "--data", str(data_dir), "--dict", str(vocab), "--config_file", str(config),
            "--max-sentences", "32", "--fast-stat-sync", "--max-update", "3", "--update-freq", "4",
            "--valid-subset", "test", "--num-workers", "2", "--warmup-updates", "10000",
            "--total-num-update", "1000000", "--lr", "0.0001", "--weight-decay", "0.01",
            "--distributed-world-size", "1", "--device-id", "0", "--save-dir", str(save_dir)]


def setup(data_dir: Path, *flags: str):
    args = parse_train_args(["--task", "bert", "--data", str(data_dir), "--max-sentences", "4", *flags])
    return args, TASK_REGISTRY.get("bert").setup_task(args)


def test_hetseq_command_gets_bert_optimizer_and_schedule(data, tmp_path: Path) -> None:
    args = parse_train_args(hetseq_command(*data, write_bert_config(tmp_path / "c.json"), tmp_path / "ckpt"))
    assert (args.criterion, args.arch, args.optimizer, args.lr_scheduler) == \
        ("masked_lm", "bert_base", "adamw", "polynomial_decay")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)
    schedule = LR_SCHEDULER_REGISTRY.get(args.lr_scheduler)(args, optimizer)
    assert schedule.lr_at(0) == pytest.approx(1e-4 / 10_000)
    assert schedule.lr_at(9_999) == pytest.approx(1e-4)
    assert schedule.lr_at(505_000) == pytest.approx(0.5e-4)  # linear decay to 0 at 1,000,000
    assert args.weight_decay == 0.01


def test_hetseq_command_trains_and_validates_on_the_test_split(data, tmp_path: Path, capsys) -> None:
    save_dir = tmp_path / "ckpt"
    command = hetseq_command(*data, write_bert_config(tmp_path / "c.json"), save_dir)
    assert train_main(command + ["--log-format", "json", "--log-interval", "1"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    updates = [r for r in records if r.get("phase") == "train_inner"]
    assert [r["num_updates"] for r in updates] == [1, 2, 3]
    assert all(r["bsz"] == 128 and 5 < r["loss"] < 12 for r in updates)  # ~log2(vocab) bits at the start
    assert all(r["wps"] > r["bsz"] * r["ups"] and "sps" not in r for r in updates)  # tokens/s: many per sample
    assert any(r.get("phase") == "test" and "ppl" in r for r in records)
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["config"]["hidden_size"] == 32 and state["config"]["optimizer"] == "adamw"


def test_nsp_adds_sentence_pairs_head_and_metrics(data) -> None:
    args, task = setup(data[0], "--nsp", "--arch", "bert_tiny")
    model, criterion = task.build_model(args), task.build_criterion(args)
    batch = task.collater([task.dataset("train")[i] for i in range(8)])
    assert batch["nsentence_labels"].shape == (8,) and (batch["net_input"]["token_type_ids"] == 1).any()
    _, sample_size, logs = criterion(model, batch)
    metrics = criterion.reduce_metrics({**logs, "sample_size": float(sample_size)})
    assert hasattr(model, "nsp_head") and logs["nsp_count"] == 8 and 0 <= metrics["nsp_accuracy"] <= 100


def test_begin_epoch_redraws_training_masks_but_not_validation_masks(data) -> None:
    _, task = setup(data[0])
    before = {split: [task.dataset(split)[i]["labels"] for i in range(20)] for split in ("train", "valid")}
    task.begin_epoch(2)
    after = {split: [task.dataset(split)[i]["labels"] for i in range(20)] for split in ("train", "valid")}
    assert sum(not torch.equal(a, b) for a, b in zip(before["train"], after["train"])) >= 15
    assert all(torch.equal(a, b) for a, b in zip(before["valid"], after["valid"]))


def test_max_tokens_becomes_a_sample_count_through_tokens_per_sample(data) -> None:
    args, task = setup(data[0], "--tokens-per-sample", "64", "--max-tokens", "1000")
    assert task.max_positions() == 64 and local_capacity(DataConfig.from_args(args), task, None) == 15
    assert max(len(task.dataset("train")[i]["input_ids"]) for i in range(len(task.dataset("train")))) <= 64


def test_dict_matching_the_data_vocabulary_is_accepted(data) -> None:
    _, task = setup(data[0], "--dict", str(data[1]))
    assert len(task.vocab) == len(data[1].read_text().splitlines())


def test_dict_differing_from_the_data_vocabulary_is_one_error_line(data, tmp_path: Path, capsys) -> None:
    other = reference_wordpiece(corpus_lines(documents(30, seed=9)), 100, tmp_path / "other.txt")
    with pytest.raises(ConfigError, match="differs from"):
        setup(data[0], "--dict", str(other))
    assert train_main(["--task", "bert", "--data", str(data[0]), "--dict", str(other), "--max-sentences", "4",
                       "--max-epoch", "1", "--save-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hetfair-train: error: vocabulary") and "differs from" in err[0]


def test_missing_split_and_unprocessed_directory_are_one_error_line(data, tmp_path: Path, capsys) -> None:
    assert train_main(["--task", "bert", "--data", str(data[0]), "--train-subset", "nope", "--max-epoch", "1",
                       "--max-sentences", "4", "--arch", "bert_tiny", "--save-dir", str(tmp_path / "ck")]) == 2
    expected = (f"hetfair-train: error: no split 'nope' in {data[0]} ({data[0] / 'nope'}.bin/.idx); "
                "create it with hetfair-preprocess --trainpref/--validpref/--testpref")
    assert capsys.readouterr().err.strip().splitlines() == [expected]
    with pytest.raises(DataError, match="not a hetfair-preprocess output"):
        setup(tmp_path)


def test_a_data_path_that_is_a_file_or_missing_is_one_error_line(tmp_path: Path) -> None:
    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("[PAD]\n")
    with pytest.raises(DataError, match=r"is a file, not a directory; give the directory that hetfair-preprocess"):
        setup(vocab_file)
    with pytest.raises(DataError, match="no such directory"):
        setup(tmp_path / "absent")
