"""Hand a live run's in-memory state from one rank to the others without unpickling anything a peer sent.

The donor writes the state as a checkpoint would be written (``torch.save``, tensors and plain data) into a
byte tensor; the receivers read it with ``torch.load(weights_only=True)``, the loader of every checkpoint,
which builds tensors and containers of numbers and strings and refuses any other object. So a member that
is not what it claims (the job's rounds are signed, see :mod:`hetfair.live.records`, but the group's gloo
connections are not) can send wrong numbers, never code.
"""

from __future__ import annotations

import io
from typing import Any, Optional

import torch
import torch.distributed as dist

from hetfair.errors import DistributedError, first_line


def encode_state(state: dict[str, Any]) -> torch.Tensor:
    """``state`` as the bytes of a ``torch.save`` archive, in a uint8 tensor."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def decode_state(payload: torch.Tensor, sender: int) -> dict[str, Any]:
    """The state in ``payload``, loaded with ``weights_only=True``; anything else is one error line."""
    try:
        state = torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError or others for a foreign payload
        raise DistributedError(f"the state rank {sender} sent is not a hetfair run's state ({first_line(exc)}); "
                               f"every process of a live job must run the same hetfair") from exc
    if not isinstance(state, dict):
        raise DistributedError(f"the state rank {sender} sent is not a hetfair run's state (a {type(state).__name__})")
    return state


def broadcast_state(state: Optional[dict[str, Any]], donor: int, rank: int, device: torch.device) -> dict[str, Any]:
    """``donor``'s ``state`` on every rank (its size, then its bytes: two broadcasts)."""
    payload = encode_state(state).to(device) if rank == donor and state is not None else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=donor)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=donor)
    return state if rank == donor and state is not None else decode_state(payload, donor)
