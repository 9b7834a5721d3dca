"""Start the training processes of this node and join them into one group.

Modes, chosen from the options and the environment:

* ``env://`` under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set): one process, no spawning;
* SLURM: ranks from SLURM_PROCID/SLURM_NTASKS (one task per process), or one task
  per node that spawns ``--distributed-gpus`` processes; master = first node;
* ``--distributed-init-method tcp://…`` or ``file://…``: spawn
  ``--distributed-gpus`` processes with ranks from ``--distributed-rank`` on;
* ``--distributed-world-size N`` alone: N local processes meeting through a private
  ``file://`` store in a directory only this user can read (no TCP port);
* otherwise a single process without a process group, in this process.

Every rank of a distributed job runs in a worker process that this command spawns and
supervises (:mod:`hetfair.launch.supervisor`): failures and Ctrl-C end all of them
with one line; SIGTERM or SIGUSR1 preempts them (:mod:`hetfair.launch.preemption`).

Options given per process (``--max-sentences 48,16``, ``--device-id 0,2``, see
:mod:`hetfair.launch.per_process`) must list one value per process started
here, or under torchrun one per worker of the node (``LOCAL_WORLD_SIZE``); each
process receives its own. Under SLURM they may be given per node (``48:16``).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from hetfair.launch.agent_store import fresh_store, join_warning, uses_agent_store
from hetfair.parallel.context import DistributedContext
from hetfair.launch.check_in import CheckIn
from hetfair.launch.per_process import check_counts, for_node, for_process
from hetfair.launch.native_output import native_stderr_discarded, quiet_native_logs
from hetfair.launch.network import GLOO_INTERFACE_ENV, choose_interface, use_interface
from hetfair.launch.rendezvous import (
    check_store_directory,
    create_store,
    job_secret,
    parse_init_method,
    private_secret,
)
from hetfair.launch.slurm import first_host, in_slurm_job, node_of, tasks_on_this_node
from hetfair.launch.preemption import preemptible
from hetfair.launch.supervisor import deadline, exit_with_parent, launcher_is_gone, run_workers
from hetfair.errors import ConfigError, DistributedError, Preempted, first_line
from hetfair.parallel import ParallelConfig, check_strategy_world
from hetfair.plugins import import_user_dir

_RENDEZVOUS_GRACE_SECONDS = 5.0
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun in its workers' environment."""
TrainFunction = Callable[[argparse.Namespace, DistributedContext], None]


@dataclass(frozen=True)
class LaunchPlan:
    """What this command starts: ``nprocs`` local processes with ranks ``base_rank + i``."""

    world_size: int
    base_rank: int
    nprocs: int
    init_method: str | None
    local_rank_offset: int = 0
    use_env_store: bool = False
    secret: Optional[bytes] = None
    """Signs the check-in (see :mod:`hetfair.launch.rendezvous`); never stored in checkpoints."""
    interface: Optional[str] = None
    """The network interface gloo (and NCCL) use here: the loopback interface when every rank runs on this
    machine, else the one towards the rendezvous host (see :mod:`hetfair.launch.network`)."""
    private_dir: Optional[str] = None
    """The directory of a one-command job's own store, removed when the job ends."""
    node_processes: int = 0
    """Under torchrun, or SLURM with one task per process: the node's processes (``LOCAL_WORLD_SIZE``, the
    node's tasks), whose per-process lists are indexed by local rank; 0 when the lists hold one value per
    process of this command."""
    node_starter: str = "torchrun (--nproc-per-node)"
    """What starts the node's processes, as a list of the wrong length names it."""

    def list_length(self) -> int:
        """How many values a per-process list must hold."""
        return self.node_processes or self.nprocs

    def list_index(self, index: int) -> int:
        """Which item of a per-process list local process ``index`` of this command takes."""
        return self.local_rank_offset + index if self.node_processes else index

    def check_counts(self, args: argparse.Namespace) -> None:
        """Refuse a per-process list of the wrong length before anything starts."""
        starter = f"{self.node_starter} starts" if self.node_processes else "this command starts"
        check_counts(args, self.list_length(), starter)


