"""``--ddp-backend pipeline`` trains BERT (masked LM + next-sentence prediction) as a plain PyTorch loop does: two
stages under 1F1B, three stages cut unevenly under GPipe, and two pipelines of two stages that take different batch
sizes and micro-batch counts; and every bad pipeline setup is refused with one line.

The reference is :func:`amp_reference.plain_sgd` (the model built from the same seed, SGD steps on consecutive
global batches of each epoch's seeded order), here on the criterion's documented loss with ``--nsp``: per update,
``sum_i (mlm_i + m_i * nsp_i) / sum_i m_i`` over the update's sentences ``i`` (``mlm_i`` the summed cross-entropy of
sentence i's ``m_i`` masked tokens, ``nsp_i`` its next-sentence cross-entropy), written with plain
``F.cross_entropy`` on the whole global batch collated at once. BERT batches are padded per micro-batch, so a
pipeline runs micro-batches of different padded lengths as separate schedule steps; the update is still exact,
also where two pipelines run different numbers of schedule steps in one update (their stages' replicas must still
sum their gradients once). Every training case starts in one ``run_nodes`` call.

Bad setups are refused with exit code 2 and one line: those the command can see in this process, before any process
starts; those only the processes find (the model, what each process was given) in one ``run_nodes`` call for all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from amp_reference import plain_sgd
from bert_helpers import make_data_dir, write_bert_config
from helpers import TOY_PLUGIN, final_parameters, free_port, rank_flags, run_nodes
from test_mnist_plugin import PLUGIN_DIR, write_mnist_dir

from hetfair.options import parse_train_args
from hetfair_cli.train import main as train_main

LAYERS = 4
SEED, LR, UPDATES, UPDATE_FREQ = 3, 0.5, 3, 2
STEP = 6  # samples per step over all pipelines: 12 per update, as the reference's global batch
MODEL = ["--nsp", "--tokens-per-sample", "32"]


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("pipeline_bert")
    data, _, _ = make_data_dir(tmp, n_docs=120, splits=("train",))
    # No dropout: each stage draws its own masks, so only then do the updates compare.
    config = write_bert_config(tmp / "c.json", num_hidden_layers=LAYERS, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
    return data, config


def model_flags(data: Path, config: Path) -> list[str]:
    return ["--task", "bert", "--data", str(data), "--config_file", str(config), *MODEL, "--seed", str(SEED)]


def nsp_loss(task: Any, model: torch.nn.Module, indices: np.ndarray) -> torch.Tensor:
    """The update's loss: masked-token-weighted MLM + NSP of the whole global batch, divided by its masked tokens."""
    dataset = task.dataset("train")
    sample = task.collater([dataset[int(i)] for i in indices])
    target = sample["target"]
    masked = target != -100
    output = model(**sample["net_input"], masked_tokens=masked)
    mlm = F.cross_entropy(output["mlm_logits"].float(), target[masked], reduction="sum")
    nsp = F.cross_entropy(output["nsp_logits"].float(), sample["nsentence_labels"], reduction="none")
    return (mlm + (masked.sum(dim=1) * nsp).sum()) / masked.sum()


