"""The cluster cost model against the real trainer: predicted and measured samples/s on emulated hosts.

For each number of hosts, link rate and mode that ``hetfair-plan`` weighs, this runs ``hetfair-train`` on the
namespace test bed of ``benchmarks/bench_links.py`` (one process per host, each host's link limited by ``tc tbf``
in both directions; its functions are imported, not copied) and asks the cost model for the same job: the
same hosts, link, per-host batch and mode flags (:func:`hetfair.plan.cluster_plan.predict_all`, the prediction
whose split and flags are the run's; the run's flags are the prediction's own ``mode_flags()``).

Calibration: the model's inputs are measured apart from the runs they predict.

* Compute: each host's samples/s from a single-node ``hetfair-train`` run of the same model and batch (world
  size 1, no communication), every host's at once (bench_links' ``single_node_speeds``): on this 2-core machine
  4 hosts are 4 processes on 2 cores, so a host alone would compute about twice as fast as it does in the job,
  where the synchronous modes compute on every host at the same time. Measured before and after each link's
  runs (the machine is shared; its load moves), the mean used. A host becomes a ``cpu`` device whose fp32
  rate is the model's FLOPs per sample times that rate, with no step overhead: every run trains the same
  per-host batch, so the whole update time is in the per-sample seconds (exact at this batch).
* Bandwidth: the tbf rate times :data:`TCP_PAYLOAD_SHARE` (tbf counts whole Ethernet frames; TCP carries 1448
  payload bytes in a frame of 1514); one TCP transfer's measured rate is printed beside it as a check.
* Latency: a 4-byte gloo all-reduce between the hosts, timed on the shaped link before the runs: ``2 (W - 1)``
  latencies in the alpha-beta model, so the latency is its median time over ``2 (W - 1)``.
* The model's costs: :func:`hetfair.plan.model_cost.measure_model_cost` through ``RunWiring`` (as
  ``hetfair-plan`` measures them), on the run's own flags.

Measured samples/s is bench_links' (between rank 0's first and last progress lines, the first interval of
:data:`INTERVAL` updates excluded: start-up, DDP's bucket rebuild; an interval holds one outer-loop round).
``hybrid_sharded`` is weighed by the plan only where a node has more than one process: never on this test bed.

    .venv/bin/python benchmarks/bench_cluster_model.py                      # 2 and 4 hosts x 3 links, 1:2 pair
    .venv/bin/python benchmarks/bench_cluster_model.py --nodes 2 --links 50mbit --updates 24 --modes c10d,bf16
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_links import (  # noqa: E402
    BURST,
    CpuLimits,
    Setting,
    link_throughput,
    node_env,
    run_job,
    single_node_speeds,
)
from benchmarks.common import DEFAULT_DATA, REPO_ROOT, data_subset, machine_note, print_table  # noqa: E402
from netns import Network, unavailable  # noqa: E402

MODES: dict[str, str] = {
    "c10d": "--ddp-backend c10d",
    "bf16": "--ddp-backend c10d --ddp-comm-hook bf16",
    "powersgd-r2": "--ddp-backend c10d --ddp-comm-hook powersgd --powersgd-rank 2",
    "zero1": "--ddp-backend c10d --zero-sharding os",
    "fully_sharded": "--ddp-backend fully_sharded",
    "diloco-h8": "--ddp-backend diloco --outer-interval 8",
    "diloco-h8-int4-k4": "--ddp-backend diloco --outer-interval 8 --outer-fragments 4 --outer-overlap "
                         "--outer-reduce-dtype int4",
    "hybrid_sharded": "--ddp-backend hybrid_sharded",
}
"""The modes and settings of the plan this benchmark runs, by name: the plan's flags (``Prediction.mode_flags``)."""
RUN_ONLY_FLAGS: dict[str, tuple[str, ...]] = {"powersgd-r2": ("--powersgd-start-update", "2")}
"""Flags a run needs beyond the plan's: the plan predicts PowerSGD compressing from the start (torch's default
start is update 1000, past the whole run)."""
TCP_PAYLOAD_SHARE = 1448 / 1514
"""TCP payload bytes per byte tbf counts: a 1500-byte MTU frame is 1514 bytes with its Ethernet header, of
which 1448 are payload (IP 20, TCP 20 and its timestamps 12)."""
TC_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
INTERVAL = 8
LATENCY_ROUNDS = 200


