"""Command-line options, built in passes like fairseq.

1. read ``--user-dir`` and import it, so its components are registered;
2. read ``--task`` and apply the task's defaults for core options (including
   which criterion / arch / optimizer / lr scheduler it uses by default);
3. add the flags of the chosen components and the defaults of ``--arch``,
   then parse everything for real.

Library code never reads ``sys.argv``: the console scripts pass ``argv`` in.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

from hetfair.criteria import CRITERION_REGISTRY
from hetfair.launch.per_process import PerProcessValues, parse_per_process, values_of
from hetfair.errors import ConfigError, HetfairError
from hetfair.models import ARCH_REGISTRY, MODEL_REGISTRY, arch_names, resolve_arch
from hetfair.optim import LR_SCHEDULER_REGISTRY, OPTIMIZER_REGISTRY
from hetfair.optim.implementation import IMPLEMENTATIONS
from hetfair.parallel import (STRATEGY_REGISTRY, ZERO_SHARDING_FLAGS, ZERO_SHARDINGS, ParallelConfig,
                              check_strategy_options, plan_candidates)
from hetfair.parallel.comm_hook import comm_hook_choices, comm_hook_flags, loadable_hooks
from hetfair.parallel.inner_steps import INNER_STEPS_BY
from hetfair.parallel.outer_exchange import OUTER_REDUCE_DTYPES
from hetfair.parallel.pipeline_split import PIPELINE_LAYOUTS, PIPELINE_SCHEDULES
from hetfair.plugins import import_user_dir
from hetfair.memory.sizes import format_size, parse_size
from hetfair.plan import AUTO
from hetfair.precision.mixed import parse_precision
from hetfair.tasks import TASK_REGISTRY
from hetfair.utils import DefaultsHelpFormatter, absolute_path

LOG_FORMATS = ("tqdm", "simple", "json", "none")


def _known(registry_names: list[str]) -> str:
    return ", ".join(registry_names) or "(none)"


@dataclass(frozen=True)
class Bounds:
    """The values a numeric option accepts, declared next to it (:func:`_option`) and checked after parsing,
    so that a plugin's default is held to them too. Floats must also be finite."""

    minimum: Optional[float] = None
    maximum: Optional[float] = None
    open_minimum: bool = False
    """The minimum itself is refused."""
    open_maximum: bool = False
    """The maximum itself is refused."""
    says: Optional[str] = None
    """The requirement in words (``"must be positive"``), where the generated one would read badly."""
    shows: Callable[[Any], str] = str
    """How a refused value is written in the error (``format_size`` for bytes)."""

    def problem(self, value: float, is_float: bool) -> Optional[str]:
        """What ``value`` breaks (``"must be at least 1"``), or ``None`` when it is within bounds."""
        if self._accepts(value, is_float):
            return None
        return self.says or self._requirement(value, is_float)

    def _accepts(self, value: float, is_float: bool) -> bool:
        low, high = self.minimum, self.maximum
        above = low is None or value > low or (value == low and not self.open_minimum)
        below = high is None or value < high or (value == high and not self.open_maximum)
        return above and below and (math.isfinite(value) or not is_float)

    def _requirement(self, value: float, is_float: bool) -> str:
        low, high = self.minimum, self.maximum
        if is_float and high is not None:
            return f"must be in {'(' if self.open_minimum else '['}{low:g}, {high:g}{')' if self.open_maximum else ']'}"
        if is_float:
            return f"must be a finite number of at least {low:g}"
        return (f"must be at least {self.shows(low)}" if low is not None and value < low
                else f"must be at most {self.shows(high)}")


POSITIVE = Bounds(0.0, open_minimum=True, says="must be positive")

MAX_MEMORY_BUDGET = 64 << 40
"""64 TiB: more than any one machine holds (the largest servers have 24-32 TiB of host memory, a GPU well under
1 TiB), so a larger --memory-budget for one process is a slip of the unit or of the digits, not a budget."""


