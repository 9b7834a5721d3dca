"""``hetfair-export``: write a trained BERT checkpoint as a Hugging Face ``transformers`` model directory."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

from hetfair.bert.hf import write_hf_directory
from hetfair.bert.hf_tokenizer import hf_tokenizer_files
from hetfair.bert.model import BertModel
from hetfair.errors import ConfigError
from hetfair.pretrained import load_model
from hetfair.utils import check_output_dir
from hetfair_cli.errors import run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetfair-export",
        description="Write a hetfair BERT checkpoint as a Hugging Face directory (config.json, model.safetensors and "
                    "the tokenizer: vocab.txt for WordPiece, tokenizer.json for sentencepiece) that transformers' "
                    "BertForPreTraining / BertForMaskedLM and AutoTokenizer.from_pretrained load.",
        allow_abbrev=False)
    parser.add_argument("--path", required=True, metavar="CKPT", help="checkpoint written by hetfair-train")
    parser.add_argument("--to", required=True, nargs=2, metavar=("FORMAT", "OUTDIR"),
                        help="target format (hf) and output directory")
    parser.add_argument("--data", metavar="DIR", help="data directory holding the vocabulary (default: training's)")
    parser.add_argument("--user-dir", metavar="DIR", help="plugin directory, if the task comes from one")
    parser.add_argument("--force", action="store_true", help="write into OUTDIR even if it is not empty")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    target, outdir = args.to
    if target != "hf":
        raise ConfigError(f"--to {target}: the only export format is 'hf' (Hugging Face transformers)")
    _check_outdir(outdir, args.force)
    loaded = load_model(args.path, user_dir=args.user_dir, overrides={"data": args.data})
    model = loaded.model
    if not isinstance(model, BertModel):
        raise ConfigError(f"{args.path} holds a '{loaded.options.model}' model; only BERT exports to Hugging Face")
    vocab, spec = loaded.task.vocab, loaded.task.tokenizer_spec  # type: ignore[attr-defined]
    tokenizer_files = hf_tokenizer_files(spec, vocab, model.config.max_position_embeddings)  # may refuse: write after
    write_hf_directory(outdir, model.config, model.state_dict(), model.nsp, vocab.pad, tokenizer_files)
    print(success_message(outdir, model.nsp), file=sys.stderr)
    return 0


def success_message(outdir: str, nsp: bool) -> str:
    """Where the export went, a shell command that loads it with ``transformers``, and which class fits."""
    model_class = "BertForPreTraining" if nsp else "BertForMaskedLM"
    path = json.dumps(outdir)  # a Python string literal in double quotes, whatever the path holds
    code = (f"from transformers import AutoTokenizer, {model_class}; model = {model_class}.from_pretrained({path}); "
            f"tokenizer = AutoTokenizer.from_pretrained({path})")
    note = ("note: BertForMaskedLM loads it too, without the next-sentence head" if nsp else
            "note: trained without --nsp, so it is a BertForMaskedLM: BertForPreTraining would start its "
            "next-sentence head from random weights")
    return f"wrote {outdir}; load it in Python with:\npython -c {shlex.quote(code)}\n{note}"


def _check_outdir(outdir: str, force: bool) -> None:
    """Refuse, before loading anything, an OUTDIR that is a file, cannot be created, or holds files (unless ``force``)."""
    check_output_dir("--to hf", outdir)
    path = Path(outdir).expanduser()
    if path.is_dir() and any(path.iterdir()) and not force:
        raise ConfigError(f"--to hf {outdir}: the directory is not empty; choose another OUTDIR, or pass --force "
                          f"to write over its files")


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hetfair-export", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
