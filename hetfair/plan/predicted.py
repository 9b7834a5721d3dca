"""``--ddp-backend auto``'s candidates ranked by the cost model on the job's own measured devices and link.

Every rank times the model on its device (:func:`hetfair.plan.measure.step_costs`: seconds per
sample and per update, in its precision) and says which node it is on; one all-reduce of the
gradients' size over every rank, timed, gives the link the job's collectives cross (its bandwidth;
its latency from a one-number all-reduce). From those the job becomes a
:class:`~hetfair.cluster.description.Cluster` of measured devices, and each candidate strategy
predicts its update (:meth:`~hetfair.parallel.Strategy.predict`). The ``plan |`` table shows the rate
of the chosen mode and of the runner-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch.distributed as dist

from hetfair.cluster.description import DEFAULT_INTRA_NODE, DEFAULT_NETWORK, Cluster, Device, Link, Node
from hetfair.parallel import STRATEGY_REGISTRY, ParallelConfig
from hetfair.parallel.collectives import timed_all_reduce
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.cost_model import ModelCost
from hetfair.plan.cluster_plan import alone_rate, build_job, predict


@dataclass(frozen=True)
class Predicted:
    """One candidate's predicted rate (plain data: the plan keeps it)."""

    backend: str
    samples_per_second: float
    efficiency: float
    fits: bool
    batches: str
    """The samples per rank it was predicted at (``4`` where alike, else ``4,8``)."""

    def words(self) -> str:
        return f"{self.backend} {self.samples_per_second:,.1f} samples/s (efficiency {self.efficiency:.2f})"


def time_link(context: DistributedContext, size: int, group: Optional[dist.ProcessGroup] = None,
              world: Optional[int] = None) -> Link:
    """The link an all-reduce over ``group`` (of ``world`` ranks; default every rank) crosses: its bandwidth from a
    timed all-reduce of ``size`` bytes, its latency from a timed one-number all-reduce (each the slowest rank's;
    a collective of the group)."""
    small, large = (timed_all_reduce(context, numbers, group) for numbers in (1, max(1, size // 4)))
    world = world or context.world_size
    ring = 2 * (world - 1)
    return Link(ring / world * size / max(large - small, 1e-9), small / ring)


def measured_cluster(facts: Sequence[dict[str, Any]], network: Optional[Link],
                     inside: Optional[Sequence[Optional[Link]]] = None) -> Cluster:
    """The job as a cluster: a node per distinct ``node`` fact (named by its first rank's ``host``), each rank a
    measured device (its ``device``: ``cpu`` or the GPU's name, ``memory``, ``precision``, ``seconds_per_sample``,
    ``step_overhead``); ``network`` between the nodes, and inside node ``i`` ``inside[i]`` where timed, else on
    one node the network's timing (the only link crossed), else the cluster file's default."""
    nodes: dict[str, list[dict[str, Any]]] = {}
    for fact in facts:
        nodes.setdefault(fact["node"], []).append(fact)
    built = []
    for index, members in enumerate(nodes.values()):
        timed = inside[index] if inside and index < len(inside) else None
        link = timed or (network if len(nodes) == 1 and network else DEFAULT_INTRA_NODE)
        built.append(Node(members[0].get("host", f"node{index}"), tuple(map(_device, members)), link))
    return Cluster(tuple(built), network or DEFAULT_NETWORK)


def _device(fact: dict[str, Any]) -> Device:
    rate = fact["flops_per_sample"] / max(fact["seconds_per_sample"], 1e-12)
    return Device(fact["device"], int(fact["memory"]), {fact["precision"]: rate}, None, True, fact["step_overhead"])


def predict_candidates(cluster: Cluster, model: ModelCost, batches: Sequence[int], candidates: Sequence[str],
                       fractions: Optional[tuple[float, ...]]) -> list[Predicted]:
    """Each candidate backend's update at its plain settings (a sharded one at ``fractions``), fastest first; none
    where a candidate has no cost formula (a plugin strategy may not: the plan then chooses by memory alone)."""
    job = build_job(cluster, model, batches, efficiency=1.0)
    alone = alone_rate(job)
    predicted = []
    for backend in candidates:
        strategy = STRATEGY_REGISTRY.get(backend)
        config = ParallelConfig(backend, shard_fractions=fractions if strategy.takes_shard_fractions else None)
        try:
            prediction = predict(backend, strategy, config, job, "as planned", alone)
        except NotImplementedError:
            return []
        shown = str(batches[0]) if len(set(batches)) == 1 else ",".join(map(str, batches))
        predicted.append(Predicted(backend, prediction.samples_per_second, prediction.efficiency, prediction.fits,
                                   shown))
    return sorted(predicted, key=lambda p: -p.samples_per_second)
