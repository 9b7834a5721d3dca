"""Faster implementations of the same update: ``--optimizer-impl`` and DDP's ``--bucket-cap-mb``.

The trainer's fused optimizer step is compared with plain PyTorch's default
(per-parameter loop) Adam; the DDP options are checked on a real 2-rank gloo group.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import TOY_PLUGIN, leave_group

from hetfair.data.rank_batches import dummy_batch
from hetfair.parallel.context import DistributedContext
from hetfair.errors import ConfigError
from hetfair.optim.implementation import implementation_kwargs
from hetfair.options import parse_train_args
from hetfair.tasks import TASK_REGISTRY
from hetfair.run.wiring import build_trainer
from hetfair.trainer import Trainer
from hetfair.launch.supervisor import run_workers

CPU = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def toy_trainer(*flags: str, context: DistributedContext = CPU) -> tuple[Trainer, torch.utils.data.Dataset]:
    args = parse_train_args(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--optimizer", "adam", "--lr", "0.05",
                             "--weight-decay", "0.01", "--max-sentences", "16", *flags])
    task = TASK_REGISTRY.get("toy").setup_task(args)
    data = task.dataset("train")
    torch.manual_seed(0)
    model = task.build_model(args)
    return build_trainer(args, model, task.build_criterion(args), context, dummy_batch(data, task.collater)), data


def batches(data: torch.utils.data.Dataset, sizes: list[int]) -> list[dict]:
    out, start = [], 0
    for size in sizes:
        inputs, labels = data.inputs[start:start + size], data.labels[start:start + size]
        out.append({"net_input": {"x": inputs}, "target": labels, "nsentences": size, "ntokens": size})
        start += size
    return out


def test_auto_chooses_fused_then_foreach_and_explicit_choices_are_honoured():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert implementation_kwargs(torch.optim.Adam, "auto", params) == {"fused": True}
    assert implementation_kwargs(torch.optim.RMSprop, "auto", params) == {"foreach": True}  # no fused kernel
    assert implementation_kwargs(torch.optim.SGD, "for-loop", params) == {"foreach": False}
    assert implementation_kwargs(torch.optim.SGD, "foreach", params) == {"foreach": True}
    with pytest.raises(ConfigError, match="RMSprop has no fused implementation.*--optimizer-impl auto"):
        implementation_kwargs(torch.optim.RMSprop, "fused", params)
    ints = [torch.zeros(3, dtype=torch.int64)]
    assert implementation_kwargs(torch.optim.Adam, "auto", ints) == {"foreach": True}


def test_fused_adam_updates_like_plain_pytorch_adam():
    trainer, data = toy_trainer()
    assert trainer.optimizer.param_groups[0]["fused"] is True
    reference = type(trainer.model)(16)
    reference.load_state_dict(trainer.model.state_dict())
    plain = torch.optim.Adam(reference.parameters(), lr=0.05, weight_decay=0.01)  # torch's default: the loop on CPU
    for batch in batches(data, [16, 16, 7, 16, 3, 16, 16, 16]):
        trainer.train_step([batch])
        plain.zero_grad()
        F.cross_entropy(reference(batch["net_input"]["x"]), batch["target"]).backward()
        plain.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_optimizer_state_moves_between_implementations_without_a_settings_notice():
    looped, data = toy_trainer("--optimizer-impl", "for-loop")
    looped.train_step(batches(data, [16]))
    fused, _ = toy_trainer()
    fused.load_state_dict(copy.deepcopy(looped.state_dict()))  # as from a file: no shared tensors
    assert fused.optimizer_overrides == {}  # how torch computes the step is no setting of the run
    assert fused.optimizer.param_groups[0]["fused"] is True
    fused.train_step(batches(data, [16]))
    looped.train_step(batches(data, [16]))
    for name, value in looped.model.state_dict().items():
        torch.testing.assert_close(fused.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def plain_adam(state: dict[str, torch.Tensor], steps: list[dict]) -> dict[str, torch.Tensor]:
    """Plain PyTorch: Adam (its default implementation) on the mean loss of each whole batch."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model.load_state_dict({name.removeprefix("net."): value for name, value in state.items()})
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, weight_decay=0.01)
    for batch in steps:
        optimizer.zero_grad()
        F.cross_entropy(model(batch["net_input"]["x"]), batch["target"]).backward()
        optimizer.step()
    return {f"net.{name}": value for name, value in model.state_dict().items()}


def _ddp_worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        _ddp_train(rank, out)
    finally:
        leave_group()


def _ddp_train(rank: int, out: str) -> None:
    context = DistributedContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    trainer, data = toy_trainer("--bucket-cap-mb", "0.0001", context=context)  # one bucket per tensor
    initial = copy.deepcopy(trainer.model.state_dict())
    whole = batches(data, [32, 32, 32])
    for batch in whole:  # rank 0 takes 12 samples of each batch, rank 1 the other 20
        part = slice(0, 12) if rank == 0 else slice(12, 32)
        x, y = batch["net_input"]["x"][part], batch["target"][part]
        trainer.train_step([{"net_input": {"x": x}, "target": y, "nsentences": len(y), "ntokens": len(y)}])
    ddp = trainer.wrapped_model
    torch.save({"cap": ddp.bucket_bytes_cap, "view": ddp.gradient_as_bucket_view,
                "params": trainer.model.state_dict(), "expected": plain_adam(initial, whole)},
               Path(out) / f"{rank}.pt")


def test_ddp_with_small_buckets_and_bucket_views_updates_like_plain_adam(tmp_path):
    run_workers(2, 0, _ddp_worker, (str(tmp_path / "rendezvous"), str(tmp_path)))
    for rank in range(2):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert (result["cap"], result["view"]) == (int(0.0001 * 1024 * 1024), True)  # --bucket-cap-mb reached DDP
        for name, value in result["expected"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_negative_bucket_cap_is_a_one_line_error(capsys):
    from hetfair_cli.train import main as train_main

    code = train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-epoch", "1", "--bucket-cap-mb", "-1"])
    assert code != 0
    assert "--bucket-cap-mb must be a finite number of at least 0, got -1.0" in capsys.readouterr().err
