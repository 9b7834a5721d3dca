"""Tokens/s of hetfair-train against a plain PyTorch loop training the same language model on the same data.

The Jargon File is preprocessed once (``hetfair-preprocess --task language_modeling``, a trained
byte-level BPE); then, on 1 process (``--single-threads`` threads) and on 2 ranks (1 thread each,
gloo, both launched by torchrun), these contenders train ``--arch`` on blocks of
``--tokens-per-sample`` tokens, ``--blocks`` blocks per update over all ranks:

* ``plain``: the loop a user writes: the task's block dataset and collater in a shuffled
  DataLoader (a DistributedSampler on 2 ranks), ``TransformerLM`` built directly, DDP on 2 ranks,
  mean next-token ``F.cross_entropy``, ``torch.optim.AdamW`` with its defaults (on CPU, its
  per-parameter loop), a JSON progress line every interval;
* ``hetfair``: ``hetfair-train --task language_modeling`` with the same model, data, batch and
  AdamW (its default fused step), data loading, token-weighted updates and logging included;
* ``hetfair for-loop``: the same with ``--optimizer-impl for-loop``, plain's optimizer step, so the
  ratio shows the framework alone.

Every run is clocked from outside between its first progress line (the end of the warm-up) and
its last; the contenders of one shape run next to each other, their order rotating every
repetition. Ratio = hetfair tokens/s / plain tokens/s (median of the repetitions' ratios; goal
>= 0.98). The machine load (``uptime``) is printed before and after.

    .venv/bin/python benchmarks/bench_lm.py             # 3 repetitions (about 25 minutes on 2 busy cores)
    .venv/bin/python benchmarks/bench_lm.py --quick     # 1 repetition, fewer updates
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_ddp import torchrun  # noqa: E402
from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    Samples,
    clocked_run,
    machine_note,
    print_table,
    progress_line,
    ratio,
    subprocess_env,
)

JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
CONTENDERS = ("plain", "hetfair", "hetfair for-loop")
LR, SEED = 3e-4, 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--arch", default="gpt_mini", help="transformer_lm architecture")
    parser.add_argument("--tokens-per-sample", type=int, default=128, help="tokens per block")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per update over all ranks")
    parser.add_argument("--vocab-size", type=int, default=8192, help="size of the trained BPE vocabulary")
    parser.add_argument("--updates", type=int, default=40, help="timed updates per run (after one warm-up interval)")
    parser.add_argument("--interval", type=int, default=10, help="updates per progress line")
    parser.add_argument("--ranks", default="1,2", help="cluster shapes: processes per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender and shape")
    parser.add_argument("--single-threads", type=int, default=2, help="threads of a one-process run")
    parser.add_argument("--workdir", type=Path, help="keep the preprocessed data here (default: temporary)")
    parser.add_argument("--quick", action="store_true", help="1 repetition, 20 timed updates")
    parser.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("train_flags", nargs="*", help=argparse.SUPPRESS)  # the plain worker's, after "--"
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.updates = 1, 20
    return args


# -- data ---------------------------------------------------------------------------------
def prepare_data(workdir: Path, vocab_size: int) -> Path:
    """The Jargon File (or, without the package, a synthetic text) preprocessed into ``workdir/data``."""
    data = workdir / "data"
    if (data / "train.idx").exists():
        return data
    workdir.mkdir(parents=True, exist_ok=True)
    text = workdir / "train.txt"
    if JARGON.is_file():
        text.write_bytes(gzip.decompress(JARGON.read_bytes()))
    else:
        words = "the hacker wrote code for machines and networks while users read manuals".split()
        text.write_text("\n\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(40))
                                    for i in range(20000)) + "\n")
    subprocess.run([sys.executable, "-m", "hetfair_cli.preprocess", "--task", "language_modeling", "--tokenizer",
                    "bpe", "--vocab-size", str(vocab_size), "--trainpref", str(text), "--destdir", str(data)],
                   check=True, cwd=REPO_ROOT, env=subprocess_env(2, str(REPO_ROOT)))
    return data


# -- the plain loop -----------------------------------------------------------------------
def train_flags(args: argparse.Namespace, data: Path, per_rank_blocks: int, save_dir: Path) -> list[str]:
    """The hetfair-train command line (also what the plain worker reads its sizes from)."""
    return ["--task", "language_modeling", "--data", str(data), "--arch", args.arch,
            "--tokens-per-sample", str(args.tokens_per_sample),
            "--max-tokens", str(per_rank_blocks * args.tokens_per_sample), "--optimizer", "adamw",
            "--lr", str(LR), "--lr-scheduler", "fixed", "--seed", str(SEED), "--cpu",
            "--max-epoch", "0", "--max-update", str(args.interval + args.updates),
            "--log-format", "json", "--log-interval", str(args.interval), "--disable-validation", "--no-save",
            "--save-dir", str(save_dir)]


def plain_worker(flags: list[str], interval: int) -> None:
    """The plain loop (under torchrun: DDP over gloo with a DistributedSampler)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from hetfair.lm.config import LMConfig
    from hetfair.lm.model import TransformerLM
    from hetfair.options import parse_train_args
    from hetfair.tasks import TASK_REGISTRY

    options = parse_train_args(flags)  # the sizes of --arch and the data directory, as hetfair-train reads them
    task = TASK_REGISTRY.get("language_modeling").setup_task(options)
    dataset = task.dataset("train")
    distributed = "WORLD_SIZE" in os.environ
    sampler = None
    rank = 0
    if distributed:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        sampler = DistributedSampler(dataset, shuffle=True, seed=SEED, drop_last=True)
    torch.manual_seed(SEED)
    config = LMConfig(vocab_size=task.vocab_size, max_positions=options.tokens_per_sample,
                      embed_dim=options.decoder_embed_dim, layers=options.decoder_layers,
                      attention_heads=options.decoder_attention_heads, ffn_embed_dim=options.decoder_ffn_embed_dim,
                      dropout=options.dropout, attention_dropout=options.attention_dropout)
    module = TransformerLM(config).train()
    model = DistributedDataParallel(module) if distributed else module
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    blocks = options.max_tokens // options.tokens_per_sample
    loader = DataLoader(dataset, batch_size=blocks, shuffle=sampler is None, sampler=sampler,
                        collate_fn=task.collater, drop_last=True)
    updates, started = 0, time.perf_counter()
    while updates < options.max_update:
        for sample in loader:
            optimizer.zero_grad(set_to_none=True)
            logits = model(**sample["net_input"])
            loss = F.cross_entropy(logits.flatten(0, 1), sample["target"].flatten(), ignore_index=task.pad_index)
            loss.backward()
            optimizer.step()
            updates += 1
            if updates % interval == 0 and rank == 0:
                now = time.perf_counter()
                print(progress_line(updates, now - started, interval), flush=True)
                started = now
            if updates == options.max_update:
                break
    if distributed:
        dist.destroy_process_group()


