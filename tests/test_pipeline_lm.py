"""``--ddp-backend pipeline`` trains the causal LM as the plain single-process PyTorch loop does: 2 and 3 stages,
even and uneven splits, 1F1B, GPipe and interleaved, with a data-parallel dimension whose pipelines take
different batch sizes and micro-batch counts; its checkpoint is the plain model's and resumes on another split.

The reference is test_lm_distributed's plain loop (SGD on the mean next-token loss of each update's blocks, in
the epoch's seeded order); the tied output projection (the token embeddings, on the first and the last stage)
must stay one parameter.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import final_parameters, free_port, rank_flags, run_nodes
from lm_helpers import small_corpus
from multi_host import node_env, start_on
from test_lm_distributed import BLOCK, LR, SEED, reference_parameters

LAYERS = 4
UPDATE_FREQ = 2
ARCH = ["--arch", "gpt_tiny", "--tokens-per-sample", str(BLOCK), "--decoder-embed-dim", "32", "--decoder-layers",
        str(LAYERS), "--decoder-attention-heads", "2", "--decoder-ffn-embed-dim", "64", "--dropout", "0",
        "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    tmp = tmp_path_factory.mktemp("pipeline_lm")
    return small_corpus(tmp)


def job(tmp_path: Path, data: Path, name: str, blocks: list[int], flags: list[list[str]], *extra: str,
        max_epoch: int = 1) -> list[list[str]]:
    """One hetfair-train command per rank: rank r takes ``blocks[r]`` blocks per micro-batch and its ``flags[r]``."""
    common = ["--task", "language_modeling", "--data", str(data), *ARCH, "--optimizer", "sgd", "--lr", str(LR),
              "--lr-scheduler", "fixed", "--seed", str(SEED), "--max-epoch", str(max_epoch), "--update-freq",
              str(UPDATE_FREQ), "--save-dir", str(tmp_path / name), "--no-epoch-checkpoints", "--log-format", "none",
              "--distributed-timeout", "120", *extra]
    init = f"tcp://127.0.0.1:{free_port()}"
    return [[*common, "--max-tokens", str(BLOCK * count), *own, *rank_flags(rank, len(blocks), init)]
            for rank, (count, own) in enumerate(zip(blocks, flags))]



def pipeline(stages: int, *extra: str) -> list[str]:
    return ["--ddp-backend", "pipeline", "--pipeline-stages", str(stages), *extra]


CASES = {  # name: per-rank blocks per micro-batch, per-rank flags; every case 12 blocks per step, as the reference
    # the first stage recomputes its layers' activations in the backward, the second keeps them
    "two_stages_1f1b": ([12, 12], [pipeline(2, "--pipeline-microbatches", "4", "--activation-checkpointing", on)
                                   for on in ("1", "0")]),
    "three_uneven_gpipe": ([12] * 3, [pipeline(3, "--pipeline-split", "1,2,1", "--pipeline-schedule", "gpipe",
                                               "--pipeline-microbatches", "3")] * 3),
    "interleaved": ([12, 12], [pipeline(2, "--pipeline-schedule", "interleaved", "--pipeline-microbatches", "4")] * 2),
    "auto_split": ([12, 12], [pipeline(2, "--pipeline-split", "auto", "--pipeline-microbatches", "2",
                                       "--log-format", "simple")] * 2),
    # two pipelines of two stages (--pipeline-layout across: ranks 0, 2 and 1, 3), 4 and 8 blocks, 2 and 4
    # micro-batches
    "two_pipelines_uneven": ([4, 8, 4, 8], [pipeline(2, "--pipeline-split", "3,1", "--pipeline-microbatches", m)
                                            for m in ("2", "4", "2", "4")]),
}


def test_every_split_schedule_and_data_parallel_shape_trains_as_the_plain_loop(tmp_path, corpus):
    data, docs = corpus
    jobs = [command for name, (blocks, flags) in CASES.items() for command in job(tmp_path, data, name, blocks, flags)]
    results = run_nodes(jobs, cwd=tmp_path, timeout=300)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    auto = next(result for result in results if "auto" in result.args)  # rank 0 of the auto_split job
    stages = [line for line in auto.stderr.splitlines() if "plan | pipeline stage" in line]
    assert len(stages) == 2 and all("ms per micro-batch of 6 (predicted)" in line for line in stages), auto.stderr
    initial, expected = reference_parameters(data, docs, layers=LAYERS)
    moved = max(float((expected[name] - initial[name]).abs().max()) for name in expected)
    assert moved > 1e-2, "the updates must move the parameters far beyond the tolerance"
    for case in CASES:
        got = final_parameters(tmp_path / case)
        assert got.keys() == expected.keys(), case
        for name in expected:  # float32 sums in other orders differ by about 1e-7
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=f"{case}: {name}")


def test_checkpoints_resume_on_another_split_and_to_and_from_replicated_training(tmp_path, corpus):
    """Epoch 1 with a 3,1 split and with plain c10d on one process; epoch 2 resumes each on the other (and the
    pipeline on a 1,3 split); with SGD momentum, so the optimizer state must travel too."""
    data, docs = corpus
    momentum = ["--momentum", "0.9"]
    split = lambda counts: [pipeline(2, "--pipeline-split", counts, "--pipeline-microbatches", "3")] * 2  # noqa: E731
    first = [*job(tmp_path, data, "pipe_3_1", [12, 12], split("3,1"), *momentum),
             *job(tmp_path, data, "c10d", [12], [[]], *momentum)]
    for result in run_nodes(first, cwd=tmp_path, timeout=300):
        assert result.returncode == 0, result.stderr[-2000:]
    restore = lambda name: ["--restore-file", str(tmp_path / name / "checkpoint_last.pt")]  # noqa: E731
    second = {"pipe_1_3": ([12, 12], split("1,3"), "pipe_3_1"), "from_c10d": ([12, 12], split("even"), "c10d"),
              "to_c10d": ([12], [[]], "pipe_3_1")}
    jobs = [command for name, (blocks, flags, source) in second.items()
            for command in job(tmp_path, data, name, blocks, flags, *momentum, *restore(source), max_epoch=2)]
    for result in run_nodes(jobs, cwd=tmp_path, timeout=300):
        assert result.returncode == 0, result.stderr[-2000:]
    _, expected = reference_parameters(data, docs, layers=LAYERS, epochs=2, momentum=0.9)
    for case in second:
        got = final_parameters(tmp_path / case)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=f"{case}: {name}")


def test_each_stage_runs_its_own_precision_under_the_jobs_one_loss_scale(tmp_path, corpus):
    """Stage 0 in bf16, stage 1 in fp16: one loss scale for the job (fp16 is present), the update within
    autocast's rounding of the fp32 loop's. Tolerance 2e-2: the half-precision matmuls round each activation to
    8 (bf16) or 11 (fp16) bits of mantissa, about 4e-3 and 5e-4 relative, and the parameters move by about 0.5
    over the run; a wrong loss scale (gradients off by the scale, 128) or a lost stage's gradient fails it."""
    data, docs = corpus
    flags = [pipeline(2, "--pipeline-microbatches", "4", "--precision", precision) for precision in ("bf16", "fp16")]
    [*results] = run_nodes(job(tmp_path, data, "mixed", [12, 12], flags, "--log-format", "json"), cwd=tmp_path,
                           timeout=300)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    assert '"loss_scale"' in results[0].stdout + results[0].stderr, "fp16 on one stage gives the job a loss scale"
    initial, expected = reference_parameters(data, docs, layers=LAYERS)
    got = final_parameters(tmp_path / "mixed")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=2e-2, atol=2e-2, msg=name)


