"""BERT updates (masked LM + NSP) are the same on one process and on heterogeneous gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bert_helpers import make_data_dir, write_bert_config
from helpers import final_parameters, free_port, node_commands, run_nodes


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("bert_dist")
    data_dir, _, _ = make_data_dir(tmp, n_docs=120, splits=("train",))
    # No dropout: every rank draws its own dropout masks, so only then are the updates comparable.
    config = write_bert_config(tmp / "c.json", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return data_dir, config


def run(tmp_path: Path, setup: tuple[Path, Path], batch_sizes: list[int]) -> dict[str, torch.Tensor]:
    data_dir, config = setup
    save_dir = tmp_path / f"ckpt_{'_'.join(map(str, batch_sizes))}"
    common = ["--task", "bert", "--data", str(data_dir), "--config_file", str(config), "--nsp",
              "--optimizer", "sgd", "--lr", "0.5", "--lr-scheduler", "fixed", "--max-update", "2",
              "--update-freq", "2", "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--disable-validation",
              "--log-format", "none", "--distributed-timeout", "120"]
    init = f"tcp://127.0.0.1:{free_port()}"
    for result in run_nodes(node_commands(common, batch_sizes, init), cwd=tmp_path, timeout=300):
        assert result.returncode == 0, result.stderr
    return final_parameters(save_dir)


def test_heterogeneous_ranks_give_the_single_process_update(tmp_path: Path, setup) -> None:
    single = run(tmp_path, setup, [12])
    split = run(tmp_path, setup, [4, 8])
    assert single.keys() == split.keys()
    for name in single:
        assert torch.allclose(single[name], split[name], atol=2e-6, rtol=1e-5), name