@dataclass(frozen=True)
class FlagOwner:
    """A mode, chosen by giving ``selector`` the value ``value`` (``True``: the switch ``selector`` itself), and the
    flags that mean something only in it: given without it (or another owner of theirs), they are refused
    (:func:`check_owned_flags`). Strategies declare theirs as ``owned_flags``, each comm hook the flags its
    ``add_args`` adds, ZeRO in :mod:`hetfair.parallel.config`, live recovery and load balancing next to their
    flags below."""

    selector: str
    value: Any
    flags: tuple[str, ...]

    def is_chosen(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> bool:
        return getattr(args, parser._option_string_actions[self.selector].dest) == self.value


def _option(group: Any, *flags: str, bounds: Bounds, **kwargs: Any) -> argparse.Action:
    """``group.add_argument(*flags, **kwargs)`` for a numeric option whose values must be within ``bounds``
    (``None``, not given, always is)."""
    action = group.add_argument(*flags, **kwargs)
    action.bounds = bounds  # type: ignore[attr-defined]
    return action


def add_common_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("common")
    group.add_argument("--user-dir", metavar="DIR", type=absolute_path,
                       help="import DIR as a Python package of plugins")
    group.add_argument("--list-plugins", action="store_true",
                       help="list every registered component and where it comes from, then exit")
    group.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    _option(group, "--seed", bounds=Bounds(0, 2**63 - 1), type=int, default=1,
            help="random seed (data order, init, masking)")
    group.add_argument("--cpu", action="store_true", help="train on CPU even when a GPU is present")
    _option(group, "--log-interval", bounds=Bounds(1), type=int, default=100, metavar="N", help="log every N updates")
    group.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                       help="progress output (default: tqdm on a terminal, simple otherwise)")
    group.add_argument("--tensorboard-logdir", metavar="DIR", type=absolute_path,
                       help="write TensorBoard scalars to DIR")
    group.add_argument("--dry-run", action="store_true",
                       help="print the plan (per process: device, memory, precision, micro-batch, share, shard) "
                            "and exit: no update, no checkpoint, no TensorBoard files")


def add_component_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("components")
    group.add_argument("--task", metavar="NAME", help=f"task to train; one of: {_known(TASK_REGISTRY.names())}")
    group.add_argument("--arch", "-a", metavar="NAME",
                       help=f"model architecture (default: the task's); one of: {_known(arch_names())}")
    group.add_argument("--criterion", metavar="NAME", default="cross_entropy",
                       help=f"training criterion; one of: {_known(CRITERION_REGISTRY.names())}")
    group.add_argument("--optimizer", metavar="NAME", default="adam",
                       help=f"optimizer; one of: {_known(OPTIMIZER_REGISTRY.names())}")
    group.add_argument("--lr-scheduler", metavar="NAME", default="fixed",
                       help=f"learning-rate schedule; one of: {_known(LR_SCHEDULER_REGISTRY.names())}")


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset and batching")
    group.add_argument("--data", metavar="DIR", type=absolute_path, help="data directory of the task")
    _option(group, "--max-sentences", "--batch-size", bounds=Bounds(1), metavar="N[,N...]", dest="max_sentences",
            type=PerProcessValues(_whole_number_or_auto, "max_sentences", int, "an integer"),
            help="samples per process and micro-batch (may differ between nodes); a list gives one "
                 "value per process of this command, e.g. 48,16; auto: the largest that fits the process's "
                 "memory, found by a short probe (docs: auto-plan)")
    _option(group, "--max-tokens", bounds=Bounds(1), metavar="N[,N...]",
            type=PerProcessValues(_whole_number_or_auto, "max_tokens", int, "an integer"),
            help="tokens per process and micro-batch (may differ between nodes); a list gives one "
                 "value per process of this command; auto: as for --max-sentences")
    _option(group, "--global-batch-size", bounds=Bounds(1), type=int, metavar="N",
            help="samples per step over all processes (default: the sum of their batch sizes; "
                 "smaller leaves room for --auto-balance to move the split)")
    _option(group, "--max-sentences-valid", bounds=Bounds(1), type=int, metavar="N",
            help="validation samples per process (default: --max-sentences)")
    group.add_argument("--train-subset", default="train", metavar="SPLIT", help="split to train on")
    group.add_argument("--valid-subset", default="valid", metavar="SPLITS",
                       help="comma-separated splits to validate on")
    group.add_argument("--disable-validation", action="store_true", help="do not validate")
    _option(group, "--validate-interval", bounds=Bounds(1), type=int, default=1, metavar="N",
            help="validate every N epochs")
    _option(group, "--validate-interval-updates", bounds=Bounds(0), type=int, default=0, metavar="N",
            help="also validate every N updates (0: off)")
    _option(group, "--num-workers", bounds=Bounds(0), type=int, default=0, metavar="N",
            help="DataLoader worker processes")


def add_optimization_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("optimization")
    _option(group, "--max-epoch", bounds=Bounds(0), type=int, default=0, metavar="N",
            help="stop after N epochs (0: no limit; --max-epoch or --max-update must set one)")
    _option(group, "--max-update", bounds=Bounds(0), type=int, default=0, metavar="N",
            help="stop after N updates (0: no limit)")
    _option(group, "--update-freq", bounds=Bounds(1), type=int, metavar="N",
            help="accumulate N micro-batches per update (gradient sync on the last only; default 1, "
                 "or as many as keep the checkpoint's samples per update when resuming)")
    group.add_argument("--fixed-update-freq", action="store_true",
                       help="fail rather than raise --update-freq when the processes cannot hold the global batch "
                            "in one step (e.g. resuming on fewer of them)")
    _option(group, "--lr", bounds=Bounds(0.0), type=float, default=1e-3, help="peak learning rate")
    _option(group, "--weight-decay", "--wd", bounds=Bounds(0.0), type=float, default=0.0, help="weight decay")
    _option(group, "--clip-norm", bounds=Bounds(0.0), type=float, default=0.0, metavar="NORM",
            help="clip gradients to this global norm (0: off)")
    _option(group, "--warmup-updates", bounds=Bounds(0), type=int, default=0, metavar="N",
            help="linear learning-rate warm-up over N updates (every scheduler)")
    group.add_argument("--optimizer-impl", choices=IMPLEMENTATIONS, default="auto",
                       help="torch's implementation of the optimizer step: auto picks fused where torch has it "
                            "(3-6x faster steps on CPU, same update up to float rounding), else foreach")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile the model (dynamic batch dimension: no recompiling for other "
                            "per-rank batch sizes); the first updates are slow while it compiles")


