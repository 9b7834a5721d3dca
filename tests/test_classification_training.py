"""Fine-tuning hetfair's BERT with the sentence_classification task, end to end.

A tiny BERT is pretrained with ``--task bert`` on Jargon File prose, then fine-tuned on Jargon
File sentence pairs (``--init-from-checkpoint``) on one process and on two gloo ranks of
different batch sizes; the fine-tuned model is exported and loaded with ``transformers``, whose
predictions the tests score themselves.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from classification_data import jargon_vocab, make_labelled_dir, prose_lines, rows
from helpers import final_parameters, free_port, node_commands, run_nodes
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import hetfair
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.options import parse_train_args
from hetfair.tasks import TASK_REGISTRY
from hetfair_cli.export import main as export_main
from hetfair_cli.preprocess import main as preprocess_main
from hetfair_cli.train import main as train_main

TRAIN, VALID = 64, 32


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("finetune")


@pytest.fixture(scope="module", autouse=True)
def datasets_cache(workdir):
    """The Arrow files ``datasets`` makes go under the test's folder (here and in the processes started)."""
    import datasets

    cache = workdir / "hf_datasets"
    saved, os.environ["HF_DATASETS_CACHE"] = os.environ.get("HF_DATASETS_CACHE"), str(cache)
    saved_config, datasets.config.HF_DATASETS_CACHE = datasets.config.HF_DATASETS_CACHE, cache
    yield
    datasets.config.HF_DATASETS_CACHE = saved_config
    if saved is None:
        os.environ.pop("HF_DATASETS_CACHE")
    else:
        os.environ["HF_DATASETS_CACHE"] = saved


@pytest.fixture(scope="module")
def pretrained(workdir) -> Path:
    """checkpoint_last.pt of a tiny BERT pretrained with --task bert (masked LM + NSP) on Jargon File prose."""
    vocab = jargon_vocab(workdir / "vocab.txt")
    text = workdir / "prose.txt"
    text.write_text("\n".join(prose_lines(400, skip=4000)) + "\n", encoding="utf-8")
    assert preprocess_main(["--trainpref", str(text), "--destdir", str(workdir / "pretraining"),
                            "--dict", str(vocab)]) == 0
    assert train_main(["--task", "bert", "--data", str(workdir / "pretraining"), "--arch", "bert_tiny", "--nsp",
                       "--max-position-embeddings", "64", "--tokens-per-sample", "64", "--optimizer", "sgd",
                       "--lr", "0.1", "--lr-scheduler", "fixed", "--max-update", "2", "--max-sentences", "8",
                       "--save-dir", str(workdir / "pretrained"), "--disable-validation", "--log-format", "none"]) == 0
    return workdir / "pretrained" / "checkpoint_last.pt"


def finetune_flags(workdir: Path, pretrained: Path, save_dir: Path) -> list[str]:
    # No dropout: every rank draws its own dropout masks, so only then are the updates comparable.
    return ["--task", "sentence_classification", "--data", str(workdir / "labelled"), "--num-classes", "2",
            "--text-pair-column", "second", "--arch", "bert_classifier", "--init-from-checkpoint", str(pretrained),
            "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0", "--optimizer", "sgd",
            "--lr", "0.3", "--lr-scheduler", "fixed", "--max-epoch", "4", "--global-batch-size", "16",
            "--best-checkpoint-metric", "accuracy", "--maximize-best-checkpoint-metric", "--save-dir", str(save_dir),
            "--log-format", "json", "--distributed-timeout", "120"]


def finetune(workdir: Path, pretrained: Path, batch_sizes: list[int], *per_node: str) -> tuple[Path, list[dict]]:
    """Save dir and valid log records of a fine-tuning run on ranks of ``batch_sizes`` (``per_node``: their flags)."""
    make_labelled_dir(workdir / "labelled", train=TRAIN, valid=VALID, pairs=True)
    save_dir = workdir / "_".join(["finetuned", *map(str, batch_sizes), *(f.strip("-") for f in per_node)])
    commands = node_commands(finetune_flags(workdir, pretrained, save_dir), batch_sizes,
                             f"tcp://127.0.0.1:{free_port()}", *per_node)
    results = run_nodes(commands, cwd=workdir, timeout=300)
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "leaked semaphore" not in result.stderr  # datasets' tqdm lock in a spawned rank
    records = [json.loads(line) for line in results[0].stderr.splitlines() if line.startswith("{")]
    return save_dir, [record for record in records if record["phase"] == "valid"]


@pytest.fixture(scope="module")
def single(workdir, pretrained) -> tuple[Path, list[dict]]:
    return finetune(workdir, pretrained, [16])