@dataclass(frozen=True)
class Row:
    nodes: int
    link: str
    speeds: str
    mode: str
    batch: int
    """Samples per host and update."""
    measured: float
    predicted: float
    compute: float
    """Predicted seconds of the update's compute."""
    exposed: float
    """Predicted seconds of communication the compute does not hide."""
    sent: float
    """Payload bytes the busiest host sent per update, measured (the whole run's, start-up included)."""
    predicted_sent: float
    """Payload bytes per update one host sends across the network, predicted."""

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured

    def cells(self) -> list[str]:
        return [str(self.nodes), self.link, self.speeds or "1:1", self.mode, f"{self.measured:.1f}",
                f"{self.predicted:.1f}", f"{self.error:+.1%}", f"{self.nodes * self.batch / self.measured * 1e3:.0f}",
                f"{self.compute * 1e3:.0f}", f"{self.exposed * 1e3:.0f}",
                f"{self.sent / 1e6:.3f}", f"{self.predicted_sent / 1e6:.3f}"]


HEADER = ["nodes", "link", "speeds", "mode", "measured sps", "predicted sps", "error", "update ms",
          "pred compute ms", "pred comm ms",
          "sent MB/update", "pred MB/update"]


# -- calibration -------------------------------------------------------------------------------
def tbf_bandwidth(rate: str) -> float:
    """Bytes/s of TCP payload a tbf ``rate`` (tc units: ``50mbit``, ``1gbit``) carries."""
    unit = next((unit for unit in TC_UNITS if rate.endswith(unit)), None)
    if unit is None:
        raise SystemExit(f"bench_cluster_model: link rate {rate!r}: give it in kbit, mbit or gbit")
    return float(rate[: -len(unit)]) * TC_UNITS[unit] / 8 * TCP_PAYLOAD_SHARE


def sent_bytes(network: Network) -> list[int]:
    """Bytes each host's interface has sent so far (frames: headers included)."""
    return [int(subprocess.run(host.command("cat", f"/sys/class/net/{host.interface}/statistics/tx_bytes"),
                               capture_output=True, text=True, check=True).stdout) for host in network.hosts]


