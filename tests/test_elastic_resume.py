"""Resuming on other ranks: the checkpoint's updates are kept, cut into steps the new ranks hold.

In-process, single-process runs stand in for clusters of other shapes: what a run
resumes with is only the sum of the ranks' batch sizes (the split of a step among
ranks is tested in test_heterogeneous_equivalence.py). The reference is plain PyTorch.
"""

from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfair.balance import BalanceConfig, LoadBalancer
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.data.batch_plan import BatchPlan
from hetfair.data.update_shape import UpdateShape
from hetfair.launch.launcher import gpu_index, plan_launch
from hetfair.launch.per_process import for_process
from hetfair.launch.slurm import tasks_on_this_node
from hetfair.parallel.stats import UpdateResult
from hetfair.errors import ConfigError
from hetfair.logging.meters import IntervalStats
from hetfair.options import parse_train_args
from hetfair.run.config import DataConfig
from hetfair.run.training import resumed_shape
from hetfair_cli.train import main as train_main
from helpers import TOY_PLUGIN, final_parameters, run_nodes
from toy_reference import TRAIN_SIZE, assert_same, reference_parameters, toy_train_args


@pytest.mark.parametrize("nominal,capacity,fitted", [
    (UpdateShape.of(64, 1), 64, UpdateShape(64, 64)),
    (UpdateShape.of(64, 1), 100, UpdateShape(64, 64)),  # more room: the same steps
    (UpdateShape.of(64, 1), 32, UpdateShape(64, 32)),
    (UpdateShape.of(64, 3), 48, UpdateShape(192, 48)),
    (UpdateShape.of(97, 1), 64, UpdateShape(97, 49)),  # steps of 49 and 48
])
def test_a_shape_that_does_not_fit_takes_more_smaller_steps(nominal, capacity, fitted):
    assert nominal.fitted(capacity) == fitted
    assert fitted.step_size <= capacity and fitted.update_size == nominal.update_size


@pytest.mark.parametrize("nominal,capacity", [(UpdateShape.of(64, 2), 24), (UpdateShape.of(30, 1), 7)])
def test_fitted_steps_cover_each_update_with_the_same_samples_in_the_same_order(nominal, capacity):
    fitted = nominal.fitted(capacity)

    def updates(shape: UpdateShape, start: int) -> list[np.ndarray]:
        plan = BatchPlan(TRAIN_SIZE, [capacity], seed=1, epoch=2, start=start, global_batch_size=shape.step_size,
                         update_size=shape.update_size)
        steps = [plan.global_batch(step) for step in range(plan.num_steps)]
        assert all(0 < len(step) <= shape.step_size for step in steps)
        per_update = shape.steps_per_update
        return [np.concatenate(steps[i:i + per_update]) for i in range(0, len(steps), per_update)]

    big = BatchPlan(TRAIN_SIZE, [nominal.step_size], seed=1, epoch=2, global_batch_size=nominal.step_size)
    whole = [np.concatenate([big.global_batch(s) for s in range(i, min(i + nominal.steps_per_update, big.num_steps))])
             for i in range(0, big.num_steps, nominal.steps_per_update)]
    assert [u.tolist() for u in updates(fitted, 0)] == [u.tolist() for u in whole]
    assert [u.tolist() for u in updates(fitted, nominal.update_size)] == [u.tolist() for u in whole[1:]]


def run(save_dir: Path, batch: int, *extra: str) -> int:
    return train_main(toy_train_args(save_dir, None, ("--max-sentences", str(batch), *extra)))


