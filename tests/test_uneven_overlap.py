"""The uneven engine's collectives and their overlap: every gather and reduction layout gives plain autograd's
gradients, the next unit's gather starts while a unit computes, a unit's reduction travels while the unit before
it runs its backward, and the shards' gradients arrive, hooks and all, by the end of the backward.

Real gloo groups (one process, or two ranks at 1:3); the reference is the same model in plain PyTorch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hetfair.launch.supervisor import run_workers
from hetfair.models.deferred_init import build_deferred
from hetfair.parallel import uneven_collectives
from hetfair.parallel.uneven_engine import UnevenShardedModel

LAYOUTS = {"summed": (uneven_collectives.gather_summed, uneven_collectives.reduce_summed),
           "padded": (uneven_collectives.gather_padded, uneven_collectives.reduce_padded)}


def blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh()) for _ in range(3)],
                         nn.Linear(6, 2))


def inputs(rank: int, micro_batch: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * rank + micro_batch))


def _layout_worker(rank: int, init_file: str, out_dir: str, gather: str, reduce: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        model = build_deferred(blocks)
        engine = UnevenShardedModel(model, list(model)[:3], (0.25, 0.75), rank, torch.device("cpu"),
                                    torch.device("cpu"), True, None)
        assert set(engine.gather_seconds) == {"all-reduce", "padded all-gather"}  # gloo: the probe timed both
        for unit in engine.units:
            unit.gather_method, unit.reduce_method = LAYOUTS[gather][0], LAYOUTS[reduce][1]
        outputs = [model(inputs(rank, micro)) for micro in range(2)]  # two micro-batches: the gradients accumulate
        for output in outputs:
            output.square().sum().backward()
        torch.save({"grads": {engine.param_of[id(shard)].name: shard.grad for shard in model.parameters()},
                    "outputs": [output.detach() for output in outputs]}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("gather, reduce", [("summed", "summed"), ("padded", "padded"), ("padded", "summed")])
def test_every_layout_gives_plain_autograds_gradients(tmp_path, gather, reduce):
    """At 1:3 each rank ends with its slices of the gradient summed over both ranks' two micro-batches."""
    run_workers(2, 0, _layout_worker, (str(tmp_path / "rendezvous"), str(tmp_path), gather, reduce))
    plain = blocks()
    saved = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    for rank in range(2):
        for micro in range(2):
            output = plain(inputs(rank, micro))
            torch.testing.assert_close(saved[rank]["outputs"][micro], output.detach())
            output.square().sum().backward()
    for name, param in plain.named_parameters():
        torch.testing.assert_close(torch.cat([saved[0]["grads"][name], saved[1]["grads"][name]]),
                                   param.grad.reshape(-1), msg=name)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_gathers_run_ahead_and_reductions_behind_the_compute(one_process_group):
    """From the second forward on (the first one records the units' order): unit k's forward starts the gather of
    unit k + 1, the end of the forward that of the last unit, and unit k's backward that of unit k - 1; unit k's reduction is still in flight (its shards
    without gradients) when unit k - 1's backward starts; by the end of the backward every shard has its gradient,
    and each shard's post-accumulate-grad hook ran once (the trainer's compute clock is one)."""
    plain, model = blocks(), build_deferred(blocks)
    layers = list(model)[:3]
    engine = UnevenShardedModel(model, layers, (1.0,), 0, torch.device("cpu"), torch.device("cpu"), True, None)
    events: list[str] = []
    unit_of = {id(unit): name for unit, name in zip(engine.units, ["0", "1", "2", "root"])}
    for unit in engine.units:
        started = unit.start_gather

        def start_gather(unit=unit, started=started) -> None:
            if not unit.is_gathered() and unit._gathering is None:
                events.append(f"gather {unit_of[id(unit)]}")
            started()
        unit.start_gather = start_gather  # type: ignore[method-assign]
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, index=index: events.append(f"forward {index}"))
        layer.register_full_backward_pre_hook(lambda *_, index=index: events.append(f"backward {index}"))
    in_flight: list[tuple[int, list[str], bool]] = []
    for index, layer in enumerate(layers[:2]):  # what is travelling as units 0 and 1 start their backward
        def look(*_: object, index: int = index) -> None:
            travelling = [unit_of[id(unit)] for unit, _ in engine._reductions]
            gradless = all(shard.grad is None for shard in engine.units[index + 1].shards)
            in_flight.append((index, travelling, gradless))
        layer.register_full_backward_pre_hook(look)
    hooks = {id(shard): 0 for shard in model.parameters()}
    for shard in model.parameters():
        shard.register_post_accumulate_grad_hook(lambda s: hooks.__setitem__(id(s), hooks[id(s)] + 1))

    x = torch.randn(5, 6, requires_grad=True)
    model(x).square().sum().backward()  # the first forward records the order
    events.clear()
    in_flight.clear()
    for shard in model.parameters():
        shard.grad = None
        hooks[id(shard)] = 0
    model(x).square().sum().backward()
    forward = events[:events.index("backward 2")]
    # a unit's own pre-hook starts the next one's gather before it computes; the forward's end, the last unit's
    assert forward == ["gather root", "gather 0", "gather 1", "forward 0", "gather 2", "forward 1", "forward 2",
                       "gather 2"]
    backward = events[len(forward):]
    assert backward == ["backward 2", "gather 1", "backward 1", "gather 0", "backward 0"]  # nothing waits to gather
    assert in_flight == [(1, ["2"], True), (0, ["1"], True)]  # unit k's reduction behind unit k - 1's backward
    assert not engine._reductions and set(hooks.values()) == {1}, hooks
    plain(x).square().sum().backward()
    for (name, expected), shard in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(shard.grad, expected.grad.reshape(-1), msg=name)


def test_a_forward_without_gradients_finishes_the_gathers_it_started(one_process_group):
    """Validation (no grad): the prefetched units are used and released; nothing is left in flight."""
    model = build_deferred(blocks)
    engine = UnevenShardedModel(model, list(model)[:3], (1.0,), 0, torch.device("cpu"), torch.device("cpu"), True,
                                None)
    x = torch.randn(5, 6)
    model(x).sum().backward()  # records the order
    with torch.no_grad():
        expected = blocks()(x)
        torch.testing.assert_close(model(x), expected)
    assert not any(unit.is_gathered() or unit._gathering is not None for unit in engine.units)
