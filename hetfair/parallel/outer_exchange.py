"""The outer loop's exchange of pseudo-gradients (``--outer-reduce-dtype``): the sample-weighted mean over the ranks.

- ``fp32`` (the default): each rank's delta pre-scaled by ``n_r * world_size / N``, then
  one flat all-reduce divided by the world size: exactly the arithmetic of torch's
  ``model_averaging.utils.average_parameters`` (so plain DiLoCo is unchanged bit for bit),
  written out because that function cannot run in the background (``--outer-overlap``
  needs the all-reduce's work handle).
- ``bf16``, ``int8``, ``int4``: each rank packs its delta (plus its error-feedback
  residual) into bytes: bf16 values, or int8/int4 values with one fp32 scale per block of
  :data:`BLOCK` values (the block's largest magnitude maps to 127 or 7; int4 two to a
  byte). gloo cannot sum int8, and a sum of quantized values would overflow anyway, so
  the ranks all-gather the packed bytes and every rank decodes and sums them in fp32, in
  rank order, weighted by ``n_r / N``: the weighting is exact, only each rank's own delta
  is rounded, and every rank computes the same sum. What rounding took from a rank's
  delta stays in its residual and is sent with the next round's (error feedback, as
  PowerSGD's), so nothing is lost over rounds, only delayed.

Bytes each rank sends per fragment exchange of ``P`` parameters over ``W`` ranks: fp32
``2 (W-1)/W * 4P`` (ring all-reduce); the packed types ``(W-1) * b P`` with ``b`` = 2 (bf16),
1 + 4/128 (int8) or 0.5 + 4/128 (int4) bytes per parameter (:func:`bytes_sent`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

OUTER_REDUCE_DTYPES = ("fp32", "bf16", "int8", "int4")
BLOCK = 128
"""Values per fp32 scale of the int8 and int4 codes."""
_LEVELS = {"int8": 127, "int4": 7}
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13


def payload_bytes(numel: int, dtype: str) -> int:
    """The bytes one rank's packed delta of ``numel`` values takes in ``dtype`` (4 per value in fp32)."""
    blocks = -(-numel // BLOCK)
    return {"fp32": 4 * numel, "bf16": 2 * numel, "int8": blocks * (4 + BLOCK),
            "int4": blocks * (4 + BLOCK // 2)}[dtype]


def bytes_sent(numel: int, dtype: str, world_size: int) -> float:
    """The bytes each rank sends to exchange a delta of ``numel`` values among ``world_size`` ranks."""
    if dtype == "fp32":
        return 2 * (world_size - 1) / world_size * payload_bytes(numel, dtype)
    return (world_size - 1) * payload_bytes(numel, dtype)


def encode(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """``values`` (flat fp32) packed into bytes (uint8)."""
    if dtype == "bf16":
        return values.to(torch.bfloat16).view(torch.uint8)
    levels = _LEVELS[dtype]
    blocks = torch.nn.functional.pad(values, (0, -values.numel() % BLOCK)).view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / levels
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (blocks / scales[:, None]).round_().clamp_(-levels, levels)
    if dtype == "int8":
        packed = codes.to(torch.int8).view(torch.uint8)
    else:
        nibbles = (codes + 8).to(torch.uint8)
        packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return torch.cat([scales.view(torch.uint8), packed.reshape(-1)])


def decode(payload: torch.Tensor, dtype: str, numel: int) -> torch.Tensor:
    """The fp32 values :func:`encode` packed into ``payload``."""
    if dtype == "bf16":
        return payload.clone().view(torch.bfloat16).float()
    blocks = -(-numel // BLOCK)
    scales = payload[: 4 * blocks].clone().view(torch.float32)
    packed = payload[4 * blocks:].view(blocks, -1)
    if dtype == "int8":
        codes = packed.clone().view(torch.int8).float()
    else:
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(blocks, BLOCK).float() - 8
    return (codes * scales[:, None]).view(-1)[:numel]


@dataclass
class PendingExchange:
    """An exchange under way: :meth:`wait` gives the sample-weighted mean delta, one tensor per input."""

    work: Optional[dist.Work]
    buffer: torch.Tensor
    shapes: list[torch.Size]
    dtype: str
    weights: Sequence[float]
    """Every rank's ``n_r / N`` (lossy types) or the world size (fp32: the all-reduced sum's divisor, applied before)."""

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        numel = sum(shape.numel() for shape in self.shapes)
        if self.dtype == "fp32":
            flat = self.buffer
        else:
            pieces = self.buffer.view(len(self.weights), -1)
            flat = torch.zeros(numel, device=self.buffer.device)
            for weight, piece in zip(self.weights, pieces):
                flat.add_(decode(piece, self.dtype, numel), alpha=weight)
        return [piece.view(shape) for piece, shape in zip(flat.split([s.numel() for s in self.shapes]), self.shapes)]


class OuterExchange:
    """One fragment's exchange in ``dtype`` over ``group``, with this rank's error-feedback residual (lossy types)."""

    def __init__(self, dtype: str, numel: int, device: torch.device, group: Optional[dist.ProcessGroup],
                 world_size: int) -> None:
        self.dtype = dtype
        self.group = group
        """The ranks' group (``None``: the default one)."""
        self.world_size = world_size
        self.residual = torch.zeros(numel if dtype != "fp32" else 0, device=device)
        """What rounding has taken from this rank's deltas so far and not yet sent (flat fp32; empty in fp32)."""

    @torch.no_grad()
    def start(self, deltas: list[torch.Tensor], rank_samples: Sequence[float], rank: int,
              background: bool) -> PendingExchange:
        """Begin exchanging this rank's ``deltas`` (unweighted; ``rank_samples``: every rank's samples since the
        fragment last met); in ``background``, :meth:`PendingExchange.wait` waits for it, else it is done."""
        total = sum(rank_samples)
        shapes = [delta.shape for delta in deltas]
        if self.dtype == "fp32":
            weight = rank_samples[rank] * self.world_size / total if total else 0.0
            torch._foreach_mul_(deltas, weight)
            flat = torch.cat([delta.reshape(-1) for delta in deltas])
            flat.div_(self.world_size)
            work = dist.all_reduce(flat, group=self.group, async_op=True) if self.world_size > 1 else None
            pending = PendingExchange(work, flat, shapes, self.dtype, [])
        else:
            values = torch.cat([delta.reshape(-1).float() for delta in deltas]).add_(self.residual)
            payload = encode(values, self.dtype)
            self.residual = values.sub_(decode(payload, self.dtype, values.numel()))
            if self.world_size == 1:
                gathered, work = payload, None
            else:
                gathered = payload.new_empty(self.world_size * payload.numel())
                work = _all_gather_single(gathered, payload, group=self.group, async_op=True)
            weights = [samples / total if total else 0.0 for samples in rank_samples]
            pending = PendingExchange(work, gathered, shapes, self.dtype, weights)
        if not background and pending.work is not None:
            pending.work.wait()
            pending.work = None
        return pending
