"""Sample text from a ``transformer_lm``: :func:`generate` (``hetfair-generate`` on the command line).

Greedy decoding takes the most likely next token; top-k sampling draws the next token
among the ``k`` most likely ones, from their probabilities at ``temperature``, with a
generator seeded by ``seed``, so the same call gives the same text. Each step runs the
model over the whole sequence so far (no key/value cache): the models of this family are
small, and the code stays the model's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hetfair.errors import ConfigError
from hetfair.lm.model import TransformerLM
from hetfair.pretrained import load_model

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass
class Generation:
    """A prompt and the tokens generated after it."""

    prompt_tokens: list[int]
    """The prompt's token ids (without the start token)."""
    new_tokens: list[int]
    """Exactly the number of tokens asked for."""
    text: str
    """The prompt followed by the generated text."""


def generate(source: str | Path | TransformerLM, prompt: str, max_new_tokens: int, *,
             tokenizer: "Tokenizer | None" = None, top_k: int | None = None, temperature: float = 1.0, seed: int = 1,
             start_token: int | None = None, device: str | torch.device | None = None,
             data: str | Path | None = None) -> Generation:
    """Continue ``prompt`` by ``max_new_tokens`` tokens, greedily or (with ``top_k``) by top-k sampling.

    Args:
        source: a ``hetfair-train`` checkpoint of a ``transformer_lm`` (its task gives the tokenizer and
            the start token: the end-of-text token that precedes every document), or a model.
        prompt: the text to continue; may be empty when there is a start token.
        max_new_tokens: how many tokens to add; prompt and new tokens must fit the model's positions.
        tokenizer: a ``tokenizers.Tokenizer`` (needed with a model; default: the checkpoint task's).
        top_k: sample among the ``top_k`` most likely tokens; ``None`` decodes greedily.
        temperature: divides the scores before sampling (below 1: more conservative).
        seed: seeds the sampling generator.
        start_token: a token id put before the prompt (default: the checkpoint task's ``eos_index``).
        device: where a checkpoint's model runs (default: CUDA when available).
        data: the checkpoint's data directory (its tokenizer), if it moved since training.
    """
    if isinstance(source, (str, Path)):
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        loaded = load_model(source, device=device, overrides={"data": str(data) if data else None})
        if not isinstance(loaded.model, TransformerLM):
            raise ConfigError(f"{source} holds a '{loaded.options.model}' model; generation needs a transformer_lm")
        model = loaded.model
        tokenizer = tokenizer or loaded.task.tokenizer  # type: ignore[attr-defined]
        start_token = loaded.task.eos_index if start_token is None else start_token  # type: ignore[attr-defined]
    else:
        model = source
    if tokenizer is None:
        raise ConfigError("generate() needs a tokenizer with a model; pass tokenizer=, or a checkpoint path")
    _check_sampling(max_new_tokens, top_k, temperature)
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=False).ids
    context = ([] if start_token is None else [start_token]) + prompt_tokens
    if not context:
        raise ConfigError("the prompt is empty and there is no start token; give a prompt or a start_token")
    room = model.max_positions - len(context)
    if max_new_tokens > room:
        raise ConfigError(f"the prompt ({len(context)} tokens with the start token) and {max_new_tokens} new tokens "
                          f"exceed the model's {model.max_positions} positions; ask for at most {max(room, 0)} "
                          f"new tokens or shorten the prompt")
    new_tokens = _continue(model, context, max_new_tokens, top_k, temperature, seed)
    return Generation(prompt_tokens, new_tokens, tokenizer.decode(prompt_tokens + new_tokens,
                                                                  skip_special_tokens=False))


def _check_sampling(max_new_tokens: int, top_k: int | None, temperature: float) -> None:
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must not be negative, got {max_new_tokens}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {top_k}")
    if not temperature > 0:
        raise ConfigError(f"--temperature must be above 0, got {temperature}")


def _continue(model: TransformerLM, context: list[int], count: int, top_k: int | None, temperature: float,
              seed: int) -> list[int]:
    """``count`` next tokens after ``context``, in eval mode (the model's mode is restored after)."""
    device = model.embed_tokens.weight.device
    tokens = torch.tensor([context], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for _ in range(count):
                scores = model(tokens)[0, -1].float()
                tokens = torch.cat((tokens, _pick(scores, top_k, temperature, generator).view(1, 1)), dim=1)
    finally:
        model.train(was_training)
    return tokens[0, len(context):].tolist()


def _pick(scores: torch.Tensor, top_k: int | None, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """The next token: the best one, or one drawn among the ``top_k`` best."""
    if top_k is None:
        return scores.argmax()
    best, indices = scores.topk(min(top_k, scores.numel()))
    choice = torch.multinomial(torch.softmax(best / temperature, dim=-1), 1, generator=generator)
    return indices[choice]
