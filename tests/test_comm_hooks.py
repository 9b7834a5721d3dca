"""--ddp-comm-hook: torch's gradient compression in replicated training, and the ``comm |`` line.

Real gloo groups throughout, one hetfair-train command per rank (batches 8 and 24,
``--update-freq 2``: updates of 64 samples). Each lossy mode's loss trajectory is
compared with plain PyTorch SGD in fp32 on the same updates (:func:`reference_losses`),
and a run stopped and resumed from its checkpoint with one that was not.
"""

from __future__ import annotations

import json
from dataclasses import replace
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import TOY_PLUGIN, final_parameters, free_port, rank_flags, run_nodes, subprocess_env
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.launch.rendezvous import SECRET_ENV
from comm_reference import CPU, builtin_link as LinkMeasurement
from hetfair.parallel.comm_advice import BOUND_RATIO, CommAdvisor, advise, fit_outer_loop
from hetfair.parallel.powersgd import AUTO_RANKS, PowerSGD
from hetfair_cli.train import main as train_main
from multi_host import start_on
from toy_plugin import Blobs, ToyMLP
from toy_reference import LR, SEED, TRAIN_SIZE, toy_train_args

BATCHES = [8, 24]
UPDATE_SIZE = 64  # 8 + 24 samples per step, --update-freq 2
UPDATES = 8  # two epochs of 200 samples: three updates of 64 and one of 8 each

TRACKING = {"fp16": 3e-3, "bf16": 3e-3, "powersgd": 0.03}
"""Largest |loss - fp32 reference loss| over the 8 updates, per mode.

A loss here moves by 0.01-0.2 per update, 0.45 over the run. fp16 and bf16 round each
gradient once before the sum and once after it (relative error at most 2**-11 and 2**-9
each), so an update's step is off by at most 0.1% and 0.4%: a few 1e-4 of loss per
update, ~3e-3 after 8 if every error added up (measured: 4e-5 and 1.3e-4). The fp16
case also runs the forward in fp16 (``--fp16``), ~1e-3 of the loss (the mixed-precision
tests). PowerSGD sends a rank-2 approximation of the 16x8 weight from the fourth update
on; error feedback adds what it left out to the next gradient, so the parameters trail
the exact ones by about what one update left out, not by what all of them did: a tenth
of the run's loss drop bounds that (measured: 3e-3); without error feedback, or with
state lost on resume, the truncation accumulates.
"""

MODE_FLAGS = {
    "fp16": ("--fp16", "--zero-sharding", "os"),  # with loss scaling and ZeRO-1
    "bf16": (),
    # DDP's first update has one bucket, its rebuilt buckets two, in another order: resuming has to carry
    # the state from one layout to the other
    "powersgd": ("--powersgd-rank", "2", "--powersgd-start-update", "3", "--zero-sharding", "os",
                 "--bucket-cap-mb", "0.0002"),
}


