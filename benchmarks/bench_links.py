"""Training across slow links: plain torch DDP against hetfair's communication modes on emulated nodes.

Each node is a network namespace of its own (``tests/netns.py``: veth pairs on a bridge), its
link limited to a rate by ``tc tbf`` in both directions, with one training process in it (one
rank per node, ``OMP_NUM_THREADS=--threads``). There is no added delay: this kernel has no netem,
so only bandwidth is emulated, and a link's latency is that of a veth pair (microseconds).

Contenders, same model, data, per-rank batch, seed, optimizer (AdamW, warm-up then linear decay,
clip 1.0) and number of updates:

* ``plain-ddp``: a plain loop (DataLoader + DistributedSampler + DDP, fp32 all-reduce);
* ``hetfair``: ``hetfair-train`` with its defaults (the fp32 all-reduce of DDP);
* one ``hetfair`` run per mode in :data:`MODES` whose flags this tree's ``hetfair-train`` knows
  (compressed all-reduce hooks, hybrid sharding with a bf16 reduction, the outer loop).

Reported per contender: samples/s of the job, clocked from outside between rank 0's first and last
progress lines (start-up and warm-up excluded); scaling efficiency, the job's samples/s over the sum
of the nodes' single-node samples/s; and the masked-LM loss of the final model on fixed validation
batches, evaluated here by one function for every contender (so after the same number of samples).

Single-node speeds: the machine has fewer cores than 4 nodes need, so a node's speed alone would
overstate it. They are measured with all N nodes' plain loops running at once, without
communication (world size 1 each), at the same thread count: what each node computes while sharing
the CPUs as it does in the job; once before and once after each table's contenders (the machine's
load changes), and the mean is used.

    .venv/bin/python benchmarks/bench_links.py             # the full table (needs root; 30+ minutes)
    .venv/bin/python benchmarks/bench_links.py --quick     # bert_tiny, 2 nodes, one rate (a few minutes)
    .venv/bin/python benchmarks/bench_links.py --archs mnist_cnn --nodes 2 --rates 100mbit --batch 32 \
        --updates 200 --interval 20                        # the MNIST plugin's CNN on Fashion-MNIST
    .venv/bin/python benchmarks/bench_links.py ... --speeds 1,2  # node 1 twice node 0's speed (CPU quotas)

``mnist_*`` architectures train the MNIST plugin's model (``plugins/``) with Adam on Fashion-MNIST, the
plain loop being benchmarks/bench_ddp.py's; their loss is the cross-entropy on the first 2,000 test
images. With ``--speeds``, each node's processes run in a cgroup whose CPU quota is its share of
``--threads`` CPUs (the fastest node's all of them), the single-node speeds measured under the same
quotas. Samples/s counts the samples each update trained (hetfair's logged ``bsz``: with
``--inner-steps-by time`` a fast node trains several micro-batches per update), and the samples
column says how many each contender trained in all.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from benchmarks.common import (  # noqa: E402
    DEFAULT_DATA,
    PLUGIN_DIR,
    REPO_ROOT,
    arch_flags,
    clocked_run,
    import_plugin,
    machine_note,
    plain_dataset,
    plain_model,
    print_table,
    progress_line,
    source_trees,
    subprocess_env,
)
from netns import Network, unavailable  # noqa: E402

SECRET = "bench-links"
PORT = 29500
MODES: dict[str, list[str]] = {
    "fp16": ["--ddp-comm-hook", "fp16"],
    "bf16": ["--ddp-comm-hook", "bf16"],
    "powersgd": ["--ddp-comm-hook", "powersgd", "--powersgd-rank", "4", "--powersgd-start-update", "2"],
    "hsdp-bf16": ["--ddp-backend", "hybrid_sharded", "--reduce-dtype", "bf16"],
    "diloco": ["--ddp-backend", "diloco", "--outer-interval", "4"],
    "diloco-h8": ["--ddp-backend", "diloco", "--outer-interval", "8"],
    "streaming-int4": ["--ddp-backend", "diloco", "--outer-interval", "8", "--outer-fragments", "4", "--outer-overlap",
                       "--outer-reduce-dtype", "int4"],
    "streaming-int4-time": ["--ddp-backend", "diloco", "--outer-interval", "8", "--outer-fragments", "4",
                            "--outer-overlap", "--outer-reduce-dtype", "int4", "--inner-steps-by", "time"],
    "diloco-h8-int4": ["--ddp-backend", "diloco", "--outer-interval", "8", "--outer-reduce-dtype", "int4"],
    "diloco-h16-int4": ["--ddp-backend", "diloco", "--outer-interval", "16", "--outer-reduce-dtype", "int4"],
    "diloco-h16-int4-time": ["--ddp-backend", "diloco", "--outer-interval", "16", "--outer-reduce-dtype", "int4",
                             "--inner-steps-by", "time"],
    "balanced-powersgd": ["--ddp-comm-hook", "powersgd", "--powersgd-rank", "4", "--powersgd-start-update", "2",
                          "--auto-balance"],
    "fsdp2": ["--ddp-backend", "fully_sharded"],
    "uneven-1-1": ["--ddp-backend", "fully_sharded", "--shard-fractions", "1,1"],
    "uneven-1-3": ["--ddp-backend", "fully_sharded", "--shard-fractions", "1,3"],
}
"""hetfair's modes for slow links, by name: the flags that turn each on."""
VALID_BATCHES = 8
MNIST_TEST_IMAGES = 2000
BURST = "256kbit"
"""tbf bucket: a few full-size packets, so that the rate, not the bucket, limits the transfer."""


