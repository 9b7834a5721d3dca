"""Bad input to hetfair-train (and hetfair-export's output path): exit code 2, one line on stderr, no traceback,
nothing written.

Every case is refused at start-up, before any model is built or any process is started.
A batch size beyond the training set is no mistake to refuse: it is cut to the set's size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TOY_PLUGIN
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.options import add_comm_hook_args, build_parser, flag_owners
from hetfair_cli.export import main as export_main
from hetfair_cli.train import main as train_main


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root`` with its modification time and content."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def toy(save_dir: Path, *extra: str) -> list[str]:
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(save_dir), "--max-epoch", "1",
            "--log-format", "none", *extra]


# (flags, fragment of the message); "FILE" stands for an existing regular file
CASES = [
    (["--save-dir", "FILE"], "--save-dir FILE is not a directory"),
    (["--save-dir", "FILE/sub"], "cannot be created: FILE is not a directory"),
    (["--tensorboard-logdir", "FILE"], "--tensorboard-logdir FILE is not a directory"),
    (["--restore-file", "missing.pt"], "missing.pt does not exist"),
    (["--validate-interval", "0"], "--validate-interval must be at least 1, got 0"),
    (["--save-interval", "0"], "--save-interval must be at least 1, got 0"),
    (["--log-interval", "0"], "--log-interval must be at least 1, got 0"),
    (["--lr", "-1"], "--lr must be a finite number of at least 0, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number of at least 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number of at least 0, got inf"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number"),
    (["--clip-norm", "nan"], "--clip-norm must be a finite number"),
    (["--seed", "-1"], "--seed must be at least 0, got -1"),
    (["--seed", str(2**64)], "--seed must be at most"),
    (["--num-workers", "-1"], "--num-workers must be at least 0, got -1"),
    (["--max-epoch", "0"], "training would never end"),
    (["--max-epoch", "-2"], "--max-epoch must be at least 0, got -2"),
    (["--max-sentences-valid", "0"], "--max-sentences-valid must be at least 1, got 0"),
    (["--keep-last-epochs", "-5"], "--keep-last-epochs must be at least -1, got -5"),
    (["--distributed-timeout", "0"], "--distributed-timeout must be a positive number"),
    (["--distributed-timeout", "nan"], "--distributed-timeout must be a positive number"),
    (["--distributed-port", "70000"], "--distributed-port must be at most 65535"),
    (["--zero-sharding", "os"], "--zero-sharding os needs more than one process"),
    (["--zero-sharding", "os", "--zero-shard-weights", "1,x"], "--zero-shard-weights must be numbers"),
    (["--zero-sharding", "os", "--zero-shard-weights", "1,-1"], "must all be positive"),
    (["--zero-sharding", "os", "--distributed-world-size", "2", "--zero-shard-weights", "1,2,3"],
     "--zero-shard-weights has 3 weights but there are 2 ranks"),
    (["--memory-budget", "99999999999999999999T"],
     "--memory-budget must be at most 64.0T, got 100000000000000000000.0T"),
    (["--memory-budget", "65T"], "--memory-budget must be at most 64.0T, got 65.0T"),
    (["--powersgd-rank", "2"], "--powersgd-rank needs --ddp-comm-hook powersgd or auto (this command has "
                               "--ddp-comm-hook none)"),
    (["--ddp-comm-hook", "powersgd", "--powersgd-rank", "foo"],
     "--powersgd-rank must be a whole number of at least 1 or auto, got foo"),
    (["--ddp-comm-hook", "auto", "--powersgd-rank", "0"],
     "--powersgd-rank must be a whole number of at least 1 or auto, got 0"),
    (["--ddp-comm-hook", "bf16", "--powersgd-start-update", "5"],
     "--powersgd-start-update needs --ddp-comm-hook powersgd or auto (this command has --ddp-comm-hook bf16)"),
    (["--live-timeout", "5"], "--live-timeout needs --fault-tolerance live (this command has --fault-tolerance none)"),
    (["--live-timeout=5"], "--live-timeout needs --fault-tolerance live"),
    (["--balance-interval", "4"], "--balance-interval needs --auto-balance"),
    (["--outer-lr", "0.5"], "--outer-lr needs --ddp-backend diloco (this command has --ddp-backend c10d)"),
    (["--offload", "0"], "--offload needs --ddp-backend fully_sharded (this command has --ddp-backend c10d)"),
    (["--ddp-backend", "fully_sharded", "--distributed-world-size", "2", "--bucket-cap-mb", "50"],
     "--bucket-cap-mb needs --ddp-backend c10d, diloco or localsgd (this command has --ddp-backend fully_sharded)"),
    (["--ddp-backend", "auto", "--find-unused-parameters"], "--ddp-backend auto may choose fully_sharded: "
                                                            "--find-unused-parameters needs --ddp-backend c10d"),
    (["--criterion", "masked_lm"], "criterion masked_lm does not fit task toy (model toy_mlp): TypeError: "),
]


@pytest.mark.parametrize("flags, message", CASES, ids=[" ".join(flags) for flags, _ in CASES])
def test_bad_option_is_one_line_exit_2_and_changes_nothing(tmp_path, capsys, flags, message):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / "checkpoint_last.pt").write_bytes(b"an earlier run's checkpoint")
    afile = tmp_path / "FILE"
    afile.write_text("not a directory")
    flags = [flag.replace("FILE", str(afile)) for flag in flags]
    before = snapshot(tmp_path)
    code = train_main(toy(save_dir, *flags))
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("hetfair-train: error: ")
    assert message.replace("FILE", str(afile)) in err
    assert snapshot(tmp_path) == before


def test_a_batch_size_beyond_the_training_set_is_cut_to_it_with_one_line(tmp_path, capfd):
    save_dir = tmp_path / "ckpt"
    assert train_main(toy(save_dir, "--toy-train-size", "50", "--max-sentences", "1000000000", "--max-epoch", "2",
                          "--log-format", "simple", "--disable-validation")) == 0
    output = capfd.readouterr()
    assert ("batch | a micro-batch holds at most the 50 training samples: per-rank batch sizes [1000000000] are cut "
            "to [50]") in output.out + output.err
    state = load_checkpoint(save_dir / "checkpoint_last.pt")
    assert state["batch"]["global_batch_size"] == 50 and state["trainer"]["num_updates"] == 2  # one update an epoch


@pytest.mark.parametrize("outdir, message", [
    ("FILE", "--to hf FILE is not a directory"),
    ("FILE/sub", "--to hf FILE/sub cannot be created: FILE is not a directory"),
    ("FULL", "--to hf FULL: the directory is not empty; choose another OUTDIR, or pass --force to write over its files"),
])
def test_export_refuses_an_output_path_it_cannot_use_with_one_line(tmp_path, capsys, outdir, message):
    (tmp_path / "FILE").write_text("an existing file")
    (tmp_path / "FULL").mkdir()
    (tmp_path / "FULL" / "config.json").write_text("{}")
    before = snapshot(tmp_path)
    code = export_main(["--path", str(tmp_path / "checkpoint_last.pt"), "--to", "hf", str(tmp_path / outdir)])
    err = capsys.readouterr().err
    assert code == 2
    expected = message.replace("FILE", str(tmp_path / "FILE")).replace("FULL", str(tmp_path / "FULL"))
    assert err == f"hetfair-export: error: {expected}\n"
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("total, warned", [("64", True), ("26", False), ("28", False), ("30", True)])
def test_a_total_num_update_far_from_the_runs_updates_is_one_warning(tmp_path, capsys, total, warned):
    """200 samples in updates of 16 for 2 epochs: 26 updates; within 10% of them no warning, and the value
    the warning gives is the one that trains without it."""
    flags = toy(tmp_path / "ckpt", "--max-epoch", "2", "--lr-scheduler", "polynomial_decay", "--warmup-updates",
                "2", "--total-num-update", total, "--dry-run")
    assert train_main(flags) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hetfair-train: warning:")]
    assert len(warnings) == warned, warnings
    if warned:
        assert warnings[0].startswith(f"hetfair-train: warning: --total-num-update {total} but this run makes 26 "
                                      f"updates (--max-epoch 2 x 13 updates an epoch")
        assert warnings[0].endswith("give --total-num-update 26")


def test_max_update_bounds_the_run_a_total_num_update_is_checked_against(tmp_path, capsys):
    flags = toy(tmp_path / "ckpt", "--max-epoch", "2", "--max-update", "5", "--lr-scheduler", "cosine",
                "--total-num-update", "26", "--dry-run")
    assert train_main(flags) == 0
    assert "this run makes 5 updates (--max-update 5)" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--ddp-comm-hook", "powersgd", "--powersgd-rank", "2"],
                                   ["--ddp-comm-hook", "auto", "--powersgd-start-update", "5"],
                                   ["--auto-balance", "--balance-interval", "4", "--balance-smoothing", "0.5"],
                                   ["--ddp-backend", "diloco", "--outer-lr", "0.5", "--bucket-cap-mb", "50"],
                                   ["--zero-sharding", "os", "--zero-shard-weights", "1,2",
                                    "--distributed-world-size", "2"]],
                         ids=lambda flags: " ".join(flags))
def test_a_mode_takes_its_own_flags(tmp_path, capsys, flags):
    assert train_main(toy(tmp_path / "ckpt", "--dry-run", *flags)) == 0, capsys.readouterr().err


def test_every_flag_a_mode_owns_is_an_option():
    parser = build_parser()
    add_comm_hook_args(parser)  # the comm hooks' flags join the chosen components' (a run's parser has them)
    options = parser._option_string_actions
    assert {flag for owner in flag_owners() for flag in owner.flags} <= set(options)
