"""``hetfair-plan``: predict every mode on a cluster before training, rank them, print the best one's commands.

``hetfair-plan --cluster FILE`` followed by ``hetfair-train``'s own task and model flags (the model is built
once on this machine's CPU to count its FLOPs, activations and state: :mod:`hetfair.plan.model_cost`), or
``--cluster measure`` to time the model on the job's own devices and links instead of a file
(:mod:`hetfair.plan.measure`), its processes started as ``hetfair-train`` starts them (``--distributed-*``
flags, torchrun, SLURM; alone, one process on this machine's first device).
"""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING, Sequence

import torch

from hetfair.errors import ConfigError
from hetfair.options import parse_train_args
from hetfair_cli.errors import run_cli

if TYPE_CHECKING:
    from hetfair.cluster.description import Cluster
    from hetfair.parallel.context import DistributedContext
    from hetfair.parallel.cost_model import ModelCost

MEASURE = "measure"
SET_BY_THE_PLAN = ("--ddp-backend", "--global-batch-size", "--max-sentences", "--precision", "--distributed-world-size",
                   "--distributed-init-method", "--distributed-gpus", "--distributed-rank")
"""``hetfair-train`` flags each node's command gets from the plan (each takes one value)."""


def plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetfair-plan", allow_abbrev=False,
        description="Predict every parallelism mode of hetfair-train on a cluster, rank them and print the "
                    "best one's command per node. Every other flag is hetfair-train's (the task, model, "
                    "optimizer and --global-batch-size).")
    parser.add_argument("--cluster", required=True, metavar="FILE|measure",
                        help="the cluster file (TOML or YAML, docs/cluster-file.md), or 'measure': this machine's "
                             "devices, timed on the model")
    parser.add_argument("--efficiency", type=float, default=None, metavar="E",
                        help="the fraction of a catalogued peak FLOP/s a training step reaches (default 0.4; "
                             "measured rates are used as they are)")
    parser.add_argument("--rows", type=int, default=12, metavar="N", help="rows of the ranked table to print")
    return parser


def plan_command(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        plan_parser().parse_args(["--help"])  # prints, and exits 0 as argparse does
    own, rest = plan_parser().parse_known_args(argv)
    _check_own(own)
    sized = any(arg.split("=", 1)[0] in ("--max-sentences", "--max-tokens") for arg in rest)
    args = parse_train_args(rest if sized else [*rest, "--max-sentences", "1"])  # the plan sets each node's
    from hetfair.plan.cluster_plan import DEFAULT_EFFICIENCY

    args.plan_options = {"efficiency": own.efficiency or DEFAULT_EFFICIENCY, "rows": own.rows,
                         "train_flags": _train_flags(rest)}
    if own.cluster == MEASURE:
        from hetfair.launch.launcher import launch

        launch(args, measure_and_plan)
        return 0
    from hetfair.cluster.description import load_cluster
    from hetfair.parallel.context import DistributedContext
    from hetfair.run.wiring import RunWiring

    cluster = load_cluster(own.cluster)
    wiring = RunWiring(args, DistributedContext(0, 1, 0, torch.device("cpu")))
    print_plan(cluster, wiring.model_cost(wiring.build_components()), args)
    return 0


def measure_and_plan(args: argparse.Namespace, context: "DistributedContext") -> None:
    """One process of ``--cluster measure``: time the model on its device and the links (with the job's other
    processes), then the master prints the plan for what was measured."""
    from hetfair.plan.measure import measure_cluster
    from hetfair.plan.probe import longest_sample_batches
    from hetfair.precision.auto import resolved_precision
    from hetfair.run.wiring import RunWiring

    wiring = RunWiring(args, context)
    components = wiring.build_components()
    cost = wiring.model_cost(components)
    budget = args.memory_budget if isinstance(args.memory_budget, int) else None
    cluster = measure_cluster(context, components.model, components.criterion,
                              longest_sample_batches(components.train_data, components.task.collater), cost,
                              resolved_precision(args.precision, context.device), budget)
    if context.is_master:
        print_plan(cluster, cost, args)


def print_plan(cluster: "Cluster", cost: "ModelCost", args: argparse.Namespace) -> None:
    """The ranked table and the commands of the fastest and of the fastest exact mode, on standard output."""
    from hetfair.plan.cluster_plan import links, node_commands, predict_all, table

    options = args.plan_options
    batch = _global_batch(args, cluster.world_size)
    predictions = predict_all(cluster, cost, batch, options["efficiency"])
    fitting = [p for p in predictions if p.fits]
    print(f"plan | {_count(cluster.world_size, 'device')} on {_count(len(cluster.nodes), 'node')}, "
          f"global batch {batch}, {cost.parameters:,} parameters, {cost.flops_per_sample / 1e9:.3g} GFLOP per sample "
          f"(forward and backward)")
    print("\n".join("plan | " + line for line in [*links(cluster), *table(predictions, options["rows"])]))
    if not fitting:
        raise ConfigError(f"no mode fits the cluster's memory with a global batch of {batch}: give a smaller "
                          f"--global-batch-size, or devices with more memory")
    best = fitting[0]
    exact = next(p for p in fitting if not p.lossy)
    flags = options["train_flags"]
    print(f"\nThe fastest predicted: {best.label()}, {best.samples_per_second:,.1f} samples/s "
          f"(efficiency {best.efficiency:.2f}). One command per node:")
    print("\n".join(node_commands(best, cluster, flags)))
    if exact is not best:
        print(f"\nThe fastest exact (no lossy communication): {exact.label()}, {exact.samples_per_second:,.1f} "
              f"samples/s (efficiency {exact.efficiency:.2f}):")
        print("\n".join(node_commands(exact, cluster, flags)))


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}{'' if number == 1 else 's'}"


def _check_own(own: argparse.Namespace) -> None:
    if own.efficiency is not None and not 0 < own.efficiency <= 1:
        raise ConfigError(f"--efficiency {own.efficiency}: give a fraction of the peak, above 0 and at most 1")
    if own.rows < 1:
        raise ConfigError(f"--rows {own.rows}: give at least 1")


def _global_batch(args: argparse.Namespace, world_size: int) -> int:
    """``--global-batch-size``, else ``--max-sentences`` (one number) on every device."""
    if args.global_batch_size:
        return int(args.global_batch_size)
    if isinstance(args.max_sentences, int):
        return args.max_sentences * world_size
    raise ConfigError("hetfair-plan needs the batch to weigh: give --global-batch-size N (samples per update over "
                      "the whole cluster)")


def _train_flags(argv: Sequence[str]) -> str:
    """``argv`` without the flags the plan sets in each node's command (:data:`SET_BY_THE_PLAN`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in SET_BY_THE_PLAN:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return shlex.join(kept)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hetfair-plan", plan_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