def plan_launch(args: argparse.Namespace, env: Mapping[str, str]) -> LaunchPlan:
    """Decide ranks and rendezvous from the options and environment variables."""
    if "RANK" in env and "WORLD_SIZE" in env and (args.distributed_init_method in (None, "env://")):
        return LaunchPlan(
            world_size=int(env["WORLD_SIZE"]), base_rank=int(env["RANK"]), nprocs=1,
            init_method="env://", local_rank_offset=int(env.get("LOCAL_RANK", 0)), use_env_store=True,
            node_processes=int(env.get("LOCAL_WORLD_SIZE", 1)),
        )
    if args.distributed_init_method is None and in_slurm_job(env):
        return _plan_slurm(args, env)
    world_size = args.distributed_world_size
    if args.distributed_init_method is None:
        if args.distributed_rank != 0:
            raise ConfigError("--distributed-rank needs --distributed-init-method to reach the other nodes")
        # a private store is made when the processes start (see launch)
        return LaunchPlan(world_size=world_size, base_rank=0, nprocs=world_size, init_method=None)
    nprocs = args.distributed_gpus or _default_local_processes(args)
    if args.distributed_rank + nprocs > world_size:
        raise ConfigError(
            f"this command would start ranks {args.distributed_rank}..{args.distributed_rank + nprocs - 1} "
            f"but --distributed-world-size is {world_size}; check --distributed-rank/--distributed-gpus"
        )
    return LaunchPlan(world_size=world_size, base_rank=args.distributed_rank, nprocs=nprocs,
                      init_method=args.distributed_init_method)


def _plan_slurm(args: argparse.Namespace, env: Mapping[str, str]) -> LaunchPlan:
    if not args.distributed_port:
        raise ConfigError("under SLURM, give --distributed-port so the ranks can meet on the first node")
    init_method = f"tcp://{first_host(env['SLURM_JOB_NODELIST'])}:{args.distributed_port}"
    ntasks = int(env["SLURM_NTASKS"])
    nnodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
    if ntasks == nnodes and args.distributed_gpus and args.distributed_gpus > 1:
        node = int(env.get("SLURM_NODEID", "0"))
        per_node = args.distributed_gpus
        return LaunchPlan(world_size=nnodes * per_node, base_rank=node * per_node, nprocs=per_node,
                          init_method=init_method)
    # one task per process: a per-process list holds one value per task of the node, each taking its SLURM_LOCALID's
    return LaunchPlan(world_size=ntasks, base_rank=int(env["SLURM_PROCID"]), nprocs=1, init_method=init_method,
                      local_rank_offset=int(env.get("SLURM_LOCALID", "0")),
                      node_processes=tasks_on_this_node(env) or 1, node_starter="SLURM (--ntasks-per-node)")


def _default_local_processes(args: argparse.Namespace) -> int:
    if isinstance(args.device_id, tuple):
        return len(args.device_id)
    if not args.cpu and torch.cuda.is_available():
        return torch.cuda.device_count() - args.device_id
    return 1


def launch(args: argparse.Namespace, train_fn: TrainFunction) -> None:
    """Run ``train_fn`` in every process this command is responsible for.

    One process without a group runs here; the ranks of a distributed job run in spawned
    worker processes (see :mod:`hetfair.launch.supervisor`), also when this command
    starts only one of them.
    """
    args = for_node(args, node_of(os.environ) if args.distributed_init_method is None else None)
    plan = plan_launch(args, os.environ)
    if TORCHRUN_ENV in os.environ:
        exit_with_parent()  # torchrun killed by SIGKILL must not leave its workers training on
    check_strategy_world(ParallelConfig.from_args(args), plan.world_size)
    plan.check_counts(args)
    if plan.world_size == 1:
        with preemptible():
            device = _device_for(args, plan, 0)
            args = for_process(args, plan.list_index(0))
            train_fn(args, DistributedContext(rank=0, world_size=1, local_rank=0, device=device))
        return
    with _rendezvous_for(plan, args) as plan:
        run_workers(plan.nprocs, plan.base_rank, _run_rank, (args, plan, train_fn))