@dataclass(frozen=True)
class Setting:
    """What every contender of one table shares."""

    arch: str
    batch: int
    updates: int
    interval: int
    threads: int
    data: Path
    """The preprocessed Jargon File (BERT) or the Fashion-MNIST directory (``mnist_*``)."""
    speeds: tuple[float, ...] = ()
    """Relative speeds of the nodes (``--speeds``; empty: all alike), kept by :class:`CpuLimits`."""

    def on_node(self, network: Network, index: int, command: Sequence[str]) -> list[str]:
        """``command`` run on node ``index``: in its namespace, and in its CPU-limited group where speeds differ."""
        if not self.speeds:
            return network.hosts[index].command(*command)
        # into the group before the namespace: ip netns exec mounts a sysfs of its own, without the cgroups
        return ["sh", "-c", 'echo $$ > "$0/tasks" && exec "$@"', str(CpuLimits.group(index)),
                *network.hosts[index].command(*command)]

    @property
    def is_mnist(self) -> bool:
        return self.arch.startswith("mnist")

    def flags(self, save_dir: Path) -> list[str]:
        """The training flags of both the plain loop and hetfair-train."""
        if self.is_mnist:  # the MNIST plugin's CNN with Adam, as benchmarks/bench_ddp.py trains it
            return ["--user-dir", str(PLUGIN_DIR), "--task", "mnist", "--dataset", "fashion-mnist", "--data",
                    str(self.data), *arch_flags(self.arch), "--max-sentences", str(self.batch), "--optimizer", "adam",
                    "--lr", "1e-3", "--max-update", str(self.updates), "--save-dir", str(save_dir),
                    "--disable-validation", "--seed", "1"]
        return ["--task", "bert", "--data", str(self.data), "--arch", self.arch, "--max-sentences", str(self.batch),
                "--lr", "5e-4", "--warmup-updates", "4", "--total-num-update", str(self.updates), "--clip-norm",
                "1.0", "--max-update", str(self.updates), "--save-dir", str(save_dir), "--disable-validation",
                "--seed", "1"]


@dataclass
class Result:
    samples_per_s: float
    loss: float
    samples: int
    """Samples trained in all (more than updates x nodes x batch where nodes take several inner steps)."""


# -- data and evaluation ---------------------------------------------------------------
def prepare_data(workdir: Path) -> Path:
    """The Jargon File (Debian's jargon-text) split and preprocessed into ``workdir/data`` (train and valid)."""
    from hetfair_cli.preprocess import main as preprocess_main
    from pretrain_bert_jargon import JARGON, write_splits

    data = workdir / "data"
    if not (data / "valid.idx").exists():
        if not JARGON.is_file():
            raise SystemExit(f"bench_links: needs the Jargon File at {JARGON} (apt-get install jargon-text)")
        train, valid = write_splits(JARGON, workdir)
        preprocess_main(["--trainpref", str(train), "--validpref", str(valid), "--destdir", str(data),
                         "--tokenizer", "wordpiece", "--vocab-size", "8000", "--workers", "2"])
    return data