def reference_losses(update_size: int) -> list[float]:
    """Plain PyTorch fp32: each update's mean cross-entropy (before its step), SGD over consecutive chunks of
    each epoch's order, as the toy task's epochs run."""
    torch.manual_seed(SEED)
    model = ToyMLP(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = Blobs(TRAIN_SIZE, seed=0)
    losses = []
    for epoch in (1, 2):
        order = np.random.default_rng([SEED, epoch]).permutation(TRAIN_SIZE)
        for start in range(0, TRAIN_SIZE, update_size):
            indices = torch.as_tensor(order[start : start + update_size])
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data.inputs[indices]), data.labels[indices])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def launch(save_dir: Path, *extra: str, batches: tuple[int, ...] = tuple(BATCHES)) -> list[str]:
    """Train the toy task with one command per rank; every rank's stderr (rank 0's has the json log)."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    commands = [toy_train_args(save_dir, 2, ("--log-format", "json", "--log-interval", "1", *extra))
                + ["--max-sentences", str(batch), *rank_flags(rank, len(batches), init_method)]
                for rank, batch in enumerate(batches)]
    results = run_nodes(commands, cwd=save_dir.parent)
    for result in results:
        assert result.returncode == 0, result.stderr
    return [result.stderr for result in results]


def records(stderr: str, phase: str = "train_inner") -> list[dict]:
    return [r for r in (json.loads(line) for line in stderr.splitlines() if line.startswith("{"))
            if r["phase"] == phase]


def comm_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("comm | ")]


@pytest.mark.parametrize("mode", ["fp16", "bf16", "powersgd"])
def test_lossy_mode_tracks_fp32_and_resumes_exactly(tmp_path, mode):
    flags = ("--ddp-comm-hook", mode, *MODE_FLAGS[mode])
    full = launch(tmp_path / "full", *flags)
    losses = [r["loss"] for r in records(full[0])]
    expected = reference_losses(UPDATE_SIZE)
    assert len(losses) == len(expected) == UPDATES
    assert max(abs(a - b) for a, b in zip(losses, expected)) < TRACKING[mode], (losses, expected)
    [line] = comm_lines(full[0])  # every replicated run of several processes says how its link fares
    assert f"this run uses {mode} (lossy)" in line or f"the mode predicted fastest, {mode} (lossy)" in line

    resumed = tmp_path / "resumed"
    launch(resumed, *flags, "--max-update", "5")  # inside the second epoch, PowerSGD compressing since update 4
    midway = load_checkpoint(resumed / "checkpoint_last.pt")
    assert ("comm" in midway) == (mode == "powersgd")  # fp16 and bf16 keep no state
    second = launch(resumed, *flags)
    assert "starts afresh" not in second[0]
    expected_params = final_parameters(tmp_path / "full")
    for name, value in final_parameters(resumed).items():
        assert torch.equal(value, expected_params[name]), name
    if mode == "powersgd":
        assert_each_ranks_powersgd_state(midway["comm"], updates=5)


def test_powersgd_rank_auto_chooses_once_and_a_resumed_run_keeps_the_choice(tmp_path):
    """``--powersgd-rank auto`` all-reduces exactly until the advice chooses the rank (after update 4), the same as
    that rank given from the start with ``--powersgd-start-update 4``; a run resumed after that keeps the rank and
    continues exactly (three epochs, 10 updates: the resumed run's advice is due at its fourth)."""
    not_the_rank = ("--powersgd-start-update", "4", *MODE_FLAGS["powersgd"][4:], "--max-epoch", "3", "--max-update", "10")
    auto = ("--ddp-comm-hook", "powersgd", "--powersgd-rank", "auto", *not_the_rank)
    resumed = tmp_path / "resumed"
    first = launch(resumed, *auto, "--max-update", "5")
    rank = load_checkpoint(resumed / "checkpoint_last.pt")["comm"]["powersgd_rank"]
    assert rank in AUTO_RANKS
    assert comm_lines(first[0])[0].startswith(f"comm | --powersgd-rank auto: rank {rank}")
    second = launch(resumed, *auto)
    assert f"comm | --powersgd-rank auto: rank {rank}, kept from the checkpoint" in comm_lines(second[0])
    assert "starts afresh" not in second[0]
    launch(tmp_path / "given", "--ddp-comm-hook", "powersgd", "--powersgd-rank", str(rank), *not_the_rank)
    expected = final_parameters(tmp_path / "given")
    for name, value in final_parameters(resumed).items():
        assert torch.equal(value, expected[name]), name


def assert_each_ranks_powersgd_state(state: dict, updates: int) -> None:
    assert state["world_size"] == 2 and state["iter"] == updates
    first, second = state["ranks"]
    assert first[0]["error"].shape == (16 * 8,)  # by parameter: Linear(8, 16).weight, whatever DDP's buckets
    assert not torch.equal(first[0]["error"], second[0]["error"])  # each rank's own error feedback
    assert torch.equal(first[0]["q"], second[0]["q"])  # Q is all-reduced: the same on every rank


def test_powersgd_recovers_from_fp16_overflows_and_starts_afresh_with_one_line_when_it_cannot_continue(tmp_path):
    """A loss scale that keeps growing overflows the gradients again and again, also after PowerSGD has
    started; every rank skips those updates and PowerSGD drops the non-finite error feedback. A resume with
    another --powersgd-rank cannot use the saved state: one line says so."""
    save_dir = tmp_path / "ckpt"
    # the scale doubles after every clean update, from just below where the fp16 backward overflows
    flags = ("--ddp-comm-hook", "powersgd", "--powersgd-start-update", "2", "--fp16", "--fp16-init-scale",
             str(2**14), "--fp16-scale-window", "1", "--max-epoch", "10")
    stderr = launch(save_dir, *flags, "--powersgd-rank", "2", "--max-update", str(UPDATES))
    inner = records(stderr[0])
    assert [r["num_updates"] for r in inner] == list(range(1, UPDATES + 1))
    assert sum(r["skipped"] for r in inner[3:]) >= 1  # overflows after PowerSGD started compressing
    assert all(math.isfinite(r["loss"]) for r in inner)
    assert inner[-1]["loss"] < inner[0]["loss"] - 0.15  # still learning: no non-finite error feedback is left

    stderr = launch(save_dir, *flags, "--max-update", str(UPDATES + 1))
    assert ("restore | PowerSGD's error feedback starts afresh (the checkpoint's was of --powersgd-rank 2, this "
            "run has 1); its first 2 updates are exact all-reduces") in stderr[0].splitlines()


# -- pick by measurement --------------------------------------------------------------
LINK = LinkMeasurement(gradient_bytes=4_000_000, all_reduce_seconds=0.4, powersgd_bytes=200_000, nodes=2)


@pytest.mark.parametrize("compute, requested, chosen, says", [
    (1.0, "auto", "none", "not bandwidth-bound: the exact all-reduce (none) fits; auto keeps it"),
    (0.5, "auto", "powersgd", "bandwidth-bound: auto switches on powersgd (lossy), all-reduce ~20 ms"),
    (0.5, "none", "none", "bandwidth-bound: --ddp-comm-hook powersgd (lossy), all-reduce ~20 ms would help; "
                          "this run uses none"),
    (1.0, "bf16", "bf16", "not bandwidth-bound: the exact all-reduce (none) fits; this run uses bf16 (lossy)"),
])
def test_the_advice_follows_the_rule(compute, requested, chosen, says):
    advice = advise(LINK, compute, requested)
    assert advice.bound == (LINK.all_reduce_seconds >= BOUND_RATIO * compute)
    assert advice.chosen == chosen
    assert advice.line() == ("comm | 4 MB of gradients per update | link 10 MB/s | all-reduce 400 ms vs compute "
                             f"{compute * 1e3:.3g} ms per update | {says}")


@pytest.mark.parametrize("all_reduce, compute, nodes, bound", [
    (3.6, 0.74, 2, True), (0.9, 0.50, 2, True), (0.375, 0.36, 4, True), (1.5, 0.32, 4, True), (3.6, 0.38, 2, True),
    (0.0039, 0.0051, 1, False), (0.00808, 0.00619, 1, False), (0.00446, 0.00448, 1, False),
], ids=["mini-2-50M", "mini-2-200M", "tiny-4-200M", "tiny-4-50M", "mini-2-50M-quiet", "loopback-3-issue",
        "loopback-3-a", "loopback-3-b"])
def test_the_rule_agrees_with_the_measured_rows_of_docs_comm_hooks(all_reduce, compute, nodes, bound):
    """docs/comm-hooks.md's table: slow links between nodes, where PowerSGD was 2-11x the exact all-reduce, and
    one machine's loopback processes, where no hook was faster."""
    link = LinkMeasurement(gradient_bytes=1_000_000, all_reduce_seconds=all_reduce, powersgd_bytes=50_000, nodes=nodes)
    advice = advise(link, compute, "none")
    assert advice.bound == bound and advice.suggested == ("powersgd" if bound else "none")
    if nodes == 1:
        assert "not bandwidth-bound (every rank on one node: no network link to spare)" in advice.line()


def test_half_precision_is_advised_where_powersgd_would_not_send_less():
    link = LinkMeasurement(gradient_bytes=4_000, all_reduce_seconds=1.0, powersgd_bytes=3_000, nodes=2)  # biases
    assert advise(link, 0.1, "none").suggested == "bf16"  # bf16 before fp16: the same bytes, fp32's range


def test_the_advice_waits_for_the_third_updates_compute_time_and_comes_once():
    advisor = CommAdvisor(LINK, "auto")
    assert advisor.observe([]) is None  # the first update: no timings yet
    assert advisor.observe([9.0, 9.0]) is None  # the first update's: warm-up work
    assert advisor.observe([5.0, 5.0]) is None  # the second's: DDP's bucket rebuild
    advice = advisor.observe([0.3, 0.5])  # the slowest rank's
    assert advice is not None and advice.compute_seconds == 0.5 and advice.chosen == "powersgd"
    assert advisor.observe([0.1, 0.1]) is None


# PowerSGD on the toy MLP's Linear(8, 16) and Linear(16, 3), 195 numbers: a rank-r P and Q of the first weight are
# 16r + 8r numbers, sent where that halves its 128 (r <= 2); of the second 3 min(r, 3) + 16 min(r, 3), sent where
# that halves its 48 (r = 1); the biases (19) always whole
SENT_BY_RANK = {1: 24 + 19 + 19, 2: 48 + 48 + 19, **{rank: 195 for rank in (4, 8, 16, 32)}}


@pytest.mark.parametrize("budget, rank", [(0.1, 1), (0.4, 1), (0.6, 2), (0.9, 2), (1.0, 32)])
def test_powersgd_rank_auto_takes_the_largest_rank_whose_all_reduce_fits_the_budget(budget, rank):
    hook = PowerSGD({"--powersgd-rank": "auto", "--powersgd-start-update": 3}, CPU, ToyMLP(hidden=16).parameters())
    line = hook.fit_link(1.0, budget)  # the exact all-reduce takes a second
    fitting = [r for r in AUTO_RANKS if SENT_BY_RANK[r] / 195 <= budget]
    assert rank == (fitting[-1] if fitting else 1)
    assert hook.state.matrix_approximation_rank == rank
    assert hook.sent_fraction() == pytest.approx(SENT_BY_RANK[rank] / 195)
    assert line.startswith(f"comm | --powersgd-rank auto: rank {rank}")
    assert (", the lowest: its all-reduce" in line) == (not fitting)
    assert hook.fit_link(1.0, 10.0) is None  # chosen once


def test_the_outer_loop_is_suggested_where_even_the_fastest_hook_takes_several_updates():
    """4 MB of fp32 gradients in 0.4 s between two ranks: each sent 4 MB at 10 MB/s. A round's exchange sends
    4 MB in fp32, 2 MB in bf16 and 1/128 more than 1 and 0.5 MB in int8 and int4 (a 4-byte scale per 128)."""
    exchange = {"fp32": 0.4, "bf16": 0.2, "int8": 0.1 * 132 / 128, "int4": 0.05 * 136 / 128}
    for dtype, seconds in exchange.items():
        assert LINK.outer_seconds(dtype) == pytest.approx(seconds, rel=1e-3)  # whole blocks
    compute = 0.005  # PowerSGD's ~20 ms is 4x: no hook will do
    fit = fit_outer_loop(LINK, compute)
    assert (fit.interval, fit.dtype, fit.fits) == (16, "int4", True)  # int4's 53 ms fits 16 x 5 ms, not 8 x 5
    [verdict, outer] = advise(LINK, compute, "auto").lines()
    assert verdict.endswith("bandwidth-bound: auto switches on powersgd (lossy), all-reduce ~20 ms")
    assert outer == ("comm | even powersgd (lossy) takes ~20 ms, 4x an update's compute: the outer loop fits this "
                     "link, its int4 exchange (~53.1 ms) running behind a round of 16 updates (~80 ms of compute); "
                     "try --ddp-backend diloco --outer-interval 16 --outer-fragments 4 --outer-overlap "
                     "--outer-reduce-dtype int4 in place of --ddp-comm-hook and its flags")
    assert fit_outer_loop(LINK, 0.0001).fits is False  # int4 every 64 updates: 53 ms against 6.4 ms
    assert len(advise(LINK, 0.01, "auto").lines()) == 1  # 20 ms is 2x the compute: PowerSGD will do


def test_a_pipeline_is_suggested_where_its_activations_are_fewer_bytes_than_the_gradients():
    """4 MB of gradients, each rank sending 4 MB in 0.4 s (10 MB/s): a pipeline whose boundary carries 1 MB each
    way takes ~100 ms and is suggested; one carrying 5 MB is not, nor is any on a link that is not the bound."""
    pipelined = replace(LINK, boundary_bytes=1_000_000)
    assert advise(pipelined, 0.1, "none").lines()[-1] == (
        "comm | a pipeline of one stage per node would send 1 MB each way per update (the activations at a stage "
        "boundary, and their gradients back; ~100 ms) against the all-reduce's 4 MB, and stay exact; try "
        "--ddp-backend pipeline --pipeline-stages 2 in place of --ddp-comm-hook and its flags")
    assert not any("pipeline" in line for line in advise(replace(LINK, boundary_bytes=5_000_000), 0.1,
                                                            "none").lines())
    assert not any("pipeline" in line for line in advise(pipelined, 10.0, "none").lines())  # not bandwidth-bound


def test_auto_on_a_slow_link_switches_to_powersgd_and_suggests_the_outer_loop_that_runs_as_typed(make_network,
                                                                                                 tmp_path):
    """Two hosts at 256 kbit/s: a wide toy model's 49 kB of gradients take about 1.5 s, against a few ms of compute.
    auto switches PowerSGD on at its lowest rank (``--powersgd-rank auto``: none fits), whose quarter of the bytes
    still takes over three updates: the outer loop's settings are suggested, and the suggestion runs as typed."""
    network = make_network(2)
    for index in range(2):
        network.shape(index, "256kbit")
    init = f"tcp://{network.hosts[0].address}:29500"
    env = {**subprocess_env(), SECRET_ENV: "the job's secret"}  # a rendezvous other machines can reach

    def train(save_dir: Path, *flags: str) -> str:
        procs = []
        for rank in range(2):
            args = toy_train_args(save_dir, 1, ("--toy-hidden", "1024", *flags, "--log-format", "simple"))
            procs.append(start_on(network, rank, [*args, "--max-sentences", "16", *rank_flags(rank, 2, init)],
                                  tmp_path, env))
        errors = [proc.communicate(timeout=240)[1] for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0], errors
        return errors[0]

    comm_flags = ("--ddp-comm-hook", "auto", "--powersgd-rank", "auto", "--powersgd-start-update", "2")
    lines = comm_lines(train(tmp_path / "ckpt", *comm_flags, "--max-update", "5"))
    assert len(lines) == 3, lines
    rank_line, verdict, outer = lines
    assert re.fullmatch(r"comm \| --powersgd-rank auto: rank 1, the lowest: its all-reduce ~.* ms is longer than "
                        r".* ms, half an update's compute", rank_line), rank_line
    assert re.fullmatch(r"comm \| 0.0492 MB of gradients per update \| link .* MB/s \| all-reduce .* ms vs compute "
                        r".* ms per update \| bandwidth-bound: auto switches on powersgd \(lossy\), all-reduce "
                        r"~.* ms", verdict), verdict
    state = load_checkpoint(tmp_path / "ckpt" / "checkpoint_last.pt")["comm"]
    assert state["mode"] == "powersgd" and state["iter"] == 5 and state["powersgd_rank"] == 1
    assert set(state["ranks"][0]) == {0, 1, 2, 3}  # compressing: every parameter has its error feedback

    # a toy update computes in ~2 ms: even int4 every 64 updates may outlast a round, and the line then says so
    suggested = re.fullmatch(r"comm \| even powersgd \(lossy\) takes ~.* ms, .*x an update's compute: (the outer loop "
                             r"fits this link,|even the outer loop's least) .*; try (--ddp-backend diloco .*) in place "
                             r"of --ddp-comm-hook and its flags", outer)
    assert suggested, outer
    train(tmp_path / "outer", *suggested[2].split())  # the toy run's two epochs: rounds also end at epoch ends
    outer = load_checkpoint(tmp_path / "outer" / "checkpoint_last.pt")["trainer"]["optimizer"]["outer_loop"]
    assert outer["outer"]["state"]  # the outer momentum buffers: its rounds met


def test_a_strategy_without_ddp_refuses_a_comm_hook_in_one_line(tmp_path, capsys):
    code = train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-epoch", "1", "--save-dir",
                       str(tmp_path / "c"), "--ddp-backend", "fully_sharded", "--ddp-comm-hook", "bf16"])
    assert code == 2
    assert capsys.readouterr().err == ("hetfair-train: error: --ddp-comm-hook needs --ddp-backend c10d (this command "
                                       "has --ddp-backend fully_sharded)\n")
