"""Which mode is fastest on a cluster: every mode's predicted update, ranked, and the commands of the best.

From a cluster (:mod:`hetfair.cluster.description`: devices and links) and a model's costs
(:mod:`hetfair.plan.model_cost`), each device becomes a rank with its precision (bf16 where the
device has it, else fp16, else fp32: ``--precision auto``'s rule) and its seconds per sample
(the model's FLOPs over the device's FLOP/s in that precision, times :data:`DEFAULT_EFFICIENCY`
for a catalogue peak; a measured rate is taken as the rate a step reaches). Every strategy that
has a cost formula (:meth:`~hetfair.parallel.Strategy.cost_variants`) is predicted with each of
its settings and each batch split (:data:`SPLITS`), and ranked by samples per second; a mode whose
state and one sample do not fit a device's memory comes after all that fit, marked.
Scaling efficiency is the predicted rate over the sum of each device's rate training alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from hetfair.cluster.description import Cluster, Device, Link
from hetfair.data.batch_plan import split_counts
from hetfair.errors import HetfairError
from hetfair.memory.sizes import format_size
from hetfair.parallel import STRATEGY_REGISTRY, ParallelConfig, Strategy
from hetfair.parallel.cost_model import Job, ModelCost, Rank, UpdateCost, compute_seconds, memory_fit

DEFAULT_EFFICIENCY = 0.4
"""The fraction of a catalogued peak FLOP/s a training step reaches (its model FLOP utilisation). Large
transformer training reports 0.4-0.55 on data-centre GPUs (Megatron-LM, PaLM's MFU table); smaller models and
consumer cards reach less (fitted to HetSeq's one-node row, benchmarks/bench_published.py: 0.28 on TITAN Xp nodes
in fp32). ``hetfair-plan --efficiency`` sets another."""

HALF_PRECISIONS = ("bf16", "fp16")
SPLITS = ("by speed", "even")
"""How a global batch is split over the ranks: in proportion to each device's speed (what ``--auto-balance``
converges to), or equally."""


def device_precision(device: Device) -> str:
    """``--precision auto``'s choice for the device: bf16 where it has it, else fp16, else fp32."""
    return next((precision for precision in HALF_PRECISIONS if precision in device.flops), "fp32")


def seconds_per_sample(device: Device, model: ModelCost, efficiency: float) -> float:
    """Forward and backward of one sample on ``device`` in its precision."""
    rate = device.flops[device_precision(device)] * (1.0 if device.measured else efficiency)
    return model.flops_per_sample / rate


def uses_gloo(cluster: Cluster) -> bool:
    """A cluster of CPUs trains over gloo, whose collectives share the processors with the compute."""
    return all(device.kind == "cpu" for _node, device in cluster.devices)


@dataclass(frozen=True)
class Prediction:
    """One mode with one setting and one split, predicted."""

    backend: str
    config: ParallelConfig
    split: str
    job: Job
    cost: UpdateCost
    micro_batches: tuple[int, ...]
    peaks: tuple[int, ...]
    lossy: bool
    alone: float
    """Samples per second of every device training alone, summed."""

    @property
    def fits(self) -> bool:
        return all(self.micro_batches)

    @property
    def samples_per_second(self) -> float:
        return self.job.samples / self.cost.seconds

    @property
    def efficiency(self) -> float:
        return self.samples_per_second / self.alone

    def mode_flags(self) -> str:
        """The flags that select this mode and its settings, as ``hetfair-train`` takes them."""
        return " ".join(_flags(self.config))

    def label(self) -> str:
        return self.mode_flags() + (" (lossy)" if self.lossy else "")


def rank_of(device: Device, node: int, batch: int, model: ModelCost, efficiency: float) -> Rank:
    return Rank(node, seconds_per_sample(device, model, efficiency), device.memory, device.memory_bandwidth, batch,
                device_precision(device) != "fp32", device.step_overhead)


def build_job(cluster: Cluster, model: ModelCost, batches: Sequence[int], efficiency: float) -> Job:
    """The cost model's job: one rank per device of ``cluster`` (node-major), rank ``r`` taking ``batches[r]``."""
    ranks = tuple(rank_of(device, node, batches[r], model, efficiency)
                  for r, (node, device) in enumerate(cluster.devices))
    return Job(model, ranks, tuple(node.link for node in cluster.nodes), cluster.slowest_network_link(),
               overlaps=not uses_gloo(cluster))


def split(cluster: Cluster, model: ModelCost, global_batch: int, how: str, efficiency: float) -> list[int]:
    """``global_batch`` over the devices: by speed or even (:data:`SPLITS`)."""
    world = cluster.world_size
    if how == "even":
        return split_counts(global_batch, [1.0] * world, [global_batch] * world)
    speeds = [1.0 / seconds_per_sample(device, model, efficiency) for _node, device in cluster.devices]
    return split_counts(global_batch, speeds, [global_batch] * world)


def alone_rate(job: Job) -> float:
    """Samples per second of each rank training its batch alone (its forward, backward and whole optimizer step),
    summed over the ranks."""
    total = 0.0
    for rank in job.ranks:
        if rank.batch == 0:  # a split may leave a slow device nothing: it adds nothing
            continue
        single = Job(job.model, (rank,), job.intra[:1], job.network, job.overlaps)
        compute, step = compute_seconds(single, [1.0])
        total += rank.batch / (compute + step)
    return total