def test_resuming_with_smaller_batches_keeps_the_updates_of_the_checkpoint(tmp_path, capsys):
    # written by "two ranks of 32" (one process of 64), resumed by "one rank of 32" after 3 updates, then 48
    save_dir = tmp_path / "ckpt"
    assert run(save_dir, 64, "--max-update", "3") == 0
    assert load_checkpoint(save_dir / "checkpoint_last.pt")["batch"] == {"global_batch_size": 64, "update_freq": 1}
    capsys.readouterr()
    assert run(save_dir, 32, "--max-update", "6", "--log-format", "simple") == 0
    assert ("batch | the global batch of 64 does not fit in one step of these processes (32 samples together): "
            "each update of 64 samples takes 2 steps of up to 32 (--update-freq 1 raised to 2)") in capsys.readouterr().err
    assert run(save_dir, 48) == 0
    assert_same(final_parameters(save_dir), reference_parameters(update_size=64))
    assert load_checkpoint(save_dir / "checkpoint_last.pt")["batch"] == {"global_batch_size": 64, "update_freq": 1}


def test_resuming_with_larger_batches_keeps_the_global_batch(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert run(save_dir, 16, "--update-freq", "2", "--max-update", "4") == 0
    assert train_main(toy_train_args(save_dir, 2, ("--max-sentences", "64"))) == 0
    assert_same(final_parameters(save_dir), reference_parameters(update_size=32))


def test_fixed_update_freq_refuses_to_cut_the_global_batch_in_one_line(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert run(save_dir, 64, "--max-update", "1") == 0
    capsys.readouterr()
    assert run(save_dir, 32, "--fixed-update-freq") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "hetfair-train: error: the global batch of 64 samples does not fit in one step of 1 process(es) with batch "
        "sizes [32] (32 together) and --fixed-update-freq forbids more steps per update; drop --fixed-update-freq")


def test_an_explicit_global_batch_and_update_freq_replace_the_checkpoints_with_a_notice(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert run(save_dir, 64, "--max-update", "1") == 0
    capsys.readouterr()
    assert run(save_dir, 64, "--max-update", "2", "--global-batch-size", "32", "--log-format", "simple") == 0
    assert "replaces" not in capsys.readouterr().err  # 32 x 2: the checkpoint's 64 samples per update
    assert load_checkpoint(save_dir / "checkpoint_last.pt")["batch"] == {"global_batch_size": 32, "update_freq": 2}
    assert run(save_dir, 64, "--max-update", "3", "--global-batch-size", "32", "--update-freq", "1",
               "--log-format", "simple") == 0
    assert ("restore | the command line's global batch 32 x --update-freq 1 replaces the checkpoint's 32 x 2"
            in capsys.readouterr().err)
    assert load_checkpoint(save_dir / "checkpoint_last.pt")["batch"] == {"global_batch_size": 32, "update_freq": 1}


def test_auto_balance_keeps_the_checkpoints_steps_where_they_fit(tmp_path, capsys):
    # 12 x 2 on a maximum of 24: the room of 12 samples is what lets the split move, so no step of 24
    save_dir = tmp_path / "ckpt"
    assert run(save_dir, 24, "--global-batch-size", "12", "--update-freq", "2", "--auto-balance",
               "--max-update", "1") == 0
    capsys.readouterr()
    assert run(save_dir, 24, "--auto-balance", "--max-update", "2", "--log-format", "simple") == 0
    assert "batch |" not in capsys.readouterr().err
    assert load_checkpoint(save_dir / "checkpoint_last.pt")["batch"] == {"global_batch_size": 12, "update_freq": 2}


SAVED = UpdateShape.of(12, 2)


@pytest.mark.parametrize("typed,expected", [
    ((), SAVED),  # nothing typed: the checkpoint's
    (("--global-batch-size", "8"), UpdateShape.of(8, 3)),  # as many steps as make the checkpoint's 24 samples
    (("--update-freq", "1"), UpdateShape.of(12, 1)),  # the checkpoint's global batch, the typed --update-freq
    (("--global-batch-size", "8", "--update-freq", "1"), UpdateShape.of(8, 1)),
])
def test_a_resumed_run_takes_only_typed_flags_over_the_checkpoints_updates(typed, expected):
    assert resumed_shape(DataConfig.from_args(toy("--max-sentences", "24", *typed)), SAVED) == expected


def test_a_global_batch_that_does_not_divide_the_checkpoints_update_is_one_line():
    with pytest.raises(ConfigError, match=r"^--global-batch-size 10 does not divide the checkpoint's 24 samples per "
                                          r"update \(12 x --update-freq 2\); give a global batch that divides it, or "
                                          r"add --update-freq N to train updates of 10 x N samples$"):
        resumed_shape(DataConfig.from_args(toy("--max-sentences", "24", "--global-batch-size", "10")), SAVED)


def test_a_resume_on_another_shape_without_update_freq_keeps_the_checkpoints_samples_per_update(tmp_path, capsys):
    # two ranks of 6 x --update-freq 2 for an epoch (24 samples per update), then one rank of 24, no --update-freq
    save_dir, copy = tmp_path / "ckpt", tmp_path / "copy"
    two_ranks = toy_train_args(save_dir, 2, ("--max-epoch", "1", "--distributed-world-size", "2",
                                             "--max-sentences", "6"))
    for result in run_nodes([two_ranks], cwd=tmp_path):
        assert result.returncode == 0, result.stderr
    shutil.copytree(save_dir, copy)
    updates_per_epoch = math.ceil(TRAIN_SIZE / 24)
    capsys.readouterr()
    assert train_main(toy_train_args(save_dir, None, ("--max-sentences", "24", "--log-format", "simple"))) == 0
    err = capsys.readouterr().err
    assert "replaces" not in err and ("batch | these processes hold 24 samples together: each update of 24 samples "
                                      "takes 1 step(s) of up to 24 (--update-freq 2 lowered to 1)") in err
    state = load_checkpoint(save_dir / "checkpoint_last.pt")
    assert state["trainer"]["num_updates"] == 2 * updates_per_epoch
    assert state["batch"] == {"global_batch_size": 12, "update_freq": 2}
    assert_same(final_parameters(save_dir), reference_parameters(update_size=24))
    # an --update-freq on the command line still replaces the checkpoint's: 12 x 1
    assert train_main(toy_train_args(copy, 1, ("--max-sentences", "24", "--log-format", "simple"))) == 0
    assert ("restore | the command line's global batch 12 x --update-freq 1 replaces the checkpoint's 12 x 2"
            in capsys.readouterr().err)
    assert load_checkpoint(copy / "checkpoint_last.pt")["trainer"]["num_updates"] == (
        updates_per_epoch + math.ceil(TRAIN_SIZE / 12))


def test_a_checkpoint_without_a_batch_part_resumes_with_the_command_lines(tmp_path):
    # written by an older hetfair: the command line decides, as it did then
    save_dir = tmp_path / "ckpt"
    assert run(save_dir, 40, "--max-update", "2") == 0
    path = save_dir / "checkpoint_last.pt"
    state = load_checkpoint(path)
    del state["batch"]
    torch.save(state, path)
    assert run(save_dir, 40) == 0
    assert_same(final_parameters(save_dir), reference_parameters(update_size=40))


# -- per-process lists under torchrun and SLURM ------------------------------------------------

def toy(*argv: str) -> argparse.Namespace:
    return parse_train_args(["--user-dir", str(TOY_PLUGIN), "--task", "toy", *argv])


TORCHRUN_ENV = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_under_torchrun_a_list_has_one_value_per_worker_of_the_node_and_each_takes_its_local_ranks():
    args = toy("--max-sentences", "48,16", "--device-id", "0,2")
    plan = plan_launch(args, TORCHRUN_ENV)
    plan.check_counts(args)
    assert plan.list_index(0) == 1
    assert gpu_index(args.device_id, plan.list_index(0), local_rank=1) == 2


def test_under_torchrun_a_list_of_the_wrong_length_names_nproc_per_node():
    args = toy("--max-sentences", "48,16,8")
    with pytest.raises(ConfigError, match=r"^--max-sentences 48,16,8 gives 3 values but torchrun \(--nproc-per-node\) "
                                          r"starts 2 processes; give one value for all of them or one per process$"):
        plan_launch(args, TORCHRUN_ENV).check_counts(args)


SLURM_ENV = {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
             "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_TASKS_PER_NODE": "4,3"}


def test_under_slurm_a_list_has_one_value_per_task_of_the_node_and_each_takes_its_localid():
    args = toy("--max-sentences", "48,16,8", "--device-id", "0,2,3", "--distributed-port", "12345")
    plan = plan_launch(args, SLURM_ENV)  # the second node runs 3 of the 7 tasks; this is its third
    plan.check_counts(args)
    assert (plan.world_size, plan.base_rank, plan.nprocs, plan.init_method) == (7, 6, 1, "tcp://gpu03:12345")
    assert plan.list_index(0) == 2 and for_process(args, plan.list_index(0)).max_sentences == 8
    assert gpu_index(args.device_id, plan.list_index(0), local_rank=2) == 3
    with pytest.raises(ConfigError, match=r"^--max-sentences 48,16 gives 2 values but SLURM \(--ntasks-per-node\) "
                                          r"starts 3 processes; give one value for all of them or one per process$"):
        plan_launch(toy("--max-sentences", "48,16", "--distributed-port", "1"), SLURM_ENV).check_counts(
            toy("--max-sentences", "48,16"))


@pytest.mark.parametrize("tasks_per_node, node, expected", [
    ("4(x2),3", "1", 4), ("4(x2),3", "2", 3), ("2", "0", 2), ("garbled", "0", 0)])
def test_tasks_on_this_node_reads_slurms_compressed_counts(tasks_per_node, node, expected):
    assert tasks_on_this_node({"SLURM_TASKS_PER_NODE": tasks_per_node, "SLURM_NODEID": node}) == expected


def test_device_id_is_the_first_gpu_or_one_per_process():
    assert toy("--device-id", "2").device_id == 2 and gpu_index(2, 0, local_rank=1) == 3
    assert toy("--device-id", "0,2,3").device_id == (0, 2, 3) and gpu_index((0, 2, 3), 2, local_rank=2) == 3
    with pytest.raises(ConfigError, match="--device-id 0,x: 'x' is not a whole number"):
        toy("--device-id", "0,x")


def test_a_live_rank_chooses_its_gpu_as_the_launcher_does(monkeypatch):
    """Live recovery's process takes the launcher's device choice, its check of the visible GPUs included."""
    from hetfair.live import recovery

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="GPU 3 requested but only 2 are visible"):
        recovery._device(toy("--device-id", "3"))
    with pytest.raises(ConfigError, match="GPU 5 requested but only 2 are visible"):
        recovery._device(toy("--device-id", "5,0"))
    assert recovery._device(toy("--cpu", "--device-id", "3")) == torch.device("cpu")


def test_balancing_starts_afresh_on_ranks_with_other_batch_sizes():
    config = BalanceConfig(warmup_updates=0, interval=1, smoothing=1.0, threshold=0.0)
    saved = LoadBalancer([24, 24], 32, config)
    saved.split = [10, 22]
    assert LoadBalancer([16, 24], 32, config).load_state_dict(saved.state_dict()) is False  # split fits, caps differ
    same = LoadBalancer([24, 24], 32, config)
    assert same.load_state_dict(saved.state_dict()) is True and same.split == [10, 22]


def test_per_rank_statistics_start_anew_on_another_number_of_ranks():
    def result(samples: list[float]) -> UpdateResult:
        return UpdateResult(totals={}, samples=samples, timed_samples=samples, compute_seconds=[1.0] * len(samples), lr=0.1, gnorm=1.0,
                            clipped=False)

    saved = IntervalStats(lambda totals: {})
    saved.add(result([16.0, 16.0]), seconds=1.0)
    resumed = IntervalStats(lambda totals: {})
    resumed.load_state_dict(saved.state_dict())
    resumed.add(result([12.0, 10.0, 10.0]), seconds=1.0)
    metrics = resumed.metrics()
    assert [metrics[f"share{r}"] for r in range(3)] == pytest.approx([37.5, 31.25, 31.25])
    assert resumed.updates == 2
