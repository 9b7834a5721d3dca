"""BERT samples: block packing, sentence pairs and dynamic masking (statistics and reproducibility)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hetfair.bert.dataset import (
    IS_NEXT,
    NOT_NEXT,
    BertDataset,
    build_blocks,
    collate_bert,
)
from hetfair.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from hetfair.bert.masking import MaskingConfig
from hetfair.bert.tokenizer import SPECIAL_TOKENS, Vocabulary

VOCAB = Vocabulary.from_tokens(list(SPECIAL_TOKENS) + [f"w{i}" for i in range(995)], "test")
SPECIAL_IDS = set(VOCAB.special_ids)


def build_corpus(prefix: Path, n_docs: int, seed: int = 0) -> list[list[np.ndarray]]:
    """Random documents of random sentences; about 1% of the tokens are [UNK] as in real data."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix), np.dtype(np.uint16))
    documents = []
    for _ in range(n_docs):
        document = [rng.integers(5, len(VOCAB), size=rng.integers(1, 40)) for _ in range(rng.integers(1, 8))]
        for sentence in document:
            sentence[rng.random(len(sentence)) < 0.01] = VOCAB.unk
            builder.add_sentence(sentence)
        builder.end_document()
        documents.append(document)
    builder.finalize()
    return documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> IndexedDataset:
    prefix = tmp_path_factory.mktemp("masking") / "train"
    build_corpus(prefix, n_docs=800)
    return IndexedDataset(str(prefix))


def dataset(data: IndexedDataset, seed: int = 1, nsp: bool = False, tokens: int = 64) -> BertDataset:
    return BertDataset(data, VOCAB, tokens, MaskingConfig(), seed=seed, nsp=nsp)


def original(item: dict[str, torch.Tensor]) -> torch.Tensor:
    """The uncorrupted sequence: labels where predicted, inputs elsewhere."""
    return torch.where(item["labels"] != -100, item["labels"], item["input_ids"])


# -- blocks ------------------------------------------------------------------------


def test_blocks_pack_whole_sentences_of_one_document_up_to_the_budget(tmp_path: Path) -> None:
    build_corpus(tmp_path / "d", n_docs=300, seed=3)
    data = IndexedDataset(str(tmp_path / "d"))
    offsets = np.asarray(data.sentence_offsets)
    budget = 30
    blocks, documents = build_blocks(offsets, np.asarray(data.document_index), budget)
    sentence_starts = set(offsets.tolist())
    for d in range(data.num_documents):
        mine = blocks[documents == d]
        doc_start = offsets[data.document_index[d]]
        doc_end = offsets[data.document_index[d + 1]]
        # Contiguous, in order, covering the document exactly.
        assert mine[0, 0] == doc_start and mine[-1, 1] == doc_end
        assert (mine[1:, 0] == mine[:-1, 1]).all()
        for start, end in mine.tolist():
            assert 0 < end - start <= budget
            # A block starts at a sentence unless it continues a sentence cut at the budget.
            assert start in sentence_starts or end - start == budget or end in sentence_starts
        # Greedy: a block that ends at a sentence start could not have taken the next sentence.
        for (start, end), (next_start, _) in zip(mine[:-1].tolist(), mine[1:].tolist()):
            if end in sentence_starts:
                next_sentence_end = offsets[np.searchsorted(offsets, end, "right")]
                assert next_sentence_end - start > budget


# -- masking statistics ----------------------------------------------------------------


def test_masking_rates_are_15_percent_and_80_10_10(corpus: IndexedDataset) -> None:
    ds = dataset(corpus)
    chosen = maskable = to_mask = to_random = kept = 0
    random_tokens: set[int] = set()
    for i in range(len(ds)):
        item = ds[i]
        inputs, labels, truth = item["input_ids"], item["labels"], original(item)
        start, end = ds.blocks[i]
        assert truth[1:-1].tolist() == corpus.tokens[start:end].tolist()
        is_special = torch.tensor([t in SPECIAL_IDS for t in truth.tolist()])
        assert (labels[is_special] == -100).all()  # never predict [CLS], [SEP], [UNK]
        assert (inputs[is_special] == truth[is_special]).all()
        picked = labels != -100
        maskable += int((~is_special).sum())
        chosen += int(picked.sum())
        to_mask += int((inputs[picked] == VOCAB.mask).sum())
        replaced = picked & (inputs != VOCAB.mask) & (inputs != truth)
        to_random += int(replaced.sum())
        kept += int((picked & (inputs == truth)).sum())
        random_tokens.update(inputs[replaced].tolist())
    assert maskable > 50_000
    assert chosen / maskable == pytest.approx(0.15, abs=0.004)
    assert to_mask / chosen == pytest.approx(0.8, abs=0.015)
    assert to_random / chosen == pytest.approx(0.1 * (1 - 1 / 995), abs=0.01)
    assert kept / chosen == pytest.approx(0.1 + 0.1 / 995, abs=0.01)
    assert not random_tokens & SPECIAL_IDS and len(random_tokens) > 500


