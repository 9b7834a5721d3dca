"""Whether a schedule's ``--total-num-update`` matches the updates the run will make.

A decaying schedule (``polynomial_decay``, ``cosine``) reaches its end learning rate at
``--total-num-update``; a run that stops well before it leaves the rate near its peak, one that
goes on past it trains the rest at the end rate. Both are silent unless said at start-up.
"""

from __future__ import annotations

import math
from typing import Optional

TOLERANCE = 0.1
"""``--total-num-update`` may differ from the run's updates by this fraction without a warning."""


def run_updates(max_update: int, max_epoch: int, samples: int, update_size: int) -> Optional[int]:
    """The updates a run from the start makes: ``--max-update``, or ``--max-epoch`` epochs of
    ``ceil(samples / update_size)`` updates, whichever ends it first (``None``: neither bounds it)."""
    bounds = [max_update] if max_update else []
    if max_epoch:
        bounds.append(max_epoch * math.ceil(samples / update_size))
    return min(bounds) if bounds else None


def schedule_length_warning(total_num_update: int, max_update: int, max_epoch: int, samples: int,
                            update_size: int) -> Optional[str]:
    """One line when ``total_num_update`` (0: not given) and the run's updates differ by more than
    :data:`TOLERANCE`, else ``None``."""
    updates = run_updates(max_update, max_epoch, samples, update_size)
    if not total_num_update or updates is None or abs(total_num_update - updates) <= TOLERANCE * updates:
        return None
    per_epoch = math.ceil(samples / update_size)
    how = f"--max-update {max_update}" if updates == max_update else \
        f"--max-epoch {max_epoch} x {per_epoch} updates an epoch (ceil({samples} samples / {update_size} an update))"
    effect = "the learning rate stops short of its end value" if total_num_update > updates else \
        f"the last {updates - total_num_update} updates train at the end learning rate"
    return (f"--total-num-update {total_num_update} but this run makes {updates} updates ({how}): {effect}; "
            f"give --total-num-update {updates}")
