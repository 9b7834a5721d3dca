"""benchmarks/bench_finetune.py's peers run as the benchmark starts them, with the transformers and accelerate
installed: each prints the progress lines the benchmark clocks, with its loss."""

from __future__ import annotations

import math
import sys

import pytest

from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_finetune  # noqa: E402
from benchmarks.common import clocked_run, subprocess_env  # noqa: E402

pytest.importorskip("accelerate")


@pytest.mark.parametrize("peer", ["trainer", "accelerate"])
def test_a_peer_prints_clocked_progress_lines_with_its_loss(tmp_path, peer):
    """Trainer's callback and accelerate's loop each print a line every interval (a Trainer whose callback
    never fires, or an accelerate loop on a changed API, would leave the benchmark without a number)."""
    data = bench_finetune.write_data(tmp_path / "data", 24)
    args = bench_finetune.parse_args(["--batch-size", "4", "--max-length", "16", "--interval", "2", "--intervals", "1"])
    run = clocked_run(bench_finetune.peer_command(args, 1, data, peer, seed=3), subprocess_env(1, str(REPO_ROOT)),
                      timeout=300, expected_updates=bench_finetune.total_updates(args), cwd=REPO_ROOT)
    assert [record["num_updates"] for record in run.records] == [2, 4]
    assert all(0.0 < record["loss"] < 2 * math.log(2) for record in run.records), run.records


def test_an_unknown_peer_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_finetune.parse_args(["--peers", "trainer,keras"])
    assert "unknown peer keras" in capsys.readouterr().err


def test_the_peers_take_each_update_s_sentences_in_hetfair_train_s_order():
    """Every contender's update k holds the same sentences (so all pad to the same lengths): the peers' order is
    the one hetfair-train's batch plan takes at the same seed, up to the order by length inside an update."""
    from benchmarks.finetune_peers import hetfair_order
    from hetfair.data.batch_plan import BatchPlan

    sentences, batch, seed = 50, 8, 3
    lengths = [(7 * index) % 13 for index in range(sentences)]
    plan = BatchPlan(sentences, [batch], seed, epoch=1, sizes=lengths)
    order = hetfair_order(sentences, seed)
    for step in range(plan.num_steps):
        assert sorted(plan.global_batch(step).tolist()) == sorted(order[step * batch:(step + 1) * batch])


def test_the_documented_run_parses_and_two_length_groups_halve_the_micro_batch(tmp_path):
    """docs/hf-encoders.md's command line, and its second hetfair contender: the same 32 sentences per update
    as two micro-batches of 16 (``--update-freq 2``), and 8 per rank on 2 ranks."""
    args = bench_finetune.parse_args(["--peers", "accelerate,trainer", "--length-groups", "1,2", "--repeats", "4",
                                      "--intervals", "5"])
    assert args.length_groups == [1, 2] and args.peers == ["accelerate", "trainer"]

    def batch_flags(ranks: int, groups: int) -> tuple[str, str]:
        command = bench_finetune.hetfair_command(args, ranks, tmp_path, tmp_path, seed=1, groups=groups)
        return (command[command.index("--max-sentences") + 1], command[command.index("--update-freq") + 1])

    assert batch_flags(1, 1) == ("32", "1")
    assert batch_flags(1, 2) == ("16", "2")
    assert batch_flags(2, 2) == ("8", "2")