def latency_worker(rounds: int) -> None:
    """One rank of the latency probe (MASTER_ADDR etc. in the environment): rank 0 prints the median seconds of
    a 4-byte all-reduce."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value, times = torch.zeros(1), []
    for round_ in range(rounds + 20):
        started = time.perf_counter()
        dist.all_reduce(value)
        if round_ >= 20:
            times.append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        print(statistics.median(times), flush=True)
    dist.destroy_process_group()


def measure_latency(network: Network, setting: Setting) -> float:
    """The alpha-beta latency of the links: a small all-reduce's median time over its ``2 (W - 1)`` latencies."""
    world, master = len(network.hosts), network.hosts[0].address
    command = [sys.executable, str(Path(__file__).resolve()), "--latency-worker", str(LATENCY_ROUNDS)]
    procs = [subprocess.Popen(setting.on_node(network, rank, command), env=node_env(setting, rank, world, True, master),
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"the latency probe failed: {[err[-2000:] for _out, err in outputs]}")
    return float(outputs[0][0]) / (2 * (world - 1))


def model_cost(setting: Setting):  # -> ModelCost
    """The model's costs as ``hetfair-plan`` measures them, from the runs' own training flags."""
    import torch

    from hetfair.options import parse_train_args
    from hetfair.parallel.context import DistributedContext
    from hetfair.run.wiring import RunWiring

    wiring = RunWiring(parse_train_args(setting.flags(Path(tempfile.gettempdir()))),
                       DistributedContext(0, 1, 0, torch.device("cpu")))
    return wiring.model_cost(wiring.build_components())


def calibrated_cluster(samples_per_second: Sequence[float], cost, bandwidth: float, latency: float):  # -> Cluster
    """One node per host, each one ``cpu`` device computing at its measured samples/s, on the measured link."""
    from hetfair.cluster.description import Cluster, Device, Link, Node

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(samples_per_second)
    nodes = tuple(Node(f"host{index}", (Device("cpu", memory, {"fp32": cost.flops_per_sample * rate}, None,
                                                 measured=True),))
                  for index, rate in enumerate(samples_per_second))
    return Cluster(nodes, Link(bandwidth, latency))


def matching_predictions(cluster, cost, batch: int) -> dict:  # -> dict[str, Prediction]
    """The plan's predictions for every host training ``batch`` samples per update, by their mode flags."""
    from hetfair.plan.cluster_plan import predict_all

    world = cluster.world_size
    return {p.mode_flags(): p for p in predict_all(cluster, cost, batch * world)
            if [rank.batch for rank in p.job.ranks] == [batch] * world}


# -- one table --------------------------------------------------------------------------------
def run_links(network: Network, setting: Setting, links: Sequence[str], modes: Sequence[str], workdir: Path,
              cost, label: str, calibration_updates: int) -> list[Row]:
    """Every mode on every link rate of one network: measured and predicted."""
    nodes, rows = len(network.hosts), []
    alone = replace(setting, updates=calibration_updates)
    for rate in links:
        for index in range(nodes):
            network.shape(index, rate, burst=BURST)
        measured_link = link_throughput(network)
        latency = measure_latency(network, setting)
        before = single_node_speeds(network, alone, workdir, [])
        bandwidth = tbf_bandwidth(rate)
        runs, sent, skipped = {}, {}, []
        for name in modes:
            started = time.perf_counter()
            runs[name] = None
            print(f"bench_cluster_model: {nodes} nodes, {rate}{label}, {name} ...", end=" ", flush=True)
            predictions = matching_predictions(calibrated_cluster(before, cost, bandwidth, latency), cost,
                                               setting.batch)
            if MODES[name] not in predictions:
                skipped.append(name)
                print("not weighed by the plan here: skipped", flush=True)
                continue
            counted = sent_bytes(network)
            runs[name] = run_job(network, setting, workdir, [*MODES[name].split(), *RUN_ONLY_FLAGS.get(name, ())])
            sent[name] = max(b - a for a, b in zip(counted, sent_bytes(network))) * TCP_PAYLOAD_SHARE / setting.updates
            print(f"{runs[name].samples_per_s:.1f} samples/s ({time.perf_counter() - started:.0f} s)", flush=True)
        after = single_node_speeds(network, alone, workdir, [])
        singles = [(a + b) / 2 for a, b in zip(before, after)]
        predictions = matching_predictions(calibrated_cluster(singles, cost, bandwidth, latency), cost, setting.batch)
        table = []
        for name, result in runs.items():
            if result is None:
                continue
            p = predictions[MODES[name]]
            table.append(Row(nodes, rate, label.removeprefix(", speeds "), name, setting.batch, result.samples_per_s,
                             p.samples_per_second, p.cost.compute, p.cost.exposed, sent[name], p.cost.network_bytes))
        print_table(f"{setting.arch}, {nodes} nodes, links {rate}{label}, batch {setting.batch}/node, "
                    f"{setting.updates} updates", HEADER, [row.cells() for row in table],
                    [f"calibration: single-node samples/s (all {nodes} at once) "
                     f"{', '.join(f'{s:.1f}' for s in singles)} (before {', '.join(f'{s:.1f}' for s in before)}; "
                     f"after {', '.join(f'{s:.1f}' for s in after)}); bandwidth {bandwidth / 1e6:.2f} MB/s "
                     f"(tbf rate x {TCP_PAYLOAD_SHARE:.3f}; one TCP transfer measured {measured_link:.2f} MB/s); "
                     f"latency {latency * 1e6:.0f} us (4-byte all-reduce / {2 * (nodes - 1)})",
                     *([f"not weighed by the plan on this job: {', '.join(skipped)}"] if skipped else []),
                     machine_note()])
        rows.extend(table)
    return rows


def summarise(rows: Sequence[Row]) -> None:
    print_table("all runs: predicted against measured", HEADER, [row.cells() for row in rows])
    errors = [abs(row.error) for row in rows]
    worst = max(rows, key=lambda row: abs(row.error))
    print(f"\nmedian |error| {statistics.median(errors):.1%}; worst {worst.error:+.1%} ({worst.nodes} nodes, "
          f"{worst.link}, {worst.speeds or '1:1'}, {worst.mode}); {sum(e > 0.15 for e in errors)} of {len(rows)} "
          f"beyond 15%, {sum(e > 0.30 for e in errors)} beyond 30% (goal: median <= 15%, none beyond 30%)",
          flush=True)


# -- the command line -------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mnist_cnn", help="comma-separated architectures (mnist_cnn, bert_mini)")
    parser.add_argument("--nodes", default="2,4", help="comma-separated host counts")
    parser.add_argument("--links", default="50mbit,100mbit,1gbit", help="comma-separated tbf rates")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    parser.add_argument("--speeds", default="1,2", help="relative speeds of one more pair of hosts (CPU quotas, "
                                                         "bench_links' --speeds); '' for none")
    parser.add_argument("--speeds-links", default="100mbit", help="the link rates of the unequal pair")
    parser.add_argument("--batch", type=int, default=32, help="samples per host and update")
    parser.add_argument("--updates", type=int, default=64, help=f"updates per run (a multiple of {INTERVAL})")
    parser.add_argument("--calibration-updates", type=int, default=160,
                        help="updates of each single-node calibration run (before and after each link's runs)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every host")
    parser.add_argument("--train-size", type=int, default=12800,
                        help="Fashion-MNIST training images each run loads (start-up time only)")
    parser.add_argument("--workdir", type=Path, help="data and checkpoints (default: a new temporary directory)")
    parser.add_argument("--latency-worker", type=int, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.latency_worker is None and (options.updates % INTERVAL or options.updates < 2 * INTERVAL):
        parser.error(f"--updates must be a multiple of {INTERVAL}, at least {2 * INTERVAL}")
    unknown = set(options.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {', '.join(sorted(unknown))} (the modes are {', '.join(MODES)})")
    return options


def main() -> None:
    options = parse_args()
    if options.latency_worker is not None:
        latency_worker(options.latency_worker)
        return
    import torch

    torch.set_num_threads(options.threads)
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"bench_cluster_model: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark removes its namespaces too
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="hetfair-cluster-model-"))
    workdir.mkdir(parents=True, exist_ok=True)
    modes, links = options.modes.split(","), options.links.split(",")
    speeds = tuple(float(s) for s in options.speeds.split(",")) if options.speeds else ()
    print(f"bench_cluster_model: {machine_note()}; uptime: {os.popen('uptime').read().strip()}", flush=True)
    rows: list[Row] = []
    for arch in options.models.split(","):
        data = data_subset(DEFAULT_DATA, options.train_size, workdir / "mnist") if arch.startswith("mnist") \
            else _bert_data(workdir)
        setting = Setting(arch, options.batch, options.updates, INTERVAL, options.threads, data)
        cost = model_cost(setting)
        print(f"bench_cluster_model: {arch}: {cost.parameters:,} parameters ({cost.parameter_bytes / 1e6:.2f} MB "
              f"fp32), {cost.flops_per_sample / 1e6:.1f} MFLOP per sample", flush=True)
        for nodes in map(int, options.nodes.split(",")):
            with Network(nodes) as network:
                rows += run_links(network, setting, links, modes, workdir, cost, "", options.calibration_updates)
        if speeds:
            unequal = Setting(arch, options.batch, options.updates, INTERVAL, options.threads, data, speeds)
            with Network(len(speeds)) as network, CpuLimits(speeds, options.threads):
                rows += run_links(network, unequal, options.speeds_links.split(","), modes, workdir, cost,
                                  f", speeds {options.speeds.replace(',', ':')}", options.calibration_updates)
    summarise(rows)
    print(f"bench_cluster_model: uptime after: {os.popen('uptime').read().strip()}", flush=True)


def _bert_data(workdir: Path) -> Path:
    from bench_links import prepare_data

    return prepare_data(workdir)


if __name__ == "__main__":
    main()
