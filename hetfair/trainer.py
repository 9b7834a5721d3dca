"""One training update over micro-batches, the same update for any cluster shape.

An update over micro-batches ``m`` on ranks ``r`` applies
``g = sum_{r,m} grad(loss_{r,m}) / sum_{r,m} sample_size_{r,m}``: criteria
return summed losses, DDP averages gradients over ranks, and the trainer
multiplies by ``world_size / total_sample_size`` (the total comes from the same
single all-reduce that carries the logging stats). Any split of a global batch
over ranks and micro-batches therefore yields the same update. That all-reduce
starts after the last forward and overlaps the last backward (and DDP's gradient
all-reduce); the trainer waits for it just before normalising. Each rank's compute
time is known only after its backward, so timings travel one update late.
Without loss scaling or sharding, that multiplication and the clipping
coefficient are one pass over the gradients; with one of torch's fused
optimizers not even that: the fused step divides each gradient by its
``grad_scale`` as it reads it, the protocol ``torch.amp.GradScaler`` uses, and
leaves the gradients normalised.

Mixed precision (:mod:`hetfair.precision.mixed`) leaves that math alone: each process
runs forward and loss under its own autocast, parameters and gradients stay fp32.
When any rank runs fp16, every rank multiplies its summed loss by the job's loss
scale ``S`` before backward, and the normalisation multiplies by
``world_size / (total_sample_size * S)`` in one fused op that also flags inf/NaN.
An overflow is seen identically on every rank (the gradients are all-reduced),
so every rank skips that update: parameters, optimizer state, schedule and
``num_updates`` stay as they were (as in fairseq), and ``S`` is halved.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from hetfair.compile import compile_model
from hetfair.parallel.context import DistributedContext
from hetfair.parallel.stats import (
    PendingStats,
    Rider,
    SyncedStats,
    UpdateResult,
    is_summable,
    start_sync_stats,
    sum_logs,
)
from hetfair.errors import CheckpointError, ConfigError, DivergenceError, first_line
from hetfair.models import HetfairModel
from hetfair.models.activation_checkpointing import checkpoint_units
from hetfair.optim import LRScheduler
from hetfair.parallel import ParallelConfig, Strategy, build_strategy
from hetfair.precision.mixed import LossScaler, autocast
from hetfair.utils import derived_seed, move_to_device, state_dict_mismatch


@dataclass(frozen=True)
class TrainerConfig:
    """The options one update depends on."""

    seed: int = 1
    clip_norm: float = 0.0
    """Clip gradients to this global norm (0: off)."""
    optimizer: str = "adam"
    """The optimizer's registry name, recorded in checkpoints."""
    reset_optimizer: bool = False
    """On restore, load the model only; optimizer and schedule start afresh."""
    precision: str = "fp32"
    """This process's forward/loss precision: fp32, bf16 or fp16 (under autocast)."""
    compile: bool = False
    """``torch.compile`` the model in place, its batch dimension dynamic (``--compile``)."""
    activation_checkpointing: bool = False
    """Recompute each sharding unit's activations in the backward (``--activation-checkpointing``, this process's)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainerConfig":
        return cls(args.seed, args.clip_norm, args.optimizer, args.reset_optimizer, args.precision, args.compile,
                   bool(args.activation_checkpointing))


class _ComputeClock:
    """Remembers when the last parameter gradient was accumulated.

    That moment ends this rank's own forward/backward work; DDP's wait for the
    final gradient all-reduce comes after it, so it is not counted as compute.
    A single process waits for no peer: there the end of the backward is that
    moment, and no hook per parameter is needed (``hooked`` false).
    """

    def __init__(self, params: list[nn.Parameter], hooked: bool) -> None:
        self.last_grad_time = 0.0
        self.hooked = hooked
        for param in params if hooked else []:
            param.register_post_accumulate_grad_hook(self._mark)

    def _mark(self, _param: torch.Tensor) -> None:
        self.last_grad_time = time.perf_counter()

    def backward_done(self) -> None:
        """The last backward of an update returned: without hooks, its own work ends now."""
        if not self.hooked:
            self.last_grad_time = time.perf_counter()


class Trainer:
    """Owns the model, criterion, optimizer and schedule of one process; its :class:`Strategy` spreads
    them over the ranks (default: replicated, the ``--ddp-backend c10d`` one)."""

    TIMINGS_LAG = 1
    """Updates between an update and the :class:`UpdateResult` that carries its per-rank timings."""

    def __init__(
        self,
        config: TrainerConfig,
        model: nn.Module,
        criterion: nn.Module,
        context: DistributedContext,
        dummy_batch: dict[str, Any],
        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        lr_scheduler_factory: Callable[[torch.optim.Optimizer], LRScheduler],
        loss_scaler: Optional[LossScaler] = None,
        strategy: Optional[Strategy] = None,
    ) -> None:
        self.config = config
        self.loss_scaler = loss_scaler
        """The job's loss scale (every rank holds one when any rank runs fp16), else ``None``."""
        self.context = context
        self.strategy = strategy or build_strategy(ParallelConfig(), context)
        if config.compile and self.strategy.compile_refusal:
            raise ConfigError(self.strategy.compile_refusal)
        if loss_scaler is not None and self.strategy.inner_steps() is not None:
            raise ConfigError("--inner-steps-by time cannot run with fp16's loss scaling (an overflow skips one "
                              "update on every rank, and the nodes take different numbers of steps); use "
                              "--precision bf16 or fp32, or --inner-steps-by count")
        self.criterion = criterion.to(context.device)
        if config.activation_checkpointing:
            checkpoint_units(model)  # before sharding: the strategy shards (or wraps) the wrapped units
        # shard first, then move only this rank's part (a sharded model need not fit the device whole)
        self.strategy.shard(model, model.sharding_units() if isinstance(model, HetfairModel) else [])
        self.model = self.strategy.to_device(model)
        if config.compile:
            compile_model(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.wrapped_model: nn.Module = self.strategy.wrap(self.model)
        self._runner = self.strategy.micro_batch_runner()  # a pipeline runs the micro-batches itself
        self.optimizer = optimizer_factory(self.params)
        self._defers_normalising = loss_scaler is None and self.strategy.holds_full_gradients
        """Normalising can wait for the clipping coefficient: one multiplication of the gradients does both.
        (With loss scaling the unscale also checks for overflow; sharded gradients are normalised in place.)"""
        self._scales_in_step = self._defers_normalising and _fused_step(self.optimizer)
        """That multiplication is the optimizer's: its fused step divides the gradients by ``grad_scale`` as it
        reads them (as under ``torch.amp.GradScaler``), so it costs no pass of its own over the gradients."""
        self._grad_scale = torch.ones((), device=context.device)
        if self._scales_in_step:
            self.optimizer.grad_scale = self._grad_scale  # type: ignore[attr-defined]
        self.lr_scheduler = lr_scheduler_factory(self.optimizer)
        self.num_updates = 0
        self.optimizer_overrides: dict[str, tuple[Any, Any]] = {}
        """Optimizer settings of the last restore where the command line differs: ``{name: (checkpoint's, now)}``."""
        self.lr_scheduler.step_update(0)
        self._dummy_batch = dummy_batch
        self._clock = _ComputeClock(self.params, hooked=context.is_distributed)
        self._last_seconds = 0.0  # this rank's compute seconds of the last update: they travel with the next
        self._last_samples: list[float] = []  # every rank's samples of the last update (empty: none yet)

    @property
    def dummy_batch(self) -> dict[str, Any]:
        """The one-sample batch a rank without samples runs with zero weight."""
        return self._dummy_batch

    # -- training --------------------------------------------------------------
    def train_step(self, samples: list[Optional[dict[str, Any]]], rider: Optional[Rider] = None
                   ) -> Optional[UpdateResult]:
        """One update over this rank's micro-batches (``None``: no data for that step).

        Where the strategy takes several steps per update (:meth:`Strategy.inner_steps`), the micro-batches are
        cut into that many equal groups in order; each but the last is one optimizer step of its own, and the
        last is the update's step, which the stats all-reduce of the whole update overlaps. ``rider``'s values
        travel in that all-reduce too, and it gets their sums back before this returns."""
        if not (self.model.training and self.criterion.training):  # validation left them in eval mode
            self.wrapped_model.train()
            self.criterion.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, Any] = {}
        start = time.perf_counter()
        self._clock.last_grad_time = start
        counts = self.strategy.inner_steps()
        steps = counts[self.context.rank] if counts is not None else 1
        size = len(samples) // steps
        assert size * steps == len(samples), f"{len(samples)} micro-batches do not make {steps} equal steps"

        # 1. forward/backward of each micro-batch; gradients sync in the last backward only
        local_samples = 0
        for step in range(steps - 1):  # the inner steps before the update's own (--inner-steps-by time)
            sample_size = totals.get("sample_size", 0.0)
            local_samples += self._forward_backward(samples[step * size:(step + 1) * size], step * size, totals)[0]
            self._step(self.strategy.inner_normalising_factor(totals["sample_size"] - sample_size))  # no loss scale
            self.optimizer.zero_grad(set_to_none=True)
        own_sample_size = totals.get("sample_size", 0.0)
        _, pending = self._forward_backward(samples[len(samples) - size:], len(samples) - size, totals,
                                            stats_samples=local_samples, rider=rider)
        assert pending is not None
        self._clock.backward_done()
        synced = pending.wait()
        if rider is not None:
            rider.arrive(synced.riders)
        self._last_seconds = self._clock.last_grad_time - start
        samples_by_rank = synced.per_rank["samples"]
        timing = (samples_by_rank, self._last_samples,
                  synced.per_rank["compute_seconds"] if self._last_samples else [])
        self._last_samples = samples_by_rank
        if timing[2]:
            self.strategy.observe_timings(timing[2])
        total_sample_size = synced.totals["sample_size"]
        if total_sample_size <= 0:
            return None

        # 2. normalise by the sample count (the strategy's: the global one, a node's in an outer loop), undo the
        #    loss scale, clip and step
        if counts is not None:
            factor = self.strategy.inner_normalising_factor(totals["sample_size"] - own_sample_size)
        else:
            factor = self.strategy.normalising_factor(total_sample_size, synced.per_rank["sample_size"])
        lr = self.optimizer.param_groups[0]["lr"]
        gnorm = self._step(factor)
        if gnorm is None:
            return self._skip(synced, timing)

        # 3. schedule
        self.strategy.after_step(self.params, synced.per_rank["sample_size"])
        self.num_updates += 1
        self.lr_scheduler.step_update(self.num_updates)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        clip_norm = self.config.clip_norm
        return UpdateResult(synced.totals, *timing, lr=lr, gnorm=gnorm, clipped=clip_norm > 0 and gnorm > clip_norm,
                            loss_scale=self._loss_scale())

    def _forward_backward(self, samples: list[Optional[dict[str, Any]]], first_index: int, totals: dict[str, Any],
                          stats_samples: Optional[int] = None, rider: Optional[Rider] = None
                          ) -> tuple[int, Optional[PendingStats]]:
        """Forward and backward of one step's micro-batches (the first is the update's ``first_index``-th), their
        logs summed into ``totals``; gradients sync in the last backward. With ``stats_samples`` (the samples of
        the update's earlier steps) this is the update's last step: the stats all-reduce (``rider``'s values with
        it) starts before its last backward. Returns this rank's samples, and that all-reduce (``None`` without
        ``stats_samples``)."""
        if self._runner is not None:
            return self._run_scheduled(samples, first_index, totals, stats_samples, rider)
        local_samples = 0
        pending: Optional[PendingStats] = None
        for index, sample in enumerate(samples, first_index):
            is_last = index == first_index + len(samples) - 1
            if sample is None and not self._joins_collectives(is_last):
                continue  # nothing to compute and no collective to join
            _seed_rng(derived_seed(self.config.seed, self.num_updates, index, self.context.rank), self.context.device)
            batch = move_to_device(sample if sample is not None else self._dummy_batch, self.context.device)
            with self.strategy.gradient_sync(self.wrapped_model, is_last):
                with autocast(self.config.precision, self.context.device):
                    loss, sample_size, logs = self.criterion(self.wrapped_model, batch)
                loss = _tally(totals, batch, sample is not None, loss, sample_size, logs)
                if sample is not None:
                    local_samples += int(batch["nsentences"])
                if is_last and stats_samples is not None:
                    # the stats all-reduce (logs, global sample size, per-rank timings) overlaps the last backward
                    pending = self._start_stats_sync(totals, stats_samples + local_samples, rider, riding=True)
                if self.loss_scaler is not None:
                    loss = loss * self.loss_scaler.scale
                loss.backward()
        if stats_samples is not None and pending is None:
            pending = self._start_stats_sync(totals, stats_samples + local_samples, rider)
        return local_samples, pending

    def _run_scheduled(self, samples: list[Optional[dict[str, Any]]], first_index: int, totals: dict[str, Any],
                       stats_samples: Optional[int], rider: Optional[Rider]) -> tuple[int, Optional[PendingStats]]:
        """:meth:`_forward_backward` where the strategy runs the micro-batches (a pipeline's schedule): the
        criterion runs on the stage that computes the loss, on the output of the model's forward there, and only
        that rank's logs count (every rank of a pipeline loads the same micro-batches and runs them all)."""
        runner = self._runner
        assert runner is not None
        device = self.context.device
        batches = [move_to_device(sample if sample is not None else self._dummy_batch, device) for sample in samples]

        def loss_of(output: Any, index: int) -> torch.Tensor:
            batch = batches[index]
            loss = _tally(totals, batch, samples[index] is not None,
                          *self.criterion(lambda **inputs: output, batch))  # the model's output is known
            return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

        _seed_rng(derived_seed(self.config.seed, self.num_updates, first_index, self.context.rank), device)
        runner.run([self.criterion.model_inputs(batch) for batch in batches], loss_of,
                   lambda: autocast(self.config.precision, device))
        totals.update(runner.agree_keys(totals))
        local_samples = sum(int(sample["nsentences"]) for sample in samples if sample is not None)
        pending = None
        if stats_samples is not None:
            pending = self._start_stats_sync(totals, stats_samples + local_samples, rider)
        return local_samples, pending

    def _step(self, factor: float) -> Optional[float]:
        """Normalise the gradients by ``factor`` (without loss scaling or sharding, together with clipping: see
        :attr:`_defers_normalising`), clip them by global norm and step; the gradient norm, or ``None`` on an
        fp16 overflow (nothing stepped)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        owed = factor if self._defers_normalising else 1.0
        if not self._defers_normalising and self._normalise(grads, factor):
            return None
        # clip by global norm (over all shards; replicated gradients are identical on all ranks)
        gnorm, multiplier = self._clip_grad_norm(grads, owed)
        if not math.isfinite(gnorm):
            raise DivergenceError(
                f"gradient norm is {gnorm} at update {self.num_updates + 1}; lower --lr or set --clip-norm"
            )
        if self._scales_in_step:
            self._grad_scale.fill_(1.0 / multiplier)
        elif multiplier != 1.0:
            torch._foreach_mul_(grads, multiplier)
        self.optimizer.step()
        return gnorm

    def synchronize(self) -> None:
        """Make the model the same on every rank (an outer loop ends its round early); before validating or saving."""
        self.strategy.synchronize(self.params)

    def _normalise(self, grads: list[torch.Tensor], factor: float) -> bool:
        """Multiply the gradients by ``factor`` (and by ``1 / S`` when loss scaling); True on inf/NaN.

        Without loss scaling there is nothing to check: the gradient norm's check
        below reports a non-finite gradient as divergence. Where each rank holds other
        shards, the strategy makes the ranks agree on an overflow.
        """
        local = self.strategy.local_tensors(grads)  # this rank's shards
        if self.loss_scaler is None:
            torch._foreach_mul_(local, factor)
            return False
        device = local[0].device if local else self.context.device  # an offloaded shard's: the CPU
        found_inf = torch.zeros(1, device=device)
        inverse_scale = torch.full((1,), factor / self.loss_scaler.scale, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(local, found_inf, inverse_scale)
        self.strategy.agree_on_overflow(found_inf)
        return bool(found_inf.item())

    def _start_stats_sync(self, totals: dict[str, Any], samples: int, rider: Optional[Rider] = None,
                          riding: bool = False) -> PendingStats:
        """Start summing ``totals`` (and ``rider``'s values) over ranks, with every rank's ``samples`` of this update
        and its compute seconds of the previous one; ``riding``: a backward with the strategy's gradient all-reduce
        follows, which may carry them (:class:`~hetfair.parallel.stats.StatsCarrier`).

        The stats leave before the last backward, so this update's own compute time
        is not known yet: timings arrive one update late (see :attr:`UpdateResult.compute_seconds`).
        """
        totals.setdefault("sample_size", 0.0)
        per_rank = {"samples": float(samples), "compute_seconds": self._last_seconds,
                    "sample_size": float(totals["sample_size"])}
        return start_sync_stats(self.context, totals, per_rank, rider.ride() if rider is not None else None,
                                carrier=self.strategy.gradient_comm() if riding else None)

    def _skip(self, synced: SyncedStats, timing: tuple[list[float], list[float], list[float]]) -> UpdateResult:
        """Drop an overflowed update on this rank (every rank does the same) and lower the loss scale."""
        assert self.loss_scaler is not None
        self.optimizer.zero_grad(set_to_none=True)
        self.strategy.discard_update()
        self.loss_scaler.update(overflow=True)
        return UpdateResult(synced.totals, *timing,
                            lr=self.optimizer.param_groups[0]["lr"], gnorm=0.0, clipped=False, skipped=True,
                            loss_scale=self._loss_scale())

    def _loss_scale(self) -> Optional[float]:
        return None if self.loss_scaler is None else self.loss_scaler.scale

    def _joins_collectives(self, is_last: bool) -> bool:
        """Whether a micro-batch must run even without samples: it holds collectives the other ranks run
        (the last one always; every one where the strategy says so)."""
        return self.context.is_distributed and (is_last or self.strategy.joins_every_micro_batch)

    def _clip_grad_norm(self, grads: list[torch.Tensor], owed: float) -> tuple[float, float]:
        """The norm of the normalised gradients ``owed * grads``, and the multiplier the gradients still need:
        ``owed`` times the clipping coefficient (``--clip-norm``)."""
        return self.strategy.clip_grad_norm(self.params, grads, owed, self.config.clip_norm)

    # -- checkpoint state -------------------------------------------------------
    def optimizer_state_dict(self) -> Optional[dict[str, Any]]:
        """The full optimizer state (collective when sharded; ``None`` off the master)."""
        return self.strategy.optimizer_state_dict(self.model, self.optimizer, self.params)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state (a collective when sharded; complete on the master)."""
        return self.strategy.model_state_dict(self.model)

    def state_dict(self) -> dict[str, Any]:
        """Model, full optimizer state, schedule and update count (a collective when sharded)."""
        return {
            "model": self.model_state_dict(),
            "optimizer": self.optimizer_state_dict(),
            "optimizer_name": self.config.optimizer,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; with ``reset_optimizer`` only the model and update count.

        The optimizer's settings (momentum, weight decay, betas, a plugin's own ...) are
        those of the command line, not the checkpoint's, like fairseq's optimizer
        overrides; :attr:`optimizer_overrides` lists the ones that changed.
        """
        try:
            self.strategy.load_model_state_dict(self.model, state["model"])
        except (RuntimeError, KeyError) as exc:
            reference = self.strategy.model_state_dict(self.model)
            detail = state_dict_mismatch(reference, state["model"]) or first_line(exc)
            raise CheckpointError(f"it does not fit model {type(self.model).__name__}: {detail}") from exc
        self.num_updates = int(state["num_updates"])
        if not self.config.reset_optimizer:
            if state.get("optimizer_name") != self.config.optimizer:
                raise CheckpointError(
                    f"checkpoint was trained with --optimizer {state.get('optimizer_name')}, not "
                    f"{self.config.optimizer}; use the same optimizer or pass --reset-optimizer"
                )
            settings = _settings(self.optimizer)  # as built from the command line
            try:
                self.strategy.load_optimizer_state_dict(self.model, self.optimizer, self.params, state["optimizer"])
            except (ValueError, KeyError, IndexError, RuntimeError) as exc:
                raise CheckpointError(f"optimizer state does not fit: {first_line(exc)}; "
                                      f"pass --reset-optimizer to start it afresh") from exc
            self.optimizer_overrides = _override_settings(self.optimizer, settings)
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.lr_scheduler.step_update(self.num_updates)


_NOT_SETTINGS = ("params", "lr", "initial_lr")  # the learning rate belongs to the LR scheduler
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
"""How torch computes the step, not what it computes: set from the command line without a notice."""


def _settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyper-parameters, learning rate excluded."""
    return [{k: v for k, v in group.items() if k not in _NOT_SETTINGS} for group in optimizer.param_groups]


def _override_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """Put ``settings`` back into the param groups; return ``{name: (replaced value, value)}`` where they differ."""
    changed: dict[str, tuple[Any, Any]] = {}
    for group, wanted in zip(optimizer.param_groups, settings, strict=True):
        for name, value in wanted.items():
            if name not in _IMPLEMENTATION and not _same(group.get(name), value):
                changed.setdefault(name, (group.get(name), value))
            group[name] = value
    return changed


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b


def _fused_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's fused implementations, which take a ``grad_scale`` to divide by."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused") for group in optimizer.param_groups)


def _tally(totals: dict[str, Any], batch: dict[str, Any], has_samples: bool, loss: torch.Tensor,
           sample_size: float, logs: dict[str, Any]) -> torch.Tensor:
    """Add one micro-batch's logs and sample size into ``totals``; its loss to backpropagate. A micro-batch that
    only joins the collectives (``has_samples`` false) counts nothing: its loss joins the gradient all-reduce as
    zero, and its logs as zeros, which keep the key set identical on every rank for the packed all-reduce."""
    if not has_samples:
        loss = loss * 0.0
        logs = {k: 0.0 if isinstance(v, (int, float)) else v for k, v in logs.items()}
        sample_size = 0
    sum_logs(totals, {**_batch_counts(batch, logs, has_samples), **logs, "sample_size": float(sample_size)})
    totals.update((key, value) for key, value in logs.items() if not is_summable(value))
    return loss


def _batch_counts(batch: dict[str, Any], logs: dict[str, Any], has_samples: bool) -> dict[str, float]:
    """The collater's ``nsentences`` and ``ntokens`` that the criterion does not log (``bsz`` and ``wps``
    read them); zeros for a batch that only joins the collectives, so every rank logs the same keys."""
    return {key: float(batch[key]) if has_samples else 0.0 for key in ("nsentences", "ntokens")
            if key in batch and key not in logs}


def _seed_rng(seed: int, device: torch.device) -> None:
    """Seed the generators this process's random ops draw from: the CPU's and ``device``'s.

    Not ``torch.manual_seed``: for every backend not initialised in this process
    (CUDA on a CPU run, XPU, ...) it queues a lazy seed with a formatted Python
    stack, 0.1-0.4 ms per call, which a small model's update notices.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
