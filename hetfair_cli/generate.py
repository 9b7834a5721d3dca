"""``hetfair-generate``: continue a prompt with a trained ``transformer_lm`` checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from hetfair.errors import ConfigError
from hetfair.lm.generate import generate
from hetfair.utils import DefaultsHelpFormatter, absolute_path
from hetfair_cli.errors import run_cli

DESCRIPTION = """Continue --prompt by --max-new-tokens tokens with a transformer_lm checkpoint and print
the prompt with its continuation on standard output. Greedy by default; --top-k K samples among
the K most likely tokens (reproducibly: --seed). The tokenizer is the one of the checkpoint's
data directory (or --data); every prompt starts after an end-of-text token, as documents do in
training. Prompt and new tokens must fit the model's positions (--tokens-per-sample in training)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetfair-generate", description=DESCRIPTION, allow_abbrev=False,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--path", required=True, metavar="CKPT", help="checkpoint written by hetfair-train")
    parser.add_argument("--prompt", default="", metavar="TEXT", help="text to continue")
    parser.add_argument("--max-new-tokens", required=True, type=int, metavar="N", help="tokens to generate")
    parser.add_argument("--top-k", type=int, metavar="K",
                        help="sample among the K most likely tokens (default: greedy)")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T", help="sampling temperature")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="seed of the sampling")
    parser.add_argument("--data", metavar="DIR", type=absolute_path,
                        help="data directory holding the tokenizer (default: the one used in training)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even where CUDA is available")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser


def check_prompt(prompt: str) -> None:
    """Refuse a prompt that is not UTF-8: Python keeps each undecodable byte of the command line as a lone
    surrogate (U+DC80-U+DCFF), which no tokenizer can encode."""
    at = next((index for index, char in enumerate(prompt) if "\ud800" <= char <= "\udfff"), None)
    if at is None:
        return
    char = prompt[at]
    what = f"byte 0x{ord(char) - 0xDC00:02x}" if "\udc80" <= char <= "\udcff" else f"character U+{ord(char):04X}"
    raise ConfigError(f"--prompt is not UTF-8 text ({what} at character {at}); give the prompt as UTF-8 text")


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_prompt(args.prompt)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # e.g. the task's data notes
    result = generate(args.path, args.prompt, args.max_new_tokens, top_k=args.top_k, temperature=args.temperature,
                      seed=args.seed, device="cpu" if args.cpu else None, data=args.data)
    print(result.text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hetfair-generate", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
