"""A pipeline across slow links: ``--ddp-backend pipeline`` against DDP, a compressed all-reduce and the outer loop.

What it measures. On emulated hosts joined by shaped links, the same model trained by each contender:

* ``ddp``: ``hetfair-train`` with its defaults (``--ddp-backend c10d``: DDP's exact fp32 all-reduce, the
  model's whole fp32 gradient crosses the links every update; plain DDP for the goals);
* optionally ``torch-ddp`` (``--modes torch-ddp``, BERT only): bench_links.py's plain PyTorch loop with DDP;
* one row per mode of ``--modes``, by name from bench_links.py's ``MODES`` (default ``powersgd``: a rank-4
  PowerSGD all-reduce hook, exact for its first 2 updates; and ``diloco``: the outer loop,
  ``--ddp-backend diloco --outer-interval 4``, the fp32 parameters exchanged every 4 updates);
* ``pipeline``: ``--ddp-backend pipeline --pipeline-stages N`` with one process per host and N = the hosts,
  so the model is cut into N stages (``--pipeline-split auto``: layers by the hosts' measured speed, the
  output layers counted with the last stage; ``--pipeline-layout across``), stage s on host s, and only the
  activations at the stage boundaries cross the links (``bert_mini``: 0.5 MB per micro-batch of 4 x 128
  tokens each way, against a 21.7 MB fp32 gradient at this vocabulary). Its one
  pipeline trains each update's whole global batch (``--max-sentences`` N x ``--batch``, cut into
  ``--microbatches`` micro-batches, default 2N, schedule 1F1B),

so that every contender trains N x ``--batch`` samples per update, the same number of samples in all, with
the same optimizer (AdamW, 4 warm-up updates then linear decay, clip 1.0), seed and number of updates.

Models: ``bert_*`` (task ``bert``, masked LM) and ``gpt_*`` (task ``language_modeling``, causal LM), both on the
Jargon File (Debian's jargon-text; the same train/valid documents; BERT: WordPiece 8,000 as bench_links.py
preprocesses it; LM: ``hetfair-preprocess --task language_modeling``, byte-level BPE 8,192), 128-token samples.

How: bench_links.py's machinery, imported, not copied. Every host is a network namespace (tests/netns.py), its
link limited by ``tc tbf`` in both directions (no added delay), one training process per host with
``OMP_NUM_THREADS=--threads``. Samples/s are clocked from outside between rank 0's first and last progress
line (start-up and the first ``--interval`` updates excluded; samples from hetfair's logged ``bsz``). Loss:
of the final model (rank 0's checkpoint, which holds the whole model in every mode, the pipeline's too) on 8
fixed validation batches, by one function for every contender (BERT: bench_links.py's masked-LM
cross-entropy; LM: next-token cross-entropy, nats), so after equal samples. Efficiency: the job's samples/s
over the sum of the hosts' single-host samples/s, measured with every host's ``hetfair-train`` running at
once without communication (world size 1 each, sharing the CPUs as in the job), before and after each
table's contenders, the mean used. A contender that fails is a ``failed`` row with its reason below the
table (the error of the process that failed, not only rank 0's), and the tables go on.

Output: per (model, hosts, rate) a table of contender, kind, samples/s, efficiency, x ddp, samples, loss and
loss vs ddp, and the goals' ratios: pipeline / ddp (goal >= 3 at 100 Mbit/s), pipeline / best lossless mode
(``ddp``, ``torch-ddp``; goal >= 1.5 at 100 Mbit/s), pipeline / best compressed mode, pipeline / outer loop.
Then the pairs of unequal speeds: 2 hosts whose CPU quotas are ``--pair-speeds`` (bench_links.py's
``--speeds`` cgroups; 1,2: host 0 gets half host 1's CPU; host 0 runs the first stage, host 1 the last,
which holds the model's head), link ``--pair-rate``, per ``--pair-archs`` model and speed pair a table of
the pipeline under each of ``--pair-splits``: ``even``, ``proportional`` (layers in proportion to the
speeds, more on the fast host: 1,3 for 4 layers at 1,2; 3,1 at 2,1) and ``auto`` (hetfair's own split);
goal: the best uneven split >= 1.3x the even one. A summary of every goal line ends the output, with the
machine's load (``uptime``) at the start and end.

Commands (as root, for the namespaces and cgroups; the Jargon File: ``apt-get install jargon-text``):

    .venv/bin/python benchmarks/bench_pipeline.py --quick    # bert_mini, 2 hosts, 100 Mbit/s, 8 updates, ddp
                                                             # against the pipeline: 2-3 minutes (busy 2 cores)
    .venv/bin/python benchmarks/bench_pipeline.py --quick --archs gpt_mini   # the same for the causal LM
    .venv/bin/python benchmarks/bench_pipeline.py            # the full matrix: bert_mini and gpt_mini x 2 and 4
                                                             # hosts x 100 Mbit/s and 1 Gbit/s x ddp, powersgd,
                                                             # diloco, pipeline; then the pairs 1,2 and 2,1 for
                                                             # both models: about 1-1.5 hours; run it quiet
    .venv/bin/python benchmarks/bench_pipeline.py --dry-run  # every command of the full matrix, each checked by
                                                             # hetfair-train's parser; runs nothing (seconds)
    .venv/bin/python benchmarks/bench_pipeline.py --smoke    # every contender kind on both tasks, tiny
                                                             # (bert_tiny, gpt_tiny, 2 hosts, 1 Gbit/s, 6
                                                             # updates) and the pairs at 1,2: ~10 minutes
    .venv/bin/python benchmarks/bench_pipeline.py --pair-only --pair-archs bert_mini --pair-speeds 1,2  # one pair

``--workdir DIR`` keeps the preprocessed data across runs (``DIR/data`` for BERT, ``DIR/lm/data`` for the LM;
preprocessing both takes about 20 s).
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.bench_links import (  # noqa: E402
    BURST,
    MODES,
    VALID_BATCHES,
    CpuLimits,
    Result,
    Setting,
    hetfair_command,
    known_modes,
    link_throughput,
    plain_command,
    prepare_data,
    run_job,
    single_node_speeds,
)
from benchmarks.common import machine_note  # noqa: E402
from hetfair.parallel.pipeline_split import even_split  # noqa: E402
from netns import Network, unavailable  # noqa: E402

TOKENS = 128
"""Tokens per sample (block) of both tasks."""
LM_VOCAB = 8192
TORCH_DDP = "torch-ddp"
OUTER = ("diloco", "localsgd")
"""``--ddp-backend`` values of the outer loop: a MODES entry with one of them is an outer-loop row."""
WARMUP = 4
"""Warm-up updates of the learning rate (bench_links.py's BERT flags; the LM's the same)."""
GOALS = {"pipeline/ddp": 3.0, "pipeline/best lossless": 1.5, "uneven/even": 1.3}


# -- the settings of both tasks ---------------------------------------------------------------
@dataclass(frozen=True)
class BertSetting(Setting):
    """bench_links.py's BERT setting with this benchmark's block length (its flags, its loss)."""

    task: str = "bert"

    def flags(self, save_dir: Path) -> list[str]:
        return [*super().flags(save_dir), "--tokens-per-sample", str(TOKENS)]


@dataclass(frozen=True)
class LMSetting(Setting):
    """The causal LM (``gpt_*``) with the same optimizer as bench_links.py's BERT setting; bench_links.py's
    ``valid_loss`` and so ``run_job`` use :meth:`valid_loss`."""

    task: str = "language_modeling"

    def flags(self, save_dir: Path) -> list[str]:
        return ["--task", "language_modeling", "--data", str(self.data), "--arch", self.arch, "--tokens-per-sample",
                str(TOKENS), "--max-sentences", str(self.batch), "--optimizer", "adamw", "--lr", "5e-4",
                "--lr-scheduler", "polynomial_decay", "--warmup-updates", str(WARMUP), "--total-num-update",
                str(self.updates), "--clip-norm", "1.0", "--max-update", str(self.updates), "--save-dir",
                str(save_dir), "--disable-validation", "--seed", "1"]

    def valid_loss(self, state: dict[str, torch.Tensor]) -> float:
        """Mean next-token cross-entropy (nats) on the first validation batches (padding not counted)."""
        task, model = build(self)
        model.load_state_dict(state)
        model.eval()
        dataset = task.dataset("valid")
        total, count = 0.0, 0
        with torch.no_grad():
            for index in range(VALID_BATCHES):
                sample = task.collater([dataset[(index * self.batch + j) % len(dataset)] for j in range(self.batch)])
                logits = model(**sample["net_input"])
                target = sample["target"]
                total += F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=task.pad_index,
                                         reduction="sum").item()
                count += int((target != task.pad_index).sum())
        return total / count


def make_setting(arch: str, options: argparse.Namespace, data: dict[str, Path],
                 speeds: tuple[float, ...] = ()) -> Setting:
    kind = LMSetting if arch.startswith("gpt") else BertSetting
    return kind(arch, options.batch, options.updates, options.interval, options.threads,
                data["lm" if kind is LMSetting else "bert"], speeds)


def build(setting: Setting) -> tuple[object, torch.nn.Module]:
    """The task and a freshly built model of ``setting`` (seeded as the runs are)."""
    from hetfair.options import parse_train_args
    from hetfair.tasks import TASK_REGISTRY

    args = parse_train_args(setting.flags(Path("unused")))
    task = TASK_REGISTRY.get(setting.task).setup_task(args)
    torch.manual_seed(1)
    return task, task.build_model(args)


def model_sizes(setting: Setting, microbatch: int) -> tuple[int, float, float]:
    """The model's sharding units (layers), its fp32 gradient in MB, and the MB one micro-batch of ``microbatch``
    samples sends across a stage boundary each way (the shapes the model's own pipeline stage declares)."""
    task, model = build(setting)
    units = len(model.sharding_units())
    grad = sum(p.numel() for p in model.parameters()) * 4 / 1e6
    dataset = task.dataset("valid")
    sample = task.collater([dataset[j % len(dataset)] for j in range(max(microbatch, 1))])
    activation = float("nan")
    stage = model.pipeline_stage(range(0, 1), first=True, last=units == 1)
    if stage is not None and units > 1:
        activation = sum(t.numel() * t.element_size() for t in stage.boundary(sample["net_input"])) / 1e6
    return units, grad, activation


def arch_layers(arch: str) -> int:
    """The layers of a registered ``bert_*`` or ``gpt_*`` architecture, without data or a model."""
    import importlib

    sizes = getattr(importlib.import_module("hetfair.lm.model" if arch.startswith("gpt") else "hetfair.bert.model"),
                    arch)()
    return int(sizes.get("decoder_layers", sizes.get("num_hidden_layers", 0)))


# -- data -------------------------------------------------------------------------------------------
def prepare_lm_data(workdir: Path) -> Path:
    """The Jargon File split as bench_links.py splits it (the same train and valid documents), preprocessed for
    the language_modeling task (a byte-level BPE trained on the train split) into ``workdir/lm/data``."""
    from hetfair_cli.preprocess import main as preprocess_main
    from pretrain_bert_jargon import JARGON, write_splits

    data = workdir / "lm" / "data"
    if not (data / "valid.idx").exists():
        if not JARGON.is_file():
            raise SystemExit(f"bench_pipeline: needs the Jargon File at {JARGON} (apt-get install jargon-text)")
        (workdir / "lm").mkdir(parents=True, exist_ok=True)
        train, valid = write_splits(JARGON, workdir / "lm")
        code = preprocess_main(["--task", "language_modeling", "--tokenizer", "bpe", "--vocab-size", str(LM_VOCAB),
                                "--trainpref", str(train), "--validpref", str(valid), "--destdir", str(data)])
        if code:
            raise SystemExit(f"bench_pipeline: hetfair-preprocess --task language_modeling failed (exit {code})")
    return data


# -- contenders -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Contender:
    name: str
    kind: str
    """``lossless``, ``compressed``, ``outer`` or ``pipeline``."""
    flags: Optional[tuple[str, ...]]
    """hetfair-train's extra flags (``None``: bench_links.py's plain torch loop)."""


def pipeline_flags(stages: int, batch: int, microbatches: int, schedule: str, split: str) -> tuple[str, ...]:
    """One pipeline over ``stages`` hosts, fed the job's whole global batch (``stages * batch`` samples per update,
    what DDP trains over the same hosts)."""
    return ("--ddp-backend", "pipeline", "--pipeline-stages", str(stages), "--pipeline-schedule", schedule,
            "--pipeline-microbatches", str(microbatches), "--pipeline-split", split, "--max-sentences",
            str(stages * batch))


def microbatches_for(options: argparse.Namespace, stages: int) -> int:
    return options.microbatches or 2 * stages


def contenders(options: argparse.Namespace, setting: Setting, nodes: int, units: int,
               modes: dict[str, list[str]]) -> tuple[list[Contender], list[str]]:
    """The contenders of one table, and a note per contender skipped (with why)."""
    found, notes = [Contender("ddp", "lossless", ())], []
    if TORCH_DDP in options.mode_names:
        if isinstance(setting, LMSetting):
            notes.append(f"{TORCH_DDP} skipped for {setting.arch}: bench_links.py's plain loop trains BERT and "
                         f"MNIST only")
        else:
            found.insert(0, Contender(TORCH_DDP, "lossless", None))
    for name, flags in modes.items():
        backend = flags[flags.index("--ddp-backend") + 1] if "--ddp-backend" in flags else "c10d"
        found.append(Contender(name, "outer" if backend in OUTER else "compressed", tuple(flags)))
    schedules = options.schedules.split(",")
    for schedule in schedules:
        stages = nodes * (2 if schedule == "interleaved" else 1)
        name = "pipeline" if len(schedules) == 1 else f"pipeline-{schedule}"
        if stages > units:
            notes.append(f"{name} skipped: {stages} stages need {stages} layers, {setting.arch} has {units}")
            continue
        flags = pipeline_flags(nodes, setting.batch, microbatches_for(options, nodes), schedule, "auto")
        found.append(Contender(name, "pipeline", flags))
    return found, notes


def proportional_split(layers: int, speeds: Sequence[float]) -> str:
    """Layers in proportion to the hosts' speeds (each at least one): 4 layers on speeds 1,2 give 1,3."""
    counts = [max(1, round(layers * speed / sum(speeds))) for speed in speeds]
    fastest = max(range(len(speeds)), key=lambda index: speeds[index])
    counts[fastest] += layers - sum(counts)
    return ",".join(map(str, counts))


def pair_contenders(options: argparse.Namespace, setting: Setting, layers: int) -> list[Contender]:
    """The pipeline under each of ``--pair-splits`` (``proportional``: :func:`proportional_split`), each split once."""
    found: dict[str, Contender] = {}
    for split in options.pair_splits.split(";"):
        value = proportional_split(layers, setting.speeds) if split == "proportional" else split
        label = f"{value} (proportional)" if split == "proportional" else value
        if value == ",".join(map(str, even_split(layers, 2))) and split != "even":
            label = f"{value} (= even)"
        found.setdefault(value, Contender(f"pipeline split {label}", "pipeline",
                                          pipeline_flags(2, setting.batch, microbatches_for(options, 2),
                                                         options.schedules.split(",")[0], value)))
    return list(found.values())


def run_contender(network: Network, setting: Setting, workdir: Path, contender: Contender) -> Result | str:
    """bench_links.py's ``run_job``; a failure is returned as its message (the table goes on)."""
    started = time.perf_counter()
    try:
        result: Result | str = run_job(network, setting, workdir, None if contender.flags is None
                                       else list(contender.flags))
    except Exception as exc:  # reported in the table and in full here
        result = f"{type(exc).__name__}: {exc}"
        text = traceback.format_exc()
        shown = text if len(text) < 8000 else f"{text[:1500]} ... {text[-6000:]}"
        print(f"bench_pipeline: {contender.name} failed:\n{shown}", flush=True)
    took = time.perf_counter() - started
    shown = f"{result.samples_per_s:.1f} samples/s, loss {result.loss:.3f}" if isinstance(result, Result) else "failed"
    print(f"  {contender.name}: {shown} ({took:.0f} s)", flush=True)
    return result


def measure_table(network: Network, setting: Setting, workdir: Path, runs: Sequence[Contender]
                  ) -> tuple[dict[str, Result | str], list[float], list[float], list[float]]:
    """Single-host speeds before, every contender, single-host speeds after."""
    before = single_node_speeds(network, setting, workdir, mode=[])
    print(f"  single-host samples/s before: {', '.join(f'{s:.1f}' for s in before)}", flush=True)
    results = {contender.name: run_contender(network, setting, workdir, contender) for contender in runs}
    after = single_node_speeds(network, setting, workdir, mode=[])
    print(f"  single-host samples/s after: {', '.join(f'{s:.1f}' for s in after)}", flush=True)
    return results, before, after, [(a + b) / 2 for a, b in zip(before, after)]


# -- tables ---------------------------------------------------------------------------------------------
def markdown_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], notes: Sequence[str]) -> None:
    """A markdown table under a heading, the first column left-aligned, the others right; ``notes`` as a list."""
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[column]) for row in cells) for column in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                                 for column, (cell, width) in enumerate(zip(row, widths))) + " |"

    rule = "|" + "|".join(("-" * (width + 2)) if column == 0 else ("-" * (width + 1) + ":")
                          for column, width in enumerate(widths)) + "|"
    print(f"\n### {title}\n\n{line(cells[0])}\n{rule}")
    for row in cells[1:]:
        print(line(row))
    print()
    for note in notes:
        print(f"- {note}")
    sys.stdout.flush()


