"""Plain-PyTorch reference training of the toy model, to compare hetfair runs against."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from helpers import TOY_PLUGIN
from toy_plugin import Blobs, ToyMLP

SEED = 3
EPOCHS = 2
TRAIN_SIZE = 200  # not a multiple of 32 or 64: the last global batch is partial
LR = 0.5


def reference_parameters(update_size: int, clip_norm: float = 0.0, train_size: int = TRAIN_SIZE,
                         updates: Optional[int] = None, lr: float = LR) -> dict[str, torch.Tensor]:
    """Plain PyTorch: SGD on mean cross-entropy over consecutive chunks of each epoch's order
    (``EPOCHS`` epochs, or the first ``updates`` updates)."""
    torch.manual_seed(SEED)
    model = ToyMLP(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = Blobs(train_size, seed=0)
    done = 0
    for epoch in range(1, EPOCHS + 1):
        order = np.random.default_rng([SEED, epoch]).permutation(train_size)
        for start in range(0, train_size, update_size):
            if updates is not None and done == updates:
                return model.state_dict()
            done += 1
            indices = torch.as_tensor(order[start : start + update_size])
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data.inputs[indices]), data.labels[indices])
            loss.backward()
            if clip_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            optimizer.step()
    return model.state_dict()


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


def toy_train_args(save_dir: Path, update_freq: Optional[int], extra: tuple[str, ...] = ()) -> list[str]:
    """The toy run of the reference; ``update_freq`` ``None`` leaves ``--update-freq`` off the command line."""
    freq = () if update_freq is None else ("--update-freq", str(update_freq))
    return [
        "--user-dir", str(TOY_PLUGIN), "--task", "toy", "--toy-train-size", str(TRAIN_SIZE),
        "--optimizer", "sgd", "--lr", str(LR), "--seed", str(SEED), "--max-epoch", str(EPOCHS),
        *freq, "--save-dir", str(save_dir), "--no-epoch-checkpoints",
        "--log-format", "none", "--disable-validation", "--distributed-timeout", "60", *extra,
    ]
