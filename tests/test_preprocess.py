"""hetfair-preprocess: binary splits agree with the tokenizer libraries; bad input is one error line.

Round trips compare, for every input line:

* WordPiece: the token ids equal ``tokenizers.BertWordPieceTokenizer(vocab).encode(line)``, and
  decoding them gives the line after BERT's normalisation (lowercase, accents stripped)
  once all whitespace is removed (WordPiece decoding re-spaces punctuation);
* sentencepiece: decoding gives exactly the line after NFKC with runs of whitespace
  collapsed to one space (sentencepiece's ``nmt_nfkc`` rule).
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from bert_helpers import (
    SPECIALS,
    corpus_lines,
    documents,
    reference_sentencepiece,
    reference_wordpiece,
    write_corpus,
)
from helpers import damaged
from tokenizers import BertWordPieceTokenizer

from hetfair.data.indexed_dataset import IndexedDataset
from hetfair.bert.tokenizer import TokenizerSpec, load_tokenizer
from hetfair_cli.preprocess import main


def bert_normalized(text: str) -> str:
    """BERT's uncased normalisation, written independently: lowercase, NFD, drop combining marks."""
    return "".join(c for c in unicodedata.normalize("NFD", text.lower()) if unicodedata.category(c) != "Mn")


def no_space(text: str) -> str:
    return "".join(text.split())


def read_split(prefix: Path, dtype: str) -> tuple[np.ndarray, IndexedDataset]:
    return np.fromfile(f"{prefix}.bin", dtype=dtype), IndexedDataset(str(prefix))


def check_structure(data: IndexedDataset, docs: list[list[str]]) -> None:
    """One item per input line, documents where the blank lines were."""
    assert len(data) == sum(len(doc) for doc in docs)
    assert data.num_documents == len(docs)
    assert np.diff(np.asarray(data.document_index)).tolist() == [len(doc) for doc in docs]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    docs = documents(40, seed=1)
    return write_corpus(tmp_path_factory.mktemp("corpus") / "train.txt", docs), docs


def test_existing_wordpiece_vocab_gives_the_tokenizers_library_ids(tmp_path: Path, corpus) -> None:
    path, docs = corpus
    vocab = reference_wordpiece(corpus_lines(docs), 200, tmp_path / "my_vocab.txt")
    assert main(["--trainpref", str(path), "--destdir", str(tmp_path / "out"), "--dict", str(vocab)]) == 0

    reference = BertWordPieceTokenizer(str(vocab), lowercase=True)
    expected = [reference.encode(line, add_special_tokens=False).ids for line in corpus_lines(docs)]
    tokens, data = read_split(tmp_path / "out" / "train", "uint16")
    assert tokens.tolist() == [i for ids in expected for i in ids]
    check_structure(data, docs)
    for i, line in enumerate(corpus_lines(docs)):
        assert no_space(reference.decode(data[i].tolist())) == no_space(bert_normalized(line))
    assert (tmp_path / "out" / "vocab.txt").read_text() == vocab.read_text()
    meta = json.loads((tmp_path / "out" / "preprocess.json").read_text())
    assert meta["tokenizer"] == {"kind": "wordpiece", "path": "vocab.txt", "lowercase": True}
    assert meta["splits"]["train"]["sentences"] == len(corpus_lines(docs))


def test_no_lowercase_keeps_case(tmp_path: Path, corpus) -> None:
    path, docs = corpus
    vocab = reference_wordpiece(corpus_lines(docs), 300, tmp_path / "cased.txt", lowercase=False)
    assert main(["--trainpref", str(path), "--destdir", str(tmp_path / "out"), "--dict", str(vocab),
                 "--no-lowercase"]) == 0
    reference = BertWordPieceTokenizer(str(vocab), lowercase=False)
    tokens, _ = read_split(tmp_path / "out" / "train", "uint16")
    expected = [reference.encode(line, add_special_tokens=False).ids for line in corpus_lines(docs)]
    assert tokens.tolist() == [i for ids in expected for i in ids]
    assert reference.token_to_id("Alice") in tokens  # a cased token survived


