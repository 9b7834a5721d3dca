"""Hugging Face interop of transformer_lm: hetfair-export -> transformers, and transformers -> --init-from-hf.

The reference is ``transformers`` itself: its GPT2LMHeadModel and GPTNeoXForCausalLM, loaded from the
export or built and saved here, must give the logits of hetfair's model on the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hetfair  # noqa: E402
from hetfair.options import parse_train_args  # noqa: E402
from hetfair.tasks import TASK_REGISTRY  # noqa: E402
from hetfair_cli.export import main as export_main  # noqa: E402
from hetfair_cli.train import main as train_main  # noqa: E402
from lm_model_helpers import TOKENS_PER_SAMPLE, lm_train_args, make_lm_data, train_tiny_lm  # noqa: E402

CLASSES = {"learned": "GPT2LMHeadModel", "rotary": "GPTNeoXForCausalLM"}
TOLERANCE = 1e-4  # the bound; float32 sums of the same terms in another order differ by ~1e-6


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lm_data(tmp_path_factory.mktemp("lm_hf"))


def tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (3, TOKENS_PER_SAMPLE), generator=torch.Generator().manual_seed(0))


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert (actual - expected).abs().amax() <= TOLERANCE


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_export_loads_in_transformers_with_the_same_logits_and_reads_back(tmp_path, data, capsys, positions):
    checkpoint = train_tiny_lm(data, tmp_path / "ckpt", "--positions", positions)
    out = tmp_path / "hf"
    capsys.readouterr()
    assert export_main(["--path", str(checkpoint), "--to", "hf", str(out)]) == 0
    message = capsys.readouterr().err.strip().splitlines()
    assert message[0] == f"wrote {out}; load it in Python with:" and CLASSES[positions] in message[1], message

    loaded = hetfair.load_model(checkpoint)
    ours, task = loaded.model, loaded.task
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(theirs).__name__ == CLASSES[positions]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    batch = tokens(task.vocab_size)
    with torch.no_grad():
        expected = theirs.eval()(batch).logits
        assert_same_logits(ours(batch), expected)

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "Alice wrote code for the kernel."
    assert tokenizer(text)["input_ids"] == task.tokenizer.encode(text).ids
    assert tokenizer.eos_token_id == task.eos_index and tokenizer.pad_token_id == task.pad_index

    args = parse_train_args(lm_train_args(data, tmp_path / "again", "--init-from-hf", str(out)))
    back = TASK_REGISTRY.get(args.task).setup_task(args).build_model(args).eval()
    assert args.positions == positions and args.decoder_embed_dim == 32 and args.decoder_layers == 2
    with torch.no_grad():
        assert_same_logits(back(batch), expected)


def hf_reference(positions: str, vocab_size: int) -> "transformers.PreTrainedModel":
    """A randomly initialised transformers model of hetfair's architecture (as a user would have one)."""
    shape = {"vocab_size": vocab_size, "tie_word_embeddings": True}
    if positions == "learned":
        config = transformers.GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=4, **shape)
    else:
        config = transformers.GPTNeoXConfig(max_position_embeddings=32, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=64, use_parallel_residual=False,
                                            rotary_pct=1.0, **shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))  # biases and norms away from their 0 / 1 start
    return model


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_init_from_hf_gives_the_transformers_logits(tmp_path, data, capsys, positions):
    args = parse_train_args(lm_train_args(data, tmp_path / "ckpt", "--init-from-hf", str(tmp_path / "hf")))
    task = TASK_REGISTRY.get(args.task).setup_task(args)
    reference = hf_reference(positions, task.vocab_size)
    reference.save_pretrained(tmp_path / "hf")
    ours = task.build_model(args).eval()
    assert args.positions == positions and args.decoder_ffn_embed_dim == (128 if positions == "learned" else 64)
    assert args.max_target_positions == 32  # the directory's, not --tokens-per-sample
    batch = tokens(task.vocab_size)
    with torch.no_grad():
        assert_same_logits(ours(batch), reference(batch).logits)


def write_directory(directory: Path, data: Path, case: str) -> None:
    """A transformers directory that --init-from-hf must refuse, for the reason ``case`` names."""
    vocab_size = len(json.loads((data / "tokenizer.json").read_text())["model"]["vocab"])
    directory.mkdir()
    configs = {
        "bert": transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, intermediate_size=64),
        "llama": transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=4, intermediate_size=64),
        "parallel_residual": transformers.GPTNeoXConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1,
                                                        num_attention_heads=4, intermediate_size=64,
                                                        use_parallel_residual=True, rotary_pct=1.0,
                                                        tie_word_embeddings=True),
        "untied": transformers.GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=1, n_head=4,
                                          tie_word_embeddings=False),
    }
    if case in configs:
        configs[case].save_pretrained(directory)
    elif case == "other_tokenizer":
        transformers.GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=1, n_head=4).save_pretrained(directory)
        other = json.loads((data / "tokenizer.json").read_text())
        other["model"]["vocab"] = {f"x{token}": index for token, index in other["model"]["vocab"].items()}
        other["model"]["merges"] = []
        (directory / "tokenizer.json").write_text(json.dumps(other))


@pytest.mark.parametrize("case, message", [
    ("no_config", "is not a Hugging Face model directory (no config.json)"),
    ("bert", "holds a 'bert' model; --init-from-hf reads GPT-2"),
    ("llama", "holds a 'llama' model; --init-from-hf reads GPT-2"),
    ("parallel_residual", "sets use_parallel_residual=True"),
    ("untied", "untied from the token embeddings"),
    ("other_tokenizer", "its tokenizer.json has another vocabulary than --data's"),
])
def test_directories_of_another_architecture_are_one_line(tmp_path, data, capsys, case, message):
    directory = tmp_path / "hf"
    write_directory(directory, data, case)
    capsys.readouterr()
    code = train_main(lm_train_args(data, tmp_path / "ckpt", "--init-from-hf", str(directory)))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
