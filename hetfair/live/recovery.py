"""``--fault-tolerance live``: one process trains through membership changes without a restart.

Each membership round (:mod:`hetfair.live.membership`) gets a new default process group under its own
store prefix, and a new :class:`~hetfair.run.training.TrainingRun` on it (in this process: no restart, no
checkpoint read). What carries over is the run's in-memory state, :meth:`Checkpointer.state`:
parameters, optimizer state, schedule, data position, loss scale, balancer, clock. A rank whose state
is not the newest (a joiner, or a survivor that had not finished the update the others finished) gets
the donor's as a ``torch.save`` archive loaded with ``weights_only=True`` (:mod:`hetfair.live.state_transfer`:
nothing a peer sends is unpickled); the others keep their own.

Who may take part: the rounds are the job's signed records under its secret prefix
(:mod:`hetfair.live.records`); the secret is the one of a tcp:// job (``HETFAIR_SECRET`` /
``--distributed-secret``), required when the lighthouse is not on loopback.

Every way a rank ends once it met the lighthouse (done, an error, preempted, the job over) leaves without
the interpreter's teardown (:func:`exit_now`): a group left behind after a lost peer, or the store client
of a lighthouse that went away, may still run a C++ thread that aborts the process when it is destroyed.

An update in flight when a peer is lost is dropped: its collectives fail (a dead peer's connection
closes, a stopped one makes them time out after ``--live-timeout``) before the optimizer steps, so the
state is the one after the last finished update, and the new group trains that update's samples again.
The global batch (``batch`` part) is kept, and an update is the same sum over its samples however they
are split over ranks and steps, so the run ends with the parameters of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
from dataclasses import replace
from datetime import timedelta
from typing import Any, NoReturn, Optional

import torch
import torch.distributed as dist

from hetfair.checkpoint.layout import progress_of
from hetfair.errors import ConfigError, DistributedError, first_line
from hetfair.launch.launcher import leave_group, looks_like_lost_peer, process_device, process_group_backend
from hetfair.launch.native_output import native_stderr_discarded, quiet_native_logs, store_logs_filtered
from hetfair.launch.network import choose_interface, use_interface
from hetfair.launch.preemption import preemptible
from hetfair.launch.rendezvous import StoreAddress, job_secret, parse_init_method, wait_until_reachable
from hetfair.live.membership import Group, Membership, RoundProgress, say
from hetfair.live.records import JobRecords
from hetfair.live.state_transfer import broadcast_state
from hetfair.logging.progress import Progress
from hetfair.parallel import STRATEGY_REGISTRY, ParallelConfig, plan_candidates
from hetfair.parallel.collectives import comm_device
from hetfair.parallel.context import DistributedContext
from hetfair.plan import AUTO
from hetfair.plugins import import_user_dir
from hetfair.run.loop import Regroup
from hetfair.run.training import TrainingRun


def check_live_options(args: argparse.Namespace) -> None:
    """Refuse, in one line each, what live recovery cannot keep exact (before anything starts)."""
    refusal = live_recovery_refusal(ParallelConfig.from_args(args))
    if refusal:
        raise ConfigError(f"--fault-tolerance live does not support {refusal}")
    init = args.distributed_init_method or ""
    if not init.startswith("tcp://"):
        raise ConfigError("--fault-tolerance live needs --distributed-init-method tcp://HOST:PORT, the address of "
                          "the lighthouse (start it with: hetfair-lighthouse --port PORT)")
    if (args.distributed_gpus or 1) != 1 or isinstance(args.max_sentences, tuple):
        raise ConfigError("--fault-tolerance live runs one process per command: give --distributed-gpus 1 and one "
                          "--max-sentences value, and start one command per process")


def live_recovery_refusal(config: ParallelConfig) -> Optional[str]:
    """What of ``config`` live recovery cannot keep exact, as its strategy declares
    (:meth:`~hetfair.parallel.Strategy.live_recovery_refusal`; ``None``: nothing); for ``--ddp-backend auto``,
    what a strategy the plan may choose declares."""
    if config.ddp_backend != AUTO:
        return STRATEGY_REGISTRY.get(config.ddp_backend).live_recovery_refusal(config)
    for backend in plan_candidates():
        refusal = STRATEGY_REGISTRY.get(backend).live_recovery_refusal(replace(config, ddp_backend=backend))
        if refusal:
            return f"--ddp-backend {AUTO}, which may choose {refusal}"
    return None


def train_live(args: argparse.Namespace) -> None:
    """Train as one process of a live job, through every membership change, until the job ends.

    Call :func:`check_live_options` first; after this, end the process with :func:`exit_now`.
    """
    if args.user_dir:
        import_user_dir(args.user_dir)
    address = parse_init_method(args.distributed_init_method, os.environ)
    secret = job_secret(args.distributed_secret, address, os.environ)  # refused off loopback without one
    device = _device(args)
    use_interface(choose_interface(args.distributed_interface, address), device,
                  override=args.distributed_interface is not None)
    if quiet_native_logs(args.debug):
        store_logs_filtered()  # a store's C++ log records, as the tcp:// path discards the rendezvous's
    wait_until_reachable(address, args.distributed_timeout, "could not reach the lighthouse",
                         f"start it first (hetfair-lighthouse --host {address.host} --port {address.port}, on that "
                         f"machine) or check --distributed-init-method")
    connect = functools.partial(_connect, address, secret, args.distributed_timeout)
    connect().claim(args.distributed_init_method)
    membership = Membership(connect, args.distributed_world_size, args.distributed_timeout, args.live_timeout)
    try:
        with preemptible():
            _train_rounds(args, membership, device)
    finally:
        membership.close()


def _connect(address: StoreAddress, secret: bytes, timeout: float) -> JobRecords:
    """A new client of the lighthouse, as the job's records."""
    try:
        store = dist.TCPStore(address.host, address.port, None, False, timeout=timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as exc:
        raise DistributedError(f"could not connect to the lighthouse at {address.host}:{address.port} "
                               f"({first_line(exc)}); check that hetfair-lighthouse listens there") from exc
    return JobRecords(store, secret)


def exit_now(code: int) -> NoReturn:
    """End a process that met a live job's lighthouse with ``code``, without the interpreter's teardown (which
    would destroy a group left behind, or the store client of a lost lighthouse, while its C++ thread runs:
    SIGABRT instead of ``code``)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _train_rounds(args: argparse.Namespace, membership: Membership, device: torch.device) -> None:
    """Train through the rounds until the job is done."""
    state: Optional[dict[str, Any]] = None
    while True:
        group = membership.next_group(_progress(state))
        run: Optional[TrainingRun] = None
        try:
            context = _form_group(group, membership, args, device)
            state = _share_state(group, state, context)
            _announce(group, state)
            if group.majority_lost:
                if context.is_master:
                    membership.finish()  # the job has ended: a process that comes later must not train on
                _save_and_stop(args, context, state, f"lost a majority of the ranks ({group.survivors} of "
                                                     f"{group.previous_size} came back in round {group.round})")
            output = Progress(args.log_format, enabled=context.is_master)
            with output.showing_log_records():
                run = TrainingRun(args, context, output, resume_state=state, regroup_wanted=membership.regroup_wanted)
                run.run()
            run = None
            if context.is_master:
                membership.finish()
            leave_group()
            return
        except Regroup:
            lost = membership.lighthouse_lost()
            if _on_any_rank(lost is not None, device):  # the group still works: every rank saves and stops
                assert run is not None
                _save_and_stop(args, context, run.checkpointer.state(),
                               f"lost the lighthouse {args.distributed_init_method} ({lost or 'seen by another rank'})")
        except (RuntimeError, dist.DistError) as exc:
            if not looks_like_lost_peer(exc):
                raise
            say(f"round {group.round}: lost contact ({str(exc).splitlines()[0][:120]}); agreeing on the members")
        if run is not None:
            state = run.checkpointer.state()
        del run
        gc.collect()  # the run's DDP reducer goes before the group (see launch.launcher.leave_group)
        _leave_group()


def _form_group(group: Group, membership: Membership, args: argparse.Namespace,
                device: torch.device) -> DistributedContext:
    """The round's default process group, its collectives timing out after ``--live-timeout``."""
    backend = process_group_backend(args.distributed_backend, device)
    with native_stderr_discarded(enabled=quiet_native_logs(args.debug)):
        dist.init_process_group(backend, store=dist.PrefixStore(f"r{group.round}/pg", membership.store),
                                rank=group.rank, world_size=group.world_size,
                                timeout=timedelta(seconds=args.live_timeout))
    return DistributedContext(rank=group.rank, world_size=group.world_size, local_rank=0, device=device)


def _share_state(group: Group, own: Optional[dict[str, Any]],
                 context: DistributedContext) -> Optional[dict[str, Any]]:
    """The state this rank trains on: its own, or the donor's when its own is not the newest."""
    donor, receivers = group.donor(), group.receivers()
    if donor is None or not receivers:
        return own
    shared = broadcast_state(own, donor, group.rank, comm_device(context))
    return shared if group.rank in receivers else own


def _leave_group() -> None:
    """Drop a group whose peer is gone (no barrier: it would wait for that peer)."""
    if dist.is_initialized():
        try:
            dist.group.WORLD.abort()  # type: ignore[union-attr]
        except RuntimeError:
            pass
        dist.destroy_process_group()


def _save_and_stop(args: argparse.Namespace, context: DistributedContext, state: Optional[dict[str, Any]],
                   why: str) -> None:
    """Save ``state`` as ``checkpoint_last.pt`` (rank 0 of the group writes it; every rank holds the same state)
    and end with one line."""
    run = TrainingRun(args, context, Progress("none", enabled=False), resume_state=state)
    checkpointer = run.checkpointer
    checkpointer.save(run.position.epoch, run.trainer.num_updates, end_of_epoch=False, valid_metric=None)
    checkpointer.close()
    saved = "no checkpoint written (--no-save)" if checkpointer.config.no_save else \
        f"saved {checkpointer.config.save_dir / 'checkpoint_last.pt'}"
    raise DistributedError(f"{why}: stopped after update {run.trainer.num_updates}; {saved}; start a new lighthouse "
                           f"and the same commands to resume")


def _on_any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on some rank of the group (every rank gets the same answer)."""
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _progress(state: Optional[dict[str, Any]]) -> Optional[RoundProgress]:
    return None if state is None else progress_of(state)


def _announce(group: Group, state: Optional[dict[str, Any]]) -> None:
    progress = _progress(state)
    at = f"update {progress[2]}" if progress else "the start"
    donor = group.donor()
    source = f", state of rank {donor}" if donor is not None and group.rank in group.receivers() else ""
    say(f"round {group.round}: rank {group.rank} of {group.world_size} ({group.survivors} of "
         f"{group.previous_size} kept) from {at}{source}")


def _device(args: argparse.Namespace) -> torch.device:
    """A live rank is one process per command: the first GPU of ``--device-id`` (or the CPU)."""
    return process_device(args.cpu, args.device_id, list_index=0, local_rank=0)
