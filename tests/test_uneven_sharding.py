"""--ddp-backend fully_sharded --shard-fractions: each rank its own share of the state, the same update.

Real gloo process groups; the references are plain PyTorch loops over the same global batches
(tests/toy_reference.py), a one-process hetfair run for BERT, and replicated DDP for fp16's overflows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.multiprocessing.reductions import StorageWeakRef

from helpers import final_parameters, free_port, node_commands, rank_flags, run_nodes
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.errors import ConfigError
from hetfair.parallel import ParallelConfig, Strategy, build_strategy
from hetfair.parallel.context import DistributedContext
from hetfair.models.deferred_init import build_deferred
from hetfair.parallel.fully_sharded import unit_bytes
from hetfair.parallel.uneven_engine import UnevenShardedModel, shard_bounds
from hetfair_cli.train import main as train_main
from hetfair.launch.supervisor import run_workers
from test_zero_sharding import ADAM, adam_reference, assert_same_optimizer_state
from toy_reference import assert_same, reference_parameters, toy_train_args


def run_uneven(tmp_path: Path, save_dir: Path, batch_sizes: list[int], fractions: str, extra: tuple[str, ...] = (),
               update_freq: int = 1) -> list[str]:
    """Train the toy model with one command per rank; each rank's stderr."""
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = node_commands(toy_train_args(save_dir, update_freq, extra), batch_sizes, init,
                             "--ddp-backend", "fully_sharded", "--shard-fractions", fractions)
    results = run_nodes(commands, cwd=tmp_path)
    for result in results:
        assert result.returncode == 0, result.stderr
    return [result.stderr for result in results]


def test_every_element_goes_to_exactly_one_rank_in_proportion():
    assert shard_bounds(10, (0.25, 0.75)) == [0, 2, 10]  # round(2.5) is 2
    assert shard_bounds(1, (0.25, 0.25, 0.5)) == [0, 0, 0, 1]  # a rank may hold nothing of a small parameter
    assert shard_bounds(1000, (0.25, 0.25, 0.5)) == [0, 250, 500, 1000]


@pytest.mark.parametrize("batch_sizes, fractions, reshard", [([8, 24], "1,3", True), ([2, 6, 24], "1,1,2", False)],
                         ids=["1:3", "1:1:2-no-reshard"])
def test_uneven_fractions_give_the_plain_update(tmp_path, batch_sizes, fractions, reshard):
    clip = 0.05  # most updates are clipped: the norm must be the global one over all shards
    expected = reference_parameters(update_size=32 * 2, clip_norm=clip)
    extra = ("--clip-norm", str(clip), "--toy-hidden", "16", "--log-format", "json") + (
        () if reshard else ("--no-reshard-after-forward",))
    stderr = run_uneven(tmp_path, tmp_path / "ckpt", batch_sizes, fractions, extra, update_freq=2)
    assert_same(final_parameters(tmp_path / "ckpt"), expected)
    (plan,) = [line for line in stderr[0].splitlines() if "plan | uneven shards" in line]
    assert "gradients reduced by all-reduce" in plan and "all-reduce" in plan and "padded all-gather" in plan, plan
    report = shard_record(stderr[0])
    held = [report[f"state_bytes{rank}"] for rank in range(len(batch_sizes))]
    for rank, size in enumerate(held):  # parameters, gradients, SGD has no state: the fraction of the whole
        assert size <= 1.1 * report[f"fraction{rank}"] * sum(held), (rank, held)


def shard_record(stderr: str) -> dict[str, float]:
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    (record,) = [r for r in records if r["phase"] == "zero"]
    return record


def test_uneven_fp16_skips_the_same_overflowing_updates_as_replicated_ranks(tmp_path):
    """Each rank sees only its gradient shards; the ranks must agree on every overflow, as DDP ranks do."""
    fp16 = ("--fp16", "--fp16-init-scale", str(2**18), "--fp16-scale-window", "3", "--max-update", "6",
            "--max-epoch", "0")
    run_uneven(tmp_path, tmp_path / "sharded", [8, 24], "1,3", fp16)
    init = f"tcp://127.0.0.1:{free_port()}"
    for result in run_nodes(node_commands(toy_train_args(tmp_path / "ddp", 1, fp16), [8, 24], init), cwd=tmp_path):
        assert result.returncode == 0, result.stderr
    assert_same(final_parameters(tmp_path / "sharded"), final_parameters(tmp_path / "ddp"))
    scales = [torch.load(tmp_path / run / "checkpoint_last.pt", weights_only=True)["loss_scale"]
              for run in ("sharded", "ddp")]
    assert scales[0] == scales[1] and scales[0]["scale"] < 2**18  # the same overflows were skipped