def add_precision_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mixed precision")
    group.add_argument("--precision", metavar="P[,P...]",
                       help="fp32 (default), bf16 or fp16: the forward pass and loss run under autocast, parameters "
                            "and gradients stay fp32; may differ between nodes; a list gives one value per process "
                            "of this command, e.g. fp32,bf16,fp16; auto: bf16 on a CUDA device that has it, else "
                            "fp16 on CUDA, fp32 on CPU")
    group.add_argument("--fp16", action="store_true",
                       help="--precision fp16 for every process of this command (with dynamic loss scaling)")
    group.add_argument("--bf16", action="store_true", help="--precision bf16 for every process of this command")
    _option(group, "--fp16-init-scale", bounds=POSITIVE, type=float, default=2.0**7, metavar="S",
            help="initial loss scale when any process runs fp16")
    _option(group, "--fp16-scale-window", bounds=Bounds(1), type=int, metavar="N",
            help="double the loss scale after N updates without overflow "
                 "(default: 2**14 / world size / update freq)")
    _option(group, "--min-loss-scale", bounds=Bounds(0.0, says="must not be negative"), type=float, default=1e-4,
            metavar="S",
            help="stop with an error when an overflow would lower the loss scale to S or below")
    _option(group, "--threshold-loss-scale", bounds=POSITIVE, type=float, metavar="S",
            help="never lower the loss scale below S")


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpoints")
    group.add_argument("--save-dir", default="checkpoints", metavar="DIR", type=absolute_path,
                       help="where checkpoints go")
    group.add_argument("--restore-file", default="checkpoint_last.pt", metavar="FILE",
                       help="checkpoint to resume from (relative to --save-dir unless absolute)")
    group.add_argument("--no-save", action="store_true",
                       help="write no checkpoints, and resume from none unless --restore-file names one")
    _option(group, "--save-interval", bounds=Bounds(1), type=int, default=1, metavar="N", help="save every N epochs")
    _option(group, "--save-interval-updates", bounds=Bounds(0), type=int, default=0, metavar="N",
            help="also save every N updates (0: off)")
    _option(group, "--keep-interval-updates", bounds=Bounds(-1), type=int, default=-1, metavar="N",
            help="keep only the last N update checkpoints (-1: all)")
    _option(group, "--keep-last-epochs", bounds=Bounds(-1), type=int, default=-1, metavar="N",
            help="keep only the last N epoch checkpoints (-1: all)")
    group.add_argument("--no-epoch-checkpoints", action="store_true", help="only keep last and best")
    group.add_argument("--no-async-save", action="store_true",
                       help="write checkpoints on the training thread (default: a host-memory snapshot is "
                            "written in the background while training goes on)")
    group.add_argument("--best-checkpoint-metric", default="loss", metavar="METRIC",
                       help="validation metric that picks checkpoint_best.pt")
    group.add_argument("--maximize-best-checkpoint-metric", action="store_true",
                       help="larger values of --best-checkpoint-metric are better")
    group.add_argument("--reset-optimizer", action="store_true",
                       help="when resuming, load the model but start optimizer and schedule afresh")


