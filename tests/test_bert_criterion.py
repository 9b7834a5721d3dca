"""masked_lm: summed cross-entropy over masked tokens, NSP weighting, split invariance, base-2 metrics."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hetfair.bert.criterion import MaskedLmCriterion
from hetfair.bert.model import BertConfig, BertModel

VOCAB = 40


def make_sample(seed: int = 0, rows: int = 6, length: int = 10, nsp: bool = False,
                mask_rate: float = 0.3) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB, (rows, length), generator=generator)
    lengths = torch.randint(3, length + 1, (rows,), generator=generator)
    attention_mask = torch.arange(length) < lengths[:, None]
    chosen = (torch.rand(rows, length, generator=generator) < mask_rate) & attention_mask
    target = torch.where(chosen, torch.randint(5, VOCAB, (rows, length), generator=generator), -100)
    sample = {
        "net_input": {"input_ids": input_ids, "token_type_ids": torch.zeros_like(input_ids),
                      "attention_mask": attention_mask},
        "target": target,
        "nsentences": rows,
        "ntokens": int(attention_mask.sum()),
    }
    if nsp:
        sample["nsentence_labels"] = torch.randint(0, 2, (rows,), generator=generator)
    return sample


def model_and_criterion(nsp: bool = False, weight: float = 1.0) -> tuple[BertModel, MaskedLmCriterion]:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertModel(config, nsp=nsp).eval(), MaskedLmCriterion(SimpleNamespace(), weight)


def rows(sample: dict, index: slice) -> dict:
    part = {**sample, "net_input": {k: v[index] for k, v in sample["net_input"].items()},
            "target": sample["target"][index]}
    part["nsentences"] = len(part["target"])
    if "nsentence_labels" in sample:
        part["nsentence_labels"] = sample["nsentence_labels"][index]
    return part


def test_loss_is_the_summed_cross_entropy_of_masked_tokens() -> None:
    model, criterion = model_and_criterion()
    sample = make_sample()
    loss, sample_size, logs = criterion(model, sample)
    full = model(**sample["net_input"])["mlm_logits"]  # every position
    masked = sample["target"] != -100
    log_probs = torch.log_softmax(full[masked], dim=-1)
    expected = -log_probs.gather(1, sample["target"][masked][:, None]).sum()
    assert sample_size == int(masked.sum()) > 0
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert logs["loss"] == logs["nll_loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert logs["mlm_correct"] == (full[masked].argmax(-1) == sample["target"][masked]).sum().item()
    assert logs["nsentences"] == 6 and logs["ntokens"] == sample["ntokens"]


def test_nsp_loss_of_each_sentence_is_weighted_by_its_masked_tokens() -> None:
    model, criterion = model_and_criterion(nsp=True, weight=0.5)
    sample = make_sample(nsp=True)
    loss, _, logs = criterion(model, sample)
    with torch.no_grad():
        out = model(**sample["net_input"], masked_tokens=sample["target"] != -100)
    nsp = torch.nn.functional.cross_entropy(out["nsp_logits"], sample["nsentence_labels"], reduction="none")
    masks_per_row = (sample["target"] != -100).sum(1)
    expected = logs["nll_loss"] + 0.5 * float((masks_per_row * nsp).sum())
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert logs["nsp_loss"] == pytest.approx(nsp.sum().item(), rel=1e-5) and logs["nsp_count"] == 6
    metrics = criterion.reduce_metrics({**logs, "sample_size": float(masks_per_row.sum())})
    assert metrics["nsp_loss"] == pytest.approx(nsp.mean().item() / math.log(2), rel=1e-5)
    predicted = out["nsp_logits"].argmax(-1)
    assert metrics["nsp_accuracy"] == pytest.approx(100 * (predicted == sample["nsentence_labels"]).float().mean())


@pytest.mark.parametrize("nsp", [False, True])
def test_gradient_is_the_same_for_any_split_of_the_batch(nsp: bool) -> None:
    """sum(loss) / sum(sample_size) over micro-batches equals the whole batch's, so updates do not depend on splits."""
    model, criterion = model_and_criterion(nsp=nsp)
    sample = make_sample(seed=3, rows=8, nsp=nsp)

    def normalized_grads(parts: list[dict]) -> list[torch.Tensor]:
        model.zero_grad()
        total = 0
        for part in parts:
            loss, sample_size, _ = criterion(model, part)
            loss.backward()
            total += sample_size
        return [p.grad / total for p in model.parameters()]

    whole = normalized_grads([sample])
    split = normalized_grads([rows(sample, slice(0, 3)), rows(sample, slice(3, 8))])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, split))


def test_a_batch_without_masked_tokens_gives_zero_loss_and_finite_gradients() -> None:
    model, criterion = model_and_criterion(nsp=True)
    sample = make_sample(nsp=True, mask_rate=0.0)
    loss, sample_size, logs = criterion(model, sample)
    loss.backward()
    assert sample_size == 0 and loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    metrics = criterion.reduce_metrics({**logs, "sample_size": 0.0})
    assert all(math.isfinite(v) for v in metrics.values())


def test_metrics_are_bits_per_masked_token() -> None:
    logs = {"loss": 30.0, "nll_loss": 20.0, "mlm_correct": 5.0, "sample_size": 10.0, "nsentences": 2.0}
    metrics = MaskedLmCriterion.reduce_metrics(logs)
    assert metrics["loss"] == pytest.approx(3.0 / math.log(2))
    assert metrics["nll_loss"] == pytest.approx(2.0 / math.log(2))
    assert metrics["ppl"] == pytest.approx(math.exp(2.0))  # 2 ** bits == e ** nats
    assert metrics["mlm_accuracy"] == pytest.approx(50.0)
    assert "nsp_accuracy" not in metrics
