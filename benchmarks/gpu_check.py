"""A ready check for a lent GPU: NCCL starts, BERT trains in fp32, bf16 and fp16, and every mode of
hetfair-train runs on the device.

One CUDA device, under 8 minutes, nothing but this repository and its PyPI
packages (no data: the masked-LM batches and the simulated cluster's are synthetic).
In this process:

1. a one-process NCCL group initialises and all-reduces a tensor;
2. ``--offload``: a few BERT updates on uneven sharding's engine with the shards, gradients and AdamW
   state in host memory equal the same updates of the whole model on the GPU (1e-5: the step runs on
   the CPU instead), and need less GPU memory (``max_memory_allocated``); the dry run checks the
   engine without offload;
3. a few BERT updates in each precision through hetfair's ``Trainer`` (AdamW,
   128-token sequences, 15% of them masked, fp16 with the dynamic loss scale),
   timed after warm-up and printed as sequences/s and tokens/s next to NVIDIA's
   published per-A100 figures for BERT-large phase 1 (sequence length 128): 580
   sequences/s in mixed precision, 317 in TF32. hetfair's fp32 leaves TF32 off
   (PyTorch's default), and BERT-base does about a third of BERT-large's work
   per sequence, so compare ratios, not the raw numbers. ``peak`` is the rank's
   ``torch.cuda.max_memory_allocated`` from building the trainer to the last update
   (:mod:`hetfair.memory.peak`; the resident set in the CPU dry run);
4. the automatic plan's micro-batch probe (``hetfair.plan.probe``) on the device, held
   to a tenth of its memory (``torch.cuda.set_per_process_memory_fraction``) so that
   the search meets a real ``torch.cuda.OutOfMemoryError`` within seconds: it must
   find a micro-batch that then trains, leave no tensor allocated and the parameters
   unchanged (on CPU, the dry run holds the probe to a budget 16M above the process's
   resident memory instead).

Then, as commands (:mod:`gpu_modes`, which says where each runs): the replicated run (``c10d``, the
reference loss), ``--ddp-comm-hook`` fp16, bf16 and powersgd, ``--ddp-backend hybrid_sharded`` (2 x 2),
``localsgd`` and ``diloco``, uneven shards (``--shard-fractions 1,3``) with ``--offload 1,0``, the automatic
plan (``--max-sentences auto --precision auto --ddp-backend auto``, probing on the device) and live recovery
(``--fault-tolerance live``, a lighthouse, one of two ranks killed and replaced; and a job of one rank,
which is on NCCL however many GPUs there are). On one GPU the multi-rank cases share it: on NCCL where NCCL allows two processes on one
device (tried first, ``nccl-2-on-1-gpu``), else on gloo.

Each check prints its lines as it ends; one table at the end has every case's mode, backend, result
(pass, fail, skip), key number and seconds.

Usage::

    python benchmarks/gpu_check.py [--arch bert_base] [--batch 64] [--updates 10] [--only NAME,...]
    python benchmarks/gpu_check.py --list       # the cases and the commands they run, without running them
    python benchmarks/gpu_check.py --dry-run    # the same steps, tiny, on CPU with gloo (tests this script)

Exit code 0 when every check passed (or was skipped), 1 when one failed, 2 when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import math
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hetfair.bert.criterion import MaskedLmCriterion
from hetfair.bert.masking import IGNORE_INDEX
from hetfair.bert.model import BertConfig, BertModel, bert_base, bert_large, bert_mini, bert_small, bert_tiny
from hetfair.memory.peak import current_bytes, peak_bytes, reset_peak
from hetfair.memory.sizes import format_size
from hetfair.parallel.config import ParallelConfig
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.uneven_sharded import UnevenShardedStrategy
from hetfair.plan.probe import MicroBatchProbe
from hetfair.optim import LRScheduler
from hetfair.precision.mixed import PRECISIONS, LossScaleConfig, LossScaler
from hetfair.trainer import Trainer, TrainerConfig

import gpu_modes
from gpu_modes import Machine, Outcome

ARCHS = {"bert_tiny": bert_tiny, "bert_mini": bert_mini, "bert_small": bert_small, "bert_base": bert_base,
         "bert_large": bert_large}
PUBLISHED_A100 = {"fp32": "317 seq/s (TF32)", "bf16": "580 seq/s (mixed)", "fp16": "580 seq/s (mixed)"}
SEQUENCE_LENGTH = 128
VOCAB_SIZE = 30522


@dataclass(frozen=True)
class Setup:
    """Where and how big: the GPU run, or the CPU dry run."""

    device: torch.device
    backend: str
    config: BertConfig
    batch: int
    length: int
    updates: int
    warmup: int = 3


class CheckFailed(Exception):
    """A check ran but did not give the expected result."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_collectives(setup: Setup) -> str:
    """Initialise a one-process group on ``setup.backend`` and all-reduce a tensor on the device."""
    if setup.device.type == "cuda":
        torch.cuda.set_device(setup.device)
    dist.init_process_group(setup.backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        tensor = torch.full((4,), 3.0, device=setup.device)
        dist.all_reduce(tensor)
        if not torch.equal(tensor.cpu(), torch.full((4,), 3.0)):
            raise CheckFailed(f"all_reduce over one {setup.backend} process returned {tensor.tolist()}")
    finally:
        dist.destroy_process_group()
    if setup.backend == "nccl":
        return "NCCL " + ".".join(map(str, torch.cuda.nccl.version()))
    return setup.backend


def synthetic_batch(setup: Setup, generator: torch.Generator) -> dict[str, Any]:
    """A masked-LM batch as the bert task's collater makes it: random tokens, 15% of them to predict."""
    shape = (setup.batch, setup.length)
    input_ids = torch.randint(5, setup.config.vocab_size, shape, generator=generator)
    masked = torch.rand(shape, generator=generator) < 0.15
    target = torch.where(masked, input_ids, torch.full(shape, IGNORE_INDEX))
    input_ids = torch.where(masked, torch.full(shape, 4), input_ids)  # [MASK]
    return {"net_input": {"input_ids": input_ids, "token_type_ids": torch.zeros_like(input_ids),
                          "attention_mask": torch.ones(shape, dtype=torch.bool)},
            "target": target, "nsentences": setup.batch, "ntokens": setup.batch * setup.length}


def build_trainer(setup: Setup, precision: str, dummy: dict[str, Any], offload: Optional[bool] = None) -> Trainer:
    """The whole model on the device, or (``offload`` given) uneven sharding's engine over this one process."""
    torch.manual_seed(1)
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=setup.device)
    schedule = argparse.Namespace(lr=1e-4, warmup_updates=0)
    scaler = LossScaler(LossScaleConfig()) if precision == "fp16" else None
    strategy = None if offload is None else _OneProcessUneven(
        ParallelConfig("fully_sharded", shard_fractions=(1.0,), offload=offload), context)
    return Trainer(TrainerConfig(clip_norm=1.0, optimizer="adamw", precision=precision), BertModel(setup.config),
                   MaskedLmCriterion(None), context, dummy,
                   optimizer_factory=lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01),
                   lr_scheduler_factory=lambda optimizer: LRScheduler(schedule, optimizer),
                   loss_scaler=scaler, strategy=strategy)