def test_on_a_slow_link_the_comm_advice_suggests_a_pipeline_that_runs_as_typed(make_network, tmp_path, corpus):
    """Two hosts at 2 Mbit/s: the LM's ~0.1 MB of gradients take far longer than its compute, while its activations
    at a stage boundary are 24 blocks (2 steps of 12) x 16 tokens x 32 floats, 49 kB; the ``comm |`` advice names
    the pipeline, and its flags run as typed across the two hosts."""
    data, _ = corpus
    network = make_network(2)
    for index in range(2):
        network.shape(index, "2mbit")
    init = f"tcp://{network.hosts[0].address}:29500"

    def train(name: str, *flags: str) -> str:
        commands = [[*command[:command.index("--distributed-world-size")], *rank_flags(rank, 2, init), *flags,
                     "--log-format", "simple"]
                    for rank, command in enumerate(job(tmp_path, data, name, [12, 12], [[], []], max_epoch=3))]
        procs = [start_on(network, rank, command, tmp_path, node_env()) for rank, command in enumerate(commands)]
        errors = [proc.communicate(timeout=240)[1] for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0], errors
        return errors[0]

    stderr = train("c10d")
    lines = [line for line in stderr.splitlines() if line.startswith("comm | ")] or ["none"]
    suggested = re.fullmatch(r"comm \| a pipeline of one stage per node would send 0.0492 MB each way per update "
                             r"\(.*\) against the all-reduce's .* MB, and stay exact; try (--ddp-backend pipeline "
                             r"--pipeline-stages 2) in place of --ddp-comm-hook and its flags", lines[-1])
    assert suggested, stderr
    train("pipelined", *suggested[1].split())
    assert (tmp_path / "pipelined" / "checkpoint_last.pt").is_file()
