"""The tokenizer hetfair-export writes: transformers' AutoTokenizer must give the ids training used.

The text is the Jargon File (Debian's ``jargon-text``): prose, ASCII art, accents, odd spacing.
Where two segmentations have the same sentencepiece score, sentencepiece's float32 sums and
tokenizers' float64 sums may pick different ones; the tests allow exactly those lines, and few.
"""

from __future__ import annotations

import gzip
import io
import re
from pathlib import Path

import pytest
import sentencepiece as spm

transformers = pytest.importorskip("transformers")

from bert_helpers import write_bert_config  # noqa: E402
from hetfair.bert.data_dir import destdir_tokenizer_spec  # noqa: E402
from hetfair.bert.hf_tokenizer import hf_tokenizer_files, hf_vocabulary_tokens  # noqa: E402
from hetfair.data.indexed_dataset import IndexedDataset  # noqa: E402
from hetfair.bert.tokenizer import TokenizerSpec, load_tokenizer, train_tokenizer  # noqa: E402
from hetfair.errors import ConfigError  # noqa: E402
from hetfair_cli.export import main as export_main  # noqa: E402
from hetfair_cli.preprocess import main as preprocess_main  # noqa: E402
from hetfair_cli.train import main as train_main  # noqa: E402

JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
BERT_SPECIALS = {"pad_id": 0, "pad_piece": "[PAD]", "unk_id": 1, "unk_piece": "[UNK]", "bos_id": 2,
                 "bos_piece": "[CLS]", "eos_id": 3, "eos_piece": "[SEP]", "control_symbols": ["[MASK]"]}


@pytest.fixture(scope="module")
def jargon() -> list[str]:
    if not JARGON.is_file():
        pytest.skip(f"{JARGON} is missing: apt-get install jargon-text (make test does)")
    with gzip.open(JARGON, "rt", encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def train_sentencepiece(lines: list[str], path: Path, **options: object) -> TokenizerSpec:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=1000,
                                   minloglevel=2, **BERT_SPECIALS, **options)  # type: ignore[arg-type]
    path.write_bytes(model.getvalue())
    return TokenizerSpec("sentencepiece", str(path))


def write_files(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir()
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")
    return directory


def assert_same_ids(spec: TokenizerSpec, lines: list[str], expected: list[list[int]], directory: Path) -> None:
    """``AutoTokenizer.from_pretrained(directory)`` gives ``expected``, except on lines where sentencepiece ties."""
    theirs = transformers.AutoTokenizer.from_pretrained(directory)(lines, add_special_tokens=False)["input_ids"]
    differ = [i for i, (a, b) in enumerate(zip(expected, theirs)) if a != b]
    if spec.kind == "sentencepiece":
        score = spm.SentencePieceProcessor(model_file=spec.path).get_score
        ties = [i for i in differ if sum(map(score, expected[i])) == pytest.approx(sum(map(score, theirs[i])))]
        differ = [i for i in differ if i not in ties]
        assert len(ties) <= len(lines) // 1000, [lines[i] for i in ties]
    assert not differ, [(lines[i], expected[i], theirs[i]) for i in differ[:3]]


@pytest.mark.parametrize("kind", ["sentencepiece (hetfair, case-folded)", "sentencepiece (cased, byte fallback)",
                                  "sentencepiece (identity, no dummy prefix)", "wordpiece", "wordpiece (cased)"])
def test_the_exported_tokenizer_gives_the_training_ids_on_real_text(tmp_path, jargon, kind):
    sample = jargon[:5000:2]  # the vocabulary is trained on some lines, compared on all
    if kind.startswith("wordpiece"):
        spec = train_tokenizer("wordpiece", lambda: sample, 2000, lowercase="cased" not in kind, out_dir=str(tmp_path))
    elif "hetfair" in kind:
        spec = train_tokenizer("sentencepiece", lambda: sample, 1000, lowercase=True, out_dir=str(tmp_path))
    elif "byte fallback" in kind:
        spec = train_sentencepiece(sample, tmp_path / "m.model", byte_fallback=True, character_coverage=0.99,
                                   remove_extra_whitespaces=False, split_digits=True)
    else:
        spec = train_sentencepiece(sample, tmp_path / "m.model", normalization_rule_name="identity",
                                   add_dummy_prefix=False)
    ours = load_tokenizer(spec)
    directory = write_files(tmp_path / "hf", hf_tokenizer_files(spec, ours.vocab, max_length=128))
    assert_same_ids(spec, jargon, ours.encode_batch(jargon), directory)
    assert hf_vocabulary_tokens(str(directory)) == list(ours.vocab.tokens)


def test_a_sentencepiece_export_has_the_ids_of_the_training_data_and_berts_special_tokens(tmp_path, jargon):
    """hetfair-preprocess -> hetfair-train -> hetfair-export; AutoTokenizer on the training text gives train.bin."""
    text = tmp_path / "train.txt"
    text.write_text("\n\n".join("\n".join(jargon[i:i + 20]) for i in range(0, 3000, 20)) + "\n", encoding="utf-8")
    data = tmp_path / "data"
    assert preprocess_main(["--trainpref", str(text), "--destdir", str(data), "--tokenizer", "sentencepiece",
                            "--vocab-size", "1000"]) == 0
    assert train_main(["--task", "bert", "--data", str(data), "--config_file", str(write_bert_config(tmp_path / "c.json")),
                       "--max-update", "1", "--max-sentences", "4", "--save-dir", str(tmp_path / "ckpt"),
                       "--log-format", "none", "--disable-validation"]) == 0
    out = tmp_path / "hf"
    assert export_main(["--path", str(tmp_path / "ckpt" / "checkpoint_last.pt"), "--to", "hf", str(out)]) == 0
    assert not (out / "vocab.txt").exists()  # a vocab.txt of pieces would make BertTokenizer split text wrongly

    spec = destdir_tokenizer_spec(str(data))
    trained_on = IndexedDataset(str(data / "train"))
    assert_same_ids(spec, jargon[:3000], [trained_on[i].tolist() for i in range(len(trained_on))], out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    vocab = load_tokenizer(spec).vocab
    assert (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id, tokenizer.pad_token_id,
            tokenizer.unk_token_id) == (vocab.cls, vocab.sep, vocab.mask, vocab.pad, vocab.unk)
    pair = tokenizer(jargon[0], jargon[1])
    first, second = trained_on[0].tolist(), trained_on[1].tolist()
    assert pair["input_ids"] == [vocab.cls, *first, vocab.sep, *second, vocab.sep]  # [CLS] A [SEP] B [SEP], as in training
    assert pair["token_type_ids"] == [0] * (len(first) + 2) + [1] * (len(second) + 1)
    assert tokenizer("a [MASK] b")["input_ids"].count(vocab.mask) == 1


@pytest.mark.parametrize("options, message", [
    ({"model_type": "bpe"}, "is a BPE sentencepiece model"),
    ({"user_defined_symbols": ["hacker"]}, "has user-defined symbols (hacker)"),
])
def test_a_sentencepiece_model_a_tokenizer_json_cannot_rebuild_is_refused(tmp_path, jargon, options, message):
    spec = train_sentencepiece(jargon[:2000], tmp_path / "m.model", **options)
    with pytest.raises(ConfigError, match=re.escape(message)):
        hf_tokenizer_files(spec, load_tokenizer(spec).vocab, max_length=128)
