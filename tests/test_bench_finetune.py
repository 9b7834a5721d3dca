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