class _OneProcessUneven(UnevenShardedStrategy):
    """The uneven engine on the one GPU there is: its one process holds the whole shard (hetfair-train needs two)."""

    @classmethod
    def check_world(cls, config: ParallelConfig, world_size: int) -> None:
        pass


def check_offload(setup: Setup) -> str:
    """A few fp32 updates with ``--offload 1`` (CPU dry run: the engine without offload) against the whole model:
    the same parameters, and the GPU memory each needed."""
    offload = setup.device.type == "cuda"
    dist.init_process_group(setup.backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        generator = torch.Generator().manual_seed(0)
        batches = [synthetic_batch(setup, generator) for _ in range(2)]
        (whole, whole_peak), (sharded, sharded_peak) = (
            _train_and_measure(setup, batches, choice) for choice in (None, offload))
    finally:
        dist.destroy_process_group()
    worst = max(float((sharded[name] - value).abs().max()) for name, value in whole.items())
    if worst > 1e-5:
        raise CheckFailed(f"offload {int(offload)}: parameters differ from the whole model's by {worst:.2e}")
    if offload and sharded_peak >= whole_peak:
        raise CheckFailed(f"offload 1 needed {sharded_peak} GPU bytes, the whole model {whole_peak}")
    return (f"offload {int(offload)}: {len(batches)} AdamW updates equal the whole model's (max diff {worst:.1e}); "
            f"GPU peak {sharded_peak / 2**20:.0f} MiB vs {whole_peak / 2**20:.0f} MiB")


def _train_and_measure(setup: Setup, batches: list[dict[str, Any]],
                       offload: Optional[bool]) -> tuple[dict[str, torch.Tensor], int]:
    """The parameters after training on ``batches``, and the device's peak allocated bytes (0 on CPU)."""
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(setup.device)
    trainer = build_trainer(setup, "fp32", batches[0], offload)
    for batch in batches:
        trainer.train_step([batch])
    peak = torch.cuda.max_memory_allocated(setup.device) if setup.device.type == "cuda" else 0
    return {k: v.cpu() for k, v in trainer.model_state_dict().items()}, peak


def train_precision(setup: Setup, precision: str) -> dict[str, float]:
    """Warm up, then time ``setup.updates`` updates; sequences/s, tokens/s, losses and skipped updates."""
    generator = torch.Generator().manual_seed(0)
    batches = [synthetic_batch(setup, generator) for _ in range(setup.warmup + setup.updates)]
    reset_peak(setup.device)
    trainer = build_trainer(setup, precision, batches[0])
    losses, skipped = [], 0
    for index, batch in enumerate(batches):
        if index == setup.warmup:
            synchronize(setup.device)
            start = time.perf_counter()
        result = trainer.train_step([batch])
        assert result is not None
        skipped += int(result.skipped)
        losses.append(result.totals["loss"] / result.totals["sample_size"])
    synchronize(setup.device)
    seconds = time.perf_counter() - start
    if not all(math.isfinite(loss) for loss in losses):
        raise CheckFailed(f"{precision}: a loss was not finite: {losses}")
    return {"seq_s": setup.batch * setup.updates / seconds, "tokens_s": setup.batch * setup.length * setup.updates
            / seconds, "first_loss": losses[0], "last_loss": losses[-1], "skipped": skipped,
            "peak": peak_bytes(setup.device)}


PROBE_MEMORY_FRACTION = 0.1


def check_oom_probe(setup: Setup) -> str:
    """Probe BERT's largest fp32 micro-batch (batches of ``length`` tokens) under a tenth of the device's memory
    (a real out-of-memory error ends the doubling), then train one update of it."""
    generator = torch.Generator().manual_seed(0)
    template = synthetic_batch(Setup(setup.device, setup.backend, setup.config, 1, setup.length, 1), generator)
    trainer = build_trainer(setup, "fp32", template)
    model, criterion = trainer.model, trainer.criterion
    before = {name: value.clone() for name, value in model.state_dict().items()}
    budget = None
    if setup.device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(PROBE_MEMORY_FRACTION, setup.device)
    else:
        budget = current_bytes(setup.device) + (16 << 20)
    allocated = current_bytes(setup.device) if setup.device.type == "cuda" else None
    try:
        probe = MicroBatchProbe(model, criterion, lambda n: _repeated(template, n), setup.device, "fp32", budget)
        result = probe.largest(upper=1 << 16, reserve=0)
        if allocated is not None and current_bytes(setup.device) != allocated:
            raise CheckFailed(f"the probe left {current_bytes(setup.device) - allocated} bytes allocated")
        if result.failed is None or result.micro_batch < 1:
            raise CheckFailed(f"the probe met no limit or found no micro-batch: {result}")
        changed = [name for name, value in model.state_dict().items() if not torch.equal(value, before[name])]
        if changed:
            raise CheckFailed(f"the probe changed {', '.join(changed[:3])}")
        trainer.train_step([_repeated(template, result.micro_batch)])
    finally:
        if setup.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, setup.device)
            torch.cuda.empty_cache()
    limit = f"{PROBE_MEMORY_FRACTION:.0%} of the device's memory" if budget is None else \
        "a budget 16M above the process's memory"
    return (f"{result.largest} sequences fit, {result.failed} did not, under {limit} ({result.steps} steps, "
            f"{result.seconds:.1f} s); one update of micro-batch {result.micro_batch} trained; nothing left allocated")


