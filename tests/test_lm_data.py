"""The language_modeling data path on real text: hetfair-preprocess (Hugging Face datasets, a trained
byte-level BPE), the token blocks the task trains on, the criterion, and one-line errors for bad input."""

from __future__ import annotations

import argparse
import bz2
import gzip
import itertools
import json
import lzma
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import damaged
from lm_helpers import EOS, PAD, jargon_paragraphs, preprocess, reference_stream, write_text
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch import nn

from hetfair.data.indexed_dataset import IndexedDataset
from hetfair.lm.criterion import LmCrossEntropyCriterion
from hetfair.lm.task import LanguageModelingTask
from hetfair_cli.preprocess import main as preprocess_main
from hetfair_cli.train import main as train_main

VOCAB_SIZE = 600
COMPRESSIONS = {"gz": gzip, "bz2": bz2, "xz": lzma}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The Jargon File's first 500 paragraphs: 400 to train on (gzipped), 100 to validate on."""
    tmp = tmp_path_factory.mktemp("lm_data")
    docs = jargon_paragraphs()[:500]
    train, valid = write_text(tmp / "train.txt.gz", docs[:400]), write_text(tmp / "valid.txt", docs[400:])
    data = preprocess(tmp / "data", "--tokenizer", "bpe", "--vocab-size", str(VOCAB_SIZE),
                      "--trainpref", str(train), "--validpref", str(valid))
    return {"data": data, "train_docs": docs[:400], "valid_docs": docs[400:], "tmp": tmp}


