"""The cluster cost model against real runs: two hosts on a shaped link, the update time predicted and measured.

Two network namespaces joined by a 20 Mbit/s ``tc tbf`` link (both directions), one ``hetfair-train`` rank
each, the toy model widened (``--toy-hidden 32768``: 393,219 parameters, 1.57 MB of fp32 gradients) so
that an update is the link's: an exact all-reduce of two ranks sends the gradients' bytes once each way,
~0.66 s at the link's TCP payload rate, against ~5 ms of compute. The prediction is the plan's
(:func:`hetfair.plan.cluster_plan.build_job` on a cluster of two ``cpu`` devices, the ``c10d`` strategy's
``predict``) with inputs measured apart from the runs: the parameters counted on the model, the bytes each
comm hook sends its own accounting (:func:`hetfair.plan.model_cost.hook_variants`), the compute timed here
in-process, the bandwidth the tbf rate's TCP payload.

**Tolerance.** The measured update lies within :data:`TOLERANCE` of the predicted one. The alpha-beta model
leaves out, on this test bed: the TCP acknowledgements that share each host's shaped egress with its data
(~2.5%: one 66-byte ACK per two 1514-byte frames), gloo's handshakes between the ring's steps, and the
per-update latency-bound collectives (a few hundred microseconds each, measured 145 us per hop between
namespaces). Measured: a plain gloo all-reduce of 1.7 MB between two namespaces at 20 Mbit/s took 1.00-1.08x
its prediction; hetfair's c10d update 1.04-1.13x (here and in ``benchmarks/bench_cluster_model.py`` at 50 and
100 Mbit/s, 2 and 4 hosts; at 10 Mbit/s, 1.27x: tbf's 50 ms queue is then a few frames, keep 20). Single
updates spread by +-10% (TCP's window after the compute's idle gap), so the median of the updates after
:data:`WARM_UP` is compared. A busy 2-core CI machine adds scheduling delays to the few milliseconds of
compute, not to the link's time. 25% holds all of that and still fails a model that forgets a collective,
counts the all-reduce once instead of both ways (0.5x) or the gradients twice (2x). The bf16 hook's case
checks a difference the model predicts: its update over the exact one's, measured against predicted within
:data:`RATIO_TOLERANCE` (predicted 0.51; measured 0.485-0.57 on a quiet machine, and 0.645 once in a CI run's
first pass, beside another worker's tests: the bf16 update is the shorter, so the CPU-bound part of an update
that the model leaves out (the hook's cast and callbacks, gloo's handshakes, scheduling) weighs more in it and
grows with the machine's load). 0.2 still fails the accounting errors this case is for: the hook's bytes
counted as fp32 give 1.0, as int8 0.25.

``serial`` (``conftest.SERIAL_GROUPS``): the ratio is a measured rate, which assumes a machine not otherwise
busy, as the project's serial marker says; nothing here holds a deadline on a peer.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import subprocess_env, rank_flags
from hetfair.cluster.description import cluster_from_dict
from hetfair.launch.rendezvous import SECRET_ENV
from hetfair.parallel import STRATEGY_REGISTRY, ParallelConfig
from hetfair.parallel.cost_model import Job, ModelCost
from hetfair.plan.cluster_plan import build_job
from hetfair.plan.model_cost import hook_variants
from multi_host import start_on
from toy_plugin import Blobs, ToyMLP
from toy_reference import toy_train_args

HIDDEN = 32768
BATCH = 16
"""Samples per rank and update."""
UPDATES = 10
WARM_UP = 3
"""Updates left out of the measured time: the first (DDP's first bucket layout, caches), the second (its rebuilt
buckets) and the third (TCP's window still growing: measured 20-30% slower with the bf16 hook)."""
RATE = "20mbit"
BANDWIDTH = 20e6 / 8 * 1448 / 1514
"""The TCP payload the tbf rate carries: tbf counts whole 1514-byte frames, of which 1448 bytes are payload."""
LATENCY = 145e-6
"""A 4-byte gloo all-reduce between two namespaces, over its two hops (bench_cluster_model measured 144-146 us)."""
TOLERANCE = 0.25
RATIO_TOLERANCE = 0.2


def toy_model_cost(model: torch.nn.Module) -> ModelCost:
    """The toy model's costs: its parameters counted, each comm hook's bytes as the hook counts them (SGD: no
    optimizer state; 6 FLOPs per parameter and sample, the rate below being measured in the same unit)."""
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    return ModelCost(parameters=count, flops_per_sample=6.0 * count, activation_bytes=0, optimizer_ratio=0.0,
                     units=1, largest_unit_bytes=4 * count, hooks=hook_variants(params))


def seconds_per_sample(model: torch.nn.Module) -> float:
    """One sample's forward, backward and SGD step here, in-process (the median of a few updates of BATCH)."""
    data = Blobs(BATCH, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for _ in range(12):
        started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(data.inputs), data.labels).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:]) / BATCH