def test_gzip_input_and_worker_processes_give_identical_files(tmp_path: Path, corpus) -> None:
    path, docs = corpus
    vocab = reference_wordpiece(corpus_lines(docs), 200, tmp_path / "vocab.txt")
    gz = tmp_path / "train.txt.gz"
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    assert main(["--trainpref", str(path), "--destdir", str(tmp_path / "one"), "--dict", str(vocab)]) == 0
    assert main(["--trainpref", str(gz), "--destdir", str(tmp_path / "two"), "--dict", str(vocab),
                 "--workers", "2"]) == 0
    for suffix in (".bin", ".idx"):
        one = (tmp_path / "one" / f"train{suffix}").read_bytes()
        assert one == (tmp_path / "two" / f"train{suffix}").read_bytes()


def test_trained_wordpiece_vocab_has_special_tokens_and_round_trips(tmp_path: Path, corpus) -> None:
    path, docs = corpus
    assert main(["--trainpref", str(path), "--validpref", str(path), "--destdir", str(tmp_path / "out"),
                 "--tokenizer", "wordpiece", "--vocab-size", "150"]) == 0
    vocab_file = tmp_path / "out" / "vocab.txt"
    tokens = vocab_file.read_text(encoding="utf-8").split("\n")[:-1]
    assert set(SPECIALS) <= set(tokens) and len(tokens) <= 150
    reference = BertWordPieceTokenizer(str(vocab_file), lowercase=True)
    ours = load_tokenizer(TokenizerSpec("wordpiece", str(vocab_file), lowercase=True))
    for split in ("train", "valid"):
        _, data = read_split(tmp_path / "out" / split, "uint16")
        check_structure(data, docs)
        for i, line in enumerate(corpus_lines(docs)):
            assert no_space(reference.decode(data[i].tolist())) == no_space(bert_normalized(line))
            assert no_space(ours.decode([ours.vocab.cls, *data[i].tolist()])) == no_space(bert_normalized(line))