def valid_loss(setting: Setting, state: dict[str, torch.Tensor]) -> float:
    """Mean masked-LM cross-entropy (nats) of a model with ``state`` on the first validation batches (for
    ``mnist_*``: the cross-entropy on the first 2,000 test images)."""
    own = getattr(setting, "valid_loss", None)
    if own is not None:  # a Setting of another task brings its own (benchmarks/bench_pipeline.py's language model)
        return own(state)
    if setting.is_mnist:
        return _mnist_test_loss(setting, state)
    from hetfair.options import parse_train_args
    from hetfair.tasks import TASK_REGISTRY

    args = parse_train_args(setting.flags(Path("unused")))
    task = TASK_REGISTRY.get("bert").setup_task(args)
    model = task.build_model(args)
    model.load_state_dict(state)
    model.eval()
    dataset = task.dataset("valid")
    total, count = 0.0, 0
    with torch.no_grad():
        for index in range(VALID_BATCHES):
            sample = task.collater([dataset[(index * setting.batch + j) % len(dataset)] for j in range(setting.batch)])
            target = sample["target"]
            masked = target != -100
            logits = model(**sample["net_input"], masked_tokens=masked)["mlm_logits"]
            total += F.cross_entropy(logits.float(), target[masked], reduction="sum").item()
            count += int(masked.sum())
    return total / count


def _mnist_test_loss(setting: Setting, state: dict[str, torch.Tensor]) -> float:
    plugin = import_plugin()
    train_images, _ = plugin.mnist_data.load_pair(setting.data, "train")
    images, labels = plugin.mnist_data.load_pair(setting.data, "t10k")
    test = plugin.mnist_data.ImageClassificationDataset(images[:MNIST_TEST_IMAGES], labels[:MNIST_TEST_IMAGES],
                                                        *plugin.mnist_data.pixel_stats(train_images))
    model = plain_model(setting.arch)
    model.load_state_dict(state)
    model.eval()
    inputs, targets = zip(*(test[index] for index in range(len(test))))
    with torch.no_grad():
        return F.cross_entropy(model(torch.stack(inputs)), torch.as_tensor(targets)).item()


# -- the plain loop (one process per node) -------------------------------------------------
def plain_worker(flags: list[str], interval: int, out: Path) -> None:
    """The plain loop of benchmarks/bench_bert.py (for ``mnist_*``, of benchmarks/bench_ddp.py), with DDP when
    WORLD_SIZE is set; rank 0 saves the model."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from bench_bert import plain_step
    from hetfair.options import parse_train_args
    from hetfair.tasks import TASK_REGISTRY

    args = parse_train_args(flags)
    mnist = args.task == "mnist"
    task = None if mnist else TASK_REGISTRY.get("bert").setup_task(args)
    dataset = plain_dataset(Path(args.data)) if task is None else task.dataset("train")
    distributed = "WORLD_SIZE" in os.environ
    sampler = None
    if distributed:
        dist.init_process_group("gloo")
        sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    modules: list[torch.nn.Module] = []

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        modules.append(model)
        return DistributedDataParallel(model) if distributed else model

    step = _mnist_step(args, wrap) if task is None else plain_step(args, task, wrap)
    loader = DataLoader(dataset, batch_size=int(args.max_sentences), shuffle=sampler is None, sampler=sampler,
                        collate_fn=None if task is None else task.collater, drop_last=True)
    rank = dist.get_rank() if distributed else 0
    updates, started = 0, _now()
    for epoch in itertools.count():
        if sampler is not None:
            sampler.set_epoch(epoch)
        for sample in loader:
            step(sample)
            updates += 1
            if updates % interval == 0 and rank == 0:
                now = _now()
                print(progress_line(updates, now - started, interval), flush=True)
                started = now
            if updates == args.max_update:
                break
        if updates == args.max_update:
            break
    if rank == 0:
        torch.save(modules[0].state_dict(), out)
    if distributed:
        dist.destroy_process_group()


def _mnist_step(args: argparse.Namespace, wrap: Callable[[torch.nn.Module], torch.nn.Module]
                ) -> Callable[[tuple[torch.Tensor, torch.Tensor]], None]:
    """One plain Adam update of the MNIST plugin's model on a batch ``(images, labels)``: mean cross-entropy."""
    torch.manual_seed(args.seed)
    model = wrap(plain_model(args.arch))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    return step


def _now() -> float:
    import time

    return time.perf_counter()


