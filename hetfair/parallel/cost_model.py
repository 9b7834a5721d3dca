"""What one update costs in each mode: compute, communication, memory, predicted before a GPU-hour is spent.

One function per strategy (:func:`replicated`, :func:`fully_sharded`, :func:`uneven_sharded`,
:func:`hybrid_sharded`, :func:`outer_loop`, :func:`pipeline`); each strategy names its own through
:meth:`hetfair.parallel.Strategy.predict`, so the cluster plan (:mod:`hetfair.plan.cluster_plan`)
never asks which mode runs. Every function takes a :class:`Job` (the model's costs, each rank's
device speed, memory and batch, the links) and returns an :class:`UpdateCost`.

**Compute.** Rank ``r`` takes ``b_r`` samples at ``s_r`` seconds each (forward and backward, in its
precision) and ``o_r`` seconds of overhead per update (the framework, kernel launches; measured where known):
``t_r = o_r + b_r s_r``, a third forward, two thirds backward; its optimizer step reads and
writes ``(3 + 2 k) x`` the bytes of the parameters it holds (parameter, gradient, ``k`` bytes of
optimizer state per parameter byte: Adam's 2) at its device's memory bandwidth. The update waits
for the slowest rank.

**Communication** is the alpha-beta model of ring collectives over the slowest link the ring crosses
(:class:`Link`: latency ``a`` seconds, bandwidth ``B`` bytes/s), for ``W`` ranks and ``S`` bytes:
all-reduce ``2 (W - 1) a + 2 (W - 1) / W * S / B``; all-gather or reduce-scatter of ``S`` in all
``(W - 1) a + (W - 1) / W * S / B``; an all-gather where each rank sends ``s`` packed bytes
``(W - 1) a + (W - 1) s / B``. A collective issued once per DDP bucket or sharding unit pays the
latency once per bucket or unit. Where the mode overlaps communication with computation (on GPUs:
NCCL's own stream), only what outlasts the overlapped compute shows, and never less than the last
bucket or the first unit, which nothing can hide; on CPUs (gloo), the collectives share the
processors with the compute, and nothing overlaps (:attr:`Job.overlaps`).

**Memory** per rank: the parameters, gradients and optimizer state it holds (fp32), the largest
unit gathered whole where it shards, and its micro-batch's activations (``activation_bytes`` per
sample, measured in fp32; half of it in fp16/bf16, where autocast keeps activations in half).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hetfair.cluster.description import Link
from hetfair.parallel.outer_exchange import bytes_sent, payload_bytes

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default bucket cap (``bucket_cap_mb=25``): the gradients leave in buckets of this size."""

FORWARD_SHARE = 1 / 3
"""The share of a forward and backward step that is the forward (the backward costs about twice)."""

HALF_ACTIVATIONS = 0.5
"""Activations in fp16/bf16 relative to fp32 (autocast saves the matmuls' inputs in half)."""



def all_reduce(link: Link, size: float, world: int, messages: int = 1) -> float:
    """Seconds of a ring all-reduce of ``size`` bytes over ``world`` ranks, issued as ``messages`` collectives."""
    if world <= 1:
        return 0.0
    return messages * 2 * (world - 1) * link.latency + 2 * (world - 1) / world * size / link.bandwidth


