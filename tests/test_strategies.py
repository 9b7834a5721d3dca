"""Parallelism strategies are components: a plugin adds one (--user-dir or entry point) and training uses it.

The toy strategy (``tests/toy_plugin/strategy.py``) replaces DDP by one all-reduce per gradient after
the last backward; on real gloo ranks it must give the plain PyTorch update, as the built-in ones do.
"""

from __future__ import annotations

import textwrap

from helpers import final_parameters, free_port, node_commands, run_nodes
from hetfair.plugins import clear_entry_point_cache
from hetfair_cli.train import main as train_main
from toy_reference import assert_same, reference_parameters, toy_train_args

ENTRY_POINT_STRATEGY = """
    from pathlib import Path

    from hetfair.parallel import Strategy


    class MarkingStrategy(Strategy):
        \"\"\"The single-process behaviour, and a mark that training built it.\"\"\"

        def wrap(self, model):
            Path("{marker}").touch()
            return model
"""


def test_user_dir_strategy_trains_heterogeneous_ranks_to_the_plain_update(tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = node_commands(toy_train_args(tmp_path / "ckpt", 2), [8, 24], init, "--ddp-backend", "toy_allreduce")
    for result in run_nodes(commands, cwd=tmp_path):
        assert result.returncode == 0, result.stderr
    assert_same(final_parameters(tmp_path / "ckpt"), reference_parameters(update_size=64))


def test_entry_point_strategy_is_chosen_by_name_and_trains(tmp_path, monkeypatch):
    site, marker = tmp_path / "site", tmp_path / "built"
    info = site / "hetfair_test_strategy-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hetfair-test-strategy\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[hetfair.strategies]\nmarking = marking_strategy:MarkingStrategy\n")
    (site / "marking_strategy.py").write_text(textwrap.dedent(ENTRY_POINT_STRATEGY.format(marker=marker)))
    monkeypatch.syspath_prepend(str(site))
    clear_entry_point_cache()
    args = [*toy_train_args(tmp_path / "ckpt", 1), "--max-sentences", "32", "--ddp-backend", "marking"]
    assert train_main(args) == 0
    assert marker.exists()
    assert_same(final_parameters(tmp_path / "ckpt"), reference_parameters(update_size=32))


def test_unknown_strategy_lists_the_known_ones(tmp_path, capsys):
    assert train_main([*toy_train_args(tmp_path, 1), "--ddp-backend", "ring"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("hetfair-train: error: unknown strategy 'ring'; known strategies: ")
    assert {"c10d", "fully_sharded", "toy_allreduce"} <= set(line.split(": ")[-1].split(", "))