# -- measuring ----------------------------------------------------------------------------
def commands(args: argparse.Namespace, data: Path, ranks: int, save_dir: Path) -> dict[str, list[str]]:
    flags = train_flags(args, data, args.blocks // ranks, save_dir)
    launch = [sys.executable] if ranks == 1 else torchrun(ranks)
    return {
        "plain": [*launch, str(Path(__file__).resolve()), "--plain-worker", "--interval", str(args.interval),
                  "--", *flags],
        "hetfair": [*launch, "-m", "hetfair_cli.train", *flags],
        "hetfair for-loop": [*launch, "-m", "hetfair_cli.train", *flags, "--optimizer-impl", "for-loop"],
    }


def measure(args: argparse.Namespace, data: Path, save_dir: Path) -> dict[int, dict[str, Samples]]:
    """Seconds per update of every contender on every shape, ``--repeats`` times, alternating."""
    shapes = [int(r) for r in args.ranks.split(",")]
    walls = {ranks: {name: Samples() for name in CONTENDERS} for ranks in shapes}
    for rep in range(args.repeats):
        for ranks in shapes:
            runs = list(commands(args, data, ranks, save_dir).items())
            shift = rep % len(runs)
            env = subprocess_env(args.single_threads if ranks == 1 else 1, str(REPO_ROOT))
            for name, command in runs[shift:] + runs[:shift]:
                run = clocked_run(command, env, timeout=3600, expected_updates=args.interval + args.updates,
                                  cwd=REPO_ROOT)
                walls[ranks][name].add(run.wall_per_update)
                print(f"  rep {rep + 1}/{args.repeats} {ranks} rank(s) {name:17s} "
                      f"{args.blocks * args.tokens_per_sample / run.wall_per_update:8.0f} tokens/s "
                      f"({run.wall_per_update * 1e3:.0f} ms/update, {run.cpu_per_update * 1e3:.0f} CPU ms/update "
                      f"of all its processes, run {run.total_wall:.0f} s)", flush=True)
    return walls


def report(args: argparse.Namespace, walls: dict[int, dict[str, Samples]]) -> None:
    tokens = args.blocks * args.tokens_per_sample
    rows = []
    for ranks, by_name in walls.items():
        plain = by_name["plain"]
        row = [f"{ranks} x {args.blocks // ranks} blocks"]
        for name in CONTENDERS:
            row.append(f"{tokens / by_name[name].median:.0f}")
        for name in CONTENDERS[1:]:
            ratios = Samples([ratio(p, h) for p, h in zip(plain.values, by_name[name].values)])
            row.append(f"{ratios.median:.3f}" + (f" ({ratios.spread('{:.3f}')})" if len(ratios.values) > 1 else ""))
        rows.append(row)
    print_table(
        f"{args.arch}, {args.tokens_per_sample} tokens per block, {tokens} tokens per update; tokens/s = tokens per "
        f"update / median s per update of {args.repeats} run(s); ratio = hetfair / plain tokens/s (goal >= 0.98)",
        ["ranks x blocks", *(f"{name} tokens/s" for name in CONTENDERS), "ratio hetfair", "ratio hetfair for-loop"],
        rows, notes=["2 ranks: torchrun, gloo, 1 thread each; plain: torch.optim.AdamW defaults (per-parameter loop "
                     "on CPU), hetfair: its default fused step, 'for-loop': plain's step"])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plain_worker:
        plain_worker(args.train_flags, args.interval)
        return
    print(f"bench_lm: {machine_note()}; uptime: {uptime()}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_lm_") as tmp:
        data = prepare_data(args.workdir or Path(tmp) / "lm", args.vocab_size)
        walls = measure(args, data, Path(tmp) / "ckpt")
    report(args, walls)
    print(f"\nbench_lm finished in {time.perf_counter() - started:.0f} s; {machine_note()}; uptime: {uptime()}")


if __name__ == "__main__":
    main()