def test_checkpoints_move_between_unsharded_uneven_and_even_runs(tmp_path):
    """unsharded -> 1:3 -> 1:1 -> unsharded ends where plain Adam ends; the 1:3 run saves plain Adam state."""
    chain = tmp_path / "chain"
    for batch_sizes, fractions, stop in (([], "", 2), ([8, 24], "1,3", 4), ([16, 16], "1,1", 6), ([], "", 8)):
        flags = (*ADAM, "--max-update", str(stop), "--max-epoch", "0")
        if fractions:
            run_uneven(tmp_path, chain, batch_sizes, fractions, flags)
        else:  # unsharded, in this process
            assert train_main(toy_train_args(chain, 1, (*flags, "--max-sentences", "32"))) == 0
        if fractions == "1,3":
            _, optimizer = adam_reference(update_size=32, max_updates=stop)
            saved = load_checkpoint(chain / "checkpoint_last.pt")["trainer"]["optimizer"]
            assert_same_optimizer_state(saved, optimizer, atol=1e-5)
    expected, _ = adam_reference(update_size=32, max_updates=8)
    assert_same(final_parameters(chain), expected)


def test_bert_uneven_per_encoder_layer_matches_one_process(tmp_path):
    from bert_helpers import make_data_dir, write_bert_config

    data_dir, _, _ = make_data_dir(tmp_path, n_docs=60, splits=("train", "valid"))
    config = write_bert_config(tmp_path / "c.json", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    common = ["--task", "bert", "--data", str(data_dir), "--config_file", str(config), "--nsp", "--optimizer", "adam",
              "--lr", "0.001", "--lr-scheduler", "fixed", "--max-update", "3", "--update-freq", "2",
              "--clip-norm", "0.5", "--no-epoch-checkpoints", "--log-format", "none", "--distributed-timeout", "120",
              "--validate-interval-updates", "2", "--max-sentences-valid", "5"]  # validation: uneven shares
    init = f"tcp://127.0.0.1:{free_port()}"
    single = run_nodes([common + ["--max-sentences", "12", "--save-dir", str(tmp_path / "one")]], cwd=tmp_path)
    sharded = run_nodes([common + ["--max-sentences", str(batch), "--save-dir", str(tmp_path / "two"),
                                   *rank_flags(rank, 2, init), "--ddp-backend", "fully_sharded",
                                   "--shard-fractions", "1,3"]
                         for rank, batch in enumerate([4, 8])], cwd=tmp_path, timeout=300)
    for result in single + sharded:
        assert result.returncode == 0, result.stderr
    expected, actual = final_parameters(tmp_path / "one"), final_parameters(tmp_path / "two")
    assert expected.keys() == actual.keys()
    for name in expected:  # the fully_sharded BERT test's tolerance: Adam divides by small second moments
        torch.testing.assert_close(actual[name], expected[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("flags, message", [
    (["--shard-fractions", "1,2,3"], "--shard-fractions has 3 values but the job has 2 processes"),
    (["--shard-fractions", "1,-3"], "--shard-fractions 1,-3: give one positive finite number per rank"),
    (["--shard-fractions", "inf,1"], "--shard-fractions inf,1: give one positive finite number per rank"),
    (["--shard-fractions", "1,nan"], "--shard-fractions 1,nan: give one positive finite number per rank"),
    (["--shard-fractions", "0,1"], "--shard-fractions 0,1: give one positive finite number per rank"),
    (["--shard-fractions", "1e308,1e308"], "--shard-fractions 1e308,1e308: give one positive finite number per rank"),
    (["--shard-fractions", "1,3", "--ddp-backend", "c10d"], "--shard-fractions needs --ddp-backend fully_sharded"),
    (["--shard-fractions", "1,3", "--ddp-backend", "hybrid_sharded"],
     "--shard-fractions needs --ddp-backend fully_sharded (this command has --ddp-backend hybrid_sharded)"),
    (["--offload", "1", "--ddp-backend", "c10d"], "--offload needs --ddp-backend fully_sharded"),
    (["--offload", "2", "--shard-fractions", "1,3"], "--offload must be at most 1"),
])
def test_flags_that_cannot_work_are_one_line(tmp_path, capsys, flags, message):
    command = toy_train_args(tmp_path / "ckpt", 1, ("--ddp-backend", "fully_sharded", *flags))
    code = train_main(command + ["--distributed-world-size", "2", "--max-sentences", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("flags, message", [
    (["--offload", "1,0"], "--offload 1 keeps rank 0's shards in host memory for a CUDA device"),
    (["--compile"], "--compile cannot trace the uneven engine's gather hooks"),
], ids=["offload-on-cpu", "compile"])
def test_what_a_rank_cannot_run_is_one_line(tmp_path, flags, message):
    command = toy_train_args(tmp_path / "ckpt", 1, ("--ddp-backend", "fully_sharded", "--shard-fractions", "1,3",
                                                    *flags))
    [result] = run_nodes([command + ["--distributed-world-size", "2", "--max-sentences", "8"]], cwd=tmp_path)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1 and message in err[0], err


def test_offload_without_fractions_names_the_engine_it_needs():
    """Even shards run on FSDP2, which hetfair gives no offload: the one-line error says what would."""
    context = DistributedContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"--offload 1 \(rank 0\) needs hetfair's uneven engine: give "
                                          r"--shard-fractions"):
        build_strategy(ParallelConfig("fully_sharded", offload=True), context)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh()) for _ in range(3)],
                         nn.Linear(6, 2))


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no-reshard"])
def test_gathered_units_are_freed_after_forward_and_after_backward(one_process_group, reshard):
    """Saved activations refer to a unit's gathered parameters without keeping them: reshard after forward frees
    them (not the root's: its backward follows at once), the backward gathers them again, and the gradients are
    plain autograd's."""
    plain, model = blocks(), build_deferred(blocks)
    units = list(model)[:3]
    engine = UnevenShardedModel(model, units, (1.0,), 0, torch.device("cpu"), torch.device("cpu"), reshard, None)
    gathered: list[StorageWeakRef] = []  # each unit's gathered buffer, seen through one of its own parameters
    for unit, holder in [*((unit, unit[0]) for unit in units), (model, model[3])]:
        unit.register_forward_pre_hook(lambda _m, _i, holder=holder: gathered.append(
            StorageWeakRef(holder.weight.untyped_storage())))
    x = torch.randn(5, 6)
    loss = model(x).square().sum()
    assert [ref.expired() for ref in gathered] == [False, *[reshard] * 3]  # the root first, then the units
    loss.backward()
    assert all(ref.expired() for ref in gathered) and not any(unit.is_gathered() for unit in engine.units)
    plain(x).square().sum().backward()
    for (name, expected), shard in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(shard.grad, expected.grad.reshape(-1), msg=name)



def test_gathered_unit_sizes_are_each_units_full_parameters(one_process_group):
    """What the memory table reads: the largest unit gathered whole, FSDP2's and the uneven engine's alike."""
    layer, root = 4 * (6 * 6 + 6 + 6 + 6), 4 * (6 * 2 + 2)  # fp32 Linear(6, 6) + LayerNorm(6); the last Linear
    plain = blocks()
    assert unit_bytes(plain, list(plain)[:3]) == [layer, layer, layer, root]
    model = build_deferred(blocks)
    engine = UnevenShardedModel(model, list(model)[:3], (1.0,), 0, torch.device("cpu"), torch.device("cpu"), True,
                                None)
    assert [unit.full_bytes for unit in engine.units] == [layer, layer, layer, root]


def test_held_state_is_what_the_rank_keeps_of_params_grads_and_optimizer_state():
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    strategy = Strategy(ParallelConfig(), DistributedContext(rank=0, world_size=1, local_rank=0,
                                                             device=torch.device("cpu")))
    weights = 4 * (4 * 3 + 3)  # fp32 bytes of the weight and bias
    assert strategy.held_state_bytes(optimizer) == {"params": weights, "grads": weights,
                                                    "optimizer": 2 * weights + 2 * 4}  # moments; two fp32 steps
    assert strategy.largest_gathered_unit_bytes() == 0  # unsharded: nothing is gathered, all is held


def _checkpointing_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        model = blocks()
        if rank == 0:  # this rank only recomputes its units' forward in the backward (--activation-checkpointing 1,0)
            for index in range(3):
                model[index] = checkpoint_wrapper(model[index])
        engine = UnevenShardedModel(model, list(model)[:3], (0.25, 0.75), rank, torch.device("cpu"),
                                    torch.device("cpu"), True, None)
        torch.manual_seed(1 + rank)
        model(torch.randn(5, 6)).square().sum().backward()
        torch.save({engine.param_of[id(shard)].name.replace("._checkpoint_wrapped_module", ""): shard.grad
                    for shard in model.parameters()}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ranks_that_checkpoint_activations_gather_with_ranks_that_do_not(tmp_path):
    """A rank recomputing its units' forward gathers each unit once in the backward, as the others do: no hang,
    and the gradients are plain autograd's over both ranks' inputs."""
    run_workers(2, 0, _checkpointing_worker, (str(tmp_path / "rendezvous"), str(tmp_path)))
    plain = blocks()
    for rank in range(2):
        torch.manual_seed(1 + rank)
        plain(torch.randn(5, 6)).square().sum().backward()
    grads = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    for name, param in plain.named_parameters():
        torch.testing.assert_close(torch.cat([grads[0][name], grads[1][name]]), param.grad.reshape(-1), msg=name)
