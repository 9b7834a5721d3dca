"""Generation: greedy is the argmax chain, top-k is reproducible and stays in the top k, lengths are exact.

The references are computed here from the model's own forward over the growing sequence.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from hetfair.errors import ConfigError
from hetfair.lm.config import LMConfig
from hetfair.lm.generate import generate
from hetfair.lm.model import TransformerLM
from hetfair_cli.generate import main as generate_main
from lm_model_helpers import make_lm_data, train_tiny_lm

PROMPT = "The hacker wrote"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):
    return make_lm_data(tmp_path_factory.mktemp("lm_generate"))


@pytest.fixture(scope="module")
def tokenizer(data) -> Tokenizer:
    return Tokenizer.from_file(str(data / "tokenizer.json"))


@pytest.fixture(scope="module", params=["learned", "rotary"])
def model(request, tokenizer) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(vocab_size=tokenizer.get_vocab_size(), max_positions=32, embed_dim=32, layers=2,
                                   attention_heads=4, ffn_embed_dim=64, positions=request.param, dropout=0.1,
                                   attention_dropout=0.1))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)  # scores far from uniform: argmax and top-k are well defined
    return model


def scores_along(model: TransformerLM, context: list[int], new_tokens: list[int]) -> torch.Tensor:
    """The next-token scores before each new token, from one forward of the whole sequence."""
    with torch.no_grad():
        logits = model.eval()(torch.tensor([context + new_tokens]))[0]
    return logits[len(context) - 1:-1]


def test_greedy_is_the_argmax_chain_and_has_the_requested_length(model, tokenizer):
    model.train()
    result = generate(model, PROMPT, 10, tokenizer=tokenizer, start_token=1)
    assert model.training  # the caller's mode is restored
    context = [1] + tokenizer.encode(PROMPT, add_special_tokens=False).ids
    expected: list[int] = []
    with torch.no_grad():
        for _ in range(10):
            expected.append(int(model.eval()(torch.tensor([context + expected]))[0, -1].argmax()))
    assert result.new_tokens == expected and len(result.new_tokens) == 10
    assert result.prompt_tokens == context[1:]
    assert result.text == tokenizer.decode(context[1:] + expected, skip_special_tokens=False)
    assert result.text.startswith(PROMPT)


def test_top_k_sampling_is_reproducible_and_stays_in_the_top_k(model, tokenizer):
    first = generate(model, PROMPT, 12, tokenizer=tokenizer, top_k=5, seed=7)
    again = generate(model, PROMPT, 12, tokenizer=tokenizer, top_k=5, seed=7)
    other = generate(model, PROMPT, 12, tokenizer=tokenizer, top_k=5, seed=8)
    assert first == again and len(first.new_tokens) == 12
    assert other.new_tokens != first.new_tokens
    scores = scores_along(model, first.prompt_tokens, first.new_tokens)
    for step, token in enumerate(first.new_tokens):
        assert token in scores[step].topk(5).indices.tolist(), step
    greedy = generate(model, PROMPT, 12, tokenizer=tokenizer)
    assert first.new_tokens != greedy.new_tokens  # it really samples
    assert generate(model, PROMPT, 12, tokenizer=tokenizer, top_k=1, seed=3) == greedy


def test_a_request_beyond_the_model_positions_is_refused(model, tokenizer):
    prompt_length = len(tokenizer.encode(PROMPT, add_special_tokens=False).ids) + 1
    fits = 32 - prompt_length
    assert len(generate(model, PROMPT, fits, tokenizer=tokenizer, start_token=1).new_tokens) == fits
    with pytest.raises(ConfigError, match=f"exceed the model's 32 positions; ask for at most {fits} new tokens"):
        generate(model, PROMPT, fits + 1, tokenizer=tokenizer, start_token=1)


def test_hetfair_generate_prints_the_continuation_of_a_trained_checkpoint(tmp_path, data, capsys):
    checkpoint = train_tiny_lm(data, tmp_path / "ckpt")
    expected = generate(checkpoint, "The", 8, top_k=4, seed=2)
    assert len(expected.new_tokens) == 8
    capsys.readouterr()
    assert generate_main(["--path", str(checkpoint), "--prompt", "The", "--max-new-tokens", "8", "--top-k", "4",
                          "--seed", "2"]) == 0
    assert capsys.readouterr().out == expected.text + "\n"
    assert generate_main(["--path", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hetfair-generate: error: the prompt") and "16 positions" in err[0]


def test_an_empty_prompt_starts_after_the_start_token_and_needs_one(model, tokenizer):
    result = generate(model, "", 5, tokenizer=tokenizer, start_token=1)
    assert result.prompt_tokens == [] and len(result.new_tokens) == 5
    assert result.new_tokens == generate(model, "", 5, tokenizer=tokenizer, start_token=1).new_tokens
    with pytest.raises(ConfigError, match="the prompt is empty and there is no start token"):
        generate(model, "", 5, tokenizer=tokenizer)


@pytest.mark.parametrize("prompt, problem", [("The \udcff hacker", "byte 0xff at character 4"),
                                             ("\ud800", "character U+D800 at character 0")])
def test_a_prompt_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path, capsys, prompt, problem):
    # Python keeps the byte 0xff of a command line (not UTF-8) as the lone surrogate U+DCFF: what main receives.
    code = generate_main(["--path", str(tmp_path / "checkpoint_last.pt"), "--prompt", prompt, "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err == f"hetfair-generate: error: --prompt is not UTF-8 text ({problem}); give the prompt " \
                                "as UTF-8 text\n", err