def test_trained_sentencepiece_round_trips_exactly_modulo_nfkc_and_whitespace(tmp_path: Path, corpus) -> None:
    path, docs = corpus
    assert main(["--trainpref", str(path), "--destdir", str(tmp_path / "out"), "--tokenizer", "sentencepiece",
                 "--vocab-size", "120", "--no-lowercase", "--character-coverage", "1.0"]) == 0
    model = str(tmp_path / "out" / "sentencepiece.model")
    processor = spm.SentencePieceProcessor(model_file=model)
    assert [processor.id_to_piece(i) for i in range(4)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    assert processor.is_control(processor.piece_to_id("[MASK]"))
    ours = load_tokenizer(TokenizerSpec("sentencepiece", model))
    _, data = read_split(tmp_path / "out" / "train", "uint16")
    check_structure(data, docs)
    for i, line in enumerate(corpus_lines(docs)):
        expected = " ".join(unicodedata.normalize("NFKC", line).split())
        assert processor.decode(data[i].tolist()) == expected
        assert ours.decode([ours.vocab.cls, *data[i].tolist(), ours.vocab.sep]) == expected


def test_existing_sentencepiece_model_gives_the_library_ids(tmp_path: Path, corpus) -> None:
    path, docs = corpus
    model = reference_sentencepiece(corpus_lines(docs), 120, tmp_path / "m.model")
    assert main(["--trainpref", str(path), "--destdir", str(tmp_path / "out"),
                 "--sentencepiece-model", str(model), "--workers", "2"]) == 0
    processor = spm.SentencePieceProcessor(model_file=str(model))
    tokens, _ = read_split(tmp_path / "out" / "train", "uint16")
    assert tokens.tolist() == [i for line in corpus_lines(docs) for i in processor.encode(line)]
    assert (tmp_path / "out" / "sentencepiece.model").read_bytes() == model.read_bytes()


def test_vocabularies_of_65536_tokens_or_more_are_stored_as_int32(tmp_path: Path) -> None:
    words = [f"w{i}" for i in range(70_000)]
    vocab = tmp_path / "big.txt"
    vocab.write_text("\n".join(SPECIALS + words) + "\n")
    text = write_corpus(tmp_path / "t.txt", [["w69999 w3 w65536 w70"]])
    assert main(["--trainpref", str(text), "--destdir", str(tmp_path / "out"), "--dict", str(vocab)]) == 0
    tokens, _ = read_split(tmp_path / "out" / "train", "int32")
    assert tokens.tolist() == [5 + 69999, 5 + 3, 5 + 65536, 5 + 70]
    assert json.loads((tmp_path / "out" / "preprocess.json").read_text())["splits"]["train"]["dtype"] == "int32"


# -- errors ----------------------------------------------------------------------


def run_error(args: list[str], capsys: pytest.CaptureFixture) -> str:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetfair-preprocess: error:"), err
    return lines[0]


@pytest.fixture
def vocab(tmp_path: Path, corpus) -> Path:
    return reference_wordpiece(corpus_lines(corpus[1]), 200, tmp_path / "vocab.txt")


def test_empty_input_is_an_error(tmp_path: Path, vocab: Path, capsys) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    line = run_error(["--trainpref", str(empty), "--destdir", str(tmp_path / "o"), "--dict", str(vocab)], capsys)
    assert "contains no text" in line


def test_missing_input_is_an_error(tmp_path: Path, vocab: Path, capsys) -> None:
    line = run_error(["--trainpref", str(tmp_path / "nope.txt"), "--dict", str(vocab),
                      "--destdir", str(tmp_path / "o")], capsys)
    assert "nope.txt does not exist" in line


@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_a_truncated_or_corrupt_gzip_input_is_one_line_naming_it(tmp_path: Path, corpus, vocab: Path, capsys,
                                                                 how: str) -> None:
    gz = tmp_path / "train.txt.gz"
    gz.write_bytes(damaged(gzip.compress(corpus[0].read_bytes()), how))
    line = run_error(["--trainpref", str(gz), "--destdir", str(tmp_path / "o"), "--dict", str(vocab)], capsys)
    assert f"{gz} is truncated or corrupt: " in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content, message", [
    (b"\x80\x81binary\x00junk", "not UTF-8"),
    (b"this is a sentence, not a vocabulary\n", "not a single token"),
    (b"[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n", "lacks the special tokens [MASK]"),
])
def test_dict_that_is_not_a_vocabulary_is_an_error(tmp_path: Path, corpus, capsys, content, message) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    line = run_error(["--trainpref", str(corpus[0]), "--dict", str(bad), "--destdir", str(tmp_path / "o")], capsys)
    assert message in line


def test_unreadable_sentencepiece_model_is_an_error(tmp_path: Path, corpus, capsys) -> None:
    line = run_error(["--trainpref", str(corpus[0]), "--sentencepiece-model", str(corpus[0]),
                      "--destdir", str(tmp_path / "o")], capsys)
    assert "cannot read sentencepiece model" in line


def test_sentencepiece_model_without_bert_special_tokens_is_an_error(tmp_path: Path, corpus, capsys) -> None:
    model = reference_sentencepiece(corpus_lines(corpus[1]), 120, tmp_path / "plain.model", with_specials=False)
    line = run_error(["--trainpref", str(corpus[0]), "--sentencepiece-model", str(model),
                      "--destdir", str(tmp_path / "o")], capsys)
    assert "lacks the special tokens [PAD] [UNK] [CLS] [SEP] [MASK]" in line


def test_destdir_vocabulary_that_differs_from_the_given_one_is_an_error(tmp_path: Path, corpus, vocab,
                                                                       capsys) -> None:
    out = str(tmp_path / "o")
    assert main(["--trainpref", str(corpus[0]), "--dict", str(vocab), "--destdir", out]) == 0
    other = reference_wordpiece(corpus_lines(corpus[1]), 120, tmp_path / "other.txt")
    line = run_error(["--validpref", str(corpus[0]), "--dict", str(other), "--destdir", out], capsys)
    assert "differs from" in line
    # The same vocabulary (or none) adds splits to the directory.
    assert main(["--validpref", str(corpus[0]), "--destdir", out]) == 0
    assert json.loads((tmp_path / "o" / "preprocess.json").read_text())["splits"].keys() == {"train", "valid"}