def reference(data: Path, config: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    args = parse_train_args([*model_flags(data, config), "--max-sentences", "1", "--lr", str(LR)])
    return plain_sgd(args, UPDATES, STEP * UPDATE_FREQ, nsp_loss)


def job(tmp_path: Path, data: Path, config: Path, name: str, batches: list[int],
        flags: list[list[str]]) -> list[list[str]]:
    """One hetfair-train command per rank: rank r takes ``batches[r]`` samples per step and its ``flags[r]``."""
    common = [*model_flags(data, config), "--optimizer", "sgd", "--lr", str(LR), "--lr-scheduler", "fixed",
              "--max-update", str(UPDATES), "--update-freq", str(UPDATE_FREQ), "--save-dir", str(tmp_path / name),
              "--no-epoch-checkpoints", "--disable-validation", "--log-format", "none", "--distributed-timeout", "60"]
    init = f"tcp://127.0.0.1:{free_port()}"
    return [[*common, "--max-sentences", str(batch), *own, *rank_flags(rank, len(batches), init)]
            for rank, (batch, own) in enumerate(zip(batches, flags))]


def pipeline(stages: int, *extra: str) -> list[str]:
    return ["--ddp-backend", "pipeline", "--pipeline-stages", str(stages), *extra]


CASES = {  # name: stages, each pipeline's samples per step (adding up to STEP) and micro-batches, flags for all
    "two_stages_1f1b": (2, [6], [2], ["--pipeline-schedule", "1f1b"]),
    "three_uneven_gpipe": (3, [6], [3], ["--pipeline-split", "1,2,1", "--pipeline-schedule", "gpipe"]),
    "two_pipelines_uneven": (2, [2, 4], [2, 4], []),  # one sample per micro-batch in both pipelines
}
"""Padded per micro-batch, some updates' micro-batches share a length and run as one schedule step of 2 or 3
(1F1B proper on two stages), the others one at a time (measured with these seeds and data)."""


def rank_options(stages: int, samples: list[int], microbatches: list[int], flags: list[str]
                 ) -> tuple[list[int], list[list[str]]]:
    """Per-rank --max-sentences and flags. --pipeline-layout across (the default): pipeline p holds ranks p, P + p,
    2P + p, ... (P pipelines), so two pipelines of two stages are ranks 0, 2 and 1, 3."""
    pipes = len(samples)
    ranks = range(stages * pipes)
    return ([samples[rank % pipes] for rank in ranks],
            [pipeline(stages, "--pipeline-microbatches", str(microbatches[rank % pipes]), *flags) for rank in ranks])


def test_every_schedule_split_and_data_parallel_shape_trains_bert_as_the_plain_loop(tmp_path, bert_data):
    data, config = bert_data
    assert all(sum(samples) == STEP for _, samples, _, _ in CASES.values())  # the reference's global batch
    assert all(size % count == 0 for _, samples, counts, _ in CASES.values() for size, count in zip(samples, counts))
    jobs = [command for name, case in CASES.items() for command in job(tmp_path, data, config, name,
                                                                       *rank_options(*case))]
    results = run_nodes(jobs, cwd=tmp_path, timeout=300)
    failed = [f"{command[command.index('--save-dir') + 1]} rank {command[command.index('--distributed-rank') + 1]}: "
              f"{result.stderr[-2000:]}" for command, result in zip(jobs, results) if result.returncode]
    assert not failed, "\n".join(failed)
    initial, expected = reference(data, config)
    moved = max(float((expected[name] - initial[name]).abs().max()) for name in expected)
    assert moved > 1e-2, "the updates must move the parameters far beyond the tolerance"
    for case in CASES:
        got = final_parameters(tmp_path / case)
        assert got.keys() == expected.keys(), case
        for name in expected:  # float32 sums in other orders differ by about 1e-7
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=f"{case}: {name}")


# -- bad input: one line, exit code 2 ---------------------------------------------------------------------------

TWO = ["--distributed-world-size", "2"]  # one command, two local processes

EARLY = {  # refused before any process starts: (flags, what the line names)
    "world_not_a_multiple": ([*pipeline(3), *TWO], ("--pipeline-stages 3", "2 processes")),
    "split_wrong_count": ([*pipeline(2, "--pipeline-split", "1,2,1"), *TWO], ("--pipeline-split 1,2,1:", "like 2,2")),
    "split_not_numbers": ([*pipeline(2, "--pipeline-split", "2,x"), *TWO], ("--pipeline-split 2,x:",)),
    "stages_without_pipeline": (["--pipeline-stages", "2", *TWO], ("--pipeline-stages needs --ddp-backend pipeline",)),
    "live_fault_tolerance": ([*pipeline(2), *TWO, "--fault-tolerance", "live"],
                             ("--fault-tolerance live", "--ddp-backend pipeline")),
}


def bad_command(save_dir: Path, data: Path, config: Path, *flags: str) -> list[str]:
    return [*model_flags(data, config), "--optimizer", "sgd", "--lr", str(LR), "--max-update", "1",
            "--max-sentences", "4", "--disable-validation", "--log-format", "none", "--distributed-timeout", "60",
            "--save-dir", str(save_dir), *flags]


