"""``--compile``: the same training as eager, one compile per process whatever the batch sizes.

One real 2-rank gloo job with per-rank batch sizes 8 and 24 (the short last
global batch of each epoch gives the ranks 2 and 6 samples), compared with a
plain eager PyTorch loop; torch's own ``recompiles`` and ``guards`` logs show
how often each rank compiled. Its checkpoint then resumes in an eager run.
"""

from __future__ import annotations

import os

import subprocess

from helpers import final_parameters, free_port, node_commands, run_nodes, start
from toy_reference import EPOCHS, assert_same, reference_parameters, toy_train_args


def test_compiled_training_matches_eager_pytorch_without_recompiling_for_other_batch_sizes(tmp_path):
    save_dir = tmp_path / "ckpt"
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = node_commands(toy_train_args(save_dir, 1, ("--compile",)), (8, 24), init)
    os.environ["TORCH_LOGS"] = "recompiles,guards"  # read by the ranks' torch as it is imported: real commands
    try:
        processes = [start(command, tmp_path) for command in commands]
    finally:
        del os.environ["TORCH_LOGS"]
    outputs = [process.communicate(timeout=300) for process in processes]
    results = [subprocess.CompletedProcess(process.args, process.returncode, *output)
               for process, output in zip(processes, outputs)]
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "Recompiling function" not in result.stderr, result.stderr
        assert result.stderr.count("GUARDS:") == 1, result.stderr  # compiled once, for every batch size
    compiled = final_parameters(save_dir)
    assert_same(compiled, reference_parameters(update_size=32))  # same keys (no _orig_mod.) and values

    # the checkpoint of a compiled run resumes in an eager one
    resumed = run_nodes([toy_train_args(save_dir, 1) + ["--max-sentences", "32", "--max-epoch", str(EPOCHS + 1)]],
                        cwd=tmp_path)[0]
    assert resumed.returncode == 0, resumed.stderr
    assert final_parameters(save_dir).keys() == compiled.keys()
