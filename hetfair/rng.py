"""The process's random generators (Python, numpy, torch CPU and CUDA): seeding and checkpoint state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (model init, dropout before the first update)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class RngState:
    """The global generators as a stateful checkpoint part (tensors and plain data only)."""

    def state_dict(self) -> dict[str, Any]:
        numpy_state = np.random.get_state()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": torch.from_numpy(numpy_state[1].astype(np.int64)),
            "numpy_pos": int(numpy_state[2]),
            "python": random.getstate(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"]))
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