@pytest.mark.parametrize("case", EARLY)
def test_a_bad_pipeline_option_is_one_line_before_anything_starts(tmp_path, capsys, bert_data, case):
    flags, names = EARLY[case]
    save_dir = tmp_path / "ckpt"
    code = train_main(bad_command(save_dir, *bert_data, *flags))
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("hetfair-train: error: ") and all(name in err for name in names), err
    assert not save_dir.exists()


def late_cases(tmp: Path, data: Path, config: Path) -> dict[str, tuple[list[list[str]], tuple[str, ...]]]:
    """Refused once the processes meet: name -> (one command per process, what every process's line names)."""
    one_layer = write_bert_config(tmp / "one_layer.json", num_hidden_layers=1, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    (tmp / "mnist").mkdir()
    mnist = write_mnist_dir(tmp / "mnist")

    def command(name: str, *flags: str, model: tuple[Path, Path] = (data, config)) -> list[str]:
        return bad_command(tmp / name, *model, *flags)

    def ranks(name: str, per_rank: list[list[str]]) -> list[list[str]]:
        init = f"tcp://127.0.0.1:{free_port()}"
        return [command(name, *flags, *rank_flags(rank, len(per_rank), init)) for rank, flags in enumerate(per_rank)]

    unpipelined = ["--optimizer", "sgd", "--lr", "0.1", "--max-update", "1", "--max-sentences", "4",
                   "--log-format", "none", "--distributed-timeout", "60", *pipeline(2), *TWO]
    return {
        "more_stages_than_layers": ([command("layers", *pipeline(2), *TWO, model=(data, one_layer))],
                                    ("--ddp-backend pipeline", "2 stages", "BertModel has 1")),
        "microbatches_differ_in_a_pipeline": (ranks("micro", [pipeline(2, "--pipeline-microbatches", m)
                                                              for m in ("2", "4")]),
                                              ("--pipeline-microbatches", "2 on rank 0, 4 on rank 1")),
        "max_sentences_differ_in_a_pipeline": ([command("sentences", *pipeline(2), *TWO, "--max-sentences", "2,4")],
                                               ("--max-sentences", "2 on rank 0, 4 on rank 1")),
        "auto_balance": ([command("balance", *pipeline(2), *TWO, "--auto-balance")],
                         ("--auto-balance", "--ddp-backend pipeline")),
        "compile": ([command("compile", *pipeline(2), *TWO, "--compile")], ("--compile", "--ddp-backend pipeline")),
        "mnist_plugin_model": ([["--user-dir", str(PLUGIN_DIR), "--task", "mnist", "--arch", "mnist_mlp", "--data",
                                 str(mnist), "--save-dir", str(tmp / "mnist_ckpt"), *unpipelined]],
                               ("--ddp-backend pipeline", "MnistMLP")),
        "model_without_stages": ([["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--toy-units", "--save-dir",
                                   str(tmp / "toy_ckpt"), *unpipelined]], ("--ddp-backend pipeline", "ToyMLP")),
    }


LATE = ["more_stages_than_layers", "microbatches_differ_in_a_pipeline", "max_sentences_differ_in_a_pipeline",
        "auto_balance", "compile", "mnist_plugin_model", "model_without_stages"]


@pytest.fixture(scope="module")
def late_results(tmp_path_factory: pytest.TempPathFactory, bert_data) -> dict[str, tuple[list[Any], tuple[str, ...]]]:
    """Every late case started at once (one run_nodes call): name -> (its processes' results, what the line names)."""
    tmp = tmp_path_factory.mktemp("pipeline_bert_bad")
    cases = late_cases(tmp, *bert_data)
    assert list(cases) == LATE
    commands = [command for processes, _ in cases.values() for command in processes]
    results = iter(run_nodes(commands, cwd=tmp, timeout=120))
    return {name: ([next(results) for _ in processes], names) for name, (processes, names) in cases.items()}


@pytest.mark.parametrize("case", LATE)
def test_a_bad_pipeline_setup_found_by_the_processes_is_one_line(late_results, case):
    """Each process of the case (a command's spawned ranks report as one) ends with exit code 2 and one line."""
    results, names = late_results[case]
    for result in results:
        err = result.stderr
        assert result.returncode == 2, err[-3000:]
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err[-3000:]
        assert err.startswith("hetfair-train: error: [rank ") and all(name in err for name in names), err