LIVE_RECOVERY = FlagOwner("--fault-tolerance", "live", ("--live-timeout",))
"""Live recovery (:mod:`hetfair.live`) owns ``--live-timeout``."""


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("distributed training")
    _option(group, "--distributed-world-size", bounds=Bounds(1), type=int, default=1, metavar="N",
            help="total number of processes in the job")
    group.add_argument("--distributed-init-method", metavar="URL",
                       help="rendezvous: tcp://HOST:PORT, file:///shared/path or env://")
    _option(group, "--distributed-rank", bounds=Bounds(0), type=int, default=0, metavar="R",
            help="global rank of the first process this command starts")
    _option(group, "--distributed-gpus", bounds=Bounds(1), type=int, metavar="N",
            help="processes this command starts on this node (default: all of the world on one node)")
    _option(group, "--device-id", "--local_rank", bounds=Bounds(0), default=0, dest="device_id", metavar="ID[,ID...]",
            type=PerProcessValues(_whole_number, "device_id", int, "an integer"),
            help="first GPU this command uses (its processes take the next ones); a list gives each "
                 "process of this command its own GPU, e.g. 0,2,3")
    group.add_argument("--distributed-backend", choices=("nccl", "gloo"),
                       help="collective backend (default: nccl on GPUs, gloo on CPU)")
    _option(group, "--distributed-port", bounds=Bounds(0, 65535), type=int, default=0, metavar="PORT",
            help="port for SLURM rendezvous")
    group.add_argument("--distributed-interface", metavar="NAME",
                       help="network interface that reaches the other nodes, for gloo and NCCL (default: the one "
                            "towards the rendezvous host; overrides GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME)")
    group.add_argument("--distributed-secret", metavar="SECRET",
                       help="shared secret that signs the ranks' check-in (default: $HETFAIR_SECRET; needed "
                            "when the rendezvous is reachable from other machines; never stored in checkpoints)")
    _option(group, "--distributed-timeout", type=float, default=600.0, metavar="SECONDS",
            bounds=Bounds(0.0, open_minimum=True, says="must be a positive number of seconds"),
            help="give up when a rank is lost or a collective stalls this long")
    group.add_argument("--fault-tolerance", choices=("none", "live"), default="none",
                       help="live: when a rank dies or leaves, the others agree on the new membership and go on "
                            "from their own state, and a rank that joins gets the state from a live peer (no "
                            "restart, no checkpoint read; the ranks meet at a lighthouse, see docs/elastic.md)")
    _option(group, "--live-timeout", type=float, default=10.0, metavar="SECONDS",
            bounds=Bounds(0.0, open_minimum=True, says="must be a positive number of seconds"),
            help="with --fault-tolerance live: a rank that stops answering (no heartbeat, or a collective "
                 "waiting for it) this long is dropped and the others go on without it")
    group.add_argument("--fast-stat-sync", action="store_true",
                       help="accepted for HetSeq compatibility: stats are always synced in one "
                            "all-reduce when they can be summed")
    group.add_argument("--find-unused-parameters", action="store_true",
                       help="let DDP handle parameters that get no gradient")
    _option(group, "--bucket-cap-mb", bounds=Bounds(0.0), type=float, default=25.0, metavar="MB",
            help="DDP gradient bucket size in MiB (as fairseq); gradients are all-reduced bucket by "
                 "bucket while the backward pass goes on")
    group.add_argument("--ddp-backend", metavar="NAME", default="c10d",
                       help="parallelism strategy: c10d replicates the model (DistributedDataParallel); "
                            "fully_sharded shards parameters, gradients and optimizer state over the ranks "
                            "(FSDP2), for models larger than the smallest device; hybrid_sharded shards inside "
                            "each node and replicates across nodes (for slow links between them); localsgd and "
                            "diloco train each node apart and synchronise every --outer-interval updates (slow "
                            "links); auto: c10d when every process holds the model's state and a micro-batch, else "
                            "fully_sharded by --memory-budget (docs: auto-plan); one of: "
                            f"{_known(STRATEGY_REGISTRY.names())}")
    group.add_argument("--no-reshard-after-forward", action="store_true",
                       help="with fully_sharded or hybrid_sharded: keep each unit's parameters gathered from "
                            "its forward to its backward (less communication, more memory; ZeRO-2-like)")
    group.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                       help="with fully_sharded or hybrid_sharded: the dtype gradients are reduced in; bf16 "
                            "halves the bytes sent (parameters and the update stay fp32; not exact)")
    _option(group, "--shard-group-size", bounds=Bounds(1), type=int, metavar="N",
            help="with hybrid_sharded: shard over groups of N consecutive ranks and replicate across the groups "
                 "(default: the processes of each node)")
    _option(group, "--outer-interval", bounds=Bounds(1), type=int, metavar="H",
            help="with --ddp-backend localsgd or diloco: inner updates per outer round, between two "
                 "synchronisations across nodes (default: 8)")
    _option(group, "--outer-fragments", bounds=Bounds(1), type=int, default=1, metavar="K",
            help="with --ddp-backend localsgd or diloco: split the model into K fragments of about equal bytes "
                 "that meet in turn, one every H/K inner updates, so the link carries 1/K of the model at a time "
                 "(Streaming DiLoCo; default: 1, the whole model every H updates)")
    group.add_argument("--outer-overlap", action="store_true",
                       help="with --ddp-backend localsgd or diloco: send each fragment's pseudo-gradient in the "
                            "background and apply its outer step at the next meeting, while inner updates go on")
    group.add_argument("--outer-reduce-dtype", choices=OUTER_REDUCE_DTYPES, default="fp32",
                       help="with --ddp-backend localsgd or diloco: how pseudo-gradients cross the link: fp32 "
                            "(exact), or packed bf16, int8 or int4 with per-block scales and error feedback "
                            "(2, 4 or about 7 times fewer bytes; not exact)")
    group.add_argument("--inner-steps-by", choices=INNER_STEPS_BY, default="count",
                       help="with --ddp-backend localsgd or diloco: count takes one inner step per update on every "
                            "node; time lets each node take as many steps of its batch size per update as its "
                            "measured speed allows (a node twice as fast takes two), so no node waits for the "
                            "slowest (docs: slow-links)")
    _option(group, "--outer-lr", bounds=POSITIVE, type=float, metavar="LR",
            help="with --ddp-backend diloco: learning rate of the outer SGD on the averaged pseudo-gradients "
                 "(default: 0.7, as in the DiLoCo paper)")
    _option(group, "--outer-momentum", bounds=Bounds(0.0, 1.0, open_maximum=True), type=float, metavar="M",
            help="with --ddp-backend diloco: Nesterov momentum of the outer SGD (default: 0.9, as in the "
                 "DiLoCo paper)")
    _option(group, "--pipeline-stages", bounds=Bounds(2), type=int, default=2, metavar="S",
            help="with --ddp-backend pipeline: the stages each pipeline cuts the model into, at its sharding units "
                 "(layers); the processes form world/S pipelines (default: 2)")
    group.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="1f1b",
                       help="with --ddp-backend pipeline: torch.distributed.pipelining's schedule: gpipe, 1f1b, or "
                            "interleaved (1F1B over two smaller stages per process; 2*S stages)")
    _option(group, "--pipeline-microbatches", bounds=Bounds(1), type=int, default=4, metavar="M",
            help="with --ddp-backend pipeline: the micro-batches a pipeline's share of each step is cut into "
                 "(more fill the pipeline better; a pipeline's stages must agree, pipelines may differ)")
    group.add_argument("--pipeline-split", metavar="even|auto|N0,N1,...", default="even",
                       help="with --ddp-backend pipeline: sharding units per stage: even, auto (by each stage's "
                            "measured speed and memory budget, so the slowest stage is as short as it can be), or "
                            "one count per stage like 4,8")
    group.add_argument("--pipeline-layout", choices=PIPELINE_LAYOUTS, default="across",
                       help="with --ddp-backend pipeline: across puts stage s of every pipeline on consecutive "
                            "ranks (one node per stage: activations cross the slow link, gradients stay inside "
                            "the node); inside puts each pipeline's stages on consecutive ranks")
    group.add_argument("--shard-fractions", metavar="F0,F1,...",
                       help="with fully_sharded: one number per rank, its share of the parameters, gradients and "
                            "optimizer state (e.g. 1,3: rank 1 holds three times rank 0's share; default: from "
                            "--memory-budget, else equal shares)")
    _option(group, "--memory-budget", metavar="SIZE[,SIZE...]",
            bounds=Bounds(1, MAX_MEMORY_BUDGET, shows=format_size),
            type=PerProcessValues(parse_size, "memory_budget", int, "a memory size"),
            help="memory each process may use, e.g. 6G or 6G,20G (one per process of this command); "
                 "the sharded state is split in proportion (default on CUDA: the device's free memory)")
    _option(group, "--offload", bounds=Bounds(0, 1), default=0, metavar="0|1[,0|1...]",
            type=PerProcessValues(_whole_number, "offload", int, "0 or 1"),
            help="with fully_sharded and shard fractions: 1 keeps this process's shards, their gradients and its "
                 "optimizer state in host memory, gathered to its CUDA device for compute (one per process)")
    _option(group, "--activation-checkpointing", bounds=Bounds(0, 1), default=0, metavar="0|1[,0|1...]",
            type=PerProcessValues(_whole_number, "activation_checkpointing", int, "0 or 1"),
            help="1: recompute each sharding unit's activations in the backward instead of keeping them (less "
                 "memory, one more forward per unit; exact); one value per process of this command, e.g. 1,0")
    group.add_argument("--zero-sharding", choices=ZERO_SHARDINGS, default="none",
                       help="os: shard optimizer state across ranks (ZeRO stage 1); "
                            "each rank updates its shard and broadcasts it")
    group.add_argument("--zero-shard-weights", metavar="W0,W1,...",
                       help="with --zero-sharding os: one weight per rank (e.g. GPU memory); a rank's "
                            "shard grows in proportion (default: from --memory-budget, else equal shards)")
    group.add_argument("--ddp-comm-hook", metavar="NAME", default="none",
                       help="with c10d: how DDP communicates gradients; none: the exact fp32 all-reduce; "
                            "fp16/bf16 (lossy): compressed to half precision; powersgd (lossy): low-rank "
                            "PowerSGD with error feedback; auto: measure link and compute, then choose "
                            f"(see the comm | line); one of: {_known(comm_hook_choices())}")


