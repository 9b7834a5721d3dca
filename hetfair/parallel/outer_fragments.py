"""``--outer-fragments K``: the outer loop's model split into K fragments of about equal bytes, synchronised in turn.

Streaming DiLoCo (Douillard et al., 2025): instead of one outer all-reduce of the whole
model every H inner updates, fragment ``k`` meets every H updates at its own offset, so
the link carries ``1/K`` of the model about every ``H/K`` updates and never the whole of it
at once. Fragments are contiguous runs of the model's parameters in order; a sharding
unit (a BERT or GPT layer, a plugin's declared unit) is never cut, and a model without
units splits between its parameter tensors (so the MNIST models split too).
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from hetfair.errors import ConfigError


def split_fragments(params: Sequence[nn.Parameter], units: Sequence[nn.Module], count: int) -> list[list[int]]:
    """The indices into ``params`` of each of ``count`` fragments: contiguous, about equal in bytes, no unit cut."""
    unit_of = {id(param): index for index, unit in enumerate(units) for param in unit.parameters()}
    groups: list[list[int]] = []
    for index, param in enumerate(params):
        unit = unit_of.get(id(param))
        if groups and unit is not None and unit_of.get(id(params[groups[-1][-1]])) == unit:
            groups[-1].append(index)
        else:
            groups.append([index])
    if count > len(groups):
        raise ConfigError(f"--outer-fragments {count}: the model splits into at most {len(groups)} fragments (its "
                          f"sharding units, else its parameter tensors); give --outer-fragments {len(groups)} or fewer")
    sizes = [sum(params[i].numel() * params[i].element_size() for i in group) for group in groups]
    total, fragments, filled = sum(sizes), [], 0
    for index, (group, size) in enumerate(zip(groups, sizes)):
        needed = count - len(fragments)
        share_reached = filled >= total * len(fragments) / count
        if not fragments or (needed > 0 and (share_reached or len(groups) - index == needed)):
            fragments.append([])
        fragments[-1].extend(group)
        filled += size
    return fragments


def sync_offsets(interval: int, count: int) -> list[int]:
    """The inner update of each round (1 to ``interval``) after which each fragment meets: evenly spread, the
    last fragment at the round's end (so one fragment meets after update ``interval``, as plain DiLoCo does)."""
    return [(index + 1) * interval // count for index in range(count)]
