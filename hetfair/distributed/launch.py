"""Start the training processes of this node and join them into one group.

Modes, chosen from the options and the environment:

* ``env://`` under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set): one process, no spawning;
* SLURM: ranks from SLURM_PROCID/SLURM_NTASKS (one task per process), or one task
  per node that spawns ``--distributed-gpus`` processes; master = first node;
* ``--distributed-init-method tcp://…`` or ``file://…``: spawn
  ``--distributed-gpus`` processes with ranks from ``--distributed-rank`` on;
* ``--distributed-world-size N`` alone: N local processes meeting on 127.0.0.1;
* otherwise a single process without a process group.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetfair.distributed.context import DistributedContext
from hetfair.distributed.rendezvous import check_in, create_store
from hetfair.distributed.slurm import first_host, in_slurm_job
from hetfair.distributed.zero import ShardingConfig, check_sharding
from hetfair.errors import ConfigError, DistributedError, HetfairError, first_line
from hetfair.plugins import import_user_dir

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


def plan_launch(args: argparse.Namespace, env: Mapping[str, str]) -> LaunchPlan:
    """Decide ranks and rendezvous from the options and environment variables."""
    if "RANK" in env and "WORLD_SIZE" in env and (args.distributed_init_method in (None, "env://")):
        return LaunchPlan(
            world_size=int(env["WORLD_SIZE"]), base_rank=int(env["RANK"]), nprocs=1,
            init_method="env://", local_rank_offset=int(env.get("LOCAL_RANK", 0)), use_env_store=True,
        )
    if args.distributed_init_method is None and in_slurm_job(env):
        return _plan_slurm(args, env)
    world_size = args.distributed_world_size
    if args.distributed_init_method is None:
        if args.distributed_rank != 0:
            raise ConfigError("--distributed-rank needs --distributed-init-method to reach the other nodes")
        init_method = f"tcp://127.0.0.1:{_free_port()}" if world_size > 1 else None
        return LaunchPlan(world_size=world_size, base_rank=0, nprocs=world_size, init_method=init_method)
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
    return LaunchPlan(world_size=ntasks, base_rank=int(env["SLURM_PROCID"]), nprocs=1, init_method=init_method,
                      local_rank_offset=int(env.get("SLURM_LOCALID", "0")))


def _default_local_processes(args: argparse.Namespace) -> int:
    if not args.cpu and torch.cuda.is_available():
        return torch.cuda.device_count() - args.device_id
    return 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: argparse.Namespace, train_fn: TrainFunction) -> None:
    """Run ``train_fn`` in every process this command is responsible for."""
    plan = plan_launch(args, os.environ)
    check_sharding(ShardingConfig.from_args(args), plan.world_size)
    if plan.nprocs == 1:
        _run_process(0, args, plan, train_fn)
        return
    try:
        mp.spawn(_spawned_process, args=(args, plan, train_fn), nprocs=plan.nprocs, join=True)
    except mp.ProcessExitedException as exc:
        raise DistributedError(
            f"process of rank {plan.base_rank + exc.error_index} exited with code {exc.exit_code}; "
            f"the other local processes were stopped (see its message above)"
        ) from exc
    except mp.ProcessRaisedException as exc:
        raise DistributedError(
            f"process of rank {plan.base_rank + exc.error_index} failed: {_last_line(str(exc))}"
        ) from exc


def _spawned_process(index: int, args: argparse.Namespace, plan: LaunchPlan, train_fn: TrainFunction) -> None:
    try:
        _run_process(index, args, plan, train_fn)
    except HetfairError as exc:
        print(f"hetfair-train: error: [rank {plan.base_rank + index}] {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)


def _run_process(index: int, args: argparse.Namespace, plan: LaunchPlan, train_fn: TrainFunction) -> None:
    if args.user_dir:
        import_user_dir(args.user_dir)  # spawned processes start with a fresh interpreter
    context = _join_group(index, args, plan)
    if context.device.type == "cpu" and plan.nprocs > 1 and "OMP_NUM_THREADS" not in os.environ:
        # like torchrun: processes sharing the CPU must not each use every core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.nprocs))
    try:
        train_fn(args, context)
    except (RuntimeError, dist.DistBackendError) as exc:
        # no orderly group shutdown here: it would wait for the peer that is gone
        if context.is_distributed and _looks_like_lost_peer(exc):
            raise DistributedError(
                f"rank {context.rank} lost contact with the other ranks ({first_line(exc)}); "
                f"a process probably died or stalled longer than --distributed-timeout"
            ) from exc
        raise
    if dist.is_initialized():
        # nobody leaves before everyone is done: rank 0 hosts the store the others still hold
        dist.barrier()
        dist.destroy_process_group()


def _join_group(index: int, args: argparse.Namespace, plan: LaunchPlan) -> DistributedContext:
    rank = plan.base_rank + index
    local_rank = plan.local_rank_offset + index
    device = _device_for(args, local_rank)
    if plan.world_size == 1:
        return DistributedContext(rank=0, world_size=1, local_rank=0, device=device)
    backend = args.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = timedelta(seconds=args.distributed_timeout)
    assert plan.init_method is not None
    if plan.use_env_store:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=plan.world_size,
                                timeout=timeout)
    else:
        store = create_store(plan.init_method, rank, plan.world_size, args.distributed_timeout)
        check_in(store, rank, plan.world_size, args.distributed_timeout)
        dist.init_process_group(backend, store=dist.PrefixStore("hetfair/pg", store), rank=rank,
                                world_size=plan.world_size, timeout=timeout)
    return DistributedContext(rank=rank, world_size=plan.world_size, local_rank=local_rank, device=device)


def _device_for(args: argparse.Namespace, local_rank: int) -> torch.device:
    if args.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    index = args.device_id + local_rank
    if index >= torch.cuda.device_count():
        raise ConfigError(f"GPU {index} requested but only {torch.cuda.device_count()} are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


_LOST_PEER_MARKERS = ("connection", "timed out", "timeout", "closed", "reset by peer", "broken pipe", "gloo", "nccl")


def _looks_like_lost_peer(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(marker in text for marker in _LOST_PEER_MARKERS)



def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