def add_comm_hook_args(parser: argparse.ArgumentParser) -> None:
    """Each comm hook's own flags, with the chosen components' (every hook that loads, imported then: given with
    another hook, its flags are one error line)."""
    for name, hook in loadable_hooks().items():
        _add_component_flags(parser, f"comm hook '{name}'", hook)


AUTO_BALANCE = FlagOwner("--auto-balance", True, ("--balance-start", "--balance-warmup-updates",
                                                  "--balance-interval", "--balance-smoothing", "--balance-threshold"))
"""The load balancer (:mod:`hetfair.balance`) runs with ``--auto-balance`` only, and owns its flags."""


def add_balance_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load balancing")
    group.add_argument("--auto-balance", action="store_true",
                       help="re-split each global batch among processes by their measured speed "
                            "(each process's batch size stays a maximum)")
    group.add_argument("--balance-start", metavar="probe|batch-sizes", default="probe",
                       help="the first split: probe (time one short step on every process at start-up and split by "
                            "speed) or batch-sizes (in proportion to the batch sizes)")
    _option(group, "--balance-warmup-updates", bounds=Bounds(0), type=int, default=1, metavar="N",
            help="updates to ignore after start-up before measuring speeds")
    _option(group, "--balance-interval", bounds=Bounds(1), type=int, default=3, metavar="N",
            help="measured updates between two re-split decisions")
    _option(group, "--balance-smoothing", bounds=Bounds(0.0, 1.0, open_minimum=True), type=float, default=0.2,
            metavar="W",
            help="weight of the newest update in the moving average of compute times (0 < W <= 1)")
    _option(group, "--balance-threshold", bounds=Bounds(0.0, 1.0, open_maximum=True), type=float, default=0.03,
            metavar="F",
            help="re-split only if the predicted step time drops by more than this fraction")