def _repeated(batch: dict[str, Any], copies: int) -> dict[str, Any]:
    """``batch`` (one sequence) ``copies`` times over."""
    inputs = {key: value.repeat(copies, 1) for key, value in batch["net_input"].items()}
    return {"net_input": inputs, "target": batch["target"].repeat(copies, 1), "nsentences": copies,
            "ntokens": copies * batch["ntokens"]}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(setup: Setup) -> str:
    if setup.device.type != "cuda":
        return f"torch {torch.__version__}, CPU dry run"
    major, minor = torch.cuda.get_device_capability(setup.device)
    return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(setup.device)} "
            f"(sm_{major}{minor})")


class Skipped(Exception):
    """A check that does not apply on this device."""


@dataclass(frozen=True)
class InProcessCheck:
    """A check of this process: it prints its lines and returns its key number."""

    name: str
    backend: str
    check: Callable[[Setup], str]


class PrecisionRows:
    """One BERT row per precision, under a header printed before the first."""

    def __init__(self, arch: str) -> None:
        self.arch = arch
        self.headed = False

    def check(self, precision: str) -> Callable[[Setup], str]:
        def row(setup: Setup) -> str:
            if not self.headed:
                self.headed = True
                print(f"{self.arch} | batch {setup.batch} x {setup.length} tokens, {setup.updates} timed updates "
                      f"after {setup.warmup} warm-up (AdamW, clip 1.0, loss in fp32)", flush=True)
                print(f"{'precision':<9} {'seq/s':>8} {'tokens/s':>10} {'loss/token first -> last':>24} "
                      f"{'skipped':>7} {'peak':>7}  published A100, BERT-large phase 1")
            if precision == "bf16" and setup.device.type == "cuda" and not torch.cuda.is_bf16_supported():
                print(f"{precision:<9} (this GPU has no bf16)")
                raise Skipped("this GPU has no bf16")
            r = train_precision(setup, precision)
            print(f"{precision:<9} {r['seq_s']:>8.1f} {r['tokens_s']:>10.0f} {r['first_loss']:>13.3f} -> "
                  f"{r['last_loss']:<7.3f} {r['skipped']:>7d} {format_size(r['peak']):>7}  "
                  f"{PUBLISHED_A100[precision]}", flush=True)
            return f"{r['seq_s']:.1f} seq/s"
        return row