def test_the_classifier_starts_from_the_pretrained_encoder_without_its_heads(workdir, pretrained, caplog):
    make_labelled_dir(workdir / "labelled", train=TRAIN, valid=VALID, pairs=True)
    args = parse_train_args(finetune_flags(workdir, pretrained, workdir / "unused") + ["--max-sentences", "8"])
    task = TASK_REGISTRY.get(args.task).setup_task(args)
    with caplog.at_level(logging.INFO):
        model = task.build_model(args)
    weights = load_checkpoint(pretrained)["trainer"]["model"]
    state = model.state_dict()
    shared = [name for name in weights if name.startswith(("embeddings.", "layers.", "pooler."))]
    assert len(shared) == 5 + 2 * 12 + 2  # embeddings (3 and a norm's 2), 2 layers of 12 tensors, the pooler
    for name in shared:
        assert torch.equal(state[name], weights[name]), name
    assert not any(name.startswith(("lm_head", "nsp_head")) for name in state)
    assert "dropped: lm_head, nsp_head (pretraining heads); its pooler is kept" in caplog.text
    assert task.vocab_size == weights["embeddings.word.weight"].shape[0]


@pytest.mark.parametrize("backend", ["c10d", "fully_sharded"])
def test_two_heterogeneous_ranks_train_as_one_process(workdir, pretrained, single, backend):
    one_dir, one_valid = single
    two_dir, two_valid = finetune(workdir, pretrained, [6, 10], "--ddp-backend", backend)
    one, two = final_parameters(one_dir), final_parameters(two_dir)
    assert one.keys() == two.keys()
    for name in one:
        assert torch.allclose(one[name], two[name], atol=1e-5, rtol=1e-5), name
    assert [r["accuracy"] for r in one_valid] == [r["accuracy"] for r in two_valid]
    assert [r["loss"] for r in one_valid] == pytest.approx([r["loss"] for r in two_valid], abs=1e-5)


def test_the_best_checkpoint_is_the_first_epoch_of_highest_validation_accuracy(single):
    save_dir, valid = single
    accuracies = [record["accuracy"] for record in valid]
    assert len(set(accuracies)) > 1  # there is a choice to make (the run is deterministic)
    best_epoch = accuracies.index(max(accuracies)) + 1
    best = load_checkpoint(save_dir / "checkpoint_best.pt")
    of_epoch = load_checkpoint(save_dir / f"checkpoint{best_epoch}.pt")["trainer"]["model"]
    assert best["best_metric"] == pytest.approx(max(accuracies))
    assert all(torch.equal(best["trainer"]["model"][name], of_epoch[name]) for name in of_epoch)


def test_the_export_is_a_transformers_classifier_with_the_same_logits_and_logged_metrics(workdir, pretrained, single):
    save_dir, valid = single
    outdir = workdir / "exported"
    moved = pretrained.rename(pretrained.with_name("moved_away.pt"))  # the fine-tuned checkpoint needs it no more
    try:
        assert export_main(["--path", str(save_dir / "checkpoint_last.pt"), "--to", "hf", str(outdir)]) == 0
        ours = hetfair.load_model(save_dir / "checkpoint_last.pt")
    finally:
        moved.rename(pretrained)
    model = AutoModelForSequenceClassification.from_pretrained(outdir).eval()
    tokenizer = AutoTokenizer.from_pretrained(outdir)
    assert type(model).__name__ == "BertForSequenceClassification"
    table = rows(prose_lines(TRAIN + VALID)[TRAIN:], pairs=True)
    batch = tokenizer([r["text"] for r in table], [r["second"] for r in table], padding=True, truncation=True,
                      return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
        our_logits = ours.model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    assert torch.allclose(logits, our_logits, atol=1e-5)
    # the last validation's metrics, scored here from transformers' predictions
    predicted, targets = logits.argmax(1), torch.tensor([r["label"] for r in table])
    tp = ((predicted == 1) & (targets == 1)).sum().item()
    fp, fn = ((predicted == 1) & (targets == 0)).sum().item(), ((predicted == 0) & (targets == 1)).sum().item()
    assert valid[-1]["accuracy"] == pytest.approx(100 * (predicted == targets).float().mean().item(), abs=0.005)
    assert valid[-1]["f1"] == pytest.approx(100 * 2 * tp / (2 * tp + fp + fn), abs=0.0005)
    assert model.config.id2label == {0: "0", 1: "1"}


def test_a_tokenizer_of_another_vocabulary_is_one_line(workdir, pretrained, capsys):
    other = jargon_vocab(workdir / "other_vocab.txt", vocab_size=300)
    make_labelled_dir(workdir / "labelled", train=TRAIN, valid=VALID, pairs=True)
    code = train_main(finetune_flags(workdir, pretrained, workdir / "refused") + ["--tokenizer", str(other),
                                                                                     "--max-sentences", "8"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    sizes = [len(path.read_text().splitlines()) for path in (workdir / "vocab.txt", other)]
    assert f"has a vocabulary of {sizes[0]} tokens but the tokenizer has {sizes[1]}" in err