def ratio_text(top: Optional[Result | str], bottom: Optional[Result | str], goal: Optional[float] = None) -> str:
    if not isinstance(top, Result) or not isinstance(bottom, Result) or not bottom.samples_per_s:
        return "n/a"
    value = top.samples_per_s / bottom.samples_per_s
    return f"{value:.2f}x" + ("" if goal is None else f" ({'meets' if value >= goal else 'BELOW'} goal >= {goal}x)")


def best(results: dict[str, Result | str], names: Sequence[str]) -> tuple[Optional[str], Optional[Result]]:
    ran = [(name, results[name]) for name in names if isinstance(results.get(name), Result)]
    if not ran:
        return "none run", None
    return max(ran, key=lambda item: item[1].samples_per_s)  # type: ignore[union-attr]


def failure(message: str) -> str:
    """The line of a failure that says why: the last error line of a process that did not just lose contact."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and "lost contact" not in line]
    return (errors or lines or ["?"])[-1][:300]


def failure_notes(results: dict[str, Result | str]) -> list[str]:
    return [f"{name} failed: {failure(result)}" for name, result in results.items() if isinstance(result, str)]


def rows_of(results: dict[str, Result | str], kinds: dict[str, str], singles: Sequence[float], base: str
            ) -> list[list[str]]:
    reference = results.get(base)
    rows = []
    for name, result in results.items():
        if not isinstance(result, Result):
            rows.append([name, kinds[name], "failed", "", "", "", "", ""])
            continue
        speed_ratio = f"{result.samples_per_s / reference.samples_per_s:.2f}" if isinstance(reference, Result) else ""
        loss_ratio = f"{(result.loss - reference.loss) / reference.loss:+.1%}" if isinstance(reference, Result) else ""
        rows.append([name, kinds[name], f"{result.samples_per_s:.1f}", f"{result.samples_per_s / sum(singles):.2f}",
                     speed_ratio, f"{result.samples}", f"{result.loss:.3f}", loss_ratio])
    return rows


def goal_lines(results: dict[str, Result | str], kinds: dict[str, str], rate: str) -> list[str]:
    pipes = [name for name, kind in kinds.items() if kind == "pipeline"]
    lines = []
    goals_apply = rate.lower() in ("100mbit", "100mbps")
    for pipe in pipes:
        p = results.get(pipe)
        lossless_name, lossless = best(results, [n for n, k in kinds.items() if k == "lossless"])
        compressed_name, compressed = best(results, [n for n, k in kinds.items() if k == "compressed"])
        outer_name, outer = best(results, [n for n, k in kinds.items() if k == "outer"])
        lines.append(
            f"{pipe} / ddp (plain DDP, hetfair c10d) = "
            f"{ratio_text(p, results.get('ddp'), GOALS['pipeline/ddp'] if goals_apply else None)}; "
            f"/ best lossless ({lossless_name}) = "
            f"{ratio_text(p, lossless, GOALS['pipeline/best lossless'] if goals_apply else None)}; "
            f"/ best compressed ({compressed_name}) = {ratio_text(p, compressed)}; "
            f"/ outer loop ({outer_name}) = {ratio_text(p, outer)}"
            + ("" if goals_apply else " (the goals are stated for 100 Mbit/s)"))
    return lines


def main_table(network: Network, options: argparse.Namespace, setting: Setting, workdir: Path, rate: str,
               modes: dict[str, list[str]], summary: list[str]) -> None:
    nodes = len(network.hosts)
    units, grad_mb, _ = model_sizes(setting, 1)
    runs, notes = contenders(options, setting, nodes, units, modes)
    _, _, act_mb = model_sizes(setting, nodes * setting.batch // microbatches_for(options, nodes))
    for index in range(nodes):
        network.shape(index, rate, burst=BURST)
    measured = link_throughput(network)
    title = (f"{setting.arch}, {nodes} hosts, links {rate} ({measured:.1f} MB/s measured), batch {setting.batch}/host "
             f"x {TOKENS} tokens ({nodes * setting.batch} per update), {setting.updates} updates")
    print(f"\n== {title}; {machine_note()}", flush=True)
    results, before, after, singles = measure_table(network, setting, workdir, runs)
    kinds = {contender.name: contender.kind for contender in runs}
    goals = goal_lines(results, kinds, rate)
    markdown_table(title, ["contender", "kind", "samples/s", "efficiency", "x ddp", "samples", "loss", "loss vs ddp"],
                rows_of(results, kinds, singles, "ddp"),
                [*goals, *failure_notes(results),
                 f"fp32 gradient {grad_mb:.1f} MB per update (ddp); pipeline: {nodes} stages over {units} "
                 f"layers (split auto), {microbatches_for(options, nodes)} micro-batches "
                 f"({options.schedules.split(',')[0]}), {act_mb:.2f} MB of activations per micro-batch each way "
                 f"per stage boundary",
                 f"single-host samples/s (hetfair-train, world 1, all {nodes} at once; mean of before and after): "
                 f"{', '.join(f'{s:.1f}' for s in singles)} (sum {sum(singles):.1f}; before {sum(before):.1f}, "
                 f"after {sum(after):.1f})", *notes, machine_note()])
    summary.extend(f"{setting.arch}, {nodes} hosts, {rate}: {line}" for line in goals)


def pair_table(options: argparse.Namespace, arch: str, speeds: tuple[float, ...], data: dict[str, Path],
               workdir: Path, summary: list[str]) -> None:
    setting = make_setting(arch, options, data, speeds)
    units, _, _ = model_sizes(setting, 1)
    runs = pair_contenders(options, setting, units)
    shown = ",".join(f"{speed:g}" for speed in speeds)
    with Network(2) as network, CpuLimits(speeds, options.threads):
        for index in range(2):
            network.shape(index, options.pair_rate, burst=BURST)
        measured = link_throughput(network)
        title = (f"{setting.arch} ({units} layers), 2 hosts of speeds {shown} (CPU quotas; host 0 runs the first "
                 f"stage, host 1 the last), links {options.pair_rate} ({measured:.1f} MB/s measured), "
                 f"{2 * setting.batch} samples per update, {setting.updates} updates")
        print(f"\n== {title}; {machine_note()}", flush=True)
        results, before, after, singles = measure_table(network, setting, workdir, runs)
    kinds = {contender.name: contender.kind for contender in runs}
    even_name = next((name for name in results if name.endswith(" even")), next(iter(results)))
    even = results[even_name]
    lines = [f"{name} / {even_name} = {ratio_text(result, even, GOALS['uneven/even'])}"
             for name, result in results.items() if name != even_name]
    uneven_name, uneven = best(results, [name for name in results if name != even_name])
    if uneven_name:
        lines.append(f"best uneven ({uneven_name}) / {even_name} = {ratio_text(uneven, even, GOALS['uneven/even'])}")
    markdown_table(title, ["contender", "kind", "samples/s", "efficiency", "x even", "samples", "loss", "loss vs even"],
                rows_of(results, kinds, singles, even_name),
                [*lines, *failure_notes(results),
                 f"single-host samples/s under the quotas (hetfair-train, world 1, both at once; mean of before and "
                 f"after): {', '.join(f'{s:.1f}' for s in singles)} (sum {sum(singles):.1f}; measured ratio "
                 f"1:{singles[1] / singles[0]:.2f} against the quotas' 1:{speeds[1] / speeds[0]:.2f}, which a busy "
                 f"machine narrows; before {sum(before):.1f}, after {sum(after):.1f})", machine_note()])
    summary.extend(f"pair {shown}, {setting.arch}, {options.pair_rate}: {line}" for line in lines[-1:])


# -- the dry run ----------------------------------------------------------------------------------------
def dry_run(options: argparse.Namespace, workdir: Path) -> None:
    """Every command the run would start (the data paths are where the run would preprocess to), each hetfair-train
    command line checked by hetfair's own parser; nothing runs."""
    data = {"bert": workdir / "data", "lm": workdir / "lm" / "data"}
    modes = {name: MODES[name] for name in options.mode_names if name != TORCH_DDP}

    from hetfair.options import parse_train_args

    def show(network: Network, setting: Setting, label: str, contender: Optional[Contender], index: int,
             command: list[str]) -> None:
        if "hetfair_cli.train" in command:  # hetfair-train's parser must take the flags (a typo stops here)
            parse_train_args(command[command.index("hetfair_cli.train") + 1:])
        print(f"[{label}] {contender.name if contender else 'single-host'} host {index}: "
              f"{shlex.join(setting.on_node(network, index, command))}")

    def table(network: Network, setting: Setting, label: str, runs: Sequence[Contender]) -> None:
        nodes, master = len(network.hosts), network.hosts[0].address
        save = workdir / "SAVE"
        for index in range(nodes):
            single = hetfair_command(setting, save, 0, 1, network.hosts[index].address, [])
            show(network, setting, label, None, index, single)
        for contender in runs:
            for rank in range(nodes):
                command = plain_command(setting, save) if contender.flags is None else \
                    hetfair_command(setting, save, rank, nodes, master, list(contender.flags))
                show(network, setting, label, contender, rank, command)

    if not options.pair_only:
        for arch, nodes, rate in itertools.product(options.archs.split(","), map(int, options.nodes.split(",")),
                                                   options.rates.split(",")):
            setting = make_setting(arch, options, data)
            units = arch_layers(arch)  # from the architecture (the data may not exist yet)
            runs, notes = contenders(options, setting, nodes, units, modes)
            for note in notes:
                print(f"[{arch}, {nodes} hosts, {rate}] note: {note}")
            table(Network(nodes), setting, f"{arch}, {nodes} hosts, {rate}", runs)
    if not options.no_pair:
        for arch, speeds in itertools.product(options.pair_archs.split(","), options.pair_speed_list):
            setting = make_setting(arch, options, data, speeds)
            table(Network(2), setting, f"pair {','.join(f'{v:g}' for v in speeds)}, {arch}, {options.pair_rate}",
                  pair_contenders(options, setting, arch_layers(arch)))