def _collectives(setup: Setup) -> str:
    version = check_collectives(setup)
    print(f"collectives | {version} initialised for 1 process; all_reduce ok", flush=True)
    return version


def _offload(setup: Setup) -> str:
    line = check_offload(setup)
    print(f"uneven | {line}", flush=True)
    return line.split("(", 1)[1].split(")", 1)[0]  # the max diff


def _probe(setup: Setup) -> str:
    line = check_oom_probe(setup)
    print(f"oom probe | {line}", flush=True)
    return line.split(",", 1)[0]  # how many fit


def in_process_checks(setup: Setup, arch: str) -> list[InProcessCheck]:
    rows = PrecisionRows(arch)
    return [InProcessCheck("collectives", setup.backend, _collectives),
            InProcessCheck("offload", setup.backend, _offload),
            *(InProcessCheck(f"bert-{precision}", "-", rows.check(precision)) for precision in PRECISIONS),
            InProcessCheck("probe", "-", _probe)]


def run_in_process(check: InProcessCheck, setup: Setup) -> Outcome:
    """One check; a failure (of any kind: one check's crash must not hide the others' results) is its row."""
    start = time.perf_counter()
    outcome = Outcome(check.name, check.backend, True, "-", 0.0)
    try:
        outcome.key = check.check(setup)
    except Skipped as exc:
        outcome.passed, outcome.detail = None, str(exc)
    except Exception as exc:  # noqa: BLE001 - reported in the table, and the exit code
        kind = "" if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: "
        outcome.passed, outcome.detail = False, kind + (str(exc).splitlines() or [""])[0][:300]
        print(f"{check.name} | failed: {outcome.detail}", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    outcome.seconds = time.perf_counter() - start
    return outcome


def machine_of(setup: Setup) -> Machine:
    return Machine(torch.cuda.device_count()) if setup.device.type == "cuda" else Machine(0)


def run(setup: Setup, arch: str, only: Optional[set[str]]) -> list[Outcome]:
    """Every check (those named in ``only``, if given), in this process, then as commands."""
    print(f"gpu_check | {describe(setup)}", flush=True)
    outcomes = [run_in_process(check, setup) for check in in_process_checks(setup, arch)
                if not only or check.name in only]
    modes = [case for case in gpu_modes.cases() if not only or case.name in only]
    machine = machine_of(setup)
    if modes and machine.cuda and machine.gpus < max(case.ranks for case in modes):
        pair = gpu_modes.nccl_pair_on_one_gpu(free_port())
        print(f"{pair.mode} | {pair.key}" + (f" ({pair.detail})" if pair.detail else ""), flush=True)
        outcomes.append(pair)
        machine = Machine(machine.gpus, nccl_shares_gpu=pair.key.startswith("yes"))
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as workdir:
        outcomes += gpu_modes.run_cases(modes, machine, Path(workdir))
    return outcomes


def table(outcomes: list[Outcome]) -> list[str]:
    """A Markdown table, one row per check, then a line per failure or skip saying why."""
    rows = [("mode", "backend", "result", "key number", "seconds")]
    rows += [(o.mode, o.backend, o.result, o.key, f"{o.seconds:.1f}") for o in outcomes]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    lines += [f"{o.result} | {o.mode}: {o.detail}" for o in outcomes if o.detail and o.passed is not True]
    return lines


def list_cases(setup: Setup, arch: str, machine: Machine, note: str) -> None:
    """Every check's name, and each command a mode runs (``PORT``: the lighthouse's, found when it starts)."""
    print(f"gpu_check | the checks {note}")
    for check in in_process_checks(setup, arch):
        print(f"{check.name} | in this process")
    workdir = Path(tempfile.gettempdir()) / "gpu_check"
    for case in gpu_modes.cases():
        print(f"{case.name} | {case.backend(machine)} | {case.what}")
        for command in case.commands(machine, workdir):
            print(f"    {shlex.join(command)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="bert_base", choices=sorted(ARCHS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--updates", type=int, default=10, choices=range(1, 1001), metavar="N")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the same steps on CPU with gloo and a tiny BERT (a test of this script)")
    parser.add_argument("--only", metavar="NAME[,NAME...]", help="run only these checks (see --list)")
    parser.add_argument("--list", action="store_true", help="print the checks and their commands; run nothing")
    options = parser.parse_args(argv)
    tiny = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=16)
    dry = Setup(torch.device("cpu"), "gloo", tiny, batch=2, length=16, updates=1, warmup=1)
    names = [check.name for check in in_process_checks(dry, "")] + [case.name for case in gpu_modes.cases()]
    only = set(options.only.split(",")) if options.only else None
    if only and only - set(names):
        parser.error(f"--only: no check named {', '.join(sorted(only - set(names)))}; the checks: {', '.join(names)}")
    if options.dry_run:
        setup, arch = dry, "a tiny BERT"
    elif not torch.cuda.is_available():
        if options.list:
            list_cases(dry, options.arch, Machine(1), "as on one GPU (no CUDA device is visible here)")
            return 0
        print(f"gpu_check: error: no CUDA device is visible (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda}); run it on the GPU machine, or pass --dry-run to try it on CPU",
              file=sys.stderr)
        return 2
    else:
        setup = Setup(torch.device("cuda", 0), "nccl", BertConfig(vocab_size=VOCAB_SIZE, **ARCHS[options.arch]()),
                      options.batch, SEQUENCE_LENGTH, options.updates)
        arch = options.arch
    if options.list:
        list_cases(setup, arch, machine_of(setup), "on CPU (--dry-run)" if options.dry_run else
                   f"on {torch.cuda.device_count()} GPU(s), before trying two NCCL processes on one")
        return 0
    start = time.perf_counter()
    outcomes = run(setup, arch, only)
    failed = sum(outcome.passed is False for outcome in outcomes)
    skipped = sum(outcome.passed is None for outcome in outcomes)
    print(f"gpu_check | {len(outcomes) - failed - skipped} passed, {failed} failed, {skipped} skipped in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    print("\n".join(table(outcomes)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