def test_no_vocabulary_choice_is_an_error(tmp_path: Path, corpus, capsys) -> None:
    line = run_error(["--trainpref", str(corpus[0]), "--destdir", str(tmp_path / "o")], capsys)
    assert "choose a vocabulary" in line


def test_console_script_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "hetfair_cli.preprocess", "--trainpref", str(tmp_path / "x"),
                             "--tokenizer", "wordpiece", "--destdir", str(tmp_path / "o")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    expected = f"hetfair-preprocess: error: input file {tmp_path / 'x'} does not exist"
    assert result.stderr.strip().splitlines() == [expected]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file of ``directory`` (hidden ones too) and its content."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize("content, message", [
    (b"A good first line.\n\x80\x81binary\x00junk\n", "not UTF-8"),
    (b"\n  \n\n", "contains no text"),
])
def test_a_failed_run_leaves_an_existing_destdir_untouched(tmp_path: Path, corpus, vocab, capsys, content,
                                                          message) -> None:
    out = tmp_path / "o"
    assert main(["--trainpref", str(corpus[0]), "--validpref", str(corpus[0]), "--dict", str(vocab),
                 "--destdir", str(out)]) == 0
    before = snapshot(out)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    # the good split is processed first, the bad one fails: nothing of the run may land
    line = run_error(["--validpref", str(corpus[0]), "--trainpref", str(bad), "--dict", str(vocab),
                      "--destdir", str(out)], capsys)
    assert message in line
    assert snapshot(out) == before
    IndexedDataset(str(out / "train"))  # still readable


def test_destdir_that_is_a_file_is_an_error(tmp_path: Path, corpus, vocab, capsys) -> None:
    target = tmp_path / "file"
    target.write_text("keep me")
    line = run_error(["--trainpref", str(corpus[0]), "--dict", str(vocab), "--destdir", str(target)], capsys)
    assert "is not a directory" in line
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("flags, message", [
    (["--vocab-size", "0"], "--vocab-size must be"),
    (["--vocab-size", "5"], "--vocab-size must be"),
    (["--character-coverage", "0"], "--character-coverage must be"),
    (["--workers", "0"], "--workers must be at least 1"),
])
def test_bad_numbers_are_refused_before_any_work(tmp_path: Path, corpus, capsys, flags, message) -> None:
    line = run_error(["--trainpref", str(corpus[0]), "--tokenizer", "wordpiece", "--destdir", str(tmp_path / "o"),
                      *flags], capsys)
    assert message in line
    assert not (tmp_path / "o").exists()


def test_wordpiece_training_is_deterministic(tmp_path: Path, corpus) -> None:
    # the tokenizers trainer numbers "##" tokens in hash-map order, random per run (huggingface/tokenizers#1794)
    vocabularies = set()
    for run in range(4):
        out = tmp_path / str(run)
        assert main(["--trainpref", str(corpus[0]), "--destdir", str(out), "--tokenizer", "wordpiece",
                     "--vocab-size", "300"]) == 0
        vocabularies.add((out / "vocab.txt").read_text(encoding="utf-8"))
    assert len(vocabularies) == 1


def test_a_failed_run_in_a_fresh_destdir_leaves_no_destdir_and_announces_no_file(tmp_path: Path, corpus,
                                                                                  capsys) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"A good first line.\n\x80\x81binary\x00junk\n")
    out = tmp_path / "fresh"
    # the training split and the trained vocabulary succeed, the validation split fails
    line = run_error(["--trainpref", str(corpus[0]), "--validpref", str(bad), "--tokenizer", "wordpiece",
                      "--vocab-size", "150", "--destdir", str(out)], capsys)
    assert "not UTF-8" in line
    assert not out.exists()
    assert capsys.readouterr().out == ""