def test_short_sequences_are_masked_at_the_expected_rate(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "s"), np.dtype(np.uint16))
    for i in range(4000):
        builder.add_sentence(np.array([10 + i % 900, 11, 12]))
        builder.end_document()
    builder.finalize()
    ds = dataset(IndexedDataset(str(tmp_path / "s")))
    chosen = sum(int((ds[i]["labels"] != -100).sum()) for i in range(len(ds)))
    assert chosen / (3 * len(ds)) == pytest.approx(0.15, abs=0.01)  # 0.45 per sample, not rounded to 0


# -- reproducibility ---------------------------------------------------------------------


def as_list(items: list) -> list:
    return items


def test_masks_depend_only_on_seed_epoch_and_index(corpus: IndexedDataset) -> None:
    ds, same = dataset(corpus), dataset(corpus)
    for i in (0, 5, 77):
        a, b = ds[i], same[i]
        assert all(torch.equal(a[k], b[k]) for k in a)
    epoch2, other_seed = dataset(corpus), dataset(corpus, seed=2)
    epoch2.set_epoch(2)
    long_items = [i for i in range(200) if len(ds[i]["labels"]) > 30]
    for changed in (epoch2, other_seed):
        differ = sum(not torch.equal(ds[i]["labels"], changed[i]["labels"]) for i in long_items)
        assert differ >= 0.95 * len(long_items)
    epoch2.set_epoch(1)
    assert torch.equal(epoch2[5]["input_ids"], ds[5]["input_ids"])


def test_masks_do_not_depend_on_batching_or_workers(corpus: IndexedDataset) -> None:
    ds = dataset(corpus, nsp=True)
    ds.set_epoch(3)
    indices = list(range(40))
    serial = [item for batch in DataLoader(torch.utils.data.Subset(ds, indices), batch_size=3, collate_fn=as_list)
              for item in batch]
    parallel = [item for batch in DataLoader(torch.utils.data.Subset(ds, indices), batch_size=5, num_workers=2,
                                             collate_fn=as_list) for item in batch]
    assert len(serial) == len(parallel) == 40
    for a, b in zip(serial, parallel):
        assert all(torch.equal(a[k], b[k]) for k in a)


# -- sentence pairs ---------------------------------------------------------------------------


def test_sentence_pairs_are_true_continuations_or_from_another_document(corpus: IndexedDataset) -> None:
    ds = dataset(corpus, nsp=True)
    offsets = np.asarray(corpus.sentence_offsets)
    doc_of_token = np.searchsorted(offsets[np.asarray(corpus.document_index)], np.arange(corpus.num_tokens), "right") - 1
    blocks_by_first_token: dict[int, list[int]] = {}
    for j, (s, _) in enumerate(ds.blocks.tolist()):
        blocks_by_first_token.setdefault(int(corpus.tokens[s]), []).append(j)
    labels = []
    for i in range(len(ds)):
        item = ds[i]
        truth, types = original(item), item["token_type_ids"]
        first_sep = int((truth == VOCAB.sep).nonzero()[0])
        assert truth[0] == VOCAB.cls and truth[-1] == VOCAB.sep and len(truth) <= 64
        assert (types[:first_sep + 1] == 0).all() and (types[first_sep + 1:] == 1).all()
        a, b = truth[1:first_sep].numpy(), truth[first_sep + 1:-1].numpy()
        start, end = ds.blocks[i]
        block = np.asarray(corpus.tokens[start:end])
        assert np.array_equal(a, block[:len(a)]) and len(a) >= 1 and len(b) >= 1
        inner_boundaries = offsets[(offsets > start) & (offsets < end)]
        if len(inner_boundaries):
            assert start + len(a) in inner_boundaries  # split between sentences
        label = int(item["nsp_label"])
        labels.append(label)
        if label == IS_NEXT:
            assert np.array_equal(b, block[len(a):])
        else:
            sources = [ds.blocks[j][0] for j in blocks_by_first_token.get(int(b[0]), [])
                       if np.array_equal(corpus.tokens[ds.blocks[j][0]:ds.blocks[j][0] + len(b)], b)]
            assert any(doc_of_token[s] != doc_of_token[start] for s in sources)
    for epoch in (2, 3):
        ds.set_epoch(epoch)
        labels += [int(ds[i]["nsp_label"]) for i in range(len(ds))]
    assert np.mean(labels) == pytest.approx(0.5, abs=0.04) and set(labels) == {IS_NEXT, NOT_NEXT}


# -- batches -------------------------------------------------------------------------------------


def test_collater_pads_and_counts(corpus: IndexedDataset) -> None:
    ds = dataset(corpus, nsp=True)
    items = [ds[i] for i in range(6)]
    batch = collate_bert(items, VOCAB.pad)
    lengths = [len(item["input_ids"]) for item in items]
    net = batch["net_input"]
    assert net["input_ids"].shape == (6, max(lengths))
    for row, (item, length) in enumerate(zip(items, lengths)):
        assert torch.equal(net["input_ids"][row, :length], item["input_ids"])
        assert (net["input_ids"][row, length:] == VOCAB.pad).all()
        assert net["attention_mask"][row].tolist() == [True] * length + [False] * (max(lengths) - length)
        assert (batch["target"][row, length:] == -100).all()
        assert torch.equal(batch["target"][row, :length], item["labels"])
        assert (net["token_type_ids"][row, length:] == 0).all()
    assert batch["nsentences"] == 6 and batch["ntokens"] == sum(lengths)
    assert batch["nsentence_labels"].tolist() == [int(item["nsp_label"]) for item in items]