# -- the command line -----------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--archs", help="comma-separated bert_* and gpt_* archs (default: bert_mini,gpt_mini; "
                                         "--quick: bert_mini; --smoke: bert_tiny,gpt_tiny)")
    parser.add_argument("--nodes", default="2,4", help="comma-separated host counts (the pipeline's stages)")
    parser.add_argument("--rates", default="100mbit,1gbit", help="comma-separated link rates (tc units)")
    parser.add_argument("--modes", default="powersgd,diloco",
                        help=f"comma-separated contenders besides ddp and the pipeline: {', '.join(MODES)} "
                             f"(bench_links.py's MODES), {TORCH_DDP} (bench_links.py's plain loop, BERT only), or none")
    parser.add_argument("--schedules", default="1f1b", help="comma-separated pipeline schedules, one row each "
                                                            "(gpipe, 1f1b, interleaved); the pair uses the first")
    parser.add_argument("--microbatches", type=int, default=0, help="pipeline micro-batches per update (0: 2 x stages)")
    parser.add_argument("--batch", type=int, default=8, help="samples per host and update")
    parser.add_argument("--updates", type=int, default=16, help="updates per run")
    parser.add_argument("--interval", type=int, default=2, help="updates per progress line; the first is warm-up")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every host")
    parser.add_argument("--pair-archs", default="bert_mini,gpt_mini",
                        help="comma-separated models of the pair of unequal speeds, one table each")
    parser.add_argument("--pair-speeds", default="1,2;2,1",
                        help="semicolon-separated relative speeds of the pair's hosts 0 and 1 (CPU quotas), one "
                             "table each: 1,2 puts the fast host on the last stage (with the model's head), 2,1 on "
                             "the first")
    parser.add_argument("--pair-rate", default="1gbit", help="the pair's link rate")
    parser.add_argument("--pair-splits", default="even;proportional;auto",
                        help="semicolon-separated --pipeline-split values of the pair; 'even' is the base, "
                             "'proportional' the layers in proportion to the speeds (4 layers at 1,2: 1,3)")
    parser.add_argument("--no-pair", action="store_true", help="skip the pair of unequal speeds")
    parser.add_argument("--pair-only", action="store_true", help="only the pair of unequal speeds")
    parser.add_argument("--workdir", type=Path, help="data and checkpoints (default: a new temporary directory)")
    parser.add_argument("--quick", action="store_true",
                        help="bert_mini, 2 hosts, 100mbit, 8 updates, ddp against the pipeline, no pair")
    parser.add_argument("--smoke", action="store_true",
                        help="every contender kind, tiny: bert_tiny and gpt_tiny, 2 hosts, 1gbit, 6 updates; the "
                             "pair at speeds 1,2 (--pair-archs, 6 updates)")
    parser.add_argument("--dry-run", action="store_true", help="print every command, run nothing")
    options = parser.parse_args(argv)
    if options.quick:
        options.archs = options.archs or "bert_mini"
        options.nodes, options.rates, options.updates, options.modes = "2", "100mbit", 8, "none"
        options.no_pair = True
    if options.smoke:
        options.archs = options.archs or "bert_tiny,gpt_tiny"
        options.nodes, options.rates, options.updates, options.pair_speeds = "2", "1gbit", 6, "1,2"
    options.archs = options.archs or "bert_mini,gpt_mini"
    options.mode_names = [] if options.modes in ("", "none") else options.modes.split(",")
    unknown = [name for name in options.mode_names if name not in MODES and name != TORCH_DDP]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}, {TORCH_DDP}")
    if options.updates % options.interval or options.updates < 2 * options.interval:
        parser.error("--updates must be a multiple of --interval, at least two intervals")
    if options.updates <= WARMUP:
        parser.error(f"--updates must exceed the {WARMUP} warm-up updates of the learning rate")
    try:
        options.pair_speed_list = [tuple(float(v) for v in pair.split(",")) for pair in options.pair_speeds.split(";")]
    except ValueError:
        parser.error(f"--pair-speeds {options.pair_speeds}: numbers, e.g. 1,2;2,1")
    if any(len(pair) != 2 or min(pair) <= 0 for pair in options.pair_speed_list):
        parser.error("--pair-speeds: two positive speeds per pair, e.g. 1,2;2,1")
    return options


