"""What frequent checkpoints cost: ``bert_tiny`` on the Jargon File through ``hetfair-train``,
saving every 20 updates in the background (the default), on the training thread
(``--no-async-save``), or not at all.

The three variants run one after the other, round after round, so they share the
machine's load; each is clocked from outside between its first and last progress line
(update 20 and the last update: start-up and warm-up excluded, the saves of updates 20,
40, ... included). The first table gives seconds per update and the overhead against no
saving. On a shared machine that difference is within the noise, so a second table times
what a save costs the training thread itself: the same model and Adam state, saved by
hetfair's ``Checkpointer`` with and without the background writer, alternating; its cost
per update is that time over 20 updates of the median update time measured above.
Usage: ``python benchmarks/bench_checkpoint.py [--rounds 3] [--updates 160] [--threads N]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_bert import prepare_data
from common import REPO_ROOT, Samples, clocked_run, machine_note, print_table, subprocess_env
from hetfair.checkpoint.layout import CheckpointConfig, Checkpointer
from hetfair.parallel.context import DistributedContext
from hetfair.options import parse_train_args
from hetfair.run.training import TrainingRun

SAVE_EVERY = 20
VARIANTS = {
    "no checkpoints": ["--no-save"],
    "sync, every 20": ["--save-interval-updates", str(SAVE_EVERY), "--no-async-save"],
    "async, every 20": ["--save-interval-updates", str(SAVE_EVERY)],
}


def command(data: Path, save_dir: Path, updates: int, batch: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "hetfair_cli.train", "--task", "bert", "--data", str(data), "--arch", "bert_tiny",
            "--max-sentences", str(batch), "--lr", "1e-4", "--warmup-updates", "10", "--total-num-update", "10000",
            "--max-update", str(updates), "--save-dir", str(save_dir), "--disable-validation",
            "--no-epoch-checkpoints", "--keep-interval-updates", "1", "--log-format", "json",
            "--log-interval", str(SAVE_EVERY), *extra]


def blocking_seconds(data: Path, workdir: Path, batch: int, saves: int) -> dict[str, Samples]:
    """Seconds each save holds the training thread, with and without the background writer (alternating)."""
    flags = command(data, workdir / "unused", 1, batch, [])[3:]  # the options, without python -m ...
    run = TrainingRun(parse_train_args(flags), DistributedContext(0, 1, 0, torch.device("cpu")))
    run.train_update(next(iter(run._epoch_updates())))  # Adam's state exists after the first update
    writers = {name: Checkpointer(CheckpointConfig(workdir / name, async_save=name == "async"),
                                  run._checkpoint_parts(), {"task": "bert"}, is_master=True)
               for name in ("sync", "async")}
    held = {name: Samples() for name in writers}
    for index in range(saves):
        for name, checkpointer in writers.items():
            started = time.perf_counter()
            checkpointer.save(1, SAVE_EVERY * (index + 1), end_of_epoch=False, valid_metric=None)
            held[name].add(time.perf_counter() - started)
            checkpointer.wait()  # not timed: the background write overlaps the next updates
    for checkpointer in writers.values():
        checkpointer.close()
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=160, help="updates per run (a multiple of 20)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--saves", type=int, default=15, help="saves of each kind in the second table")
    options = parser.parse_args()
    env = subprocess_env(options.threads, pythonpath=str(REPO_ROOT))
    times = {name: Samples() for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        workdir = Path(tmp)
        data = prepare_data(workdir)
        checkpoint_mb = None
        for round_index in range(options.rounds):
            for name, extra in VARIANTS.items():
                save_dir = workdir / f"ckpt-{round_index}-{len(times[name].values)}-{name[:4]}"
                run = clocked_run(command(data, save_dir, options.updates, options.batch, extra), env,
                                  timeout=3600, expected_updates=options.updates, cwd=REPO_ROOT)
                times[name].add(run.wall_per_update)
                last = save_dir / "checkpoint_last.pt"
                if last.exists():
                    checkpoint_mb = last.stat().st_size / 2**20
                print(f"round {round_index + 1} {name}: {run.wall_per_update * 1000:.1f} ms/update", flush=True)
        torch.set_num_threads(options.threads)
        held = blocking_seconds(data, workdir, options.batch, options.saves)
    base = times["no checkpoints"].values
    ratios = {name: Samples([t / b for t, b in zip(s.values, base)]) for name, s in times.items()}
    rows = [(name, f"{s.median * 1000:.1f}", s.spread("{:.1f}", 1000), f"{ratios[name].median:.4f}",
             ratios[name].spread("{:.4f}"), f"{(ratios[name].median - 1) * 100:+.2f}%") for name, s in times.items()]
    saves = (options.updates - SAVE_EVERY) // SAVE_EVERY
    print_table(f"bert_tiny, batch {options.batch}, {options.updates} updates per run, {saves} saves timed per run, "
                f"checkpoint {checkpoint_mb or 0:.1f} MiB, {options.rounds} rounds",
                ["variant", "ms/update", "min..max", "vs none", "min..max", "overhead"], rows,
                [machine_note(), f"OMP_NUM_THREADS={options.threads}; variants alternate; 'vs none' is the median "
                                 f"of each round's ratio to that round's run without checkpoints"])
    interval = SAVE_EVERY * times["no checkpoints"].median
    print_table(f"training-thread time per save ({options.saves} saves each, alternating), as a share of "
                f"{SAVE_EVERY} updates ({interval:.1f} s)",
                ["writer", "ms/save", "min..max", "per update"],
                [(name, f"{s.median * 1000:.1f}", s.spread("{:.1f}", 1000), f"{s.median / interval * 100:.3f}%")
                 for name, s in held.items()],
                [machine_note(), "sync: state_dict(), torch.save, fsync and rename on the training thread; "
                                 "async: state_dict() and the host-memory snapshot"])


if __name__ == "__main__":
    main()