# -- running the nodes ---------------------------------------------------------------------
def node_env(setting: Setting, rank: int, world: int, plain: bool, master: str, root: Path = REPO_ROOT
             ) -> dict[str, str]:
    """A node's environment; its hetfair from the source tree ``root``."""
    env = subprocess_env(setting.threads, os.pathsep.join([str(root), str(REPO_ROOT / "benchmarks")]))
    env.pop("GLOO_SOCKET_IFNAME", None)
    env["HETFAIR_SECRET"] = SECRET
    if plain and world > 1:  # what torchrun would set; gloo needs the interface (the hostname is not in the namespace)
        env.update({"MASTER_ADDR": master, "MASTER_PORT": str(PORT), "RANK": str(rank),
                    "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "eth0"})
    return env


def plain_command(setting: Setting, save_dir: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--plain-worker", json.dumps(setting.flags(save_dir)),
            "--interval", str(setting.interval), "--out", str(save_dir / "plain.pt")]


def hetfair_command(setting: Setting, save_dir: Path, rank: int, world: int, master: str,
                    mode: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "hetfair_cli.train", *setting.flags(save_dir), "--log-format", "json",
            "--log-interval", str(setting.interval), "--distributed-world-size", str(world), "--distributed-rank",
            str(rank), "--distributed-gpus", "1", "--distributed-init-method",
            f"tcp://{master}:{PORT}", *mode]


def run_job(network: Network, setting: Setting, workdir: Path, mode: Optional[Sequence[str]],
            root: Path = REPO_ROOT) -> Result:
    """One job of one process per host (``mode`` None: the plain loop), hetfair from the source tree ``root``; its
    samples/s and final loss."""
    world, master = len(network.hosts), network.hosts[0].address
    save_dir = Path(tempfile.mkdtemp(dir=workdir))
    commands = [plain_command(setting, save_dir) if mode is None
                else hetfair_command(setting, save_dir, r, world, master, mode) for r in range(world)]
    others = [subprocess.Popen(setting.on_node(network, rank, command),
                               env=node_env(setting, rank, world, mode is None, master, root),
                               cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for rank, command in enumerate(commands) if rank > 0]
    try:
        try:
            clock = clocked_run(setting.on_node(network, 0, commands[0]),
                                node_env(setting, 0, world, mode is None, master, root), timeout=1800,
                                expected_updates=setting.updates, cwd=root)
        except RuntimeError as exc:  # rank 0 often only lost contact: the cause is in another node's output
            raise RuntimeError(f"{exc}\n{_others_errors(others)}") from None
        for proc in others:
            _, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"a node failed (exit {proc.returncode}):\n{err[-3000:]}")
    finally:
        for proc in others:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if mode is None:
        state = torch.load(save_dir / "plain.pt", weights_only=True)
    else:
        state = torch.load(save_dir / "checkpoint_last.pt", weights_only=True)["trainer"]["model"]
    shutil.rmtree(save_dir)
    fixed = world * setting.batch  # samples per update, unless the log says otherwise (hetfair's bsz)
    per_interval = [float(record.get("bsz", fixed)) * setting.interval for record in clock.records]
    steady = sum(per_interval[1:]) / (clock.wall_per_update * clock.updates)
    return Result(steady, valid_loss(setting, state), round(sum(per_interval)))


def _others_errors(others: Sequence[subprocess.Popen]) -> str:
    """The end of the error output of nodes 1, 2, ... (stopped if they still run)."""
    parts = []
    for rank, proc in enumerate(others, start=1):
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        parts.append(f"node {rank} (exit {proc.returncode}):\n{(err or '')[-3000:]}")
    return "\n".join(parts)


def single_node_speeds(network: Network, setting: Setting, workdir: Path,
                       mode: Optional[Sequence[str]] = None) -> list[float]:
    """Samples/s of each node's plain loop without communication, all nodes running at once (``mode`` given:
    of ``hetfair-train`` with these flags, each node a job of its own)."""
    speeds: list[float] = [0.0] * len(network.hosts)
    errors: list[BaseException] = []

    def one(index: int) -> None:
        save_dir = Path(tempfile.mkdtemp(dir=workdir))
        command = plain_command(setting, save_dir) if mode is None else \
            hetfair_command(setting, save_dir, 0, 1, network.hosts[index].address, mode)
        try:
            clock = clocked_run(setting.on_node(network, index, command),
                                node_env(setting, index, 1, mode is None, ""), timeout=1800,
                                expected_updates=setting.updates, cwd=REPO_ROOT)
            speeds[index] = setting.batch / clock.wall_per_update
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
        finally:
            shutil.rmtree(save_dir, ignore_errors=True)

    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(network.hosts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return speeds


class CpuLimits:
    """Nodes of unequal speed on one machine: each node's processes in a cgroup (v1 ``cpu``) whose CFS quota is
    its share of ``--threads`` CPUs, the fastest node's the whole of them (speeds 1,2: half a CPU and one)."""

    ROOT = Path("/sys/fs/cgroup/cpu")
    PERIOD_US = 10_000
    """A short period, so that a throttled node runs in slices much shorter than an update."""

    def __init__(self, speeds: Sequence[float], threads: int) -> None:
        self.speeds, self.threads = list(speeds), threads

    @classmethod
    def group(cls, index: int) -> Path:
        return cls.ROOT / f"hetfair-links-node{index}"

    def __enter__(self) -> "CpuLimits":
        for index, speed in enumerate(self.speeds):
            group = self.group(index)
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            quota = int(self.PERIOD_US * self.threads * speed / max(self.speeds))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        return self

    def __exit__(self, *_: object) -> None:
        for index in range(len(self.speeds)):
            self.group(index).rmdir()  # empty: every node's processes have ended


def link_throughput(network: Network, megabytes: int = 4) -> float:
    """MB/s of one TCP transfer from host 1 to host 0 over the shaped links (what the tbf rates give)."""
    server = ("import socket,sys,time;s=socket.create_server((sys.argv[1],5001));print('ready',flush=True);"
              "c,_=s.accept();n=0;t=time.perf_counter()\nwhile True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
              "print(n/(time.perf_counter()-t)/1e6)")
    client = ("import socket,sys;c=socket.create_connection((sys.argv[1],5001));"
              f"c.sendall(bytes({megabytes}<<20));c.close()")
    receiver = subprocess.Popen(network.hosts[0].command(sys.executable, "-c", server, network.hosts[0].address),
                                stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None and receiver.stdout.readline() == "ready\n"
        subprocess.run(network.hosts[1].command(sys.executable, "-c", client, network.hosts[0].address), check=True,
                       timeout=600)
        return float(receiver.communicate(timeout=60)[0])
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


def known_modes(names: Sequence[str]) -> dict[str, list[str]]:
    """The modes of ``names`` whose flags this tree's hetfair-train accepts (the others are skipped, with a note)."""
    found = {}
    for name in names:
        # with a task and the mode's own flags: a comm hook's flags are in the help once a task is chosen
        help_text = subprocess.run([sys.executable, "-m", "hetfair_cli.train", "--user-dir", str(PLUGIN_DIR), "--task",
                                    "mnist", *MODES[name], "--help"], capture_output=True, text=True, cwd=REPO_ROOT,
                                   env=subprocess_env(1, str(REPO_ROOT))).stdout
        missing = [flag for flag in MODES[name] if flag.startswith("--") and flag not in help_text]
        if missing:
            print(f"bench_links: skipping {name}: this hetfair-train has no {', '.join(missing)}", flush=True)
        else:
            found[name] = MODES[name]
    return found


def gradient_megabytes(setting: Setting) -> float:
    """Megabytes of the model's fp32 gradient: what plain DDP all-reduces every update."""
    from hetfair.options import parse_train_args
    from hetfair.tasks import TASK_REGISTRY

    if setting.is_mnist:
        model = plain_model(setting.arch)
    else:
        args = parse_train_args(setting.flags(Path("unused")))
        model = TASK_REGISTRY.get("bert").setup_task(args).build_model(args)
    return sum(p.numel() for p in model.parameters()) * 4 / 1e6


# -- the table -----------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="bert_mini,bert_tiny",
                        help="comma-separated BERT architectures or the MNIST plugin's (mnist_cnn)")
    parser.add_argument("--mnist-data", type=Path, default=DEFAULT_DATA, help="Fashion-MNIST directory")
    parser.add_argument("--speeds", help="relative node speeds, e.g. 1,2 (each node's CPU quota; needs --nodes 2 "
                                         "for 1,2); default: all alike")
    parser.add_argument("--nodes", default="2,4", help="comma-separated node counts")
    parser.add_argument("--rates", default="50mbit,200mbit", help="comma-separated link rates (tc units)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    parser.add_argument("--batch", type=int, default=8, help="samples per node and update")
    parser.add_argument("--updates", type=int, default=8, help="updates per run")
    parser.add_argument("--interval", type=int, default=2, help="updates per progress line; the first is warm-up")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every node")
    parser.add_argument("--workdir", type=Path, help="data and checkpoints (default: a new temporary directory)")
    parser.add_argument("--quick", action="store_true", help="bert_tiny, 2 nodes, the first rate, 6 updates")
    parser.add_argument("--also-tree", action="append", default=[], metavar="LABEL=PATH",
                        help="also run the fully sharded modes of another hetfair source tree (a git worktree, say)")
    parser.add_argument("--plain-worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.quick:
        options.archs, options.nodes, options.updates = "bert_tiny", "2", 6
        options.rates = options.rates.split(",")[0]
    if not options.plain_worker and (options.updates % options.interval or options.updates < 2 * options.interval):
        parser.error("--updates must be a multiple of --interval, at least two intervals")
    return options


def main() -> None:
    options = parse_args()
    torch.set_num_threads(options.threads)
    if options.plain_worker:
        plain_worker(json.loads(options.plain_worker), options.interval, options.out)
        return
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"bench_links: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark removes its namespaces too
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="hetfair-links-"))
    workdir.mkdir(parents=True, exist_ok=True)
    archs = options.archs.split(",")
    data = prepare_data(workdir) if any(not arch.startswith("mnist") for arch in archs) else None
    speeds = tuple(float(speed) for speed in options.speeds.split(",")) if options.speeds else ()
    modes: dict[str, tuple[Optional[list[str]], Path]] = {
        name: (flags, REPO_ROOT) for name, flags in
        {"plain-ddp": None, "hetfair": [], **known_modes(options.modes.split(","))}.items()}
    for tree in source_trees(options.also_tree, "bench_links.py")[1:]:  # the sharded modes again, from that tree
        modes.update({tree.tag(name): (flags, tree.root) for name, (flags, _) in list(modes.items())
                      if flags and "fully_sharded" in flags})
    print(f"bench_links: {machine_note()}; uptime: {os.popen('uptime').read().strip()}", flush=True)
    for arch, nodes in itertools.product(archs, map(int, options.nodes.split(","))):
        if speeds and len(speeds) != nodes:
            raise SystemExit(f"bench_links: --speeds gives {len(speeds)} speeds for {nodes} nodes")
        setting = Setting(arch, options.batch, options.updates, options.interval, options.threads,
                          options.mnist_data if arch.startswith("mnist") else data, speeds)
        with Network(nodes) as network, CpuLimits(speeds, options.threads):
            for rate in options.rates.split(","):
                for index in range(nodes):
                    network.shape(index, rate, burst=BURST)
                measured = link_throughput(network)
                before = single_node_speeds(network, setting, workdir)
                results = {name: run_job(network, setting, workdir, mode, root) for name, (mode, root) in modes.items()
                           if nodes == 2 or "--shard-fractions" not in (mode or [])}  # two values: two ranks
                after = single_node_speeds(network, setting, workdir)
                singles = [(a + b) / 2 for a, b in zip(before, after)]
                plain = results["plain-ddp"]
                rows = [[name, f"{r.samples_per_s:.1f}", f"{r.samples_per_s / sum(singles):.2f}",
                         f"{r.samples_per_s / plain.samples_per_s:.2f}", f"{r.samples}", f"{r.loss:.3f}",
                         f"{(r.loss - plain.loss) / plain.loss:+.1%}"]
                        for name, r in results.items()]
                shape = f", node speeds {options.speeds} (CPU quotas)" if speeds else ""
                print_table(f"{arch}, {nodes} nodes, links {rate} ({measured:.1f} MB/s measured), batch "
                            f"{setting.batch}/node, {setting.updates} updates{shape}",
                            ["contender", "samples/s", "efficiency", "vs plain", "samples", "loss", "vs plain"], rows,
                            [f"fp32 gradient {gradient_megabytes(setting):.1f} MB; single-node samples/s (all "
                             f"{nodes} at once, no communication; mean of before and after the contenders): "
                             f"{', '.join(f'{s:.1f}' for s in singles)} (sum {sum(singles):.1f}; before "
                             f"{sum(before):.1f}, after {sum(after):.1f})", f"{machine_note()}"])


if __name__ == "__main__":
    main()