def build_parser() -> argparse.ArgumentParser:
    """The core parser, without any component's own flags."""
    parser = argparse.ArgumentParser(
        prog="hetfair-train",
        description="Train a model with hetfair on one or many (heterogeneous) processes.",
        allow_abbrev=False,
        formatter_class=DefaultsHelpFormatter,
    )
    for add in (add_common_args, add_component_args, add_dataset_args, add_optimization_args,
                add_precision_args, add_checkpoint_args, add_distributed_args, add_balance_args):
        add(parser)
    return parser


def _set_defaults(parser: argparse.ArgumentParser, defaults: dict[str, Any], owner: str) -> None:
    """Apply a component's option defaults after checking that each names an option and fits its type."""
    if not isinstance(defaults, dict):
        raise ConfigError(f"{owner} must give its option defaults as a dict, not {type(defaults).__name__}")
    actions = {action.dest: action for action in parser._actions}
    unknown = sorted(set(defaults) - set(actions))
    if unknown:
        raise ConfigError(f"{owner} sets defaults for unknown options: {', '.join(unknown)}")
    for dest, value in defaults.items():
        problem = _default_problem(actions[dest], value)
        if problem:
            flag = actions[dest].option_strings[0]
            raise ConfigError(f"{owner} sets the default of {flag} to {value!r}, but {flag} {problem}")
    parser.set_defaults(**defaults)


_TYPE_NAMES = {int: "an integer", float: "a number"}


def _default_problem(action: argparse.Action, value: Any) -> str | None:
    """Why ``value`` cannot be the default of ``action``'s option, or ``None`` when it can."""
    if value is None:
        return None
    if action.nargs == 0:  # a switch (store_true, store_const, ...)
        return None if isinstance(value, bool) else "is a switch: give True or False"
    if action.nargs not in (None, "?"):
        if not isinstance(value, (list, tuple)):
            return "takes a list of values"
        problems = [_value_problem(action, item) for item in value]
        return next((problem for problem in problems if problem), None)
    return _value_problem(action, value)


def _value_problem(action: argparse.Action, value: Any) -> str | None:
    """Why ``value`` is no single value of ``action``'s option, or ``None``."""
    convert = action.type
    if isinstance(convert, PerProcessValues):
        return convert.problem(value)
    if isinstance(value, str):
        if convert is not None:  # argparse converts string defaults like command-line text
            try:
                value = convert(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                return f"takes {_TYPE_NAMES.get(convert, 'another kind of value')}"
    elif convert is None:
        return f"takes text, not {_a(value)}"
    elif convert in _TYPE_NAMES:
        allowed = (int,) if convert is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, allowed):
            return f"takes {_TYPE_NAMES[convert]}, not {_a(value)}"
    if action.choices is not None and value not in action.choices:
        return f"takes one of: {', '.join(map(str, action.choices))}"
    return None


def _a(value: Any) -> str:
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _add_component_flags(parser: argparse.ArgumentParser, title: str, component: Any) -> None:
    group = parser.add_argument_group(title)
    try:
        component.add_args(group)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"{title} declares a flag that clashes with another option: {exc}") from exc