def planned_job(model: torch.nn.Module) -> Job:
    """The plan's job of two hosts on the link, each a ``cpu`` device at the compute rate measured here."""
    cost = toy_model_cost(model)
    device = {"kind": "cpu", "memory": "1G", "fp32": cost.flops_per_sample / seconds_per_sample(model)}
    cluster = cluster_from_dict({"network": {"bandwidth": BANDWIDTH, "latency": LATENCY},
                                 "node": [{"devices": [device]}, {"devices": [device]}]}, "test")
    job = build_job(cluster, cost, [BATCH, BATCH], efficiency=1.0)
    assert not job.overlaps  # CPUs over gloo
    return job


def predicted_update(job: Job, hook: str) -> float:
    """Seconds of one update of ``job`` with ``--ddp-comm-hook hook``, as the ``c10d`` strategy predicts it."""
    return STRATEGY_REGISTRY.get("c10d").predict(ParallelConfig("c10d", ddp_comm_hook=hook), job).seconds


def measured_update(network, tmp_path: Path, name: str, *flags: str) -> float:
    """The median seconds of rank 0's updates after the warm-up, from its JSON progress lines (one per update)."""
    init = f"tcp://{network.hosts[0].address}:29500"
    env = {**subprocess_env(), SECRET_ENV: "the job's secret"}
    procs = []
    for rank in range(2):
        args = toy_train_args(tmp_path / name, None, ("--toy-hidden", str(HIDDEN), "--toy-train-size", "2000",
                                                      "--max-update", str(UPDATES), "--log-format", "json",
                                                      "--log-interval", "1", *flags))
        procs.append(start_on(network, rank, [*args, "--max-sentences", str(BATCH), *rank_flags(rank, 2, init)],
                              tmp_path, env))
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _out, err in outputs]
    walls = [record["wall"] for record in _progress(outputs[0][0] + outputs[0][1])]
    assert len(walls) == UPDATES, walls
    return statistics.median(b - a for a, b in zip(walls[WARM_UP:], walls[WARM_UP + 1:]))


def _progress(text: str) -> list[dict]:
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [record for record in records if record.get("phase") == "train_inner"]


@pytest.fixture
def shaped_pair(make_network):
    network = make_network(2)
    for index in range(2):
        network.shape(index, RATE, burst="256kbit")  # a bucket of a few frames: the rate, not the bucket, limits
    return network


def test_exact_all_reduce_update_takes_the_predicted_time_and_bf16_the_predicted_share_of_it(shaped_pair, tmp_path):
    job = planned_job(ToyMLP(HIDDEN))
    exact_predicted, bf16_predicted = predicted_update(job, "none"), predicted_update(job, "bf16")
    exact = measured_update(shaped_pair, tmp_path, "exact")
    bf16 = measured_update(shaped_pair, tmp_path, "bf16", "--ddp-comm-hook", "bf16")
    report = (f"exact: measured {exact * 1e3:.0f} ms, predicted {exact_predicted * 1e3:.0f} ms; bf16: measured "
              f"{bf16 * 1e3:.0f} ms, predicted {bf16_predicted * 1e3:.0f} ms")
    assert abs(exact - exact_predicted) <= TOLERANCE * exact_predicted, report
    assert abs(bf16 / exact - bf16_predicted / exact_predicted) <= RATIO_TOLERANCE, report
