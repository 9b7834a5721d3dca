"""The BERT model: sizes, attention against torch's reference layer, LM head at masked positions, configs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from bert_helpers import make_data_dir, write_bert_config
from torch import nn

from hetfair.errors import ConfigError
from hetfair.bert.model import BertConfig, BertLayer, BertModel
from hetfair.options import parse_train_args
from hetfair.tasks import TASK_REGISTRY

TINY = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=24)


def batch(vocab: int = 50, lengths: tuple[int, ...] = (12, 7, 12, 3), seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    size = max(lengths)
    input_ids = torch.randint(5, vocab, (len(lengths), size), generator=generator)
    attention_mask = torch.arange(size) < torch.tensor(lengths)[:, None]
    input_ids[~attention_mask] = 0
    token_type_ids = (torch.arange(size) >= size // 2).long().expand(len(lengths), -1) * attention_mask
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}


@pytest.mark.parametrize("nsp, published", [(False, 109_514_298), (True, 110_106_428)])
def test_bert_base_has_the_published_parameter_count(nsp: bool, published: int) -> None:
    # Hugging Face's bert-base-uncased: BertForMaskedLM 109,514,298; BertForPreTraining 110,106,428.
    model = BertModel(BertConfig(vocab_size=30522), nsp=nsp)
    assert sum(p.numel() for p in model.parameters()) == published


def test_layer_matches_torch_transformer_encoder_layer_with_padding() -> None:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=10, hidden_size=16, num_attention_heads=4, intermediate_size=40,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ours = BertLayer(config).eval()
    reference = nn.TransformerEncoderLayer(16, 4, 40, dropout=0.0, activation="gelu", layer_norm_eps=1e-12,
                                           batch_first=True).eval()
    with torch.no_grad():
        reference.self_attn.in_proj_weight.copy_(ours.qkv.weight)
        reference.self_attn.in_proj_bias.copy_(ours.qkv.bias)
        reference.self_attn.out_proj.weight.copy_(ours.attention_out.weight)
        reference.self_attn.out_proj.bias.copy_(ours.attention_out.bias)
        reference.linear1.load_state_dict(ours.intermediate.state_dict())
        reference.linear2.load_state_dict(ours.output.state_dict())
        reference.norm1.load_state_dict(ours.attention_norm.state_dict())
        reference.norm2.load_state_dict(ours.output_norm.state_dict())
    x = torch.randn(3, 9, 16)
    real = torch.arange(9) < torch.tensor([9, 4, 6])[:, None]
    expected = reference(x, src_key_padding_mask=~real)
    actual = ours(x, real[:, None, None, :])
    assert torch.allclose(actual[real], expected[real], atol=1e-5)


def test_padding_does_not_change_real_positions() -> None:
    model = BertModel(TINY).eval()
    short = batch(lengths=(5,))
    padded = {k: torch.cat([v, torch.zeros(1, 6, dtype=v.dtype)], dim=1) for k, v in short.items()}
    with torch.no_grad():
        a = model(**short)["mlm_logits"]
        b = model(**padded)["mlm_logits"]
    assert b.shape == (1, 11, 50) and torch.allclose(a, b[:, :5], atol=1e-5)


def test_lm_head_runs_only_on_masked_positions_and_matches_full_scores() -> None:
    model = BertModel(TINY).eval()
    inputs = batch()
    masked = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
    masked[0, 3] = masked[2, 0] = masked[2, 11] = masked[3, 1] = True
    seen: list[torch.Size] = []
    model.lm_head.transform.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    with torch.no_grad():
        gathered = model(**inputs, masked_tokens=masked)["mlm_logits"]
        full = model(**inputs)["mlm_logits"]
    assert seen == [torch.Size([4, 16]), torch.Size([4, 12, 16])]
    assert gathered.shape == (4, 50) and torch.allclose(gathered, full[masked], atol=1e-6)


def test_output_embeddings_are_tied_and_init_follows_bert() -> None:
    model = BertModel(BertConfig(vocab_size=3000, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=128))
    assert model.lm_head.weight is model.embeddings.word.weight
    assert model.embeddings.word.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers[0].qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert (model.layers[0].qkv.bias == 0).all() and (model.lm_head.bias == 0).all()
    assert (model.embeddings.norm.weight == 1).all()


@pytest.mark.parametrize("nsp", [False, True])
def test_every_parameter_gets_a_gradient(nsp: bool) -> None:
    model = BertModel(TINY, nsp=nsp)
    inputs = batch()
    out = model(**inputs, masked_tokens=inputs["attention_mask"])
    loss = out["mlm_logits"].sum() + (out["nsp_logits"].sum() if nsp else 0)
    loss.backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []
    assert hasattr(model, "nsp_head") == nsp


# -- building from options ----------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A preprocessed directory and the size of its vocabulary."""
    data_dir, vocab, _ = make_data_dir(tmp_path_factory.mktemp("model"), n_docs=20)
    return data_dir, len(vocab.read_text().splitlines())


@pytest.fixture(scope="module")
def data_dir(data: tuple[Path, int]) -> Path:
    return data[0]


def build(data_dir: Path, *flags: str) -> tuple[BertModel, SimpleNamespace]:
    args = parse_train_args(["--task", "bert", "--data", str(data_dir), "--max-sentences", "4", *flags])
    task = TASK_REGISTRY.get("bert").setup_task(args)
    return task.build_model(args), args


@pytest.mark.parametrize("arch, layers, hidden, heads", [
    ("bert_tiny", 2, 128, 2), ("bert_mini", 4, 256, 4), ("bert_small", 4, 512, 8),
])
def test_archs_set_the_model_size(data: tuple[Path, int], arch: str, layers: int, hidden: int, heads: int) -> None:
    model, _ = build(data[0], "--arch", arch)
    assert len(model.layers) == layers and model.embeddings.word.weight.shape == (data[1], hidden)
    assert model.layers[0].num_heads == heads and model.layers[0].intermediate.out_features == 4 * hidden


def test_flags_override_the_arch(data_dir: Path) -> None:
    model, _ = build(data_dir, "--arch", "bert_tiny", "--num-hidden-layers", "1", "--hidden-act", "relu")
    assert len(model.layers) == 1 and model.config.hidden_act == "relu"


def test_config_file_overrides_arch_and_is_written_back(data: tuple[Path, int], tmp_path: Path) -> None:
    config = write_bert_config(tmp_path / "bert_config.json", vocab_size=data[1], architectures=["BertForMaskedLM"])
    model, args = build(data[0], "--arch", "bert_large", "--config_file", str(config))
    assert len(model.layers) == 2 and model.config.hidden_size == 32 and model.config.intermediate_size == 64
    assert args.hidden_size == 32 and args.num_hidden_layers == 2


def test_config_file_without_vocab_size_takes_the_task_vocabulary(data: tuple[Path, int], tmp_path: Path) -> None:
    model, _ = build(data[0], "--config_file", str(write_bert_config(tmp_path / "c.json")))
    assert model.config.vocab_size == data[1]


@pytest.mark.parametrize("content, message", [
    (json.dumps({"vocab_size": 30522}), r"vocab_size 30522 but the vocabulary of --data has \d+ tokens"),
    (json.dumps({"hidden_size": "big"}), "hidden_size must be int"),
    ("{not json", "not valid JSON"),
    (json.dumps({"hidden_size": 30, "num_attention_heads": 4}), "not a multiple"),
    (json.dumps({"max_position_embeddings": 64}), "do not fit max_position_embeddings 64"),
])
def test_bad_config_file_is_a_config_error(data_dir: Path, tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        build(data_dir, "--config_file", str(path))