def parse_train_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``hetfair-train`` arguments, importing ``--user-dir`` first."""
    argv = list(argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--user-dir")
    user_dir = pre.parse_known_args(argv)[0].user_dir
    if user_dir:
        import_user_dir(user_dir)

    # One parser: probed for the chosen components (without --help, which would
    # print and exit before their flags are known), then extended with those
    # components' flags and defaults and parsed for real.
    parser = build_parser()
    probe_argv = [arg for arg in argv if arg not in ("-h", "--help")]
    early, _ = parser.parse_known_args(probe_argv)
    if early.list_plugins or early.task is None:
        args = parser.parse_args(argv)
        if not args.list_plugins:
            parser.error(f"--task is required; known tasks: {_known(TASK_REGISTRY.names())}")
        return args

    task_cls = TASK_REGISTRY.get(early.task)
    _set_defaults(parser, task_cls.option_defaults, f"task '{early.task}' [{TASK_REGISTRY.source(early.task)}]")
    chosen, _ = parser.parse_known_args(probe_argv)
    model_name = add_chosen_components(parser, chosen)
    args = parser.parse_args(argv)
    args.model = model_name
    validate_args(args, parser, argv)
    return args


def _arch_source(arch: str) -> str:
    """Where ``--arch`` comes from: the architecture's definition, or the model's when it names a model."""
    return ARCH_REGISTRY.source(arch) if arch in ARCH_REGISTRY.names() else MODEL_REGISTRY.source(arch)


def add_chosen_components(parser: argparse.ArgumentParser, chosen: argparse.Namespace) -> str:
    """Add the flags and defaults of the task, arch, criterion, optimizer and scheduler ``chosen`` names (and
    the comm hooks' flags, :func:`add_comm_hook_args`).

    Returns the model that ``chosen.arch`` belongs to.
    """
    if chosen.arch is None:
        raise ConfigError(f"task '{chosen.task}' has no default --arch; choose one of: {_known(arch_names())}")
    model_name, arch_defaults = resolve_arch(chosen.arch)
    _add_component_flags(parser, f"task '{chosen.task}'", TASK_REGISTRY.get(chosen.task))
    _add_component_flags(parser, f"model '{model_name}'", MODEL_REGISTRY.get(model_name))
    _add_component_flags(parser, f"criterion '{chosen.criterion}'", CRITERION_REGISTRY.get(chosen.criterion))
    _add_component_flags(parser, f"optimizer '{chosen.optimizer}'", OPTIMIZER_REGISTRY.get(chosen.optimizer))
    _add_component_flags(parser, f"lr scheduler '{chosen.lr_scheduler}'",
                         LR_SCHEDULER_REGISTRY.get(chosen.lr_scheduler))
    add_comm_hook_args(parser)
    _set_defaults(parser, arch_defaults, f"architecture '{chosen.arch}' [{_arch_source(chosen.arch)}]")
    return model_name


def stored_options(config: dict[str, Any]) -> argparse.Namespace:
    """Options stored in a checkpoint, completed with the defaults of the components they name.

    An option the checkpoint lacks (an older hetfair, a hand-edited arch) takes its default
    instead of being missing when the model is built; the model is the one of the stored arch.
    """
    parser = build_parser()
    _set_defaults(parser, TASK_REGISTRY.get(config["task"]).option_defaults, f"task '{config['task']}'")
    model_name = add_chosen_components(parser, argparse.Namespace(**{**vars(parser.parse_args([])), **config}))
    return argparse.Namespace(**{**vars(parser.parse_args([])), **config, "model": model_name})


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Every core option of ``parser`` checked at start-up, before any compute or process is started:
    the bounds each option declares (:func:`_option`), then what relates several options (``argv`` tells
    which flags were given, for :func:`check_owned_flags`).

    What a run needs beyond valid values (an end, writable directories, the restore file) is
    :func:`hetfair.run.training.check_before_start`; the ranks' agreement is checked when they meet.
    """
    if args.max_sentences is None and args.max_tokens is None:
        raise ConfigError("give a batch size: --max-sentences N (samples per process) or --max-tokens N")
    args.precision = _chosen_precision(args)
    for action in parser._actions:
        bounds: Optional[Bounds] = getattr(action, "bounds", None)
        if bounds is None:
            continue
        for value in values_of(getattr(args, action.dest)):
            problem = None if value in (None, AUTO) else bounds.problem(value, is_float=action.type is float)
            if problem:
                raise ConfigError(f"{action.option_strings[0]} {problem}, got {bounds.shows(value)}")
    _check_parallel(args, parser, argv)


def _check_parallel(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """The flags the modes own and the strategy's own checks; for ``--ddp-backend auto``, those of both
    backends it may choose."""
    config = ParallelConfig.from_args(args)
    if config.ddp_backend != AUTO:
        _check_backend(args, parser, argv, config)
        return
    for backend in plan_candidates():
        try:
            _check_backend(argparse.Namespace(**{**vars(args), "ddp_backend": backend}), parser, argv,
                           replace(config, ddp_backend=backend))
        except ConfigError as exc:
            raise ConfigError(f"--ddp-backend auto may choose {backend}: {exc}") from None


def _check_backend(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str],
                   config: ParallelConfig) -> None:
    STRATEGY_REGISTRY.get(config.ddp_backend)  # an unknown or broken strategy is the first thing to say
    check_owned_flags(args, parser, argv)
    check_strategy_options(config)


def check_owned_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Refuse a flag that ``argv`` gives (its default never counts) when no mode that owns it is chosen."""
    owners = flag_owners()
    for flag in _given(parser, argv, {flag for owner in owners for flag in owner.flags}):
        mine = [owner for owner in owners if flag in owner.flags]
        if not any(owner.is_chosen(args, parser) for owner in mine):
            raise ConfigError(f"{flag} needs {_either(mine)}{_chosen_instead(mine[0].selector, args, parser)}")


def flag_owners() -> list[FlagOwner]:
    """Every mode that owns flags: each strategy (``--ddp-backend``), comm hook, ZeRO mode, live recovery and
    load balancing."""
    strategies = [FlagOwner("--ddp-backend", name, strategy.owned_flags) for name, strategy in _strategies()]
    hooks = [FlagOwner("--ddp-comm-hook", hook, flags) for hook, flags in comm_hook_flags().items()]
    zero = [FlagOwner("--zero-sharding", mode, flags) for mode, flags in ZERO_SHARDING_FLAGS.items()]
    return [*strategies, *hooks, *zero, LIVE_RECOVERY, AUTO_BALANCE]


def _strategies() -> list[tuple[str, Any]]:
    """Every strategy that loads: a plugin strategy that fails to load owns nothing here (choosing it says why)."""
    loaded = []
    for name in STRATEGY_REGISTRY.names():
        try:
            loaded.append((name, STRATEGY_REGISTRY.get(name)))
        except HetfairError:
            continue
    return loaded


def _given(parser: argparse.ArgumentParser, argv: Sequence[str], flags: set[str]) -> list[str]:
    """Those of ``flags`` that ``argv`` gives, in the parser's order: ``argv`` parsed again into a namespace
    where their destinations hold a marker, which argparse leaves where a flag is not given."""
    actions = {action.option_strings[0]: action for action in parser._actions if action.option_strings}
    unknown = sorted(flags - set(actions))
    if unknown:
        raise ConfigError(f"a mode claims flags hetfair-train does not have: {', '.join(unknown)}")
    wanted = [flag for flag in actions if flag in flags]
    unset = object()
    namespace = argparse.Namespace(**{actions[flag].dest: unset for flag in wanted})
    parser.parse_known_args(list(argv), namespace)
    return [flag for flag in wanted if getattr(namespace, actions[flag].dest) is not unset]


def _either(owners: list[FlagOwner]) -> str:
    """``--ddp-backend localsgd or diloco``, ``--auto-balance``: the modes of ``owners`` in words."""
    by_selector: dict[str, list[str]] = {}
    for owner in owners:
        by_selector.setdefault(owner.selector, []).append("" if owner.value is True else str(owner.value))
    return " or ".join(f"{selector} {_one_of(values)}".rstrip() for selector, values in by_selector.items())


def _one_of(values: list[str]) -> str:
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def _chosen_instead(selector: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """`` (this command has --ddp-backend c10d)``; nothing for a switch, which is simply not given."""
    action = parser._option_string_actions[selector]
    return "" if action.nargs == 0 else f" (this command has {selector} {getattr(args, action.dest)})"


def _whole_number_or_auto(text: str) -> int | str:
    return AUTO if text == AUTO else _whole_number(text)


def _precision_or_auto(text: str) -> str:
    return AUTO if text == AUTO else parse_precision(text)


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"'{text}' is not a whole number") from None


def _chosen_precision(args: argparse.Namespace) -> str | tuple[str, ...]:
    """``--precision`` (one value or one per process), or what ``--fp16`` / ``--bf16`` stand for."""
    given = [flag for flag, chosen in (("--precision", args.precision is not None), ("--fp16", args.fp16),
                                       ("--bf16", args.bf16)) if chosen]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} both choose the precision; give only one of them")
    if args.precision is None:
        return "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    return parse_per_process(args.precision, _precision_or_auto, "precision")


_NEVER_STORED = ("distributed_secret",)


def plain_config(args: argparse.Namespace) -> dict[str, Any]:
    """The options as plain data (numbers, strings, lists), safe to store in checkpoints (no secrets)."""
    plain: dict[str, Any] = {}
    for key, value in vars(args).items():
        if key in _NEVER_STORED:
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            plain[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            plain[key] = list(value)
    return plain
