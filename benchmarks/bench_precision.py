"""BERT updates in fp32, bf16 and fp16 on this machine, and what loss scaling itself costs.

Variants, each a :class:`hetfair.trainer.Trainer` on the same pre-collated
batches (the Jargon File, or a synthetic corpus without ``jargon-text``):

* ``fp32``: no autocast, no loss scaling (hetfair's default);
* ``fp32+scaling``: fp32 with the job's loss scale on, as a bf16/fp32 rank has it
  when another rank runs fp16: the loss multiplied by ``S``, the gradients
  unscaled and checked for inf/NaN in one fused op. Same math as ``fp32``, so
  the time difference is the overhead of loss scaling;
* ``bf16``: autocast to bfloat16;
* ``fp16``: autocast to float16 with loss scaling.

The variants alternate update by update inside one process, so all see the same
machine load; times are medians after warm-up. The overhead of loss scaling is
given twice: end to end, as the median of the per-update time ratios
``fp32+scaling / fp32`` (noisy on a shared machine), and isolated, as the extra
time of the ops it adds (the loss times ``S``; the fused unscale-and-check with
its read-back instead of one ``_foreach_mul_``) on the model's gradients, timed
alternately over many repetitions, relative to the fp32 update. On a CPU without
native bf16/fp16 arithmetic (no AVX512-BF16/AMX/AVX512-FP16) low precision is
emulated and slower than fp32; the numbers say what this machine gives.
Usage: ``python benchmarks/bench_precision.py [--archs bert_tiny,bert_mini]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bert import fixed_batches, prepare_data, train_flags  # noqa: E402

from hetfair.parallel.context import DistributedContext  # noqa: E402
from hetfair.options import parse_train_args  # noqa: E402
from hetfair.precision.mixed import LossScaleConfig, LossScaler  # noqa: E402
from hetfair.tasks import TASK_REGISTRY  # noqa: E402
from hetfair.run import wiring  # noqa: E402
from hetfair.trainer import Trainer  # noqa: E402

WARMUP_UPDATES = 2
VARIANTS = {"fp32": ("fp32", False), "fp32+scaling": ("fp32", True), "bf16": ("bf16", False), "fp16": ("fp16", True)}
Step = Callable[[dict], None]
REPEATS = 200


def build_trainer(flags: list[str], precision: str, scaling: bool, dummy: dict) -> Trainer:
    args = parse_train_args(flags + ["--precision", precision])
    task = TASK_REGISTRY.get("bert").setup_task(args)
    torch.manual_seed(args.seed)
    model, criterion = task.build_model(args), task.build_criterion(args)
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    scaler = LossScaler(LossScaleConfig(init_scale=2.0**7, scale_window=2000)) if scaling else None
    return wiring.build_trainer(args, model, criterion, context, dummy, scaler)


def time_alternating(steps: dict[str, Step], batches: list[dict]) -> dict[str, list[float]]:
    """Seconds per update of every variant, the variants alternating on each batch (warm-up dropped)."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for index, sample in enumerate(batches):
        for name, step in steps.items():
            start = time.perf_counter()
            step(sample)
            if index >= WARMUP_UPDATES:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def measure(workdir: Path, arch: str, batch: int, updates: int) -> None:
    count = updates + WARMUP_UPDATES
    flags = train_flags(workdir / "data", arch, batch, count, workdir / "ckpt")
    task = TASK_REGISTRY.get("bert").setup_task(parse_train_args(flags))
    batches = fixed_batches(task, count, batch)
    trainers = {name: build_trainer(flags, precision, scaling, batches[0])
                for name, (precision, scaling) in VARIANTS.items()}
    seconds = time_alternating({name: _step(trainer) for name, trainer in trainers.items()}, batches)
    tokens = statistics.median(sample["ntokens"] for sample in batches[WARMUP_UPDATES:])
    fp32 = statistics.median(seconds["fp32"])
    print(f"\n{arch}, batch {batch} x <=128 tokens, {updates} timed updates, {torch.get_num_threads()} threads")
    print(f"{'variant':<14} {'ms/update':>10} {'tokens/s':>9} {'vs fp32':>8}")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"{name:<14} {1000 * median:>10.1f} {tokens / median:>9.0f} {fp32 / median:>8.3f}")
    ratios = sorted(scaled / plain for scaled, plain in zip(seconds["fp32+scaling"], seconds["fp32"]))
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"loss-scaling overhead, end to end (median of per-update ratios fp32+scaling / fp32): "
          f"{100 * (statistics.median(ratios) - 1):+.1f}% (quartiles {100 * (quartiles[0] - 1):+.1f}% .. "
          f"{100 * (quartiles[2] - 1):+.1f}%)")
    extra = scaling_ops_seconds(trainers["fp32"], trainers["fp32+scaling"])
    print(f"loss-scaling overhead, its own ops: {1e3 * extra:+.3f} ms per update = {100 * extra / fp32:+.3f}% "
          f"of the fp32 update")


def _step(trainer: Trainer) -> Step:
    return lambda sample: trainer.train_step([sample])


def scaling_ops_seconds(plain: Trainer, scaled: Trainer) -> float:
    """Median extra seconds of the scaled trainer's gradient normalisation (and loss multiply) over the plain one's.

    Both run their own ``Trainer._normalise`` on gradients shaped like the model's, alternately.
    """
    grads = [torch.randn_like(p) for p in plain.params]
    loss = torch.tensor(1.0, requires_grad=True)
    times: dict[str, list[float]] = {"plain": [], "scaled": []}
    for _ in range(REPEATS):
        start = time.perf_counter()
        plain._normalise(grads, 1.0)
        times["plain"].append(time.perf_counter() - start)
        start = time.perf_counter()
        loss * scaled.loss_scaler.scale
        scaled._normalise(grads, 1.0)
        times["scaled"].append(time.perf_counter() - start)
    return statistics.median(times["scaled"]) - statistics.median(times["plain"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="bert_tiny,bert_mini")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--updates", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", type=Path)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="hetfair-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    prepare_data(workdir)
    for arch in options.archs.split(","):
        measure(workdir, arch, options.batch, options.updates)


if __name__ == "__main__":
    main()