def all_gather(link: Link, size: float, world: int, messages: int = 1) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) of ``size`` bytes in all over ``world`` ranks."""
    if world <= 1:
        return 0.0
    return messages * (world - 1) * link.latency + (world - 1) / world * size / link.bandwidth


def reduce_scatter(job: "Job", link: Link, size: float, world: int, messages: int = 1) -> float:
    """Seconds of a reduce-scatter of ``size`` bytes in all: a ring's half of an all-reduce, except over gloo (a job
    that does not overlap: CPUs), whose reduce-scatter is a whole all-reduce of the input (measured between test
    hosts: the same seconds and bytes as an all-reduce; benchmarks/bench_cluster_model.py)."""
    if not job.overlaps:
        return all_reduce(link, size, world, messages)
    return all_gather(link, size, world, messages)


def send_to_all(link: Link, per_rank: float, world: int, messages: int = 1) -> float:
    """Seconds of an all-gather in which each of ``world`` ranks sends ``per_rank`` bytes to every other."""
    if world <= 1:
        return 0.0
    return messages * (world - 1) * link.latency + (world - 1) * per_rank / link.bandwidth


@dataclass(frozen=True)
class HookVariant:
    """A ``--ddp-comm-hook`` with its own flags' values, and the share of the fp32 gradients' bytes it sends."""

    name: str
    options: tuple[tuple[str, Any], ...]
    sent: float
    lossy: bool

    def flags(self) -> str:
        return " ".join([f"--ddp-comm-hook {self.name}", *(f"{flag} {value}" for flag, value in self.options)])


EXACT_ALL_REDUCE = HookVariant("none", (), 1.0, False)


@dataclass(frozen=True)
class ModelCost:
    """What the model costs whatever the device: measured once on the model (:mod:`hetfair.plan.model_cost`)."""

    parameters: int
    """Trainable values (4 bytes each in fp32: parameters, gradients and the exchanged states are fp32)."""
    flops_per_sample: float
    """Forward and backward FLOPs of one sample (torch's ``FlopCounterMode``)."""
    activation_bytes: int
    """Bytes one sample's forward saves for its backward, in fp32."""
    optimizer_ratio: float
    """Bytes of optimizer state per parameter byte (Adam 2, SGD with momentum 1)."""
    units: int
    """Sharding units (a sharded mode gathers each in one collective), the rest of the model counted as one."""
    largest_unit_bytes: int
    """fp32 bytes of the largest unit a sharded rank gathers whole."""
    largest_parameter_bytes: int = 0
    """fp32 bytes of the largest parameter: ZeRO-1 shards whole parameters, so no shard is smaller."""
    boundary_bytes: int = 0
    """fp32 bytes of one sample's activations at a pipeline stage boundary (0: the model cannot be pipelined)."""
    hooks: tuple[HookVariant, ...] = (EXACT_ALL_REDUCE,)
    """The comm hook settings to weigh, with what each sends of these gradients (PowerSGD's depends on shapes)."""

    def hook(self, name: str, options: Sequence[tuple[str, Any]]) -> HookVariant:
        """The variant of :attr:`hooks` with this name and these options (a hook's other flags at their defaults)."""
        given = dict(options)
        return next(hook for hook in self.hooks if hook.name == name and all(
            given.get(flag) == value for flag, value in hook.options))

    @property
    def parameter_bytes(self) -> int:
        return 4 * self.parameters


@dataclass(frozen=True)
class Rank:
    """One process of the job: its node, its device's speed and memory, its share of the global batch."""

    node: int
    seconds_per_sample: float
    """Forward and backward of one sample in the rank's precision."""
    memory: int
    memory_bandwidth: Optional[float]
    """Bytes per second (``None``: unknown; the optimizer step is then not counted)."""
    batch: int
    """Samples this rank trains per update."""
    half: bool = False
    """It trains in fp16/bf16 (activations take :data:`HALF_ACTIVATIONS` of fp32's)."""
    step_overhead: float = 0.0
    """Seconds each update's step costs beyond its samples' (the framework, kernel launches)."""

    def forward_backward(self, accumulation: int = 1) -> float:
        """Seconds of this rank's forward and backward passes in one update of ``accumulation`` micro-batches."""
        return accumulation * self.step_overhead + self.batch * self.seconds_per_sample


@dataclass(frozen=True)
class Job:
    """A job as the cost model sees it: the model, the ranks (node-major), the links and whether comm overlaps."""

    model: ModelCost
    ranks: tuple[Rank, ...]
    intra: tuple[Link, ...]
    """The link between the devices of each node, by node."""
    network: Link
    """The slowest link between nodes (a ring over the nodes runs at its slowest hop)."""
    overlaps: bool
    """Collectives run beside the compute (GPUs); on CPUs (gloo) they share the processors: no overlap."""
    accumulation: int = 1
    """Micro-batches per update: all but the last skip the gradients' synchronisation (``no_sync``), so it
    overlaps only the last one's backward; a sharded mode gathers its units for each of them."""

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def nodes(self) -> int:
        return len({rank.node for rank in self.ranks})

    @property
    def per_node(self) -> int:
        """Ranks per node (the most on any node)."""
        return max(sum(1 for rank in self.ranks if rank.node == node) for node in {r.node for r in self.ranks})

    @property
    def samples(self) -> int:
        return sum(rank.batch for rank in self.ranks)

    def ring_link(self) -> Link:
        """The link a ring over every rank runs at: the network's over several nodes, else the node's own."""
        if self.nodes > 1:
            slowest = min(self.intra, key=lambda link: link.bandwidth)
            return Link(min(self.network.bandwidth, slowest.bandwidth), max(self.network.latency, slowest.latency))
        return self.intra[self.ranks[0].node]

    def intra_link(self) -> Link:
        """The slowest link inside any node."""
        return Link(min(link.bandwidth for link in self.intra), max(link.latency for link in self.intra))


@dataclass(frozen=True)
class UpdateCost:
    """One update, predicted: where its time goes, and what each rank holds."""

    compute: float
    """Seconds of the slowest rank's forward, backward and optimizer step."""
    communication: float
    """Seconds the collectives take in all (per update; an outer loop's round exchange divided by its interval)."""
    exposed: float
    """Seconds of communication the compute does not hide."""
    state_memory: tuple[int, ...]
    """Bytes each rank holds besides its activations: its parameters, gradients, optimizer (and outer-loop)
    state, and where it shards the largest unit gathered whole (:func:`memory_fit` adds the activations)."""
    network_bytes: float
    """Bytes one rank sends across the slowest link per update."""

    @property
    def seconds(self) -> float:
        return self.compute + self.exposed


# -- the parts every mode shares -------------------------------------------------------------------
def compute_seconds(job: Job, held_fraction: Sequence[float]) -> tuple[float, float]:
    """The slowest rank's (forward+backward, optimizer step) seconds, its optimizer stepping ``held_fraction[r]``
    of the parameters. The step is counted with the rank whose forward and backward end last."""
    slowest = max(range(job.world), key=lambda r: job.ranks[r].forward_backward(job.accumulation))
    rank = job.ranks[slowest]
    step_bytes = (3 + 2 * job.model.optimizer_ratio) * job.model.parameter_bytes * held_fraction[slowest]
    step = step_bytes / rank.memory_bandwidth if rank.memory_bandwidth else 0.0
    return rank.forward_backward(job.accumulation), step


def exposed(job: Job, communication: float, overlappable: float, pieces: int) -> float:
    """Seconds of ``communication`` (in ``pieces`` collectives) left once ``overlappable`` compute seconds hide it:
    on GPUs at least the last piece; on CPUs all of it."""
    if not job.overlaps or communication == 0.0:
        return communication
    return max(communication / max(pieces, 1), communication - overlappable)


def activation_bytes(job: Job, rank: Rank, micro_batch: int) -> int:
    return int(micro_batch * job.model.activation_bytes * (HALF_ACTIVATIONS if rank.half else 1.0))


def memory_fit(job: Job, state: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each rank's micro-batch (the most of its batch its memory holds beside ``state[r]`` bytes; 0: not even one
    sample) and its peak memory with it."""
    sizes, peaks = [], []
    for r, rank in enumerate(job.ranks):
        per_sample = max(activation_bytes(job, rank, 1), 1)
        size = max(0, min(rank.batch, int((rank.memory - state[r]) // per_sample)))
        sizes.append(size)
        peaks.append(state[r] + activation_bytes(job, rank, max(size, 1)))
    return tuple(sizes), tuple(peaks)


def _bytes(state: Sequence[float]) -> tuple[int, ...]:
    return tuple(int(value) for value in state)


def ddp_buckets(size: float) -> int:
    return max(1, math.ceil(size / DDP_BUCKET_BYTES))


def stats_sync(job: Job) -> float:
    """The update's one all-reduce of its statistics (a few numbers: latency only), across every rank."""
    return all_reduce(job.ring_link(), 0.0, job.world)


# -- one function per mode ------------------------------------------------------------------------
def replicated(job: Job, sent_fraction: float = 1.0, zero: bool = False) -> UpdateCost:
    """``c10d`` (DDP), its comm hook sending ``sent_fraction`` of the fp32 gradients' bytes; ``zero``: ZeRO-1,
    each rank steps ``1 / W`` of the optimizer state and the stepped parameters are gathered after the step."""
    model, world = job.model, job.world
    size = model.parameter_bytes
    buckets = ddp_buckets(size)
    link = job.ring_link()
    gradients = all_reduce(link, sent_fraction * size, world, buckets)
    held = [1 / world if zero else 1.0] * world
    forward_backward, step = compute_seconds(job, held)
    hidden = exposed(job, gradients, (1 - FORWARD_SHARE) * forward_backward / job.accumulation, buckets)
    # ZeRO-1 (torch's ZeroRedundancyOptimizer) broadcasts each rank's stepped shard from it, whole parameters: the
    # largest shard, at least the largest parameter, bounds the update. gloo's broadcast is a binomial tree (the
    # root's interface sends ceil(log2 W) copies) whose sends take (W - 1) shard-times in all (measured, W = 2, 4)
    shard = max(size / world, model.largest_parameter_bytes)
    gather = send_to_all(link, shard, world) if zero else 0.0
    sync = stats_sync(job)
    state = [size * (2 + model.optimizer_ratio * held[r]) for r in range(world)]
    rounds = math.ceil(math.log2(world)) if world > 1 else 0
    network = 2 * (world - 1) / world * sent_fraction * size + (rounds * shard if zero else 0.0)
    return UpdateCost(forward_backward + step, gradients + gather + sync, hidden + gather + sync,
                      _bytes(state), network if job.nodes > 1 else 0.0)


def fully_sharded(job: Job) -> UpdateCost:
    """``fully_sharded`` with equal shards (FSDP2): per unit and micro-batch an all-gather for the forward and
    another for the backward, and per update a reduce-scatter of the gradients; prefetching hides them behind the
    forward and the backward, all but the first unit's."""
    model, world = job.model, job.world
    units, size = model.units, model.parameter_bytes
    link, micro = job.ring_link(), job.accumulation
    gather = all_gather(link, size, world, units)
    scatter = reduce_scatter(job, link, size, world, units)
    forward_backward, step = compute_seconds(job, [1 / world] * world)
    forward = FORWARD_SHARE * forward_backward
    hidden = exposed(job, micro * gather, forward, micro * units) \
        + exposed(job, micro * gather + scatter, forward_backward - forward, micro * units)
    state = [size * (2 + model.optimizer_ratio) / world + 2 * model.largest_unit_bytes] * world
    scatter_share = (1 if job.overlaps else 2) * (world - 1) / world
    return UpdateCost(forward_backward + step, 2 * micro * gather + scatter + stats_sync(job), hidden + stats_sync(job),
                      _bytes(state), (2 * micro * (world - 1) / world + scatter_share) * size if job.nodes > 1 else 0.0)


def uneven_sharded(job: Job, fractions: Sequence[float]) -> UpdateCost:
    """``fully_sharded --shard-fractions`` (hetfair's uneven engine): rank ``r`` holds ``fractions[r]``; per unit two
    gathers per micro-batch and one reduction, prefetched and overlapped as FSDP2's (on GPUs). NCCL's are padded: each
    rank's segment to the largest share. On gloo the reduction is an all-reduce of the unit, and the gather the
    faster of a padded all-gather and an all-reduce (the engine times both at start-up; here the faster predicted)."""
    model, world = job.model, job.world
    size = model.parameter_bytes
    padded = max(fractions) * size
    link, units, micro = job.ring_link(), model.units, job.accumulation
    padded_gather = send_to_all(link, padded, world, units)
    if job.overlaps:
        gather, gather_bytes = padded_gather, (world - 1) * padded
        scatter, scatter_bytes = all_gather(link, world * padded, world, units), (world - 1) * padded
    else:
        summed_gather = all_reduce(link, size, world, units)
        summed_bytes = 2 * (world - 1) / world * size
        gather, gather_bytes = min((padded_gather, (world - 1) * padded), (summed_gather, summed_bytes))
        scatter, scatter_bytes = all_reduce(link, size, world, units), summed_bytes
    forward_backward, step = compute_seconds(job, fractions)
    forward = FORWARD_SHARE * forward_backward
    hidden = exposed(job, micro * gather, forward, micro * units) \
        + exposed(job, micro * gather + scatter, forward_backward - forward, micro * units)
    state = [size * (2 + model.optimizer_ratio) * f + 2 * model.largest_unit_bytes for f in fractions]
    return UpdateCost(forward_backward + step, 2 * micro * gather + scatter + stats_sync(job), hidden + stats_sync(job),
                      _bytes(state), 2 * micro * gather_bytes + scatter_bytes if job.nodes > 1 else 0.0)


def hybrid_sharded(job: Job) -> UpdateCost:
    """``hybrid_sharded``: FSDP2 over each node's ranks (their link), and each rank's gradient shard all-reduced
    across the nodes, every rank of a node at once over the node's one network link; hidden as FSDP2's are."""
    model, size = job.model, job.model.parameter_bytes
    group, nodes = job.per_node, job.nodes
    micro = job.accumulation
    inside = all_gather(job.intra_link(), size, group, model.units)
    scatter = reduce_scatter(job, job.intra_link(), size, group, model.units)
    across = all_reduce(job.network, size, nodes, model.units)  # G shards of size / G share the node's link
    forward_backward, step = compute_seconds(job, [1 / group] * job.world)
    forward = FORWARD_SHARE * forward_backward
    backward = exposed(job, micro * inside + scatter + across, forward_backward - forward, micro * model.units)
    hidden = exposed(job, micro * inside, forward, micro * model.units) + backward + stats_sync(job)
    state = [size * (2 + model.optimizer_ratio) / group + 2 * model.largest_unit_bytes] * job.world
    return UpdateCost(forward_backward + step, 2 * micro * inside + scatter + across + stats_sync(job), hidden,
                      _bytes(state), 2 * (nodes - 1) / nodes * size / group)


def outer_loop(job: Job, interval: int, dtype: str = "fp32", fragments: int = 1, overlap: bool = False,
               outer_copies: int = 2) -> UpdateCost:
    """``diloco`` / ``localsgd``: inner updates with the gradients all-reduced inside each node only, then every
    ``interval`` updates an exchange of every parameter over all ranks in ``dtype`` (in ``fragments``
    collectives); with ``overlap`` the exchange runs behind the next round's inner updates and shows only where
    it outlasts them. Per update: the round's exchange over ``interval``. Each rank holds ``outer_copies`` fp32
    copies of the parameters besides the model's (the anchor; DiLoCo's momentum) and, with a packed ``dtype``, an
    error-feedback residual."""
    model, world = job.model, job.world
    size = model.parameter_bytes
    group = job.per_node
    link = job.ring_link()
    if dtype == "fp32":
        exchange = all_reduce(link, size, world, fragments)
    else:
        exchange = send_to_all(link, payload_bytes(model.parameters, dtype), world, fragments)
    buckets = ddp_buckets(size)
    inside = all_reduce(job.intra_link(), size, group, buckets)
    forward_backward, step = compute_seconds(job, [1.0] * world)
    inner = exposed(job, inside, (1 - FORWARD_SHARE) * forward_backward / job.accumulation, buckets) + stats_sync(job)
    round_compute = interval * (forward_backward + step + inner)
    waited = max(0.0, exchange - round_compute) if overlap else exchange
    copies = 2 + model.optimizer_ratio + outer_copies + (1 if dtype != "fp32" else 0)
    state = [size * copies] * world
    return UpdateCost(forward_backward + step, inside + stats_sync(job) + exchange / interval,
                      inner + waited / interval, _bytes(state),
                      bytes_sent(model.parameters, dtype, world) / interval)


def pipeline(job: Job, stages: int, microbatches: int, shares: Sequence[float]) -> UpdateCost:
    """``pipeline``: ``W / stages`` pipelines, stage ``s`` (``shares[s]`` of the layers) on position ``s`` of each,
    the positions node-major (``--pipeline-layout across``: one node per stage where the nodes are the stages).

    A pipeline's batch (its ranks' batches together) runs as ``microbatches`` micro-batches through torch's
    schedules: the last micro-batch leaves the last stage after ``microbatches + stages - 1`` slots of the slowest
    stage (GPipe's and 1F1B's bubble alike). A slot is the stage's compute for one micro-batch and, at each
    boundary, the micro-batch's activations one way and their gradients the other (``boundary_bytes`` a sample,
    one message each); on CPUs they add to the slot, on GPUs the longer of the two counts. Each stage's gradients
    are all-reduced over its replicas (the other pipelines' ranks at its position). The tied embeddings' rows the
    update looks up travel between the last and the first stage, each way once (:mod:`hetfair.parallel.pipeline_tied`):
    at most the parameters outside the units, and at most a token's row per token (the boundary's bytes)."""
    model, world = job.model, job.world
    pipes = world // stages
    positions = [[job.ranks[position * pipes + pipe] for pipe in range(pipes)] for position in range(stages)]
    batch = max(sum(job.ranks[position * pipes + pipe].batch for position in range(stages)) for pipe in range(pipes))
    micro = batch / microbatches
    boundary_link = job.network if job.nodes > 1 else job.intra_link()
    hop = 2 * (boundary_link.latency + micro * model.boundary_bytes / boundary_link.bandwidth) if stages > 1 else 0.0
    works = [micro * shares[position] * max(rank.seconds_per_sample for rank in ranks) + ranks[0].step_overhead
             for position, ranks in enumerate(positions)]
    slots = [max(work, hop) if job.overlaps else work + hop for work in works]
    flight = (microbatches + stages - 1) * max(slots)
    size = model.parameter_bytes
    outside = max(0.0, size - (model.units - 1) * model.largest_unit_bytes)
    replica_link = job.intra_link() if job.nodes > 1 else job.ring_link()
    replicas = max(all_reduce(replica_link, share * size, pipes, ddp_buckets(share * size)) for share in shares)
    rows = min(outside, batch * model.boundary_bytes)  # the tied embeddings' rows the update looks up, at most
    tied = 2 * (boundary_link.latency + rows / boundary_link.bandwidth) if stages > 1 else 0.0
    forward_backward = microbatches * max(works)  # the busiest stage's own compute
    step_rank = positions[0][0]
    step = (3 + 2 * model.optimizer_ratio) * size * max(shares) / step_rank.memory_bandwidth \
        if step_rank.memory_bandwidth else 0.0
    communication = (microbatches + stages - 1) * hop + replicas + tied + stats_sync(job)
    state = [int((share * size + outside) * (2 + model.optimizer_ratio)) for share in shares for _ in range(pipes)]
    network = 2 * batch * model.boundary_bytes + 2 * rows if job.nodes > 1 else 0.0
    return UpdateCost(forward_backward + step, communication,
                      flight - forward_backward + replicas + tied + stats_sync(job), tuple(state), network)
