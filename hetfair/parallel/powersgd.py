"""``--ddp-comm-hook powersgd``: torch's ``powerSGD_hook`` (error feedback, warm start) after
``--powersgd-start-update`` exact all-reduces. It divides by the world size as DDP's own all-reduce
does, so the trainer's ``world_size / total_sample_size`` normalisation holds unchanged.

PowerSGD's state (per-rank error feedback, P/Q memory, step counter, the generator of
its random Q) goes into the checkpoint. Torch keys it by DDP bucket, and a fresh DDP
uses another bucket layout for its first update than after it rebuilds its buckets,
so the state is carried over parameter by parameter when the layout changes and is
stored that way: a resumed run continues exactly where the saved one stopped.

``--powersgd-rank auto`` leaves the rank to the ``comm |`` advice (:meth:`PowerSGD.fit_link`): the
largest of :data:`AUTO_RANKS` whose all-reduce fits the budget it is given, the lowest where none
does. Until then (the fourth update) it all-reduces exactly, as before ``--powersgd-start-update``;
the choice goes into the checkpoint, and a resumed ``auto`` run keeps it.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd_module
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook

from hetfair.errors import ConfigError
from hetfair.parallel.collectives import all_gather_json, comm_device
from hetfair.parallel import CommHook, register_comm_hook
from hetfair.parallel.comm_advice import milliseconds
from hetfair.parallel.context import DistributedContext

RANK, START = "--powersgd-rank", "--powersgd-start-update"

AUTO = "auto"
"""``--powersgd-rank auto``: the rank is chosen from the measured link (:meth:`PowerSGD.fit_link`)."""

AUTO_RANKS = (1, 2, 4, 8, 16, 32)
"""The ranks ``--powersgd-rank auto`` weighs (docs/comm-hooks.md: on mnist_cnn rank 1 lost 14% against the exact
all-reduce's loss, rank 2 under 5%, higher ranks less)."""

_KINDS = ("error", "p", "q")
"""PowerSGD's per-bucket memories: local error (bucket-sized), and the P and Q of each compressed gradient."""

MIN_COMPRESSION_RATE = 2.0
"""PowerSGD compresses a matrix only where that sends this many times fewer numbers (torch's default)."""

ParamState = dict[int, dict[str, torch.Tensor]]
"""PowerSGD memories by parameter index (``module.parameters()`` order) and kind."""


@register_comm_hook("powersgd")
class PowerSGD(CommHook):
    """A rank-R approximation P·Qᵀ of each weight matrix, biases and other vectors whole (``powerSGD_hook``)."""

    tie_order = 2
    keeps_state = True
    plan_settings = ({RANK: 2},)  # the smallest rank measured within 5% of the exact all-reduce's loss (docs)

    def __init__(self, options: Mapping[str, Any], context: DistributedContext,
                 params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__(options, context, params)
        self._index = {id(param): i for i, param in enumerate(self.params)}
        # torch logs every bucket's allocations at INFO; the comm | line says what matters
        logging.getLogger(powersgd_module.__name__).setLevel(logging.WARNING)
        rank = parse_rank(options[RANK])
        self.rank_chosen: Optional[str] = None if rank == AUTO else "given"
        """How the rank was set: ``given`` (a number), ``chosen`` (``auto``, by :meth:`fit_link`), ``kept`` (``auto``,
        from the checkpoint); ``None`` while ``auto`` has not chosen, all-reducing exactly."""
        self.state = PowerSGDState(None, matrix_approximation_rank=AUTO_RANKS[0] if rank == AUTO else rank,
                                   start_powerSGD_iter=options[START], min_compression_rate=MIN_COMPRESSION_RATE)
        self._layouts: dict[int, tuple[int, ...]] = {}  # bucket index -> its parameters, of PowerSGD's memories
        self._loose: ParamState = {}  # memories of buckets not seen yet in the current layout
        self._serial = dist.is_initialized() and dist.get_backend() == "gloo"
        """Finish each bucket's PowerSGD before the next bucket starts. On gloo its chained all-reduces start
        from gloo's worker threads as the previous ones complete, so with several buckets in flight two ranks
        can start them in other orders and wait on each other for ever; one bucket at a time keeps one order
        (the price: no overlap with the backward pass). NCCL orders them on its stream."""

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(RANK, default=1, metavar="R",
                            help="with --ddp-comm-hook powersgd/auto: rank of PowerSGD's low-rank approximation; "
                                 "auto: the largest of 1, 2, 4, ..., 32 whose all-reduce fits half an update's "
                                 "compute on the measured link (see the comm | line)")
        parser.add_argument(START, type=int, default=1000, metavar="N",
                            help="with --ddp-comm-hook powersgd/auto: the first N updates are exact all-reduces")

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        parse_rank(options[RANK])
        if options[START] < 2:
            raise ConfigError(f"{START} must be at least 2, got {options[START]}")

    # -- the hook -------------------------------------------------------------------
    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.rank_chosen is None:  # auto, not chosen yet: as powerSGD_hook before its start update
            self.pass_over(bucket)
            return super().communicate(bucket)
        self._fit_layout(bucket)
        future = powerSGD_hook(self.state, bucket)
        if self._serial:
            future.wait()
        return future

    def pass_over(self, bucket: dist.GradBucket) -> None:
        self.state.maybe_increase_iter(bucket)  # auto, undecided: PowerSGD's counter still counts updates

    def sent_fraction(self) -> float:
        """P and Q of each matrix it compresses, the rest whole, over the gradients' bytes."""
        return self._sent_fraction(self.state.matrix_approximation_rank)

    def _sent_fraction(self, approximation_rank: int) -> float:
        total = whole_total = 0
        for param in self.params:
            if param.requires_grad:
                rows = param.shape[0] if param.dim() else 1
                matrix = (rows, param.numel() // rows)
                rank = min(*matrix, approximation_rank)
                compress, whole, compressed = _should_compress(*matrix, rank, MIN_COMPRESSION_RATE)
                total += (compressed if compress else whole) * param.element_size()
                whole_total += param.numel() * param.element_size()
        return total / max(whole_total, 1)

    def fit_link(self, all_reduce_seconds: float, budget_seconds: float) -> Optional[str]:
        """``auto``: the largest of :data:`AUTO_RANKS` whose all-reduce (``all_reduce_seconds`` times its bytes'
        share) takes at most ``budget_seconds``, else the lowest; the ``comm |`` line that says which."""
        if self.rank_chosen == "kept":
            return f"comm | {RANK} auto: rank {self.state.matrix_approximation_rank}, kept from the checkpoint"
        if self.rank_chosen is not None:
            return None
        seconds = {rank: all_reduce_seconds * self._sent_fraction(rank) for rank in AUTO_RANKS}
        fitting = [rank for rank in AUTO_RANKS if seconds[rank] <= budget_seconds]
        rank = fitting[-1] if fitting else AUTO_RANKS[0]
        self.state.matrix_approximation_rank, self.rank_chosen = rank, "chosen"
        budget = f"{milliseconds(budget_seconds)}, half an update's compute"
        if not fitting:
            return (f"comm | {RANK} auto: rank {rank}, the lowest: its all-reduce ~{milliseconds(seconds[rank])} "
                    f"is longer than {budget}")
        above = AUTO_RANKS.index(rank) + 1
        beyond = (f"; rank {AUTO_RANKS[above]} would take ~{milliseconds(seconds[AUTO_RANKS[above]])}"
                  if above < len(AUTO_RANKS) else "")
        return f"comm | {RANK} auto: rank {rank}, its all-reduce ~{milliseconds(seconds[rank])} within {budget}{beyond}"

    def discard_update(self) -> None:
        """Its non-finite error feedback and P/Q go too; PowerSGD then starts its memories afresh, as in its first
        compressed update (Q drawn from its generator, the same on every rank)."""
        for memory in self._memories().values():
            memory.clear()
        self._loose.clear()

    # -- the memories, bucket by bucket or parameter by parameter ---------------------------
    def _memories(self) -> dict[str, dict[int, torch.Tensor]]:
        state = self.state
        return {"error": state.error_dict, "p": state.p_memory_dict, "q": state.q_memory_dict}

    def _fit_layout(self, bucket: dist.GradBucket) -> None:
        """Give ``bucket`` the memories of its parameters, also when DDP has rebuilt its buckets since."""
        layout = tuple(self._index[id(param)] for param in bucket.parameters())
        known = self._layouts.get(bucket.index())
        if known == layout:
            return
        if known is not None:  # a new layout: every bucket's memories become per-parameter ones
            self._loose.update(self._split_buckets())
            for memory in self._memories().values():
                memory.clear()
            self._layouts.clear()
        self._layouts[bucket.index()] = layout
        self._join_bucket(bucket.index(), layout)

    def _segments(self, layout: tuple[int, ...]) -> dict[str, list[tuple[int, int]]]:
        """Where each parameter's memories sit in a bucket of ``layout``: ``{kind: [(param index, numel)]}``,
        in the order ``powerSGD_hook`` lays them out (P and Q grouped by matrix shape)."""
        rank, rate = self.state.matrix_approximation_rank, self.state.min_compression_rate
        segments: dict[str, list[tuple[int, int]]] = {"error": [(i, self.params[i].numel()) for i in layout]}
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i in layout:
            rows = self.params[i].shape[0] if self.params[i].dim() else 1
            matrix = (rows, self.params[i].numel() // rows)
            if _should_compress(*matrix, min(*matrix, rank), rate)[0]:
                by_shape.setdefault(matrix, []).append(i)
        ordered = [(i, matrix) for matrix, members in by_shape.items() for i in members]
        segments["p"] = [(i, n * min(n, m, rank)) for i, (n, m) in ordered]
        segments["q"] = [(i, m * min(n, m, rank)) for i, (n, m) in ordered]
        return segments

    def _split_buckets(self) -> ParamState:
        """The memories of every bucket seen, per parameter."""
        split: ParamState = {}
        memories = self._memories()
        for index, layout in self._layouts.items():
            for kind, segments in self._segments(layout).items():
                if index not in memories[kind]:
                    continue
                pieces = memories[kind][index].split([numel for _, numel in segments])
                for (param, _), piece in zip(segments, pieces, strict=True):
                    split.setdefault(param, {})[kind] = piece.clone()
        return split

    def _join_bucket(self, index: int, layout: tuple[int, ...]) -> None:
        """Build bucket ``index``'s memories from the loose per-parameter ones, where every piece is there."""
        memories = self._memories()
        for kind, segments in self._segments(layout).items():
            pieces = [self._loose.get(param, {}).get(kind) for param, _ in segments]
            if segments and all(piece is not None for piece in pieces):
                memories[kind][index] = torch.cat(pieces)  # type: ignore[arg-type]
        for param in layout:
            self._loose.pop(param, None)

    # -- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """On the master every rank's PowerSGD state, by parameter; elsewhere ``{}``."""
        own = {**self._split_buckets(), **self._loose}
        spec = [[param, kind, int(own[param][kind].numel())] for param in sorted(own) for kind in _KINDS
                if kind in own[param]]
        if any(other != spec for other in all_gather_json(self.context, spec)):
            raise RuntimeError("PowerSGD memories differ in shape between ranks")  # they run the same steps
        if spec:
            flat = torch.cat([own[p][k].reshape(-1) for p, k, _ in spec])
            gathered = self._gather(flat.to(comm_device(self.context)))
        else:  # not compressing yet: nothing to send
            gathered = [torch.zeros(0)] * self.context.world_size
        if not self.context.is_master:
            return {}
        state = self.state
        rank = state.matrix_approximation_rank if self.rank_chosen is not None else None
        return {"world_size": self.context.world_size, "powersgd_rank": rank,
                "iter": state.iter, "rng": _rng_state(state.rng),
                "ranks": [_unflatten(spec, tensor.cpu()) for tensor in gathered]}

    def _gather(self, flat: torch.Tensor) -> list[torch.Tensor]:
        if not self.context.is_distributed:
            return [flat]
        gathered = [torch.empty_like(flat) for _ in range(self.context.world_size)] if self.context.is_master else None
        dist.gather(flat, gathered, dst=0)
        return gathered or []

    def load_state_dict(self, state: dict[str, Any], notice: Callable[[str], None]) -> bool:
        if self.rank_chosen is None and isinstance(state.get("powersgd_rank"), int):  # auto keeps its choice
            self.state.matrix_approximation_rank, self.rank_chosen = state["powersgd_rank"], "kept"
        reason = self._cannot_continue(state)
        if reason:
            notice(f"restore | PowerSGD's error feedback starts afresh ({reason}); its first "
                   f"{self.state.start_powerSGD_iter} updates are exact all-reduces")
            return False
        self.state.iter = int(state["iter"])
        self.state.rng.set_state(_rng_tuple(state["rng"]))
        self._loose = {param: dict(kinds) for param, kinds in state["ranks"][self.context.rank].items()}
        self._layouts.clear()
        for memory in self._memories().values():
            memory.clear()
        return True

    def _cannot_continue(self, state: dict[str, Any]) -> Optional[str]:
        if not state.get("ranks"):
            return "the checkpoint holds none"
        if state["world_size"] != self.context.world_size:
            return f"the checkpoint's was of {state['world_size']} ranks, this run has {self.context.world_size}"
        if state["powersgd_rank"] not in (None, self.state.matrix_approximation_rank):
            return (f"the checkpoint's was of --powersgd-rank {state['powersgd_rank']}, this run has "
                    f"{self.state.matrix_approximation_rank}")
        return None


def parse_rank(value: Any) -> int | str:
    """``--powersgd-rank``'s value: a whole number of at least 1, or ``auto`` (else one error line)."""
    if value == AUTO:
        return AUTO
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value.isdigit())
    if not whole or int(value) < 1:
        raise ConfigError(f"{RANK} must be a whole number of at least 1 or auto, got {value}")
    return int(value)


def _unflatten(spec: list[list[Any]], flat: torch.Tensor) -> ParamState:
    state: ParamState = {}
    for (param, kind, _), piece in zip(spec, flat.split([numel for _, _, numel in spec]), strict=True):
        state.setdefault(int(param), {})[kind] = piece.clone()
    return state


def _rng_state(rng: np.random.RandomState) -> dict[str, Any]:
    """PowerSGD's numpy generator as plain data (``torch.load(weights_only=True)`` reads no numpy arrays)."""
    name, keys, pos, has_gauss, gauss = rng.get_state()
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "gauss": float(gauss)}


def _rng_tuple(state: dict[str, Any]) -> tuple[Any, ...]:
    return ("MT19937", state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"], state["gauss"])