def predict_all(cluster: Cluster, model: ModelCost, global_batch: int,
                efficiency: float = DEFAULT_EFFICIENCY) -> list[Prediction]:
    """Every mode, setting and split, ranked: those that fit first, fastest first, exact before lossy at equal speed."""
    predictions, splits = [], []
    for how in SPLITS:
        batches = split(cluster, model, global_batch, how, efficiency)
        if batches in splits:
            continue  # the devices are alike: one split is the other
        splits.append(batches)
        job = build_job(cluster, model, batches, efficiency)
        alone = alone_rate(job)
        for backend, strategy in _strategies().items():
            for config in strategy.cost_variants(backend, job):
                predictions.append(predict(backend, strategy, config, job, how, alone))
    return sorted(predictions, key=lambda p: (not p.fits, -p.samples_per_second, p.lossy))


def predict(backend: str, strategy: type[Strategy], config: ParallelConfig, job: Job, split_name: str,
            alone: float) -> Prediction:
    """One mode's prediction; where a rank's batch does not fit its memory in one micro-batch, the update takes as
    many micro-batches as the tightest rank needs (:attr:`Job.accumulation`)."""
    cost = strategy.predict(config, job)
    micro, peaks = memory_fit(job, cost.state_memory)
    steps = max(-(-rank.batch // size) for rank, size in zip(job.ranks, micro)) if all(micro) else 1
    if steps > 1:
        job = replace(job, accumulation=steps)
        cost = strategy.predict(config, job)
    return Prediction(backend, config, split_name, job, cost, micro, peaks, strategy.changes_numbers(config, job),
                      alone)


def links(cluster: Cluster) -> list[str]:
    """The links the plan weighs, a line: the network between nodes (the slowest hop) and each node's own."""
    inside = [f"inside {node.name} {_link(node.link)}" for node in cluster.nodes if len(node.devices) > 1]
    between = [f"between nodes {_link(cluster.slowest_network_link())}"] if len(cluster.nodes) > 1 else []
    return ["links: " + "; ".join(between + inside)] if between or inside else []


def _link(link: Link) -> str:
    return f"{link.bandwidth * 8 / 1e9:.3g} Gbit/s, {link.latency * 1e6:.3g} us"


def table(predictions: Sequence[Prediction], rows: int) -> list[str]:
    """The ranked table: the first ``rows`` predictions, one line each, aligned."""
    header = ("#", "mode", "split", "update", "samples/s", "efficiency", "comm shown", "peak memory", "fits")
    lines = [header]
    for index, p in enumerate(predictions[:rows], 1):
        tightest = max(range(len(p.peaks)), key=lambda r: p.peaks[r] / p.job.ranks[r].memory)
        lines.append((str(index), p.label(), p.split, _ms(p.cost.seconds), f"{p.samples_per_second:,.1f}",
                      f"{p.efficiency:.2f}", _ms(p.cost.exposed),
                      f"{format_size(p.peaks[tightest])} of {format_size(p.job.ranks[tightest].memory)}",
                      "yes" if p.fits else "no"))
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    return [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]


def node_commands(prediction: Prediction, cluster: Cluster, train_flags: str, port: int = 12345) -> list[str]:
    """One ``hetfair-train`` command per node that runs ``prediction``: its ranks' micro-batches (proportional to
    their shares of the split, the global batch in as many steps as the smallest memory needs; ranks that load the
    same samples, a pipeline's, take their shares together) and precisions."""
    job = prediction.job
    steps = max(-(-rank.batch // micro) for rank, micro in zip(job.ranks, prediction.micro_batches))
    shares = [max(1, rank.batch // steps) for rank in job.ranks]
    groups = STRATEGY_REGISTRY.get(prediction.backend).data_groups(prediction.config, job.world)
    for group in groups:
        together = sum(shares[rank] for rank in group)  # ranks that load the same samples take their sum each
        for rank in group:
            shares[rank] = together
    total = sum(shares[group[0]] for group in groups)
    commands, first = [], 0
    for index, node in enumerate(cluster.nodes):
        ranks = range(first, first + len(node.devices))
        sizes = ",".join(str(shares[r]) for r in ranks)
        precisions = ",".join(device_precision(device) for device in node.devices)
        commands.append(" ".join(part for part in (
            f"hetfair-train {train_flags}".rstrip(), prediction.mode_flags(),
            f"--global-batch-size {total * steps} --max-sentences {sizes} --precision {precisions}",
            f"--distributed-world-size {job.world} --distributed-init-method tcp://{cluster.nodes[0].name}:{port}",
            f"--distributed-gpus {len(node.devices)} --distributed-rank {first}") if part))
        first += len(node.devices)
    return commands


def _strategies() -> dict[str, type[Strategy]]:
    """Every registered strategy that loads, by name."""
    loaded = {}
    for name in STRATEGY_REGISTRY.names():
        try:
            loaded[name] = STRATEGY_REGISTRY.get(name)
        except HetfairError:  # a plugin that fails to import is not weighed (choosing it says why)
            continue
    return loaded


def _flags(config: ParallelConfig) -> list[str]:
    """``config``'s settings that differ from a default one of its backend, as flags."""
    default = ParallelConfig(config.ddp_backend).settings()
    flags = [f"--ddp-backend {config.ddp_backend}"]
    for flag, value in config.settings().items():
        if flag == "--ddp-backend" or value == default.get(flag):
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, tuple):
            flags.append(f"{flag} {','.join(f'{item:.3g}' for item in value)}")
        else:
            flags.append(f"{flag} {value}")
    return flags


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"

