"""BERT's dynamic masking of one sequence, drawn from a caller-provided generator."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetfair.errors import ConfigError

IGNORE_INDEX = -100  # label of positions that are not predicted (torch's cross-entropy default)


@dataclass(frozen=True)
class MaskingConfig:
    """Which tokens to predict and how to corrupt them.

    ``mask_prob`` of the maskable tokens are chosen (in expectation: the count is
    ``floor(mask_prob * n + u)`` with ``u ~ U[0, 1)``, so short sequences are not
    rounded away); of those, ``random_token_prob`` become a random regular token,
    ``leave_unmasked_prob`` stay as they are and the rest become ``[MASK]``.
    """

    mask_prob: float = 0.15
    random_token_prob: float = 0.1
    leave_unmasked_prob: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.mask_prob <= 1.0:
            raise ConfigError(f"--mask-prob must be in [0, 1], got {self.mask_prob}")
        if min(self.random_token_prob, self.leave_unmasked_prob) < 0 or \
                self.random_token_prob + self.leave_unmasked_prob > 1.0:
            raise ConfigError("--random-token-prob and --leave-unmasked-prob must be >= 0 and sum to at most 1")


def mask_tokens(
    ids: np.ndarray,
    maskable: np.ndarray,
    config: MaskingConfig,
    mask_id: int,
    regular_ids: np.ndarray,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(inputs, labels)``: corrupted ``ids`` and the original id at chosen positions, else -100.

    Only positions where ``maskable`` is true are chosen; random replacements are
    drawn uniformly from ``regular_ids`` (the vocabulary minus special tokens).
    """
    candidates = np.flatnonzero(maskable)
    count = min(int(config.mask_prob * len(candidates) + rng.random()), len(candidates))
    chosen = np.sort(rng.choice(candidates, size=count, replace=False))
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    labels[chosen] = ids[chosen]
    inputs = ids.astype(np.int64, copy=True)
    action = rng.random(count)
    replace = action < config.random_token_prob
    keep = action < config.random_token_prob + config.leave_unmasked_prob
    inputs[chosen[replace]] = rng.choice(regular_ids, size=int(replace.sum()))
    inputs[chosen[~keep]] = mask_id
    return inputs, labels
