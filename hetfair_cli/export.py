"""``hetfair-export``: write a trained checkpoint as a Hugging Face ``transformers`` model directory.

Each model family writes its own directory: its spec's ``hf_exporter`` (:class:`~hetfair.families.FamilySpec`);
a model registered outside a family, its own :meth:`~hetfair.models.HetfairModel.export_hf`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from hetfair.errors import ConfigError
from hetfair.families import FAMILY_REGISTRY
from hetfair.models import HetfairModel
from hetfair.pretrained import load_model
from hetfair.utils import check_output_dir
from hetfair_cli.errors import run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetfair-export",
        description="Write a hetfair checkpoint as a Hugging Face directory (config.json, model.safetensors and "
                    "the tokenizer) that transformers loads: a BERT as BertForPreTraining / BertForMaskedLM with "
                    "AutoTokenizer.from_pretrained; each model family says what it writes.",
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
    print(_hf_exporter(args.path, loaded.options.model, loaded.model)(loaded.model, outdir, loaded.task),
          file=sys.stderr)
    return 0


def _hf_exporter(path: str, name: str, model: object) -> Callable[..., str]:
    """``exporter(model, outdir, task)`` of model ``name``: its family's, else the model's own ``export_hf``."""
    family = FAMILY_REGISTRY.family_of("models", name)
    if family is not None:
        if family.spec.hf_exporter is None:
            raise ConfigError(f"{path} holds a '{name}' model, which does not export to Hugging Face (its family "
                              f"'{family.name}' names no hf_exporter)")
        return family.hf_exporter()
    if not isinstance(model, HetfairModel) or type(model).export_hf is HetfairModel.export_hf:
        raise ConfigError(f"{path} holds a '{name}' model, which does not export to Hugging Face (it belongs to no "
                          f"model family and defines no export_hf)")
    return type(model).export_hf


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