def test_a_trained_byte_level_bpe_has_the_requested_size_and_encodes_real_text_losslessly(corpus):
    tokenizer = Tokenizer.from_file(str(corpus["data"] / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert (tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)) == (0, 1)
    docs = corpus["train_docs"] + corpus["valid_docs"]  # box drawing, indentation, accents: bytes cover all
    assert tokenizer.decode_batch([e.ids for e in tokenizer.encode_batch(docs)]) == docs


@pytest.mark.parametrize("split", ["train", "valid"])
def test_each_split_is_its_paragraphs_encoded_and_ended_by_end_of_text(corpus, split):
    binary = IndexedDataset(str(corpus["data"] / split))
    docs = corpus[f"{split}_docs"]
    np.testing.assert_array_equal(binary.tokens, reference_stream(corpus["data"] / "tokenizer.json", docs))
    assert binary.num_documents == len(docs)


def test_json_lines_records_are_documents_of_the_text_field_with_a_given_tokenizer(corpus):
    tmp, docs = corpus["tmp"], corpus["valid_docs"][:30]
    records = tmp / "records.jsonl"
    records.write_text("".join(json.dumps({"id": i, "body": doc, "lang": "en"}) + "\n" for i, doc in enumerate(docs)))
    given = corpus["data"] / "tokenizer.json"
    data = preprocess(tmp / "json_data", "--tokenizer-file", str(given), "--text-field", "body",
                      "--trainpref", str(records))
    assert (data / "tokenizer.json").read_text() == given.read_text()
    np.testing.assert_array_equal(IndexedDataset(str(data / "train")).tokens, reference_stream(given, docs))


def test_preprocessing_again_adds_a_split_with_the_tokenizer_already_there(corpus, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(corpus["data"], data)
    tokenizer = (data / "tokenizer.json").read_text()
    preprocess(data, "--testpref", str(corpus["tmp"] / "valid.txt"))
    assert (data / "tokenizer.json").read_text() == tokenizer
    np.testing.assert_array_equal(IndexedDataset(str(data / "test")).tokens,
                                  IndexedDataset(str(corpus["data"] / "valid")).tokens)
    assert {p.name for p in data.iterdir()} == {p.name for p in corpus["data"].iterdir()} | {"test.bin", "test.idx"}


def test_without_hugging_face_datasets_preprocessing_says_what_to_install(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    code = preprocess_main(["--task", "language_modeling", "--tokenizer", "bpe", "--trainpref",
                            str(corpus["tmp"] / "valid.txt"), "--destdir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err == ("hetfair-preprocess: error: reading text for --task language_modeling needs "
                                 "Hugging Face datasets: pip install 'hetfair[lm]'\n")
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_file_without_end_of_text_and_padding_gets_both(corpus, tmp_path):
    plain = Tokenizer(models.BPE(unk_token="?"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.train_from_iterator(corpus["train_docs"], trainers.BpeTrainer(vocab_size=300, special_tokens=["?"]))
    plain.save(str(tmp_path / "plain.json"))
    data = preprocess(tmp_path / "data", "--tokenizer-file", str(tmp_path / "plain.json"),
                      "--trainpref", str(corpus["tmp"] / "valid.txt"))
    task = lm_task(data, 64)
    assert task.vocab_size == plain.get_vocab_size() + 2 and {task.eos_index, task.pad_index} == {
        plain.get_vocab_size(), plain.get_vocab_size() + 1}
    np.testing.assert_array_equal(IndexedDataset(str(data / "train")).tokens,
                                  reference_stream(data / "tokenizer.json", corpus["valid_docs"]))


def lm_task(data: Path, tokens_per_sample: int) -> LanguageModelingTask:
    return LanguageModelingTask.setup_task(argparse.Namespace(data=str(data), tokens_per_sample=tokens_per_sample,
                                                              train_subset="train"))


def test_blocks_cut_the_stream_and_their_targets_are_the_next_tokens(corpus):
    task = lm_task(corpus["data"], 37)
    stream = IndexedDataset(str(corpus["data"] / "train")).tokens.astype(np.int64)
    blocks = task.dataset("train")
    assert len(blocks) == math.ceil((len(stream) - 1) / 37)
    items = [blocks[i] for i in range(len(blocks))]
    np.testing.assert_array_equal(torch.cat([item["source"] for item in items]).numpy(), stream[:-1])
    np.testing.assert_array_equal(torch.cat([item["target"] for item in items]).numpy(), stream[1:])
    last = items[-1]
    assert 0 < len(last["source"]) < 37, "the corpus must end in a short block for this test"
    batch = task.collater([items[-1], items[0]])
    assert batch["net_input"]["src_tokens"].shape == batch["target"].shape == (2, 37)
    assert (batch["target"][0, len(last["target"]):] == task.pad_index).all()
    assert batch["ntokens"] == 37 + len(last["target"]) and batch["nsentences"] == 2
    assert batch["id"].tolist() == [len(blocks) - 1, 0]
    assert task.tokenizer_file == corpus["data"] / "tokenizer.json" and task.max_positions() == 37


class FixedLogits(nn.Module):
    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, src_tokens: torch.Tensor) -> torch.Tensor:
        return self.logits


def test_the_criterion_sums_next_token_losses_over_targets_that_are_not_padding(corpus):
    task = lm_task(corpus["data"], 37)
    batch = task.collater([task.dataset("train")[i] for i in (len(task.dataset("train")) - 1, 3)])
    logits = torch.randn(*batch["target"].shape, task.vocab_size, generator=torch.Generator().manual_seed(0))
    loss, sample_size, logs = LmCrossEntropyCriterion(task)(FixedLogits(logits), batch)
    target = batch["target"]
    picked = -logits.log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    expected = picked[target != task.pad_index].sum()
    torch.testing.assert_close(loss, expected)
    assert sample_size == batch["ntokens"] < 2 * 37
    metrics = LmCrossEntropyCriterion.reduce_metrics({**logs, "sample_size": sample_size})
    bits = float(expected) / sample_size / math.log(2)
    # float32 sums in another order: 1e-6 relative
    assert metrics["loss"] == pytest.approx(bits, rel=1e-6) and metrics["ppl"] == pytest.approx(2 ** bits, rel=1e-5)
    assert F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=task.pad_index).item() \
        == pytest.approx(float(loss) / sample_size)


# (flags, fragment of the message); TRAIN / VALID / JSONL / DATA stand for the corpus' files and directory
PREPROCESS_CASES = [
    (["--tokenizer", "bpe", "--trainpref", "missing.txt"], "input file missing.txt does not exist"),
    (["--trainpref", "TRAIN"], "choose a tokenizer: --tokenizer bpe"),
    (["--tokenizer", "bpe", "--vocab-size", "100", "--trainpref", "TRAIN"], "--vocab-size must be at least 258"),
    (["--tokenizer", "bpe", "--validpref", "VALID"], "--tokenizer bpe trains on the training text: give --trainpref"),
    (["--tokenizer-file", "VALID", "--trainpref", "TRAIN"], "is not a Hugging Face tokenizers file"),
    (["--tokenizer", "bpe", "--trainpref", "JSONL", "--text-field", "body"], "a record has no 'body' field "
                                                                              "(fields: id, text)"),
    (["--tokenizer", "bpe", "--trainpref", "BROKEN.jsonl"], "cannot read BROKEN.jsonl as JSON lines"),
    (["--tokenizer", "bpe", "--trainpref", "TRAIN", "--text-field", "body"], "--text-field body applies to JSON"),
    (["--tokenizer", "bpe", "--trainpref", "EMPTY.txt"], "EMPTY.txt contains no text"),
    *[(["--tokenizer", "bpe", "--trainpref", f"{how}.txt.{suffix}"], f"{how}.txt.{suffix} is truncated or corrupt: ")
      for how in ("truncated", "corrupt") for suffix in COMPRESSIONS],
    (["--tokenizer-file", "DATA/tokenizer.json", "--trainpref", "truncated.jsonl.gz"],
     "truncated.jsonl.gz is truncated or corrupt: Compressed file ended before the end-of-stream marker was reached"),
    (["--tokenizer", "bpe", "--trainpref", "TRAIN", "--vocab-size", "300", "--destdir", "DATA"],
     "already holds a tokenizer"),
]


@pytest.mark.parametrize("flags, message", PREPROCESS_CASES, ids=[" ".join(f) for f, _ in PREPROCESS_CASES])
def test_bad_preprocess_input_is_one_line_and_writes_nothing(corpus, tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "records.jsonl").write_text('{"id": 1, "text": "a"}\n')
    (tmp_path / "BROKEN.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (tmp_path / "EMPTY.txt").write_text("\n\n  \n")
    text = "\n\n".join(corpus["valid_docs"]).encode()
    for (suffix, module), how in itertools.product(COMPRESSIONS.items(), ("truncated", "corrupt")):
        (tmp_path / f"{how}.txt.{suffix}").write_bytes(damaged(module.compress(text), how))
    records = "".join(json.dumps({"text": doc}) + "\n" for doc in corpus["valid_docs"]).encode()
    (tmp_path / "truncated.jsonl.gz").write_bytes(damaged(gzip.compress(records), "truncated"))
    names = {"TRAIN": str(corpus["tmp"] / "valid.txt"), "VALID": str(corpus["tmp"] / "valid.txt"),
             "JSONL": "records.jsonl", "DATA": str(corpus["data"])}
    flags = [names.get(flag, flag).replace("DATA/", f"{corpus['data']}/") for flag in flags]
    if "--destdir" not in flags:
        flags += ["--destdir", "out"]
    before = sorted(p.name for p in Path(corpus["data"]).iterdir())
    code = preprocess_main(["--task", "language_modeling", *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("hetfair-preprocess: error: "), err
    assert message in err, err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in Path(corpus["data"]).iterdir()) == before


TRAIN_CASES = [
    (["--data", "missing"], "--data missing: no such directory"),
    (["--data", "EMPTY"], "has no tokenizer.json; make the directory with hetfair-preprocess --task language_modeling"),
    (["--data", "DATA", "--train-subset", "test"], "no split 'test' in"),
    (["--data", "DATA", "--tokens-per-sample", "0"], "--tokens-per-sample must be at least 1, got 0"),
    (["--data", "DATA", "--tokens-per-sample", "128", "--max-target-positions", "64"],
     "samples of 128 tokens do not fit the model's 64 positions"),
    (["--data", "DATA", "--max-tokens", "8"], "--max-tokens 8 is smaller than one sample (16 tokens)"),
]


def test_samples_longer_than_the_training_split_are_one_line_whose_suggestion_trains(corpus, tmp_path, capsys):
    small = write_text(tmp_path / "small.txt", corpus["valid_docs"][:3])
    data = preprocess(tmp_path / "data", "--tokenizer-file", str(corpus["data"] / "tokenizer.json"),
                      "--trainpref", str(small))
    tokens = IndexedDataset(str(data / "train")).num_tokens

    def train(tokens_per_sample: int) -> int:
        return train_main(["--task", "language_modeling", "--arch", "gpt_tiny", "--data", str(data),
                           "--tokens-per-sample", str(tokens_per_sample), "--max-sentences", "1", "--max-update", "1",
                           "--disable-validation", "--no-save", "--log-format", "none"])

    assert train(100000) == 2
    err = capsys.readouterr().err
    assert err == (f"hetfair-train: error: --tokens-per-sample 100000 is longer than the training split {data}/train "
                   f"({tokens} tokens, {tokens - 1} of them inputs): it would train on one padded sample; give "
                   f"--tokens-per-sample {tokens - 1} or less\n")
    assert train(tokens - 1) == 0, capsys.readouterr().err


@pytest.mark.parametrize("flags, message", TRAIN_CASES, ids=[" ".join(f) for f, _ in TRAIN_CASES])
def test_bad_training_input_is_one_line(corpus, tmp_path, capsys, flags, message):
    (tmp_path / "EMPTY").mkdir()
    names = {"DATA": str(corpus["data"]), "EMPTY": str(tmp_path / "EMPTY"), "missing": str(tmp_path / "missing")}
    flags = [names.get(flag, flag) for flag in flags]
    code = train_main(["--task", "language_modeling", "--arch", "gpt_tiny", "--tokens-per-sample", "16",
                       "--max-tokens", "64", "--max-update", "1", "--save-dir", str(tmp_path / "ckpt"),
                       "--log-format", "none", *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("hetfair-train: error: "), err
    assert message.replace("missing", str(tmp_path / "missing")) in err, err
