"""Fine-tuning transformers encoders with ``hetfair-train --arch hf_encoder`` on the Jargon File labelled set.

Real gloo groups. The reference is a plain transformers + ``torch.optim.AdamW`` loop
(:func:`hf_encoder_helpers.plain_finetune`) on the same sentences: with one update per epoch
covering the whole training file, the update does not depend on the batch order, so any split
over ranks must give the same weights up to float rounding (1e-5: a few Adam steps of rounding
differences in sums over differently padded batches, far below the ~1e-3 each step moves a weight).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import transformers

from classification_data import make_labelled_dir
from helpers import final_parameters, free_port, rank_flags, run_nodes
from hetfair.pretrained import load_model
from hetfair_cli.export import main as export_main
from hf_encoder_helpers import MINILM, plain_finetune, save_tiny_encoder

LR, WEIGHT_DECAY, UPDATES = 1e-3, 0.01, 3
TOLERANCE = dict(rtol=0, atol=1e-5)


def train_args(model_dir: Path, data: Path, save_dir: Path, max_positions: int, *extra: str) -> list[str]:
    return ["--task", "sentence_classification", "--num-classes", "2", "--data", str(data), "--arch", "hf_encoder",
            "--hf-model", str(model_dir), "--hf-dropout", "0", "--max-positions", str(max_positions),
            "--optimizer", "adamw", "--lr", str(LR), "--weight-decay", str(WEIGHT_DECAY), "--lr-scheduler", "fixed",
            "--max-epoch", "0", "--no-epoch-checkpoints", "--log-format", "none", "--distributed-timeout", "120",
            "--save-dir", str(save_dir), *extra]


def run(tmp_path: Path, common: list[str], batch_sizes: list[int], *per_rank: str) -> None:
    """One hetfair-train job, on one process or one process per entry of ``batch_sizes``."""
    init = f"tcp://127.0.0.1:{free_port()}"
    world = len(batch_sizes)
    commands = [[*common, "--max-sentences", str(batch), *(rank_flags(rank, world, init) + list(per_rank)
                                                            if world > 1 else [])]
                for rank, batch in enumerate(batch_sizes)]
    for result in run_nodes(commands, cwd=tmp_path, timeout=300):
        assert result.returncode == 0, result.stderr[-3000:]


def train_rows(data: Path) -> tuple[list[str], list[int]]:
    with open(data / "train.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [row["text"] for row in rows], [int(row["label"]) for row in rows]


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE, msg=name)


@pytest.mark.parametrize("family, backend", [("bert", "c10d"), ("distilbert", "fully_sharded")])
def test_two_uneven_ranks_make_the_plain_transformers_update(tmp_path, family, backend):
    model_dir = save_tiny_encoder(tmp_path / family, family, head=True)
    data = make_labelled_dir(tmp_path / "data", train=16, valid=8)
    common = train_args(model_dir, data, tmp_path / "ckpt", 64, "--max-update", str(UPDATES),
                        "--disable-validation")
    run(tmp_path, common, [3, 13], "--ddp-backend", backend)  # 16 sentences: one update per epoch
    expected = plain_finetune(model_dir, *train_rows(data), UPDATES, LR, WEIGHT_DECAY, max_length=64)
    assert_same(final_parameters(tmp_path / "ckpt"), expected)


def test_minilm_fine_tunes_the_same_sharded_on_two_uneven_ranks_and_exports_equal_logits(tmp_path):
    """all-MiniLM-L6-v2 (22M parameters; its classification head starts from hetfair's seed): one process
    against two uneven fully sharded ranks, then ``hetfair-export --to hf`` of the sharded run.

    Plain SGD here (the later flags win): Adam would turn the rounding noise of gradients that are zero in
    exact arithmetic (attention key biases: softmax ignores a shift shared by all keys) into steps of
    +-lr, and its state would triple the checkpoints of a 22M-parameter model.
    """
    data = make_labelled_dir(tmp_path / "data", train=16, valid=8)
    common = ["--max-update", "2", "--disable-validation", "--seed", "3", "--optimizer", "sgd", "--lr", "0.5",
              "--weight-decay", "0"]
    run(tmp_path, train_args(MINILM, data, tmp_path / "one", 32, *common), [16])
    run(tmp_path, train_args(MINILM, data, tmp_path / "two", 32, *common), [5, 11], "--ddp-backend", "fully_sharded")
    sharded = final_parameters(tmp_path / "two")
    assert_same(sharded, final_parameters(tmp_path / "one"))

    checkpoint, out = tmp_path / "two" / "checkpoint_last.pt", tmp_path / "exported"
    assert export_main(["--path", str(checkpoint), "--to", "hf", str(out)]) == 0
    loaded = load_model(checkpoint)
    exported = transformers.AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True).eval()
    texts, _ = train_rows(data)
    inputs = dict(transformers.AutoTokenizer.from_pretrained(out)(texts, padding=True, truncation=True,
                                                                   max_length=32, return_tensors="pt"))
    task_ids = [loaded.task.dataset("train")[i]["input_ids"].tolist() for i in range(len(texts))]
    assert [row[row != 0].tolist() for row in inputs["input_ids"]] == task_ids  # the ids it was trained on
    with torch.no_grad():
        torch.testing.assert_close(exported(**inputs).logits, loaded.model.eval()(**inputs), rtol=0, atol=1e-6)
    assert exported.config.id2label == {0: "0", 1: "1"}