def guarded(label: str, summary: list[str], table: Callable[[], None]) -> None:
    """Run one table; where it fails as a whole (a single-host run, the link test), say so and go on."""
    try:
        table()
    except Exception as exc:  # the other tables still run
        print(f"bench_pipeline: the table {label} failed:\n{traceback.format_exc()[-6000:]}", flush=True)
        summary.append(f"{label}: the table failed ({failure(f'{type(exc).__name__}: {exc}')})")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: Optional[list[str]] = None) -> None:
    options = parse_args(argv)
    torch.set_num_threads(options.threads)
    if options.dry_run:
        dry_run(options, options.workdir or Path(tempfile.gettempdir()) / "hetfair-pipeline-WORKDIR")
        return
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="hetfair-pipeline-"))
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"bench_pipeline: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark removes its namespaces too
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"bench_pipeline: {machine_note()}; uptime: {uptime()}; workdir {workdir}", flush=True)
    archs = [] if options.pair_only else options.archs.split(",")
    wanted = set(archs) | (set() if options.no_pair else set(options.pair_archs.split(",")))
    data: dict[str, Path] = {}
    if any(not arch.startswith("gpt") for arch in wanted):
        data["bert"] = prepare_data(workdir)
    if any(arch.startswith("gpt") for arch in wanted):
        data["lm"] = prepare_lm_data(workdir)
    print(f"bench_pipeline: data ready ({time.perf_counter() - started:.0f} s)", flush=True)
    modes = known_modes([name for name in options.mode_names if name != TORCH_DDP])
    summary: list[str] = []
    for arch, nodes in itertools.product(archs, map(int, options.nodes.split(","))):
        setting = make_setting(arch, options, data)
        with Network(nodes) as network:
            for rate in options.rates.split(","):
                guarded(f"{arch}, {nodes} hosts, {rate}", summary,
                        lambda: main_table(network, options, setting, workdir, rate, modes, summary))
    if not options.no_pair:
        for arch, speeds in itertools.product(options.pair_archs.split(","), options.pair_speed_list):
            guarded(f"pair {','.join(f'{v:g}' for v in speeds)}, {arch}", summary,
                    lambda: pair_table(options, arch, speeds, data, workdir, summary))
    print("\nAgainst the goals (at 100 Mbit/s: pipeline >= 3x plain DDP, >= 1.5x the best lossless mode; the 1:2 "
          "pair: uneven split >= 1.3x even):")
    for line in summary:
        print(f"  {line}")
    print(f"\nbench_pipeline finished in {time.perf_counter() - started:.0f} s; {machine_note()}; uptime: {uptime()}",
          flush=True)


if __name__ == "__main__":
    main()
