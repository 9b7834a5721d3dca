"""One value per local process: ``--max-sentences 48,16``, ``--precision fp32,bf16`` and their errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from helpers import TOY_PLUGIN
from hetfair.launch.per_process import check_counts, for_process, parse_per_process
from hetfair.errors import ConfigError
from hetfair.options import parse_train_args
from hetfair_cli.train import main as train_main


def toy(*argv: str) -> argparse.Namespace:
    return parse_train_args(["--user-dir", str(TOY_PLUGIN), "--task", "toy", *argv])


def run_main(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> tuple[int, str]:
    code = train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(tmp_path / "ckpt"),
                       "--log-format", "none", "--max-update", "1", *argv])
    return code, capsys.readouterr().err


def test_one_value_stays_a_value_and_a_list_becomes_a_tuple() -> None:
    assert parse_per_process("48", int, "max_sentences") == 48
    assert parse_per_process("48, 16", int, "max_sentences") == (48, 16)


def test_each_process_gets_its_own_values_and_shares_single_ones() -> None:
    args = argparse.Namespace(max_sentences=(48, 16), max_tokens=None, precision=("bf16", "fp16"), lr=0.1)
    first, second = for_process(args, 0), for_process(args, 1)
    assert (first.max_sentences, first.precision, second.max_sentences, second.precision) == (48, "bf16", 16, "fp16")
    assert first.lr == second.lr == 0.1 and first.max_tokens is None
    assert args.max_sentences == (48, 16)  # the command's own options are left alone


def test_lists_must_have_one_value_per_process() -> None:
    args = argparse.Namespace(max_sentences=(48, 16, 8), max_tokens=None, precision="fp32")
    check_counts(args, 3)
    with pytest.raises(ConfigError, match=r"--max-sentences 48,16,8 gives 3 values but this command starts "
                                          r"2 processes; give one value for all of them or one per process"):
        check_counts(args, 2)
    budgets = argparse.Namespace(memory_budget=(1 << 30, 3 << 29))  # sizes, parsed to bytes, are shown as sizes
    with pytest.raises(ConfigError, match=r"^--memory-budget 1.0G,1.5G gives 2 values but this command starts 3 "):
        check_counts(budgets, 3)


def test_options_parse_into_values_or_lists() -> None:
    args = toy("--max-sentences", "2,6,24", "--max-tokens", "64", "--precision", "fp32,bf16,fp16")
    assert args.max_sentences == (2, 6, 24) and args.max_tokens == 64
    assert args.precision == ("fp32", "bf16", "fp16")


@pytest.mark.parametrize("argv,precision", [((), "fp32"), (("--fp16",), "fp16"), (("--bf16",), "bf16"),
                                            (("--precision", "bf16"), "bf16")])
def test_fp16_and_bf16_are_shorthands_for_every_process(argv: tuple[str, ...], precision: str) -> None:
    assert toy(*argv).precision == precision


@pytest.mark.parametrize("argv,message", [
    (("--max-sentences", "4,x"), "--max-sentences 4,x: 'x' is not a whole number"),
    (("--max-sentences", "4,0"), "--max-sentences must be at least 1, got 0"),
    (("--precision", "fp32,fp8"), "--precision fp32,fp8: 'fp8' is not a precision; choose from fp32, bf16, fp16"),
    (("--fp16", "--bf16"), "--fp16 and --bf16 both choose the precision; give only one of them"),
    (("--precision", "fp32", "--fp16"), "--precision and --fp16 both choose the precision"),
    (("--fp16-scale-window", "0"), "--fp16-scale-window must be at least 1, got 0"),
    (("--fp16-init-scale", "0"), "--fp16-init-scale must be positive, got 0.0"),
    (("--min-loss-scale", "-1"), "--min-loss-scale must not be negative, got -1.0"),
])
def test_bad_values_are_one_line_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        toy(*argv)


def test_a_list_of_the_wrong_length_stops_the_command_before_any_process_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, tmp_path, "--distributed-world-size", "2", "--precision", "fp32,bf16,fp16")
    assert code == 2
    assert err.strip() == ("hetfair-train: error: --precision fp32,bf16,fp16 gives 3 values but this command "
                           "starts 2 processes; give one value for all of them or one per process")
    assert not (tmp_path / "ckpt").exists()


def test_a_single_process_command_takes_no_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, tmp_path, "--max-sentences", "8,8")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--max-sentences 8,8 gives 2 values but this command starts 1 process;" in err


def test_list_errors_from_the_command_line_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, tmp_path, "--max-sentences", "8,eight")
    assert code == 2 and err.count("\n") == 1 and err.startswith("hetfair-train: error: --max-sentences 8,eight")
