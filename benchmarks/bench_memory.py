"""Per-rank memory and update time of BERT training: DDP, ZeRO-1, even fully sharded (FSDP2), hetfair's uneven
engine with equal (1:1) and 1:3 shards;
and the largest BERT a 1:3 memory pair can train with even and with uneven shards.

    python benchmarks/bench_memory.py [--layers 12,24] [--updates 4] [--rounds 1] [--budgets 1G,3G]
                                      [--modes "FSDP2 even,uneven 1:3"] [--max-sentences 2]
                                      [--also-tree LABEL=PATH]   # its uneven modes too, alternating

Every run is the product as users run it: ``hetfair-train --task bert`` (bert_base's width, ``--layers``
encoder layers) on the Jargon File's data (:func:`bench_bert.prepare_data`), two ranks of one
process each, ``--max-sentences 2``, Adam. Each rank's peak resident memory (its worker's, through
the first update: building, sharding, gathering and the first step; a rank's worker is a child of
the launcher's fork server, out of its launcher's ``RUSAGE_CHILDREN``) and the bytes of state it
holds come from the ``memory |`` table the run prints; the time per update is the
median of the ``train_inner`` lines after the first update. The modes alternate inside each round.

The largest model: with ``--memory-budget`` set to ``--budgets`` (a 1:3 pair), the start-up fit
check (each rank's predicted state plus its largest gathered unit against its budget) decides
whether a layer count fits, with the budgets' own shares (uneven) or with ``--shard-fractions 1,1``
(even); the largest that fits is found by doubling then bisecting (each probe stops once the check
has passed), then one update of each confirms it (the held state of the small rank against its budget).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_bert import prepare_data  # noqa: E402
from benchmarks.common import (  # noqa: E402
    SourceTree,
    free_port,
    machine_note,
    print_table,
    source_trees,
    subprocess_env,
)
from hetfair.memory.sizes import format_size, parse_size  # noqa: E402

MODES: dict[str, list[str]] = {
    "DDP": ["--ddp-backend", "c10d"],
    "ZeRO-1": ["--ddp-backend", "c10d", "--zero-sharding", "os"],
    "FSDP2 even": ["--ddp-backend", "fully_sharded"],
    "uneven 1:1": ["--ddp-backend", "fully_sharded", "--shard-fractions", "1,1"],
    "uneven 1:3": ["--ddp-backend", "fully_sharded", "--shard-fractions", "1,3"],
}
def train_command(data: Path, layers: int, updates: int, rank: int, init: str, save_dir: Path,
                  flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "hetfair_cli.train", "--task", "bert", "--data", str(data), "--arch", "bert_base",
             "--num-hidden-layers", str(layers), "--optimizer", "adam", "--lr", "1e-4", "--max-sentences", "2",
             "--max-update", str(updates), "--max-epoch", "0", "--no-save", "--disable-validation",
             "--save-dir", str(save_dir), "--log-format", "json", "--log-interval", "1",
             "--distributed-world-size", "2", "--distributed-rank", str(rank), "--distributed-gpus", "1",
             "--distributed-init-method", init, "--distributed-timeout", "600", *flags]


def run_job(data: Path, layers: int, updates: int, rank_flags: list[list[str]],
            workdir: Path, tree: Optional[SourceTree] = None) -> list[subprocess.CompletedProcess]:
    """Both ranks' commands at once (``rank_flags``: each rank's own flags), from ``tree`` (default: the installed
    hetfair); both finished."""
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(train_command(data, layers, updates, rank, init, workdir / "ckpt", flags),
                              env=tree.env(1) if tree else subprocess_env(1), cwd=tree.root if tree else workdir, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for rank, flags in enumerate(rank_flags)]
    outputs = [proc.communicate() for proc in procs]
    return [subprocess.CompletedProcess(proc.args, proc.returncode, *output) for proc, output in zip(procs, outputs)]


def measure(data: Path, layers: int, updates: int, rank_flags: list[list[str]], workdir: Path,
            tree: Optional[SourceTree] = None) -> dict:
    """One job: each rank's peak RSS through its first update and held state (both from the ``memory |`` table),
    the median seconds per update."""
    results = run_job(data, layers, updates, rank_flags, workdir, tree)
    for result in results:
        if result.returncode != 0:
            raise RuntimeError(f"hetfair-train failed: {result.stderr[-3000:]}")
    output = results[0].stdout + results[0].stderr
    state = [parse_size(m.group(1)) for m in re.finditer(r"^memory \| \d+ \| [^|]+ \| ([\d.]+[KMGT]?B?):", output,
                                                         re.MULTILINE)]
    seconds = [1.0 / json.loads(line)["ups"] for line in output.splitlines()
               if line.startswith("{") and '"train_inner"' in line][1:]
    peaks = [parse_size(m.group(1)) for m in re.finditer(r"^memory \| \d+ \| (?:[^|]+ \| ){4}([\d.]+[KMGT]?B?) \|",
                                                          output, re.MULTILINE)]
    return {"peak": peaks, "state": state, "seconds": statistics.median(seconds) if seconds else float("nan")}


def fits(data: Path, layers: int, budgets: str, even: bool, workdir: Path) -> bool:
    """Whether the start-up fit check passes: the run either fails before training with the check's line, or
    gets as far as its ``setup |`` line (printed after the check), where it is stopped."""
    shares = ["--shard-fractions", "1,1"] if even else []
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(train_command(data, layers, 1, rank, init, workdir / "ckpt",
                                            ["--ddp-backend", "fully_sharded", "--memory-budget", budget, *shares]),
                              env=subprocess_env(1), cwd=workdir, text=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for rank, budget in enumerate(budgets.split(","))]
    assert procs[0].stderr is not None
    lines = []
    for line in procs[0].stderr:
        lines.append(line)
        if line.startswith("setup | model"):
            break
    for proc in procs:
        proc.kill()  # the launcher: its worker gets its stop signal from the kernel
        proc.wait()
    output = "".join(lines)
    if "setup | model" in output:
        return True
    if "memory budget" in output:
        return False
    raise RuntimeError(f"hetfair-train failed for another reason: {output[-3000:]}")


def largest_fitting(data: Path, budgets: str, even: bool, workdir: Path, start: int = 2) -> int:
    """The most encoder layers that pass the fit check: doubling, then bisecting."""
    low, high = 0, start
    while fits(data, high, budgets, even, workdir):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(data, middle, budgets, even, workdir) else (low, middle)
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="12,24", help="encoder layers of the BERTs to measure (bert_base: 12)")
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="times each mode runs, alternating")
    parser.add_argument("--budgets", default="1G,3G", help="the 1:3 memory pair for the largest model")
    parser.add_argument("--skip-largest", action="store_true")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated modes to time (FSDP2 even is always one: the ratios' reference)")
    parser.add_argument("--max-sentences", type=int, default=2,
                        help="samples per rank and update (more: the compute outweighs the communication)")
    parser.add_argument("--also-tree", action="append", default=[], metavar="LABEL=PATH",
                        help="also time the uneven modes of another hetfair source tree (a git worktree, say)")
    options = parser.parse_args()
    chosen = [mode for mode in MODES if mode in {*options.modes.split(","), "FSDP2 even"}]
    modes: dict[str, tuple[list[str], Optional[SourceTree]]] = {
        mode: ([*MODES[mode], "--max-sentences", str(options.max_sentences)], None) for mode in chosen}
    for tree in source_trees(options.also_tree, "bench_memory.py")[1:]:
        modes.update({tree.tag(mode): (modes[mode][0], tree) for mode in chosen if mode.startswith("uneven")})
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        workdir = Path(tmp)
        data = prepare_data(workdir)
        runs: dict[tuple[int, str], list[dict]] = {}
        for layers in map(int, options.layers.split(",")):
            for _ in range(options.rounds):
                for mode, (flags, tree) in modes.items():
                    measured = measure(data, layers, options.updates, [flags, flags], workdir, tree)
                    runs.setdefault((layers, mode), []).append(measured)
        report(runs)
        if not options.skip_largest:
            report_largest(data, options.budgets, workdir)
    print(f"\n  {machine_note()}")


def report(runs: dict[tuple[int, str], list[dict]]) -> None:
    rows = []
    for (layers, mode), measured in runs.items():
        fsdp = statistics.median(m["seconds"] for m in runs[(layers, "FSDP2 even")])
        peak = [max(m["peak"][rank] for m in measured) for rank in range(2)]
        state = measured[0]["state"]
        seconds = statistics.median(m["seconds"] for m in measured)
        rows.append([f"bert {layers} layers", mode, format_size(peak[0]), format_size(peak[1]),
                     format_size(state[0]), format_size(state[1]), f"{seconds:.2f}", f"{seconds / fsdp:.2f}"])
    print_table("Per-rank peak RSS (through the first update), held state (memory | table) and seconds per update, 2 ranks",
                ["model", "mode", "peak 0", "peak 1", "state 0", "state 1", "s/update", "vs FSDP2"], rows)


def report_largest(data: Path, budgets: str, workdir: Path) -> None:
    even = largest_fitting(data, budgets, True, workdir)
    uneven = largest_fitting(data, budgets, False, workdir, start=max(even, 1))
    confirmed = {name: measure(data, layers, 1, [["--ddp-backend", "fully_sharded", "--memory-budget", budget,
                                                  *(["--shard-fractions", "1,1"] if name == "even" else [])]
                                                 for budget in budgets.split(",")], workdir)
                 for name, layers in (("even", even), ("uneven", uneven)) if layers}
    small = parse_size(budgets.split(",")[0])
    rows = [[name, layers, format_size(confirmed[name]["state"][0]) if layers else "-", format_size(small)]
            for name, layers in (("even", even), ("uneven", uneven))]
    print_table(f"Largest BERT (bert_base width) a {budgets} memory pair trains (the start-up fit check)",
                ["shares", "layers", "rank 0 state", "rank 0 budget"], rows,
                [f"uneven / even: {uneven / even:.2f}x the layers" if even else "even fits no layer"])


if __name__ == "__main__":
    main()