@contextmanager
def _rendezvous_for(plan: LaunchPlan, args: argparse.Namespace) -> Iterator[LaunchPlan]:
    """The plan with its store, secret and network interface: a private file store for a one-command job
    (removed after)."""
    if plan.init_method is not None:
        address = parse_init_method(plan.init_method, os.environ)
        check_store_directory(address)
        serves_store = not plan.use_env_store or uses_agent_store(os.environ)  # not torchrun's own store
        # a missing secret is refused before the network is looked at
        secret = job_secret(args.distributed_secret, address, os.environ) if serves_store else plan.secret
        interface = choose_interface(args.distributed_interface, address)  # a host that does not resolve ends here
        if plan.use_env_store and address.is_loopback and args.distributed_interface is None:
            interface = None  # torchrun's MASTER_ADDR may be loopback on its own node only (a host name as 127.0.1.1)
        yield replace(plan, secret=secret, interface=interface)
        return
    directory = tempfile.mkdtemp(prefix="hetfair-rendezvous-")  # mode 0700: this user only
    try:
        yield replace(plan, init_method=f"file://{directory}/store", secret=private_secret().encode(),
                      interface=choose_interface(args.distributed_interface, None), private_dir=directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _run_rank(index: int, args: argparse.Namespace, plan: LaunchPlan, train_fn: TrainFunction) -> None:
    """One rank, in its worker process; a rank whose launcher was killed removes the job's own store."""
    try:
        _train_rank(index, args, plan, train_fn)
    finally:
        if plan.private_dir and launcher_is_gone():  # killed (SIGKILL): it cannot clean up
            shutil.rmtree(plan.private_dir, ignore_errors=True)


def _train_rank(index: int, args: argparse.Namespace, plan: LaunchPlan, train_fn: TrainFunction) -> None:
    """One rank: join the group, train, leave the group in order."""
    device = _device_for(args, plan, index)
    args = for_process(args, plan.list_index(index))
    if args.user_dir:
        import_user_dir(args.user_dir)  # the fork server imported hetfair, not the user's plugins
    context = _join_group(index, args, plan, device)
    if context.device.type == "cpu" and plan.nprocs > 1 and "OMP_NUM_THREADS" not in os.environ:
        # like torchrun: processes sharing the CPU must not each use every core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.nprocs))
    try:
        train_fn(args, context)
    except Preempted:
        leave_group()  # every rank stops after the same update: leave in order
        raise
    except (RuntimeError, dist.DistBackendError) as exc:
        # no orderly group shutdown here: it would wait for the peer that is gone
        if looks_like_lost_peer(exc):
            raise DistributedError(
                f"rank {context.rank} lost contact with the other ranks ({first_line(exc)}); "
                f"a process probably died or stalled longer than --distributed-timeout"
            ) from exc
        raise
    leave_group()


def leave_group() -> None:
    """Leave the default process group in order, once every rank is done (after its training returned)."""
    # A DDP reducer still alive (in a reference cycle) once the group is destroyed would be its last
    # owner, and its C++ destructor joins gloo's threads holding the GIL, which a gloo thread freeing a
    # work started in a backward needs: collect it first.
    gc.collect()
    # nobody leaves before everyone is done: rank 0 hosts the store the others still hold
    dist.barrier()
    dist.destroy_process_group()


def _join_group(index: int, args: argparse.Namespace, plan: LaunchPlan, device: torch.device) -> DistributedContext:
    """Meet the other ranks and build the process group, in at most ``--distributed-timeout`` (+ grace).

    torch's C++ log lines of the meeting are discarded unless ``--debug`` or the user's own
    ``TORCH_CPP_LOG_LEVEL`` asks for them (see :mod:`hetfair.launch.native_output`): what goes
    wrong is this command's one error line.
    """
    rank = plan.base_rank + index
    backend = process_group_backend(args.distributed_backend, device)
    use_interface(plan.interface, device, override=args.distributed_interface is not None)
    with native_stderr_discarded(enabled=quiet_native_logs(args.debug)):
        _form_group(rank, backend, args.distributed_timeout, plan)
    return DistributedContext(rank=rank, world_size=plan.world_size, local_rank=plan.local_rank_offset + index,
                              device=device)


def _form_group(rank: int, backend: str, timeout: float, plan: LaunchPlan) -> None:
    assert plan.init_method is not None
    limit = timeout + _RENDEZVOUS_GRACE_SECONDS  # the waits inside end first; these deadlines catch C++ hangs
    if plan.use_env_store and not uses_agent_store(os.environ):
        with deadline(limit, f"rank {rank} could not join the process group through env:// within {timeout:.0f}s"):
            _init_process_group(backend, rank, plan, timeout, init_method="env://")
        return
    if plan.use_env_store:  # torchrun's shared store: find this start's own through it
        warning = join_warning(os.environ)
        if warning and rank == 0:
            print(f"hetfair-train: warning: {warning}", file=sys.stderr, flush=True)
        with deadline(limit, f"rank {rank} found no store of this start through torchrun's within {timeout:.0f}s"):
            store = fresh_store(os.environ, rank, plan.world_size, timeout, plan.secret)
    else:
        address = parse_init_method(plan.init_method, os.environ)
        with deadline(limit, f"rank {rank} got no answer from the rendezvous {plan.init_method} within "
                             f"{timeout:.0f}s; check that it is rank 0's address and that no other program "
                             f"listens there"):
            store = create_store(address, rank, plan.world_size, timeout)
    checking_in = CheckIn(store, rank, plan.world_size, timeout, plan.secret)
    with deadline(limit, checking_in.stalled):
        checking_in.wait()
    with deadline(limit, f"rank {rank} checked in but the process group did not form within {timeout:.0f}s; "
                         f"{_interface_hint(plan)}"):
        _init_process_group(backend, rank, plan, timeout, store=dist.PrefixStore("hetfair/pg", store))


def _init_process_group(backend: str, rank: int, plan: LaunchPlan, timeout: float, **rendezvous: object) -> None:
    try:
        dist.init_process_group(backend, rank=rank, world_size=plan.world_size, timeout=timedelta(seconds=timeout),
                                **rendezvous)
    except (RuntimeError, dist.DistBackendError) as exc:
        if not looks_like_lost_peer(exc):
            raise
        raise DistributedError(
            f"rank {rank} could not connect to the other ranks over {backend} ({first_line(exc)}); "
            f"{_interface_hint(plan)}"
        ) from exc


def _interface_hint(plan: LaunchPlan) -> str:
    used = plan.interface or "the default"
    kept = os.environ.get(GLOO_INTERFACE_ENV)
    if kept and kept != plan.interface:  # the user's own setting, kept without --distributed-interface
        used = f"{kept}, from {GLOO_INTERFACE_ENV}"
    return (f"give every node's command --distributed-interface with the network interface that reaches the "
            f"others (this node used {used})")


def _device_for(args: argparse.Namespace, plan: LaunchPlan, index: int) -> torch.device:
    """The device of local process ``index``: ``--device-id`` plus its local rank, or its own item of a list."""
    return process_device(args.cpu, args.device_id, plan.list_index(index), plan.local_rank_offset + index)


def process_device(cpu: bool, device_id: int | tuple[int, ...], list_index: int, local_rank: int) -> torch.device:
    """The device a process trains on (made its current CUDA device): the CPU with ``--cpu`` or without CUDA,
    else its GPU (:func:`gpu_index`), which must be visible."""
    if cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    index = gpu_index(device_id, list_index, local_rank)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"GPU {index} requested but only {torch.cuda.device_count()} are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def process_group_backend(requested: Optional[str], device: torch.device) -> str:
    """``--distributed-backend``, or by default NCCL on a CUDA device and gloo on the CPU."""
    return requested or ("nccl" if device.type == "cuda" else "gloo")


def gpu_index(device_id: int | tuple[int, ...], list_index: int, local_rank: int) -> int:
    """``--device-id 2``: the first GPU, so local rank 1 takes GPU 3; ``--device-id 0,2``: each process's own."""
    return device_id[list_index] if isinstance(device_id, tuple) else device_id + local_rank


_LOST_PEER_MARKERS = ("connection", "timed out", "timeout", "closed", "reset by peer", "broken pipe", "gloo", "nccl")


def looks_like_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from (torch's pipeline schedules wrap a failed send in a
    ``RuntimeError`` of their own), says a peer is gone."""
    cause: BaseException | None = exc
    while cause is not None:
        if any(marker in str(cause).lower() for marker in _LOST_PEER_MARKERS):
            return True
        cause = cause.__cause__
    return False



