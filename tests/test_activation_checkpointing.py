"""--activation-checkpointing: a rank recomputes its sharding units' activations, and the update stays exact.

The reference is the plain PyTorch loop of :mod:`toy_reference`; the runs are real gloo groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers import final_parameters, run_nodes
from hetfair.models.activation_checkpointing import checkpoint_units
from toy_plugin import ToyMLP
from toy_reference import assert_same, reference_parameters, toy_train_args


def test_each_unit_runs_its_forward_again_in_the_backward_and_keeps_its_names():
    torch.manual_seed(0)
    model = ToyMLP(hidden=16, units=True)
    names = list(model.state_dict())
    units = model.sharding_units()
    checkpoint_units(model)
    calls = [0, 0]
    for index, unit in enumerate(units):
        unit.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    F.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
    assert calls == [2, 2]  # the forward, then its recomputation in the backward (stopped once it has what it needs)
    assert list(model.state_dict()) == names  # checkpoints keep the plain parameter names


def test_one_rank_checkpointing_gives_the_plain_update(tmp_path):
    """Rank 0 recomputes, rank 1 does not: the same parameters as plain PyTorch (no dropout in the toy model).
    Fully sharded: the recomputed forward gathers its unit again (the wrapper is the same in every mode)."""
    save_dir = tmp_path / "ckpt"
    args = toy_train_args(save_dir, 1, ("--optimizer", "sgd", "--toy-units", "--ddp-backend", "fully_sharded",
                                        "--distributed-world-size", "2", "--max-sentences", "8,24",
                                        "--activation-checkpointing", "1,0"))
    result, = run_nodes([args], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_same(final_parameters(save_dir), reference_parameters(update_size=32))


def test_a_model_without_sharding_units_is_refused_in_one_line(tmp_path):
    args = toy_train_args(tmp_path / "ckpt", 1, ("--max-update", "1", "--activation-checkpointing", "1"))
    result, = run_nodes([args], cwd=tmp_path)
    errors = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(errors) == 1 and "has no sharding units" in errors[0], result.stderr
