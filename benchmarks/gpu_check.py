"""A ready check for a lent GPU: NCCL starts, and BERT trains in fp32, bf16 and fp16.

One CUDA device, well under 5 minutes, nothing but this repository and its PyPI
packages (no data: the masked-LM batches are synthetic):

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

Usage::

    python benchmarks/gpu_check.py [--arch bert_base] [--batch 64] [--updates 10]
    python benchmarks/gpu_check.py --dry-run    # the same steps, tiny, on CPU with gloo (tests this script)

Exit code 0 when every check passed, 1 when one failed, 2 when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

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


def run(setup: Setup, arch: str) -> None:
    print(f"gpu_check | {describe(setup)}", flush=True)
    print(f"collectives | {check_collectives(setup)} initialised for 1 process; all_reduce ok", flush=True)
    print(f"uneven | {check_offload(setup)}", flush=True)
    print(f"{arch} | batch {setup.batch} x {setup.length} tokens, {setup.updates} timed updates after "
          f"{setup.warmup} warm-up (AdamW, clip 1.0, loss in fp32)", flush=True)
    print(f"{'precision':<9} {'seq/s':>8} {'tokens/s':>10} {'loss/token first -> last':>24} {'skipped':>7} "
          f"{'peak':>7}  published A100, BERT-large phase 1")
    for precision in PRECISIONS:
        if precision == "bf16" and setup.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            print(f"{precision:<9} (this GPU has no bf16)")
            continue
        r = train_precision(setup, precision)
        print(f"{precision:<9} {r['seq_s']:>8.1f} {r['tokens_s']:>10.0f} {r['first_loss']:>13.3f} -> "
              f"{r['last_loss']:<7.3f} {r['skipped']:>7d} {format_size(r['peak']):>7}  {PUBLISHED_A100[precision]}",
              flush=True)
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"oom probe | {check_oom_probe(setup)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="bert_base", choices=sorted(ARCHS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--updates", type=int, default=10, choices=range(1, 1001), metavar="N")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the same steps on CPU with gloo and a tiny BERT (a test of this script)")
    options = parser.parse_args(argv)
    if options.dry_run:
        tiny = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=16)
        setup = Setup(torch.device("cpu"), "gloo", tiny, batch=2, length=16, updates=1, warmup=1)
        arch = "a tiny BERT"
    elif not torch.cuda.is_available():
        print(f"gpu_check: error: no CUDA device is visible (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda}); run it on the GPU machine, or pass --dry-run to try it on CPU",
              file=sys.stderr)
        return 2
    else:
        setup = Setup(torch.device("cuda", 0), "nccl", BertConfig(vocab_size=VOCAB_SIZE, **ARCHS[options.arch]()),
                      options.batch, SEQUENCE_LENGTH, options.updates)
        arch = options.arch
    try:
        run(setup, arch)
    except CheckFailed as exc:
        print(f"gpu_check: failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
